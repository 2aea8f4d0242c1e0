//! The HTTP API (axum): commands, plugin status, health, readiness and metrics.
//!
//! Invariant: every error response is JSON, `{"error": {"code", "message"}}`, with a stable
//! `code`; database text and guest internals never reach a client (they go to the log).

mod commands;
mod errors;

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
use tower_http::timeout::TimeoutLayer;

use crate::config::HttpConfig;
use crate::dispatch::Dispatcher;
use crate::runtime::registry::Registry;

pub use errors::error_response;

#[derive(Clone)]
pub struct AppState {
    pub dispatcher: Arc<Dispatcher>,
    pub registry: Arc<Registry>,
    pub pool: PgPool,
    /// False until plugins are loaded, and again once shutdown begins.
    pub ready: Arc<AtomicBool>,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
}

pub fn router(state: AppState, http: &HttpConfig) -> Router {
    Router::new()
        .route("/v1/commands/{plugin}/{command}", post(commands::run))
        .route("/v1/plugins", get(plugins))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(http.max_body_bytes))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            http.request_timeout,
        ))
        .layer(axum::middleware::map_response(errors::json_errors))
        .with_state(state)
}

async fn plugins(State(state): State<AppState>) -> Response {
    Json(json!({ "plugins": state.registry.status() })).into_response()
}

/// Liveness: the process is up and serving HTTP.
async fn healthz() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

/// Readiness: plugins are loaded, shutdown has not begun, and Postgres answers.
async fn readyz(State(state): State<AppState>) -> Response {
    if !state.ready.load(Ordering::SeqCst) {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "the host is starting or stopping",
        );
    }
    let ping = tokio::time::timeout(Duration::from_secs(2), sqlx::query("SELECT 1").execute(&state.pool)).await;
    match ping {
        Ok(Ok(_)) => Json(json!({ "status": "ready" })).into_response(),
        _ => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_unavailable",
            "Postgres does not answer",
        ),
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

async fn not_found() -> Response {
    error_response(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
}
