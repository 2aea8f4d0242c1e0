//! The events held behind a released dead letter, freed a part at a time.
//!
//! A release (a retry, a discard) frees the first 1,000 events held behind its letter in its
//! own statement, and names the key in `obx.inbox_key_freeing` while it may hold more
//! (migration 0034). The inbox processors free the rest, up to [`PART`] at a time, each part
//! in a short transaction of its own on the plugin's session, before they claim: again at once
//! while a named key is found, otherwise at most once per [`EVERY`] for each consumer, on one
//! schedule for all of a host's processors. The key's order holds meanwhile: its head is its
//! first unprocessed event, held or not.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::Row;

use crate::db::sessions::Sessions;

/// The most events one transaction frees (about 0.2 s of Postgres's time here).
const PART: i32 = 10_000;
/// The fewest: a part that fails (past `limits.statement_timeout` on a slow database) is
/// tried again a quarter the size, down to this, and parts grow again to half the smallest
/// that failed at most.
const LEAST_PART: i32 = 100;
/// How often a processor looks for named keys of a consumer when it found none.
const EVERY: Duration = Duration::from_secs(1);
/// How long it waits after a part of the least size failed.
const AFTER_FAILURE: Duration = Duration::from_secs(30);

/// When each consumer's named keys are next looked for, and how many events a part frees.
#[derive(Default)]
pub struct Freeing {
    next: Mutex<HashMap<String, Schedule>>,
}

#[derive(Clone, Copy)]
struct Schedule {
    next: Instant,
    part: i32,
    /// The smallest part that failed: later parts grow to half of it at most, so that a part
    /// that did not fit is not tried again and again.
    failed: i32,
}

impl Schedule {
    fn new() -> Schedule {
        Schedule {
            next: Instant::now(),
            part: PART,
            failed: i32::MAX,
        }
    }

    /// After a part: `Ok(Some(freed))`, `Ok(None)` if no key was named, or a failure.
    fn after(self, outcome: &anyhow::Result<Option<i32>>) -> (Schedule, Duration) {
        let mut next = self;
        let wait = match outcome {
            // A whole part: the key may hold more, and the next part may be larger.
            Ok(Some(freed)) if *freed >= self.part => {
                next.part = self
                    .part
                    .saturating_mul(2)
                    .min(PART)
                    .min(self.failed / 2)
                    .max(LEAST_PART);
                Duration::ZERO
            }
            Ok(Some(_)) => Duration::ZERO,
            Ok(None) => EVERY,
            Err(_) => {
                next.failed = self.failed.min(self.part);
                next.part = (self.part / 4).max(LEAST_PART);
                if self.part > LEAST_PART {
                    EVERY
                } else {
                    AFTER_FAILURE
                }
            }
        };
        next.next = Instant::now() + wait;
        (next, wait)
    }
}

impl Freeing {
    /// Frees a part of one of `consumer`'s named keys, if it is time to look. A failure is
    /// logged and looked at again later, with a smaller part: it must not hold up the
    /// consumer's claims, nor a key for ever.
    pub async fn run(&self, sessions: &Sessions, consumer: &str) {
        let schedule = self.lock().get(consumer).copied().unwrap_or_else(Schedule::new);
        if Instant::now() < schedule.next {
            return;
        }
        let outcome = free_part(sessions, consumer, schedule.part).await;
        let (next, wait) = schedule.after(&outcome);
        if let Err(e) = &outcome {
            tracing::warn!(plugin = consumer, error = %e, part = schedule.part, retry_in = ?wait,
                "freeing the events behind a released dead letter failed");
        }
        self.lock().insert(consumer.to_string(), next);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Schedule>> {
        self.next.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Frees up to `part` events of one named key of `consumer`'s: how many, or `None` if no
/// key was named that another session was not freeing.
async fn free_part(sessions: &Sessions, consumer: &str, part: i32) -> anyhow::Result<Option<i32>> {
    let (tx, rows) = sessions
        .begin_then(consumer, &format!("SELECT obx_api.inbox_free_held({part})"))
        .await?;
    let freed: i32 = match rows.first() {
        Some(row) => row.try_get(0)?,
        None => anyhow::bail!("obx_api.inbox_free_held returned no row"),
    };
    tx.commit().await?;
    Ok((freed >= 0).then_some(freed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(outcomes: &[anyhow::Result<Option<i32>>]) -> Vec<i32> {
        let mut schedule = Schedule::new();
        outcomes
            .iter()
            .map(|o| {
                schedule = schedule.after(o).0;
                schedule.part
            })
            .collect()
    }

    #[test]
    fn a_part_that_failed_is_not_grown_back_to() {
        let failed = || Err(anyhow::anyhow!("canceling statement due to statement timeout"));
        let whole = |n| Ok(Some(n));
        assert_eq!(
            parts(&[failed(), whole(2_500), whole(5_000), whole(5_000)]),
            [2_500, 5_000, 5_000, 5_000],
            "10,000 failed: up to 5,000"
        );
        assert_eq!(
            parts(&[failed(), failed(), failed(), failed(), failed(), whole(100), whole(200)]),
            [2_500, 625, 156, 100, 100, 100, 100],
            "100 failed: stays at 100"
        );
        assert_eq!(parts(&[whole(10_000), Ok(Some(3)), Ok(None)]), [10_000; 3]);
    }
}
