//! Logs (tracing) and metrics (Prometheus, served at `/metrics`).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

/// Installs the log subscriber: `RUST_LOG` filters (default `info`), and
/// `OBX_LOG_FORMAT=json` switches to one JSON object per line.
pub fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = if std::env::var("OBX_LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    // A second init (tests start several hosts in one process) keeps the first subscriber.
    drop(result);
}

/// The process-wide Prometheus recorder, installed on first use.
pub fn metrics() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Fails only if another recorder is installed; then ours just records nothing.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}
