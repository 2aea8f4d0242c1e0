//! Why a command or a handler call did not succeed, in the words each audience gets: the
//! client (a status, a stable code, a message with no database text or guest internals) and
//! the operator (the detail, cut to a bound).

use serde_json::json;

use crate::db::sessions::SessionError;
use crate::runtime::bindings::types::HandlerError;
use crate::runtime::{CallError, Trap};
use crate::text::clipped;

/// Why a command did not succeed. Each maps to one HTTP status and one stable code; the
/// message is safe to show to clients (no database text, no guest internals).
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("there is no plugin named {0:?}")]
    UnknownPlugin(String),
    #[error("plugin {plugin:?} has no command {command:?}")]
    UnknownCommand { plugin: String, command: String },
    #[error("{message}")]
    Rejected { reason: String, message: String },
    #[error("{0}")]
    InvalidInput(String),
    #[error("the handler failed")]
    HandlerFailed(String),
    #[error("the handler could not complete its transaction")]
    Aborted(String),
    #[error("the plugin trapped")]
    Trapped(String),
    #[error("the plugin exceeded its memory limit")]
    MemoryLimit(String),
    #[error("the handler ran past its deadline")]
    Deadline,
    #[error("the handler returned an invalid response")]
    InvalidResponse(String),
    #[error("this Idempotency-Key was used with a different request")]
    IdempotencyKeyReused,
    #[error("a request with this Idempotency-Key is still running; retry when it has been answered")]
    IdempotencyKeyInUse,
    /// The handler failed after a statement of its lost to concurrent work (a lock wait past
    /// `lock_timeout`, a deadlock): nothing took effect, and the same request may pass.
    #[error("the command lost to concurrent work and took no effect; retry it")]
    LostRace(String),
    #[error("the host is at capacity; retry later")]
    Busy,
    #[error("the host could not reach its database")]
    Database(#[source] anyhow::Error),
    /// The commit's connection failed, or the host ended a commit that ran past its bound:
    /// the command may have taken effect.
    #[error("the command's commit did not complete: it may have taken effect; a retry with the same Idempotency-Key answers what it came to")]
    OutcomeUnknown(String),
}

impl CommandError {
    pub fn status(&self) -> u16 {
        use CommandError::*;
        match self {
            UnknownPlugin(_) | UnknownCommand { .. } => 404,
            Rejected { .. } | IdempotencyKeyInUse => 409,
            InvalidInput(_) => 400,
            IdempotencyKeyReused => 422,
            HandlerFailed(_) | Aborted(_) | Trapped(_) | MemoryLimit(_) | InvalidResponse(_) => 500,
            LostRace(_) | Busy | Database(_) => 503,
            Deadline | OutcomeUnknown(_) => 504,
        }
    }

    pub fn code(&self) -> &'static str {
        use CommandError::*;
        match self {
            UnknownPlugin(_) => "unknown_plugin",
            UnknownCommand { .. } => "unknown_command",
            Rejected { .. } => "rejected",
            InvalidInput(_) => "invalid_input",
            HandlerFailed(_) => "handler_failed",
            Aborted(_) => "transaction_aborted",
            Trapped(_) => "plugin_trap",
            MemoryLimit(_) => "memory_limit",
            Deadline => "deadline_exceeded",
            InvalidResponse(_) => "invalid_response",
            IdempotencyKeyReused => "idempotency_key_reused",
            IdempotencyKeyInUse => "idempotency_key_in_use",
            LostRace(_) => "contention",
            Busy => "busy",
            Database(_) => "database_unavailable",
            OutcomeUnknown(_) => "outcome_unknown",
        }
    }

    /// The JSON error body clients get.
    pub fn body(&self) -> serde_json::Value {
        let mut error = json!({ "code": self.code(), "message": self.to_string() });
        if let CommandError::Rejected { reason, .. } = self {
            error["reason"] = json!(reason);
        }
        json!({ "error": error })
    }

    /// What the log should say: the hidden detail, for the operator.
    pub(super) fn detail(&self) -> Option<&str> {
        use CommandError::*;
        match self {
            HandlerFailed(d) | Aborted(d) | Trapped(d) | MemoryLimit(d) | InvalidResponse(d) | OutcomeUnknown(d)
            | LostRace(d) => Some(d),
            _ => None,
        }
    }

    /// The error of call error `e`, whose call's first failure was a statement that lost to
    /// concurrent work if `lost_race`: [`CommandError::LostRace`] when the handler failed for
    /// that race ([`CallError::may_follow_a_race`]), not for a fault of its own.
    pub(super) fn after_race(e: CallError, lost_race: bool) -> CommandError {
        let raced = lost_race && e.may_follow_a_race();
        match CommandError::from(e) {
            CommandError::HandlerFailed(d) | CommandError::Aborted(d) | CommandError::Trapped(d) if raced => {
                CommandError::LostRace(d)
            }
            other => other,
        }
    }
}

/// A handler's error, with what the guest wrote cut at [`MAX_GUEST_TEXT`] bytes: it goes to
/// the client, into the stored answer of an `Idempotency-Key` and into the log, and its
/// length is the plugin's choice (up to its memory limit).
impl From<HandlerError> for CommandError {
    fn from(e: HandlerError) -> CommandError {
        let cut = |text: String| match text.len() <= MAX_GUEST_TEXT {
            true => text,
            false => clipped(&text, MAX_GUEST_TEXT).into_owned(),
        };
        match e {
            HandlerError::Rejected(r) => CommandError::Rejected {
                reason: cut(r.code),
                message: cut(r.message),
            },
            HandlerError::InvalidInput(m) => CommandError::InvalidInput(cut(m)),
            HandlerError::Failed(m) => CommandError::HandlerFailed(cut(m)),
        }
    }
}

impl From<CallError> for CommandError {
    fn from(e: CallError) -> CommandError {
        match e {
            CallError::Handler(h) => h.into(),
            CallError::Aborted(reason) => CommandError::Aborted(reason),
            CallError::Trapped(Trap::Deadline) => CommandError::Deadline,
            CallError::Trapped(Trap::Memory(m)) => CommandError::MemoryLimit(m),
            CallError::Trapped(Trap::Fault(m)) => CommandError::Trapped(m),
            CallError::Busy => CommandError::Busy,
        }
    }
}

pub(super) fn db_error(e: impl Into<anyhow::Error>) -> CommandError {
    let e = e.into();
    let timed_out = matches!(e.downcast_ref::<sqlx::Error>(), Some(sqlx::Error::PoolTimedOut))
        || matches!(
            e.downcast_ref::<SessionError>(),
            Some(SessionError::Database(sqlx::Error::PoolTimedOut))
        );
    if timed_out {
        return CommandError::Busy;
    }
    CommandError::Database(e)
}

/// A call error in words, for the operator: the log, `last_error` and the dead-letter table.
/// What the guest wrote is cut at [`MAX_GUEST_TEXT`] bytes.
pub(super) fn describe_call_error(e: &CallError) -> String {
    match e {
        CallError::Handler(HandlerError::Rejected(r)) => {
            format!(
                "rejected ({}): {}",
                clipped(&r.code, MAX_GUEST_TEXT),
                clipped(&r.message, MAX_GUEST_TEXT)
            )
        }
        CallError::Handler(HandlerError::InvalidInput(m)) => format!("invalid input: {}", clipped(m, MAX_GUEST_TEXT)),
        CallError::Handler(HandlerError::Failed(m)) => format!("failed: {}", clipped(m, MAX_GUEST_TEXT)),
        // Postgres quotes values in its messages, and a trap's backtrace names the guest's
        // functions: the plugin's words too.
        CallError::Aborted(m) => format!("transaction aborted: {}", clipped(m, MAX_GUEST_TEXT)),
        CallError::Trapped(Trap::Deadline) => "ran past its deadline".into(),
        CallError::Trapped(Trap::Memory(m)) => format!("memory limit: {}", clipped(m, MAX_GUEST_TEXT)),
        CallError::Trapped(Trap::Fault(m)) => format!("trapped: {}", clipped(m, MAX_GUEST_TEXT)),
        CallError::Busy => "no free call slot, or no room in the instance pool".into(),
    }
}

/// The most of a guest's error text the host keeps: a plugin chooses its length, and each
/// failed attempt of an event logs it and may store it.
const MAX_GUEST_TEXT: usize = 4096;
