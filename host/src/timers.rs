//! Fires durable timers (`obx:plugin/timers`) when they are due.
//!
//! One task per host. It sleeps until the earliest due time of the loaded `timed-plugin`s'
//! timers (asking again at least every [`IDLE_POLL`], for timers other hosts schedule), then
//! fires the due timers in batches, each batch one transaction on the plugin's session:
//!
//! 1. `obx_api.timer_take(n)` takes the earliest due timers, up to
//!    `consumer.batch_max_events`, and locks their rows (another host's firing skips them);
//! 2. each timer's `handle-timer` runs behind a savepoint of its own;
//! 3. on `ok`, `obx_api.timer_done` deletes the timer (unless the handler scheduled it again);
//! 4. on failure, the call is rolled back to its savepoint and `obx_api.timer_fail` records
//!    it: due again after a backoff, or parked after `consumer.max_attempts` (or at once, for
//!    invalid input or a rejection);
//! 5. the handled timers' outbox rows are written and the batch commits: each handler's
//!    effects and its timer's end commit together, once.
//!
//! A host killed mid-firing leaves the transaction uncommitted: the row lock goes with its
//! session, and the timer fires again on a living host.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Executor as _;
use tokio::sync::watch;

use crate::config::ConsumerConfig;
use crate::db::sessions::PluginTx;
use crate::dispatch::Dispatcher;
use crate::inbox::backoff;
use crate::runtime::bindings::timer_guest;
use crate::runtime::registry::Registry;
use crate::runtime::Plugin;

/// How often an idle host asks for the earliest due time, at the least.
pub const IDLE_POLL: Duration = Duration::from_millis(250);

pub struct TimerService {
    pub dispatcher: Arc<Dispatcher>,
    pub registry: Arc<Registry>,
    pub config: ConsumerConfig,
    pub shutdown: watch::Receiver<bool>,
}

/// A plugin's timers, for `/v1/status` and the gauges.
#[derive(Debug, serde::Serialize, sqlx::FromRow)]
pub struct TimerCounts {
    pub plugin: String,
    /// Timers waiting to fire (due or not).
    pub pending: i64,
    /// Timers that failed `consumer.max_attempts` times and fire no more.
    pub parked: i64,
    /// How long the most overdue pending timer has been due; 0 when none is.
    pub overdue_seconds: f64,
}

/// Each plugin with timers: its counts. The pending count reads the partial index of
/// pending timers.
pub async fn counts(pool: &sqlx::PgPool) -> sqlx::Result<Vec<TimerCounts>> {
    sqlx::query_as(
        "SELECT plugin, \
                count(*) FILTER (WHERE parked_at IS NULL) AS pending, \
                count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked, \
                greatest(coalesce(extract(epoch FROM clock_timestamp() \
                    - min(due_at) FILTER (WHERE parked_at IS NULL)), 0), 0)::float8 AS overdue_seconds \
         FROM obx.timer GROUP BY plugin ORDER BY plugin",
    )
    .fetch_all(pool)
    .await
}

/// A timer, for `obx timers list` and `GET /v1/timers`.
#[derive(Debug, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct TimerRow {
    pub plugin: String,
    pub name: String,
    pub key: String,
    pub due_at: chrono::DateTime<chrono::Utc>,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub parked_at: Option<chrono::DateTime<chrono::Utc>>,
    pub scheduled_at: chrono::DateTime<chrono::Utc>,
}

/// The most timers one listing returns.
pub const LIST_LIMIT: i64 = 1000;

/// Timers, earliest due first (parked ones only, if asked), at most [`LIST_LIMIT`].
pub async fn list(pool: &sqlx::PgPool, plugin: Option<&str>, parked: bool) -> sqlx::Result<Vec<TimerRow>> {
    sqlx::query_as(
        "SELECT plugin, name, key, due_at, attempts, last_error, parked_at, scheduled_at FROM obx.timer \
         WHERE ($1::text IS NULL OR plugin = $1) AND (NOT $2 OR parked_at IS NOT NULL) \
         ORDER BY due_at LIMIT $3",
    )
    .bind(plugin)
    .bind(parked)
    .bind(LIST_LIMIT)
    .fetch_all(pool)
    .await
}

/// A timer, named: (plugin, name, key).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct TimerId {
    pub plugin: String,
    pub name: String,
    pub key: String,
}

/// Cancels a timer, pending or parked; whether there was one. A timer being fired right now
/// is waited for (its row is locked): if the firing commits, there is nothing left to cancel.
pub async fn cancel(pool: &sqlx::PgPool, id: &TimerId) -> sqlx::Result<bool> {
    let deleted = sqlx::query("DELETE FROM obx.timer WHERE plugin = $1 AND name = $2 AND key = $3")
        .bind(&id.plugin)
        .bind(&id.name)
        .bind(&id.key)
        .execute(pool)
        .await?;
    Ok(deleted.rows_affected() == 1)
}

/// Sends a parked timer back to fire now, its attempts reset; whether one was parked.
pub async fn retry(pool: &sqlx::PgPool, id: &TimerId) -> sqlx::Result<bool> {
    let updated = sqlx::query(
        "UPDATE obx.timer SET parked_at = NULL, attempts = 0, last_error = NULL, due_at = clock_timestamp() \
         WHERE plugin = $1 AND name = $2 AND key = $3 AND parked_at IS NOT NULL",
    )
    .bind(&id.plugin)
    .bind(&id.name)
    .bind(&id.key)
    .execute(pool)
    .await?;
    Ok(updated.rows_affected() == 1)
}

/// A due timer, as `obx_api.timer_take` returns it.
#[derive(sqlx::FromRow)]
struct Due {
    name: String,
    key: String,
    payload: String,
    due_at: chrono::DateTime<chrono::Utc>,
    generation: i64,
    attempts: i32,
}

impl TimerService {
    pub async fn run(mut self) {
        let mut changes = self.registry.changes();
        let mut failures = 0u32;
        loop {
            if *self.shutdown.borrow() {
                return;
            }
            let wait = match self.step().await {
                Ok(wait) => {
                    failures = 0;
                    wait
                }
                Err(e) => {
                    failures += 1;
                    let wait = backoff(self.config.backoff_initial, Duration::from_secs(1), failures);
                    tracing::warn!(error = format!("{e:#}"), retry_in = ?wait, "firing timers failed");
                    wait
                }
            };
            if wait.is_zero() {
                continue;
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = changes.changed() => {}
                _ = self.shutdown.changed() => {}
            }
        }
    }

    /// Fires what is due; returns how long to wait before the next step.
    async fn step(&self) -> anyhow::Result<Duration> {
        let plugins: Vec<Arc<Plugin>> = self.registry.plugins().into_iter().filter(|p| p.timed()).collect();
        if plugins.is_empty() {
            return Ok(IDLE_POLL);
        }
        for plugin in &plugins {
            if *self.shutdown.borrow() {
                return Ok(Duration::ZERO);
            }
            if self.fire_batch(plugin).await? {
                return Ok(Duration::ZERO);
            }
        }
        let names: Vec<&str> = plugins.iter().map(|p| p.manifest.name.as_str()).collect();
        // Each plugin's earliest pending timer, one index probe each: `min` over
        // `plugin = ANY(...)` would read every pending timer, four times a second.
        let next: Option<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM min(t.due_at) - clock_timestamp())::float8 \
             FROM unnest($1::text[]) AS p(name), LATERAL ( \
                 SELECT due_at FROM obx.timer \
                 WHERE plugin = p.name AND parked_at IS NULL ORDER BY due_at LIMIT 1) t",
        )
        .bind(&names)
        .fetch_one(&self.dispatcher.pool)
        .await?;
        Ok(match next {
            Some(secs) if secs <= 0.0 => Duration::from_millis(5),
            Some(secs) => Duration::from_secs_f64(secs).min(IDLE_POLL),
            None => IDLE_POLL,
        })
    }

    /// Fires a batch of the plugin's due timers, earliest first, that no other session holds:
    /// one transaction, each timer behind a savepoint. Returns whether there were any.
    async fn fire_batch(&self, plugin: &Plugin) -> anyhow::Result<bool> {
        let name = &plugin.manifest.name;
        let mut tx = self.dispatcher.sessions.begin(name).await?;
        let due: Vec<Due> = sqlx::query_as("SELECT * FROM obx_api.timer_take($1)")
            .bind(self.config.batch_max_events.max(1) as i32)
            .fetch_all(&mut *tx)
            .await?;
        if due.is_empty() {
            tx.rollback().await?;
            return Ok(false);
        }
        let mut emitted = Vec::with_capacity(due.len());
        for due in &due {
            tx.execute("SAVEPOINT obx_timer").await?;
            let attempt = (due.attempts.max(0) as u32).saturating_add(1);
            let lateness = (chrono::Utc::now() - due.due_at).num_microseconds().unwrap_or(0).max(0);
            metrics::histogram!("obx_timer_lateness_seconds", "plugin" => name.clone()).record(lateness as f64 / 1e6);
            let timer = timer_guest::Timer {
                name: due.name.clone(),
                key: due.key.clone(),
                payload: due.payload.clone(),
                due_at: due.due_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                attempt,
            };
            match self.dispatcher.call_timer(plugin, tx, timer).await {
                Ok((mut back, e)) => {
                    sqlx::query("SELECT obx_api.timer_done($1, $2, $3)")
                        .bind(&due.name)
                        .bind(&due.key)
                        .bind(due.generation)
                        .execute(&mut *back)
                        .await?;
                    emitted.push(e);
                    tx = back;
                }
                Err(failure) => {
                    let park = !failure.retriable || attempt >= self.config.max_attempts;
                    tracing::warn!(plugin = %name, timer = %due.name, key = %due.key, attempt, park,
                        error = %failure.error, "a timer handler failed");
                    match failure.tx {
                        Some(mut back) if !back.is_poisoned() => {
                            back.execute("ROLLBACK TO SAVEPOINT obx_timer").await?;
                            self.record_failure(&mut back, due, attempt, &failure.error, park)
                                .await?;
                            tx = back;
                        }
                        lost => {
                            // The call's session may still be running a statement: it goes,
                            // with the batch's work, and the failure is recorded on a fresh
                            // session. The batch's other timers are due again at once.
                            if let Some(session) = lost {
                                session.abandon();
                            }
                            let mut fresh = self.dispatcher.sessions.begin(name).await?;
                            self.record_failure(&mut fresh, due, attempt, &failure.error, park)
                                .await?;
                            fresh.commit().await?;
                            return Ok(true);
                        }
                    }
                }
            }
        }
        crate::inbox::handling::commit(&self.dispatcher, tx, &emitted).await?;
        Ok(true)
    }

    /// Records a failed firing of `due` in `tx`: due again after the backoff, or parked.
    async fn record_failure(
        &self,
        tx: &mut PluginTx,
        due: &Due,
        attempt: u32,
        error: &str,
        park: bool,
    ) -> sqlx::Result<()> {
        let retry = backoff(self.config.backoff_initial, self.config.backoff_max, attempt);
        sqlx::query("SELECT obx_api.timer_fail($1, $2, $3, $4, $5, $6, $7)")
            .bind(&due.name)
            .bind(&due.key)
            .bind(due.generation)
            .bind(attempt as i32)
            .bind(error)
            .bind(park)
            .bind(retry.as_millis() as i64)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}
