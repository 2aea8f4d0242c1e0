//! `obx:plugin/log`: plugin log lines go into the host's tracing, tagged with the plugin,
//! its version and the call, bounded in length, in number per call and per second, and with
//! their control characters escaped.

use std::borrow::Cow;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::runtime::bindings::log::{Host, Level};
use crate::runtime::state::CallState;
use crate::text::prefix;

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

/// Whether `c` is escaped in a plugin's log line: a control character, a line or paragraph
/// separator, or a bidirectional override or isolate (which reorder what a terminal shows).
fn escapes(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `message` with those characters escaped (`\\n`, `\\u{1b}`): in the text format a plugin's
/// newline began a line that read as the host's own, and terminal escapes reached the
/// operator's terminal.
fn escaped(message: &str) -> Cow<'_, str> {
    if !message.chars().any(escapes) {
        return message.into();
    }
    let mut out = String::with_capacity(message.len() + 16);
    for c in message.chars() {
        if escapes(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out.into()
}

/// The line a plugin's `message` is logged as: cut at [`MAX_LINE_BYTES`], escaped, and cut
/// there again (escapes lengthen it up to six times; escaping the whole of a 100 MB message
/// first would take 600 MB).
fn line(message: &str) -> String {
    let mut line = escaped(prefix(message, MAX_LINE_BYTES)).into_owned();
    if line.len() > MAX_LINE_BYTES || message.len() > MAX_LINE_BYTES {
        line.truncate(prefix(&line, MAX_LINE_BYTES).len());
        line.push_str(" [truncated]");
    }
    line
}

/// Whether the host's log shows plugin lines of `level`.
fn enabled(level: &Level) -> bool {
    match level {
        Level::Trace => tracing::enabled!(target: "obx::plugin", tracing::Level::TRACE),
        Level::Debug => tracing::enabled!(target: "obx::plugin", tracing::Level::DEBUG),
        Level::Info => tracing::enabled!(target: "obx::plugin", tracing::Level::INFO),
        Level::Warn => tracing::enabled!(target: "obx::plugin", tracing::Level::WARN),
        Level::Error => tracing::enabled!(target: "obx::plugin", tracing::Level::ERROR),
    }
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
        // A line the log would not show costs nothing, and takes nothing from the budget.
        if !enabled(&level) {
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
        let message = line(&message);
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

    use super::{escaped, line, Budget, LogBudget, MAX_LINES_PER_SECOND, MAX_LINE_BYTES};

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
        assert_eq!(escaped("a\u{2028}b\u{202e}c"), r"a\u{2028}b\u{202e}c");
        // Cut to the limit before and after escaping.
        let long = line(&"\n".repeat(10 * MAX_LINE_BYTES));
        assert!(long.len() <= MAX_LINE_BYTES + " [truncated]".len() && long.ends_with(" [truncated]"));
        assert_eq!(line("short"), "short");
    }
}
