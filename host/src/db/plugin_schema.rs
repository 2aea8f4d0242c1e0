//! Each plugin's own corner of the database: a schema, a role, and the migrations from its
//! manifest.
//!
//! Invariants:
//! * The plugin's role owns its schema and nothing else. It gets no privilege on `obx` or
//!   on any other plugin's schema, and `PUBLIC` gets none on the plugin's schema.
//! * Migrations run in one transaction per load, under the plugin's role, with the plugin's
//!   schema as the search path, serialised across hosts by an advisory lock.
//! * An applied migration never changes: its SHA-256 is recorded, and a manifest whose
//!   migration text differs, or that drops an applied migration, is refused.

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};

use crate::runtime::Manifest;

/// Why a plugin's schema could not be prepared. The message is meant for the operator.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SchemaError(String);

/// Creates the plugin's role and schema if needed, then applies its pending migrations.
pub async fn prepare(pool: &PgPool, manifest: &Manifest) -> Result<(), SchemaError> {
    prepare_inner(pool, manifest)
        .await
        .map_err(|e| SchemaError(format!("{e:#}")))
}

async fn prepare_inner(pool: &PgPool, manifest: &Manifest) -> Result<()> {
    let (name, schema, role) = (&manifest.name, manifest.schema(), manifest.role());
    ensure_role(pool, &role).await?;

    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('obx.plugin.' || $1))")
        .bind(name)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO obx.plugin (name, schema_name, role_name) VALUES ($1, $2, $3) \
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(name)
    .bind(schema)
    .bind(&role)
    .execute(&mut *tx)
    .await?;
    // Names were validated as [a-z][a-z0-9_]*, so quoting them is enough.
    for ddl in [
        format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\" AUTHORIZATION \"{role}\""),
        format!("REVOKE ALL ON SCHEMA \"{schema}\" FROM PUBLIC"),
    ] {
        sqlx::query(&ddl)
            .persistent(false)
            .execute(&mut *tx)
            .await
            .with_context(|| ddl.clone())?;
    }

    let applied = sqlx::query("SELECT id, checksum FROM obx.plugin_migration WHERE plugin = $1 ORDER BY id")
        .bind(name)
        .fetch_all(&mut *tx)
        .await?;
    let mut last_applied = None;
    for row in &applied {
        let id: i32 = row.get("id");
        let checksum: Vec<u8> = row.get("checksum");
        let Some(m) = manifest.migrations.iter().find(|m| m.id as i32 == id) else {
            bail!(
                "migration {id} was applied but is missing from the manifest of version {}",
                manifest.version
            );
        };
        if checksum != Sha256::digest(m.sql.as_bytes()).as_slice() {
            bail!(
                "migration {id} ({}) was changed after it was applied; add a new migration instead",
                m.name
            );
        }
        last_applied = Some(id);
    }

    for m in &manifest.migrations {
        let id = m.id as i32;
        if applied.iter().any(|r| r.get::<i32, _>("id") == id) {
            continue;
        }
        if let Some(last) = last_applied.filter(|last| id < *last) {
            bail!(
                "migration {id} ({}) is older than migration {last}, which is already applied",
                m.name
            );
        }
        sqlx::query(
            "SELECT set_config('role', $1, true), set_config('search_path', $2, true), \
                    set_config('lock_timeout', '30s', true)",
        )
        .bind(&role)
        .bind(format!("\"{schema}\""))
        .execute(&mut *tx)
        .await?;
        for statement in &m.statements {
            sqlx::query(statement)
                .persistent(false)
                .execute(&mut *tx)
                .await
                .map_err(|e| anyhow!("migration {id} ({}) failed: {}", m.name, db_message(&e)))?;
        }
        sqlx::query(crate::dispatch::RESET_TO_HOST).execute(&mut *tx).await?;
        sqlx::query(
            "INSERT INTO obx.plugin_migration (plugin, id, name, checksum, plugin_version) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(name)
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

/// Roles are shared by every database of the cluster, so two hosts (or two test databases)
/// may race to create the same one, or to grant it: whoever loses finds it done. The host's
/// user must be a member of the role to `SET ROLE` to it (a superuser always is).
async fn ensure_role(pool: &PgPool, role: &str) -> Result<()> {
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
        .bind(role)
        .fetch_one(pool)
        .await?;
    if !exists {
        let create = format!("CREATE ROLE \"{role}\" NOLOGIN NOINHERIT");
        match sqlx::query(&create).persistent(false).execute(pool).await {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42710" | "23505")) => {}
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("creating role {role} (the host's database user needs CREATEROLE)"))
            }
        }
    }
    for attempt in 1.. {
        let member: bool = sqlx::query_scalar("SELECT pg_has_role(current_user, $1, 'MEMBER')")
            .bind(role)
            .fetch_one(pool)
            .await?;
        if member {
            return Ok(());
        }
        let grant = format!("GRANT \"{role}\" TO CURRENT_USER");
        match sqlx::query(&grant).persistent(false).execute(pool).await {
            Ok(_) => return Ok(()),
            // "tuple concurrently updated": another host granted it at the same moment.
            Err(_) if attempt < 5 => tokio::time::sleep(std::time::Duration::from_millis(20 * attempt)).await,
            Err(e) => return Err(e).with_context(|| format!("granting role {role} to the host's user")),
        }
    }
    unreachable!()
}

/// The database's own words about a failed migration statement, for the operator.
fn db_message(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(d) => format!("{} ({})", d.message(), d.code().unwrap_or_default()),
        other => other.to_string(),
    }
}
