//! `http.request_timeout`, with the status that says whose time ran out: 408 when the
//! handling was waiting for more of the request's body (the client was slow, and a retry on a
//! better link may succeed), 503 when the host was still handling it, before any commit. A
//! command or an admin action already committing is given its outcome (see [`deadline`]).
//! The same answers end the requests still running when a stopping host winds its
//! connections down ([`Deadline::winding_down`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::sync::watch;

use super::error_response;

/// The bounds of a request's handling.
#[derive(Clone)]
pub struct Deadline {
    /// `http.request_timeout`.
    pub timeout: Duration,
    /// Turns true when a stopping host winds its connections down: requests still running
    /// end as at their timeout, so that their clients get an answer before the connections
    /// are cut (`api::server`).
    pub winding_down: watch::Receiver<bool>,
}

/// Runs the request within `timeout`, which starts when its head has arrived. A command, or
/// an admin action (a dead letter retried or discarded, a timer cancelled or retried), whose
/// commit was sent by then is waited for one more `timeout` and answered with its outcome:
/// Postgres commits it whatever the host does, and a client told 503 would run a command
/// again, or believe a dead letter still parked. Past that, 504 `outcome_unknown`. A host
/// winding down ends it early, the same way.
pub async fn deadline(State(bounds): State<Deadline>, request: Request, next: Next) -> Response {
    let (timeout, mut winding_down) = (bounds.timeout, bounds.winding_down);
    let awaiting_body = Arc::new(AtomicBool::new(false));
    let request = request.map(|body| {
        Body::new(Watched {
            body,
            awaiting: awaiting_body.clone(),
        })
    });
    let committing = Arc::new(AtomicBool::new(false));
    let run = crate::dispatch::noting_commit(committing.clone(), next.run(request));
    tokio::pin!(run);
    let stopping = tokio::select! {
        response = tokio::time::timeout(timeout, &mut run) => match response {
            Ok(response) => return response,
            Err(_) => false,
        },
        _ = winding_down.wait_for(|w| *w) => true,
    };
    if stopping && !committing.load(Ordering::Acquire) {
        let mut response = error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "host_stopping",
            "the host is stopping: the request was stopped before it finished (a command is rolled back); \
             send it again, to another host",
        );
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return response;
    }
    if awaiting_body.load(Ordering::Acquire) {
        let mut response = error_response(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request's body did not arrive within http.request_timeout",
        );
        // The rest of the body may still come: the connection cannot carry another request.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return response;
    }
    if !committing.load(Ordering::Acquire) {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "timeout",
            "the request took longer than http.request_timeout",
        );
    }
    match tokio::time::timeout(timeout, &mut run).await {
        Ok(response) => response,
        Err(_) => error_response(
            StatusCode::GATEWAY_TIMEOUT,
            "outcome_unknown",
            "the commit did not finish within twice http.request_timeout: it may have taken effect \
             (for a command, a retry with the same Idempotency-Key answers what it came to)",
        ),
    }
}

/// A request body that says whether the request's handling waits for more of it: the last
/// read found nothing there yet. Only then is a request cut off at its deadline the client's
/// doing. Whether the body had all arrived was not the question: a handler that takes no body
/// (a dead letter's retry, whose body the command line sends as `null`) never reads its end,
/// and its own slowness was answered 408, with the blame on the client.
struct Watched {
    body: Body,
    awaiting: Arc<AtomicBool>,
}

impl HttpBody for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        this.awaiting.store(polled.is_pending(), Ordering::Release);
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
