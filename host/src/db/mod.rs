//! Postgres: the connection pool, the host's own schema (`migrations/`), and the schema,
//! role and migrations of each plugin ([`plugin_schema`]).
//!
//! Invariant: host statements name host tables with the `obx.` schema and never run
//! under a plugin's role; plugin statements run only under the plugin's role (see
//! `runtime::host::sql`).

pub mod embedded;
pub mod plugin_schema;

use std::str::FromStr;

use anyhow::{Context, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::config::DatabaseConfig;

/// The host's schema migrations, embedded from `migrations/` at build time.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Opens the pool. Each connection names itself `obx` in `pg_stat_activity`.
pub async fn connect(url: &str, cfg: &DatabaseConfig) -> Result<PgPool> {
    let options = PgConnectOptions::from_str(url)
        .context("parsing the database URL")?
        .application_name("obx");
    PgPoolOptions::new()
        .max_connections(cfg.max_connections)
        .acquire_timeout(cfg.acquire_timeout)
        .connect_with(options)
        .await
        .context("connecting to Postgres")
}

/// Applies the host's migrations. Safe to run from several hosts at once: sqlx takes an
/// advisory lock around them.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR.run(pool).await.context("applying the host's migrations")
}
