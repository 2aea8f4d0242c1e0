//! `http.request_timeout`, with the status that says whose time ran out: 408 when the
//! request's body had not all arrived (the client was slow, and a retry on a better link may
//! succeed), 503 when the host was still handling it.

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

use super::error_response;

/// Runs the request within `timeout`, which starts when its head has arrived.
pub async fn deadline(State(timeout): State<Duration>, request: Request, next: Next) -> Response {
    let received = Arc::new(AtomicBool::new(request.body().is_end_stream()));
    let request = request.map(|body| {
        Body::new(Received {
            body,
            received: received.clone(),
        })
    });
    match tokio::time::timeout(timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) if !received.load(Ordering::Acquire) => {
            let mut response = error_response(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                "the request's body did not arrive within http.request_timeout",
            );
            // The rest of the body may still come: the connection cannot carry another request.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        }
        Err(_) => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "timeout",
            "the request took longer than http.request_timeout",
        ),
    }
}

/// A request body that says when its end has been read.
struct Received {
    body: Body,
    received: Arc<AtomicBool>,
}

impl HttpBody for Received {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || this.body.is_end_stream() {
            this.received.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
