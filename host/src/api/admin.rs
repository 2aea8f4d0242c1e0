//! The admin endpoints that `obx dlq` and `obx outbox replay` use against a running host, so
//! that an operator needs the host's address and an admin token, not its database URL (the
//! embedded default has none to give) nor its brokers (the embedded mock cluster lives in the
//! host's process).
//!
//! * `GET /v1/dlq?plugin=&all=` — dead letters, newest first;
//! * `POST /v1/dlq/{id}/retry`, `POST /v1/dlq/{id}/discard`;
//! * `POST /v1/dlq/discard?plugin=&through=` — a thousand of the plugin's parked events
//!   discarded at a time: `{"discarded": n, "through": id, "more": bool}`;
//! * `GET /v1/quarantine?plugin=` — quarantined messages;
//! * `POST /v1/outbox/replay` with a [`ReplayFilter`] as JSON: `{"replayed": n}`;
//! * `GET /v1/catalog?format=json|asyncapi` — the event catalogue of the loaded plugins;
//! * `GET /v1/timers?plugin=&parked=` — durable timers, earliest due first;
//! * `POST /v1/timers/cancel`, `POST /v1/timers/retry` with `{"plugin", "name", "key"}`.
//!
//! The three lists answer in pages (`crate::paging`): `limit=` rows at most (1 to 1,000, and
//! 1,000 if not given), and when there are more, a `Link` header with the next page's
//! address (`rel="next"`, its cursor as `after=`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::{error_response, AppState};
use crate::inbox::dlq::{self, DlqError};
use crate::outbox::replay::ReplayFilter;
use crate::paging::{ListError, Page, PageRequest};
use crate::timers::TimerId;

#[derive(Deserialize)]
pub struct DlqQuery {
    plugin: Option<String>,
    #[serde(default)]
    all: bool,
    after: Option<String>,
    limit: Option<i64>,
}

impl DlqQuery {
    fn page(&self) -> PageRequest {
        PageRequest {
            after: self.after.clone(),
            limit: self.limit,
        }
    }

    /// The query of the next page, but its cursor.
    fn pairs(&self) -> Vec<(&'static str, String)> {
        next_pairs(("all", self.all), &self.plugin, self.limit)
    }
}

pub async fn dlq_list(State(state): State<Arc<AppState>>, Query(q): Query<DlqQuery>) -> Response {
    match dlq::list(&state.admin_pool, q.plugin.as_deref(), q.all, &q.page()).await {
        Ok(page) => page_response("/v1/dlq", q.pairs(), page),
        Err(e) => list_error(e),
    }
}

pub async fn dlq_retry(State(state): State<Arc<AppState>>, Path(id): Path<i64>) -> Response {
    resolved(id, "retried", dlq::retry(&state.admin_pool, id).await)
}

pub async fn dlq_discard(State(state): State<Arc<AppState>>, Path(id): Path<i64>) -> Response {
    resolved(id, "discarded", dlq::discard(&state.admin_pool, id).await)
}

#[derive(Deserialize)]
pub struct DiscardQuery {
    plugin: Option<String>,
    through: Option<i64>,
}

/// `POST /v1/dlq/discard?plugin=P[&through=ID]`: up to [`dlq::DISCARD_BATCH`] of the plugin's
/// parked dead letters discarded, oldest first, in one transaction: `{discarded, through,
/// more}`; with `more`, the caller asks again with the `through` it was given.
pub async fn dlq_discard_parked(State(state): State<Arc<AppState>>, Query(q): Query<DiscardQuery>) -> Response {
    let Some(plugin) = q.plugin.filter(|p| !p.is_empty()) else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "name the plugin whose parked events to discard: ?plugin=",
        );
    };
    match dlq::discard_parked(&state.admin_pool, &plugin, q.through).await {
        Ok(done) => Json(done).into_response(),
        Err(e) => dlq_error(e),
    }
}

fn resolved(id: i64, status: &str, result: Result<(), DlqError>) -> Response {
    match result {
        Ok(()) => Json(json!({ "id": id, "status": status })).into_response(),
        Err(e) => dlq_error(e),
    }
}

fn dlq_error(e: DlqError) -> Response {
    match e {
        DlqError::NotParked(_) => error_response(StatusCode::NOT_FOUND, "not_parked", &e.to_string()),
        DlqError::UnknownPlugin(_) => error_response(StatusCode::NOT_FOUND, "unknown_plugin", &e.to_string()),
        DlqError::Database(e) => database_error(e.into()),
    }
}

#[derive(Deserialize)]
pub struct TimersQuery {
    plugin: Option<String>,
    #[serde(default)]
    parked: bool,
    after: Option<String>,
    limit: Option<i64>,
}

pub async fn timers_list(State(state): State<Arc<AppState>>, Query(q): Query<TimersQuery>) -> Response {
    let page = PageRequest {
        after: q.after,
        limit: q.limit,
    };
    match crate::timers::list(&state.admin_pool, q.plugin.as_deref(), q.parked, &page).await {
        Ok(rows) => page_response("/v1/timers", next_pairs(("parked", q.parked), &q.plugin, q.limit), rows),
        Err(e) => list_error(e),
    }
}

pub async fn timers_cancel(State(state): State<Arc<AppState>>, Json(id): Json<TimerId>) -> Response {
    match crate::timers::cancel(&state.admin_pool, &id).await {
        Ok(true) => Json(json!({ "cancelled": id })).into_response(),
        Ok(false) => error_response(StatusCode::NOT_FOUND, "no_timer", "no such timer"),
        Err(e) => database_error(e.into()),
    }
}

pub async fn timers_retry(State(state): State<Arc<AppState>>, Json(id): Json<TimerId>) -> Response {
    match crate::timers::retry(&state.admin_pool, &id).await {
        Ok(true) => Json(json!({ "retried": id })).into_response(),
        Ok(false) => error_response(StatusCode::NOT_FOUND, "not_parked", "no such parked timer"),
        Err(e) => database_error(e.into()),
    }
}

pub async fn quarantine(State(state): State<Arc<AppState>>, Query(q): Query<DlqQuery>) -> Response {
    match dlq::quarantined(&state.admin_pool, q.plugin.as_deref(), &q.page()).await {
        Ok(page) => page_response("/v1/quarantine", q.pairs(), page),
        Err(e) => list_error(e),
    }
}

/// The query of a list's next page, but its cursor: its flag (`all`, `parked`), plugin and
/// limit, as the caller gave them.
fn next_pairs(
    (flag, on): (&'static str, bool),
    plugin: &Option<String>,
    limit: Option<i64>,
) -> Vec<(&'static str, String)> {
    let mut pairs = vec![(flag, on.to_string())];
    pairs.extend(plugin.clone().map(|p| ("plugin", p)));
    pairs.extend(limit.map(|n| ("limit", n.to_string())));
    pairs
}

/// A page of a listing: its rows as the body, a JSON array as before listings had pages, and,
/// when there are more, the next page's address in a `Link` header (`rel="next"`): `path`
/// with `pairs` and the page's cursor as `after`.
fn page_response<T: serde::Serialize>(path: &str, mut pairs: Vec<(&str, String)>, page: Page<T>) -> Response {
    let mut response = Json(page.rows).into_response();
    if let Some(next) = page.next {
        pairs.push(("after", next));
        let query = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(pairs)
            .finish();
        let link = HeaderValue::from_str(&format!("<{path}?{query}>; rel=\"next\""))
            .expect("an encoded query is a header value");
        response.headers_mut().insert(header::LINK, link);
    }
    response
}

fn list_error(e: ListError) -> Response {
    match e {
        ListError::Page(e) => error_response(StatusCode::BAD_REQUEST, "bad_request", &e.to_string()),
        ListError::Database(e) => database_error(e.into()),
    }
}

/// `?parts=true`: the caller takes a replay in parts.
#[derive(Deserialize)]
pub struct ReplayQuery {
    #[serde(default)]
    parts: bool,
}

/// Publishes the stored events the filter selects again, through a producer of its own (the
/// relay's is not shared: a replay must not hold up new events, nor they it). With
/// `?parts=true`, a long replay stops at the first page's end past `replay_part` and answers
/// `done: false` with the `next_from_id` the same filter goes on from (`obx outbox replay`
/// does so by itself). Without it, as callers of the previous version expect, it answers
/// only when done, and a long one meets `http.request_timeout`.
pub async fn outbox_replay(
    State(state): State<Arc<AppState>>,
    Query(q): Query<ReplayQuery>,
    Json(filter): Json<ReplayFilter>,
) -> Response {
    if filter.is_empty() {
        return error_response(StatusCode::BAD_REQUEST, "bad_request", crate::outbox::replay::NO_FILTER);
    }
    let producer = match crate::outbox::relay::producer(
        &state.brokers,
        &state.kafka,
        &state.relay,
        Some(Duration::from_secs(30)),
    ) {
        Ok(p) => OffWorkers(Some(p)),
        Err(e) => {
            tracing::warn!(error = format!("{e:#}"), "no producer for an outbox replay");
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "kafka_unavailable",
                "the host could not make a Kafka producer; see its log",
            );
        }
    };
    let until = q.parts.then(|| std::time::Instant::now() + state.replay_part);
    let result = crate::outbox::replay::replay_until(
        &state.admin_pool,
        producer.0.as_ref().expect("made above"),
        &state.kafka,
        &filter,
        state.relay.batch_max_bytes,
        until,
    )
    .await;
    drop(producer);
    match result {
        Ok(part) => Json(json!({
            "replayed": part.sent,
            "refused": part.refused,
            "done": part.next_from_id.is_none(),
            "next_from_id": part.next_from_id,
        }))
        .into_response(),
        Err(e) => {
            if let Some(refused) = refused_input(&e) {
                return refused;
            }
            // Database and broker text goes to the log, not to the client.
            tracing::warn!(error = format!("{e:#}"), "outbox replay failed");
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "replay_failed",
                "the replay did not finish (events already sent stay sent); see the host's log",
            )
        }
    }
}

/// A replay's producer, dropped off the async workers (dropping one waits for its threads),
/// also when the request is dropped: at its timeout, or when a stopping host winds it down.
struct OffWorkers(Option<rdkafka::producer::FutureProducer>);

impl Drop for OffWorkers {
    fn drop(&mut self) {
        if let Some(producer) = self.0.take() {
            tokio::task::spawn_blocking(move || drop(producer));
        }
    }
}

fn database_error(e: anyhow::Error) -> Response {
    if let Some(refused) = refused_input(&e) {
        return refused;
    }
    tracing::warn!(
        error = format!("{e:#}"),
        "an admin request could not reach the database"
    );
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "database_unavailable",
        "Postgres does not answer",
    )
}

/// 400 `bad_request` if Postgres refused a value of the request (`db::refused_value`: a data
/// exception, such as a NUL in a plugin's name): the caller's input, not an outage to alert
/// on. The admin queries bind the request's values and read stored columns as they are, so
/// such a refusal comes only from the request.
fn refused_input(e: &anyhow::Error) -> Option<Response> {
    let refused = e
        .chain()
        .filter_map(|c| c.downcast_ref::<sqlx::Error>())
        .find(|e| crate::db::refused_value(e))?;
    let code = refused.as_database_error().and_then(|d| d.code()).unwrap_or_default();
    tracing::debug!(
        error = format!("{e:#}"),
        "an admin request's value was refused by Postgres"
    );
    Some(error_response(
        StatusCode::BAD_REQUEST,
        "bad_request",
        &format!("Postgres cannot take a value of the request (SQLSTATE {code}): a NUL character, say"),
    ))
}

#[derive(Deserialize)]
pub struct CatalogQuery {
    format: Option<String>,
}

pub async fn catalog(State(state): State<Arc<AppState>>, Query(q): Query<CatalogQuery>) -> Response {
    let manifests: Vec<_> = state.registry.plugins().iter().map(|p| p.manifest.clone()).collect();
    let catalog = crate::catalog::build(&state.service, &state.kafka.topic_prefix, &manifests);
    match q.format.as_deref() {
        None | Some("json") => Json(catalog).into_response(),
        Some("asyncapi") => {
            Json(crate::catalog::asyncapi(&catalog, &crate::catalog::version(&manifests))).into_response()
        }
        Some(other) => error_response(
            StatusCode::BAD_REQUEST,
            "bad_request",
            &format!("format {}: use json or asyncapi", crate::text::shown(other)),
        ),
    }
}
