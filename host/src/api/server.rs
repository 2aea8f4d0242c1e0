//! The HTTP server: HTTP/1.1 connections, each on a task of its own, with bounds a broken or
//! hostile peer cannot get past.
//!
//! - At most `http.max_connections` connections are open at once, so that peers cannot take
//!   the file descriptors the host needs for Postgres, Kafka and plugins. Past that, one more
//!   is accepted and waits while a connection is asked to leave for it (see `places`); the
//!   rest wait in the kernel's queue.
//! - A connection that has not sent a request's whole head within `http.header_read_timeout`
//!   is closed: a slow sender, or a keep-alive connection idle that long. Slow peers thus
//!   free their places.
//! - A connection whose peer takes no byte of an answer for `http.write_timeout` is closed:
//!   a peer that pipelines requests and never reads the answers, or reads too slowly to
//!   free the socket's buffer. Without it such a peer held its place for ever.
//! - A request head (start line and headers) over 64 KiB is refused (431).
//! - A request's body and handling are bounded by the router's own layers
//!   (`http.max_body_bytes`, `http.request_timeout`).
//! - At shutdown, connections finish the requests they are serving for `drain` at most
//!   (half of `http.shutdown_timeout`), so that a slow command or a peer that takes its answer
//!   a few bytes at a time cannot spend the time the consumers and the relay need to stop in
//!   order. At three quarters of it, the requests still running are wound down: each is
//!   answered as at its timeout (503 `host_stopping`, and rolled back; a command whose
//!   `COMMIT` was sent is waited for). At its end, the connections still open are cut: a
//!   command whose `COMMIT` had been sent may then have taken effect, as after a crash, and
//!   its client, which sees the connection closed, learns which by retrying with its
//!   `Idempotency-Key`.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::places::{Holder, Places};

/// The largest request head (start line and headers) a connection takes; a larger one is
/// answered 431 and the connection closed. Without it, hyper buffered a head up to about
/// 400 KiB: with `http.max_connections` peers, no token needed, hundreds of MiB.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// What bounds the server's connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub write_timeout: Duration,
    /// How long connections may take to finish their requests once the server stops.
    pub drain: Duration,
}

/// Serves `router` on `listener` until `stop` turns true; then stops accepting, lets each
/// connection finish the request it is serving for `limits.drain` at most (winding them down,
/// through `wind_down`, at three quarters of it), cuts those still open, and returns when
/// every one has closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
    wind_down: watch::Sender<bool>,
) {
    let places = Places::new(limits.max_connections);
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(MAX_HEAD_BYTES)
        .keep_alive(true);
    // Each connection task holds a clone; when all are gone, every connection has closed.
    let (open_tx, open) = watch::channel(());
    // Set once the drain is over: connections still open are dropped.
    let (cut_tx, cut) = watch::channel(false);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    // Out of descriptors, or a peer gone before it was accepted: wait a
                    // little rather than spin.
                    tracing::warn!(error = %e, "accepting an HTTP connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stopped(&mut stop) => break,
        };
        let place = tokio::select! {
            place = places.take() => place,
            _ = stopped(&mut stop) => break,
        };
        let _ = stream.set_nodelay(true);
        let stream = WriteDeadline::new(stream, limits.write_timeout);
        let connection = http.serve_connection(TokioIo::new(stream), counted(router.clone(), place.holder()));
        let (mut stop, mut cut) = (stop.clone(), cut.clone());
        let open = open.clone();
        metrics::gauge!("obx_http_connections").increment(1.0);
        tokio::spawn(async move {
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = place.asked_to_leave() => {
                    connection.as_mut().graceful_shutdown();
                    tokio::select! {
                        _ = connection.as_mut() => {}
                        _ = stopped(&mut cut) => {}
                    }
                }
                _ = stopped(&mut stop) => {
                    connection.as_mut().graceful_shutdown();
                    tokio::select! {
                        _ = connection.as_mut() => {}
                        _ = stopped(&mut cut) => {}
                    }
                }
            }
            metrics::gauge!("obx_http_connections").decrement(1.0);
            drop((place, open));
        });
    }
    drop(open);
    drop(listener);
    let wind_down_at = limits.drain.mul_f64(0.75);
    if tokio::time::timeout(wind_down_at, open_tx.closed()).await.is_ok() {
        return;
    }
    // The requests still running answer now, as at their timeout.
    let _ = wind_down.send(true);
    if tokio::time::timeout(limits.drain - wind_down_at, open_tx.closed())
        .await
        .is_err()
    {
        tracing::warn!(
            connections = open_tx.receiver_count(),
            drain = ?limits.drain,
            "connections still busy at the end of the shutdown's drain are cut: a command whose \
             COMMIT had not been sent rolls back, one whose COMMIT had been may have taken effect \
             (a retry with its Idempotency-Key answers which)"
        );
        let _ = cut_tx.send(true);
        open_tx.closed().await;
    }
}

/// `router` as a connection's service, each request counted as served by `holder` until
/// its answer is ready.
fn counted(
    router: Router,
    holder: Arc<Holder>,
) -> impl hyper::service::Service<
    hyper::Request<hyper::body::Incoming>,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<axum::response::Response, std::convert::Infallible>> + Send,
> + Clone {
    use hyper::service::Service as _;
    let service = TowerToHyperService::new(router);
    hyper::service::service_fn(move |request| {
        let serving = holder.serving();
        let answer = service.call(request);
        async move {
            let answer = answer.await;
            drop(serving);
            answer
        }
    })
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A connection whose writes fail once one has waited `timeout` for the peer to take a
/// byte; hyper then closes the connection. A write that makes progress starts the clock
/// again. The kernel wakes a blocked writer only once a good part of the socket's buffer
/// is free, so a peer that reads a byte now and then does not keep a write alive.
struct WriteDeadline {
    stream: TcpStream,
    timeout: Duration,
    /// Armed when a write first has to wait; disarmed by any progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteDeadline {
    fn new(stream: TcpStream, timeout: Duration) -> WriteDeadline {
        WriteDeadline {
            stream,
            timeout,
            stalled: None,
        }
    }

    /// What a write that found no room returns: `Pending`, until the deadline passes.
    fn waited<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer took no part of an answer within http.write_timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.waited(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.waited(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_flush(cx);
        this.waited(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_shutdown(cx);
        this.waited(cx, polled)
    }
}
