//! Inbox processors. Each step takes one transaction that
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
    consumer: String,
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
            let pause = match self.step().await {
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

    async fn step(&self) -> sqlx::Result<Outcome> {
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

    async fn step_for(&self, consumer: &str) -> sqlx::Result<Outcome> {
        let pool = &self.dispatcher.pool;
        // The walk must follow (consumer, seq) and stop at the first event that may run; with
        // stale statistics after a burst the planner may prefer to sort the whole inbox.
        let mut tx = pool
            .begin_with(
                "BEGIN; SELECT set_config('enable_sort', 'off', true), set_config('enable_bitmapscan', 'off', true)",
            )
            .await?;
        let row = sqlx::query(
            "SELECT e.consumer, e.event_id, e.topic, e.payload::text AS payload, e.event_type, e.partition_key, \
                    e.headers, e.attempts \
             FROM obx.inbox_event e \
             WHERE e.consumer = $1 AND NOT e.processed AND NOT e.parked \
               AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now()) \
               AND (e.partition_key IS NULL OR e.seq = ( \
                    SELECT min(p.seq) FROM obx.inbox_event p \
                    WHERE p.consumer = e.consumer AND p.topic = e.topic AND p.partition_key = e.partition_key \
                      AND NOT p.processed)) \
             ORDER BY e.seq \
             LIMIT 1 \
             FOR UPDATE OF e SKIP LOCKED",
        )
        .bind(consumer)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            tx.commit().await?;
            return Ok(Outcome::Idle);
        };
        let headers: serde_json::Map<String, serde_json::Value> =
            serde_json::from_value(row.get("headers")).unwrap_or_default();
        let attempts: i32 = row.get("attempts");
        let claimed = Claimed {
            consumer: row.get("consumer"),
            event_id: row.get("event_id"),
            attempts,
            event: guest::Event {
                event_id: row.get::<Uuid, _>("event_id").to_string(),
                event_type: row.get("event_type"),
                topic: row.get("topic"),
                key: row.get("partition_key"),
                payload: row.get("payload"),
                headers: headers
                    .into_iter()
                    .filter_map(|(k, v)| Some((k, v.as_str()?.to_string())))
                    .collect(),
                attempt: attempts as u32 + 1,
            },
        };
        let Some(plugin) = self.registry.get(&claimed.consumer) else {
            tx.commit().await?;
            return Ok(Outcome::Idle);
        };

        // Everything from here on can be undone, while the row stays locked: a failed
        // handler's attempt is recorded before any other processor can take the row.
        sqlx::query("SAVEPOINT obx_event").execute(&mut *tx).await?;
        // processed_event too, so that a dedup-mode redelivery of this event is a no-op.
        let fresh =
            sqlx::query("INSERT INTO obx.processed_event (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                .bind(&claimed.consumer)
                .bind(claimed.event_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        // Marked before the handler runs, in the same transaction: a failure undoes it.
        mark_processed(&mut tx, &claimed).await?;
        if fresh == 0 {
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
                metrics::counter!("obx_inbox_processed_total", "plugin" => claimed.consumer.clone()).increment(1);
            }
            Err(failure) => {
                let attempts = claimed.attempts as u32 + 1;
                tracing::warn!(consumer = %claimed.consumer, event_id = %claimed.event_id, attempts,
                    error = %failure.error, "inbox event handler failed");
                let Some(mut tx) = failure.tx else {
                    // The transaction is gone, and the row lock with it: the next claim retries.
                    return Ok(Outcome::Worked);
                };
                sqlx::query("ROLLBACK TO SAVEPOINT obx_event").execute(&mut *tx).await?;
                sqlx::query(crate::dispatch::RESET_TO_HOST).execute(&mut *tx).await?;
                if !failure.retriable || attempts >= self.config.max_attempts {
                    sqlx::query(
                        "UPDATE obx.inbox_event SET attempts = $3, last_error = $4, parked = true \
                         WHERE consumer = $1 AND event_id = $2",
                    )
                    .bind(&claimed.consumer)
                    .bind(claimed.event_id)
                    .bind(attempts as i32)
                    .bind(&failure.error)
                    .execute(&mut *tx)
                    .await?;
                    let e = &claimed.event;
                    super::dlq::record(
                        &mut tx,
                        &claimed.consumer,
                        claimed.event_id,
                        &e.topic,
                        e.key.as_deref(),
                        &e.event_type,
                        &failure.error,
                        attempts,
                    )
                    .await?;
                    tracing::error!(consumer = %claimed.consumer, event_id = %claimed.event_id, attempts,
                        "event parked in the dead-letter table");
                } else {
                    let delay = backoff(self.config.backoff_initial, self.config.backoff_max, attempts);
                    sqlx::query(
                        "UPDATE obx.inbox_event SET attempts = $3, last_error = $4, \
                                next_attempt_at = now() + make_interval(secs => $5) \
                         WHERE consumer = $1 AND event_id = $2",
                    )
                    .bind(&claimed.consumer)
                    .bind(claimed.event_id)
                    .bind(attempts as i32)
                    .bind(&failure.error)
                    .bind(delay.as_secs_f64())
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
            }
        }
        Ok(Outcome::Worked)
    }
}

async fn mark_processed(conn: &mut sqlx::PgConnection, claimed: &Claimed) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE obx.inbox_event SET processed = true, processed_at = now() WHERE consumer = $1 AND event_id = $2",
    )
    .bind(&claimed.consumer)
    .bind(claimed.event_id)
    .execute(conn)
    .await?;
    Ok(())
}
