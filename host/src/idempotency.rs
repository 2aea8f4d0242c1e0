//! `Idempotency-Key` records for commands, kept in `obx.idempotency_key` and written in the
//! command's own transaction (through `obx_api`, since that transaction is the plugin's
//! session): a stored answer exists exactly when the command's effects were committed.

use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::db::literal::{push_bytes, push_text};
use crate::db::sessions::PluginTx;

/// What claiming a key found.
pub enum Claim {
    /// The key is new: this request runs the handler.
    New,
    /// The key was used before, and this is what was answered.
    Answered {
        request_hash: Vec<u8>,
        status: u16,
        body: Vec<u8>,
    },
}

/// The statements that claim `key` for the session's plugin, to send with the `BEGIN`
/// ([`crate::db::sessions::Sessions::begin_then`]), and then mark where the handler's work
/// starts (`savepoint`), which a rejection rolls back to so as to keep the claim. A
/// concurrent request with the same key waits on the claim, on the row, until the first one
/// commits (then it replays) or rolls back (then it runs).
pub fn claim_statements(key: &str, request_hash: &[u8], savepoint: &str) -> String {
    let mut sql = String::from("SELECT fresh, stored_hash, status, response FROM obx_api.claim_idempotency_key(");
    push_text(&mut sql, key);
    sql.push_str(", ");
    push_bytes(&mut sql, request_hash);
    sql.push_str("); ");
    sql.push_str(savepoint);
    sql
}

/// What the claim's row says.
pub fn read_claim(row: Option<&PgRow>) -> sqlx::Result<Claim> {
    let row = row.ok_or(sqlx::Error::RowNotFound)?;
    // try_get: the row comes from the plugin's own session.
    if row.try_get::<bool, _>("fresh")? {
        return Ok(Claim::New);
    }
    Ok(Claim::Answered {
        request_hash: row.try_get::<Option<Vec<u8>>, _>("stored_hash")?.unwrap_or_default(),
        status: row
            .try_get::<Option<i16>, _>("status")?
            .map_or(500, |s| s.clamp(100, 599) as u16),
        body: row.try_get::<Option<Vec<u8>>, _>("response")?.unwrap_or_default(),
    })
}

/// Has the command's transaction store the answer to a claimed key at its commit, in the
/// commit's round trip.
pub fn store_answer_at_commit(tx: &mut PluginTx, key: &str, status: u16, body: &[u8]) {
    let mut sql = String::with_capacity(2 * body.len() + key.len() + 96);
    sql.push_str("SELECT obx_api.store_idempotent_answer(");
    push_text(&mut sql, key);
    sql.push_str(&format!(", {status}::pg_catalog.int2, "));
    push_bytes(&mut sql, body);
    sql.push(')');
    tx.write_at_commit(sql);
}
