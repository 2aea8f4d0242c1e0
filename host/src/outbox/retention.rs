//! Retention: deletes published outbox rows once they are older than
//! `retention.outbox_after` (7 days by default), in bounded batches. Rows stay that long for
//! audit and replay (R-DIST-OBX-3). Unpublished rows are never deleted.

use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::watch;

use crate::config::RetentionConfig;

/// Deletes one batch; returns how many rows went. `SKIP LOCKED` lets hosts run it at once.
pub async fn delete_batch(pool: &PgPool, older_than: Duration, batch_size: u32) -> sqlx::Result<u64> {
    let deleted = sqlx::query(
        "DELETE FROM obx.outbox_event WHERE id IN ( \
             SELECT id FROM obx.outbox_event \
             WHERE created_at < now() - make_interval(secs => $1) AND published_at IS NOT NULL \
             LIMIT $2 \
             FOR UPDATE SKIP LOCKED)",
    )
    .bind(older_than.as_secs_f64())
    .bind(batch_size as i64)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(deleted)
}

/// Deletes everything that is due, batch after batch; returns the total.
pub async fn run_once(pool: &PgPool, config: &RetentionConfig) -> sqlx::Result<u64> {
    let mut total = 0;
    loop {
        let deleted = delete_batch(pool, config.outbox_after, config.batch_size).await?;
        total += deleted;
        if deleted < config.batch_size as u64 {
            return Ok(total);
        }
    }
}

/// The scheduled job: runs every `retention.interval` until shutdown.
pub async fn run(pool: PgPool, config: RetentionConfig, mut shutdown: watch::Receiver<bool>) {
    loop {
        match run_once(&pool, &config).await {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(deleted = n, "outbox retention deleted published rows");
                metrics::counter!("obx_outbox_retention_deleted_total").increment(n);
            }
            Err(e) => tracing::warn!(error = %e, "outbox retention failed; will retry"),
        }
        tokio::select! {
            _ = tokio::time::sleep(config.interval) => {}
            _ = shutdown.changed() => return,
        }
    }
}
