//! A plugin's metric handles, registered at its version's first call: later calls and
//! commands record into them without building label strings or looking them up.

use metrics::{Counter, Histogram};

pub(crate) struct CallMetrics {
    /// `obx_plugin_call_duration_seconds`.
    pub(crate) duration: Histogram,
    /// `obx_plugin_calls_total`, by outcome.
    pub(crate) ok: Counter,
    pub(crate) error: Counter,
    pub(crate) trap: Counter,
    /// `obx_outbox_events_written_total`.
    pub(crate) events_written: Counter,
    /// `obx_command_duration_seconds`.
    pub(crate) command_duration: Histogram,
    /// `obx_commands_total` with outcome `ok`, by command, in the manifest's order.
    commands_ok: Vec<(String, Counter)>,
}

impl CallMetrics {
    /// The handles of plugin `name`, whose manifest declares `commands`, from the recorder
    /// installed now (the host installs its own before it serves any call).
    pub(crate) fn new(name: &str, commands: &[String]) -> CallMetrics {
        let calls = |outcome: &'static str| metrics::counter!("obx_plugin_calls_total", "plugin" => name.to_string(), "outcome" => outcome);
        let command_ok = |command: &String| metrics::counter!("obx_commands_total", "plugin" => name.to_string(), "command" => command.clone(), "outcome" => "ok");
        CallMetrics {
            duration: metrics::histogram!("obx_plugin_call_duration_seconds", "plugin" => name.to_string()),
            ok: calls("ok"),
            error: calls("error"),
            trap: calls("trap"),
            events_written: metrics::counter!("obx_outbox_events_written_total", "plugin" => name.to_string()),
            command_duration: metrics::histogram!("obx_command_duration_seconds", "plugin" => name.to_string()),
            commands_ok: commands.iter().map(|c| (c.clone(), command_ok(c))).collect(),
        }
    }

    /// `obx_commands_total` of `command` with outcome `ok`, if the manifest declares it.
    pub(crate) fn command_ok(&self, command: &str) -> Option<&Counter> {
        self.commands_ok
            .iter()
            .find(|(c, _)| c == command)
            .map(|(_, counter)| counter)
    }
}
