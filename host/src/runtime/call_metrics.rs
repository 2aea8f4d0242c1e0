//! A plugin's metric handles, registered at its version's first call: later calls record
//! into them without building label strings or looking them up.

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
}

impl CallMetrics {
    /// The handles of plugin `name`, from the recorder installed now (the host installs its
    /// own before it serves any call).
    pub(crate) fn new(name: &str) -> CallMetrics {
        let calls = |outcome: &'static str| metrics::counter!("obx_plugin_calls_total", "plugin" => name.to_string(), "outcome" => outcome);
        CallMetrics {
            duration: metrics::histogram!("obx_plugin_call_duration_seconds", "plugin" => name.to_string()),
            ok: calls("ok"),
            error: calls("error"),
            trap: calls("trap"),
            events_written: metrics::counter!("obx_outbox_events_written_total", "plugin" => name.to_string()),
        }
    }
}
