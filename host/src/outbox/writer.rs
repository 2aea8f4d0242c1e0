//! Writes a call's buffered events into the outbox, inside the call's transaction, through
//! `obx_api.emit` (and `obx_api.emit_delayed` for delayed events): the call's session is the
//! plugin's own, which may not write the outbox itself. The functions name the plugin from the
//! session's login, never from us.

use sqlx::PgConnection;

use super::NewEvent;

/// Inserts `events` in emit order (so `id` follows emit order), with one statement for the
/// events published on commit and one more for delayed events, if any, and records the
/// emitting plugin (the session's) and version on every row. `created_at` is the insert's own
/// clock, taken just before the commit, so that commit-to-publish latency can be measured
/// from it; a delayed event is due `delay_ms` after it.
pub async fn insert(
    conn: &mut PgConnection,
    plugin_version: &str,
    traceparent: Option<&str>,
    events: &[NewEvent],
) -> sqlx::Result<()> {
    let (delayed, now): (Vec<&NewEvent>, Vec<&NewEvent>) = events.iter().partition(|e| e.delay_ms > 0);
    if !now.is_empty() {
        Columns::of(&now)
            .bind(sqlx::query("SELECT obx_api.emit($8, $9, $1, $2, $3, $4, $5, $6, $7)"))
            .bind(plugin_version)
            .bind(traceparent)
            .execute(&mut *conn)
            .await?;
    }
    if !delayed.is_empty() {
        let delays: Vec<i64> = delayed
            .iter()
            .map(|e| i64::try_from(e.delay_ms).unwrap_or(i64::MAX))
            .collect();
        Columns::of(&delayed)
            .bind(sqlx::query(
                "SELECT obx_api.emit_delayed($8, $9, $1, $2, $3, $4, $5, $6, $7, $10)",
            ))
            .bind(plugin_version)
            .bind(traceparent)
            .bind(delays)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// The events' fields as the parallel arrays the functions take.
struct Columns<'a> {
    ids: Vec<uuid::Uuid>,
    aggregate_types: Vec<&'a str>,
    aggregate_ids: Vec<&'a str>,
    event_types: Vec<&'a str>,
    payloads: Vec<&'a str>,
    topics: Vec<&'a str>,
    keys: Vec<&'a str>,
}

impl<'a> Columns<'a> {
    fn of(events: &[&'a NewEvent]) -> Self {
        Columns {
            ids: events.iter().map(|e| e.event_id).collect(),
            aggregate_types: events.iter().map(|e| e.aggregate_type.as_str()).collect(),
            aggregate_ids: events.iter().map(|e| e.aggregate_id.as_str()).collect(),
            event_types: events.iter().map(|e| e.event_type.as_str()).collect(),
            payloads: events.iter().map(|e| e.payload.as_str()).collect(),
            topics: events.iter().map(|e| e.topic.as_str()).collect(),
            keys: events.iter().map(|e| e.partition_key.as_str()).collect(),
        }
    }

    /// Binds $1 to $7.
    fn bind<'q>(
        self,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>
    where
        'a: 'q,
    {
        query
            .bind(self.ids)
            .bind(self.aggregate_types)
            .bind(self.aggregate_ids)
            .bind(self.event_types)
            .bind(self.payloads)
            .bind(self.topics)
            .bind(self.keys)
    }
}
