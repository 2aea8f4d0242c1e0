//! `obx:plugin/log`: plugin log lines go into the host's tracing, tagged with the plugin,
//! its version and the call, bounded in length, in number per call and per second, and with
//! their control characters escaped.

use std::borrow::Cow;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::runtime::bindings::log::{Host, Level};
use crate::runtime::state::CallState;

/// Lines one call may log; the rest are dropped, with one warning.
const MAX_LINES_PER_CALL: u32 = 1000;
/// Lines a plugin may log in one second, over all its calls; the rest are dropped, with one
/// warning a second. Per call alone, a plugin serving a thousand calls a second could write
/// 8 GB of log a second.
const MAX_LINES_PER_SECOND: u32 = 2000;
/// Longest line kept; longer lines are cut.
const MAX_LINE_BYTES: usize = 8 * 1024;

/// The lines a plugin may still log in the current second.
#[derive(Default)]
pub(crate) struct LogBudget(Mutex<Option<(Instant, u32)>>);

/// Whether a line fits the second's budget.
#[derive(Debug, PartialEq)]
enum Budget {
    Fits,
    /// The first line over it this second: say that the rest are dropped.
    FirstOver,
    Over,
}

impl LogBudget {
    fn take(&self, now: Instant) -> Budget {
        let mut second = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (start, lines) = second.get_or_insert((now, 0));
        if now.duration_since(*start) >= Duration::from_secs(1) {
            (*start, *lines) = (now, 0);
        }
        *lines = lines.saturating_add(1);
        match (*lines).cmp(&(MAX_LINES_PER_SECOND + 1)) {
            std::cmp::Ordering::Less => Budget::Fits,
            std::cmp::Ordering::Equal => Budget::FirstOver,
            std::cmp::Ordering::Greater => Budget::Over,
        }
    }
}

/// `message` with its control characters escaped (`\n`, `\u{1b}`): in the text format a
/// plugin's newline began a line that read as the host's own, and terminal escapes reached the
/// operator's terminal.
fn escaped(message: &str) -> Cow<'_, str> {
    if !message.chars().any(char::is_control) {
        return message.into();
    }
    let mut out = String::with_capacity(message.len() + 16);
    for c in message.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out.into()
}

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
        match self.plugin.log_budget.take(Instant::now()) {
            Budget::Fits => {}
            Budget::FirstOver => {
                tracing::warn!(target: "obx::plugin", plugin, version,
                    "more than {MAX_LINES_PER_SECOND} log lines in a second; dropping the rest of it");
                return;
            }
            Budget::Over => return,
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
        let message = escaped(&message);
        match level {
            Level::Trace => tracing::trace!(target: "obx::plugin", plugin, version, call, "{message}"),
            Level::Debug => tracing::debug!(target: "obx::plugin", plugin, version, call, "{message}"),
            Level::Info => tracing::info!(target: "obx::plugin", plugin, version, call, "{message}"),
            Level::Warn => tracing::warn!(target: "obx::plugin", plugin, version, call, "{message}"),
            Level::Error => tracing::error!(target: "obx::plugin", plugin, version, call, "{message}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{escaped, Budget, LogBudget, MAX_LINES_PER_SECOND};

    #[test]
    fn a_plugins_lines_are_bounded_per_second_over_its_calls() {
        let budget = LogBudget::default();
        let start = Instant::now();
        for _ in 0..MAX_LINES_PER_SECOND {
            assert_eq!(budget.take(start), Budget::Fits);
        }
        assert_eq!(budget.take(start), Budget::FirstOver);
        assert_eq!(budget.take(start + Duration::from_millis(999)), Budget::Over);
        assert_eq!(budget.take(start + Duration::from_secs(1)), Budget::Fits);
    }

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(escaped("plain \"text\" é"), "plain \"text\" é");
        assert_eq!(
            escaped("ok\n2026-12-05T07:00:00Z  INFO obx::app: forged\u{1b}[2J"),
            "ok\\n2026-12-05T07:00:00Z  INFO obx::app: forged\\u{1b}[2J"
        );
    }
}
