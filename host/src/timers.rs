//! Fires durable timers (`obx:plugin/timers`) when they are due.
//!
//! One loop per loaded `timed-plugin`, each a task of its own. It sleeps until the earliest
//! due time of its plugin's timers (asking again at least every [`IDLE_POLL`], for timers
//! other hosts schedule), then fires the due timers in batches, each batch one transaction on
//! the plugin's session:
//!
//! 1. `obx_api.timer_take_traced(n)` takes the earliest due timers, up to
//!    `consumer.batch_max_events`, and locks their rows (another host's firing skips them);
//! 2. each timer's `handle-timer` runs behind a savepoint of its own;
//! 3. on `ok`, `obx_api.timer_done` deletes the timer (unless the handler scheduled it again);
//! 4. on failure, the call is rolled back to its savepoint and `obx_api.timer_fail` records
//!    it: due again after a backoff, or parked after `consumer.max_attempts` (or at once, for
//!    invalid input or a rejection);
//! 5. the handled timers' outbox rows are written and the batch commits: each handler's
//!    effects and its timer's end commit together, once.
//!
//! A batch commits after [`BATCH_BUDGET`] whatever is left, and each plugin's loop waits
//! only for its own batches: no plugin's backlog, slow handlers or failures hold up
//! another's timers. A plugin whose batch fails (its session cannot be opened, its commit
//! fails) waits alone, with backoff. A deferred constraint is checked after each handler, as
//! its own failure. A batch of several timers whose commit the database refuses anyway (a row
//! written at the commit) charges none of them: they fire again one per transaction, and a
//! single timer's refused commit counts as its failed attempt, so that no timer fires for
//! ever and no timer pays for another's. A commit that fails for the database's or the
//! connection's sake charges none, and the loop backs off. A call refused for want of a call
//! slot (`Busy`) is not the timer's fault and is not counted; a batch that could fire none
//! for want of one backs off too.
//!
//! A host killed mid-firing leaves the transaction uncommitted: the row lock goes with its
//! session, and the timer fires again on a living host.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{Executor as _, Row as _};
use tokio::sync::watch;

use crate::config::ConsumerConfig;
use crate::db::sessions::PluginTx;
use crate::dispatch::{Dispatcher, Emitted, EventFailure};
use crate::inbox::backoff;
use crate::inbox::handling::{Deferred, Failure};
use crate::paging::{ListError, Page, PageRequest};
use crate::runtime::bindings::timer_guest;
use crate::runtime::registry::Registry;
use crate::runtime::Plugin;
use crate::trace::TraceContext;

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

/// Each plugin of the installation: its timers' counts, zeros for one with none. A plugin
/// whose last timer went was left out, so that its gauges kept their last values for ever (a
/// parked timer cancelled still read as parked). The pending count reads the partial index of
/// pending timers.
pub async fn counts(pool: &sqlx::PgPool) -> sqlx::Result<Vec<TimerCounts>> {
    sqlx::query_as(
        "SELECT p.name AS plugin, \
                count(t.plugin) FILTER (WHERE t.parked_at IS NULL) AS pending, \
                count(t.plugin) FILTER (WHERE t.parked_at IS NOT NULL) AS parked, \
                greatest(coalesce(extract(epoch FROM clock_timestamp() \
                    - min(t.due_at) FILTER (WHERE t.parked_at IS NULL)), 0), 0)::float8 AS overdue_seconds \
         FROM obx.plugin p LEFT JOIN obx.timer t ON t.plugin = p.name GROUP BY p.name ORDER BY p.name",
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

/// A page of timers, earliest due first (parked ones only, if asked). The cursor is the last
/// timer listed, its due time and its name, as opaque hex.
pub async fn list(
    pool: &sqlx::PgPool,
    plugin: Option<&str>,
    parked: bool,
    page: &PageRequest,
) -> Result<Page<TimerRow>, ListError> {
    let size = page.rows()?;
    let after: Option<TimerCursor> = page.cursor(|a| serde_json::from_slice(&hex::decode(a).ok()?).ok())?;
    let rows = sqlx::query_as(
        "SELECT plugin, name, key, due_at, attempts, last_error, parked_at, scheduled_at FROM obx.timer \
         WHERE ($1::text IS NULL OR plugin = $1) AND (NOT $2 OR parked_at IS NOT NULL) \
           AND ($3::timestamptz IS NULL OR (due_at, plugin, name, key) > ($3, $4, $5, $6)) \
         ORDER BY due_at, plugin, name, key LIMIT $7",
    )
    .bind(plugin)
    .bind(parked)
    .bind(after.as_ref().map(|c| c.0))
    .bind(after.as_ref().map(|c| &c.1))
    .bind(after.as_ref().map(|c| &c.2))
    .bind(after.as_ref().map(|c| &c.3))
    .bind(size + 1)
    .fetch_all(pool)
    .await?;
    Ok(Page::of(rows, size, |t: &TimerRow| {
        let cursor = TimerCursor(t.due_at, t.plugin.clone(), t.name.clone(), t.key.clone());
        hex::encode(serde_json::to_vec(&cursor).expect("a cursor serialises"))
    }))
}

/// Where a page of timers ends: the last one's due time, plugin, name and key.
#[derive(serde::Serialize, serde::Deserialize)]
struct TimerCursor(chrono::DateTime<chrono::Utc>, String, String, String);

/// A timer, named: (plugin, name, key).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct TimerId {
    pub plugin: String,
    pub name: String,
    pub key: String,
}

/// Cancels a timer, pending or parked; whether there was one. A timer being fired right now
/// is waited for (its row is locked, a batch commits within about a second plus one call's
/// deadline): if the firing commits, there is nothing left to cancel.
pub async fn cancel(pool: &sqlx::PgPool, id: &TimerId) -> sqlx::Result<bool> {
    changes_one(
        pool,
        "DELETE FROM obx.timer WHERE plugin = $1 AND name = $2 AND key = $3",
        id,
    )
    .await
}

/// Sends a parked timer back to fire now, its attempts reset; whether one was parked.
pub async fn retry(pool: &sqlx::PgPool, id: &TimerId) -> sqlx::Result<bool> {
    changes_one(
        pool,
        "UPDATE obx.timer SET parked_at = NULL, attempts = 0, last_error = NULL, contended_since = NULL, \
         due_at = clock_timestamp() \
         WHERE plugin = $1 AND name = $2 AND key = $3 AND parked_at IS NOT NULL",
        id,
    )
    .await
}

/// Runs `statement` with the timer `id` as $1, $2, $3; whether it changed that timer's row.
async fn changes_one(pool: &sqlx::PgPool, statement: &str, id: &TimerId) -> sqlx::Result<bool> {
    let mut conn = pool.acquire().await?;
    // One statement, its own transaction: once sent, it may commit whatever the host does.
    crate::dispatch::commit_sent();
    let done = sqlx::query(statement)
        .bind(&id.plugin)
        .bind(&id.name)
        .bind(&id.key)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Checks the deferred constraints now, then defers every deferrable constraint again for the
/// next handler of the batch. `SET CONSTRAINTS ALL IMMEDIATE` alone left them immediate for
/// the rest of the transaction, so that a later handler whose work breaks one for a moment
/// failed. (Rolling back to a savepoint around the check restores the modes too, but marks
/// the checks undone: every later handler's check ran all the earlier ones again, n²/2 for
/// n timers.) A constraint declared `DEFERRABLE INITIALLY IMMEDIATE` is deferred too for the
/// later handlers: its violation then shows at this check, after the handler, as that timer's
/// failure, rather than at the statement, which fails the timer the same way.
const CHECK_DEFERRED: &str = "SET CONSTRAINTS ALL IMMEDIATE; SET CONSTRAINTS ALL DEFERRED";

/// A due timer, as `obx_api.timer_take_traced` returns it.
#[derive(sqlx::FromRow)]
struct Due {
    name: String,
    key: String,
    payload: String,
    due_at: chrono::DateTime<chrono::Utc>,
    generation: i64,
    attempts: i32,
    /// The trace context of the call that scheduled it, if it was recorded.
    traceparent: Option<String>,
}

impl Due {
    /// What the timer weighs in memory: its payload, name and key.
    fn bytes(&self) -> usize {
        self.payload.len() + self.name.len() + self.key.len()
    }
}

/// How often the firing loops are checked for one that ended.
const RESTART_CHECK: Duration = Duration::from_secs(1);

/// How long a batch may run handlers before it commits what it has done: its timers'
/// rows stay locked until then, and a command that cancels one of them waits for it.
const BATCH_BUDGET: Duration = Duration::from_secs(1);

impl TimerService {
    /// Keeps one firing loop per loaded timed plugin ([`TimerService::fire_plugin`]), so that
    /// no plugin's backlog, slow handlers or failures hold up another's timers.
    pub async fn run(self) {
        let service = Arc::new(self);
        let mut changes = service.registry.changes();
        let mut shutdown = service.shutdown.clone();
        let mut loops: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
        loop {
            if *shutdown.borrow() {
                break;
            }
            loops.retain(|_, task| !task.is_finished());
            for plugin in service.registry.plugins().into_iter().filter(|p| p.timed()) {
                let name = plugin.manifest.name.clone();
                loops
                    .entry(name.clone())
                    .or_insert_with(|| tokio::spawn(service.clone().fire_plugin(name)));
            }
            // A loop that ended (its plugin was unloaded, or it panicked) starts again here
            // if its plugin is loaded and timed.
            tokio::select! {
                _ = changes.changed() => {}
                _ = shutdown.changed() => {}
                _ = tokio::time::sleep(RESTART_CHECK) => {}
            }
        }
        for (_, task) in loops {
            let _ = task.await;
        }
    }

    /// Fires `name`'s due timers, a batch at a time, for as long as it is loaded and timed:
    /// between batches it sleeps until its earliest timer is due (asking again at least every
    /// [`IDLE_POLL`], for timers other hosts schedule); after a failed batch, the backoff.
    async fn fire_plugin(self: Arc<Self>, name: String) {
        let mut shutdown = self.shutdown.clone();
        let (mut failures, mut held) = (0u32, 0u32);
        // Batches of one timer still to fire, after a batch whose commit failed.
        let mut alone = 0usize;
        // How many timers a batch reads (`db::next_take_limit`): a batch of large ones read
        // 32 to keep one, and dropped the rest.
        let most = self.config.batch_max_events.max(1);
        let mut limit = most;
        loop {
            if *shutdown.borrow() {
                return;
            }
            let Some(plugin) = self.registry.get(&name).filter(|p| p.timed()) else {
                return;
            };
            let take = if alone > 0 { 1 } else { limit };
            let fired = self.fire_batch(&plugin, take).await;
            alone = alone.saturating_sub(1);
            let wait = match fired {
                Ok(Batch::Fired { kept, bytes, cut }) => {
                    (failures, held) = (0, 0);
                    if take == limit {
                        limit = crate::db::next_take_limit(limit, kept, bytes, cut, most, self.config.batch_max_bytes);
                    }
                    continue;
                }
                Ok(Batch::Split(timers)) => {
                    alone = timers;
                    continue;
                }
                Ok(Batch::Idle) => {
                    failures = 0;
                    if self.idle_until_due(&name, &mut held, &mut shutdown).await {
                        return;
                    }
                    continue;
                }
                Err(e) => {
                    failures += 1;
                    let wait = backoff(self.config.backoff_initial, self.config.backoff_max, failures);
                    tracing::warn!(plugin = %name, error = format!("{e:#}"), retry_in = ?wait, "firing timers failed");
                    wait
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// After a batch that found nothing to fire: sleeps until `plugin`'s earliest pending
    /// timer is due, probing the index at least every [`IDLE_POLL`] (for timers other hosts
    /// schedule), and takes no batch before then. Each idle turn took one, a transaction on a
    /// plugin session four times a second for every timed plugin on every host, which kept
    /// those sessions from ever closing. True at shutdown, or once the plugin is gone or no
    /// longer timed.
    async fn idle_until_due(&self, plugin: &str, held: &mut u32, shutdown: &mut watch::Receiver<bool>) -> bool {
        loop {
            let (wait, fire) = self.until_due(plugin, held).await;
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => return true,
            }
            if *shutdown.borrow() || self.registry.get(plugin).is_none_or(|p| !p.timed()) {
                return true;
            }
            if fire {
                return false;
            }
        }
    }

    /// How long `plugin` may sleep: until its earliest pending timer is due, at most
    /// [`IDLE_POLL`], and whether a batch is to be taken then: not when no timer is pending,
    /// or the earliest is due later than that. One due that could not be taken (another
    /// session holds it) is asked for again soon, then less and less often (`held` counts
    /// such answers in a row).
    async fn until_due(&self, plugin: &str, held: &mut u32) -> (Duration, bool) {
        // The earliest pending timer: one probe of the partial index.
        let due: sqlx::Result<Option<f64>> = sqlx::query_scalar(
            "SELECT extract(epoch FROM due_at - clock_timestamp())::float8 FROM obx.timer \
             WHERE plugin = $1 AND parked_at IS NULL ORDER BY due_at LIMIT 1",
        )
        .bind(plugin)
        .fetch_optional(&self.dispatcher.pool)
        .await
        .map(Option::flatten);
        match due {
            Ok(Some(secs)) if secs <= 0.0 => {
                *held = held.saturating_add(1);
                (Duration::from_millis(5 << (*held).min(6)).min(IDLE_POLL), true)
            }
            Ok(Some(secs)) => {
                *held = 0;
                let due = Duration::from_secs_f64(secs);
                (due.min(IDLE_POLL), due <= IDLE_POLL)
            }
            Ok(None) => (IDLE_POLL, false),
            Err(e) => {
                tracing::warn!(plugin, error = %e, "reading the next timer's due time failed");
                (IDLE_POLL, true)
            }
        }
    }

    /// Fires a batch of at most `take` of the plugin's due timers, earliest first, that no
    /// other session holds: one transaction, each timer behind a savepoint, for at most
    /// [`BATCH_BUDGET`].
    async fn fire_batch(&self, plugin: &Plugin, take: u32) -> anyhow::Result<Batch> {
        let name = &plugin.manifest.name;
        let mut tx = self.dispatcher.sessions.begin(name).await?;
        // At most `consumer.batch_max_bytes` of payloads (the first timer always): the rest
        // stay due, their rows released by this transaction's end.
        let due = sqlx::query_as::<_, Due>("SELECT * FROM obx_api.timer_take_traced($1)")
            .bind(take as i32)
            .fetch(&mut *tx);
        let (due, cut) = crate::db::take_within(due, self.config.batch_max_bytes, Due::bytes).await?;
        let (kept, bytes) = (due.len(), due.iter().map(Due::bytes).sum());
        if due.is_empty() {
            tx.rollback().await?;
            return Ok(Batch::Idle);
        }
        let started = Instant::now();
        let mut emitted = Vec::with_capacity(due.len());
        let mut done = Vec::with_capacity(due.len());
        let (mut busy, mut ran, mut emitted_bytes) = (false, 0, 0);
        for (at, due) in due.into_iter().enumerate() {
            // Past its time, once its emits reach one call's limit, or at shutdown.
            if started.elapsed() > BATCH_BUDGET
                || self.dispatcher.batch_emitted_enough(emitted_bytes)
                || *self.shutdown.borrow()
            {
                // The rest stay due; the commit below releases their rows.
                break;
            }
            // Handlers before it in the batch may have rescheduled or cancelled it.
            let check = at > 0;
            match self.fire_one(plugin, tx, &due, check).await? {
                Fired::Done(back, e) => {
                    tx = back;
                    emitted_bytes += e.bytes();
                    emitted.push(e);
                    done.push(due);
                }
                Fired::Failed(back) => tx = back,
                Fired::Gone(back) => {
                    tx = back;
                    continue;
                }
                Fired::Busy(back) => {
                    tx = back;
                    busy = true;
                    break;
                }
            }
            ran += 1;
        }
        if let Err(e) = self.dispatcher.commit_events(tx, &emitted).await {
            return self.commit_failed(name, e, ran, &done).await;
        }
        if busy && done.is_empty() {
            // The host is overloaded: the loop backs off and says so, rather than take the
            // same timers again at once.
            return Err(crate::inbox::handling::NoCallSlot.into());
        }
        Ok(Batch::Fired { kept, bytes, cut })
    }

    /// What a batch whose commit failed (`e`), having run `ran` timers of which `done` did
    /// their work, comes to.
    async fn commit_failed(&self, name: &str, e: sqlx::Error, ran: usize, done: &[Due]) -> anyhow::Result<Batch> {
        let Some(failure) = crate::inbox::handling::refused_commit(&e) else {
            // The database or the connection failed, not the timers: none is charged, and
            // the loop backs off.
            return Err(e.into());
        };
        if ran > 1 {
            // Which timer's work the commit refused cannot be told: none is charged (the
            // failures recorded in the batch went with it), and each of the timers it ran
            // fires again in a transaction of its own.
            tracing::warn!(plugin = %name, timers = ran, error = %e,
                "a batch of timers could not commit; they fire again one at a time");
            return Ok(Batch::Split(ran));
        }
        if done.is_empty() {
            // Nothing the handlers did was in it (the one timer failed, and its failure went
            // with the commit): the loop backs off.
            return Err(e.into());
        }
        // The one timer's work cannot commit: it counts as failed (unless it lost a race within
        // the grace), or it would fire for ever. Its own retry delay keeps it from firing
        // again at once; the loop goes on.
        let mut fresh = self.dispatcher.sessions.begin(name).await?;
        for due in done {
            self.record_failure(&mut fresh, name, due, &failure, "a timer's work could not commit")
                .await?;
        }
        fresh.commit().await?;
        Ok(Batch::Fired {
            kept: done.len(),
            bytes: done.iter().map(Due::bytes).sum(),
            cut: false,
        })
    }

    /// Runs one timer's handler behind a savepoint of `tx`; if `check`, only if the timer is
    /// still as the batch took it (in the savepoint's round trip).
    async fn fire_one(&self, plugin: &Plugin, mut tx: PluginTx, due: &Due, check: bool) -> anyhow::Result<Fired> {
        let name = &plugin.manifest.name;
        if check {
            let mut sql = String::from("SAVEPOINT obx_timer; SELECT obx_api.timer_current(");
            crate::db::literal::push_text(&mut sql, &due.name);
            sql.push_str(", ");
            crate::db::literal::push_text(&mut sql, &due.key);
            sql.push_str(&format!(", {})", due.generation));
            let current: bool = tx.fetch_one(sql.as_str()).await?.try_get(0)?;
            if !current {
                return Ok(Fired::Gone(tx));
            }
        } else {
            tx.execute("SAVEPOINT obx_timer").await?;
        }
        let attempt = attempt_of(due);
        let lateness = (chrono::Utc::now() - due.due_at).num_microseconds().unwrap_or(0).max(0);
        metrics::histogram!("obx_timer_lateness_seconds", "plugin" => name.clone()).record(lateness as f64 / 1e6);
        let timer = timer_guest::Timer {
            name: due.name.clone(),
            key: due.key.clone(),
            payload: due.payload.clone(),
            due_at: due.due_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            attempt,
        };
        let scheduled_in = due.traceparent.as_deref().and_then(TraceContext::parse);
        let mut failed = match self
            .dispatcher
            .call_timer(plugin, tx, timer, scheduled_in.as_ref())
            .await
        {
            Ok((mut back, emitted)) => {
                // Deferred constraints are checked here, as this timer's own failure, not at
                // the batch's commit; the next handler of the batch finds them deferred.
                let ended = async {
                    back.execute(CHECK_DEFERRED).await?;
                    sqlx::query("SELECT obx_api.timer_done($1, $2, $3)")
                        .bind(&due.name)
                        .bind(&due.key)
                        .bind(due.generation)
                        .execute(&mut *back)
                        .await
                }
                .await;
                match ended {
                    Ok(_) => return Ok(Fired::Done(back, emitted)),
                    Err(e) => EventFailure {
                        error: format!("the timer could not end: {e}"),
                        retriable: true,
                        lost_race: crate::db::lost_a_race(&e),
                        busy: false,
                        tx: Some(back),
                    },
                }
            }
            Err(failure) => failure,
        };
        let failure = Failure::taken_from(&mut failed);
        match failed.tx.take() {
            Some(mut back) if !back.is_poisoned() => {
                back.execute("ROLLBACK TO SAVEPOINT obx_timer").await?;
                if failed.busy {
                    // No call slot: the host is overloaded, the timer is not at fault.
                    return Ok(Fired::Busy(back));
                }
                self.record_failure(&mut back, name, due, &failure, "a timer handler failed")
                    .await?;
                Ok(Fired::Failed(back))
            }
            lost => {
                // The call's session may still be running a statement: it goes, with the
                // batch's work, and the failure is recorded on a fresh session. The batch's
                // other timers are due again at once.
                if let Some(session) = lost {
                    session.abandon();
                }
                let mut fresh = self.dispatcher.sessions.begin(name).await?;
                let message = "a timer handler failed and took its transaction with it";
                self.record_failure(&mut fresh, name, due, &failure, message).await?;
                fresh.commit().await?;
                anyhow::bail!("a timer handler lost its transaction: {}", failure.error)
            }
        }
    }

    /// Records a failed firing of `due` in `tx`, with `message` for its log line. A lost race
    /// within `consumer.contention_grace` of the first is due again as the same attempt
    /// (`obx_api.timer_defer`), after a quarter of the time since then, between the backoff and
    /// `consumer.backoff_max`; any other failure is due again as the next attempt, or parked
    /// after `consumer.max_attempts` (`obx_api.timer_fail`).
    async fn record_failure(
        &self,
        tx: &mut PluginTx,
        plugin: &str,
        due: &Due,
        failure: &Failure,
        message: &str,
    ) -> sqlx::Result<()> {
        let attempt = attempt_of(due);
        let retry = backoff(self.config.backoff_initial, self.config.backoff_max, attempt);
        let error = crate::db::storable(&failure.error);
        if failure.lost_race && !self.config.contention_grace.is_zero() {
            let answer: String = sqlx::query_scalar("SELECT obx_api.timer_defer($1, $2, $3, $4, $5, $6, $7, $8)")
                .bind(&due.name)
                .bind(&due.key)
                .bind(due.generation)
                .bind(due.attempts)
                .bind(&*error)
                .bind(retry.as_millis() as i64)
                .bind(self.config.backoff_max.as_millis() as i64)
                .bind(self.config.contention_grace.as_millis() as i64)
                .fetch_one(&mut **tx)
                .await?;
            let deferred = Deferred::of(&answer).map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
            let id = format_args!("timer {:?} of key {:?}", due.name, due.key);
            deferred.report(plugin, &id, &error);
            if deferred != Deferred::Charge {
                return Ok(());
            }
        }
        let park = !failure.retriable || attempt >= self.config.max_attempts;
        tracing::warn!(plugin, timer = ?due.name, key = ?due.key, attempt, park, error = ?failure.error, "{message}");
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

/// How a batch of timers ended.
enum Batch {
    /// It took due timers and committed: each fired, or its failure was recorded. With how
    /// many timers (of how many bytes) it kept of those it read, and whether it had to cut.
    Fired { kept: usize, bytes: usize, cut: bool },
    /// No timer was due.
    Idle,
    /// The database refused its commit, with this many timers run: none was charged, and the
    /// next batches take one timer each, so that only the timer whose work cannot commit is.
    Split(usize),
}

/// How one timer's firing ended, with the batch's transaction.
enum Fired {
    /// Its handler returned `ok` and the timer ended; what it emitted, unwritten.
    Done(PluginTx, Emitted),
    /// Its handler failed, was rolled back to its savepoint, and the failure recorded.
    Failed(PluginTx),
    /// There was no call slot: rolled back, not counted; the batch stops here.
    Busy(PluginTx),
    /// A handler before it in the batch rescheduled or cancelled it: not fired.
    Gone(PluginTx),
}

/// The attempt a firing of `due` is: one more than its recorded failures.
fn attempt_of(due: &Due) -> u32 {
    (due.attempts.max(0) as u32).saturating_add(1)
}
