//! Runs commands. The dispatcher owns the transaction of every call: it opens it on a
//! session of the plugin's own role, hands it to the handler through the `sql` import, and
//! then commits it, with the call's outbox rows and its idempotency record, only if the
//! handler succeeded. Any other ending rolls everything back.
//!
//! Invariants:
//! * One command, one transaction: domain writes, `outbox_event` rows and the
//!   `Idempotency-Key` record commit together or not at all.
//! * The whole transaction runs as the plugin: what the host adds to it (outbox rows, the
//!   idempotency record) goes through the `obx_api` functions, which act for the session's
//!   plugin and no other.
//! * A call that did not return `ok` never commits its effects.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::db::sessions::{PluginTx, SessionError, Sessions};
use crate::idempotency::{self, Claim};
use crate::otel::{self, Kind};
use crate::outbox::{self, writer};
use crate::runtime::bindings::{guest, timer_guest, types::HandlerError};
use crate::runtime::registry::Registry;
use crate::runtime::{CallError, CallOutput, Plugin, Runtime};
use crate::signal::Signal;
use crate::trace::TraceContext;
use tracing::Instrument;

mod error;
mod observe;

pub use error::CommandError;
use error::{db_error, describe_call_error};
use observe::{call_span, count_outcome, end_call_span, record_command};

tokio::task_local! {
    /// Set, within the work of [`noting_commit`], once a command's `COMMIT` has been sent.
    static COMMIT_SENT: Arc<AtomicBool>;
}

/// Runs `work` (an HTTP request's) with `sent` set once a command's `COMMIT` is sent: from
/// then on Postgres may commit whatever the host does, so that cutting the work off at a
/// deadline would answer a failure for a command that took effect.
pub async fn noting_commit<F: std::future::Future>(sent: Arc<AtomicBool>, work: F) -> F::Output {
    COMMIT_SENT.scope(sent, work).await
}

/// Notes that the work [`noting_commit`] runs is about to send a commit (a `COMMIT`, or a
/// statement that commits on its own): a command's, or an admin action's. Outside such work,
/// nothing.
pub(crate) fn commit_sent() {
    let _ = COMMIT_SENT.try_with(|sent| sent.store(true, Ordering::Release));
}

pub struct Dispatcher {
    /// The host's own pool, for bookkeeping outside plugin transactions.
    pub(crate) pool: PgPool,
    /// Sessions of the plugins' own roles, where every call runs.
    pub(crate) sessions: Arc<Sessions>,
    runtime: Arc<Runtime>,
    registry: Arc<Registry>,
    signal: Signal,
}

pub struct CommandRequest {
    pub plugin: String,
    pub command: String,
    /// The request body: valid JSON text.
    pub payload: String,
    pub idempotency_key: Option<String>,
    pub request_id: String,
    /// The caller's trace context (`traceparent`), if it sent one.
    pub parent_trace: Option<TraceContext>,
}

/// How a command's start came out: its transaction, with the `Idempotency-Key` it claimed
/// (and the request's hash), or the answer already stored for its key.
enum Begun<'r> {
    Run(PluginTx, Option<(&'r str, Vec<u8>)>),
    Replay(CommandResponse),
}

/// A successful command, or a stored answer replayed for a repeated `Idempotency-Key`.
#[derive(Debug)]
pub struct CommandResponse {
    pub status: u16,
    /// JSON.
    pub body: Vec<u8>,
    pub replayed: bool,
}

/// The savepoint that separates a command's effects from its idempotency record.
const HANDLER_SAVEPOINT: &str = "SAVEPOINT obx_handler";

impl Dispatcher {
    pub fn new(
        pool: PgPool,
        sessions: Arc<Sessions>,
        runtime: Arc<Runtime>,
        registry: Arc<Registry>,
        signal: Signal,
    ) -> Dispatcher {
        Dispatcher {
            pool,
            sessions,
            runtime,
            registry,
            signal,
        }
    }

    /// Whether a batch of handlers (events or timers) whose emits so far hold `emitted_bytes`
    /// starts no more: they reached one call's limit, `limits.max_emit_bytes_per_call`. A batch
    /// holds its events until its commit, written in one statement, so with no bound of its
    /// own 32 timers of 16 MiB of emits each held 512 MiB, and a statement past Postgres's
    /// 1 GiB could never commit. Never before the batch's first handler: a limit of 0 refuses
    /// every emit, and counted before it, stopped every batch empty.
    pub(crate) fn batch_emitted_enough(&self, emitted_bytes: usize) -> bool {
        emitted_bytes > 0 && emitted_bytes >= self.runtime.limits().max_emit_bytes_per_call
    }

    /// Runs one command in one transaction.
    pub async fn run_command(&self, req: CommandRequest) -> Result<CommandResponse, CommandError> {
        self.run_command_traced(req).await.0
    }

    /// Like [`Dispatcher::run_command`], and returns the trace context of the command's span,
    /// which the events it emitted name as their parent.
    pub async fn run_command_traced(
        &self,
        mut req: CommandRequest,
    ) -> (Result<CommandResponse, CommandError>, TraceContext) {
        let mut otel = otel::Span::start(
            format!("command {}.{}", req.plugin, req.command),
            Kind::Internal,
            req.parent_trace.as_ref(),
        );
        let trace = *otel.context();
        let span = tracing::info_span!(
            "command",
            plugin = %req.plugin,
            command = %req.command,
            request_id = %req.request_id,
            trace_id = %trace.trace_id(),
            span_id = %trace.span_id(),
            parent_span_id = %crate::trace::parent_field(req.parent_trace.as_ref()),
        );
        // Moved into the call, not copied: a body of up to `http.max_body_bytes` each.
        let payload = std::mem::take(&mut req.payload);
        let result = self.run_command_in_span(&req, payload, &trace).instrument(span).await;
        if otel.recording() {
            otel.set("obx.plugin", req.plugin.clone());
            otel.set("obx.command", req.command.clone());
            otel.set("obx.request_id", req.request_id.clone());
            match &result {
                Ok(r) => otel.set("obx.outcome", if r.replayed { "replayed" } else { "ok" }),
                Err(e) => {
                    otel.set("obx.outcome", e.code());
                    if e.status() >= 500 {
                        otel.fail(e.to_string());
                    }
                }
            }
        }
        (result, trace)
    }

    async fn run_command_in_span(
        &self,
        req: &CommandRequest,
        payload: String,
        trace: &TraceContext,
    ) -> Result<CommandResponse, CommandError> {
        let started = Instant::now();
        let plugin = self.registry.get(&req.plugin);
        let result = match &plugin {
            Some(plugin) => self.run_command_inner(plugin, req, payload, trace).await,
            None => Err(CommandError::UnknownPlugin(req.plugin.clone())),
        };
        record_command(plugin.as_deref(), req, &result, started.elapsed());
        match &result {
            Err(e) if e.status() >= 500 => tracing::warn!(
                plugin = %req.plugin, command = %req.command, request_id = %req.request_id,
                code = e.code(), detail = e.detail().unwrap_or_default(), error = ?e, "command failed"
            ),
            Err(e) => tracing::debug!(
                plugin = %req.plugin, command = %req.command, request_id = %req.request_id,
                code = e.code(), "command refused"
            ),
            Ok(_) => {}
        }
        result
    }

    /// Runs `req`, whose body is `payload` (taken out of it).
    async fn run_command_inner(
        &self,
        plugin: &Plugin,
        req: &CommandRequest,
        payload: String,
        trace: &TraceContext,
    ) -> Result<CommandResponse, CommandError> {
        if !plugin.manifest.commands.iter().any(|c| c == &req.command) {
            return Err(CommandError::UnknownCommand {
                plugin: req.plugin.clone(),
                command: req.command.clone(),
            });
        }
        let (tx, idempotency) = match self.begin_command(&plugin.manifest.name, req, &payload).await? {
            Begun::Run(tx, claimed) => (tx, claimed),
            Begun::Replay(answer) => return Ok(answer),
        };

        let command = guest::Command {
            name: req.command.clone(),
            payload,
            request_id: req.request_id.clone(),
        };
        let call = call_span(plugin, "handle-command", trace);
        let CallOutput {
            result,
            tx,
            events,
            lost_race,
        } = self.runtime.handle_command(plugin, tx, command, Some(*trace)).await;
        end_call_span(call, &result, events.len());
        let Some(mut tx) = tx else {
            let error = result.err().map(|e| CommandError::after_race(e, lost_race));
            return Err(error.unwrap_or(CommandError::Deadline));
        };

        let error = match result {
            Ok(response) => match check_response(&response, self.runtime.limits().max_payload_bytes) {
                Ok(()) => {
                    let body = response.into_bytes();
                    let answer = idempotency.as_ref().map(|(k, _)| (*k, 200, &body[..]));
                    self.commit(tx, plugin, trace, &events, answer).await?;
                    return Ok(CommandResponse {
                        status: 200,
                        body,
                        replayed: false,
                    });
                }
                Err(e) => CommandError::InvalidResponse(e),
            },
            Err(e) => CommandError::after_race(e, lost_race),
        };

        // A rejection or invalid input is an answer too: with an Idempotency-Key, record it
        // (and nothing the handler did) so that a retry gets the same answer. Not on a session
        // that had to be abandoned mid-result: the retry then runs the handler again.
        let answerable = matches!(error, CommandError::Rejected { .. } | CommandError::InvalidInput(_));
        if let (Some((key, _)), true, false) = (&idempotency, answerable, tx.is_poisoned()) {
            let body = serde_json::to_vec(&error.body()).expect("json");
            // Nothing the handler did commits: undone in the commit's round trip, before its
            // check (a handler that caught a failed statement left the transaction aborted).
            tx.undo_at_commit_to("obx_handler");
            idempotency::store_answer_at_commit(&mut tx, key, error.status(), &body);
            commit_sent();
            let stored = tx.commit().await;
            if let Err(e) = stored {
                tracing::warn!(error = %e, "could not record the answer for an Idempotency-Key");
            }
            return Err(error);
        }
        let _ = tx.rollback().await;
        Err(error)
    }

    /// Begins a command's transaction on a session of `plugin`; with an `Idempotency-Key`,
    /// claims the key in the same round trip, and replays the answer stored for it if there
    /// is one.
    async fn begin_command<'r>(
        &self,
        plugin: &str,
        req: &'r CommandRequest,
        payload: &str,
    ) -> Result<Begun<'r>, CommandError> {
        let Some(key) = &req.idempotency_key else {
            let tx = self.sessions.begin(plugin).await.map_err(db_error)?;
            return Ok(Begun::Run(tx, None));
        };
        let hash = Sha256::new()
            .chain_update(req.command.as_bytes())
            .chain_update(b"\n")
            .chain_update(payload.as_bytes())
            .finalize()
            .to_vec();
        let claim = idempotency::claim_statements(key, &hash, HANDLER_SAVEPOINT);
        let (tx, rows) = self.sessions.begin_then(plugin, &claim).await.map_err(|e| {
            // The claim waits for a request that holds the key, up to the role's lock
            // timeout: that request is still running, and the database is fine.
            match &e {
                SessionError::Database(e) if crate::db::lock_timed_out(e) => CommandError::IdempotencyKeyInUse,
                _ => db_error(e),
            }
        })?;
        match idempotency::read_claim(rows.first()).map_err(db_error)? {
            Claim::New => Ok(Begun::Run(tx, Some((key.as_str(), hash)))),
            Claim::Answered {
                request_hash,
                status,
                body,
            } => {
                let _ = tx.rollback().await;
                if request_hash != hash {
                    return Err(CommandError::IdempotencyKeyReused);
                }
                Ok(Begun::Replay(CommandResponse {
                    status,
                    body,
                    replayed: true,
                }))
            }
        }
    }

    async fn commit(
        &self,
        mut tx: PluginTx,
        plugin: &Plugin,
        trace: &TraceContext,
        events: &[outbox::NewEvent],
        answer: Option<(&str, u16, &[u8])>,
    ) -> Result<(), CommandError> {
        self.outbox_insert(&mut tx, [(plugin.manifest.version.as_str(), trace, events)]);
        if let Some((key, status, body)) = answer {
            idempotency::store_answer_at_commit(&mut tx, key, status, body);
        }
        commit_sent();
        tx.commit()
            .await
            .map_err(|e| match (crate::db::refused_for_content(&e), e.as_database_error()) {
                // The same every time: the handler's doing (a deferred constraint or trigger),
                // not a database to retry against.
                (true, _) => CommandError::Aborted(format!("the commit was refused: {e}")),
                // Lost to another transaction at the commit (a deferred check that waited past
                // `lock_timeout`, a deadlock): undone, and a retry may pass.
                (false, Some(_)) if crate::db::lost_a_race(&e) => CommandError::LostRace(format!("the commit: {e}")),
                // No answer from Postgres, or the server or the connection failed in the
                // commit's round trip (a shutdown, a terminated backend) with no word of
                // whether the COMMIT completed. The commit may have gone through.
                (false, _) => CommandError::OutcomeUnknown(format!("the commit: {e}")),
            })?;
        if !events.is_empty() {
            plugin.identity.metrics().events_written.increment(events.len() as u64);
            self.signal.notify();
        }
        Ok(())
    }
}

/// Why an event handler did not take effect.
pub struct EventFailure {
    /// For logs, `last_error` and the dead-letter table (the operator's eyes only).
    pub error: String,
    /// Whether another attempt can help: not for invalid input or a business rejection.
    pub retriable: bool,
    /// The call's first failure was a statement that lost to concurrent work (a lock wait,
    /// a deadlock), and the handler failed for it ([`CallError::may_follow_a_race`]): no
    /// fault of the handler's, so no attempt of the event's.
    pub lost_race: bool,
    /// The call could not start: no free call slot (the host is overloaded, not the handler
    /// at fault).
    pub busy: bool,
    /// The event's transaction, still open (possibly aborted), when it survived the call:
    /// the caller rolls it back, whole or to a savepoint of its own.
    pub tx: Option<PluginTx>,
}

/// What a `handle-event` call that returned `ok` emitted, not yet written.
pub struct Emitted {
    pub events: Vec<outbox::NewEvent>,
    /// The plugin version that handled the event, and the trace context of its handling.
    pub version: String,
    pub trace: TraceContext,
}

impl Emitted {
    /// The bytes of its events.
    pub fn bytes(&self) -> usize {
        self.events.iter().map(outbox::NewEvent::bytes).sum()
    }
}

impl Dispatcher {
    /// Runs `handle-event` in `tx` and hands back what it emitted, unwritten: the caller
    /// writes it with [`Dispatcher::commit_events`], in the commit's round trip. On failure the transaction
    /// comes back in the [`EventFailure`], for the caller to roll back.
    pub async fn call_event(
        &self,
        plugin: &Plugin,
        tx: PluginTx,
        event: guest::Event,
        parent_trace: Option<&TraceContext>,
    ) -> Result<(PluginTx, Emitted), EventFailure> {
        let mut otel = otel::Span::start(format!("process {}", event.event_type), Kind::Consumer, parent_trace);
        if otel.recording() {
            otel.set("messaging.system", "kafka");
            otel.set("messaging.destination.name", event.topic.clone());
            otel.set("messaging.message.id", event.event_id.clone());
            otel.set("obx.plugin", plugin.manifest.name.clone());
            otel.set("obx.event_type", event.event_type.clone());
            otel.set("obx.attempt", i64::from(event.attempt));
        }
        let trace = *otel.context();
        let span = tracing::info_span!(
            "event",
            plugin = %plugin.manifest.name,
            event_id = %event.event_id,
            event_type = %event.event_type,
            attempt = event.attempt,
            trace_id = %trace.trace_id(),
            span_id = %trace.span_id(),
            parent_span_id = %crate::trace::parent_field(parent_trace),
        );
        let outcome = self
            .call_event_in_span(plugin, tx, event, &trace)
            .instrument(span)
            .await;
        if let Err(failure) = &outcome {
            otel.fail(failure.error.clone());
        }
        outcome
    }

    async fn call_event_in_span(
        &self,
        plugin: &Plugin,
        tx: PluginTx,
        event: guest::Event,
        trace: &TraceContext,
    ) -> Result<(PluginTx, Emitted), EventFailure> {
        let started = Instant::now();
        let call = call_span(plugin, "handle-event", trace);
        let output = self.runtime.handle_event(plugin, tx, event, Some(*trace)).await;
        end_call_span(call, &output.result, output.events.len());
        let outcome = handled(plugin, output, trace);
        tracing::trace!(took = ?started.elapsed(), "event handler");
        count_outcome(
            plugin,
            &outcome,
            started,
            ("obx_events_handled_total", "obx_event_handler_duration_seconds"),
        );
        outcome
    }

    /// Runs `handle-timer` in `tx`, as [`Dispatcher::call_event`] runs `handle-event`, in a
    /// trace of its own, linked to `scheduled_in` (the span of the call that scheduled it).
    pub async fn call_timer(
        &self,
        plugin: &Plugin,
        tx: PluginTx,
        timer: timer_guest::Timer,
        scheduled_in: Option<&TraceContext>,
    ) -> Result<(PluginTx, Emitted), EventFailure> {
        let mut otel = otel::Span::start_linked(format!("timer {}", timer.name), Kind::Internal, scheduled_in);
        if otel.recording() {
            otel.set("obx.plugin", plugin.manifest.name.clone());
            otel.set("obx.timer.name", timer.name.clone());
            otel.set("obx.attempt", i64::from(timer.attempt));
        }
        let trace = *otel.context();
        let span = tracing::info_span!(
            "timer",
            plugin = %plugin.manifest.name,
            timer = %timer.name,
            key = %timer.key,
            attempt = timer.attempt,
            trace_id = %trace.trace_id(),
            scheduled_in_trace = %scheduled_in.map(TraceContext::trace_id).unwrap_or_default(),
        );
        let started = Instant::now();
        let call = call_span(plugin, "handle-timer", &trace);
        let output = self
            .runtime
            .handle_timer(plugin, tx, timer, Some(trace))
            .instrument(span)
            .await;
        end_call_span(call, &output.result, output.events.len());
        let outcome = handled(plugin, output, &trace);
        if let Err(failure) = &outcome {
            otel.fail(failure.error.clone());
        }
        count_outcome(
            plugin,
            &outcome,
            started,
            ("obx_timers_fired_total", "obx_timer_handler_duration_seconds"),
        );
        outcome
    }

    /// Writes the outbox rows of handled events (`emitted`, in the order they were handled)
    /// and commits; wakes the relay if there were any.
    pub async fn commit_events(&self, mut tx: PluginTx, emitted: &[Emitted]) -> sqlx::Result<()> {
        let calls = emitted.iter().map(|e| (e.version.as_str(), &e.trace, &e.events[..]));
        let written = self.outbox_insert(&mut tx, calls);
        tx.commit().await?;
        if written > 0 {
            self.signal.notify();
        }
        Ok(())
    }

    /// Has the transaction write the outbox rows of its calls (each a plugin version, the
    /// call's trace context and its events) at its commit, in one round trip with it, so
    /// that a refused row is the commit's failure, reported with it. Each call's rows go
    /// under a span of their own whose trace context they carry: the relay's publish and
    /// every consumer's handling of the events are its children. Returns how many rows.
    fn outbox_insert<'a>(
        &self,
        tx: &mut PluginTx,
        calls: impl IntoIterator<Item = (&'a str, &'a TraceContext, &'a [outbox::NewEvent])>,
    ) -> usize {
        let calls: Vec<_> = calls.into_iter().filter(|(_, _, events)| !events.is_empty()).collect();
        if calls.is_empty() {
            return 0;
        }
        // Each span ends when dropped, with this function, once its rows are queued.
        let mut spans = Vec::with_capacity(calls.len());
        let mut traceparents = Vec::with_capacity(calls.len());
        for (_, parent, events) in &calls {
            let mut span = otel::Span::export_only("outbox insert", Kind::Producer, Some(parent));
            traceparents.push(span.as_ref().map_or(*parent, |s| s.context()).header());
            if let Some(span) = &mut span {
                span.set("messaging.batch.message_count", events.len() as i64);
            }
            spans.push(span);
        }
        let rows: Vec<writer::CallRows<'_>> = calls
            .iter()
            .zip(&traceparents)
            .map(|((version, _, events), traceparent)| writer::CallRows {
                version,
                traceparent,
                events,
            })
            .collect();
        let limits = self.runtime.limits();
        let per_statement = writer::PerStatement {
            events: limits.max_emits_per_call as usize,
            payload_bytes: limits.max_emit_bytes_per_call,
        };
        writer::insert_at_commit(tx, &rows, per_statement);
        rows.iter().map(|r| r.events.len()).sum()
    }
}

/// What a `handle-event` or `handle-timer` call came to: its transaction and what it emitted,
/// or why it failed.
#[expect(
    clippy::result_large_err,
    reason = "both variants carry the event's transaction: boxing the failure would not shrink the result"
)]
fn handled(plugin: &Plugin, output: CallOutput<()>, trace: &TraceContext) -> Result<(PluginTx, Emitted), EventFailure> {
    let CallOutput {
        result,
        tx,
        events,
        lost_race,
    } = output;
    match (result, tx) {
        (Ok(()), Some(tx)) => Ok((
            tx,
            Emitted {
                events,
                version: plugin.manifest.version.clone(),
                trace: *trace,
            },
        )),
        (Ok(()), None) => Err(EventFailure {
            error: "the call lost its transaction".into(),
            retriable: true,
            lost_race: false,
            busy: false,
            tx: None,
        }),
        (Err(e), tx) => {
            let retriable = !matches!(
                e,
                CallError::Handler(HandlerError::InvalidInput(_) | HandlerError::Rejected(_))
            );
            Err(EventFailure {
                error: describe_call_error(&e),
                retriable,
                lost_race: lost_race && e.may_follow_a_race(),
                busy: matches!(e, CallError::Busy),
                tx,
            })
        }
    }
}

fn check_response(response: &str, max_bytes: usize) -> Result<(), String> {
    if response.len() > max_bytes {
        return Err(format!(
            "the response is {} bytes, over the limit of {max_bytes}",
            response.len()
        ));
    }
    serde_json::from_str::<serde::de::IgnoredAny>(response)
        .map(|_| ())
        .map_err(|e| format!("the response is not valid JSON: {e}"))
}
