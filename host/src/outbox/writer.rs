//! Writes a call's buffered events into `obx.outbox_event`, inside the call's transaction.

use sqlx::PgConnection;

use super::NewEvent;

/// Inserts `events` with one statement, in emit order (so `id` follows emit order), and
/// records the emitting plugin and version on every row. `created_at` is the insert's own
/// clock, taken just before the commit, so that commit-to-publish latency can be measured
/// from it.
pub async fn insert(
    conn: &mut PgConnection,
    plugin_name: &str,
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
    sqlx::query(
        "INSERT INTO obx.outbox_event \
           (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key, \
            plugin_name, plugin_version, created_at, traceparent) \
         SELECT e.event_id, e.aggregate_type, e.aggregate_id, e.event_type, e.payload::jsonb, \
                e.topic, e.partition_key, $8, $9, clock_timestamp(), $10 \
         FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[]) \
           WITH ORDINALITY AS e(event_id, aggregate_type, aggregate_id, event_type, payload, topic, \
                                partition_key, n) \
         ORDER BY e.n",
    )
    .bind(&ids)
    .bind(&aggregate_types)
    .bind(&aggregate_ids)
    .bind(&event_types)
    .bind(&payloads)
    .bind(&topics)
    .bind(&keys)
    .bind(plugin_name)
    .bind(plugin_version)
    .bind(traceparent)
    .execute(conn)
    .await?;
    Ok(())
}
