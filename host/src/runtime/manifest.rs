//! A plugin's manifest as the host keeps it, and the checks it must pass before the plugin
//! is activated. The rest of the host sees this type, never the generated bindings.

use std::collections::HashSet;

use serde::Serialize;

use super::bindings::guest;
use crate::outbox::check_topic;
use crate::sql_policy;

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Manifest {
    pub name: String,
    pub version: String,
    pub commands: Vec<String>,
    pub subscriptions: Vec<Subscription>,
    pub migrations: Vec<Migration>,
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
        }
    }
}

/// Schema names a plugin may not take.
const RESERVED_NAMES: &[&str] = &["obx", "public", "information_schema"];

impl Manifest {
    /// The plugin's Postgres schema.
    pub fn schema(&self) -> &str {
        &self.name
    }

    /// The plugin's Postgres role.
    pub fn role(&self) -> String {
        format!("obx_plugin_{}", self.name)
    }

    /// Checks the manifest and runs each migration through the SQL policy. On success the
    /// migrations carry the statements that will run.
    pub fn validate(&mut self) -> Result<(), String> {
        let name = &self.name;
        let name_ok = name.len() <= 40
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !name_ok {
            return Err(format!(
                "name {name:?} must be 1-40 characters of a-z, 0-9 and _, starting with a letter"
            ));
        }
        if RESERVED_NAMES.contains(&name.as_str()) || name.starts_with("pg_") {
            return Err(format!("name {name:?} is reserved"));
        }
        if self.version.is_empty()
            || self.version.len() > 64
            || self.version.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "version {:?} must be 1-64 characters with no spaces",
                self.version
            ));
        }
        let mut seen = HashSet::new();
        for command in &self.commands {
            let ok = (1..=128).contains(&command.len())
                && command.starts_with(|c: char| c.is_ascii_alphabetic())
                && command.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
            if !ok {
                return Err(format!(
                    "command {command:?} must be 1-128 characters of A-Z a-z 0-9 _ - ., \
                     starting with a letter"
                ));
            }
            if !seen.insert(command) {
                return Err(format!("command {command:?} is declared twice"));
            }
        }
        let mut topics = HashSet::new();
        for s in &self.subscriptions {
            check_topic(&s.topic).map_err(|e| format!("subscription: {e}"))?;
            if !topics.insert(&s.topic) {
                return Err(format!("topic {:?} is subscribed twice", s.topic));
            }
            if s.event_types.iter().any(|t| t.is_empty()) {
                return Err(format!("subscription to {:?} has an empty event type", s.topic));
            }
        }
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
            if m.name.is_empty() {
                return Err(format!("migration {} has no name", m.id));
            }
            m.statements = sql_policy::check_migration(&m.sql, &self.name)
                .map_err(|e| format!("migration {} ({}): {e}", m.id, m.name))?;
        }
        Ok(())
    }
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
            migrations: vec![Migration {
                id: 1,
                name: "orders".into(),
                sql: "CREATE TABLE orders (id uuid PRIMARY KEY)".into(),
                statements: vec![],
            }],
        }
    }

    #[test]
    fn a_sound_manifest_passes() {
        let mut m = manifest();
        m.validate().unwrap();
        assert_eq!(m.migrations[0].statements.len(), 1);
        assert_eq!(m.role(), "obx_plugin_orders");
    }

    #[test]
    fn bad_manifests_are_refused() {
        type Change = Box<dyn Fn(&mut Manifest)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|m| m.name = "Orders".into()), "must be 1-40"),
            (Box::new(|m| m.name = "obx".into()), "reserved"),
            (Box::new(|m| m.name = "pg_x".into()), "reserved"),
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
        ];
        for (change, needle) in cases {
            let mut m = manifest();
            change(&mut m);
            let e = m.validate().unwrap_err();
            assert!(e.contains(needle), "{e}");
        }
    }
}
