//! `obx:plugin/log`: plugin log lines go into the host's tracing, tagged with the plugin,
//! its version and the call, and bounded in length and number.

use crate::runtime::bindings::log::{Host, Level};
use crate::runtime::state::CallState;

/// Lines one call may log; the rest are dropped, with one warning.
const MAX_LINES_PER_CALL: u32 = 1000;
/// Longest line kept; longer lines are cut.
const MAX_LINE_BYTES: usize = 8 * 1024;

impl Host for CallState {
    fn log(&mut self, level: Level, message: String) {
        self.log_lines += 1;
        let (plugin, version, call) = (&self.plugin.name, &self.plugin.version, &self.request_id);
        if self.log_lines > MAX_LINES_PER_CALL {
            if self.log_lines == MAX_LINES_PER_CALL + 1 {
                tracing::warn!(target: "obx::plugin", plugin, version, call,
                    "more than {MAX_LINES_PER_CALL} log lines in one call; dropping the rest");
            }
            return;
        }
        let mut message = message;
        if message.len() > MAX_LINE_BYTES {
            let mut cut = MAX_LINE_BYTES;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str(" [truncated]");
        }
        match level {
            Level::Trace => tracing::trace!(target: "obx::plugin", plugin, version, call, "{message}"),
            Level::Debug => tracing::debug!(target: "obx::plugin", plugin, version, call, "{message}"),
            Level::Info => tracing::info!(target: "obx::plugin", plugin, version, call, "{message}"),
            Level::Warn => tracing::warn!(target: "obx::plugin", plugin, version, call, "{message}"),
            Level::Error => tracing::error!(target: "obx::plugin", plugin, version, call, "{message}"),
        }
    }
}
