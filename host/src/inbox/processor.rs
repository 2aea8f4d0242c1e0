//! Inbox processors. Each step takes one transaction, on a session of the plugin's own
//! role (the inbox bookkeeping goes through `obx_api`), that
//!
//! 1. claims the next inbox event that may run — unprocessed, not parked, not waiting for a
//!    retry, and the oldest unprocessed event of its key on its topic — with
//!    `FOR UPDATE SKIP LOCKED`;
//! 2. runs the plugin's handler on it, inside that transaction, which holds the row lock
//!    throughout (the seed's sample takes the lock outside any transaction: not here);
//! 3. marks it processed (`processed`, `processed_at`) and records it in `processed_event`;
//! 4. commits.
//!
//! Any number of processors, on any number of hosts, can run at once: the row lock keeps
//! two of them off one event, and "oldest of its key" keeps a key's events in order.
//! A failed handler rolls back; the event is retried with backoff, and after
//! `consumer.max_attempts` it is parked with a dead letter, holding its key.

use std::sync::Arc;

use futures::FutureExt as _;
use sqlx::Row;
use tokio::sync::watch;
use uuid::Uuid;

use super::backoff;
use crate::config::ConsumerConfig;
use crate::dispatch::Dispatcher;
use crate::runtime::bindings::guest;
use crate::runtime::registry::Registry;

pub struct Processor {
    pub turn: std::sync::atomic::AtomicUsize,
    pub dispatcher: Arc<Dispatcher>,
    pub registry: Arc<Registry>,
    pub config: ConsumerConfig,
    pub wake: watch::Receiver<u64>,
    pub shutdown: watch::Receiver<bool>,
}

/// What one step did.
enum Outcome {
    /// Processed, or settled a failure: look for more at once.
    Worked,
    /// Nothing may run now.
    Idle,
}

struct Claimed {
    event_id: Uuid,
    attempts: i32,
    event: guest::Event,
}

impl Processor {
    pub async fn run(mut self) {
        loop {
            if *self.shutdown.borrow() {
                return;
            }
            // A bug must not stop every plugin's inbox: a step that panics is logged and
            // retried after a pause, like one that failed.
            let step = std::panic::AssertUnwindSafe(self.step()).catch_unwind().await;
            let step = step.unwrap_or_else(|_| Err(anyhow::anyhow!("the step panicked")));
            let pause = match step {
                Ok(Outcome::Worked) => continue,
                Ok(Outcome::Idle) => self.config.inbox_poll_interval,
                Err(e) => {
                    tracing::warn!(error = %e, "inbox processor step failed");
                    self.config.backoff_max
                }
            };
            tokio::select! {
                _ = self.wake.changed() => {}
                _ = tokio::time::sleep(pause) => {}
                _ = self.shutdown.changed() => return,
            }
        }
    }

    async fn step(&self) -> anyhow::Result<Outcome> {
        let mut consumers: Vec<String> = self
            .registry
            .plugins()
            .iter()
            .map(|p| p.manifest.name.clone())
            .collect();
        if consumers.is_empty() {
            return Ok(Outcome::Idle);
        }
        // Start from a different consumer each time, so that a busy one cannot starve the rest.
        let turn = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % consumers.len();
        consumers.rotate_left(turn);
        for consumer in consumers {
            if let Outcome::Worked = self.step_for(&consumer).await? {
                return Ok(Outcome::Worked);
            }
        }
        Ok(Outcome::Idle)
    }

    /// One event of `consumer`, in one transaction on the plugin's own session.
    async fn step_for(&self, consumer: &str) -> anyhow::Result<Outcome> {
        let Some(plugin) = self.registry.get(consumer) else {
            return Ok(Outcome::Idle);
        };
        let mut tx = self.dispatcher.sessions.begin(consumer).await?;
        let Some(claimed) = claim(&mut tx).await? else {
            tx.rollback().await?;
            return Ok(Outcome::Idle);
        };

        // Everything from here on can be undone, while the row stays locked: a failed
        // handler's attempt is recorded before any other processor can take the row.
        sqlx::query("SAVEPOINT obx_event").execute(&mut *tx).await?;
        // Marked processed (and in processed_event, so that a dedup-mode redelivery is a
        // no-op) before the handler runs, in the same transaction: a failure undoes it.
        let fresh: bool = sqlx::query_scalar("SELECT obx_api.inbox_take($1)")
            .bind(claimed.event_id)
            .fetch_one(&mut *tx)
            .await?;
        if !fresh {
            tx.commit().await?;
            return Ok(Outcome::Worked);
        }
        let parent = claimed
            .event
            .headers
            .iter()
            .find(|(k, _)| k == "traceparent")
            .and_then(|(_, v)| crate::trace::TraceContext::parse(v));
        match self
            .dispatcher
            .run_event(&plugin, tx, claimed.event.clone(), parent.as_ref())
            .await
        {
            Ok((tx, emitted)) => {
                self.dispatcher.commit_event(tx, emitted).await?;
                metrics::counter!("obx_inbox_processed_total", "plugin" => consumer.to_string()).increment(1);
            }
            Err(failure) => self.settle_failure(consumer, &claimed, failure).await?,
        }
        Ok(Outcome::Worked)
    }

    /// Records a failed attempt, under the row lock the claim took: a retry after a backoff,
    /// or, past `consumer.max_attempts` or for a failure no retry can help, a dead letter.
    async fn settle_failure(
        &self,
        consumer: &str,
        claimed: &Claimed,
        failure: crate::dispatch::EventFailure,
    ) -> anyhow::Result<()> {
        let attempts = claimed.attempts as u32 + 1;
        tracing::warn!(consumer, event_id = %claimed.event_id, attempts,
            error = %failure.error, "inbox event handler failed");
        let mut tx = match failure.tx {
            // The transaction is gone, and the row lock with it: the next claim retries.
            None => return Ok(()),
            // The session was abandoned mid-result: record the attempt on a fresh one, so
            // that the event is parked in the end like any other.
            Some(tx) if tx.is_poisoned() => {
                tx.abandon();
                self.dispatcher.sessions.begin(consumer).await?
            }
            Some(mut tx) => {
                sqlx::query("ROLLBACK TO SAVEPOINT obx_event").execute(&mut *tx).await?;
                tx
            }
        };
        let park = !failure.retriable || attempts >= self.config.max_attempts;
        let delay = backoff(self.config.backoff_initial, self.config.backoff_max, attempts);
        sqlx::query("SELECT obx_api.inbox_fail($1, $2, $3, $4, $5)")
            .bind(claimed.event_id)
            .bind(attempts as i32)
            .bind(&failure.error)
            .bind(park)
            .bind(delay.as_secs_f64())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        if park {
            metrics::counter!("obx_dead_letters_total", "plugin" => consumer.to_string()).increment(1);
            tracing::error!(consumer, event_id = %claimed.event_id, attempts,
                "event parked in the dead-letter table");
        }
        Ok(())
    }
}

/// Claims the plugin's next event that may run, locking its row for the transaction.
async fn claim(conn: &mut sqlx::PgConnection) -> sqlx::Result<Option<Claimed>> {
    let row = sqlx::query(
        "SELECT event_id, topic, payload, event_type, partition_key, headers, attempts FROM obx_api.inbox_claim()",
    )
    .fetch_optional(conn)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    // try_get everywhere: the row comes from the plugin's own session.
    let headers: serde_json::Map<String, serde_json::Value> =
        serde_json::from_value(row.try_get("headers")?).unwrap_or_default();
    let attempts = row.try_get::<i32, _>("attempts")?.max(0);
    let event_id: Uuid = row.try_get("event_id")?;
    Ok(Some(Claimed {
        event_id,
        attempts,
        event: guest::Event {
            event_id: event_id.to_string(),
            event_type: row.try_get("event_type")?,
            topic: row.try_get("topic")?,
            key: row.try_get("partition_key")?,
            payload: row.try_get("payload")?,
            headers: headers
                .into_iter()
                .filter_map(|(k, v)| Some((k, v.as_str()?.to_string())))
                .collect(),
            attempt: attempts as u32 + 1,
        },
    }))
}
