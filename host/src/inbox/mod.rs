//! Event consumption (R-DIST-OBX-2): each event's handler takes effect once.
//!
//! * [`consumer`] — one Kafka consumer per plugin, committing as group `<service>.<plugin>`,
//!   its partitions leased in Postgres (`lease`, `leased`) or given by the group. In dedup mode
//!   (the default) it runs the handler in a transaction that first inserts
//!   `(consumer, event_id)` into `processed_event`; in inbox mode it only stores the event in
//!   `inbox_event`. Either way the offset is stored after the commit, never before.
//! * [`processor`] — inbox processors: claim the next event of a key with
//!   `FOR UPDATE SKIP LOCKED` and process it in that same transaction.
//! * `handling` — the one path from a taken event to its handler's commit, both modes: a
//!   savepoint per event, the first failure ends the run, outbox rows just before the commit.
//! * [`dlq`] — the dead-letter table: list, retry, discard.
//! * [`counts`] — what waits in each plugin's consumption, for `/v1/status` and the gauges.
//! * [`ConsumerLag`] — the lag librdkafka last reported per partition, for `/v1/status`.
//!
//! Invariants:
//! * A handler's effects, its outbox rows and the record that the event was processed
//!   commit in one transaction: a crash at any point redelivers the event, and the record
//!   makes the redelivery a no-op.
//! * A key's events are handled in their Kafka order. A failing event is retried with
//!   backoff; after `consumer.max_attempts` it is parked, and so is every later event of its
//!   key, until the dead letter is retried or discarded. Other keys keep flowing.
//! * A message that is not an event (see [`Incoming::parse`]) is quarantined with its reason
//!   and skipped; it never stops its partition.

pub mod consumer;
mod counts;
pub mod dlq;
mod freeing;
pub(crate) mod handling;
mod lag;
mod lease;
mod leased;
pub mod processor;
mod stuck;
pub mod supervisor;

pub use self::counts::{counts, Counts};
pub use self::freeing::Freeing;
pub use self::lag::ConsumerLag;

use std::collections::BTreeMap;

use rdkafka::message::{BorrowedHeaders, Headers, Message, OwnedMessage};
use serde_json::Value;
use uuid::Uuid;

use crate::text::shown;

/// An event as it arrived from Kafka, validated.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub event_id: Uuid,
    pub event_type: String,
    pub topic: String,
    pub key: Option<String>,
    /// Valid JSON text.
    pub payload: String,
    /// Every header whose value is UTF-8.
    pub headers: BTreeMap<String, String>,
    pub partition: i32,
    pub offset: i64,
}

/// Why a message was quarantined.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Quarantine(pub String);

/// The longest message key taken, in bytes: what `emit` allows a partition key. Postgres
/// cannot index a much longer one (the inbox's key order), nor store a NUL in it; such a
/// message used to be retried for ever, holding up its partition, then the consumer.
pub const MAX_KEY_BYTES: usize = 1024;

/// The most header bytes (names and values, and [`HEADER_OVERHEAD`] for each header) a
/// message may carry to be taken: about a thousand empty headers. The value is
/// bounded by `consumer.max_message_bytes`; the headers were not, and went whole into the
/// inbox, each handler call and the quarantine.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

impl Incoming {
    /// Validates a Kafka message: an event id and type (see [`identity`]), a UTF-8 key (if
    /// any) of at most [`MAX_KEY_BYTES`] and no NUL, headers of at most [`MAX_HEADER_BYTES`],
    /// and a JSON value of at most `max_bytes`.
    /// The topic loses `topic_prefix`.
    pub fn parse(m: &OwnedMessage, max_bytes: usize, topic_prefix: &str) -> Result<Incoming, Quarantine> {
        let q = |reason: String| Quarantine(reason);
        let value = m.payload().ok_or_else(|| q("the message has no value".into()))?;
        if value.len() > max_bytes {
            return Err(q(format!(
                "the value is {} bytes, over the limit of {max_bytes}",
                value.len()
            )));
        }
        let key = match m.key() {
            None => None,
            Some(k) if k.len() > MAX_KEY_BYTES => {
                return Err(q(format!(
                    "the key is {} bytes, over the limit of {MAX_KEY_BYTES}",
                    k.len()
                )))
            }
            Some(k) if k.contains(&0) => {
                return Err(q("the key holds a NUL character, which Postgres cannot store".into()))
            }
            Some(k) => Some(
                std::str::from_utf8(k)
                    .map_err(|_| q("the key is not UTF-8".into()))?
                    .to_string(),
            ),
        };
        let header_bytes = message_bytes(m) - value.len() - m.key().map_or(0, <[u8]>::len);
        if header_bytes > MAX_HEADER_BYTES {
            return Err(q(format!(
                "the headers hold {header_bytes} bytes (counting {HEADER_OVERHEAD} for each of the {} headers), \
                 over the limit of {MAX_HEADER_BYTES}",
                m.headers().map_or(0, |h| h.count())
            )));
        }
        let headers = utf8_headers(m);
        let (event_id, event_type) = identity(&headers).map_err(q)?;
        let payload = std::str::from_utf8(value).map_err(|_| q("the value is not UTF-8".into()))?;
        serde_json::from_str::<serde::de::IgnoredAny>(payload).map_err(|e| q(format!("the value is not JSON: {e}")))?;
        // Read back (an inbox claim) as `jsonb` prints it, every number in full: 5 KB of
        // `1e131071` prints as 65 MB, 90 KB as more than Postgres can print, and a claim that
        // reached it failed for ever. Twice the bound leaves room for the space `jsonb` puts
        // after each `,` and `:`.
        match crate::jsonb::printed_len(payload) {
            Err(reason) => return Err(q(format!("the value cannot be stored: {reason}"))),
            Ok(printed) if printed > max_bytes.saturating_mul(2) => {
                return Err(q(format!(
                    "the value is {printed} bytes as jsonb prints it (numbers in full: 1e100 as 101 digits), \
                     over twice the limit of {max_bytes}"
                )))
            }
            Ok(_) => {}
        }
        if let Some(name) = headers
            .iter()
            .find_map(|(k, v)| (k.contains('\0') || v.contains('\0')).then_some(k))
        {
            return Err(q(format!(
                "the header {} holds a NUL character, which Postgres cannot store",
                shown(name)
            )));
        }
        Ok(Incoming {
            event_id,
            event_type,
            topic: m.topic().strip_prefix(topic_prefix).unwrap_or(m.topic()).to_string(),
            key,
            payload: payload.to_string(),
            headers,
            partition: m.partition(),
            offset: m.offset(),
        })
    }

    pub fn headers_json(&self) -> Value {
        serde_json::to_value(&self.headers).unwrap_or(Value::Null)
    }
}

/// The namespace of the event ids made from CloudEvents' `ce_source` and `ce_id`.
const CLOUDEVENTS_ID_NAMESPACE: Uuid = uuid::uuid!("3eccc7b8-082c-47ea-8cb3-65a466f6cfcb");

/// An event's id and type: the seed's `eventId` (a UUID) and `eventType` headers; or, on a
/// message that has no `eventId` and is a CloudEvent in Kafka's binary mode
/// (`ce_specversion` 1.x), its `ce_id` and `ce_type`. A CloudEvent is identified by its
/// source and id together, so a `ce_id` that is not a UUID becomes the UUID v5 of
/// `ce_source` and `ce_id`: a redelivered CloudEvent is the same event, and two sources'
/// equal ids are not. A `ce_id` that is a UUID is the event id as it is, as an `eventId` is.
///
/// The nil UUID is refused (the message is quarantined): it is a producer's unset field,
/// and every event after the first to carry it would be skipped as a duplicate of it.
fn identity(headers: &BTreeMap<String, String>) -> Result<(Uuid, String), String> {
    let (id, event_type) = given_identity(headers)?;
    if id.is_nil() {
        return Err("the event id is the nil UUID (an unset field?): every event with it would be one event".into());
    }
    Ok((id, event_type))
}

fn given_identity(headers: &BTreeMap<String, String>) -> Result<(Uuid, String), String> {
    let cloudevent = headers.get("ce_specversion").is_some_and(|v| v.starts_with("1."));
    if !headers.contains_key("eventId") && cloudevent {
        let id = headers
            .get("ce_id")
            .filter(|i| !i.is_empty())
            .ok_or("the CloudEvent has no ce_id header")?;
        let source = headers
            .get("ce_source")
            .filter(|s| !s.is_empty())
            .ok_or("the CloudEvent has no ce_source header")?;
        let event_type = headers
            .get("ce_type")
            .filter(|t| !t.is_empty())
            .ok_or("the CloudEvent has no ce_type header")?;
        return Ok((cloudevent_id(source, id), event_type.clone()));
    }
    let event_id = headers
        .get("eventId")
        .ok_or("the message has no eventId header (nor is it a CloudEvent with ce_id)")?;
    let event_id =
        Uuid::parse_str(event_id).map_err(|_| format!("the eventId header {} is not a UUID", shown(event_id)))?;
    let event_type = headers
        .get("eventType")
        .filter(|t| !t.is_empty())
        .ok_or("the message has no eventType header")?;
    Ok((event_id, event_type.clone()))
}

/// The event id a CloudEvents-only message gets: see [`identity`].
pub fn cloudevent_id(source: &str, id: &str) -> Uuid {
    Uuid::parse_str(id)
        .unwrap_or_else(|_| Uuid::new_v5(&CLOUDEVENTS_ID_NAMESPACE, format!("{source}\n{id}").as_bytes()))
}

/// Headers whose name and value are UTF-8, by name (the last one wins).
pub fn utf8_headers(m: &OwnedMessage) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    each_header(m, |name, value| {
        if let (Ok(name), Some(Ok(value))) = (std::str::from_utf8(name), value.map(std::str::from_utf8)) {
            out.insert(name.to_string(), value.to_string());
        }
    });
    out
}

/// What a header costs the host beyond its name and value, in bytes: librdkafka's copy of
/// each header in a detached message is an allocation of its own (a list entry and its
/// bookkeeping). An empty header is 2 bytes on the wire.
pub const HEADER_OVERHEAD: usize = 64;

/// The bytes a message holds: its value, its key and its headers, each header with
/// [`HEADER_OVERHEAD`]. Without it, a message of 500,000 empty headers counted as empty while
/// its copy held about 30 MB, and the consumers' in-flight budget let thousands in.
pub fn message_bytes(m: &OwnedMessage) -> usize {
    let mut bytes = m.payload().map_or(0, <[u8]>::len) + m.key().map_or(0, <[u8]>::len);
    each_header(m, |name, value| {
        bytes += name.len() + value.map_or(0, <[u8]>::len) + HEADER_OVERHEAD
    });
    bytes
}

/// Calls `visit` with each header's name and value, as bytes.
///
/// Read through librdkafka itself: rdkafka's reader (`Headers::try_get`, and so `iter`)
/// unwraps each name as UTF-8 and panics on one that is not, which any producer can send
/// (Kafka's header names are bytes to most clients). That panic ended a consumer's lane, and
/// then the consumer, on every host that took the partition.
fn each_header(m: &OwnedMessage, mut visit: impl FnMut(&[u8], Option<&[u8]>)) {
    let Some(headers) = m.headers() else {
        return;
    };
    // A `BorrowedHeaders` is the native header list itself, seen through a zero-sized type:
    // rdkafka makes one by casting the pointer, and its address is that pointer.
    let native = headers.as_borrowed() as *const BorrowedHeaders as *const rdkafka::bindings::rd_kafka_headers_t;
    for idx in 0..headers.count() {
        let (mut name, mut value, mut size) = (std::ptr::null(), std::ptr::null(), 0usize);
        // SAFETY: `native` is the live header list of `m`, borrowed for this loop; librdkafka
        // gives a NUL-terminated name and a value of `size` bytes that live as long as it.
        unsafe {
            let err = rdkafka::bindings::rd_kafka_header_get_all(native, idx, &mut name, &mut value, &mut size);
            if err != rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
                continue;
            }
            let value = (!value.is_null()).then(|| std::slice::from_raw_parts(value.cast::<u8>(), size));
            visit(std::ffi::CStr::from_ptr(name).to_bytes(), value);
        }
    }
}

/// The delay before attempt `attempt + 1`: doubling from `initial`, at most `max`.
pub fn backoff(initial: std::time::Duration, max: std::time::Duration, attempt: u32) -> std::time::Duration {
    initial
        .saturating_mul(2u32.saturating_pow(attempt.saturating_sub(1)))
        .min(max)
}

/// The wait before a try that lost a race is repeated, `contended` into its episode of
/// contention: a quarter of it, at least `least` (the attempt's backoff) and at most `most`
/// (`consumer.backoff_max`) unless `least` is more. The first tries come as quickly as an
/// attempt's, and with the defaults the whole grace costs about 105 tries of a lock wait
/// (1 s each), not 550, and 140 of a race lost at once, not 6,000. `obx.contended_wait`
/// (migration 0030) is the same rule for the inbox and timers.
pub fn contended_wait(
    contended: std::time::Duration,
    least: std::time::Duration,
    most: std::time::Duration,
) -> std::time::Duration {
    (contended / 4).min(most).max(least)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage, Timestamp};

    fn message(key: Option<&[u8]>, value: Option<&[u8]>, headers: &[(&str, &[u8])]) -> OwnedMessage {
        let mut h = OwnedHeaders::new();
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(*v),
            });
        }
        OwnedMessage::new(
            value.map(<[u8]>::to_vec),
            key.map(<[u8]>::to_vec),
            "t".into(),
            Timestamp::NotAvailable,
            0,
            7,
            Some(h),
        )
    }

    const ID: &[u8] = b"5f0c7a51-0b5e-4a8e-9a0e-0d1f2c3b4a59";

    #[test]
    fn a_seed_style_event_parses() {
        let m = message(
            Some(b"k"),
            Some(br#"{"a":1}"#),
            &[("eventId", ID), ("eventType", b"OrderCreated")],
        );
        let e = Incoming::parse(&m, 1024, "").unwrap();
        assert_eq!(e.event_type, "OrderCreated");
        assert_eq!(e.key.as_deref(), Some("k"));
        assert_eq!((e.partition, e.offset), (0, 7));
    }

    /// The consumer's in-flight budget charged the value only: a message of a large key or
    /// headers and an empty value cost almost nothing of it.
    #[test]
    fn message_bytes_counts_the_key_and_the_headers() {
        let key = vec![b'k'; 5000];
        let m = message(Some(&key), Some(b"{}"), &[("eventId", ID), ("big", &[b'v'; 7000])]);
        assert_eq!(
            message_bytes(&m),
            2 + 5000 + "eventId".len() + ID.len() + 3 + 7000 + 2 * HEADER_OVERHEAD
        );
    }

    /// Empty headers cost the host an allocation each: a message of many is counted as such,
    /// and quarantined past the headers' limit. It counted as empty before, so that the
    /// in-flight budget let thousands of such messages in (about 30 MB each, copied).
    #[test]
    fn many_empty_headers_count_and_are_quarantined() {
        let many: Vec<(&str, &[u8])> = std::iter::repeat_n(("", &b""[..]), 2000).collect();
        let mut headers = vec![("eventId", ID), ("eventType", &b"X"[..])];
        headers.extend(many);
        let m = message(None, Some(b"{}"), &headers);
        assert!(message_bytes(&m) >= 2000 * HEADER_OVERHEAD);
        let refused = Incoming::parse(&m, 1 << 20, "").unwrap_err();
        assert!(refused.0.contains("2002 headers"), "{refused}");
    }

    /// 5 KB of `1e131071` prints as 65 MB of `jsonb`, which every inbox claim of it read.
    #[test]
    fn a_value_that_prints_past_twice_its_bound_is_quarantined() {
        let headers = [("eventId", ID), ("eventType", &b"X"[..])];
        let wide = format!("[{}1]", "1e131071,".repeat(20));
        let refused = Incoming::parse(&message(None, Some(wide.as_bytes()), &headers), 1 << 20, "").unwrap_err();
        assert!(refused.0.contains("as jsonb prints it"), "{refused}");
        // Compact JSON prints half again as long (`1,1` as `1, 1`): taken.
        let compact = format!("[{}1]", "1,".repeat(1000));
        assert!(Incoming::parse(&message(None, Some(compact.as_bytes()), &headers), 2003, "").is_ok());
    }

    /// rdkafka's own header reader panicked on this, ending the consumer on every host.
    #[test]
    fn a_header_name_that_is_not_utf8_is_skipped_not_a_panic() {
        let h = OwnedHeaders::new()
            .insert(Header {
                key: "eventId",
                value: Some(ID),
            })
            .insert(Header {
                key: "eventType",
                value: Some(b"X"),
            });
        let native = h.as_borrowed() as *const BorrowedHeaders as *mut rdkafka::bindings::rd_kafka_headers_t;
        // SAFETY: the list is alive, and librdkafka copies the name and value.
        let err = unsafe {
            rdkafka::bindings::rd_kafka_header_add(native, b"\xff".as_ptr().cast(), 1, b"v".as_ptr().cast(), 1)
        };
        assert_eq!(err, rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);
        let m = OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            7,
            Some(h),
        );
        assert_eq!(m.headers().map(Headers::count), Some(3));
        let e = Incoming::parse(&m, 1024, "").unwrap();
        assert_eq!(e.headers.keys().collect::<Vec<_>>(), ["eventId", "eventType"]);
    }

    #[test]
    fn a_long_event_id_is_shown_cut_in_the_reason() {
        let long = "x".repeat(50_000);
        let m = message(None, Some(b"{}"), &[("eventId", long.as_bytes()), ("eventType", b"X")]);
        let reason = Incoming::parse(&m, 1024, "").unwrap_err().0;
        assert!(
            reason.contains("not a UUID") && reason.contains("50000 bytes"),
            "{reason}"
        );
        assert!(reason.len() < 200, "{reason}");
    }

    #[test]
    fn each_bad_input_class_has_its_reason() {
        let good: &[(&str, &[u8])] = &[("eventId", ID), ("eventType", b"X")];
        let cases: Vec<(OwnedMessage, &str)> = vec![
            (message(None, Some(b"{}"), &[("eventType", b"X")]), "no eventId header"),
            (
                message(None, Some(b"{}"), &[("eventId", b"42"), ("eventType", b"X")]),
                "not a UUID",
            ),
            (message(None, Some(b"{}"), &[("eventId", ID)]), "no eventType header"),
            (
                message(
                    None,
                    Some(b"{}"),
                    &[
                        ("eventId", b"00000000-0000-0000-0000-000000000000"),
                        ("eventType", b"X"),
                    ],
                ),
                "nil UUID",
            ),
            (
                message(
                    None,
                    Some(b"{}"),
                    &[
                        ("ce_specversion", b"1.0"),
                        ("ce_id", b"00000000-0000-0000-0000-000000000000"),
                        ("ce_source", b"/s"),
                        ("ce_type", b"T"),
                    ],
                ),
                "nil UUID",
            ),
            (message(None, Some(b"not json"), good), "not JSON"),
            (message(None, Some(b"\xff\xfe"), good), "not UTF-8"),
            (message(Some(b"\xff\xfe"), Some(b"{}"), good), "key is not UTF-8"),
            (message(Some(b"a\0b"), Some(b"{}"), good), "key holds a NUL"),
            (message(Some(&[b'k'; 1025]), Some(b"{}"), good), "key is 1025 bytes"),
            (message(None, Some(&[b' '; 2000]), good), "over the limit"),
            (message(None, None, good), "no value"),
        ];
        for (m, needle) in cases {
            let e = Incoming::parse(&m, 1024, "").unwrap_err();
            assert!(e.0.contains(needle), "{e}");
        }
    }

    #[test]
    fn a_cloudevents_only_message_is_an_event_named_by_its_source_and_id() {
        let ce = |id: &'static [u8], source: &'static [u8]| {
            message(
                Some(b"k"),
                Some(b"{}"),
                &[
                    ("ce_specversion", b"1.0"),
                    ("ce_id", id),
                    ("ce_source", source),
                    ("ce_type", b"com.example.Thing"),
                ],
            )
        };
        let a = Incoming::parse(&ce(b"evt-42", b"/billing"), 1024, "").unwrap();
        assert_eq!(a.event_type, "com.example.Thing");
        let again = Incoming::parse(&ce(b"evt-42", b"/billing"), 1024, "").unwrap();
        let elsewhere = Incoming::parse(&ce(b"evt-42", b"/shipping"), 1024, "").unwrap();
        assert_eq!(a.event_id, again.event_id, "a redelivery is the same event");
        assert_ne!(a.event_id, elsewhere.event_id, "another source's id is another event");
        let uuid = Incoming::parse(&ce(ID, b"/billing"), 1024, "").unwrap();
        assert_eq!(uuid.event_id.to_string().as_bytes(), ID, "a UUID ce_id is the event id");
        for (missing, needle) in [
            ("ce_source", "no ce_source"),
            ("ce_type", "no ce_type"),
            ("ce_id", "no ce_id"),
        ] {
            let mut headers = vec![
                ("ce_specversion", &b"1.0"[..]),
                ("ce_id", b"x"),
                ("ce_source", b"/s"),
                ("ce_type", b"T"),
            ];
            headers.retain(|(k, _)| *k != missing);
            let e = Incoming::parse(&message(None, Some(b"{}"), &headers), 1024, "").unwrap_err();
            assert!(e.0.contains(needle), "{e}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let ms = std::time::Duration::from_millis;
        assert_eq!(backoff(ms(100), ms(1000), 1), ms(100));
        assert_eq!(backoff(ms(100), ms(1000), 3), ms(400));
        assert_eq!(backoff(ms(100), ms(1000), 30), ms(1000));
    }

    #[test]
    fn a_contended_wait_is_a_quarter_of_the_episode_between_the_backoff_and_its_cap() {
        let ms = std::time::Duration::from_millis;
        assert_eq!(contended_wait(ms(0), ms(100), ms(5000)), ms(100));
        assert_eq!(contended_wait(ms(2000), ms(100), ms(5000)), ms(500));
        assert_eq!(contended_wait(ms(600_000), ms(100), ms(5000)), ms(5000));
        assert_eq!(contended_wait(ms(600_000), ms(8000), ms(5000)), ms(8000));
    }
}
