//! Rust SDK for OBX plugins.
//!
//! It generates the bindings of the `obx:plugin/timed-plugin` world once, re-exports them
//! under short names, and adds conveniences for the SQL, outbox and timers imports. A plugin
//! implements [`Guest`] and exports it with [`export_plugin!`]:
//!
//! ```ignore
//! struct MyPlugin;
//! impl obx_sdk::Guest for MyPlugin { /* manifest, handle_command, handle_event */ }
//! obx_sdk::export_plugin!(MyPlugin);
//! ```
//!
//! A plugin with durable timers also implements [`TimerGuest`] and says so:
//! `obx_sdk::export_plugin!(MyPlugin, timers);`. Without it, its `handle-timer` fails every
//! timer (so a timer it schedules by mistake is parked, not lost silently).

// The generated code names this crate by its path, also from inside it.
extern crate self as obx_sdk;

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "obx:plugin/timed-plugin",
        pub_export_macro: true,
        export_macro_name: "__export_plugin",
        default_bindings_module: "obx_sdk::bindings",
        runtime_path: "obx_sdk::__rt::wit_bindgen::rt",
    });
}

#[doc(hidden)]
pub mod __rt {
    pub use wit_bindgen;
}

/// Exports a type that implements [`Guest`] as this component's plugin.
#[macro_export]
macro_rules! export_plugin {
    ($ty:ident) => {
        impl $crate::TimerGuest for $ty {
            fn handle_timer(timer: $crate::Timer) -> Result<(), $crate::HandlerError> {
                Err($crate::HandlerError::Failed(format!(
                    "this plugin handles no timers (timer {:?})",
                    timer.name
                )))
            }
        }
        $crate::bindings::__export_plugin!($ty with_types_in $crate::bindings);
    };
    ($ty:ident, timers) => {
        $crate::bindings::__export_plugin!($ty with_types_in $crate::bindings);
    };
}

pub use bindings::exports::obx::plugin::handler::{
    Command, DeliveryMode, Event, EventDeclaration, Guest, Manifest, Migration, Subscription,
};
pub use bindings::exports::obx::plugin::timer_handler::{Guest as TimerGuest, Timer};
pub use bindings::obx::plugin::log::Level;
pub use bindings::obx::plugin::outbox::{EmitError, Event as OutboxEvent};
pub use bindings::obx::plugin::sql::{Column, DatabaseError, RowSet, SqlError};
pub use bindings::obx::plugin::timers::TimerError;
pub use bindings::obx::plugin::types::{HandlerError, Rejection, SqlValue};

/// Runs a statement that returns rows, on the call's transaction.
pub fn query(statement: &str, params: &[SqlValue]) -> Result<RowSet, SqlError> {
    bindings::obx::plugin::sql::query(statement, params)
}

/// Runs a statement and returns how many rows it affected.
pub fn execute(statement: &str, params: &[SqlValue]) -> Result<u64, SqlError> {
    bindings::obx::plugin::sql::execute(statement, params)
}

/// Adds an event to the outbox of the call's transaction; returns its event id.
pub fn emit(event: &OutboxEvent) -> Result<String, EmitError> {
    bindings::obx::plugin::outbox::emit(event)
}

/// Like [`emit`], but the relay publishes the event no earlier than `delay_ms` after the call
/// wrote it (by the database's clock). It exists only if the call commits, and it takes its
/// place among its key's events when it is due.
pub fn emit_delayed(event: &OutboxEvent, delay_ms: u64) -> Result<String, EmitError> {
    bindings::obx::plugin::outbox::emit_delayed(event, delay_ms)
}

/// Declares the JSON Schema of an event's payload (and an example payload), from
/// `describe`: `emit` then refuses payloads that break it, consumed events that break it are
/// parked before the handler, and `obx catalog` and `obx plugin test` use it.
pub fn declare_payload(topic: &str, event_type: &str, schema: &str, example: Option<&str>) {
    bindings::obx::plugin::contract::declare_payload(topic, event_type, schema, example)
}

/// Schedules (or replaces) the timer (`name`, `key`) to fire after `delay_ms`, in the call's
/// transaction: it fires only if the call commits.
pub fn schedule_timer(name: &str, key: &str, delay_ms: u64, payload: &str) -> Result<(), TimerError> {
    bindings::obx::plugin::timers::schedule(name, key, delay_ms, payload)
}

/// Cancels the timer (`name`, `key`) in the call's transaction; whether one was pending.
pub fn cancel_timer(name: &str, key: &str) -> Result<bool, TimerError> {
    bindings::obx::plugin::timers::cancel(name, key)
}

/// Writes a line to the host's log.
pub fn log(level: Level, message: &str) {
    bindings::obx::plugin::log::log(level, message)
}

/// Declares that the plugin emits `event_types` on `topic`, for [`Manifest::emits`].
pub fn emits(topic: &str, event_types: &[&str]) -> Vec<EventDeclaration> {
    event_types
        .iter()
        .map(|t| EventDeclaration {
            topic: topic.into(),
            event_type: (*t).into(),
        })
        .collect()
}

/// A business rejection (HTTP 409).
pub fn reject(code: &str, message: &str) -> HandlerError {
    HandlerError::Rejected(Rejection {
        code: code.into(),
        message: message.into(),
    })
}

/// Malformed input (HTTP 400).
pub fn invalid(message: impl Into<String>) -> HandlerError {
    HandlerError::InvalidInput(message.into())
}

impl From<SqlError> for HandlerError {
    fn from(e: SqlError) -> HandlerError {
        HandlerError::Failed(format!("sql: {e:?}"))
    }
}

impl From<TimerError> for HandlerError {
    fn from(e: TimerError) -> HandlerError {
        HandlerError::Failed(format!("timer: {e:?}"))
    }
}

impl From<EmitError> for HandlerError {
    fn from(e: EmitError) -> HandlerError {
        HandlerError::Failed(format!("emit: {e:?}"))
    }
}

impl RowSet {
    /// The value in `row` of the column named `name`.
    pub fn value(&self, row: usize, name: &str) -> Option<&SqlValue> {
        let col = self.columns.iter().position(|c| c.name == name)?;
        self.rows.get(row)?.get(col)
    }
}

impl SqlValue {
    /// The value as text, for the text-like variants (text, uuid, json, timestamp, date, numeric).
    pub fn as_str(&self) -> Option<&str> {
        match self {
            SqlValue::Text(s)
            | SqlValue::Uuid(s)
            | SqlValue::Json(s)
            | SqlValue::Timestamp(s)
            | SqlValue::Date(s)
            | SqlValue::Numeric(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            SqlValue::Int(i) => Some(*i),
            _ => None,
        }
    }
}
