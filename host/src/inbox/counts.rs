//! What waits in each plugin's consumption, for `obx status` and the database gauges.

use sqlx::PgPool;

/// One plugin's counts.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Counts {
    pub plugin: String,
    /// Unprocessed inbox events: those that can run, and those that wait (parked, or held
    /// behind a parked event), each read from its own index.
    pub inbox_backlog: i64,
    pub dead_letters: i64,
    pub quarantined: i64,
}

/// Every plugin's counts, by name.
pub async fn counts(pool: &PgPool) -> sqlx::Result<Vec<Counts>> {
    sqlx::query_as(
        "SELECT p.name AS plugin, \
                (SELECT count(*) FROM obx.inbox_event i \
                 WHERE i.consumer = p.name AND NOT i.processed AND NOT i.parked AND NOT i.held) \
                + (SELECT count(*) FROM obx.inbox_event i \
                   WHERE i.consumer = p.name AND NOT i.processed AND (i.parked OR i.held)) AS inbox_backlog, \
                (SELECT count(*) FROM obx.dead_letter d \
                 WHERE d.consumer = p.name AND d.status = 'parked') AS dead_letters, \
                (SELECT count(*) FROM obx.quarantine q WHERE q.consumer = p.name) AS quarantined \
         FROM obx.plugin p ORDER BY p.name",
    )
    .fetch_all(pool)
    .await
}
