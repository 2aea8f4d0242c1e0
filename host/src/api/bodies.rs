//! A bound on the request bodies all of a host's connections hold at once
//! (`http.max_body_bytes_in_flight`). `http.max_body_bytes` bounds one body; without this,
//! `http.max_connections` peers each sending one could make the host hold about a gigabyte
//! (twice that while each is checked and copied) for as long as `http.request_timeout`.
//!
//! A request takes its body's declared length from the budget when its head has arrived,
//! before any of its body is read (or `http.max_body_bytes` if it declares none: a chunked
//! body), and gives it back with its answer. A request the budget cannot take is answered
//! 503 `busy` with `Retry-After`, and its connection closed, once its body has been read and
//! dropped a frame at a time (never held): a connection closed with bytes unread is reset,
//! and the client's kernel may throw the answer away. The read stops after [`DRAIN_WITHIN`]
//! or one body's bound. A request that waits for `100 Continue` has sent no body, and is
//! answered at once: reading its body would invite the upload.
//!
//! The charge is what a request declares, not what it has sent: a caller allowed to send
//! commands can hold the budget with heads whose bodies never come, for
//! `http.request_timeout`, as it can hold `http.max_connections` connections.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;
use tokio::sync::Semaphore;

use super::errors::error_response;

/// The budget is counted in KiB, as a semaphore's permits.
const UNIT: usize = 1024;
/// The longest a refused request's body is read (and dropped) before its answer.
const DRAIN_WITHIN: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct Budget {
    kib: Arc<Semaphore>,
    /// The most one body may take: `http.max_body_bytes`.
    one_body_bytes: usize,
}

/// `bytes` in whole KiB, rounded up.
fn kib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(UNIT as u64)).unwrap_or(u32::MAX)
}

impl Budget {
    pub fn new(in_flight_bytes: usize, max_body_bytes: usize) -> Budget {
        Budget {
            kib: Arc::new(Semaphore::new(kib(in_flight_bytes as u64) as usize)),
            one_body_bytes: max_body_bytes,
        }
    }

    /// What a request with these headers takes: its declared length, at most one body's
    /// bound; one body's bound if it has a body of no declared length; nothing without one.
    fn cost(&self, headers: &HeaderMap) -> u32 {
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let one_body = kib(self.one_body_bytes as u64);
        match declared {
            Some(bytes) => kib(bytes).min(one_body),
            None if headers.contains_key(header::TRANSFER_ENCODING) => one_body,
            None => 0,
        }
    }
}

pub async fn bounded(State(budget): State<Budget>, request: Request, next: Next) -> Response {
    let cost = budget.cost(request.headers());
    if cost == 0 {
        return next.run(request).await;
    }
    let Ok(taken) = budget.kib.clone().try_acquire_many_owned(cost) else {
        metrics::counter!("obx_http_requests_refused_total", "reason" => "bodies_in_flight").increment(1);
        if !request.headers().contains_key(header::EXPECT) {
            drain(request.into_body(), budget.one_body_bytes).await;
        }
        let mut response = error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            "the host holds as many request bodies as http.max_body_bytes_in_flight allows; send it again",
        );
        let headers = response.headers_mut();
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        // Closed, as a refused peer's connection always was: a drained one could otherwise
        // be kept busy with refusals.
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        return response;
    };
    let response = next.run(request).await;
    drop(taken);
    response
}

/// Reads `body` and drops each frame as it comes, to its end, or [`DRAIN_WITHIN`], or `most`
/// bytes, whichever comes first.
async fn drain(body: Body, most: usize) {
    let mut frames = body.into_data_stream();
    let to_the_end = async {
        let mut read = 0usize;
        while let Some(Ok(frame)) = frames.next().await {
            read += frame.len();
            if read > most {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_WITHIN, to_the_end).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_takes_its_declared_length_at_most_one_bodys_bound() {
        let budget = Budget::new(8 * UNIT, 2 * UNIT);
        let with = |name: header::HeaderName, value: &str| {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_str(value).unwrap());
            h
        };
        assert_eq!(budget.cost(&HeaderMap::new()), 0);
        assert_eq!(budget.cost(&with(header::CONTENT_LENGTH, "0")), 0);
        assert_eq!(budget.cost(&with(header::CONTENT_LENGTH, "1")), 1);
        assert_eq!(budget.cost(&with(header::CONTENT_LENGTH, "1025")), 2);
        assert_eq!(budget.cost(&with(header::CONTENT_LENGTH, "99999999999999")), 2);
        assert_eq!(budget.cost(&with(header::TRANSFER_ENCODING, "chunked")), 2);
    }
}
