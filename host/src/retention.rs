//! The retention job: deletes rows that have served their purpose, in bounded batches, on a
//! schedule (`retention.interval`):
//!
//! * outbox rows published more than `retention.outbox_after` (7 days) ago: they stay that
//!   long for audit and replay (R-DIST-OBX-3);
//! * `processed_event` rows older than `retention.processed_after` (14 days): the dedup
//!   window;
//! * processed inbox rows, and quarantined messages, older than `retention.inbox_after`;
//! * stored `Idempotency-Key` answers older than `retention.idempotency_after` (1 day).
//!
//! Unpublished outbox rows and unprocessed inbox rows are never deleted. Deletions take
//! `FOR UPDATE SKIP LOCKED`, so every host can run the job at once.

use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::watch;

use crate::config::RetentionConfig;

/// One kind of row to clean up: a table and the condition of the rows that may go, with
/// `$1` the age in seconds.
struct Job {
    name: &'static str,
    table: &'static str,
    condition: &'static str,
}

const JOBS: &[Job] = &[
    Job {
        name: "outbox",
        table: "obx.outbox_event",
        // Aged by publication too: a row published late (after an outage) is kept the whole
        // window. `created_at` is there for its index; a row is published after it is created.
        condition: "created_at < now() - make_interval(secs => $1) \
                    AND published_at < now() - make_interval(secs => $1)",
    },
    Job {
        name: "processed_event",
        table: "obx.processed_event",
        condition: "processed_at < now() - make_interval(secs => $1)",
    },
    Job {
        name: "inbox",
        table: "obx.inbox_event",
        condition: "processed AND processed_at < now() - make_interval(secs => $1)",
    },
    Job {
        name: "quarantine",
        table: "obx.quarantine",
        condition: "received_at < now() - make_interval(secs => $1)",
    },
    Job {
        name: "idempotency_key",
        table: "obx.idempotency_key",
        condition: "created_at < now() - make_interval(secs => $1)",
    },
];

fn age(config: &RetentionConfig, job: &Job) -> Duration {
    match job.name {
        "outbox" => config.outbox_after,
        "processed_event" => config.processed_after,
        "idempotency_key" => config.idempotency_after,
        _ => config.inbox_after,
    }
}

/// The statement that deletes one batch of `job`'s rows: `$1` the age in seconds, `$2` the
/// batch's size.
fn delete_statement(job: &Job) -> String {
    format!(
        "DELETE FROM {table} WHERE ctid IN (SELECT ctid FROM {table} WHERE {condition} LIMIT $2 FOR UPDATE SKIP LOCKED)",
        table = job.table,
        condition = job.condition,
    )
}

/// Each job's name and batch statement ([`delete_statement`]), for a test to read their plans.
pub fn delete_statements() -> impl Iterator<Item = (&'static str, String)> {
    JOBS.iter().map(|job| (job.name, delete_statement(job)))
}

async fn delete_batch(pool: &PgPool, job: &Job, older_than: Duration, batch: u32) -> sqlx::Result<u64> {
    let sql = delete_statement(job);
    Ok(sqlx::query(&sql)
        .bind(older_than.as_secs_f64())
        .bind(batch as i64)
        .execute(pool)
        .await?
        .rows_affected())
}

/// Deletes everything of one kind that is due, batch after batch; returns how many rows.
async fn run_job(pool: &PgPool, job: &Job, config: &RetentionConfig) -> sqlx::Result<u64> {
    let mut total = 0;
    loop {
        let deleted = delete_batch(pool, job, age(config, job), config.batch_size).await?;
        total += deleted;
        if deleted < config.batch_size as u64 {
            return Ok(total);
        }
    }
}

/// Deletes the outbox rows that are due; returns how many.
pub async fn outbox(pool: &PgPool, config: &RetentionConfig) -> sqlx::Result<u64> {
    run_job(pool, &JOBS[0], config).await
}

/// Runs every job once; returns the rows deleted, by kind.
pub async fn run_once(pool: &PgPool, config: &RetentionConfig) -> sqlx::Result<Vec<(&'static str, u64)>> {
    let mut report = Vec::with_capacity(JOBS.len());
    for job in JOBS {
        report.push((job.name, run_job(pool, job, config).await?));
    }
    Ok(report)
}

/// The scheduled job: runs every `retention.interval` until shutdown.
pub async fn run(pool: PgPool, config: RetentionConfig, mut shutdown: watch::Receiver<bool>) {
    loop {
        match run_once(&pool, &config).await {
            Ok(report) => {
                for (name, deleted) in report.into_iter().filter(|(_, n)| *n > 0) {
                    tracing::info!(table = name, deleted, "retention deleted old rows");
                    metrics::counter!("obx_retention_deleted_total", "table" => name).increment(deleted);
                }
            }
            Err(e) => tracing::warn!(error = %e, "retention failed; will retry"),
        }
        tokio::select! {
            _ = tokio::time::sleep(config.interval) => {}
            _ = shutdown.changed() => return,
        }
    }
}
