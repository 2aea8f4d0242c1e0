//! The events held behind a released dead letter, freed a part at a time.
//!
//! A release (a retry, a discard) frees the first 1,000 events held behind its letter in its
//! own statement, and names the key in `obx.inbox_key_freeing` while it may hold more
//! (migration 0034). The inbox processors free the rest, up to [`PART`] at a time, each part
//! in a short transaction of its own on the plugin's session, before they claim: again at once
//! while a named key is found, otherwise at most once per [`EVERY`] for each consumer. The
//! key's order holds meanwhile: its head is its first unprocessed event, held or not.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::Row;

use crate::db::sessions::Sessions;

/// The most events one transaction frees (about 0.2 s of Postgres's time here).
pub const PART: i32 = 10_000;
/// The fewest: a part that fails (past `limits.statement_timeout` on a slow database) is
/// tried again a quarter the size, down to this.
const LEAST_PART: i32 = 100;
/// How often a processor looks for named keys of a consumer when it found none.
const EVERY: Duration = Duration::from_secs(1);
/// How long it waits after a part of the least size failed.
const AFTER_FAILURE: Duration = Duration::from_secs(30);

/// When each consumer's named keys are next looked for, and how many events a part frees.
#[derive(Default)]
pub struct Freeing {
    next: Mutex<HashMap<String, (Instant, i32)>>,
}

impl Freeing {
    /// Frees a part of one of `consumer`'s named keys, if it is time to look. A failure is
    /// logged and looked at again later, with a smaller part: it must not hold up the
    /// consumer's claims, nor a key for ever.
    pub async fn run(&self, sessions: &Sessions, consumer: &str) {
        let (next, part) = self.lock().get(consumer).copied().unwrap_or((Instant::now(), PART));
        if Instant::now() < next {
            return;
        }
        let (wait, part) = match free_part(sessions, consumer, part).await {
            // A whole part: the key may hold more, and the next part may be larger.
            Ok(Some(freed)) if freed >= part => (Duration::ZERO, part.saturating_mul(2).min(PART)),
            Ok(Some(_)) => (Duration::ZERO, part),
            Ok(None) => (EVERY, part),
            Err(e) => {
                let wait = if part > LEAST_PART { EVERY } else { AFTER_FAILURE };
                tracing::warn!(plugin = consumer, error = %e, part, retry_in = ?wait,
                    "freeing the events behind a released dead letter failed");
                (wait, (part / 4).max(LEAST_PART))
            }
        };
        self.lock().insert(consumer.to_string(), (Instant::now() + wait, part));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, i32)>> {
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
