//! Rows whose payload Postgres cannot print. The relay claims rows with `payload::text`, and
//! `jsonb` prints every number in full, so a payload of 90 KB of `1e131071` prints as 1.3 GB,
//! past the gigabyte Postgres can build: every claim that reached such a row failed, and no
//! event on its shard was published again. `obx_api.emit_calls` refuses such payloads since
//! migration 0035, which set aside those stored before it; this is the relay's own wall, for
//! a row that came in another way (a delayed event stored before 0035 and released later, a
//! row written by hand).
//!
//! When a claim fails for want of memory, the relay looks at the rows it would claim, by id,
//! and sets aside each one whose payload cannot be printed, as it sets aside a row the broker
//! refuses for good: its key moves on. A payload is judged by its numbers first, each printed
//! on its own, so that finding one never builds its whole text; a payload whose numbers do
//! not tell is printed alone, and set aside only if Postgres refuses it as too long
//! (`54000`), never for a server short of memory (`53200`), which says nothing of the row.

use anyhow::Result;
use sqlx::postgres::PgDatabaseError;
use sqlx::PgConnection;

/// Whether `e` is Postgres failing for want of memory: building a value past its gigabyte
/// (`program_limit_exceeded`, "Cannot enlarge string buffer"), or any allocation
/// (`out_of_memory`).
pub fn failed_to_print(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|code| code == "54000" || code == "53200"))
}

/// Numbers whose printed text adds up to more than this make a payload Postgres cannot be
/// relied on to print (its limit is a gigabyte, for the whole text).
const NUMBERS_PRINT_PAST: i64 = 512 * 1024 * 1024;

/// Sets aside the rows among the next `limit` of `shards` (those a claim takes, by
/// `claimable`, a condition on `o` with the shards as `$1`) whose payload Postgres cannot
/// print. Returns how many it set aside.
pub async fn set_aside(conn: &mut PgConnection, claimable: &str, shards: &[i32], limit: u32) -> Result<usize> {
    let ids: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT o.id FROM obx.outbox_event o WHERE {claimable} ORDER BY o.id LIMIT $2"
    ))
    .bind(shards)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    let mut set = 0;
    for id in ids {
        if let Some(why) = why_unprintable(conn, id).await? {
            record(conn, id, &why).await?;
            set += 1;
        }
    }
    Ok(set)
}

/// Why row `id`'s payload cannot be printed, if it cannot.
async fn why_unprintable(conn: &mut PgConnection, id: i64) -> Result<Option<String>> {
    let numbers: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(octet_length(n::text)), 0)::bigint FROM obx.outbox_event o, \
                jsonb_path_query(o.payload, 'strict $.** ? (@.type() == \"number\")') AS n \
         WHERE o.id = $1",
    )
    .bind(id)
    .fetch_one(&mut *conn)
    .await?;
    if numbers > NUMBERS_PRINT_PAST {
        return Ok(Some(format!(
            "its numbers alone print as {numbers} bytes (jsonb prints numbers in full)"
        )));
    }
    let printed = sqlx::query("SELECT octet_length(payload::text) FROM obx.outbox_event WHERE id = $1")
        .bind(id)
        .execute(&mut *conn)
        .await;
    match printed {
        Ok(_) => Ok(None),
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("54000") => {
            let detail = db
                .try_downcast_ref::<PgDatabaseError>()
                .and_then(PgDatabaseError::detail)
                .unwrap_or_default();
            Ok(Some(format!("{} (54000): {detail}", db.message())))
        }
        Err(e) => Err(e.into()),
    }
}

async fn record(conn: &mut PgConnection, id: i64, why: &str) -> Result<()> {
    tracing::error!(
        id,
        why,
        "Postgres cannot print an outbox row's payload; it is set aside and its key moves on"
    );
    metrics::counter!("obx_outbox_set_aside_total").increment(1);
    sqlx::query(
        "INSERT INTO obx.outbox_delivery_failure \
           (outbox_id, topic, partition_key, attempts, last_error, next_attempt_at, set_aside) \
         SELECT id, topic, partition_key, 1, $2, 'infinity', true FROM obx.outbox_event WHERE id = $1 \
         ON CONFLICT (outbox_id) DO UPDATE SET set_aside = true, next_attempt_at = 'infinity', \
           last_error = EXCLUDED.last_error, updated_at = now()",
    )
    .bind(id)
    .bind(format!("Postgres cannot print its payload: {why}"))
    .execute(conn)
    .await?;
    Ok(())
}
