//! The HTTP server: HTTP/1.1 connections, each on a task of its own, with bounds a broken or
//! hostile peer cannot get past.
//!
//! - At most `http.max_connections` connections are open at once. Past that the server stops
//!   accepting (new peers wait in the kernel's queue), so that peers cannot take the file
//!   descriptors the host needs for Postgres, Kafka and plugins.
//! - A connection that has not sent a request's whole head within `http.header_read_timeout`
//!   is closed: a slow sender, or a keep-alive connection idle that long. Slow peers thus
//!   free their places.
//! - A request head (start line and headers) over 64 KiB is refused (431).
//! - A request's body and handling are bounded by the router's own layers
//!   (`http.max_body_bytes`, `http.request_timeout`).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// The largest request head (start line and headers) a connection takes; a larger one is
/// answered 431 and the connection closed. Without it, hyper buffered a head up to about
/// 400 KiB: with `http.max_connections` peers, no token needed, hundreds of MiB.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// What bounds the server's connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
}

/// Serves `router` on `listener` until `stop` turns true; then stops accepting, lets each
/// connection finish the request it is serving, and returns when every one has closed.
pub async fn serve(listener: TcpListener, router: Router, limits: Limits, mut stop: watch::Receiver<bool>) {
    let places = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(MAX_HEAD_BYTES)
        .keep_alive(true);
    // Each connection task holds a clone; when all are gone, every connection has closed.
    let (open_tx, open) = watch::channel(());
    loop {
        let place = tokio::select! {
            place = places.clone().acquire_owned() => place.expect("the semaphore is never closed"),
            _ = stopped(&mut stop) => break,
        };
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
        let _ = stream.set_nodelay(true);
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let mut stop = stop.clone();
        let open = open.clone();
        metrics::gauge!("obx_http_connections").increment(1.0);
        tokio::spawn(async move {
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = stopped(&mut stop) => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
            metrics::gauge!("obx_http_connections").decrement(1.0);
            drop((place, open));
        });
    }
    drop(open);
    drop(listener);
    open_tx.closed().await;
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
