//! `POST /v1/commands/{plugin}/{command}`: the body is the command's JSON payload. An
//! optional `Idempotency-Key` header makes a retry return the stored answer.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{error_response, AppState};
use crate::dispatch::CommandRequest;
use crate::otel::{Kind, Span};
use crate::trace::TraceContext;

/// The longest `Idempotency-Key` accepted.
const MAX_IDEMPOTENCY_KEY: usize = 255;

pub async fn run(
    State(state): State<Arc<AppState>>,
    path: Result<Path<(String, String)>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request_id = uuid::Uuid::now_v7().to_string();
    let caller = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(crate::trace::TraceContext::parse);
    let mut span = Span::export_only("POST /v1/commands/{plugin}/{command}", Kind::Server, caller.as_ref());
    if let Some(span) = span.as_mut().filter(|s| s.recording()) {
        span.set("http.request.method", "POST");
        span.set("http.route", "/v1/commands/{plugin}/{command}");
        if let Ok(Path((plugin, command))) = &path {
            span.set("url.path", format!("/v1/commands/{plugin}/{command}"));
        }
        span.set("obx.request_id", request_id.clone());
    }
    let parent = span.as_ref().map(|s| *s.context()).or(caller);
    let mut response = handle(state, path, headers, body, &request_id, parent).await;
    if let Some(span) = &mut span {
        span.set("http.response.status_code", i64::from(response.status().as_u16()));
        if response.status().is_server_error() {
            span.fail(response.status().to_string());
        }
    }
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", v);
    }
    response
}

async fn handle(
    state: Arc<AppState>,
    path: Result<Path<(String, String)>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    request_id: &str,
    parent_trace: Option<TraceContext>,
) -> Response {
    let Ok(Path((plugin, command))) = path else {
        return error_response(StatusCode::BAD_REQUEST, "bad_request", "malformed path");
    };
    let body = match body {
        Ok(body) => body,
        Err(rejection) => {
            let status = rejection.status();
            let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
                "payload_too_large"
            } else {
                "bad_request"
            };
            return error_response(status, code, &rejection.body_text());
        }
    };
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let json = ct.to_str().is_ok_and(|ct| {
            let essence = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
            essence == "application/json" || essence.ends_with("+json")
        });
        if !json {
            return error_response(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "the body must be application/json",
            );
        }
    }
    // The body's own buffer becomes the payload, not a copy of it.
    let payload = match String::from_utf8(Vec::from(body)) {
        Ok(p) => p,
        Err(_) => return error_response(StatusCode::BAD_REQUEST, "invalid_json", "the body is not UTF-8"),
    };
    if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&payload) {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            &format!("the body is not valid JSON: {e}"),
        );
    }
    // What Postgres could not hold as `jsonb` (a lone surrogate escape, a number past
    // `numeric`'s range, NUL) is refused here, as it would be if the plugin stored it or
    // emitted it.
    if let Some(reason) = crate::jsonb::refusal(&payload) {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            &format!("the body cannot be taken: {reason}"),
        );
    }
    let Ok(idempotency_key) = idempotency_key(&headers) else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
            "Idempotency-Key must be one header of 1-255 visible ASCII characters, no spaces",
        );
    };
    let request = CommandRequest {
        plugin,
        command,
        payload,
        idempotency_key,
        request_id: request_id.to_string(),
        parent_trace,
    };
    let (result, trace) = state.dispatcher.run_command_traced(request).await;
    let mut response = respond(result);
    if let Ok(v) = HeaderValue::from_str(&trace.header()) {
        response.headers_mut().insert("traceparent", v);
    }
    response
}

/// The request's `Idempotency-Key`, if it has one: one header of 1 to
/// [`MAX_IDEMPOTENCY_KEY`] visible ASCII characters. A key with a space or a tab in it, or a
/// request with two keys, is an error: taking one of two keys, or a key that a proxy may
/// fold or trim, could replay another command's answer.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ()> {
    let mut keys = headers.get_all("idempotency-key").iter();
    let (Some(key), None) = (keys.next(), keys.next()) else {
        return if headers.contains_key("idempotency-key") {
            Err(())
        } else {
            Ok(None)
        };
    };
    let key = key.as_bytes();
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY || !key.iter().all(u8::is_ascii_graphic) {
        return Err(());
    }
    Ok(Some(String::from_utf8(key.to_vec()).expect("ASCII")))
}

fn respond(result: Result<crate::dispatch::CommandResponse, crate::dispatch::CommandError>) -> Response {
    match result {
        Ok(answer) => {
            let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::OK);
            let mut response = (status, [(header::CONTENT_TYPE, "application/json")], answer.body).into_response();
            if answer.replayed {
                response
                    .headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
            }
            response
        }
        Err(e) => {
            let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, axum::Json(e.body())).into_response()
        }
    }
}
