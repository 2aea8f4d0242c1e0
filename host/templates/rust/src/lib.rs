//! {{name}}: an OBX plugin.
//!
//! Command AddNote {"text"} stores a note and, in the same transaction, emits NoteAdded
//! on {{name}}.events through the outbox. The plugin's own subscription to that topic
//! marks the note seen: an event handler runs once per event, in a transaction of its
//! own. Command GetNote {"id"} answers the note.

wit_bindgen::generate!({ path: "wit", world: "obx:plugin/plugin" });

use exports::obx::plugin::handler::{
    Command, DeliveryMode, Event, EventDeclaration, Guest, Manifest, Migration, Subscription,
};
use obx::plugin::contract::declare_payload;
use obx::plugin::log::{log, Level};
use obx::plugin::outbox::{emit, Event as OutboxEvent};
use obx::plugin::sql::{execute, query, SqlError};
use obx::plugin::types::{HandlerError, Rejection, SqlValue};

const TOPIC: &str = "{{name}}.events";

const MIGRATION_1: &str = "
CREATE TABLE notes (
    id         uuid        PRIMARY KEY,
    text       text        NOT NULL,
    seen       boolean     NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now()
)";

/// The JSON Schema of NoteAdded's payload: `emit` refuses one that breaks it, the event
/// path parks one that breaks it, and `obx plugin test` sends the example to the handler.
const NOTE_ADDED: &str = r#"{"type": "object", "required": ["id", "text"],
    "properties": {"id": {"type": "string", "format": "uuid"}, "text": {"type": "string"}}}"#;
const NOTE_ADDED_EXAMPLE: &str = r#"{"id": "0b7e5c1a-9a8f-4c1e-8e5e-2f3b6c7d8e9f", "text": "hello"}"#;

struct Plugin;

impl Guest for Plugin {
    fn describe() -> Manifest {
        declare_payload(TOPIC, "NoteAdded", NOTE_ADDED, Some(NOTE_ADDED_EXAMPLE));
        Manifest {
            name: "{{name}}".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commands: vec!["AddNote".into(), "GetNote".into()],
            subscriptions: vec![Subscription {
                topic: TOPIC.into(),
                event_types: vec!["NoteAdded".into()],
                mode: DeliveryMode::Dedup,
            }],
            emits: vec![EventDeclaration {
                topic: TOPIC.into(),
                event_type: "NoteAdded".into(),
            }],
            migrations: vec![Migration {
                id: 1,
                name: "notes".into(),
                sql: MIGRATION_1.into(),
            }],
        }
    }

    fn handle_command(command: Command) -> Result<String, HandlerError> {
        let payload: serde_json::Value = serde_json::from_str(&command.payload)
            .map_err(|e| invalid(format!("{}: {e}", command.name)))?;
        match command.name.as_str() {
            "AddNote" => add_note(&payload),
            "GetNote" => get_note(&payload),
            other => Err(invalid(format!("unknown command {other}"))),
        }
    }

    fn handle_event(event: Event) -> Result<(), HandlerError> {
        let payload: serde_json::Value =
            serde_json::from_str(&event.payload).map_err(|e| invalid(format!("NoteAdded: {e}")))?;
        let id = text_field(&payload, "id")?;
        let marked = execute(
            "UPDATE notes SET seen = true WHERE id = $1",
            &[SqlValue::Uuid(id.clone())],
        )
        .map_err(sql_failed)?;
        log(Level::Info, &format!("note {id} seen ({marked} row)"));
        Ok(())
    }
}

fn add_note(payload: &serde_json::Value) -> Result<String, HandlerError> {
    let text = text_field(payload, "text")?;
    let rows = query(
        "INSERT INTO notes (id, text) VALUES (gen_random_uuid(), $1) RETURNING id",
        &[SqlValue::Text(text.clone())],
    )
    .map_err(sql_failed)?;
    let Some(SqlValue::Uuid(id)) = rows.rows.first().and_then(|row| row.first()).cloned() else {
        return Err(HandlerError::Failed("the insert returned no id".into()));
    };
    emit(&OutboxEvent {
        event_id: None,
        aggregate_type: "Note".into(),
        aggregate_id: id.clone(),
        event_type: "NoteAdded".into(),
        payload: serde_json::json!({ "id": id, "text": text }).to_string(),
        topic: TOPIC.into(),
        partition_key: None,
    })
    .map_err(|e| HandlerError::Failed(format!("emit: {e:?}")))?;
    Ok(serde_json::json!({ "id": id }).to_string())
}

fn get_note(payload: &serde_json::Value) -> Result<String, HandlerError> {
    let id = text_field(payload, "id")?;
    let rows = query(
        "SELECT text, seen FROM notes WHERE id = $1",
        &[SqlValue::Uuid(id.clone())],
    )
    .map_err(|e| match e {
        // The id is not a UUID: the caller's mistake, not the plugin's.
        SqlError::Invalid(message) => invalid(format!("id: {message}")),
        e => sql_failed(e),
    })?;
    match rows.rows.first().map(|row| row.as_slice()) {
        Some([SqlValue::Text(text), SqlValue::Boolean(seen)]) => {
            Ok(serde_json::json!({ "id": id, "text": text, "seen": seen }).to_string())
        }
        _ => Err(HandlerError::Rejected(Rejection {
            code: "no-such-note".into(),
            message: format!("there is no note {id}"),
        })),
    }
}

/// A string field of a JSON object, or invalid input naming it.
fn text_field(payload: &serde_json::Value, name: &str) -> Result<String, HandlerError> {
    match payload.get(name).and_then(|v| v.as_str()) {
        Some(s) if !s.is_empty() => Ok(s.to_string()),
        _ => Err(invalid(format!("needs a non-empty string {name:?}"))),
    }
}

fn invalid(message: String) -> HandlerError {
    HandlerError::InvalidInput(message)
}

/// A statement Postgres refused: the call fails and rolls back (the host logs the text).
fn sql_failed(e: SqlError) -> HandlerError {
    HandlerError::Failed(format!("sql: {e:?}"))
}

export!(Plugin);
