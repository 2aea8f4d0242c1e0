//! Writes a call's buffered events into `obx.outbox_event`, inside the call's transaction,
//! through `obx_api.emit`: the call's session is the plugin's own, which may not write the
//! outbox itself. The function names the plugin from the session's login, never from us.

use sqlx::PgConnection;

use super::NewEvent;

/// Inserts `events` with one statement, in emit order (so `id` follows emit order), and
/// records the emitting plugin (the session's) and version on every row. `created_at` is the insert's own
/// clock, taken just before the commit, so that commit-to-publish latency can be measured
/// from it.
pub async fn insert(
    conn: &mut PgConnection,
    plugin_version: &str,
    traceparent: Option<&str>,
    events: &[NewEvent],
) -> sqlx::Result<()> {
    if events.is_empty() {
        return Ok(());
    }
    let mut ids = Vec::with_capacity(events.len());
    let mut aggregate_types = Vec::with_capacity(events.len());
    let mut aggregate_ids = Vec::with_capacity(events.len());
    let mut event_types = Vec::with_capacity(events.len());
    let mut payloads = Vec::with_capacity(events.len());
    let mut topics = Vec::with_capacity(events.len());
    let mut keys = Vec::with_capacity(events.len());
    for e in events {
        ids.push(e.event_id);
        aggregate_types.push(e.aggregate_type.as_str());
        aggregate_ids.push(e.aggregate_id.as_str());
        event_types.push(e.event_type.as_str());
        payloads.push(e.payload.as_str());
        topics.push(e.topic.as_str());
        keys.push(e.partition_key.as_str());
    }
    sqlx::query("SELECT obx_api.emit($8, $9, $1, $2, $3, $4, $5, $6, $7)")
        .bind(&ids)
        .bind(&aggregate_types)
        .bind(&aggregate_ids)
        .bind(&event_types)
        .bind(&payloads)
        .bind(&topics)
        .bind(&keys)
        .bind(plugin_version)
        .bind(traceparent)
        .execute(conn)
        .await?;
    Ok(())
}
