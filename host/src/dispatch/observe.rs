//! What a command or handler call leaves for the operator besides its result: metrics and
//! the spans of its guest calls.

use std::time::Instant;

use super::{CommandError, CommandRequest, CommandResponse, EventFailure};
use crate::otel::{self, Kind};
use crate::runtime::{CallError, Plugin};
use crate::trace::TraceContext;

/// Counts a command in `obx_commands_total` and records its duration: a command that ran
/// its plugin's handler and succeeded through the plugin's handles, which need no label
/// strings or lookups; any other outcome through the recorder.
pub(super) fn record_command(
    plugin: Option<&Plugin>,
    req: &CommandRequest,
    result: &Result<CommandResponse, CommandError>,
    took: std::time::Duration,
) {
    if let (Some(plugin), Ok(CommandResponse { replayed: false, .. })) = (plugin, result) {
        let handles = plugin.identity.metrics();
        if let Some(ok) = handles.command_ok(&req.command) {
            ok.increment(1);
            handles.command_duration.record(took.as_secs_f64());
            return;
        }
    }
    let outcome = match result {
        Ok(r) if r.replayed => "replayed",
        Ok(_) => "ok",
        Err(e) => e.code(),
    };
    let (plugin, command) = metric_labels(req, result);
    metrics::counter!("obx_commands_total", "plugin" => plugin.clone(), "command" => command, "outcome" => outcome)
        .increment(1);
    metrics::histogram!("obx_command_duration_seconds", "plugin" => plugin).record(took.as_secs_f64());
}

/// The plugin and command labels of a command's metrics: names the caller sent that no loaded
/// plugin knows are counted as `unknown`, so that a client cannot add a metric series, held
/// for the host's life, with every name it makes up.
fn metric_labels(req: &CommandRequest, result: &Result<CommandResponse, CommandError>) -> (String, String) {
    const UNKNOWN: &str = "unknown";
    match result {
        Err(CommandError::UnknownPlugin(_)) => (UNKNOWN.into(), UNKNOWN.into()),
        Err(CommandError::UnknownCommand { .. }) => (req.plugin.clone(), UNKNOWN.into()),
        _ => (req.plugin.clone(), req.command.clone()),
    }
}

/// The span of one guest call (`export` is the WIT export it calls).
pub(super) fn call_span(plugin: &Plugin, export: &'static str, parent: &TraceContext) -> Option<otel::Span> {
    if !otel::enabled() {
        return None;
    }
    let mut span = otel::Span::export_only(
        format!("call {} {export}", plugin.manifest.name),
        Kind::Internal,
        Some(parent),
    )?;
    span.set("obx.plugin", plugin.manifest.name.clone());
    span.set("obx.plugin.version", plugin.manifest.version.clone());
    Some(span)
}

pub(super) fn end_call_span<T>(span: Option<otel::Span>, result: &Result<T, CallError>, events: usize) {
    if let Some(mut span) = span {
        span.set("obx.events_emitted", events as i64);
        if let Err(e) = result {
            span.fail(super::error::describe_call_error(e));
        }
    }
}

/// Counts a handler call by outcome (`counter`, labelled `ok` or `failed`) and records how
/// long it took (`histogram`), per plugin.
pub(super) fn count_outcome<T>(
    plugin: &Plugin,
    outcome: &Result<T, EventFailure>,
    started: Instant,
    (counter, histogram): (&'static str, &'static str),
) {
    let label = if outcome.is_ok() { "ok" } else { "failed" };
    metrics::counter!(counter, "plugin" => plugin.manifest.name.clone(), "outcome" => label).increment(1);
    metrics::histogram!(histogram, "plugin" => plugin.manifest.name.clone()).record(started.elapsed().as_secs_f64());
}
