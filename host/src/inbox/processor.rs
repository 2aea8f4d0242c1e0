//! Inbox processors. Each step takes one transaction, on a session of the plugin's own
//! role (the inbox bookkeeping goes through `obx_api`), that
//!
//! 1. claims the next inbox event that may run — unprocessed, not parked, not waiting for a
//!    retry, and the oldest unprocessed event of its key on its topic — with
//!    `FOR UPDATE SKIP LOCKED`, and the unprocessed events of its key after it, up to
//!    `consumer.batch_max_events`, and in the same statement marks them processed
//!    (`processed`, `processed_at`, `processed_event`);
//! 2. runs the plugin's handler on each in order inside that transaction, which holds the
//!    row locks throughout (the seed's sample takes the lock outside any transaction: not
//!    here);
//! 3. writes the events' outbox rows and commits.
//!
//! Any number of processors, on any number of hosts, can run at once: the row lock keeps
//! two of them off one event, and "oldest of its key" keeps a key's events in order (a batch
//! holds its key's oldest event, so nobody else can start on that key). A batch of several
//! events runs first with no savepoint between them (each costs a round trip and a Postgres
//! subtransaction, and handlers fail rarely); if a handler fails, the whole batch is rolled
//! back, nothing of that run counts, and the processor takes a batch again with a savepoint
//! per event. There, a failed handler is rolled back to its savepoint, its event is marked
//! unprocessed with its attempt recorded, and the events behind it are marked unprocessed
//! again, under the row locks, in the same transaction; the events before it commit. The
//! event is retried with backoff, and after `consumer.max_attempts` it is parked with a dead
//! letter, holding its key.

use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt as _;
use sqlx::Row;
use tokio::sync::watch;
use uuid::Uuid;

use super::backoff;
use super::handling::{self, Deferred, EventFields, Failure, Job, Ran, Undo};
use crate::config::ConsumerConfig;
use crate::db::sessions::PluginTx;
use crate::dispatch::Dispatcher;
use crate::runtime::registry::Registry;

pub struct Processor {
    pub turn: std::sync::atomic::AtomicUsize,
    pub dispatcher: Arc<Dispatcher>,
    pub registry: Arc<Registry>,
    pub config: ConsumerConfig,
    pub wake: watch::Receiver<u64>,
    pub shutdown: watch::Receiver<bool>,
    /// Consumers whose batch commit was refused for something a handler did, or lost a race
    /// at its `COMMIT` (see [`handling::refused_commit`]), with how many more events each
    /// takes one at a time (`consumer.batch_max_events`, as many as the refused batch could
    /// hold), so that the refusal names its event, which is retried and parked in the end.
    pub one_at_a_time: std::sync::Mutex<std::collections::HashMap<String, u32>>,
    /// Consumers whose steps failed (their session cannot be opened, a statement failed):
    /// how many times in a row, and when to try again. Each waits out its own backoff,
    /// while the others' events go on.
    pub failing: std::sync::Mutex<std::collections::HashMap<String, (u32, Instant)>>,
    /// When each consumer's keys named for freeing are next looked at (see
    /// [`super::Freeing`]): one schedule for all of a host's processors.
    pub freeing: Arc<super::Freeing>,
}

/// What one step did.
enum Outcome {
    /// Processed, or settled a failure: look for more at once.
    Worked,
    /// Nothing may run now.
    Idle,
    /// A handler failed in a batch without savepoints, and the batch was rolled back: take
    /// one again, with a savepoint per event.
    Undone,
}

struct Claimed {
    attempts: i32,
    job: Job,
    /// Not in processed_event before this claim.
    fresh: bool,
}

impl Processor {
    pub async fn run(mut self) {
        loop {
            if *self.shutdown.borrow() {
                return;
            }
            let pause = match self.step().await {
                Outcome::Worked | Outcome::Undone => continue,
                Outcome::Idle => self.config.inbox_poll_interval,
            };
            tokio::select! {
                _ = self.wake.changed() => {}
                _ = tokio::time::sleep(pause) => {}
                _ = self.shutdown.changed() => return,
            }
        }
    }

    /// One batch of the first consumer, in turn, that has an event to run. A consumer whose
    /// step fails waits out a backoff of its own; the others go on.
    async fn step(&self) -> Outcome {
        let mut consumers: Vec<String> = self
            .registry
            .plugins()
            .iter()
            .map(|p| p.manifest.name.clone())
            .collect();
        if consumers.is_empty() {
            return Outcome::Idle;
        }
        // Start from a different consumer each time, so that a busy one cannot starve the rest.
        let turn = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % consumers.len();
        consumers.rotate_left(turn);
        for consumer in consumers {
            if self.backing_off(&consumer) {
                continue;
            }
            // A bug must not stop every plugin's inbox: a step that panics is logged and
            // retried after a pause, like one that failed.
            let step = std::panic::AssertUnwindSafe(self.step_for(&consumer))
                .catch_unwind()
                .await;
            match step.unwrap_or_else(|_| Err(anyhow::anyhow!("the step panicked"))) {
                Ok(outcome) => {
                    self.lock_failing().remove(&consumer);
                    if let Outcome::Worked = outcome {
                        return Outcome::Worked;
                    }
                }
                Err(e) => self.failed(&consumer, &e),
            }
        }
        Outcome::Idle
    }

    fn lock_failing(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, (u32, Instant)>> {
        self.failing.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn backing_off(&self, consumer: &str) -> bool {
        self.lock_failing()
            .get(consumer)
            .is_some_and(|(_, until)| Instant::now() < *until)
    }

    fn failed(&self, consumer: &str, e: &anyhow::Error) {
        let mut failing = self.lock_failing();
        let failures = failing.get(consumer).map_or(1, |(n, _)| n + 1);
        let wait = backoff(self.config.backoff_initial, self.config.backoff_max, failures);
        tracing::warn!(plugin = consumer, error = %e, retry_in = ?wait, "inbox processor step failed");
        failing.insert(consumer.to_string(), (failures, Instant::now() + wait));
    }

    /// Events of one key of `consumer`, up to `consumer.batch_max_events`, in one
    /// transaction on the plugin's own session: first with no savepoints, and if a handler
    /// fails, again with a savepoint per event (see the module's documentation). Before
    /// that, now and then, a part of the events held behind a released dead letter is freed.
    async fn step_for(&self, consumer: &str) -> anyhow::Result<Outcome> {
        self.freeing.run(&self.dispatcher.sessions, consumer).await;
        match self.take(consumer, Undo::Transaction).await? {
            Outcome::Undone => self.take(consumer, Undo::Event).await,
            done => Ok(done),
        }
    }

    /// One batch of `consumer`'s events, in one transaction. A batch of one event, or any
    /// batch with [`Undo::Event`], runs each event behind a savepoint: the first whose
    /// handler fails is rolled back to it, its attempt is recorded under its row lock, the
    /// events behind it go back to wait, and the batch commits with them. With
    /// [`Undo::Transaction`] a failed handler rolls the batch back whole
    /// ([`Outcome::Undone`]), claims and all, and records nothing.
    async fn take(&self, consumer: &str, undo: Undo) -> anyhow::Result<Outcome> {
        let Some(plugin) = self.registry.get(consumer) else {
            return Ok(Outcome::Idle);
        };
        let mut tx = self.dispatcher.sessions.begin(consumer).await?;
        let limit = if self.single(consumer) {
            1
        } else {
            self.config.batch_max_events
        };
        let batch = claim(&mut tx, limit).await?;
        if batch.is_empty() {
            tx.rollback().await?;
            return Ok(Outcome::Idle);
        }
        // Already marked processed, with the row still locked; an event in processed_event
        // already (a dedup-mode delivery) is not handled again.
        let fresh: Vec<&Claimed> = batch.iter().filter(|c| c.fresh).collect();
        let undo = if fresh.len() > 1 { undo } else { Undo::Event };
        let (mut tx, emitted, failed) = match handling::run(
            &self.dispatcher,
            &plugin,
            tx,
            &fresh.iter().map(|c| &c.job).collect::<Vec<_>>(),
            undo,
        )
        .await?
        {
            Ran::Open { tx, emitted, failed } => (tx, emitted, failed),
            Ran::RolledBack { at, failure } => {
                tracing::debug!(consumer, event_id = %fresh[at].job.event_id, error = %failure.error,
                    "a handler failed in a batch without savepoints; taking it again with them");
                return Ok(Outcome::Undone);
            }
            // The transaction is gone (a call stopped by its backstop, blocked in the host), or
            // its session was abandoned mid-result: what it did is undone, and the attempt is
            // recorded on a fresh session, so that the event waits its backoff and is parked in
            // the end like any other. Unrecorded, it was claimed again at once, for ever,
            // holding up its key and a processor each time.
            Ran::Lost { at, failure, session } => {
                if let Some(poisoned) = session {
                    poisoned.abandon();
                }
                self.record_apart(consumer, fresh[at], &failure).await?;
                return Ok(Outcome::Worked);
            }
        };
        // The first failed event: its attempt is recorded under its row lock, and the rest of
        // the batch, of the same key, waits behind it. A run that met its time budget leaves
        // the events it did not run for the next batch.
        let (parked, behind) = match (failed, fresh.get(emitted.len())) {
            (Some(failure), Some(claimed)) => {
                // Under the claim's row lock: always recorded.
                let park = self.record_failure(&mut tx, consumer, claimed, &failure).await? == Some(true);
                (Some((*claimed, park)), &fresh[emitted.len() + 1..])
            }
            _ => (None, &fresh[emitted.len()..]),
        };
        if !behind.is_empty() {
            let behind: Vec<Uuid> = behind.iter().map(|c| c.job.event_id).collect();
            sqlx::query("SELECT obx_api.inbox_untake($1)")
                .bind(&behind)
                .execute(&mut *tx)
                .await?;
        }
        let handled = emitted.len();
        if let Err(e) = self.dispatcher.commit_events(tx, &emitted).await {
            let Some(failure) = handling::refused_commit(&e) else {
                return Err(e.into());
            };
            return self.commit_refused(consumer, &fresh, &failure).await;
        }
        {
            let mut single = self.lock_single();
            if let Some(left) = single.get_mut(consumer) {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    single.remove(consumer);
                }
            }
        }
        metrics::counter!("obx_inbox_processed_total", "plugin" => consumer.to_string()).increment(handled as u64);
        if let Some((claimed, park)) = parked {
            self.report_parked(consumer, claimed, park);
        }
        Ok(Outcome::Worked)
    }

    fn lock_single(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, u32>> {
        self.one_at_a_time.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn single(&self, consumer: &str) -> bool {
        self.lock_single().contains_key(consumer)
    }

    /// The commit of a batch was refused for something a handler did, or lost a race at its
    /// `COMMIT`. One event alone: its attempt (or lost race) is recorded. Several: the
    /// consumer's next events go one at a time, to find it.
    async fn commit_refused(&self, consumer: &str, fresh: &[&Claimed], failure: &Failure) -> anyhow::Result<Outcome> {
        if let [only] = fresh {
            self.record_apart(consumer, only, failure).await?;
        } else {
            tracing::warn!(consumer, error = %failure.error, "an inbox batch could not commit; its events go one at a time");
            self.lock_single()
                .insert(consumer.to_string(), self.config.batch_max_events.max(1));
        }
        Ok(Outcome::Worked)
    }

    /// Records a failed attempt of `claimed` in a transaction of its own (the claim's is gone,
    /// so another processor may have claimed the event again since: then the attempt it
    /// records, or its success, stands, and this one is dropped).
    async fn record_apart(&self, consumer: &str, claimed: &Claimed, failure: &Failure) -> anyhow::Result<()> {
        let mut again = self.dispatcher.sessions.begin(consumer).await?;
        let recorded = self.record_failure(&mut again, consumer, claimed, failure).await?;
        again.commit().await?;
        match recorded {
            Some(park) => self.report_parked(consumer, claimed, park),
            None => tracing::debug!(consumer, event_id = %claimed.job.event_id,
                "the event moved on since its claim; this attempt is not recorded"),
        }
        Ok(())
    }

    /// Records a failed attempt in `tx`: a retry after a backoff, or, past
    /// `consumer.max_attempts` or for a failure no retry can help, a dead letter. Returns
    /// whether the event is parked, or `None` if it is no longer where its claim left it
    /// (`obx_api.inbox_fail_attempt`; never under the claim's own row lock).
    async fn record_failure(
        &self,
        tx: &mut PluginTx,
        consumer: &str,
        claimed: &Claimed,
        failure: &Failure,
    ) -> anyhow::Result<Option<bool>> {
        let attempts = claimed.attempts as u32 + 1;
        let delay = backoff(self.config.backoff_initial, self.config.backoff_max, attempts);
        if failure.lost_race && !self.config.contention_grace.is_zero() {
            match self.defer(tx, consumer, claimed, failure, delay).await? {
                Deferred::First | Deferred::Again => return Ok(Some(false)),
                Deferred::Gone => return Ok(None),
                Deferred::Charge => {}
            }
        }
        tracing::warn!(consumer, event_id = %claimed.job.event_id, attempts,
            error = %failure.error, "inbox event handler failed");
        let park = !failure.retriable || attempts >= self.config.max_attempts;
        let recorded: bool = sqlx::query_scalar("SELECT obx_api.inbox_fail_attempt($1, $2, $3, $4, $5)")
            .bind(claimed.job.event_id)
            .bind(attempts as i32)
            .bind(crate::db::storable(&failure.error))
            .bind(park)
            .bind(delay.as_secs_f64())
            .fetch_one(&mut **tx)
            .await?;
        Ok(recorded.then_some(park))
    }

    /// Records in `tx` that the handler of `claimed` lost to concurrent work: within
    /// `consumer.contention_grace` of its first lost race, the event is due again as the same
    /// attempt (`obx_api.inbox_defer`), after a quarter of the time since that race, at least
    /// `delay` (the backoff of the attempt it repeats) and at most `consumer.backoff_max`
    /// ([`super::contended_wait`]).
    async fn defer(
        &self,
        tx: &mut PluginTx,
        consumer: &str,
        claimed: &Claimed,
        failure: &Failure,
        delay: std::time::Duration,
    ) -> anyhow::Result<Deferred> {
        let answer: String = sqlx::query_scalar("SELECT obx_api.inbox_defer($1, $2, $3, $4, $5, $6)")
            .bind(claimed.job.event_id)
            .bind(claimed.attempts)
            .bind(crate::db::storable(&failure.error))
            .bind(delay.as_secs_f64())
            .bind(self.config.backoff_max.as_secs_f64())
            .bind(self.config.contention_grace.as_secs_f64())
            .fetch_one(&mut **tx)
            .await?;
        let deferred = Deferred::of(&answer)?;
        deferred.report(consumer, &claimed.job.event_id, &failure.error);
        Ok(deferred)
    }

    /// Once a parking committed: the metric and the log line.
    fn report_parked(&self, consumer: &str, claimed: &Claimed, park: bool) {
        if park {
            metrics::counter!("obx_dead_letters_total", "plugin" => consumer.to_string()).increment(1);
            tracing::error!(consumer, event_id = %claimed.job.event_id, attempts = claimed.attempts + 1,
                "event parked in the dead-letter table");
        }
    }
}

/// Claims the plugin's next event that may run and the events of its key after it, up to
/// `limit` in all, in order, and marks them processed, their rows locked for the
/// transaction.
async fn claim(conn: &mut sqlx::PgConnection, limit: u32) -> sqlx::Result<Vec<Claimed>> {
    let rows = sqlx::query(
        "SELECT event_id, topic, payload, event_type, partition_key, headers, attempts, fresh \
         FROM obx_api.inbox_take_batch($1)",
    )
    .bind(limit as i32)
    .fetch_all(conn)
    .await?;
    rows.iter().map(claimed).collect()
}

fn claimed(row: &sqlx::postgres::PgRow) -> sqlx::Result<Claimed> {
    // try_get everywhere: the row comes from the plugin's own session.
    let headers: serde_json::Map<String, serde_json::Value> =
        serde_json::from_value(row.try_get("headers")?).unwrap_or_default();
    let attempts = row.try_get::<i32, _>("attempts")?.max(0);
    let fields = EventFields {
        event_id: row.try_get("event_id")?,
        event_type: row.try_get("event_type")?,
        topic: row.try_get("topic")?,
        key: row.try_get("partition_key")?,
        payload: row.try_get("payload")?,
        headers: headers
            .into_iter()
            .filter_map(|(k, v)| Some((k, v.as_str()?.to_string())))
            .collect(),
    };
    Ok(Claimed {
        attempts,
        fresh: row.try_get("fresh")?,
        job: Job::new(fields, attempts as u32 + 1),
    })
}
