//! The transactional outbox (R-DIST-OBX-1 and R-DIST-OBX-3).
//!
//! Invariants:
//! * A plugin's only way to emit an event is the `outbox` import. Its events are buffered
//!   in the call's state and written here, in the call's own transaction, only when the
//!   handler succeeds: the domain writes and the outbox rows commit together or not at all.
//! * Nothing in the command or event path talks to Kafka. Only the relay does, and only
//!   about rows that are already committed.

pub mod notifier;
pub mod relay;
pub mod replay;
pub mod unprintable;
pub mod writer;

use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::text::shown;

/// The state of the outbox, for `obx status` and the metrics.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Backlog {
    /// Rows not yet published (those set aside excluded).
    pub backlog: i64,
    /// Age of the oldest of them.
    pub oldest_unpublished_seconds: Option<f64>,
    /// Rows the broker refused that wait for another attempt.
    pub rows_failing: i64,
    /// Rows the broker refuses for good, set aside so that their key moves on.
    pub rows_set_aside: i64,
    /// Delayed events not yet due (`outbox.emit-delayed`), outside the backlog.
    pub delayed: i64,
}

/// Reads the [`Backlog`].
pub async fn backlog(pool: &sqlx::PgPool) -> sqlx::Result<Backlog> {
    let (backlog, oldest, failing, set_aside, delayed): (i64, Option<f64>, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE NOT coalesce(f.set_aside, false)), \
                extract(epoch FROM now() - min(o.created_at) FILTER (WHERE NOT coalesce(f.set_aside, false)))::float8, \
                count(f.outbox_id) FILTER (WHERE NOT f.set_aside), \
                count(*) FILTER (WHERE f.set_aside), \
                (SELECT count(*) FROM obx.outbox_delayed) \
         FROM obx.outbox_event o LEFT JOIN obx.outbox_delivery_failure f ON f.outbox_id = o.id \
         WHERE o.published_at IS NULL",
    )
    .fetch_one(pool)
    .await?;
    Ok(Backlog {
        backlog,
        oldest_unpublished_seconds: oldest,
        rows_failing: failing,
        rows_set_aside: set_aside,
        delayed,
    })
}

/// An event a handler emitted, validated, waiting for its transaction to commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEvent {
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    /// Valid JSON text.
    pub payload: String,
    pub topic: String,
    pub partition_key: String,
    /// Milliseconds after its write before the relay may publish it; 0 publishes on commit.
    pub delay_ms: u64,
}

impl NewEvent {
    /// The bytes the host holds for it until its write: its payload and its text fields.
    pub fn bytes(&self) -> usize {
        self.payload.len()
            + self.aggregate_type.len()
            + self.aggregate_id.len()
            + self.event_type.len()
            + self.topic.len()
            + self.partition_key.len()
    }
}

/// The fields of an event as a plugin gave them, before validation.
pub struct RawEvent {
    pub event_id: Option<String>,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: String,
    pub topic: String,
    pub partition_key: Option<String>,
}

/// Why an event was refused; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    TooLarge(String),
}

/// Longest aggregate type, aggregate id, event type and partition key accepted.
const MAX_FIELD_BYTES: usize = 1024;

/// The id an event is stored and published with when the session of `role` (a plugin's,
/// `obx_<installation>_<plugin>`) passes `id`, the one its plugin gave or a UUIDv7 the host
/// assigned: the first 6 bytes of `id` (a UUIDv7's timestamp), then bytes 7 to 16 of SHA-256
/// over a fixed prefix, the role's name, a zero byte and `id`, marked as a UUID of version 8.
/// The database makes every id a plugin's session writes into its plugin's own with the same
/// function (`obx.event_id_in`, migration 0031), whichever function the session calls; the
/// host computes it to tell the plugin what `emit` wrote. The same plugin passing the same id
/// gets the same event id, so a retried emit is still one event, and the ids of a plugin's
/// events still grow with time; but no plugin, of this installation or another, can feasibly
/// write an id that is, or will be, another plugin's (it would need a search of about 2^74
/// hashes), and so make that plugin's emits fail on the outbox's unique index, or a consumer
/// of both skip its event as already processed.
pub fn stored_event_id(role: &str, id: Uuid) -> Uuid {
    let digest = Sha256::new()
        .chain_update(b"obx event id ")
        .chain_update(role.as_bytes())
        .chain_update([0u8])
        .chain_update(id.as_bytes())
        .finalize();
    let mut bytes = *id.as_bytes();
    bytes[6..].copy_from_slice(&digest[6..16]);
    bytes[6] = (bytes[6] & 0x0f) | 0x80;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    Uuid::from_bytes(bytes)
}

impl RawEvent {
    /// Checks every field; assigns a UUIDv7 event id when none was given. The event is stored
    /// with [`stored_event_id`] of that id.
    pub fn validate(self, max_payload_bytes: usize) -> Result<NewEvent, EventError> {
        let event_id = match self.event_id {
            None => Uuid::now_v7(),
            Some(id) => Uuid::parse_str(&id)
                .map_err(|_| EventError::Invalid(format!("event-id {} is not a UUID", shown(&id))))?,
        };
        for (field, value) in [
            ("aggregate-type", &self.aggregate_type),
            ("aggregate-id", &self.aggregate_id),
            ("event-type", &self.event_type),
        ] {
            check_text_field(field, value)?;
        }
        if let Some(key) = &self.partition_key {
            check_text_field("partition-key", key)?;
        }
        check_topic(&self.topic).map_err(EventError::Invalid)?;
        if self.payload.len() > max_payload_bytes {
            return Err(EventError::TooLarge(format!(
                "payload is {} bytes, over the limit of {max_payload_bytes}",
                self.payload.len()
            )));
        }
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&self.payload) {
            return Err(EventError::Invalid(format!("payload is not valid JSON: {e}")));
        }
        // The relay publishes the payload as `jsonb` prints it, numbers in full: that is held
        // to the bound too (as `obx_api.emit_calls` holds it, migration 0035).
        match crate::jsonb::printed_len(&self.payload) {
            Err(reason) => return Err(EventError::Invalid(format!("payload cannot be stored: {reason}"))),
            Ok(printed) if printed > max_payload_bytes => {
                return Err(EventError::TooLarge(format!(
                    "payload is {printed} bytes as jsonb prints it (numbers in full: 1e100 as 101 digits), \
                     over the limit of {max_payload_bytes}"
                )))
            }
            Ok(_) => {}
        }
        let partition_key = self.partition_key.unwrap_or_else(|| self.aggregate_id.clone());
        Ok(NewEvent {
            event_id,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            event_type: self.event_type,
            payload: self.payload,
            topic: self.topic,
            partition_key,
            delay_ms: 0,
        })
    }
}

fn check_text_field(field: &str, value: &str) -> Result<(), EventError> {
    if value.is_empty() {
        return Err(EventError::Invalid(format!("{field} is empty")));
    }
    if value.len() > MAX_FIELD_BYTES {
        return Err(EventError::Invalid(format!(
            "{field} is longer than {MAX_FIELD_BYTES} bytes"
        )));
    }
    if value.contains('\0') {
        return Err(EventError::Invalid(format!("{field} contains a NUL character")));
    }
    Ok(())
}

/// Kafka's rule for topic names: 1 to 249 of `[a-zA-Z0-9._-]`, and not `.` or `..`.
pub fn check_topic(topic: &str) -> Result<(), String> {
    let legal = topic.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if topic.is_empty() || topic.len() > 249 || !legal || topic == "." || topic == ".." {
        return Err(format!(
            "topic {} is not a legal Kafka topic name (1-249 of a-z A-Z 0-9 . _ -)",
            shown(topic)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw() -> RawEvent {
        RawEvent {
            event_id: None,
            aggregate_type: "Order".into(),
            aggregate_id: "o-1".into(),
            event_type: "OrderCreated".into(),
            payload: r#"{"orderId":"o-1"}"#.into(),
            topic: "order.events".into(),
            partition_key: None,
        }
    }

    #[test]
    fn defaults_key_to_aggregate_id_and_assigns_an_id() {
        let e = raw().validate(1024).unwrap();
        assert_eq!(e.partition_key, "o-1");
        assert_eq!(e.event_id.get_version_num(), 7);
    }

    /// An id is the plugin's own: the same role passing the same id gets the same event id (a
    /// version 8 UUID that keeps the id's timestamp); another role passing it, or passing the
    /// event id, gets another.
    #[test]
    fn a_passed_id_becomes_an_id_of_the_plugins_own() {
        let given = Uuid::parse_str("0191d3a4-5b6c-7d8e-9f00-112233445566").unwrap();
        let (role, other) = ("obx_0a1b2c3d_orders", "obx_0a1b2c3d_hostile");
        let ours = stored_event_id(role, given);
        assert_eq!(ours.get_version_num(), 8);
        assert_eq!(ours.get_variant(), uuid::Variant::RFC4122);
        assert_eq!(ours.as_bytes()[..6], given.as_bytes()[..6], "the timestamp stays");
        assert_eq!(stored_event_id(role, given), ours);
        assert_ne!(stored_event_id(other, given), ours);
        assert_ne!(stored_event_id("obx_99999999_orders", given), ours);
        assert_ne!(stored_event_id(other, ours), ours);
        assert_ne!(stored_event_id(role, ours), ours);
        // Postgres's obx.event_id_in gives the same (tests/confinement.rs checks it there).
        assert_eq!(ours.to_string(), "0191d3a4-5b6c-89d1-9572-480e45d865da");
    }

    #[test]
    fn refuses_bad_fields() {
        let cases: Vec<(RawEvent, &str)> = vec![
            (
                RawEvent {
                    payload: "{nope".into(),
                    ..raw()
                },
                "not valid JSON",
            ),
            (
                RawEvent {
                    payload: r#"{"s":"a\u0000b"}"#.into(),
                    ..raw()
                },
                "\\u0000 (NUL), which Postgres's jsonb cannot store",
            ),
            (
                RawEvent {
                    payload: r#"{"s":"a\ud800b"}"#.into(),
                    ..raw()
                },
                "a surrogate escape that is not a pair",
            ),
            (
                RawEvent {
                    payload: r#"{"n":1e131072}"#.into(),
                    ..raw()
                },
                "beyond the range of Postgres's numeric",
            ),
            (
                // 80 bytes as written, 1,048,592 as jsonb prints it.
                RawEvent {
                    payload: format!("[{}1e131071]", "1e131071,".repeat(7)),
                    ..raw()
                },
                "1048592 bytes as jsonb prints it",
            ),
            (
                RawEvent {
                    topic: "bad topic".into(),
                    ..raw()
                },
                "topic",
            ),
            (
                RawEvent {
                    event_type: "".into(),
                    ..raw()
                },
                "event-type is empty",
            ),
            (
                RawEvent {
                    event_id: Some("x".into()),
                    ..raw()
                },
                "not a UUID",
            ),
            (
                RawEvent {
                    payload: format!("\"{}\"", "a".repeat(2000)),
                    ..raw()
                },
                "over the limit",
            ),
        ];
        for (event, needle) in cases {
            let e = event.validate(1024).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }
}
