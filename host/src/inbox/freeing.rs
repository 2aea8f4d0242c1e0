//! The events held behind a released dead letter, freed a part at a time.
//!
//! A release (a retry, a discard) frees the first 1,000 events held behind its letter in its
//! own statement, and names the key in `obx.inbox_key_freeing` while it may hold more
//! (migration 0034). The inbox processors free the rest, [`PART`] at a time, each part in a
//! short transaction of its own on the plugin's session, before they claim: again at once
//! while a named key is found, otherwise at most once per [`EVERY`] for each consumer. The
//! key's order holds meanwhile: its head is its first unprocessed event, held or not.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::Row;

use crate::db::sessions::Sessions;

/// The most events one transaction frees (about 0.2 s of Postgres's time here).
pub const PART: i32 = 10_000;
/// How often a processor looks for named keys of a consumer when it found none.
const EVERY: Duration = Duration::from_secs(1);
/// How long it waits after a look failed.
const AFTER_FAILURE: Duration = Duration::from_secs(30);

/// When each consumer's named keys are next looked for.
#[derive(Default)]
pub struct Freeing {
    next: Mutex<HashMap<String, Instant>>,
}

impl Freeing {
    /// Frees a part of one of `consumer`'s named keys, if it is time to look. A failure is
    /// logged and looked at again later: it must not hold up the consumer's claims.
    pub async fn run(&self, sessions: &Sessions, consumer: &str) {
        if self.lock().get(consumer).is_some_and(|next| Instant::now() < *next) {
            return;
        }
        let wait = match free_part(sessions, consumer).await {
            Ok(Some(_)) => Duration::ZERO,
            Ok(None) => EVERY,
            Err(e) => {
                tracing::warn!(plugin = consumer, error = %e,
                    "freeing the events behind a released dead letter failed; trying again later");
                AFTER_FAILURE
            }
        };
        self.lock().insert(consumer.to_string(), Instant::now() + wait);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.next.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Frees up to [`PART`] events of one named key of `consumer`'s: how many, or `None` if no
/// key was named that another session was not freeing.
async fn free_part(sessions: &Sessions, consumer: &str) -> anyhow::Result<Option<i32>> {
    let (tx, rows) = sessions
        .begin_then(consumer, &format!("SELECT obx_api.inbox_free_held({PART})"))
        .await?;
    let freed: i32 = match rows.first() {
        Some(row) => row.try_get(0)?,
        None => anyhow::bail!("obx_api.inbox_free_held returned no row"),
    };
    tx.commit().await?;
    Ok((freed >= 0).then_some(freed))
}
