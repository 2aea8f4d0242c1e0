//! The HTTP API (axum): commands, plugin status, health, readiness and metrics, behind
//! bearer tokens by scope (see [`auth`]); with no tokens, to callers on this machine only, and
//! to no web page (see [`local`]).
//!
//! Invariant: every error response is JSON, `{"error": {"code", "message"}}`, with a stable
//! `code`; database text and guest internals never reach a client (they go to the log).

mod admin;
mod auth;
mod bodies;
mod commands;
mod deadline;
pub mod descriptors;
mod errors;
mod local;
mod places;
pub mod server;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use sqlx::PgPool;

use crate::config::HttpConfig;
use crate::dispatch::Dispatcher;
use crate::runtime::registry::Registry;

pub use errors::error_response;

/// What the handlers share, behind one `Arc`: a request clones a pointer, not the state.
pub struct AppState {
    pub dispatcher: Arc<Dispatcher>,
    pub registry: Arc<Registry>,
    /// The host's pool: `/readyz` asks it.
    pub pool: PgPool,
    /// The admin API's own pool ([`crate::db::connect_admin`]).
    pub admin_pool: PgPool,
    /// False until plugins are loaded, and again once shutdown begins.
    pub ready: Arc<AtomicBool>,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    pub lag: Arc<crate::inbox::ConsumerLag>,
    /// For replays through the admin API: the host's brokers and Kafka settings.
    pub brokers: Arc<crate::kafka::Brokers>,
    pub kafka: crate::config::KafkaConfig,
    /// The relay's settings, which replays follow (`linger_ms`, `batch_max_bytes`).
    pub relay: crate::config::RelayConfig,
    /// How long a replay through the admin API sends before it answers with where the rest
    /// begins: half of `http.request_timeout`, the other half for its last page.
    pub replay_part: Duration,
    /// `service.name`, for the event catalogue.
    pub service: String,
    /// Postgres's last answer to `/readyz`.
    pub readiness: Readiness,
}

/// How long an answer of Postgres to a readiness ping stands.
const READINESS_KEPT: Duration = Duration::from_secs(1);

/// Postgres's last answer to a readiness ping, kept [`READINESS_KEPT`]. `/readyz` needs no
/// token: with a ping per request, any peer that reaches the port could keep the host's own
/// sessions busy (the relay's, the consumers') and Postgres with them.
#[derive(Default)]
pub struct Readiness {
    last: tokio::sync::Mutex<Option<(std::time::Instant, bool)>>,
}

impl Readiness {
    /// Whether Postgres answers: asked at most once per [`READINESS_KEPT`]; requests that
    /// come while it is asked wait for that answer.
    async fn database_answers(&self, pool: &PgPool) -> bool {
        let mut last = self.last.lock().await;
        if let Some((at, answered)) = *last {
            if at.elapsed() < READINESS_KEPT {
                return answered;
            }
        }
        let ping = tokio::time::timeout(Duration::from_secs(2), sqlx::query("SELECT 1").execute(pool)).await;
        let answered = matches!(ping, Ok(Ok(_)));
        *last = Some((std::time::Instant::now(), answered));
        answered
    }
}

/// The API's routes and layers. `winding_down` turns true when the stopping server winds its
/// connections down (see [`deadline::Deadline`]).
pub fn router(state: AppState, http: &HttpConfig, winding_down: tokio::sync::watch::Receiver<bool>) -> Router {
    let tokens = auth::Tokens::new(&http.auth);
    let commands = Router::new()
        .route("/v1/commands/{plugin}/{command}", post(commands::run))
        .route_layer(axum::middleware::from_fn_with_state(tokens.clone(), auth::commands));
    let read = Router::new()
        .route("/v1/plugins", get(plugins))
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/dlq", get(admin::dlq_list))
        .route("/v1/quarantine", get(admin::quarantine))
        .route("/v1/timers", get(admin::timers_list))
        .route("/v1/catalog", get(admin::catalog))
        .route_layer(axum::middleware::from_fn_with_state(tokens.clone(), auth::read));
    let act = Router::new()
        .route("/v1/dlq/{id}/retry", post(admin::dlq_retry))
        .route("/v1/dlq/{id}/discard", post(admin::dlq_discard))
        .route("/v1/dlq/discard", post(admin::dlq_discard_parked))
        .route("/v1/timers/cancel", post(admin::timers_cancel))
        .route("/v1/timers/retry", post(admin::timers_retry))
        .route("/v1/outbox/replay", post(admin::outbox_replay))
        .route_layer(axum::middleware::from_fn_with_state(tokens, auth::admin));
    let api = commands.merge(read).merge(act);
    // Without tokens, only this machine's callers, and no web page (see `local`). Health
    // and readiness stay open, for probes, as they do with tokens.
    let api = match http.auth.enabled() {
        true => api,
        false => api.route_layer(axum::middleware::from_fn(local::only_local)),
    };
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(api)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(http.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            bodies::Budget::new(http.max_body_bytes_in_flight, http.max_body_bytes),
            bodies::bounded,
        ))
        .layer(axum::middleware::from_fn_with_state(
            deadline::Deadline {
                timeout: http.request_timeout,
                winding_down,
            },
            deadline::deadline,
        ))
        .layer(axum::middleware::map_response(errors::json_errors))
        .with_state(Arc::new(state))
}

async fn plugins(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({ "plugins": state.registry.status() })).into_response()
}

/// A summary of what the host is doing, for `obx status` and dashboards.
async fn status(State(state): State<Arc<AppState>>) -> Response {
    let db = async {
        let outbox = crate::outbox::backlog(&state.admin_pool).await?;
        let per_plugin = crate::inbox::counts(&state.admin_pool).await?;
        let timers = crate::timers::counts(&state.admin_pool).await?;
        Ok::<_, sqlx::Error>((outbox, per_plugin, timers))
    };
    let Ok(Ok((outbox, per_plugin, timers))) = tokio::time::timeout(Duration::from_secs(5), db).await else {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_unavailable",
            "Postgres does not answer",
        );
    };
    let lag = state.lag.per_plugin();
    let consumption: Vec<_> = per_plugin
        .into_iter()
        .map(|c| {
            json!({
                "plugin": c.plugin,
                "lag": lag.get(&c.plugin),
                "inbox_backlog": c.inbox_backlog,
                "dead_letters": c.dead_letters,
                "quarantined": c.quarantined,
            })
        })
        .collect();
    Json(json!({
        "ready": state.ready.load(Ordering::SeqCst),
        "plugins": state.registry.status(),
        "outbox": outbox,
        "consumption": consumption,
        "timers": timers,
    }))
    .into_response()
}

/// Liveness: the process is up and serving HTTP.
async fn healthz() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

/// Readiness: plugins are loaded, shutdown has not begun, and Postgres answers (as of at
/// most a second ago).
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if !state.ready.load(Ordering::SeqCst) {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "the host is starting or stopping",
        );
    }
    match state.readiness.database_answers(&state.pool).await {
        true => Json(json!({ "status": "ready" })).into_response(),
        false => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_unavailable",
            "Postgres does not answer",
        ),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

async fn not_found() -> Response {
    error_response(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
}
