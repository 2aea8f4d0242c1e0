//! Writes a call's buffered events into the outbox, inside the call's transaction, through
//! `obx_api.emit` (and `obx_api.emit_delayed` for delayed events): the call's session is the
//! plugin's own, which may not write the outbox itself. The functions name the plugin from the
//! session's login, never from us.
//!
//! The statements are text, with the events as constants ([`crate::db::literal`]), so that the
//! session runs them in the round trip of its `COMMIT` ([`PluginTx::write_at_commit`]): a
//! statement with parameters would take a round trip of its own, one more per command.

use crate::db::literal::{push_array, push_optional_text, push_text};
use crate::db::sessions::PluginTx;

use super::NewEvent;

/// Has `tx` insert `events` at its commit, in emit order (so `id` follows emit order), with one
/// statement for the events published on commit and one more for delayed events, if any, and
/// the emitting plugin (the session's) and version recorded on every row. `created_at` is the
/// insert's own clock, taken just before the commit, so that commit-to-publish latency can be
/// measured from it; a delayed event is due `delay_ms` after it. A refused event fails the
/// commit, which then commits nothing.
pub fn insert_at_commit(tx: &mut PluginTx, plugin_version: &str, traceparent: Option<&str>, events: &[NewEvent]) {
    let (delayed, now): (Vec<&NewEvent>, Vec<&NewEvent>) = events.iter().partition(|e| e.delay_ms > 0);
    if !now.is_empty() {
        tx.write_at_commit(statement(plugin_version, traceparent, &now, false));
    }
    if !delayed.is_empty() {
        tx.write_at_commit(statement(plugin_version, traceparent, &delayed, true));
    }
}

/// `SELECT obx_api.emit(…)` for `events`, the fields as the parallel arrays the function
/// takes; `obx_api.emit_delayed(…)` and their delays if `delayed`.
fn statement(plugin_version: &str, traceparent: Option<&str>, events: &[&NewEvent], delayed: bool) -> String {
    let bytes: usize = events.iter().map(|e| e.payload.len() + 256).sum();
    let mut sql = String::with_capacity(bytes + 256);
    sql.push_str(if delayed {
        "SELECT obx_api.emit_delayed("
    } else {
        "SELECT obx_api.emit("
    });
    push_text(&mut sql, plugin_version);
    sql.push_str(", ");
    push_optional_text(&mut sql, traceparent);
    let ids: Vec<String> = events.iter().map(|e| e.event_id.to_string()).collect();
    sql.push_str(", ");
    push_array(&mut sql, ids.iter().map(String::as_str), "pg_catalog.uuid");
    let columns: [fn(&NewEvent) -> &str; 6] = [
        |e| &e.aggregate_type,
        |e| &e.aggregate_id,
        |e| &e.event_type,
        |e| &e.payload,
        |e| &e.topic,
        |e| &e.partition_key,
    ];
    for column in columns {
        sql.push_str(", ");
        push_array(&mut sql, events.iter().map(|e| column(e)), "pg_catalog.text");
    }
    if delayed {
        let delays: Vec<String> = events
            .iter()
            .map(|e| i64::try_from(e.delay_ms).unwrap_or(i64::MAX).to_string())
            .collect();
        sql.push_str(", ");
        push_array(&mut sql, delays.iter().map(String::as_str), "pg_catalog.int8");
    }
    sql.push(')');
    sql
}
