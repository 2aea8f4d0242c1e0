//! Each plugin's own corner of the database: a login role, a schema, the events it may
//! emit, and the migrations from its manifest.
//!
//! Invariants:
//! * A plugin's role is `obx_<installation>_<plugin>`. It logs in with a password only the
//!   host knows, owns the plugin's schema, may use the functions of `obx_api`, and has no
//!   other privilege and no membership: it cannot reach `obx`, another plugin's schema, or
//!   the host's role. Its settings (search path, timeouts, `work_mem`, `temp_file_limit`)
//!   are the role's own, so a session starts confined.
//! * A plugin's name is its schema's: it may not be the name of an existing role (whose
//!   default search path, `"$user"`, would find the schema) or of a schema that is not
//!   already the plugin's.
//! * Migrations run on the plugin's own session, in one transaction per load, serialised
//!   across hosts by a lock on the plugin's registry row.
//! * An applied migration never changes: its SHA-256 is recorded, and a manifest whose
//!   migration text differs, or that drops an applied migration, is refused.
//! * An event type on a topic is declared by one plugin at most, for every version of it
//!   ever loaded; only the operator releases it ([`release_event`]), to move it to another.

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};
use sqlx::{Executor, PgConnection, PgPool};

use super::Manifest;
use crate::config::Limits;
use crate::db::login::{self, Login};
use crate::db::sessions::{PluginTx, SessionError, Sessions};

/// Why a plugin's schema could not be prepared. The message is meant for the operator.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct SchemaError {
    message: String,
    /// The database failed, or the work lost to another host's (a lock wait, a deadlock):
    /// the same plugin may be prepared if tried again. Not for a statement or a migration
    /// that Postgres refused for what it says.
    pub may_pass: bool,
}

/// Creates or updates the plugin's role, schema and declared events, registers its login
/// with `sessions`, then applies its pending migrations.
pub async fn prepare(
    pool: &PgPool,
    sessions: &Sessions,
    manifest: &Manifest,
    limits: &Limits,
) -> Result<(), SchemaError> {
    let result = async {
        let login = provision(pool, manifest, limits, sessions.role_connection_limit()).await?;
        sessions.register(&manifest.name, login);
        // Dropped past the deadline, the session is closed, and its backend stops.
        tokio::time::timeout(MIGRATION_DEADLINE, migrate(sessions, manifest, limits.max_relations))
            .await
            .map_err(|_| anyhow!("the migrations ran past {MIGRATION_DEADLINE:?}"))?
    }
    .await;
    result.map_err(|e| SchemaError {
        message: format!("{e:#}"),
        may_pass: may_pass(&e),
    })
}

/// Postgres's refusal of a second concurrent change of one catalog row (a grant on `obx_api`
/// while a newer host's migrations replace its functions, say): tried again, it passes.
fn concurrently_updated(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("XX000")
        && d.message().contains("tuple concurrently updated"))
}

/// Whether preparing may succeed if tried again: the database failed or was busy
/// ([`crate::db::may_pass`]), or a catalog row was changed concurrently, somewhere in `e`'s
/// chain.
fn may_pass(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.downcast_ref::<sqlx::Error>().is_some_and(|e| crate::db::may_pass(e) || concurrently_updated(e))
            || cause.downcast_ref::<MigrationFailed>().is_some_and(|m| m.may_pass)
            || matches!(cause.downcast_ref::<SessionError>(), Some(SessionError::Database(db)) if crate::db::may_pass(db))
    })
}

/// A migration statement that Postgres refused. Its error is kept as words for the operator
/// (and whether a retry may help), not as a source, so that the message stays one line.
#[derive(Debug, thiserror::Error)]
#[error("migration {id} ({name}) failed: {message}")]
struct MigrationFailed {
    id: i32,
    name: String,
    message: String,
    may_pass: bool,
}

/// How long a plugin's migrations may take in all, statements and lock waits together.
const MIGRATION_DEADLINE: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// The role of plugin `name` in this installation.
pub async fn role_name(conn: &mut PgConnection, name: &str) -> Result<String> {
    let installation: String = sqlx::query_scalar("SELECT id FROM obx.installation")
        .fetch_one(conn)
        .await
        .context("reading the installation id")?;
    Ok(format!("obx_{installation}_{name}"))
}

/// Everything the host does for a plugin as itself, in one transaction that holds the
/// plugin's registry row: concurrent hosts loading the same plugin take turns.
async fn provision(pool: &PgPool, manifest: &Manifest, limits: &Limits, connection_limit: u32) -> Result<Login> {
    let name = &manifest.name;
    let mut tx = pool.begin().await?;
    // Another host may be provisioning the same plugin; that takes moments, not minutes.
    (&mut *tx).execute("SET LOCAL lock_timeout = '30s'").await?;
    let role = role_name(&mut tx, name).await?;
    let registered: Option<String> = sqlx::query_scalar("SELECT role_name FROM obx.plugin WHERE name = $1 FOR UPDATE")
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
    if registered.is_none() {
        check_name_is_free(&mut tx, name).await?;
    }
    sqlx::query(
        "INSERT INTO obx.plugin (name, schema_name, role_name, max_emits_per_call, max_payload_bytes, \
                                 max_emit_bytes_per_call) \
         VALUES ($1, $1, $2, $3, $4, $5) \
         ON CONFLICT (name) DO UPDATE SET max_emits_per_call = EXCLUDED.max_emits_per_call, \
             max_payload_bytes = EXCLUDED.max_payload_bytes, \
             max_emit_bytes_per_call = EXCLUDED.max_emit_bytes_per_call",
    )
    .bind(name)
    .bind(&role)
    .bind(limits.max_emits_per_call as i32)
    .bind(i32::try_from(limits.max_payload_bytes).unwrap_or(i32::MAX))
    .bind(limits.max_emit_bytes_per_call as i64)
    .execute(&mut *tx)
    .await?;
    let password = login::ensure_role(&mut tx, &role, connection_limit).await?;
    let settings = session_settings(name, limits);
    if let Some(old) = registered.filter(|old| *old != role) {
        adopt_legacy_role(&mut tx, name, &old, &role).await?;
    }
    configure_role(&mut tx, &role, &settings, limits).await?;
    // The grants on `obx_api` take turns across hosts, whatever their plugins: Postgres refuses
    // a second concurrent change of one catalog row ("tuple concurrently updated"), which left
    // that host's plugin unloaded until its file changed. Taken after the plugin's own row
    // (above), which a migration holds for as long as it runs: a host waiting for that row
    // holds up no other plugin's load. Held to the commit, a few statements on.
    (&mut *tx).execute("SELECT 1 FROM obx.installation FOR UPDATE").await?;
    // Names were validated as [a-z][a-z0-9_]*, and the installation id as hex: quoting is enough.
    for ddl in [
        format!("CREATE SCHEMA IF NOT EXISTS \"{name}\" AUTHORIZATION \"{role}\""),
        format!("REVOKE ALL ON SCHEMA \"{name}\" FROM PUBLIC"),
        format!("GRANT USAGE ON SCHEMA obx_api TO \"{role}\""),
        format!("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA obx_api TO \"{role}\""),
    ] {
        crate::db::ddl(&mut tx, &ddl).await?;
    }
    let (topics, types): (Vec<&str>, Vec<&str>) = manifest
        .emits
        .iter()
        .map(|e| (e.topic.as_str(), e.event_type.as_str()))
        .unzip();
    sqlx::query(
        "INSERT INTO obx.plugin_emit (plugin, topic, event_type) \
         SELECT $1, t, e FROM unnest($2::text[], $3::text[]) AS d(t, e) ON CONFLICT DO NOTHING",
    )
    .bind(name)
    .bind(&topics)
    .bind(&types)
    .execute(&mut *tx)
    .await?;
    // An event type on a topic is one plugin's: another may not emit it, so not forge it.
    let taken: Option<(String, String, String)> = sqlx::query_as(
        "SELECT d.event_type, d.topic, d.plugin FROM obx.plugin_emit d \
         JOIN unnest($2::text[], $3::text[]) AS w(t, e) ON d.topic = w.t AND d.event_type = w.e \
         WHERE d.plugin <> $1 LIMIT 1",
    )
    .bind(name)
    .bind(&topics)
    .bind(&types)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some((event_type, topic, owner)) = taken {
        bail!(
            "{event_type} on topic {topic} is emitted by plugin {owner:?}; a plugin may not declare another's events"
        );
    }
    tx.commit().await?;
    Ok(Login {
        role,
        password,
        settings,
        // The statements before the `COMMIT` have a statement timeout each; the deferred
        // triggers the `COMMIT` runs have none. Generous beyond that: a commit that waits for
        // its WAL flush (a slow disk, a synchronous standby) may have taken effect when its
        // backend is ended.
        commit_within: limits.statement_timeout * 4 + std::time::Duration::from_secs(2),
    })
}

/// What [`release_event`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Release {
    /// The declaration was the plugin's, and is gone.
    Released,
    /// Another plugin declared it, and still does.
    HeldBy(String),
    /// No plugin declared it.
    Undeclared,
}

/// Takes `event_type` on `topic` out of `plugin`'s declarations, so that another plugin may
/// declare it: how an event moves from one plugin to another. From then on the database
/// refuses the plugin's own emits of it, until a host loads a version of the plugin that
/// still declares it and claims it again, if it is still free. Serialised with the loads'
/// claims, as they are across hosts.
pub async fn release_event(pool: &PgPool, plugin: &str, topic: &str, event_type: &str) -> Result<Release> {
    let mut tx = pool.begin().await?;
    (&mut *tx).execute("SELECT 1 FROM obx.installation FOR UPDATE").await?;
    let released = sqlx::query("DELETE FROM obx.plugin_emit WHERE plugin = $1 AND topic = $2 AND event_type = $3")
        .bind(plugin)
        .bind(topic)
        .bind(event_type)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if released == 1 {
        tx.commit().await?;
        return Ok(Release::Released);
    }
    let holder: Option<String> =
        sqlx::query_scalar("SELECT plugin FROM obx.plugin_emit WHERE topic = $1 AND event_type = $2")
            .bind(topic)
            .bind(event_type)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(holder.map_or(Release::Undeclared, Release::HeldBy))
}

/// A new plugin may not take the name of a role (`"$user"` in that role's search path would
/// find the schema), nor of a schema that exists already.
async fn check_name_is_free(conn: &mut PgConnection, name: &str) -> Result<()> {
    let (role, schema): (bool, bool) = sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = $1), \
                EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)",
    )
    .bind(name)
    .fetch_one(conn)
    .await?;
    if role {
        bail!("the name {name:?} is reserved: a database role of that name exists, and a schema named like a role is first in that role's search path");
    }
    if schema {
        bail!("the name {name:?} is reserved: a schema of that name exists and does not belong to this plugin");
    }
    Ok(())
}

/// Hosts before 0.2 gave each plugin a role `obx_plugin_<name>` that could not log in. Its
/// objects in this database pass to the new login role.
async fn adopt_legacy_role(conn: &mut PgConnection, name: &str, old: &str, role: &str) -> Result<()> {
    let old_exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = $1)")
        .bind(old)
        .fetch_one(&mut *conn)
        .await?;
    if old_exists {
        tracing::info!(plugin = %name, from = %old, to = %role, "moving the plugin's objects to its login role");
        let old = old.replace('"', "\"\"");
        sqlx::query(&format!("REASSIGN OWNED BY \"{old}\" TO \"{role}\""))
            .persistent(false)
            .execute(&mut *conn)
            .await
            .with_context(|| format!("reassigning the objects of role {old} to {role}"))?;
    }
    sqlx::query("UPDATE obx.plugin SET role_name = $2 WHERE name = $1")
        .bind(name)
        .bind(role)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// What a plugin session's `idle_in_transaction_session_timeout` allows beyond a call's own
/// bounds (see [`session_settings`]).
const IDLE_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// The settings a plugin's sessions start with. All of them may be changed by a session
/// itself (the SQL policy refuses SET and set_config, but the wall is elsewhere): they are
/// defaults that keep a plugin's work bounded, not privileges.
fn session_settings(schema: &str, limits: &Limits) -> Vec<(&'static str, String)> {
    let ms = |d: std::time::Duration| format!("{}ms", d.as_millis());
    // If the host ever stalls holding a transaction, Postgres ends it rather than let it pin
    // the xmin horizon. A call's transaction may wait one deadline for a call slot, and then
    // run for one; IDLE_MARGIN is for the host's own delays under load (a commit waiting for
    // a worker thread), which short deadlines and timeouts would not cover.
    let idle = limits.call_deadline * 2 + limits.statement_timeout * 2 + IDLE_MARGIN;
    vec![
        ("search_path", schema.to_string()),
        ("statement_timeout", ms(limits.statement_timeout)),
        ("lock_timeout", ms(limits.lock_timeout)),
        ("idle_in_transaction_session_timeout", ms(idle)),
        ("work_mem", format!("{}kB", limits.work_mem_bytes / 1024)),
        // A statement whose client went away (a call killed at its deadline) stops soon.
        ("client_connection_check_interval", "1000ms".to_string()),
        // No notices: a statement can make Postgres send one per row, each quoting a value
        // whole (the host's log filter drops any that a session asks for again).
        ("client_min_messages", "error".to_string()),
    ]
}

/// The role's own settings, which every session of it starts with. They are written only
/// when they differ, since they are shared catalog rows. `temp_file_limit` is one a plugin
/// session cannot change at all (only a superuser, or a role granted it, may set it).
async fn configure_role(
    conn: &mut PgConnection,
    role: &str,
    session: &[(&'static str, String)],
    limits: &Limits,
) -> Result<()> {
    let mut settings = session.to_vec();
    settings.push(("temp_file_limit", format!("{}kB", limits.temp_file_bytes / 1024)));
    let (current, in_database): (Vec<String>, bool) = sqlx::query_as(
        "SELECT coalesce((SELECT s.setconfig FROM pg_catalog.pg_db_role_setting s \
                          WHERE s.setrole = r.oid AND s.setdatabase = 0), '{}'), \
                EXISTS (SELECT 1 FROM pg_catalog.pg_db_role_setting s WHERE s.setrole = r.oid \
                        AND s.setdatabase = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())) \
         FROM pg_catalog.pg_roles r WHERE r.rolname = $1",
    )
    .bind(role)
    .fetch_one(&mut *conn)
    .await?;
    // A plugin may set defaults for its own role (Postgres lets every role): only ours stay.
    if in_database {
        let db = current_database(conn).await?.replace('"', "\"\"");
        crate::db::ddl(conn, &format!("ALTER ROLE \"{role}\" IN DATABASE \"{db}\" RESET ALL")).await?;
    }
    for entry in &current {
        let name = entry.split('=').next().unwrap_or_default();
        let ours = settings.iter().any(|(n, _)| *n == name);
        if !ours && !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') {
            crate::db::ddl(conn, &format!("ALTER ROLE \"{role}\" RESET \"{name}\"")).await?;
        }
    }
    for (name, value) in settings {
        if current.iter().any(|c| *c == format!("{name}={value}")) {
            continue;
        }
        let ddl = format!("ALTER ROLE \"{role}\" SET {name} TO '{value}'");
        // temp_file_limit needs a grant the host may not have; the rest must succeed.
        sqlx::query("SAVEPOINT obx_role_setting").execute(&mut *conn).await?;
        match sqlx::query(&ddl).persistent(false).execute(&mut *conn).await {
            Ok(_) => {}
            Err(e) if name == "temp_file_limit" => {
                sqlx::query("ROLLBACK TO SAVEPOINT obx_role_setting")
                    .execute(&mut *conn)
                    .await?;
                tracing::warn!(role, error = %e, "cannot set temp_file_limit for plugin sessions; a superuser can \
                    allow it with `GRANT SET ON PARAMETER temp_file_limit TO <host user>`");
            }
            Err(e) => return Err(e).with_context(|| ddl.clone()),
        }
    }
    Ok(())
}

async fn current_database(conn: &mut PgConnection) -> Result<String> {
    Ok(sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(conn)
        .await?)
}

/// Applies the plugin's pending migrations on its own session, and records them there. If
/// they would leave its role owning more than `max_relations` relations ([`RelationBound`]),
/// none of them is.
async fn migrate(sessions: &Sessions, manifest: &Manifest, max_relations: u32) -> Result<()> {
    let name = &manifest.name;
    let mut tx = sessions.begin(name).await?;
    // A migration may rewrite a large table: the role's statement timeout is for handlers.
    // Another host may be applying this plugin's migrations: wait for it (it is bounded by
    // MIGRATION_DEADLINE), then bound lock waits.
    (&mut *tx)
        .execute("SET LOCAL statement_timeout = '10min'; SET LOCAL lock_timeout = 0")
        .await?;
    tx.commit_within(std::time::Duration::from_secs(10 * 60));
    let applied: Vec<(i32, Vec<u8>)> = sqlx::query_as("SELECT id, checksum FROM obx_api.migrations_applied()")
        .fetch_all(&mut *tx)
        .await?;
    (&mut *tx).execute("SET LOCAL lock_timeout = '30s'").await?;
    let last_applied = check_applied(manifest, &applied)?;
    let bound = RelationBound::read(&mut tx, name, max_relations).await?;
    for m in &manifest.migrations {
        let id = m.id as i32;
        if applied.iter().any(|(a, _)| *a == id) {
            continue;
        }
        if let Some(last) = last_applied.filter(|last| id < *last) {
            bail!(
                "migration {id} ({}) is older than migration {last}, which is already applied",
                m.name
            );
        }
        for statement in &m.statements {
            sqlx::query(statement)
                .persistent(false)
                .execute(&mut *tx)
                .await
                .map_err(|e| MigrationFailed {
                    id,
                    name: m.name.clone(),
                    message: db_message(&e),
                    may_pass: crate::db::may_pass(&e),
                })?;
            bound.check(&mut tx).await?;
        }
        sqlx::query("SELECT obx_api.record_migration($1, $2, $3, $4)")
            .bind(id)
            .bind(&m.name)
            .bind(Sha256::digest(m.sql.as_bytes()).as_slice())
            .bind(&manifest.version)
            .execute(&mut *tx)
            .await?;
        tracing::info!(plugin = %name, migration = id, name = %m.name, "applied plugin migration");
    }
    tx.commit().await?;
    Ok(())
}

/// The relations a plugin's migrations may leave: `limits.max_relations`, or as many as it had
/// before them if that was more. A statement on a table locks each of its indexes,
/// inheritance children and TOAST relations, in the lock table the whole server shares; a
/// table with thousands of them could fill it from a few sessions, and every transaction on
/// the server would then fail ("out of shared memory"). Checked after each statement, since
/// each relation a migration creates holds its lock to the migration's end: a migration of
/// thousands of `CREATE TABLE … INHERITS` would fill the table before it was refused.
struct RelationBound {
    max: i64,
    before: i64,
}

impl RelationBound {
    /// Reads what the plugin's role owns now; a schema over the bound from before it existed
    /// only gets a warning, so that a host upgrade does not stop a plugin that served.
    async fn read(tx: &mut PluginTx, plugin: &str, max: u32) -> Result<RelationBound> {
        let bound = RelationBound {
            max: i64::from(max),
            before: owned_relations(tx).await?,
        };
        if bound.before > bound.max {
            tracing::warn!(
                plugin,
                relations = bound.before,
                max,
                "the plugin's role owns more relations \
                than limits.max_relations; no migration may add to them"
            );
        }
        Ok(bound)
    }

    /// Refuses the migrations (their transaction is not committed) once they leave more
    /// relations than the bound and than before.
    async fn check(&self, tx: &mut PluginTx) -> Result<()> {
        let now = owned_relations(tx).await?;
        if now <= self.max || now <= self.before {
            return Ok(());
        }
        bail!(
            "its migrations were not applied: they would leave the plugin's role owning {now} \
             relations or more (tables, partitions, indexes, sequences, views and their TOAST \
             tables), more than limits.max_relations ({}); an operator who raises it sizes \
             Postgres's max_locks_per_transaction to match (docs/operations.md)",
            self.max
        )
    }
}

/// The relations the session's role owns in this database, wherever they are (composite types
/// aside, which nothing locks). Every name is qualified: the session is the plugin's, and its
/// schema is in its search path.
async fn owned_relations(tx: &mut PluginTx) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT pg_catalog.count(*) FROM pg_catalog.pg_class c \
         WHERE c.relowner OPERATOR(pg_catalog.=) (SELECT r.oid FROM pg_catalog.pg_roles r \
                                                   WHERE r.rolname OPERATOR(pg_catalog.=) session_user) \
           AND c.relkind OPERATOR(pg_catalog.<>) 'c'",
    )
    // Not a named prepared statement: the plugin's SQL could have prepared one of that name.
    .persistent(false)
    .fetch_one(&mut **tx)
    .await?)
}

/// Every applied migration must still be in the manifest, unchanged. Returns the last one.
fn check_applied(manifest: &Manifest, applied: &[(i32, Vec<u8>)]) -> Result<Option<i32>> {
    let mut last_applied = None;
    for (id, checksum) in applied {
        let Some(m) = manifest.migrations.iter().find(|m| m.id as i32 == *id) else {
            bail!(
                "migration {id} was applied but is missing from the manifest of version {}",
                manifest.version
            );
        };
        if checksum.as_slice() != Sha256::digest(m.sql.as_bytes()).as_slice() {
            bail!(
                "migration {id} ({}) was changed after it was applied; add a new migration instead",
                m.name
            );
        }
        last_applied = Some(*id);
    }
    Ok(last_applied)
}

/// The database's own words about a failed migration statement, for the operator, in part:
/// Postgres may quote a value whole, and the message is logged, kept in `last_error` and
/// served by `/v1/plugins`.
fn db_message(e: &sqlx::Error) -> String {
    let message = match e {
        sqlx::Error::Database(d) => format!("{} ({})", d.message(), d.code().unwrap_or_default()),
        other => other.to_string(),
    };
    crate::text::clipped(&message, 4096).into_owned()
}
