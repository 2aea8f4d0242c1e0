//! Writes calls' buffered events into the outbox, inside their transaction, through
//! `obx_api.emit_calls` (and `obx_api.emit_delayed` for delayed events): the call's session is the
//! plugin's own, which may not write the outbox itself. The functions name the plugin from the
//! session's login, never from us.
//!
//! The statements are text, with the events as constants ([`crate::db::literal`]), so that the
//! session runs them in the round trip of its `COMMIT` ([`PluginTx::write_at_commit`]): a
//! statement with parameters would take a round trip of its own, one more per command.

use crate::db::literal::{push_array, push_text};
use crate::db::sessions::PluginTx;

use super::NewEvent;

/// The outbox rows of one call: the plugin version that made them, and the trace context
/// they carry.
pub struct CallRows<'a> {
    pub version: &'a str,
    pub traceparent: &'a str,
    pub events: &'a [NewEvent],
}

/// What one statement may carry: the per-call limits (`limits.max_emits_per_call`,
/// `limits.max_emit_bytes_per_call`). `obx_api.emit_calls` holds each call of a statement to
/// the limits recorded for the plugin, by whichever host loaded it last; these keep one
/// statement's size within what one call may write.
#[derive(Clone, Copy)]
pub struct PerStatement {
    pub events: usize,
    pub payload_bytes: usize,
}

/// One `obx_api.emit_calls` statement in the making: its events, each with its trace context,
/// and how many of them each of its calls made.
#[derive(Default)]
struct Statement<'a> {
    events: Vec<(&'a str, &'a NewEvent)>,
    calls: Vec<usize>,
    bytes: usize,
}

/// Has `tx` insert the rows of `calls` at its commit, in order (so `id` follows emit order),
/// with the emitting plugin (the session's) and version recorded on every row. The events
/// published on commit go in as few `obx_api.emit_calls` statements as `per_statement` allows
/// (a batch of consumed events writes its handlers' rows together), a call's never split, and
/// each statement says where its calls begin and end, for the database to hold each to the
/// per-call limits; each call's delayed events, if any, in an `obx_api.emit_delayed` of their
/// own. `created_at` is the insert's own clock, taken just before the commit, so that
/// commit-to-publish latency can be measured from it; a delayed event is due `delay_ms` after
/// it. A refused event fails the commit, which then commits nothing.
pub fn insert_at_commit(tx: &mut PluginTx, calls: &[CallRows<'_>], per_statement: PerStatement) {
    for statement in statements(calls, per_statement) {
        tx.write_at_commit(statement);
    }
}

/// The statements [`insert_at_commit`] has run, in order.
fn statements(calls: &[CallRows<'_>], per_statement: PerStatement) -> Vec<String> {
    let mut out = Vec::new();
    let mut statement = Statement::default();
    let mut version = "";
    for call in calls {
        let now: Vec<&NewEvent> = call.events.iter().filter(|e| e.delay_ms == 0).collect();
        if now.is_empty() {
            continue;
        }
        let call_bytes: usize = now.iter().map(|e| e.payload.len()).sum();
        let full = statement.events.len() + now.len() > per_statement.events
            || statement.bytes + call_bytes > per_statement.payload_bytes
            || call.version != version;
        if full && !statement.events.is_empty() {
            out.push(emit_calls(version, &std::mem::take(&mut statement)));
        }
        version = call.version;
        statement.bytes += call_bytes;
        statement.calls.push(now.len());
        statement.events.extend(now.into_iter().map(|e| (call.traceparent, e)));
    }
    if !statement.events.is_empty() {
        out.push(emit_calls(version, &statement));
    }
    for call in calls {
        let delayed: Vec<&NewEvent> = call.events.iter().filter(|e| e.delay_ms > 0).collect();
        if !delayed.is_empty() {
            out.push(emit_delayed(call, &delayed));
        }
    }
    out
}

/// `SELECT obx_api.emit_calls(…)` for `statement`: its calls' sizes, then the events, each with
/// its trace context, as the parallel arrays the function takes.
fn emit_calls(version: &str, statement: &Statement<'_>) -> String {
    let events = &statement.events;
    let mut sql = String::with_capacity(capacity(events.iter().map(|(_, e)| *e)));
    sql.push_str("SELECT obx_api.emit_calls(");
    push_text(&mut sql, version);
    sql.push_str(", ");
    let sizes: Vec<String> = statement.calls.iter().map(usize::to_string).collect();
    push_array(&mut sql, sizes.iter().map(String::as_str), "pg_catalog.int4");
    sql.push_str(", ");
    push_array(&mut sql, events.iter().map(|(t, _)| *t), "pg_catalog.text");
    push_columns(&mut sql, events.iter().map(|(_, e)| *e));
    sql.push(')');
    sql
}

/// `SELECT obx_api.emit_delayed(…)` for the delayed `events` of `call`, and their delays.
fn emit_delayed(call: &CallRows<'_>, events: &[&NewEvent]) -> String {
    let mut sql = String::with_capacity(capacity(events.iter().copied()));
    sql.push_str("SELECT obx_api.emit_delayed(");
    push_text(&mut sql, call.version);
    sql.push_str(", ");
    push_text(&mut sql, call.traceparent);
    push_columns(&mut sql, events.iter().copied());
    let delays: Vec<String> = events
        .iter()
        .map(|e| i64::try_from(e.delay_ms).unwrap_or(i64::MAX).to_string())
        .collect();
    sql.push_str(", ");
    push_array(&mut sql, delays.iter().map(String::as_str), "pg_catalog.int8");
    sql.push(')');
    sql
}

fn capacity<'a>(events: impl Iterator<Item = &'a NewEvent>) -> usize {
    events.map(|e| e.payload.len() + 320).sum::<usize>() + 256
}

/// Appends `, ids, aggregate types, aggregate ids, event types, payloads, topics, partition
/// keys`: the arrays both functions take, in their order.
fn push_columns<'a>(sql: &mut String, events: impl Iterator<Item = &'a NewEvent> + Clone) {
    let ids: Vec<String> = events.clone().map(|e| e.event_id.to_string()).collect();
    sql.push_str(", ");
    push_array(sql, ids.iter().map(String::as_str), "pg_catalog.uuid");
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
        push_array(sql, events.clone().map(column), "pg_catalog.text");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(payload_bytes: usize, delay_ms: u64) -> NewEvent {
        NewEvent {
            event_id: uuid::Uuid::now_v7(),
            aggregate_type: "Item".into(),
            aggregate_id: "i".into(),
            event_type: "ItemEmitted".into(),
            payload: format!("\"{}\"", "x".repeat(payload_bytes.saturating_sub(2))),
            topic: "t".into(),
            partition_key: "k".into(),
            delay_ms,
        }
    }

    /// A call for each of `events`, all of version 1.
    fn calls_of(events: &[Vec<NewEvent>]) -> Vec<CallRows<'_>> {
        events
            .iter()
            .map(|events| CallRows {
                version: "1",
                traceparent: "tp",
                events,
            })
            .collect()
    }

    /// The calls' sizes each `emit_calls` statement names, in order.
    fn sizes(statements: &[String]) -> Vec<String> {
        statements
            .iter()
            .filter(|s| s.starts_with("SELECT obx_api.emit_calls("))
            .map(|s| {
                // The version, then the sizes: `emit_calls(E'1', E'{"1","1"}'::pg_catalog.int4[], …`.
                let start = s.find("E'{").expect("the sizes array") + 3;
                s[start..start + s[start..].find('}').expect("its end")].to_string()
            })
            .collect()
    }

    /// A batch's calls go into as few statements as the per-statement bounds allow, in order,
    /// each call whole, each statement naming its calls' sizes; a change of plugin version
    /// starts a statement, a call over the bounds goes alone, delayed events go apart.
    #[test]
    fn calls_are_grouped_whole_within_the_bounds() {
        let one: Vec<Vec<NewEvent>> = (0..10).map(|_| vec![event(10, 0)]).collect();
        let calls = calls_of(&one);
        let bound = PerStatement {
            events: 4,
            payload_bytes: 1 << 20,
        };
        assert_eq!(
            sizes(&statements(&calls, bound)),
            ["\"1\",\"1\",\"1\",\"1\"", "\"1\",\"1\",\"1\",\"1\"", "\"1\",\"1\""]
        );

        let (three, five, two) = (vec![event(10, 0); 3], vec![event(10, 0); 5], vec![event(10, 0); 2]);
        let delayed = vec![event(10, 0), event(10, 5000)];
        let calls = [
            CallRows {
                version: "1",
                traceparent: "a",
                events: &three,
            },
            CallRows {
                version: "1",
                traceparent: "b",
                events: &five,
            },
            CallRows {
                version: "2",
                traceparent: "c",
                events: &two,
            },
            CallRows {
                version: "2",
                traceparent: "d",
                events: &delayed,
            },
        ];
        let written = statements(&calls, bound);
        // Three then five would be eight: the five go alone, over the bound as one call.
        assert_eq!(sizes(&written), ["\"3\"", "\"5\"", "\"2\",\"1\""]);
        assert!(written[3].starts_with("SELECT obx_api.emit_delayed("), "{written:?}");
        assert_eq!(written.len(), 4);

        let bytes = PerStatement {
            events: 1000,
            payload_bytes: 25,
        };
        assert_eq!(sizes(&statements(&calls[..1], bytes)), ["\"3\""]);
        let small: Vec<Vec<NewEvent>> = (0..3).map(|_| vec![event(10, 0)]).collect();
        let calls = calls_of(&small);
        assert_eq!(sizes(&statements(&calls, bytes)), ["\"1\",\"1\"", "\"1\""]);
    }
}
