//! `obx:plugin/timers`: schedules and cancels the plugin's durable timers in the call's
//! transaction, through `obx_api.timer_schedule` and `obx_api.timer_cancel` on the call's
//! session (the plugin's own role: the functions name the plugin from the session, never
//! from us). What the call schedules commits with it or not at all. Malformed input is
//! refused here with a clear message; the database checks the same again. A statement that
//! fails marks the call as unable to commit, like a failed `sql` statement.

use super::outbox::MAX_DELAY_MS;
use crate::runtime::bindings::timers::{Host, TimerError};
use crate::runtime::state::CallState;
use crate::trace::TraceContext;

/// The most timers one call may schedule or cancel.
pub(crate) const MAX_TIMER_CALLS: u32 = 1000;

impl Host for CallState {
    async fn schedule(&mut self, name: String, key: String, delay_ms: u64, payload: String) -> Result<(), TimerError> {
        self.check_timer_call(&name, &key)?;
        if delay_ms > MAX_DELAY_MS {
            return Err(TimerError::Limit(format!("the delay is {delay_ms} ms, over ten years")));
        }
        let max = self.limits.max_payload_bytes;
        if payload.len() > max {
            return Err(TimerError::Limit(format!(
                "the payload is {} bytes, over the limit of {max} (limits.max_payload_bytes)",
                payload.len()
            )));
        }
        // Timers' payloads share the call's budget with its events' (what one call may write).
        if self.event_bytes + payload.len() > self.limits.max_emit_bytes_per_call {
            self.fail("too many payload bytes");
            return Err(TimerError::Limit(format!(
                "the events and timers of one call may hold at most {} payload bytes",
                self.limits.max_emit_bytes_per_call
            )));
        }
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&payload) {
            return Err(TimerError::Invalid(format!("the payload is not valid JSON: {e}")));
        }
        let traceparent = self.trace.as_ref().map(TraceContext::header);
        let tx = self.sending().expect("checked by check_timer_call");
        let run = sqlx::query("SELECT obx_api.timer_schedule($1, $2, $3, $4, $5)")
            .bind(&name)
            .bind(&key)
            .bind(delay_ms as i64)
            .bind(&payload)
            .bind(traceparent)
            .execute(&mut **tx)
            .await;
        if run.is_ok() {
            self.event_bytes += payload.len();
        }
        self.after_statement(run.map(|_| ()))
    }

    async fn cancel(&mut self, name: String, key: String) -> Result<bool, TimerError> {
        self.check_timer_call(&name, &key)?;
        let tx = self.sending().expect("checked by check_timer_call");
        let run = sqlx::query_scalar::<_, bool>("SELECT obx_api.timer_cancel($1, $2)")
            .bind(&name)
            .bind(&key)
            .fetch_one(&mut **tx)
            .await;
        self.after_statement(run)
    }
}

impl CallState {
    /// Whether a timer call may go to the database at all; counts it.
    fn check_timer_call(&mut self, name: &str, key: &str) -> Result<(), TimerError> {
        if !self.plugin.timed {
            return Err(TimerError::Unavailable);
        }
        if self.tx.is_none() {
            return Err(TimerError::Invalid(
                "timers are available only inside handle-command, handle-event and handle-timer".into(),
            ));
        }
        if self.failure.is_some() {
            return Err(TimerError::Database(
                "an earlier statement of this call failed, so it can only roll back".into(),
            ));
        }
        if std::time::Instant::now() >= self.deadline {
            self.fail("the call deadline passed during a timer call");
            return Err(TimerError::Database("the call deadline has passed".into()));
        }
        // In bytes, as the database counts them: the key of `obx.timer` must fit an index entry.
        if name.is_empty() || name.len() > 200 {
            return Err(TimerError::Invalid("a timer name has 1 to 200 bytes".into()));
        }
        if key.is_empty() || key.len() > 1024 {
            return Err(TimerError::Invalid("a timer key has 1 to 1024 bytes".into()));
        }
        if name.contains('\0') || key.contains('\0') {
            return Err(TimerError::Invalid(
                "a timer name or key may not hold a NUL character".into(),
            ));
        }
        if self.timer_calls >= MAX_TIMER_CALLS {
            self.fail("too many timer calls");
            return Err(TimerError::Limit(format!(
                "a call may schedule or cancel at most {MAX_TIMER_CALLS} timers"
            )));
        }
        self.timer_calls += 1;
        Ok(())
    }

    fn after_statement<T>(&mut self, run: sqlx::Result<T>) -> Result<T, TimerError> {
        run.map_err(|e| {
            let message = match &e {
                sqlx::Error::Database(db) => db.message().to_string(),
                other => other.to_string(),
            };
            self.fail_statement(format!("a timer call failed: {message}"), crate::db::lost_a_race(&e));
            TimerError::Database(message)
        })
    }
}
