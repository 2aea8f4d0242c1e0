//! Logs (tracing) and metrics (Prometheus, served at `/metrics`).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::EnvFilter;

/// How the log is written: `--log-format`, or `OBX_LOG_FORMAT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for a log collector.
    Json,
}

/// Installs the log subscriber: `RUST_LOG` filters (default `info`), in `format`. Colours
/// only in text on a terminal (a log written to a file or a pipe has no escape codes), and
/// never with `NO_COLOR` set.
pub fn init_logging(format: LogFormat) {
    use std::io::IsTerminal as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt().with_writer(std::io::stderr);
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry();
    // A second init (tests start several hosts in one process) keeps the first subscriber.
    let _installed = match (log_filter(std::env::var("RUST_LOG").ok()), format) {
        (LogFilter::Targets(t), LogFormat::Json) => {
            registry.with(layer.with_ansi(false).json()).with(t).try_init().is_ok()
        }
        (LogFilter::Targets(t), LogFormat::Text) => registry.with(layer.with_ansi(colour)).with(t).try_init().is_ok(),
        (LogFilter::Env(f), LogFormat::Json) => builder.with_env_filter(f).with_ansi(false).json().try_init().is_ok(),
        (LogFilter::Env(f), LogFormat::Text) => builder.with_env_filter(f).with_ansi(colour).try_init().is_ok(),
    };
}

/// What filters the log.
#[expect(clippy::large_enum_variant, reason = "made once, when the log is set up")]
enum LogFilter {
    /// Targets and levels only: decided once per call site, at no cost when a span is
    /// entered or left.
    Targets(Targets),
    /// Anything else: directives on spans or fields, which `Targets` cannot express, and
    /// values the two read differently. `EnvFilter` takes a shared lock on every entry into
    /// and exit from a span, also for the spans it does not filter (a command's span is
    /// entered at each of its polls), so it is used only for them.
    Env(EnvFilter),
}

/// The filter for `RUST_LOG` (unset: `info`). A value made only of plain directives
/// (`info`, `obx=debug,sqlx=warn`) that `EnvFilter` also reads filters as `EnvFilter` would,
/// without its cost; anything else (a span or field directive, an empty or unreadable value,
/// an empty part, a space, a target `EnvFilter` would refuse) goes to `EnvFilter` as before.
///
/// The notices and warnings Postgres sends on a session (sqlx logs them under
/// [`NOTICES`]) are off unless the value names that target: a plugin's statements can make
/// Postgres send one per row, each quoting a value of the plugin's whole, and through that
/// target they reached the host's log past the `log` import's bounds. Plugin sessions also
/// start with `client_min_messages` at `error`, but a session may change its own settings.
fn log_filter(rust_log: Option<String>) -> LogFilter {
    let spec = rust_log.unwrap_or_else(|| "info".into());
    let notices = !spec.contains(NOTICES);
    let env = EnvFilter::try_new(&spec);
    let filter = match (spec.split(',').all(plain_directive), spec.parse::<Targets>(), env) {
        (true, Ok(targets), Ok(_)) => LogFilter::Targets(targets),
        (_, _, Ok(env)) => LogFilter::Env(env),
        (_, _, Err(_)) => LogFilter::Env(EnvFilter::new("info")),
    };
    match filter {
        LogFilter::Targets(t) if notices => LogFilter::Targets(t.with_target(NOTICES, LevelFilter::OFF)),
        LogFilter::Env(f) if notices => {
            LogFilter::Env(f.add_directive(format!("{NOTICES}=off").parse().expect("a valid directive")))
        }
        filter => filter,
    }
}

/// The target under which sqlx logs what Postgres notices on a session.
const NOTICES: &str = "sqlx::postgres::notice";

/// Whether `directive` is `level`, `target` or `target=level`, which `Targets` and
/// `EnvFilter` read alike: a target of letters, digits, `_`, `-` and `::`, a level that is
/// not empty, no spaces.
fn plain_directive(directive: &str) -> bool {
    let (target, level) = match directive.split_once('=') {
        Some((target, level)) => (target, Some(level)),
        None => (directive, None),
    };
    let word = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-:".contains(c));
    word(target) && level.is_none_or(|l| word(l) && !l.contains(':'))
}

/// Bucket bounds, in seconds, of every duration histogram (`*_seconds`): fine in the
/// milliseconds where commands and deliveries live, coarse up to a minute.
const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
];

/// The process-wide Prometheus recorder, installed on first use. Durations are Prometheus
/// histograms (buckets), not summaries, so that they can be aggregated across hosts.
pub fn metrics() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                    SECONDS_BUCKETS,
                )
                .expect("the bucket list is not empty")
                .build_recorder();
            let handle = recorder.handle();
            // Fails only if another recorder is installed; then ours just records nothing.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// Gauges read from the database every few seconds, so that every host reports them whatever
/// it runs: the outbox backlog and the age of its oldest row, the inbox backlog, the dead
/// letters parked and the messages quarantined, per plugin. The counts read their tables'
/// rows: with millions of pending timers or unprocessed inbox events a reading takes a
/// second or more, so the next one waits [`gauge_wait`] (`obx_database_gauges_seconds` says
/// how long the last took).
pub async fn run_database_gauges(
    pool: sqlx::PgPool,
    every: std::time::Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let started = std::time::Instant::now();
        if let Err(e) = record_database_gauges(&pool).await {
            tracing::debug!(error = %e, "could not read the database gauges");
        }
        let took = started.elapsed();
        metrics::gauge!("obx_database_gauges_seconds").set(took.as_secs_f64());
        tokio::select! {
            _ = tokio::time::sleep(gauge_wait(every, took)) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// How long to wait before the next reading of the database gauges: `every`, or twenty times
/// what the last reading took if that is longer (so that the readings keep at most a
/// twentieth of a database session busy), and never more than [`MAX_GAUGE_WAIT`].
fn gauge_wait(every: std::time::Duration, took: std::time::Duration) -> std::time::Duration {
    every.max(took.saturating_mul(20)).min(MAX_GAUGE_WAIT.max(every))
}

/// The longest the database gauges go unread.
const MAX_GAUGE_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

async fn record_database_gauges(pool: &sqlx::PgPool) -> sqlx::Result<()> {
    let outbox = crate::outbox::backlog(pool).await?;
    metrics::gauge!("obx_outbox_backlog").set(outbox.backlog as f64);
    metrics::gauge!("obx_outbox_oldest_unpublished_seconds").set(outbox.oldest_unpublished_seconds.unwrap_or(0.0));
    metrics::gauge!("obx_outbox_set_aside").set(outbox.rows_set_aside as f64);
    metrics::gauge!("obx_outbox_delayed").set(outbox.delayed as f64);
    for c in crate::inbox::counts(pool).await? {
        metrics::gauge!("obx_inbox_backlog", "plugin" => c.plugin.clone()).set(c.inbox_backlog as f64);
        metrics::gauge!("obx_dead_letters_parked", "plugin" => c.plugin.clone()).set(c.dead_letters as f64);
        metrics::gauge!("obx_quarantined_messages", "plugin" => c.plugin).set(c.quarantined as f64);
    }
    for t in crate::timers::counts(pool).await? {
        metrics::gauge!("obx_timers_pending", "plugin" => t.plugin.clone()).set(t.pending as f64);
        metrics::gauge!("obx_timers_parked", "plugin" => t.plugin.clone()).set(t.parked as f64);
        metrics::gauge!("obx_timers_overdue_seconds", "plugin" => t.plugin).set(t.overdue_seconds);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tracing::Level;

    use super::{gauge_wait, log_filter, LogFilter};

    /// `RUST_LOG` of targets and levels takes the lock-free filter and means what it meant
    /// with `EnvFilter`; directives on spans or fields, and an empty value, keep `EnvFilter`.
    #[test]
    fn plain_rust_log_values_filter_by_target_and_level_and_the_rest_keep_env_filter() {
        let targets = |v: Option<&str>| match log_filter(v.map(str::to_string)) {
            LogFilter::Targets(t) => t,
            LogFilter::Env(f) => panic!("{v:?} should filter by targets, got {f}"),
        };
        let unset = targets(None);
        assert!(unset.would_enable("obx::dispatch", &Level::INFO));
        assert!(!unset.would_enable("obx::dispatch", &Level::DEBUG));
        let mixed = targets(Some("warn,obx::dispatch=trace,sqlx=error"));
        assert!(mixed.would_enable("obx::dispatch::x", &Level::TRACE));
        assert!(!mixed.would_enable("obx::relay", &Level::INFO));
        assert!(mixed.would_enable("obx::relay", &Level::WARN));
        assert!(!mixed.would_enable("sqlx::query", &Level::WARN));
        // What Postgres notices on a session is off, unless asked for by name.
        for v in [None, Some("debug"), Some("warn,sqlx=trace")] {
            assert!(
                !targets(v).would_enable("sqlx::postgres::notice", &Level::WARN),
                "{v:?}"
            );
        }
        assert!(targets(Some("info,sqlx::postgres::notice=info")).would_enable("sqlx::postgres::notice", &Level::INFO));
        let off = targets(Some("OFF"));
        assert!(!off.would_enable("obx", &Level::ERROR));
        let plain = targets(Some("obx::dispatch=info,INFO,sqlx=5"));
        assert!(plain.would_enable("sqlx::query", &Level::TRACE));
        assert!(plain.would_enable("obx::relay", &Level::INFO));
        // Values the two parsers read differently, or that EnvFilter refuses, keep EnvFilter:
        // an empty part or level, a space after a comma, a target that starts oddly.
        for v in [
            "obx[command{plugin=orders}]=debug",
            "obx[command]=debug",
            "",
            "  ",
            "info,",
            "obx=debug,,sqlx=warn",
            "obx=",
            "obx=debug, sqlx=warn",
            "=debug",
            "*=warn",
            "obx=debug=x",
        ] {
            assert!(
                matches!(log_filter(Some(v.into())), LogFilter::Env(_)),
                "{v:?} needs EnvFilter"
            );
        }
    }

    /// A slow reading of the gauges spaces the next one out: they keep at most a twentieth
    /// of a session busy, and are read at least every five minutes.
    #[test]
    fn slow_gauge_readings_are_spaced_out() {
        let every = Duration::from_secs(2);
        assert_eq!(gauge_wait(every, Duration::from_millis(30)), every);
        assert_eq!(gauge_wait(every, Duration::from_millis(100)), every);
        assert_eq!(gauge_wait(every, Duration::from_millis(500)), Duration::from_secs(10));
        assert_eq!(gauge_wait(every, Duration::from_secs(4)), Duration::from_secs(80));
        assert_eq!(gauge_wait(every, Duration::from_secs(60)), Duration::from_secs(300));
        assert_eq!(
            gauge_wait(Duration::from_secs(600), Duration::ZERO),
            Duration::from_secs(600)
        );
    }
}
