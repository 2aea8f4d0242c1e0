//! The dead-letter table: events whose handler kept failing, parked with their error and
//! attempt count. A parked event holds its key: later events of the same key wait in the
//! inbox behind it, so a key's order is kept. An operator then either
//!
//! * retries it (`obx dlq retry ID`): it goes back to the inbox processors with its attempts
//!   reset, and the key's waiting events follow it in order; or
//! * discards it (`obx dlq discard ID`): it is marked processed without running, and the
//!   key's waiting events proceed. `obx dlq discard --parked PLUGIN` discards all of a
//!   plugin's parked events, a thousand to a transaction.

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::paging::{ListError, Page, PageRequest};

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct DeadLetter {
    pub id: i64,
    pub consumer: String,
    pub event_id: Uuid,
    pub topic: String,
    pub partition_key: Option<String>,
    pub event_type: String,
    pub error: String,
    pub attempts: i32,
    pub status: String,
    pub parked_at: chrono::DateTime<chrono::Utc>,
    pub resolved_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Later events of the same key waiting behind this one.
    pub waiting: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct Quarantined {
    pub id: i64,
    pub consumer: String,
    pub topic: String,
    pub kafka_partition: i32,
    pub kafka_offset: i64,
    pub reason: String,
    pub received_at: chrono::DateTime<chrono::Utc>,
}

#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    #[error("there is no parked dead letter with id {0}")]
    NotParked(i64),
    #[error("no plugin is named {0:?}, and no dead letter was parked under that name")]
    UnknownPlugin(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// A page of dead letters, newest first: parked ones only, unless `all`. The cursor is the
/// last id listed.
pub async fn list(
    pool: &PgPool,
    consumer: Option<&str>,
    all: bool,
    page: &PageRequest,
) -> Result<Page<DeadLetter>, ListError> {
    let size = page.rows()?;
    let before = page.cursor(|a| a.parse::<i64>().ok())?;
    let rows = sqlx::query_as(
        "SELECT d.id, d.consumer, d.event_id, d.topic, d.partition_key, d.event_type, d.error, d.attempts, \
                d.status, d.parked_at, d.resolved_at, \
                (SELECT count(*) FROM obx.inbox_event w \
                 WHERE w.consumer = d.consumer AND w.topic = d.topic AND w.partition_key = d.partition_key \
                   AND NOT w.processed AND NOT w.parked AND NOT w.held AND w.event_id <> d.event_id) \
                + (SELECT count(*) FROM obx.inbox_event w \
                   WHERE w.consumer = d.consumer AND w.topic = d.topic AND w.partition_key = d.partition_key \
                     AND NOT w.processed AND (w.parked OR w.held) \
                     AND w.event_id <> d.event_id) AS waiting \
         FROM obx.dead_letter d \
         WHERE ($1::text IS NULL OR d.consumer = $1) AND ($2 OR d.status = 'parked') \
           AND ($3::bigint IS NULL OR d.id < $3) \
         ORDER BY d.id DESC LIMIT $4",
    )
    .bind(consumer)
    .bind(all)
    .bind(before)
    .bind(size + 1)
    .fetch_all(pool)
    .await?;
    Ok(Page::of(rows, size, |d: &DeadLetter| d.id.to_string()))
}

/// Sends a parked event back to the inbox processors, with its attempts reset.
pub async fn retry(pool: &PgPool, id: i64) -> Result<(), DlqError> {
    let mut tx = pool.begin().await?;
    let target: Option<(String, Uuid)> = sqlx::query_as(
        "UPDATE obx.dead_letter SET status = 'retried', resolved_at = now() \
         WHERE id = $1 AND status = 'parked' RETURNING consumer, event_id",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((consumer, event_id)) = target else {
        return Err(DlqError::NotParked(id));
    };
    sqlx::query(
        "UPDATE obx.inbox_event SET parked = false, attempts = 0, next_attempt_at = NULL, contended_since = NULL \
         WHERE consumer = $1 AND event_id = $2",
    )
    .bind(&consumer)
    .bind(event_id)
    .execute(&mut *tx)
    .await?;
    resolved(tx, id, &consumer, event_id, "retried").await
}

/// Marks a parked event processed without running it, releasing its key; delivered again,
/// it is a duplicate.
pub async fn discard(pool: &PgPool, id: i64) -> Result<(), DlqError> {
    let mut tx = pool.begin().await?;
    // Waits for a session resolving the same letter, then finds it parked or not.
    let target: Option<(String, Uuid)> = sqlx::query_as(&discarding(
        "SELECT d.id FROM obx.dead_letter d WHERE d.id = $1 AND d.status = 'parked' FOR UPDATE",
        "SELECT r.consumer, r.event_id FROM resolved r",
    ))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((consumer, event_id)) = target else {
        return Err(DlqError::NotParked(id));
    };
    resolved(tx, id, &consumer, event_id, "discarded").await
}

/// Commits a resolved letter's transaction, and says so in the log.
async fn resolved(
    tx: sqlx::Transaction<'_, sqlx::Postgres>,
    id: i64,
    consumer: &str,
    event_id: Uuid,
    status: &str,
) -> Result<(), DlqError> {
    // Cut off by the request's deadline from here on, it would be answered as not done.
    crate::dispatch::commit_sent();
    tx.commit().await?;
    tracing::info!(id, %consumer, %event_id, status, "dead letter resolved");
    Ok(())
}

/// The one statement that discards dead letters, by id or a plugin's together: the letters
/// `picked` selects (their `id`) are marked discarded, their events processed and no longer
/// parked, and recorded in `processed_event`, so that delivered again (a dedup
/// subscription's redelivery, an outbox replay) each is a duplicate, not an event to run.
/// `answer` is the statement's last SELECT, over `resolved (consumer, event_id)`.
fn discarding(picked: &str, answer: &str) -> String {
    format!(
        "WITH picked AS ({picked}), resolved AS ( \
             UPDATE obx.dead_letter d SET status = 'discarded', resolved_at = now() \
             FROM picked p WHERE d.id = p.id \
             RETURNING d.consumer, d.event_id \
         ), released AS ( \
             UPDATE obx.inbox_event e SET parked = false, processed = true, processed_at = now() \
             FROM resolved r WHERE e.consumer = r.consumer AND e.event_id = r.event_id \
         ), recorded AS ( \
             INSERT INTO obx.processed_event (consumer, event_id) \
             SELECT r.consumer, r.event_id FROM resolved r ON CONFLICT DO NOTHING \
         ) \
         {answer}"
    )
}

/// The most dead letters [`discard_parked`] resolves in one transaction.
pub const DISCARD_BATCH: i64 = 1000;

/// What one [`discard_parked`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Discarded {
    pub discarded: u64,
    /// The highest dead-letter id it could discard: the one it was given, or the plugin's
    /// highest parked id when it began, so that the next batch does not reach letters parked
    /// after the first (0 when none was parked).
    pub through: i64,
    /// A whole batch was discarded: there may be more up to `through`.
    pub more: bool,
}

/// Discards up to [`DISCARD_BATCH`] of `consumer`'s parked dead letters, oldest first and up
/// to `through` (without it, the highest parked now), in one transaction, each as [`discard`]
/// does. For a flood of refused events, which an operator would otherwise discard one id at a
/// time. Letters another session is resolving are skipped. A batch that loses a race (a
/// deadlock with a consumer storing events behind the same letters, which locks them in
/// its own order) is tried again, up to three times. A name that is neither a plugin's nor
/// any dead letter's is refused (a typo would otherwise look like a plugin with nothing
/// parked); a plugin that was removed may still have letters to clear.
pub async fn discard_parked(pool: &PgPool, consumer: &str, through: Option<i64>) -> Result<Discarded, DlqError> {
    let mut tries = 1;
    let done = loop {
        match discard_batch(pool, consumer, through).await {
            Err(e) if tries < 3 && crate::db::lost_a_race(&e) => {
                tracing::debug!(%consumer, error = %e, "discarding parked dead letters again");
                tries += 1;
            }
            done => break done?,
        }
    };
    if done.discarded == 0 && !known_consumer(pool, consumer).await? {
        return Err(DlqError::UnknownPlugin(consumer.to_owned()));
    }
    Ok(done)
}

/// Whether `consumer` names a plugin the host has known, or any dead letter.
async fn known_consumer(pool: &PgPool, consumer: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM obx.plugin p WHERE p.name = $1) \
             OR EXISTS (SELECT 1 FROM obx.dead_letter d WHERE d.consumer = $1)",
    )
    .bind(consumer)
    .fetch_one(pool)
    .await
}

async fn discard_batch(pool: &PgPool, consumer: &str, through: Option<i64>) -> Result<Discarded, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let bound = "coalesce($3, (SELECT max(d.id) FROM obx.dead_letter d \
                               WHERE d.consumer = $1 AND d.status = 'parked'), 0)";
    let (discarded, through): (i64, i64) = sqlx::query_as(&discarding(
        &format!(
            "SELECT d.id FROM obx.dead_letter d \
             WHERE d.consumer = $1 AND d.status = 'parked' AND d.id <= {bound} \
             ORDER BY d.id LIMIT $2 FOR UPDATE OF d SKIP LOCKED"
        ),
        &format!("SELECT (SELECT count(*) FROM resolved), {bound}"),
    ))
    .bind(consumer)
    .bind(DISCARD_BATCH)
    .bind(through)
    .fetch_one(&mut *tx)
    .await?;
    crate::dispatch::commit_sent();
    tx.commit().await?;
    if discarded > 0 {
        tracing::info!(%consumer, discarded, through, "parked dead letters discarded");
    }
    Ok(Discarded {
        discarded: discarded as u64,
        through,
        more: discarded >= DISCARD_BATCH,
    })
}

/// A page of quarantined messages, newest first. The cursor is the last id listed.
pub async fn quarantined(
    pool: &PgPool,
    consumer: Option<&str>,
    page: &PageRequest,
) -> Result<Page<Quarantined>, ListError> {
    let size = page.rows()?;
    let before = page.cursor(|a| a.parse::<i64>().ok())?;
    let rows = sqlx::query_as(
        "SELECT id, consumer, topic, kafka_partition, kafka_offset, reason, received_at FROM obx.quarantine \
         WHERE ($1::text IS NULL OR consumer = $1) AND ($2::bigint IS NULL OR id < $2) ORDER BY id DESC LIMIT $3",
    )
    .bind(consumer)
    .bind(before)
    .bind(size + 1)
    .fetch_all(pool)
    .await?;
    Ok(Page::of(rows, size, |q: &Quarantined| q.id.to_string()))
}
