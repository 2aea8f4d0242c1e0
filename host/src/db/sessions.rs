//! Plugin sessions: every statement of a plugin, and every host write in the same
//! transaction, runs on a database session logged in as the plugin's own role. Each plugin
//! has a small pool of such sessions, opened on demand.
//!
//! This is the wall that Postgres enforces: whatever SQL a plugin manages to run, it runs as
//! a role that owns the plugin's schema, may call the functions of `obx_api`, and has no
//! other privilege. `RESET ROLE` and `set_config('role', …)` leave it as itself, because its
//! session user is itself.
//!
//! Invariants:
//! * A plugin session is used only inside a transaction that the host began ([`PluginTx`]).
//! * A session goes back to its pool only after a transaction that ended cleanly and left
//!   no prepared statement made by SQL, with what a statement could leave on it (cursors,
//!   `LISTEN`s, settings, temporary objects) cleared in the same round trip as the commit or
//!   rollback, after it: what plugin code does during a `COMMIT` is cleared too. Session
//!   advisory locks are released, and prepared statements counted, again at the next call's
//!   `BEGIN`: a session found with one then is closed.
//!   A session whose transaction did not end cleanly is closed, never reused, and its
//!   backend terminated: it may still be running a statement. A commit's round trip is
//!   bounded by the host ([`Login`]'s `commit_within`): Postgres times no part of a `COMMIT`.
//!   A commit whose caller is dropped while it runs (a request whose client went away) is let
//!   end within that bound, and only then is its session closed.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{ConnectOptions, Connection, Executor, PgConnection, PgPool, Postgres, Row};

use super::login::Login;
use crate::config::DatabaseConfig;

/// The pools of plugin sessions, by plugin name.
pub struct Sessions {
    /// The database URL's options: plugin sessions reach the same server the same way
    /// (host, port, TLS) as the host, as another user.
    base: PgConnectOptions,
    /// The host's own pool, to terminate a plugin session that was abandoned mid-statement.
    host: PgPool,
    max_connections: u32,
    role_connection_limit: u32,
    acquire_timeout: Duration,
    pools: Mutex<HashMap<String, (Login, PgPool)>>,
    /// When each plugin's password was last set anew (see [`Sessions::begin`]).
    rotated: Mutex<HashMap<String, std::time::Instant>>,
    /// Held while a password is set anew, so that a call that met the refusal meanwhile
    /// waits for the new login rather than trying the old one again.
    rotating: tokio::sync::Mutex<()>,
}

/// Why a plugin session could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("plugin {0:?} has no database login on this host")]
    Unknown(String),
    #[error("plugin {0:?}'s role refuses its password, which was set anew less than a minute ago")]
    Login(String),
    #[error("could not set a new password for a plugin's role: {0}")]
    Rotate(String),
    #[error("plugin {0:?}'s sessions keep coming back with prepared statements made by SQL")]
    Tampered(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Begins, and says which backend, which transaction (its start, in microseconds), and how
/// many prepared statements SQL made since the last check (plugin code can still run at the
/// previous call's `COMMIT`: a deferred constraint trigger). It also releases session
/// advisory locks. The reads at both ends of a call are `obx_api` functions (migration
/// 0003), whose plans the session keeps: sent as text they were planned anew at every call.
const BEGIN: &str = "BEGIN; SELECT * FROM obx_api.call_begin()";
/// Sent before the commit, with the start of the call's transaction as `BEGIN` read it: it
/// raises [`ANOTHER_TRANSACTION`] if the transaction open now began at another time (a
/// plugin that ended the host's transaction itself is in another one, or in none), which ends
/// the round trip before its outbox rows, its answer and its `COMMIT`. It also releases
/// session advisory locks. Prepared statements are counted once per call, at the next
/// `BEGIN`: a statement SQL made during a call can only act within the plugin's own call, and
/// the session is closed before it serves another.
fn check(started: i64) -> String {
    format!("SELECT * FROM obx_api.call_check({started})")
}

/// The SQLSTATE of `obx_api.call_check` refusing to go on in a transaction that is not the
/// call's own (migration 0026).
const ANOTHER_TRANSACTION: &str = "OBX01";
/// Clears what a statement could leave on a session: cursors, `LISTEN`s, settings and the
/// role, temporary objects, sequence state. Sent after the `COMMIT` or `ROLLBACK`, in the
/// same round trip, so that it also clears what plugin code did during the commit.
const CLEAR: &str = "CLOSE ALL; UNLISTEN *; RESET ALL; RESET ROLE; DISCARD TEMP; DISCARD SEQUENCES";
/// A commit the host cut off: its round trip ran past the login's `commit_within`, and its
/// session was ended. Plugin code at the commit (a deferred trigger) ran on: unless the
/// commit record was written in time, the transaction is undone. See [`commit_cut`].
#[derive(Debug, thiserror::Error)]
#[error("the commit ran past {0:?}; its session was ended")]
pub struct CommitCut(pub Duration);

/// Whether `e` is a [`CommitCut`]. Plugin code that runs this long at one commit will
/// likely do so at the next: an event's or a timer's handling counts it as a failed attempt,
/// so that it is parked in the end rather than tried for ever. A command answers it as an
/// unknown outcome (the commit may have gone through).
pub fn commit_cut(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Io(io) if io.get_ref().is_some_and(|inner| inner.is::<CommitCut>()))
}

/// A lost race ([`super::lost_a_race`]) of a statement that a commit's round trip runs before
/// its `COMMIT`: the check, or the host's own writes (`PluginTx::write_at_commit`: the
/// outbox rows), which wait on the host's tables (a migration, an operator's `LOCK`), not on
/// anything plugin code did. It keeps the error's SQLSTATE and message, so that a command is
/// still answered `contention`; [`lost_before_commit`] tells it apart from plugin code that
/// lost at the `COMMIT` (a deferred trigger or check), which an event is charged for in the
/// end.
#[derive(Debug)]
struct BeforeCommit(Box<dyn sqlx::error::DatabaseError>);

impl std::fmt::Display for BeforeCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for BeforeCommit {}

impl sqlx::error::DatabaseError for BeforeCommit {
    fn message(&self) -> &str {
        self.0.message()
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.0.code()
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        self.0.kind()
    }
}

/// Whether `e` is a [`BeforeCommit`]: a commit's round trip that lost a race in one of the
/// host's statements, before its `COMMIT`.
pub fn lost_before_commit(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.try_downcast_ref::<BeforeCommit>().is_some())
}

/// A plugin statement or commit that takes this long is logged (by the host, without the
/// values it carried).
pub const SLOW_STATEMENT: Duration = Duration::from_secs(1);
/// How many sessions a call tries before it gives up on finding one that SQL left no
/// prepared statement on.
const BEGIN_ATTEMPTS: usize = 3;

impl Sessions {
    pub fn new(database_url: &str, host: PgPool, config: &DatabaseConfig) -> anyhow::Result<Sessions> {
        let base =
            PgConnectOptions::from_str(database_url).map_err(|e| anyhow::anyhow!("parsing the database URL: {e}"))?;
        Ok(Sessions {
            base,
            host,
            max_connections: config.plugin_max_connections,
            role_connection_limit: config.plugin_role_connections,
            acquire_timeout: config.acquire_timeout,
            pools: Mutex::new(HashMap::new()),
            rotated: Mutex::new(HashMap::new()),
            rotating: tokio::sync::Mutex::new(()),
        })
    }

    /// Records how plugin `name` logs in. A new login (a new role or password) gets a new
    /// pool; the old one closes once its sessions are returned.
    pub fn register(&self, name: &str, login: Login) {
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        if pools.get(name).is_some_and(|(current, _)| *current == login) {
            return;
        }
        let options = self
            .base
            .clone()
            .username(&login.role)
            .password(&login.password)
            .application_name(&format!("obx:{name}"))
            .options(login.settings.iter().map(|(k, v)| (*k, v)))
            // sqlx would log a slow statement's whole text, and the host's text on these
            // sessions carries event payloads and stored answers (the commit's round trip):
            // the host logs slow statements and commits itself, without their values.
            .disable_statement_logging();
        let pool = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .min_connections(0)
            // No ping before each call: it cost a round trip per call, and the call's
            // `BEGIN` finds a session whose backend is gone anyway (`try_begin` then tries
            // another). Host CPU per command -13 µs native, -26 µs Wasm.
            .test_before_acquire(false)
            .idle_timeout(Duration::from_secs(60))
            .acquire_timeout(self.acquire_timeout)
            .connect_lazy_with(options);
        if let Some((_, old)) = pools.insert(name.to_string(), (login, pool)) {
            tokio::spawn(async move { old.close().await });
        }
    }

    /// The most sessions a plugin's role may have, across all hosts (its `CONNECTION LIMIT`).
    pub fn role_connection_limit(&self) -> u32 {
        self.role_connection_limit
    }

    /// Begins a transaction on a session of plugin `name`. If the plugin's role no longer
    /// takes its password (a plugin can change its own), the host sets a new one, at most
    /// once a minute, and tries again.
    pub async fn begin(&self, name: &str) -> Result<PluginTx, SessionError> {
        Ok(self.begin_then(name, "").await?.0)
    }

    /// [`Sessions::begin`], then `statements` (host SQL as text, separated by `;`; see
    /// [`super::literal`]) in the same round trip; and the rows they returned.
    pub async fn begin_then(&self, name: &str, statements: &str) -> Result<(PluginTx, Vec<PgRow>), SessionError> {
        match self.try_begin(name, statements).await {
            Err(e) if refused_password(&e) => {
                self.rotate(name).await?;
                match self.try_begin(name, statements).await {
                    Err(e) if refused_password(&e) => Err(SessionError::Login(name.to_string())),
                    other => other,
                }
            }
            other => other,
        }
    }

    /// Sets a new password for plugin `name`'s role, unless another host of the service set
    /// one since (that one is taken) or this host set one less than a minute ago: then the
    /// caller tries again with that one (two calls that met the refusal at once, such as a
    /// command and a consumer, must not both fail), and a plugin that keeps changing its
    /// password cannot make the host keep resetting it.
    async fn rotate(&self, name: &str) -> Result<(), SessionError> {
        use super::login::Renewed;
        let _one_at_a_time = self.rotating.lock().await;
        let mut login = self.login(name)?;
        let recently = {
            let rotated = self.rotated.lock().unwrap_or_else(|e| e.into_inner());
            rotated.get(name).is_some_and(|t| t.elapsed() < Duration::from_secs(60))
        };
        let mut conn = self.host.acquire().await?;
        let renewed = super::login::renew(&mut conn, &login.role, &login.password, !recently).await;
        if !recently && !matches!(renewed, Ok(Renewed::Taken(_))) {
            // This host tried to set one (and may have failed): not again within the minute.
            let mut rotated = self.rotated.lock().unwrap_or_else(|e| e.into_inner());
            rotated.insert(name.to_string(), std::time::Instant::now());
        }
        login.password = match renewed.map_err(|e| SessionError::Rotate(format!("{e:#}")))? {
            Renewed::Kept => return Ok(()),
            Renewed::Taken(password) => password,
            Renewed::Set(password) => {
                tracing::warn!(plugin = name, role = %login.role, "the plugin's role refused its password; a new one is set");
                password
            }
        };
        self.register(name, login);
        Ok(())
    }

    fn login(&self, name: &str) -> Result<Login, SessionError> {
        self.pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|(login, _)| login.clone())
            .ok_or_else(|| SessionError::Unknown(name.to_string()))
    }

    async fn try_begin(&self, name: &str, then: &str) -> Result<(PluginTx, Vec<PgRow>), SessionError> {
        let (role, commit_within, pool) = self
            .pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|(login, pool)| (Arc::<str>::from(login.role.as_str()), login.commit_within, pool.clone()))
            .ok_or_else(|| SessionError::Unknown(name.to_string()))?;
        let mut last_gone = None;
        // Sessions are not pinged before use, so after a server restart every idle one is
        // gone: enough tries to get past all of them to a new one.
        let (mut tampered_left, mut gone_left) = (BEGIN_ATTEMPTS, self.max_connections as usize + 1);
        while tampered_left > 0 && gone_left > 0 {
            let mut conn = Opening(Some(pool.acquire().await?));
            // A plain string goes over the simple protocol: every statement in one round trip.
            let sql = if then.is_empty() {
                std::borrow::Cow::Borrowed(BEGIN)
            } else {
                std::borrow::Cow::Owned(format!("{BEGIN}; {then}"))
            };
            let sent = Instant::now();
            let rows = (&mut **conn).fetch_all(&*sql).await;
            warn_if_slow(&role, "begin", sent, rows.is_ok());
            let row = rows.and_then(|mut rows| {
                let first = rows.first().ok_or(sqlx::Error::RowNotFound)?;
                let read = (
                    first.try_get::<i32, _>(0)?,
                    first.try_get::<i64, _>(1)?,
                    first.try_get::<i64, _>(2)?,
                );
                rows.remove(0);
                Ok((read, rows))
            });
            match row {
                Ok(((pid, started, 0), rows)) => {
                    let tx = PluginTx {
                        conn: Some(conn.hand_over()),
                        pid,
                        started,
                        role,
                        host: self.host.clone(),
                        poisoned: false,
                        at_commit: String::new(),
                        at_commit_statements: 0,
                        undo_to: None,
                        commit_within,
                        committing: None,
                    };
                    return Ok((tx, rows));
                }
                Ok(_) => {
                    tampered(&role, "SQL made prepared statements on it");
                    conn.close_on_drop();
                    tampered_left -= 1;
                }
                // A pooled session whose backend is gone (terminated, or the server
                // restarted; a check before it was handed out can race the backend's exit):
                // a new session may do.
                Err(e) if session_gone(&e) => {
                    conn.close_on_drop();
                    last_gone = Some(e);
                    gone_left -= 1;
                }
                Err(e) => {
                    conn.close_on_drop();
                    return Err(e.into());
                }
            }
        }
        match last_gone {
            Some(e) => Err(e.into()),
            None => Err(SessionError::Tampered(name.to_string())),
        }
    }

    /// Closes every pool (at shutdown).
    pub async fn close(&self) {
        let pools: Vec<PgPool> = self
            .pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|(_, p)| p.clone())
            .collect();
        for pool in pools {
            pool.close().await;
        }
    }
}

/// Logs a host round trip on a plugin session (`step`: its `BEGIN`, with the call's
/// Idempotency-Key claim, or its commit) that took [`SLOW_STATEMENT`] or more: the role and
/// the duration, never the text, which carries the call's keys, payloads and answers.
fn warn_if_slow(role: &str, step: &'static str, sent: Instant, ok: bool) {
    let elapsed = sent.elapsed();
    if elapsed >= SLOW_STATEMENT {
        let elapsed_ms = elapsed.as_millis() as u64;
        tracing::warn!(role, step, elapsed_ms, ok, "a plugin session's round trip was slow");
    }
}

/// A pooled session on its way into a call's transaction: closed, never pooled, if it is
/// dropped before [`Opening::hand_over`]. A call cancelled while its `BEGIN` round trip waits
/// (for an Idempotency-Key that another call holds, say) would otherwise return the session
/// to the pool inside the transaction that round trip began, with its claim in it.
struct Opening(Option<PoolConnection<Postgres>>);

impl Opening {
    fn hand_over(mut self) -> PoolConnection<Postgres> {
        self.0.take().expect("handed over once")
    }
}

impl Deref for Opening {
    type Target = PoolConnection<Postgres>;
    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("open until handed over")
    }
}

impl DerefMut for Opening {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.0.as_mut().expect("open until handed over")
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

/// Whether the server refused the plugin role's password (`28P01`).
fn refused_password(e: &SessionError) -> bool {
    matches!(e, SessionError::Database(sqlx::Error::Database(d)) if d.code().as_deref() == Some("28P01"))
}

/// Whether `e` says the session's backend is gone: the connection closed, or the server
/// ended the session (`57P01` admin shutdown, `57P02` crash shutdown, `57P03` cannot
/// connect now).
fn session_gone(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(d) => matches!(d.code().as_deref(), Some("57P01" | "57P02" | "57P03")),
        _ => false,
    }
}

/// An open transaction on a plugin session. It derefs to the connection, for statements.
/// End it with [`PluginTx::commit`] or [`PluginTx::rollback`]; dropped without either, its
/// session is closed rather than returned to the pool.
pub struct PluginTx {
    conn: Option<PoolConnection<Postgres>>,
    pid: i32,
    /// When the transaction began (microseconds since the epoch, the server's clock).
    started: i64,
    role: Arc<str>,
    host: PgPool,
    /// The session may be in the middle of a result: it can only be abandoned.
    poisoned: bool,
    /// Host statements to run at the commit, in its round trip ([`PluginTx::write_at_commit`]).
    at_commit: String,
    /// How many statements `at_commit` holds: the `COMMIT` is the one after them, the check
    /// and the rollback to `undo_to`, if any.
    at_commit_statements: usize,
    /// A savepoint the commit rolls back to first, before its check.
    undo_to: Option<&'static str>,
    /// The longest the commit's round trip may take ([`Login::commit_within`]).
    commit_within: Duration,
    /// When the commit's round trip was sent, while it runs: dropped then (a request whose
    /// client went away), the transaction is let end rather than its backend ended.
    committing: Option<Instant>,
}

impl PluginTx {
    /// The plugin's role, which the session logged in as.
    pub fn role(&self) -> &str {
        &self.role
    }

    /// Commits and clears the session. An error Postgres sends after the `COMMIT` completed
    /// leaves it standing: `Ok`, and the session is closed. On an error before that, the
    /// session is closed, and nothing was committed if the error was the statement's own;
    /// if the server or the connection failed (a shutdown, a terminated backend, or the round
    /// trip ran past [`Login::commit_within`] and the host ended the backend), the commit may
    /// have gone through.
    pub async fn commit(mut self) -> sqlx::Result<()> {
        if self.poisoned {
            return Err(sqlx::Error::Protocol("the plugin session was abandoned".into()));
        }
        self.finish(true).await
    }

    /// Bounds the commit's round trip by `d` instead of [`Login::commit_within`] (a plugin's
    /// migrations, whose statements are not held to a handler's timeout either).
    pub fn commit_within(&mut self, d: Duration) {
        self.commit_within = d;
    }

    /// Has the commit run `statement` (one statement of host SQL, as text: see
    /// [`crate::db::literal`]) just before its `COMMIT`, in the same round trip, after those
    /// given before it. A statement that fails fails the commit. A rollback drops them unrun.
    pub fn write_at_commit(&mut self, mut statement: String) {
        self.at_commit_statements += 1;
        statement.push_str("; ");
        if self.at_commit.is_empty() {
            // The common case, one statement: kept as it is, not copied.
            self.at_commit = statement;
        } else {
            self.at_commit.push_str(&statement);
        }
    }

    /// Has the commit roll back to `savepoint` first, in the same round trip, before its
    /// check: the work since the savepoint does not commit, and the commit runs even in a
    /// transaction a failed statement aborted after it. Sent as text, never as a named
    /// statement of the session's cache, whose name plugin SQL could have taken for one of
    /// its own (`DEALLOCATE`, then `PREPARE`).
    pub fn undo_at_commit_to(&mut self, savepoint: &'static str) {
        self.undo_to = Some(savepoint);
    }

    /// Rolls back and clears the session. On error the session is closed.
    pub async fn rollback(mut self) -> sqlx::Result<()> {
        if self.poisoned {
            return Ok(());
        }
        self.finish(false).await
    }

    /// Ends the transaction and clears the session in one round trip, after the commit or
    /// rollback, so that what plugin code did during a commit is cleared too. Before a
    /// commit, [`check`] refuses to go on if the plugin ended the host's transaction itself:
    /// nothing more of the round trip runs, the commit fails, and the session is closed. The
    /// statements given to [`PluginTx::write_at_commit`] run after the check, before the
    /// `COMMIT`. An error after
    /// the `COMMIT` completed (a cancel a sibling session of the plugin sent, a statement
    /// timeout the plugin set, a shutdown in the clearing) leaves the commit standing: the
    /// session is closed, and the commit is answered as done.
    async fn finish(&mut self, commit: bool) -> sqlx::Result<()> {
        let conn = self.conn.as_mut().expect("open until consumed");
        if commit {
            let at_commit = std::mem::take(&mut self.at_commit);
            let sent = Instant::now();
            let undo = self
                .undo_to
                .map_or(String::new(), |sp| format!("ROLLBACK TO SAVEPOINT {sp}; "));
            let before_check = usize::from(self.undo_to.is_some());
            let sql = format!("{undo}{}; {at_commit}COMMIT; {CLEAR}", check(self.started));
            let before_commit = before_check + 1 + std::mem::take(&mut self.at_commit_statements);
            let round_trip = commit_round_trip(conn, &sql, before_check, before_commit);
            self.committing = Some(sent);
            let reply = tokio::time::timeout(self.commit_within, round_trip).await;
            self.committing = None;
            let Ok(reply) = reply else {
                // Plugin code at the commit (a deferred trigger) that runs on: `Drop` ends the
                // backend, which undoes the transaction unless its commit record was written.
                self.poisoned = true;
                warn_if_slow(&self.role, "commit", sent, false);
                return Err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    CommitCut(self.commit_within),
                )));
            };
            warn_if_slow(&self.role, "commit", sent, reply.is_ok());
            let undoing = self.undo_to.is_some();
            let reply = reply.inspect_err(|e| {
                if let sqlx::Error::Database(db) = e {
                    // With a rollback to the host's savepoint first, a transaction the plugin
                    // ended fails there: no transaction (25P01), or no such savepoint (3B001).
                    let code = db.code();
                    let ended = code.as_deref() == Some(ANOTHER_TRANSACTION)
                        || (undoing && matches!(code.as_deref(), Some("25P01" | "3B001")));
                    if ended {
                        tampered(&self.role, "the plugin ended the host's transaction itself");
                    }
                }
            })?;
            if reply.started != Some(self.started) {
                tampered(&self.role, "the plugin ended the host's transaction itself");
                // `Drop` closes it.
                return Ok(());
            }
            if let Some(e) = reply.after_commit {
                let role = &*self.role;
                tracing::warn!(role, error = %e, "a plugin session failed after its commit, which stands; the session is closed");
                // `Drop` closes it.
                return Ok(());
            }
        } else {
            // Session advisory locks outlive a rollback: released here, not at the next call's
            // `BEGIN`, so that an idle pooled session holds none in the server's shared lock
            // table. (A commit's check released those taken before it; plugin code at the
            // `COMMIT` may take more, kept until the next call's `BEGIN`.)
            (&mut **conn)
                .execute(format!("ROLLBACK; {CLEAR}; SELECT pg_catalog.pg_advisory_unlock_all()").as_str())
                .await?;
        }
        // Clean: back to the pool. On error, `Drop` closes it instead.
        drop(self.conn.take());
        Ok(())
    }

    /// Marks the session as unusable: it may be in the middle of a result or a statement.
    /// It is then closed and its backend terminated, never drained.
    pub fn poison(&mut self) {
        self.poisoned = true;
    }

    /// Whether the session was abandoned: it takes no more statements.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// Closes the session at once and terminates its backend, which may still be running a
    /// statement (a call killed at its deadline, a result too large to read).
    pub fn abandon(mut self) {
        self.poisoned = true;
    }
}

/// What a commit's round trip came to, once its `COMMIT` completed.
struct CommitReply {
    /// The first column of the check's row: its reading of when the transaction began.
    started: Option<i64>,
    /// An error from a statement after the `COMMIT` (the clearing).
    after_commit: Option<sqlx::Error>,
}

/// Runs `sql` (statements in one simple query, the check the one after the first
/// `before_check`, the `COMMIT` the one after the first `before_commit`) and tells whether
/// its `COMMIT` completed: each statement that completes sends its own completion, so an
/// error after `before_commit + 1` of them came after the commit. An error at or before the
/// `COMMIT` is returned: nothing was committed. A lost race before the `COMMIT` is returned
/// as a [`BeforeCommit`].
async fn commit_round_trip(
    conn: &mut PgConnection,
    sql: &str,
    before_check: usize,
    before_commit: usize,
) -> sqlx::Result<CommitReply> {
    use futures::StreamExt;
    let mut results = conn.fetch_many(sql);
    let (mut started, mut completed) = (None, 0);
    while let Some(item) = results.next().await {
        match item {
            Ok(sqlx::Either::Left(_)) => completed += 1,
            Ok(sqlx::Either::Right(row)) if completed == before_check && started.is_none() => {
                // Read on to the end whatever it holds: what the COMMIT came to decides.
                started = row.try_get(0).ok();
            }
            Ok(sqlx::Either::Right(_)) => {}
            Err(e) if completed > before_commit => {
                return Ok(CommitReply {
                    started,
                    after_commit: Some(e),
                });
            }
            Err(sqlx::Error::Database(db)) if completed < before_commit && super::lost_a_race_code(db.code()) => {
                return Err(sqlx::Error::Database(Box::new(BeforeCommit(db))));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(CommitReply {
        started,
        after_commit: None,
    })
}

/// Reports a session a plugin tampered with (`how`): it is closed, never reused.
fn tampered(role: &str, how: &str) {
    tracing::warn!(role, how, "a plugin tampered with its session; it is closed");
    metrics::counter!("obx_plugin_sessions_tampered_total", "role" => role.to_string()).increment(1);
}

/// Closes a session without reading what it may still send, and terminates its backend.
fn terminate(mut conn: PoolConnection<Postgres>, pid: i32, role: Arc<str>, host: PgPool) {
    conn.close_on_drop();
    drop(conn);
    tokio::spawn(async move {
        // Only a session of this plugin: the pid may already belong to another backend.
        let ended = match host.acquire().await {
            Ok(mut conn) => super::end_plugin_backends(&mut conn, &[(pid, role.to_string())]).await,
            Err(e) => Err(e),
        };
        match ended {
            // A closed pool: the host is stopping, and Postgres ends the backend with its socket.
            Ok(_) | Err(sqlx::Error::PoolClosed) => {}
            Err(e) => tracing::warn!(role = &*role, pid, error = %e, "ending an abandoned plugin session failed"),
        }
    });
}

impl Deref for PluginTx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn.as_ref().expect("open until consumed")
    }
}

impl DerefMut for PluginTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("open until consumed")
    }
}

impl Drop for PluginTx {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if let Some(sent) = self.committing {
            // Dropped with its commit sent (hyper drops a request's work when its client
            // goes): the commit is let end, within the commit's bound, and the session closed.
            // Ended mid-`COMMIT`, the backend undid the transaction or not, as it happened.
            let within = self.commit_within.saturating_sub(sent.elapsed());
            let (pid, role, host) = (self.pid, self.role.clone(), self.host.clone());
            tokio::spawn(async move {
                let mut conn = conn;
                // Reads the rest of the commit's round trip first.
                match tokio::time::timeout(within, conn.ping()).await {
                    Ok(Ok(())) => {
                        conn.close_on_drop();
                        drop(conn);
                    }
                    _ => terminate(conn, pid, role, host),
                }
            });
            return;
        }
        // Still in its transaction: never back to the pool. It may also be running a
        // statement (a caller cut off by its own deadline), which a closed socket stops only
        // as soon as the backend checks, on a setting the plugin may have changed: ended.
        terminate(conn, self.pid, self.role.clone(), self.host.clone());
    }
}

#[cfg(test)]
mod tests {
    use sqlx::{Connection, Executor, PgConnection};

    use super::commit_round_trip;
    use crate::db::embedded::EmbeddedPostgres;

    async fn rows(conn: &mut PgConnection) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM t")
            .fetch_one(conn)
            .await
            .unwrap()
    }

    /// A transaction's commit round trip: the check's row, `before`, the `COMMIT`, then two
    /// statements that clear, the second `after`.
    async fn commit(conn: &mut PgConnection, before: &str, after: &str) -> sqlx::Result<super::CommitReply> {
        conn.execute("BEGIN").await.unwrap();
        let sql = format!("SELECT 42::int8; {before}; COMMIT; SELECT 1; {after}");
        commit_round_trip(conn, &sql, 0, 2).await
    }

    /// The commit's round trip tells an error after its `COMMIT` (which stands) from one at
    /// or before it (nothing committed), by the statements that completed before the error.
    #[tokio::test]
    async fn an_error_after_the_commit_leaves_it_standing_and_one_before_it_does_not() {
        let pg = EmbeddedPostgres::start(&[]).unwrap();
        let mut conn = PgConnection::connect(&pg.url("postgres")).await.unwrap();
        conn.execute("CREATE TABLE t (n int)").await.unwrap();
        let (write, fail) = ("INSERT INTO t VALUES (1)", "SELECT 1/0");

        let reply = commit(&mut conn, write, "SELECT 2").await.unwrap();
        assert_eq!(reply.started, Some(42));
        assert!(reply.after_commit.is_none());
        assert_eq!(rows(&mut conn).await, 1);

        let reply = commit(&mut conn, write, fail).await.unwrap();
        assert_eq!(reply.started, Some(42));
        let e = reply.after_commit.expect("the error after the commit");
        assert!(e.to_string().contains("division by zero"), "{e}");
        assert_eq!(rows(&mut conn).await, 2, "the commit stands");

        let e = commit(&mut conn, fail, "SELECT 2")
            .await
            .err()
            .expect("a failed commit");
        assert!(e.to_string().contains("division by zero"), "{e}");
        conn.execute("ROLLBACK").await.unwrap();
        assert_eq!(rows(&mut conn).await, 2, "nothing committed");
    }

    /// With a rollback to a savepoint before the check (a keyed rejection's commit), the
    /// check's row is still the one read, and the counts still tell an error before the
    /// `COMMIT` from one after it; what came after the savepoint does not commit.
    #[tokio::test]
    async fn a_rollback_to_a_savepoint_before_the_check_keeps_the_counts() {
        let pg = EmbeddedPostgres::start(&[]).unwrap();
        let mut conn = PgConnection::connect(&pg.url("postgres")).await.unwrap();
        conn.execute("CREATE TABLE t (n int)").await.unwrap();
        let commit_undone = |before: &'static str, after: &'static str| {
            format!("ROLLBACK TO SAVEPOINT s; SELECT 42::int8; {before}; COMMIT; SELECT 1; {after}")
        };
        let begin = "BEGIN; INSERT INTO t VALUES (1); SAVEPOINT s; INSERT INTO t VALUES (2); SELECT 1/0";

        let _ = conn.execute(begin).await.expect_err("the handler's failed statement");
        let sql = commit_undone("INSERT INTO t VALUES (3)", "SELECT 2");
        let reply = commit_round_trip(&mut conn, &sql, 1, 3).await.unwrap();
        assert_eq!(reply.started, Some(42));
        assert!(reply.after_commit.is_none());
        let kept: Vec<i32> = sqlx::query_scalar("SELECT n FROM t ORDER BY n")
            .fetch_all(&mut conn)
            .await
            .unwrap();
        assert_eq!(kept, vec![1, 3], "the work after the savepoint committed");

        let _ = conn.execute(begin).await.expect_err("the handler's failed statement");
        let sql = commit_undone("INSERT INTO t VALUES (4)", "SELECT 1/0");
        let reply = commit_round_trip(&mut conn, &sql, 1, 3).await.unwrap();
        assert_eq!(reply.started, Some(42));
        assert!(reply.after_commit.is_some(), "the error after the commit");

        let _ = conn.execute(begin).await.expect_err("the handler's failed statement");
        let sql = commit_undone("SELECT 1/0", "SELECT 2");
        assert!(
            commit_round_trip(&mut conn, &sql, 1, 3).await.is_err(),
            "an error before the commit"
        );
        conn.execute("ROLLBACK").await.unwrap();
        assert_eq!(rows(&mut conn).await, 4, "nothing more committed");
    }
}
