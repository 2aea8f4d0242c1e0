//! The service's event catalogue, from the manifests of its plugins: each event (topic and
//! type), the plugins that emit it and the plugins that consume it. `GET /v1/catalog` and
//! `obx catalog` show it; [`asyncapi`] writes it as an AsyncAPI 3.0 document, which the
//! AsyncAPI tools (generator, Studio, parser) read.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Value};

use crate::runtime::manifest::{DeliveryMode, Manifest};

#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Catalog {
    pub service: String,
    /// By topic, then event type.
    pub events: Vec<CatalogEvent>,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct CatalogEvent {
    /// As plugins name it; the Kafka topic is `kafka_topic`.
    pub topic: String,
    pub kafka_topic: String,
    /// `*` for a subscription to every type on a topic whose types nobody declares.
    pub event_type: String,
    pub emitted_by: Vec<String>,
    pub consumed_by: Vec<Consumer>,
    /// The payload's JSON Schema and an example, as the emitter declared them (else a
    /// consumer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub example: Option<Value>,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Consumer {
    pub plugin: String,
    pub mode: String,
}

/// Any event type on a topic.
const ANY: &str = "*";

/// The catalogue of `manifests`, whose topics carry `topic_prefix` on Kafka.
pub fn build(service: &str, topic_prefix: &str, manifests: &[Manifest]) -> Catalog {
    // By name: the registry's order is the order plugins happened to load in, and the
    // catalogue lists emitters and consumers the same way every time.
    let mut by_name: Vec<&Manifest> = manifests.iter().collect();
    by_name.sort_by(|a, b| a.name.cmp(&b.name));
    let manifests = by_name.as_slice();
    let mut events: BTreeMap<(String, String), CatalogEvent> = BTreeMap::new();
    fn entry<'a>(
        events: &'a mut BTreeMap<(String, String), CatalogEvent>,
        prefix: &str,
        topic: &str,
        event_type: &str,
    ) -> &'a mut CatalogEvent {
        events
            .entry((topic.to_string(), event_type.to_string()))
            .or_insert_with(|| CatalogEvent {
                topic: topic.to_string(),
                kafka_topic: format!("{prefix}{topic}"),
                event_type: event_type.to_string(),
                emitted_by: Vec::new(),
                consumed_by: Vec::new(),
                schema: None,
                example: None,
            })
    }
    for m in manifests {
        for e in &m.emits {
            entry(&mut events, topic_prefix, &e.topic, &e.event_type)
                .emitted_by
                .push(m.name.clone());
        }
        for s in &m.subscriptions {
            for t in &s.event_types {
                entry(&mut events, topic_prefix, &s.topic, t);
            }
        }
    }
    // Consumers second, so that a subscription to every type of a topic is listed on each
    // type that anyone declared on it.
    for m in manifests {
        for s in &m.subscriptions {
            let consumer = Consumer {
                plugin: m.name.clone(),
                mode: match s.mode {
                    DeliveryMode::Dedup => "dedup".into(),
                    DeliveryMode::Inbox => "inbox".into(),
                },
            };
            let types: Vec<String> = if s.event_types.is_empty() {
                let known: Vec<String> = events
                    .keys()
                    .filter(|(topic, _)| topic == &s.topic)
                    .map(|(_, t)| t.clone())
                    .collect();
                if known.is_empty() {
                    vec![ANY.to_string()]
                } else {
                    known
                }
            } else {
                s.event_types.clone()
            };
            for t in types {
                entry(&mut events, topic_prefix, &s.topic, &t)
                    .consumed_by
                    .push(consumer.clone());
            }
        }
    }
    // Schemas: the emitters' first, then the consumers' where no emitter declared one.
    let emitters = manifests
        .iter()
        .flat_map(|m| m.payloads.iter().filter(|p| m.declares(&p.topic, &p.event_type)));
    let consumers = manifests
        .iter()
        .flat_map(|m| m.payloads.iter().filter(|p| !m.declares(&p.topic, &p.event_type)));
    for p in emitters.chain(consumers) {
        if let Some(e) = events.get_mut(&(p.topic.clone(), p.event_type.clone())) {
            if e.schema.is_none() {
                e.schema = Some(p.schema.clone());
                e.example = p.example.clone();
            }
        }
    }
    Catalog {
        service: service.to_string(),
        events: events.into_values().collect(),
    }
}

/// The version of the catalogue: its plugins' names and versions, as `a@1.0.0 b@0.2.0`.
pub fn version(manifests: &[Manifest]) -> String {
    let mut versions: Vec<String> = manifests.iter().map(|m| format!("{}@{}", m.name, m.version)).collect();
    versions.sort();
    if versions.is_empty() {
        return "no plugins".into();
    }
    versions.join(" ")
}

/// The Kafka headers every OBX event carries, as a JSON Schema.
fn headers_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "eventId": { "type": "string", "format": "uuid", "description": "Unique per event; consumers deduplicate on it." },
            "eventType": { "type": "string" },
            "aggregateType": { "type": "string" },
            "aggregateId": { "type": "string" },
            "obx-plugin": { "type": "string", "description": "The plugin that emitted the event." },
            "traceparent": { "type": "string", "description": "W3C trace context." }
        },
        "required": ["eventId", "eventType", "aggregateType", "aggregateId"]
    })
}

/// An id usable as an AsyncAPI key and in a JSON pointer: letters, digits, `.`, `-`, `_`.
fn key(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The catalogue as an AsyncAPI 3.0 document: a channel per topic with its messages, a
/// `send` operation per emitting plugin and a `receive` operation per consuming plugin.
/// A payload is what its declared JSON Schema says (JSON Schema is AsyncAPI's default
/// schema format), or any JSON object when none was declared.
pub fn asyncapi(catalog: &Catalog, version: &str) -> Value {
    let mut channels = serde_json::Map::new();
    let mut operations = serde_json::Map::new();
    for e in &catalog.events {
        let channel_id = key(&e.topic);
        let message_id = if e.event_type == ANY {
            "any".to_string()
        } else {
            key(&e.event_type)
        };
        let channel = channels.entry(channel_id.clone()).or_insert_with(|| {
            json!({
                "address": e.kafka_topic,
                "title": e.topic,
                "messages": {}
            })
        });
        let mut message = json!({
            "name": e.event_type,
            "title": e.event_type,
            "contentType": "application/json",
            "headers": headers_schema(),
            "payload": e.schema.clone().unwrap_or_else(|| json!({ "type": "object" })),
            "bindings": { "kafka": { "key": { "type": "string", "description": "The partition key: events of one key keep their order." } } }
        });
        if let Some(example) = &e.example {
            message["examples"] = json!([{ "name": "example", "payload": example }]);
        }
        channel["messages"][&message_id] = message;
        let channel_ref = json!({ "$ref": format!("#/channels/{channel_id}") });
        let message_ref = json!({ "$ref": format!("#/channels/{channel_id}/messages/{message_id}") });
        for plugin in &e.emitted_by {
            operations.insert(
                format!("{}.send.{channel_id}.{message_id}", key(plugin)),
                json!({
                    "action": "send",
                    "channel": channel_ref,
                    "messages": [message_ref],
                    "summary": format!("{plugin} emits {} through the outbox", e.event_type),
                }),
            );
        }
        for c in &e.consumed_by {
            operations.insert(
                format!("{}.receive.{channel_id}.{message_id}", key(&c.plugin)),
                json!({
                    "action": "receive",
                    "channel": channel_ref,
                    "messages": [message_ref],
                    "summary": format!("{} handles {} ({} mode), once per event", c.plugin, e.event_type, c.mode),
                }),
            );
        }
    }
    json!({
        "asyncapi": "3.0.0",
        "info": {
            "title": catalog.service,
            "version": version,
            "description": "The events of this OBX service, from its plugins' manifests."
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::manifest::{EventDeclaration, Subscription};

    fn manifest(name: &str, emits: &[(&str, &str)], subscriptions: &[(&str, &[&str])]) -> Manifest {
        Manifest {
            name: name.into(),
            version: "1.0.0".into(),
            commands: vec![],
            subscriptions: subscriptions
                .iter()
                .map(|(topic, types)| Subscription {
                    topic: (*topic).into(),
                    event_types: types.iter().map(|t| (*t).into()).collect(),
                    mode: DeliveryMode::Dedup,
                })
                .collect(),
            emits: emits
                .iter()
                .map(|(topic, t)| EventDeclaration {
                    topic: (*topic).into(),
                    event_type: (*t).into(),
                })
                .collect(),
            migrations: vec![],
            payloads: vec![],
        }
    }

    #[test]
    fn emitters_and_consumers_meet_on_each_event() {
        let catalog = build(
            "shop",
            "prod.",
            &[
                manifest("orders", &[("order.events", "OrderCreated")], &[]),
                manifest("inventory", &[], &[("order.events", &["OrderCreated"])]),
                manifest("audit", &[], &[("order.events", &[]), ("other.events", &[])]),
            ],
        );
        let created = &catalog.events[0];
        assert_eq!(
            (created.topic.as_str(), created.event_type.as_str()),
            ("order.events", "OrderCreated")
        );
        assert_eq!(created.kafka_topic, "prod.order.events");
        assert_eq!(created.emitted_by, ["orders"]);
        let consumers: Vec<&str> = created.consumed_by.iter().map(|c| c.plugin.as_str()).collect();
        assert_eq!(consumers, ["audit", "inventory"], "by name, whatever the load order");
        // A topic nobody declares a type on: the subscription to all of it is still listed.
        assert_eq!(catalog.events[1].event_type, ANY);
        assert_eq!(catalog.events[1].consumed_by[0].plugin, "audit");

        let doc = asyncapi(&catalog, "1");
        assert_eq!(doc["channels"]["order.events"]["address"], "prod.order.events");
        assert_eq!(
            doc["operations"]["inventory.receive.order.events.OrderCreated"]["messages"][0]["$ref"],
            "#/channels/order.events/messages/OrderCreated"
        );
    }
}
