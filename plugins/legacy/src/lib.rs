//! A plugin of the frozen `obx:plugin@0.2.0` contract (`wit/v0.2.0/obx.wit`), built straight
//! from that WIT: the host links 0.2.0 and 0.2.1 components side by side. Its `ping` command
//! writes a row and emits an event, so a test sees both of its imports work.

wit_bindgen::generate!({
    path: "../../wit/v0.2.0",
    world: "obx:plugin/plugin",
});

use exports::obx::plugin::handler::{Command, Event, EventDeclaration, Guest, Manifest, Migration};
use obx::plugin::types::{HandlerError, SqlValue};

struct Legacy;

impl Guest for Legacy {
    fn describe() -> Manifest {
        Manifest {
            name: "legacy".into(),
            version: "0.2.0".into(),
            commands: vec!["ping".into()],
            subscriptions: vec![],
            emits: vec![EventDeclaration {
                topic: "legacy.events".into(),
                event_type: "Pinged".into(),
            }],
            migrations: vec![Migration {
                id: 1,
                name: "pings".into(),
                sql: "CREATE TABLE pings (id text PRIMARY KEY)".into(),
            }],
        }
    }

    fn handle_command(command: Command) -> Result<String, HandlerError> {
        let id = command.request_id;
        obx::plugin::sql::execute("INSERT INTO pings (id) VALUES ($1)", &[SqlValue::Text(id.clone())])
            .map_err(|e| HandlerError::Failed(format!("{e:?}")))?;
        obx::plugin::outbox::emit(&obx::plugin::outbox::Event {
            event_id: None,
            aggregate_type: "Ping".into(),
            aggregate_id: id.clone(),
            event_type: "Pinged".into(),
            payload: "{}".into(),
            topic: "legacy.events".into(),
            partition_key: None,
        })
        .map_err(|e| HandlerError::Failed(format!("{e:?}")))?;
        Ok(format!("{{\"pong\":\"{id}\"}}"))
    }

    fn handle_event(_event: Event) -> Result<(), HandlerError> {
        Ok(())
    }
}

export!(Legacy);
