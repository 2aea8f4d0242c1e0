//! Postgres: the host's connections and schema (`migrations/`), plugins' login roles
//! ([`login`]), the sessions plugins run on ([`sessions`]), and the constants of the host's
//! writes at their commits ([`literal`]). Each plugin's schema and migrations are prepared
//! by `runtime::plugin_schema`, which builds on these.
//!
//! Invariants:
//! * Host connections pin `search_path` to `obx`: no user or schema name can redirect the
//!   host's statements (the default `"$user", public` would put a schema named like the
//!   host's user first). Host statements name host tables with `obx.` all the same.
//! * Host connections never run plugin statements; plugin statements run only on plugin
//!   sessions ([`sessions`]).

pub mod embedded;
pub mod installation;
pub mod literal;
pub mod locks;
pub mod login;
pub mod scram;
pub mod sessions;

use std::str::FromStr;

use anyhow::{Context, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::config::DatabaseConfig;

/// The host's schema migrations, embedded from `migrations/` at build time. A newer host of
/// the service may have migrated the schema already (a rolling upgrade, and this host
/// restarted meanwhile): its migrations keep the previous version working, so this host
/// starts on them rather than refuse ([`migrate`] says so in the log).
pub fn migrator() -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("../migrations");
    migrator.set_ignore_missing(true);
    migrator
}

/// Whether a failed commit was refused for what its transaction holds, which would refuse it
/// the same way at every try: a deferred constraint, the error of a deferred trigger, a row
/// the host writes at the commit. Not when the connection or the server failed (SQLSTATE
/// classes 08, 53, 57 but a statement timeout, 58 and XX, or an error with no SQLSTATE), nor
/// when the transaction lost to a concurrent one (class 40, a lock timeout): a retry can cure
/// those. A plugin's trigger could raise one of those codes itself; that only has its own
/// work retried.
pub fn refused_for_content(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    let Some(code) = db.code() else {
        return false;
    };
    match code.get(..2) {
        Some("08" | "40" | "53" | "58" | "XX") => false,
        Some("57") => code == "57014",
        Some("55") => code != "55P03",
        _ => true,
    }
}

/// Whether a transaction lost to a concurrent one (SQLSTATE class 40: a serialization
/// failure, a deadlock) or gave up waiting for a lock (55P03): it was undone, and a retry may
/// pass.
pub fn lost_a_race(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if lost_a_race_code(d.code()))
}

/// Whether a SQLSTATE is a lost race's (see [`lost_a_race`]).
fn lost_a_race_code(code: Option<std::borrow::Cow<'_, str>>) -> bool {
    code.is_some_and(|c| c.starts_with("40") || c == "55P03")
}

/// Whether a statement waited its `lock_timeout` for a lock and gave up (SQLSTATE 55P03).
pub fn lock_timed_out(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("55P03"))
}

/// Whether Postgres refused a value sent to it (SQLSTATE class 22, data exception, as `jsonb`
/// refuses a lone surrogate escape or a number past `numeric`'s range; 54001, a value nested
/// too deep to parse): sent again, it is refused again.
pub fn refused_value(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    db.code().is_some_and(|code| code.starts_with("22") || code == "54001")
}

/// `text` as a Postgres `text` or `jsonb` string can hold it: a NUL, which neither can,
/// becomes U+FFFD. For what the host records of others' words: a handler's error, a
/// message's headers.
pub fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        text.replace('\0', "\u{FFFD}").into()
    } else {
        text.into()
    }
}

/// Whether work that failed with `e` may succeed if tried again as it is: the connection or
/// the server failed (an I/O error, the pool, SQLSTATE class 08, an administrator's
/// shutdown or crash recovery: 57P01–57P03, too many connections: 53300), or it lost to
/// concurrent work (class 40, a lock timeout: 55P03). Everything else is taken for a refusal
/// of what was sent, which would come back the same. Not the inverse of
/// [`refused_for_content`]: between the two lie errors neither names (a disk full, an
/// internal error), which a load leaves until its file changes and a commit retries.
pub fn may_pass(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            matches!(code.get(..2), Some("08" | "40"))
                || matches!(&*code, "57P01" | "57P02" | "57P03" | "53300" | "55P03")
        }),
        _ => false,
    }
}

/// The options of every host connection to `url`: named `name` in `pg_stat_activity`, with
/// the search path pinned to `obx`.
pub fn host_options(url: &str, name: &str) -> Result<PgConnectOptions> {
    Ok(PgConnectOptions::from_str(url)
        .context("parsing the database URL")?
        .application_name(name)
        .options([("search_path", "obx")]))
}

/// `options` for a connection whose session holds leases (advisory locks: the relay's
/// shards, a consumer's partitions). A host process that dies takes its sessions with it at
/// once; a host machine that vanishes, or a network partition, leaves the server holding the
/// session, and its locks, until TCP keepalives give up: the kernel's default waits two
/// hours, these about 8 s (ignored on Unix sockets, where a dead peer is noticed at once).
pub fn lease_holder(options: PgConnectOptions) -> PgConnectOptions {
    options.options([
        ("tcp_keepalives_idle", "5"),
        ("tcp_keepalives_interval", "1"),
        ("tcp_keepalives_count", "3"),
        ("tcp_user_timeout", "8000"),
    ])
}

/// Opens the host's pool.
pub async fn connect(url: &str, cfg: &DatabaseConfig) -> Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(cfg.max_connections)
        .acquire_timeout(cfg.acquire_timeout)
        .connect_with(host_options(url, "obx")?)
        .await
        .context("connecting to Postgres")
}

/// How many sessions the admin API's pool ([`connect_admin`]) may hold.
pub const ADMIN_CONNECTIONS: u32 = 2;

/// A small pool, apart from the host's, for what the admin API reads and repairs
/// (`/v1/status`, `/v1/dlq`, `/v1/timers`, `/v1/quarantine`, replays): a dashboard's slow
/// counts can hold at most [`ADMIN_CONNECTIONS`] sessions, never the connections the relay,
/// the consumers, the timers and `/readyz` need, and Postgres ends each statement at
/// `statement_timeout` (the request's timeout) instead of running it on after its request
/// was answered. Connected when first used.
pub fn connect_admin(url: &str, cfg: &DatabaseConfig, statement_timeout: std::time::Duration) -> Result<PgPool> {
    let timeout = statement_timeout.as_millis().max(1).to_string();
    Ok(PgPoolOptions::new()
        .max_connections(ADMIN_CONNECTIONS)
        .acquire_timeout(cfg.acquire_timeout)
        .connect_lazy_with(host_options(url, "obx-admin")?.options([("statement_timeout", timeout)])))
}

/// Applies the host's migrations. Safe to run from several hosts at once: sqlx takes an
/// advisory lock around them. sqlx's own table lives in `obx` (see [`adopt_legacy_history`]).
pub async fn migrate(pool: &PgPool) -> Result<()> {
    let mut conn = pool.acquire().await?;
    // sqlx creates its table in the first schema of the (pinned) search path.
    for attempt in 1.. {
        match sqlx::query("CREATE SCHEMA IF NOT EXISTS obx").execute(&mut *conn).await {
            Ok(_) => break,
            // Another host created it at the same moment.
            Err(e) if attempt < 3 && is_unique_violation(&e) => continue,
            Err(e) => {
                return Err(e).context(
                    "creating schema obx (the host's database user needs CREATE on the database, \
                     see docs/operations.md)",
                )
            }
        }
    }
    adopt_legacy_history(&mut conn).await?;
    warn_of_newer_schema(&mut conn).await;
    // sqlx waits for its lock with no bound, and a plugin session (one past the SQL policy)
    // can take it: its key is public. Such sessions are ended, and the wait is bounded so
    // that one that takes the lock again meanwhile is ended too; another host applying the
    // migrations is waited for.
    sqlx::query("SET lock_timeout = '5s'").execute(&mut *conn).await?;
    let run = run_migrations(&mut conn).await;
    sqlx::query("RESET lock_timeout").execute(&mut *conn).await?;
    run?;
    revoke_temporary(&mut conn).await;
    revoke_create(&mut conn).await;
    Ok(())
}

/// Runs sqlx's migrator on `conn` (whose `lock_timeout` bounds each wait), ending plugin
/// sessions that hold its lock before each attempt.
async fn run_migrations(conn: &mut sqlx::PgConnection) -> Result<()> {
    use sqlx::migrate::MigrateError;
    let mut attempt = 0;
    loop {
        evict_migration_lock_holders(conn).await?;
        let run = migrator().run(&mut *conn).await;
        // The lock, or a migration's own (its statements wait as long for a table's lock;
        // the migration rolled back, and goes again).
        let waited = match &run {
            Err(MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _)) => lock_timed_out(e),
            _ => false,
        };
        if !waited || attempt >= MIGRATION_LOCK_ATTEMPTS {
            return run.context("applying the host's migrations");
        }
        // sqlx leaves its lock held when a migration fails after taking it: let it go, or the
        // next attempt holds it twice and its one unlock leaves it on a pooled connection.
        sqlx::query("SELECT pg_catalog.pg_advisory_unlock_all()")
            .execute(&mut *conn)
            .await?;
        attempt += 1;
        tracing::info!(
            attempt,
            "waiting for a lock to apply the host's migrations (another host applying them?)"
        );
    }
}

/// How many 5 s waits for the migration lock a host makes before it gives up.
const MIGRATION_LOCK_ATTEMPTS: u32 = 60;

/// The first rows of a query's stream whose `weight` adds up to `max_bytes` at most (the first
/// row always), and whether the stream had more. The rest is read and dropped (Postgres sends
/// every row a query asks for), so that a batch of large rows holds a bounded amount of memory.
pub async fn take_within<T, S>(
    mut rows: S,
    max_bytes: usize,
    weight: impl Fn(&T) -> usize,
) -> sqlx::Result<(Vec<T>, bool)>
where
    S: futures::Stream<Item = sqlx::Result<T>> + Unpin,
{
    use futures::TryStreamExt;
    let (mut kept, mut bytes) = (Vec::new(), 0usize);
    while let Some(row) = rows.try_next().await? {
        bytes = bytes.saturating_add(weight(&row));
        if !kept.is_empty() && bytes > max_bytes {
            return Ok((kept, true));
        }
        kept.push(row);
    }
    Ok((kept, false))
}

/// The rows the next read of a batch asks Postgres for, after one that asked for `limit` and
/// kept `kept` rows of `kept_bytes` ([`take_within`]). A batch cut by its bytes was read whole
/// all the same (the rest dropped), so the next asks for as many rows as fitted; a full batch
/// well within its bytes asks for twice as many, up to `most_rows`. A backlog of large rows
/// thus costs the database about what the host keeps.
pub fn next_take_limit(
    limit: u32,
    kept: usize,
    kept_bytes: usize,
    cut: bool,
    most_rows: u32,
    most_bytes: usize,
) -> u32 {
    let rows = kept as u32;
    if cut {
        rows.max(1)
    } else if rows >= limit && kept_bytes <= most_bytes / 2 {
        limit.saturating_mul(2).min(most_rows)
    } else {
        limit
    }
}

/// Ends each plugin session that holds sqlx's migration lock. Plugins have no use for
/// advisory locks (the SQL policy refuses them), and this one stops every host's start.
async fn evict_migration_lock_holders(conn: &mut sqlx::PgConnection) -> Result<()> {
    let (database, installed): (String, bool) =
        sqlx::query_as("SELECT current_database()::text, to_regclass('obx.plugin_credential') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    if !installed {
        // A database OBX never migrated has no plugin roles.
        return Ok(());
    }
    let lock = "l.objsubid = 1 AND ((l.classid::int8 << 32) | l.objid::int8) = ANY($1)";
    for role in terminate_plugin_holders(conn, lock, &[migration_lock_key(&database)]).await? {
        tracing::warn!(
            role,
            "a plugin session held the host's migration lock; it was terminated"
        );
    }
    Ok(())
}

/// Terminates each plugin session that holds an advisory lock in this database matching
/// `lock` (a condition on `pg_locks l`, with `keys` as `$1`), and names their roles. A plugin
/// session is one of a role this installation made for a plugin (`obx.plugin_credential`),
/// not merely one the host is a member of: a superuser host is a member of every role, and
/// another host of another service may run as an `obx_…` user. One statement when no plugin
/// session holds such a lock, as at nearly every step.
pub(crate) async fn terminate_plugin_holders(
    conn: &mut sqlx::PgConnection,
    lock: &str,
    keys: &[i64],
) -> sqlx::Result<Vec<String>> {
    let sql = format!(
        "SELECT DISTINCT a.pid, a.usename::text \
         FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND ({lock}) \
           AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
           AND a.usename IN (SELECT c.role_name FROM obx.plugin_credential c)"
    );
    let holders: Vec<(i32, String)> = sqlx::query_as(&sql).bind(keys).fetch_all(&mut *conn).await?;
    if holders.is_empty() {
        return Ok(Vec::new());
    }
    // A failure here (another host granting the same membership at that moment, say) is for
    // the next step to mend: the caller's leases and shards are not at stake.
    match end_plugin_backends(conn, &holders).await {
        Ok(ended) => Ok(ended),
        Err(e) => {
            tracing::warn!(error = %e, "ending plugin sessions that hold the host's locks failed; tried again at the next step");
            Ok(Vec::new())
        }
    }
}

/// Ends the backends of plugin sessions (`pid`, role), each only if it is still a session of
/// that role (a pid may have gone to another backend since), and names the roles of those
/// ended. `pg_terminate_backend` needs the role's privileges, which a plugin can take from the
/// host ([`reclaim_privileges`]): they are granted again first, in the same transaction, where
/// the plugin cannot revoke them before the sessions end.
pub(crate) async fn end_plugin_backends(
    conn: &mut sqlx::PgConnection,
    sessions: &[(i32, String)],
) -> sqlx::Result<Vec<String>> {
    use sqlx::Connection;
    let (pids, mut roles): (Vec<i32>, Vec<String>) = sessions.iter().cloned().unzip();
    roles.sort();
    roles.dedup();
    let mut tx = conn.begin().await?;
    for role in reclaim_privileges(&mut tx, &roles).await? {
        tracing::warn!(
            role,
            "the host had lost its membership in a plugin's role; it is granted again"
        );
    }
    // Materialized first, so that nothing but a plugin session can reach the terminate call.
    let ended = sqlx::query_scalar(
        "WITH s AS MATERIALIZED ( \
             SELECT a.pid, a.usename::text AS role FROM pg_catalog.pg_stat_activity a \
             JOIN unnest($1::int4[], $2::text[]) AS w(pid, role) ON a.pid = w.pid AND a.usename = w.role) \
         SELECT role FROM s WHERE pg_catalog.pg_terminate_backend(pid)",
    )
    .bind(&pids)
    .bind(sessions.iter().map(|(_, r)| r.as_str()).collect::<Vec<_>>())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(ended)
}

/// Grants the host each of `roles` it has not the privileges of (USAGE: a membership that
/// inherits), and names those granted. The host needs them to create a plugin's schema for it
/// and to end its sessions. On Postgres 15 and older a role may revoke membership in itself
/// while it is its session's user, as a plugin's session always is
/// (`tests/confinement.rs` `a_plugin_that_revokes_the_hosts_membership_in_its_role_is_still_ended`);
/// on 16 and later, the membership a CREATEROLE user gets in the roles it creates inherits
/// nothing. Names were validated as `[a-z][a-z0-9_]*` (role names the host made).
pub(crate) async fn reclaim_privileges(conn: &mut sqlx::PgConnection, roles: &[String]) -> sqlx::Result<Vec<String>> {
    let lost: Vec<String> = sqlx::query_scalar(
        "SELECT r FROM unnest($1::text[]) AS r WHERE NOT pg_catalog.pg_has_role(current_user, r, 'USAGE')",
    )
    .bind(roles)
    .fetch_all(&mut *conn)
    .await?;
    for role in &lost {
        let grant = format!("GRANT \"{}\" TO CURRENT_USER", role.replace('"', "\"\""));
        sqlx::query(&grant).persistent(false).execute(&mut *conn).await?;
    }
    Ok(lost)
}

/// The key of sqlx's migration lock on `database` (sqlx's `generate_lock_id`: a CRC-32 of the
/// name, times a constant).
pub fn migration_lock_key(database: &str) -> i64 {
    let mut crc = !0u32;
    for &byte in database.as_bytes() {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    0x3d32_ad9e * i64::from(!crc)
}

/// Says so when the database holds host migrations newer than this host's own.
async fn warn_of_newer_schema(conn: &mut sqlx::PgConnection) {
    let ours = migrator().iter().map(|m| m.version).max().unwrap_or(0);
    let newer: sqlx::Result<Option<i64>> =
        sqlx::query_scalar("SELECT max(version) FROM obx._sqlx_migrations WHERE version > $1 AND success")
            .bind(ours)
            .fetch_one(&mut *conn)
            .await;
    if let Ok(Some(newest)) = newer {
        tracing::warn!(
            ours,
            newest,
            "a newer host has migrated the database past this host's migrations; this host runs \
             on the newer schema, which keeps the previous version working (upgrade this host)"
        );
    }
}

/// Hosts before 0.2 kept sqlx's history in the first schema of the default search path,
/// usually `public`. If it is there (and it is ours: migration 1 with our checksum), move it
/// to `obx`, so that the migrations are not applied a second time.
async fn adopt_legacy_history(conn: &mut sqlx::PgConnection) -> Result<()> {
    let migrator = migrator();
    let first = migrator.iter().next().context("no host migrations")?;
    let legacy: Option<String> = sqlx::query_scalar(
        "SELECT n.nspname::text FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relname = '_sqlx_migrations' AND n.nspname <> 'obx' AND c.relkind = 'r' \
         ORDER BY n.nspname = 'public' DESC LIMIT 1",
    )
    .fetch_optional(&mut *conn)
    .await?;
    let Some(schema) = legacy else {
        return Ok(());
    };
    let table = format!("\"{}\"._sqlx_migrations", schema.replace('"', "\"\""));
    let ours: bool = sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM {table} WHERE version = $1 AND checksum = $2)"
    ))
    .bind(first.version)
    .bind(first.checksum.as_ref())
    .fetch_one(&mut *conn)
    .await
    .unwrap_or(false);
    let ours_here: bool = sqlx::query_scalar(
        "SELECT to_regclass('obx._sqlx_migrations') IS NOT NULL \
         AND EXISTS (SELECT 1 FROM obx._sqlx_migrations WHERE version = $1)",
    )
    .bind(first.version)
    .fetch_one(&mut *conn)
    .await
    .unwrap_or(false);
    if !ours || ours_here {
        return Ok(());
    }
    tracing::info!(from = %schema, "moving the host's migration history into schema obx");
    let moved = format!("BEGIN; DROP TABLE IF EXISTS obx._sqlx_migrations; ALTER TABLE {table} SET SCHEMA obx; COMMIT");
    sqlx::Executor::execute(&mut *conn, moved.as_str())
        .await
        .context("moving the host's migration history into schema obx")?;
    Ok(())
}

/// Refuses a server that allows prepared transactions (`max_prepared_transactions` above 0).
/// A prepared transaction outlives its session and keeps its locks and its snapshot: a
/// plugin's SQL (past the SQL policy, which refuses transaction control) could prepare one
/// holding the relay's locks, which no session holds then and only its owner or a superuser
/// can end, halting publishing for every plugin and vacuum for the whole server.
pub async fn refuse_prepared_transactions(pool: &PgPool) -> Result<()> {
    let allowed: String = sqlx::query_scalar("SELECT pg_catalog.current_setting('max_prepared_transactions')")
        .fetch_one(pool)
        .await?;
    if allowed != "0" {
        anyhow::bail!(
            "the Postgres server allows prepared transactions (max_prepared_transactions = {allowed}): a plugin \
             could leave one behind holding the host's locks, which the host cannot end; set \
             max_prepared_transactions = 0 on the server (it is the default), or give OBX a server of its own"
        );
    }
    Ok(())
}

/// Temporary tables are searched before a session's own schema, and outlive a transaction:
/// plugin roles must not be able to create them. Only the database's owner can revoke the
/// right from `PUBLIC`; otherwise say what the operator should do.
async fn revoke_temporary(conn: &mut sqlx::PgConnection) {
    if !public_has_temp(&mut *conn).await {
        return;
    }
    // A non-owner's REVOKE only warns, so check again after it.
    let _ = sqlx::Executor::execute(
        &mut *conn,
        "DO $$ BEGIN EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database()); END $$",
    )
    .await;
    if public_has_temp(&mut *conn).await {
        tracing::warn!(
            "PUBLIC may create temporary tables in this database; run `REVOKE TEMPORARY ON \
             DATABASE <db> FROM PUBLIC` as its owner. Plugin sessions drop any they create, and \
             the SQL policy refuses them, but the database should refuse them too"
        );
    }
}

/// A schema where `PUBLIC` may create objects (`public` on a Postgres before 15, or on a
/// cluster upgraded from one), or a database where it may create schemas, lets a plugin keep
/// tables and functions outside its own schema: state the host never clears, and traps for
/// anyone whose `search_path` reaches them (a function named like a built-in, run by an
/// administrator). The host revokes the right on `public`, on the schemas its role owns and
/// on the database, where it may (it owns them; on a Postgres before 15 a superuser owns
/// `public`); otherwise it says what the operator should do. Other applications' schemas in
/// the database are theirs: the host only warns of them.
async fn revoke_create(conn: &mut sqlx::PgConnection) {
    let before = public_may_create_in(&mut *conn).await;
    if before.is_empty() {
        return;
    }
    // A non-owner's REVOKE only warns, so check again after it.
    let _ = sqlx::Executor::execute(
        &mut *conn,
        "DO $$ DECLARE s text; BEGIN \
           FOR s IN SELECT nspname FROM pg_catalog.pg_namespace \
                    WHERE has_schema_privilege('public', oid, 'CREATE') \
                      AND (nspname = 'public' OR pg_has_role(nspowner, 'USAGE')) LOOP \
             EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', s); \
           END LOOP; \
           IF has_database_privilege('public', current_database(), 'CREATE') THEN \
             EXECUTE format('REVOKE CREATE ON DATABASE %I FROM PUBLIC', current_database()); \
           END IF; END $$",
    )
    .await;
    let left = public_may_create_in(&mut *conn).await;
    let revoked: Vec<&String> = before.iter().filter(|s| !left.contains(s)).collect();
    if !revoked.is_empty() {
        tracing::info!(schemas = ?revoked, "revoked CREATE from PUBLIC (`<database>`: on the database)");
    }
    if !left.is_empty() {
        tracing::warn!(
            schemas = ?left,
            "PUBLIC may create objects in these schemas (`<database>`: schemas in this database); \
             as their owner (a superuser for `public` on a Postgres before 15), run `REVOKE CREATE \
             ON SCHEMA <schema> FROM PUBLIC`, and `REVOKE CREATE ON DATABASE <db> FROM PUBLIC` \
             after `GRANT CREATE ON DATABASE <db> TO <the host's user>` if the host creates its \
             schemas through PUBLIC's right. Until then a plugin past the SQL policy can keep \
             objects outside its own schema"
        );
    }
}

/// The schemas where `PUBLIC` may create objects, and `<database>` when it may create schemas.
async fn public_may_create_in(conn: &mut sqlx::PgConnection) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT nspname::text FROM pg_catalog.pg_namespace WHERE has_schema_privilege('public', oid, 'CREATE') \
         UNION ALL SELECT '<database>' WHERE has_database_privilege('public', current_database(), 'CREATE')",
    )
    .fetch_all(conn)
    .await
    .unwrap_or_default()
}

async fn public_has_temp(conn: &mut sqlx::PgConnection) -> bool {
    sqlx::query_scalar("SELECT has_database_privilege('public', current_database(), 'TEMPORARY')")
        .fetch_one(conn)
        .await
        .unwrap_or(true)
}

/// Runs one statement of DDL the host built from validated names (no parameters are
/// possible there). The error names the statement, less any password.
pub(crate) async fn ddl(conn: &mut sqlx::PgConnection, sql: &str) -> Result<()> {
    sqlx::query(sql)
        .persistent(false)
        .execute(conn)
        .await
        .with_context(|| sql.split(" PASSWORD ").next().unwrap_or(sql).to_string())?;
    Ok(())
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("23505"))
}

#[cfg(test)]
mod tests {
    /// The checksum of every landed migration. sqlx refuses to migrate a database where a
    /// migration ran whose file has changed since ("previously applied but has been
    /// modified"), so a host with an edited migration would not start against any database
    /// of an earlier version. A change goes in a new migration; a new one is pinned here
    /// when it lands. The first 16 bytes of each SHA-384 are enough to see a change.
    const LANDED: &[(i64, &str)] = &[
        (1, "fe1d447c306800f57b306e1a76752111"),
        (2, "192f73b52f4b050556125a8cd6186a6f"),
        (3, "72e544993ff36296e4ac00faab1f8458"),
        (4, "57e5178f0709d7c741fbc9fd41cceb18"),
        (5, "bbaf414bfaf559e028b33447ff156452"),
        (6, "f265764f4e1f7a9dacdda7f5a2188251"),
        (7, "e4c9ff6cb2dfc2a879ae311d5d0e5153"),
        (8, "6e7d0b24c95f059bb41b336160b22ee5"),
        (9, "0b52c3d72bf029bacff84322978a9b1b"),
        (10, "34f1d6a33b6d22aab3593a2281944031"),
        (11, "c0c849645b745c2759336ac38fbcfd2c"),
        (12, "9c5bff2fa5c42db5d5f400ac60d56b3a"),
        (13, "863e697cb8b592d50f163b8e73ade8a7"),
        (14, "58515d2f58e7dd41d0970e6e5eedc75a"),
        (15, "4c4e6ebe593ab5325645c9bef6526c80"),
        (16, "60f8f27579b7d7e93e2b8d451cb104cf"),
        (17, "08eb940bb37ff357c5c8c998e1f30a56"),
        (18, "03e41642842c0598b1dfc03ea5bd3277"),
        (19, "0bbdf00c99be45fd4c7389e121e43e5a"),
        (20, "90095d4f1c9bb0149b3b3fa90f932439"),
        (21, "4a46a01c8ce08e5aa0d54073eb73709c"),
        (22, "2dce6cb60854b7f5f9f3246907eea921"),
        (23, "924846e7b32b22c9ef2abc6da8d9d529"),
        (24, "07642e6b887df6d4ca8873f740e1a9ab"),
        (25, "cba906ccb613a979ad466790dc3e4fa5"),
        (26, "7bf88b6e418aa59c81c144beb66551ba"),
        (27, "ec2f2cfc1a77939dc6b6125861b459e8"),
        (28, "48eed987c88a256b0cb44599e09016fc"),
        (29, "0cc80e65d88c55b33aff795d5af07758"),
        (30, "458b15a10ef48afe773a0ff85531a16b"),
        (31, "be16091c8b44d0de794ca816f852b6e2"),
        (32, "3278b6433db34c6286daf4ee25f5009e"),
        (33, "fe7c2d562463a52dba2d46968d1f1063"),
        (34, "20c1cc83e24f4c95ba9566a11659b08c"),
        (35, "c9829909b72a4e8ea71f989eb6ed71c3"),
    ];

    #[test]
    fn a_landed_migration_never_changes() {
        let migrator = super::migrator();
        for m in migrator.iter() {
            let found = hex::encode(&m.checksum[..16]);
            match LANDED.iter().find(|(v, _)| *v == m.version) {
                Some((_, pinned)) => assert_eq!(
                    found, *pinned,
                    "migration {} ({}) changed after it landed: databases that ran it would \
                     refuse this host; put the change in a new migration",
                    m.version, m.description
                ),
                None => panic!(
                    "migration {} ({}) is not pinned: add ({}, \"{found}\") to LANDED",
                    m.version, m.description, m.version
                ),
            }
        }
        let count = migrator.iter().count();
        assert_eq!(count, LANDED.len(), "a pinned migration is gone");
    }
}
