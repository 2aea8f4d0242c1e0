//! Rows whose payload Postgres cannot print. The relay claims rows with `payload::text`, and
//! `jsonb` prints every number in full, so a payload of 90 KB of `1e131071` prints as 1.3 GB,
//! past the gigabyte Postgres can build: every claim that reached such a row failed, and no
//! event on its shard was published again. `obx_api.emit_calls` refuses such payloads since
//! migration 0035, which set aside those stored before it; this is the relay's own wall, for
//! a row that came in another way (a delayed event released later, a row written by hand).
//!
//! When a claim fails so, the relay looks at the rows it would claim one at a time, without
//! their payloads, prints each payload alone, and sets aside each one Postgres cannot print,
//! as it sets aside a row the broker refuses for good: its key moves on.

use anyhow::Result;
use sqlx::PgConnection;

/// Whether `e` is Postgres failing to build a value that large (`program_limit_exceeded`, as
/// "Cannot enlarge string buffer", or `out_of_memory`).
pub fn failed_to_print(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("54000" | "53200")))
}

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
        let printed = sqlx::query("SELECT octet_length(payload::text) FROM obx.outbox_event WHERE id = $1")
            .bind(id)
            .execute(&mut *conn)
            .await;
        match printed {
            Ok(_) => {}
            Err(e) if failed_to_print(&e) => {
                record(conn, id, &e.to_string()).await?;
                set += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(set)
}

async fn record(conn: &mut PgConnection, id: i64, error: &str) -> Result<()> {
    tracing::error!(
        id,
        error,
        "Postgres cannot print an outbox row's payload (jsonb prints numbers in full); it is set aside \
         and its key moves on"
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
    .bind(format!("Postgres cannot print its payload: {error}"))
    .execute(conn)
    .await?;
    Ok(())
}
