//! A plugin's manifest as the host keeps it, and the checks it must pass before the plugin
//! is activated. The rest of the host sees this type, never the generated bindings.

use std::collections::HashSet;

use serde::Serialize;

use super::bindings::guest;
use crate::outbox::check_topic;
use crate::sql_policy;
use crate::text::shown;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Manifest {
    pub name: String,
    pub version: String,
    pub commands: Vec<String>,
    pub subscriptions: Vec<Subscription>,
    /// Every (topic, event type) the plugin may emit.
    pub emits: Vec<EventDeclaration>,
    pub migrations: Vec<Migration>,
    /// Payload schemas declared through `obx:plugin/contract` while the manifest was read.
    pub payloads: Vec<PayloadContract>,
}

/// The declared JSON Schema of an event's payload, with an optional example.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct PayloadContract {
    pub topic: String,
    pub event_type: String,
    pub schema: serde_json::Value,
    pub example: Option<serde_json::Value>,
}

/// An event a plugin declares it emits.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, Hash)]
pub struct EventDeclaration {
    pub topic: String,
    pub event_type: String,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Subscription {
    pub topic: String,
    /// Empty: every event type on the topic.
    pub event_types: Vec<String>,
    pub mode: DeliveryMode,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryMode {
    Dedup,
    Inbox,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Migration {
    pub id: u32,
    pub name: String,
    pub sql: String,
    /// The statements to run, as checked by the SQL policy.
    #[serde(skip)]
    pub statements: Vec<String>,
}

impl From<guest::Manifest> for Manifest {
    fn from(m: guest::Manifest) -> Manifest {
        Manifest {
            name: m.name,
            version: m.version,
            commands: m.commands,
            subscriptions: m
                .subscriptions
                .into_iter()
                .map(|s| Subscription {
                    topic: s.topic,
                    event_types: s.event_types,
                    mode: match s.mode {
                        guest::DeliveryMode::Dedup => DeliveryMode::Dedup,
                        guest::DeliveryMode::Inbox => DeliveryMode::Inbox,
                    },
                })
                .collect(),
            emits: m
                .emits
                .into_iter()
                .map(|e| EventDeclaration {
                    topic: e.topic,
                    event_type: e.event_type,
                })
                .collect(),
            migrations: m
                .migrations
                .into_iter()
                .map(|g| Migration {
                    id: g.id,
                    name: g.name,
                    sql: g.sql,
                    statements: Vec::new(),
                })
                .collect(),
            payloads: Vec::new(),
        }
    }
}

/// Schema names a plugin may not take, besides those starting with `pg_` or `obx_`. The
/// database adds its own: existing roles and schemas (see `plugin_schema`).
const RESERVED_NAMES: &[&str] = &["obx", "public", "information_schema", "postgres"];

/// Most events a manifest may declare.
const MAX_DECLARED_EVENTS: usize = 1024;
/// Most commands, subscriptions, event types in one subscription, and migrations a manifest
/// may hold. Each list is kept for the plugin's life, listed by `GET /v1/plugins`, and
/// walked on the hot paths (a command's lookup, an event's subscription): far above what a
/// service declares, far below what the host should hold for one plugin.
const MAX_COMMANDS: usize = 1024;
const MAX_SUBSCRIPTIONS: usize = 256;
const MAX_SUBSCRIBED_TYPES: usize = 1024;
const MAX_MIGRATIONS: usize = 10_000;
/// The longest name of a migration, in bytes: far above any name seen, so that no applied
/// migration's name is refused now, and far below the 100 MiB that were kept whole.
const MAX_MIGRATION_NAME: usize = 1024;

impl Manifest {
    /// The plugin's Postgres schema.
    pub fn schema(&self) -> &str {
        &self.name
    }

    /// Whether the manifest declares `event_type` on `topic`.
    pub fn declares(&self, topic: &str, event_type: &str) -> bool {
        self.emits
            .iter()
            .any(|e| e.topic == topic && e.event_type == event_type)
    }

    /// Checks the manifest and runs each migration through the SQL policy. On success the
    /// migrations carry the statements that will run.
    pub fn validate(&mut self, max_statement_bytes: usize) -> Result<(), String> {
        check_name(&self.name)?;
        if self.version.is_empty()
            || self.version.len() > 64
            || self.version.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "version {} must be 1-64 characters with no spaces",
                shown(&self.version)
            ));
        }
        let counts = [
            ("commands", self.commands.len(), MAX_COMMANDS),
            ("subscriptions", self.subscriptions.len(), MAX_SUBSCRIPTIONS),
            ("migrations", self.migrations.len(), MAX_MIGRATIONS),
        ];
        for (what, count, most) in counts {
            if count > most {
                return Err(format!("a manifest may hold at most {most} {what}, not {count}"));
            }
        }
        let mut seen = HashSet::new();
        for command in &self.commands {
            let ok = (1..=128).contains(&command.len())
                && command.starts_with(|c: char| c.is_ascii_alphabetic())
                && command.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
            if !ok {
                return Err(format!(
                    "command {} must be 1-128 characters of A-Z a-z 0-9 _ - ., \
                     starting with a letter",
                    shown(command)
                ));
            }
            if !seen.insert(command) {
                return Err(format!("command {} is declared twice", shown(command)));
            }
        }
        let mut topics = HashSet::new();
        for s in &self.subscriptions {
            check_topic(&s.topic).map_err(|e| format!("subscription: {e}"))?;
            if !topics.insert(&s.topic) {
                return Err(format!("topic {:?} is subscribed twice", s.topic));
            }
            if s.event_types.len() > MAX_SUBSCRIBED_TYPES {
                return Err(format!(
                    "subscription to {:?} names {} event types, over {MAX_SUBSCRIBED_TYPES}",
                    s.topic,
                    s.event_types.len()
                ));
            }
            if s.event_types.iter().any(|t| t.is_empty() || t.len() > 1024) {
                return Err(format!(
                    "subscription to {:?} has an event type that is empty or over 1024 bytes",
                    s.topic
                ));
            }
        }
        self.validate_emits()?;
        self.validate_payloads()?;
        let mut last = None;
        for m in &mut self.migrations {
            if last.is_some_and(|last| m.id <= last) {
                return Err(format!(
                    "migration ids must increase strictly: {} follows {}",
                    m.id,
                    last.unwrap_or_default()
                ));
            }
            last = Some(m.id);
            // Recorded as Postgres `integer`: a larger id wrapped, and its order with it.
            if i32::try_from(m.id).is_err() {
                return Err(format!("migration id {} is over {}", m.id, i32::MAX));
            }
            // A name is quoted in errors, logs, `last_error` and `/v1/plugins`, and recorded.
            if m.name.is_empty() || m.name.len() > MAX_MIGRATION_NAME || m.name.chars().any(char::is_control) {
                return Err(format!(
                    "migration {} needs a name of 1-{MAX_MIGRATION_NAME} bytes with no control characters \
                     ({} bytes given)",
                    m.id,
                    m.name.len()
                ));
            }
            m.statements = sql_policy::check_migration(&m.sql, &self.name, max_statement_bytes)
                .map_err(|e| format!("migration {} ({}): {e}", m.id, m.name))?;
        }
        Ok(())
    }
}

impl Manifest {
    /// A manifest of `name` at version 1 that declares nothing (for tests).
    #[cfg(test)]
    pub(crate) fn empty(name: &str) -> Manifest {
        Manifest {
            name: name.into(),
            version: "1".into(),
            commands: vec![],
            subscriptions: vec![],
            emits: vec![],
            migrations: vec![],
            payloads: vec![],
        }
    }

    /// Whether a subscription takes `event_type` on `topic`.
    pub fn consumes(&self, topic: &str, event_type: &str) -> bool {
        self.subscriptions
            .iter()
            .any(|s| s.topic == topic && (s.event_types.is_empty() || s.event_types.iter().any(|t| t == event_type)))
    }

    /// Each payload schema is of an event the plugin emits or consumes, and declared once.
    fn validate_payloads(&self) -> Result<(), String> {
        let mut seen = HashSet::new();
        for p in &self.payloads {
            if !self.declares(&p.topic, &p.event_type) && !self.consumes(&p.topic, &p.event_type) {
                return Err(format!(
                    "contract: {} on {} is neither in emits nor in a subscription",
                    shown(&p.event_type),
                    shown(&p.topic)
                ));
            }
            if !seen.insert((&p.topic, &p.event_type)) {
                return Err(format!(
                    "contract: the payload of {} on {} is declared twice",
                    shown(&p.event_type),
                    shown(&p.topic)
                ));
            }
        }
        Ok(())
    }

    fn validate_emits(&self) -> Result<(), String> {
        if self.emits.len() > MAX_DECLARED_EVENTS {
            return Err(format!("a manifest may declare at most {MAX_DECLARED_EVENTS} events"));
        }
        let mut seen = HashSet::new();
        for e in &self.emits {
            check_emitted_topic(&e.topic).map_err(|m| format!("emits: {m}"))?;
            if e.event_type.is_empty() || e.event_type.len() > 1024 || e.event_type.contains('\0') {
                return Err(format!(
                    "emits: event type {} on {} must be 1-1024 bytes with no NUL",
                    shown(&e.event_type),
                    shown(&e.topic)
                ));
            }
            if !seen.insert(e) {
                return Err(format!("emits: {} on {} is declared twice", e.event_type, e.topic));
            }
        }
        Ok(())
    }
}

/// A topic a plugin may emit to: a legal Kafka name, and not one of Kafka's own (`__…`).
pub fn check_emitted_topic(topic: &str) -> Result<(), String> {
    check_topic(topic)?;
    if topic.starts_with("__") {
        return Err(format!(
            "topic {} starts with `__`, which Kafka keeps for itself",
            shown(topic)
        ));
    }
    Ok(())
}

/// A plugin name names its schema, role, HTTP path and consumer groups: 1-40 characters of
/// a-z, 0-9 and `_`, starting with a letter, and none of Postgres's or the host's own.
pub fn check_name(name: &str) -> Result<(), String> {
    let name_ok = name.len() <= 40
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !name_ok {
        return Err(format!(
            "name {} must be 1-40 characters of a-z, 0-9 and _, starting with a letter",
            shown(name)
        ));
    }
    if RESERVED_NAMES.contains(&name) || name.starts_with("pg_") || name.starts_with("obx_") {
        return Err(format!("name {} is reserved", shown(name)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        Manifest {
            name: "orders".into(),
            version: "1.0.0".into(),
            commands: vec!["CreateOrder".into()],
            subscriptions: vec![Subscription {
                topic: "payment.events".into(),
                event_types: vec!["PaymentCaptured".into()],
                mode: DeliveryMode::Dedup,
            }],
            emits: vec![EventDeclaration {
                topic: "order.events".into(),
                event_type: "OrderCreated".into(),
            }],
            migrations: vec![Migration {
                id: 1,
                name: "orders".into(),
                sql: "CREATE TABLE orders (id uuid PRIMARY KEY)".into(),
                statements: vec![],
            }],
            payloads: vec![],
        }
    }

    /// A refused manifest's error quotes at most 64 characters of each string it names: the
    /// plugin chooses their length, and the error is logged, kept and served. A 10 MB name
    /// of control characters made a 60 MB error.
    #[test]
    fn a_refusal_quotes_a_plugins_strings_in_part() {
        let long = "\u{1}".repeat(10 << 20);
        let cases: [fn(&mut Manifest, &str); 5] = [
            |m, s| m.name = s.into(),
            |m, s| m.version = s.into(),
            |m, s| m.commands = vec![s.into()],
            |m, s| m.subscriptions[0].topic = s.into(),
            |m, s| m.emits[0].event_type = s.into(),
        ];
        for (i, set) in cases.iter().enumerate() {
            let mut m = manifest();
            set(&mut m, &long);
            let error = m.validate(1 << 20).unwrap_err();
            assert!(error.len() < 1024, "case {i}: {} bytes", error.len());
        }
    }

    fn payload(topic: &str, event_type: &str) -> PayloadContract {
        PayloadContract {
            topic: topic.into(),
            event_type: event_type.into(),
            schema: serde_json::json!({ "type": "object" }),
            example: None,
        }
    }

    /// A manifest's lists are bounded: a plugin cannot make the host keep and walk a million
    /// commands (the bytes a manifest may take are bounded too, by the hostcall fuel, but
    /// short names fit millions into them).
    #[test]
    fn each_list_of_a_manifest_is_bounded() {
        let many = |n: usize, f: &dyn Fn(usize) -> String| (0..n).map(f).collect::<Vec<_>>();
        let mut m = manifest();
        m.commands = many(MAX_COMMANDS + 1, &|i| format!("c{i}"));
        assert!(m.validate(1 << 16).unwrap_err().contains("at most 1024 commands"));
        m.commands = many(MAX_COMMANDS, &|i| format!("c{i}"));
        m.validate(1 << 16).unwrap();

        let mut m = manifest();
        m.subscriptions[0].event_types = many(MAX_SUBSCRIBED_TYPES + 1, &|i| format!("T{i}"));
        assert!(m.validate(1 << 16).unwrap_err().contains("event types, over"));
        m.subscriptions[0].event_types = vec!["T".repeat(1025)];
        assert!(m.validate(1 << 16).unwrap_err().contains("over 1024 bytes"));

        let mut m = manifest();
        m.subscriptions = (0..=MAX_SUBSCRIPTIONS)
            .map(|i| Subscription {
                topic: format!("t{i}"),
                event_types: vec![],
                mode: DeliveryMode::Dedup,
            })
            .collect();
        assert!(m.validate(1 << 16).unwrap_err().contains("subscriptions"));

        let mut m = manifest();
        m.migrations = (1..=MAX_MIGRATIONS as u32 + 1)
            .map(|id| Migration {
                id,
                name: "m".into(),
                sql: "SELECT 1".into(),
                statements: vec![],
            })
            .collect();
        assert!(m.validate(1 << 16).unwrap_err().contains("migrations"));
    }

    #[test]
    fn payload_schemas_are_of_declared_events_and_declared_once() {
        let mut m = manifest();
        m.payloads = vec![
            payload("order.events", "OrderCreated"),
            payload("payment.events", "PaymentCaptured"),
        ];
        m.validate(64 * 1024).unwrap();
        m.payloads.push(payload("order.events", "OrderCreated"));
        assert!(m.validate(64 * 1024).unwrap_err().contains("declared twice"));
        m.payloads = vec![payload("order.events", "OrderShipped")];
        assert!(m
            .validate(64 * 1024)
            .unwrap_err()
            .contains("neither in emits nor in a subscription"));
    }

    #[test]
    fn a_sound_manifest_passes() {
        let mut m = manifest();
        m.validate(64 * 1024).unwrap();
        assert_eq!(m.migrations[0].statements.len(), 1);
        assert!(m.declares("order.events", "OrderCreated"));
        assert!(!m.declares("order.events", "OrderDeleted"));
    }

    #[test]
    fn bad_manifests_are_refused() {
        type Change = Box<dyn Fn(&mut Manifest)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|m| m.name = "Orders".into()), "must be 1-40"),
            (Box::new(|m| m.name = "obx".into()), "reserved"),
            (Box::new(|m| m.name = "pg_x".into()), "reserved"),
            (Box::new(|m| m.name = "obx_api".into()), "reserved"),
            (Box::new(|m| m.name = "public".into()), "reserved"),
            (Box::new(|m| m.name = "postgres".into()), "reserved"),
            (Box::new(|m| m.emits[0].topic = "__consumer_offsets".into()), "`__`"),
            (Box::new(|m| m.emits[0].topic = "a b".into()), "emits"),
            (Box::new(|m| m.emits[0].event_type = "".into()), "event type"),
            (Box::new(|m| m.emits.push(m.emits[0].clone())), "twice"),
            (Box::new(|m| m.version = "".into()), "version"),
            (Box::new(|m| m.commands.push("CreateOrder".into())), "twice"),
            (Box::new(|m| m.commands.push("a/b".into())), "command"),
            (Box::new(|m| m.subscriptions[0].topic = "a b".into()), "topic"),
            (
                Box::new(|m| {
                    m.migrations.push(Migration {
                        id: 1,
                        name: "x".into(),
                        sql: "".into(),
                        statements: vec![],
                    })
                }),
                "increase",
            ),
            (
                Box::new(|m| m.migrations[0].sql = "CREATE ROLE x".into()),
                "migration 1",
            ),
            (
                Box::new(|m| {
                    m.migrations.push(Migration {
                        id: u32::MAX,
                        name: "x".into(),
                        sql: "".into(),
                        statements: vec![],
                    })
                }),
                "is over",
            ),
            (Box::new(|m| m.migrations[0].name = "".into()), "needs a name"),
            // Quoted in errors, logs and the plugins' status: 100 MiB names were kept whole.
            (
                Box::new(|m| m.migrations[0].name = "n".repeat(1025)),
                "of 1-1024 bytes with no control characters (1025 bytes given)",
            ),
            (
                Box::new(|m| m.migrations[0].name = "a\nb".into()),
                "no control characters",
            ),
        ];
        for (change, needle) in cases {
            let mut m = manifest();
            change(&mut m);
            let e = m.validate(64 * 1024).unwrap_err();
            assert!(e.contains(needle), "{e}");
        }
    }
}
