//! A bound on the request bodies all of a host's connections hold at once
//! (`http.max_body_bytes_in_flight`). `http.max_body_bytes` bounds one body; without this,
//! `http.max_connections` peers each sending one could make the host hold about a gigabyte
//! (twice that while each is checked and copied) for as long as `http.request_timeout`.
//!
//! A request is charged for its body as the body arrives, frame by frame, in whole KiB of
//! what it has sent so far (at most one body's bound and a KiB: past that it is refused 413),
//! and gives it all back with its answer: the budget counts what the handlers hold, not
//! hyper's read buffers. A request whose next frame the budget cannot take gives back what it
//! took at once, so that one refusal does not refuse others, and is answered 503 `busy` with
//! `Retry-After`, and its connection closed, once the rest of its body has been read and
//! dropped a frame at a time (never held): a connection closed with bytes unread is reset,
//! and the client's kernel may throw the answer away. The read stops after
//! [`DRAIN_WITHIN`] or one body's bound. A request that waits for `100 Continue` has sent no
//! body: if its declared length does not fit in what is left, it is answered at once, since
//! reading its body would invite the upload.
//!
//! A head charges nothing: the budget was charged each request's declared length when its
//! head arrived, so a caller allowed to send commands could hold all of it with heads whose
//! bodies never came, for `http.request_timeout`, and every other body was refused meanwhile.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, BodyDataStream};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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

    /// What a request with these headers declares it will send: its length, at most one
    /// body's bound; one body's bound if it has a body of no declared length; nothing
    /// without one.
    fn declared(&self, headers: &HeaderMap) -> u32 {
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

/// What one request's body has taken from the budget so far.
#[derive(Default)]
struct Charge {
    bytes: u64,
    taken: Option<OwnedSemaphorePermit>,
    /// A frame did not fit: the request is answered `busy`.
    refused: bool,
    /// The rest of a refused body, read and dropped before the answer.
    rest: Option<BodyDataStream>,
}

impl Charge {
    /// Takes what `more` bytes of body add, in whole KiB, up to one body's bound and a KiB;
    /// false, and what it took given back, if the budget cannot.
    fn take(&mut self, budget: &Budget, more: usize) -> bool {
        let bytes = self.bytes + more as u64;
        let held = self.taken.as_ref().map_or(0, |t| t.num_permits() as u32);
        let most = kib(budget.one_body_bytes as u64).saturating_add(1);
        let wanted = kib(bytes).min(most).saturating_sub(held);
        if wanted > 0 {
            let Ok(permits) = budget.kib.clone().try_acquire_many_owned(wanted) else {
                self.refused = true;
                self.taken = None;
                return false;
            };
            match &mut self.taken {
                Some(taken) => taken.merge(permits),
                None => self.taken = Some(permits),
            }
        }
        self.bytes = bytes;
        true
    }
}

type Shared = Arc<std::sync::Mutex<Charge>>;

fn lock(charge: &Shared) -> std::sync::MutexGuard<'_, Charge> {
    charge.lock().unwrap_or_else(|e| e.into_inner())
}

/// The body was refused a frame by the budget.
#[derive(Debug)]
struct OverBudget;

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the host holds as many request bodies as http.max_body_bytes_in_flight allows")
    }
}

impl std::error::Error for OverBudget {}

pub async fn bounded(State(budget): State<Budget>, request: Request, next: Next) -> Response {
    let declared = budget.declared(request.headers());
    if declared == 0 {
        return next.run(request).await;
    }
    if request.headers().contains_key(header::EXPECT) && (budget.kib.available_permits() as u32) < declared {
        return busy();
    }
    let charge = Shared::default();
    let (parts, body) = request.into_parts();
    let body = charged(body, budget.clone(), charge.clone());
    let response = next.run(Request::from_parts(parts, body)).await;
    // Whatever the handler made of the error its body gave it.
    let rest = {
        let mut charge = lock(&charge);
        if !charge.refused {
            return response;
        }
        charge.rest.take()
    };
    if let Some(rest) = rest {
        drain(rest, budget.one_body_bytes).await;
    }
    busy()
}

/// `body`, each frame charged to `budget` as it comes. A frame the budget cannot take ends
/// the body with an error at once; its rest is kept in `charge`, to be read and dropped
/// after the handler's answer (see [`drain`]).
fn charged(body: Body, budget: Budget, charge: Shared) -> Body {
    let frames = body.into_data_stream();
    let stream = futures::stream::unfold(Some(frames), move |frames| {
        let (budget, charge) = (budget.clone(), charge.clone());
        async move {
            let mut frames = frames?;
            match frames.next().await? {
                Ok(frame) => {
                    let mut charge = lock(&charge);
                    if charge.take(&budget, frame.len()) {
                        return Some((Ok(frame), Some(frames)));
                    }
                    charge.rest = Some(frames);
                    Some((Err(axum::Error::new(OverBudget)), None))
                }
                Err(e) => Some((Err(e), None)),
            }
        }
    });
    Body::from_stream(stream)
}

/// 503 `busy`, and the connection closed.
fn busy() -> Response {
    metrics::counter!("obx_http_requests_refused_total", "reason" => "bodies_in_flight").increment(1);
    let mut response = error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "busy",
        "the host holds as many request bodies as http.max_body_bytes_in_flight allows; send it again",
    );
    let headers = response.headers_mut();
    headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    // Closed, as a refused peer's connection always was: a drained one could otherwise be
    // kept busy with refusals.
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Reads `frames` and drops each as it comes, to their end, or [`DRAIN_WITHIN`], or `most`
/// bytes, whichever comes first.
async fn drain(mut frames: BodyDataStream, most: usize) {
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
    fn a_request_declares_its_length_at_most_one_bodys_bound() {
        let budget = Budget::new(8 * UNIT, 2 * UNIT);
        let with = |name: header::HeaderName, value: &str| {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_str(value).unwrap());
            h
        };
        assert_eq!(budget.declared(&HeaderMap::new()), 0);
        assert_eq!(budget.declared(&with(header::CONTENT_LENGTH, "0")), 0);
        assert_eq!(budget.declared(&with(header::CONTENT_LENGTH, "1")), 1);
        assert_eq!(budget.declared(&with(header::CONTENT_LENGTH, "1025")), 2);
        assert_eq!(budget.declared(&with(header::CONTENT_LENGTH, "99999999999999")), 2);
        assert_eq!(budget.declared(&with(header::TRANSFER_ENCODING, "chunked")), 2);
    }

    #[test]
    fn a_body_is_charged_whole_kib_of_what_it_has_sent() {
        let budget = Budget::new(4 * UNIT, 4 * UNIT);
        let (mut a, mut b) = (Charge::default(), Charge::default());
        assert!(a.take(&budget, 1));
        assert!(a.take(&budget, 1023));
        assert_eq!(budget.kib.available_permits(), 3, "1,024 bytes in two frames: one KiB");
        assert!(a.take(&budget, 1));
        assert!(b.take(&budget, 2 * UNIT));
        assert_eq!(budget.kib.available_permits(), 0);
        assert!(!b.take(&budget, 1), "no room for a fifth KiB");
        assert!(b.refused && !a.refused);
        assert_eq!(
            budget.kib.available_permits(),
            2,
            "a refused body gives back what it took"
        );
        drop(a);
        assert_eq!(budget.kib.available_permits(), 4, "given back whole");
        let budget = Budget::new(8 * UNIT, 4 * UNIT);
        let mut c = Charge::default();
        assert!(c.take(&budget, 3 * UNIT));
        assert!(
            c.take(&budget, 9 * UNIT),
            "past one body's bound: a KiB more (it is refused 413)"
        );
        assert_eq!(budget.kib.available_permits(), 3);
    }
}
