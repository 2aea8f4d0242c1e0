//! `obx:plugin/outbox`: `emit` validates an event and buffers it in the call's state. The
//! dispatcher writes the buffer to `outbox_event` in the call's transaction when the
//! handler succeeds, so an event exists exactly when its call committed.
//!
//! An event must be one the manifest declares (topic and event type), and its payload must
//! fit what the producer can send (`limits.max_payload_bytes` is checked against the
//! producer's `message.max.bytes` at start): an event that could never be delivered is
//! refused here, not at the broker. The database checks the same again (`obx_api.emit`).
//! A payload must also match the schema the plugin declared for it, if any
//! (`obx:plugin/contract`). `emit-delayed` is `emit` with a delay: the writer sends such
//! events to `obx.outbox_delayed`, and the relay releases them when they are due.

use crate::outbox::{EventError, RawEvent};
use crate::runtime::bindings::outbox::{EmitError, Event, Host};
use crate::runtime::state::CallState;

/// The longest delay of an event: ten years, in milliseconds (as `obx_api.emit_delayed` checks).
pub(super) const MAX_DELAY_MS: u64 = 315_576_000_000;

impl Host for CallState {
    fn emit(&mut self, event: Event) -> Result<String, EmitError> {
        self.emit_after(event, 0)
    }

    fn emit_delayed(&mut self, event: Event, delay_ms: u64) -> Result<String, EmitError> {
        self.emit_after(event, delay_ms)
    }
}

impl CallState {
    fn emit_after(&mut self, event: Event, delay_ms: u64) -> Result<String, EmitError> {
        let result = self.try_emit(event, delay_ms);
        if let Err(e) = &result {
            let reason = match e {
                EmitError::Invalid(m) | EmitError::Limit(m) => m,
            };
            self.fail(format!("emit failed: {reason}"));
        }
        result
    }

    fn try_emit(&mut self, event: Event, delay_ms: u64) -> Result<String, EmitError> {
        let Some(role) = self.tx.as_ref().map(|tx| tx.role().to_owned()) else {
            return Err(EmitError::Invalid(
                "emit is available only inside handle-command and handle-event".into(),
            ));
        };
        if delay_ms > MAX_DELAY_MS {
            return Err(EmitError::Limit(format!("the delay is {delay_ms} ms, over ten years")));
        }
        let limits = &self.limits;
        if self.events.len() >= limits.max_emits_per_call as usize {
            return Err(EmitError::Limit(format!(
                "a call may emit at most {} events",
                limits.max_emits_per_call
            )));
        }
        let raw = RawEvent {
            event_id: event.event_id,
            aggregate_type: event.aggregate_type,
            aggregate_id: event.aggregate_id,
            event_type: event.event_type,
            payload: event.payload,
            topic: event.topic,
            partition_key: event.partition_key,
        };
        let mut event = raw.validate(limits.max_payload_bytes).map_err(|e| match e {
            EventError::Invalid(m) => EmitError::Invalid(m),
            EventError::TooLarge(m) => EmitError::Limit(m),
        })?;
        if !self.plugin.declares(&event.topic, &event.event_type) {
            return Err(EmitError::Invalid(format!(
                "{} on topic {:?} is not declared in the manifest's emits",
                event.event_type, event.topic
            )));
        }
        if let Err(e) =
            self.plugin
                .contracts
                .check(&event.topic, &event.event_type, &event.payload, &mut self.check_budget)
        {
            return Err(EmitError::Invalid(format!("the payload of {} {e}", event.event_type)));
        }
        if self.event_bytes + event.payload.len() > limits.max_emit_bytes_per_call {
            return Err(EmitError::Limit(format!(
                "the events of one call may hold at most {} payload bytes",
                limits.max_emit_bytes_per_call
            )));
        }
        // What the database will write: the session passes `event_id`, made the plugin's own.
        let id = crate::outbox::stored_event_id(&role, event.event_id).to_string();
        event.delay_ms = delay_ms;
        self.event_bytes += event.payload.len();
        self.events.push(event);
        Ok(id)
    }
}
