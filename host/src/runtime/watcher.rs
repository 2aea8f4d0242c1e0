//! Hot loading: watches the plugin directory and loads, reloads and unloads plugins as their
//! files appear, change and disappear, with no restart.
//!
//! A file is acted on only after it has been quiet for `plugins.debounce`, so a copy in
//! progress is not loaded half-written; even so, a file that does not compile, does not fit
//! the world or whose migrations fail leaves the previous version serving (see
//! [`Registry::load_file`]). Hidden files and names that do not end in `.wasm` (editors'
//! temporary files) are ignored. The recommended way to deploy is to write to a temporary
//! name in the same directory and rename it into place: the rename is atomic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use notify::{RecursiveMode, Watcher};
use sqlx::PgPool;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::registry::Registry;
use super::Runtime;

/// A component file name: `*.wasm`, not hidden.
pub fn is_component_name(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|name| !name.starts_with('.') && name.ends_with(".wasm"))
}

/// Starts watching `dir`. The returned task runs until `shutdown`.
pub fn spawn(
    dir: PathBuf,
    debounce: Duration,
    runtime: Arc<Runtime>,
    pool: PgPool,
    registry: Arc<Registry>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>> {
    let (tx, mut rx) = mpsc::unbounded_channel::<PathBuf>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
        Ok(event) => {
            // Reading a file changes nothing. Without this, hosts that share a directory
            // wake each other forever: each load reads the file, and each read is an event.
            use notify::event::{AccessKind, AccessMode, EventKind};
            if matches!(event.kind, EventKind::Access(kind) if kind != AccessKind::Close(AccessMode::Write)) {
                return;
            }
            for path in event.paths {
                let _ = tx.send(path);
            }
        }
        Err(e) => tracing::warn!(error = %e, "plugin directory watch error"),
    })
    .context("starting the plugin directory watcher")?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching {}", dir.display()))?;
    tracing::info!(dir = %dir.display(), "watching the plugin directory");

    Ok(tokio::spawn(async move {
        let _watcher = watcher;
        // Files with recent events, and when they become due.
        let mut pending: HashMap<PathBuf, Instant> = HashMap::new();
        loop {
            let next_due = pending.values().min().copied();
            tokio::select! {
                path = rx.recv() => match path {
                    Some(path) if is_component_name(&path) => {
                        pending.insert(path, Instant::now() + debounce);
                    }
                    Some(_) => {}
                    None => return,
                },
                _ = sleep_until(next_due) => {
                    let now = Instant::now();
                    let due: Vec<PathBuf> = pending.iter().filter(|(_, t)| **t <= now).map(|(p, _)| p.clone()).collect();
                    for path in due {
                        pending.remove(&path);
                        settle(&path, &runtime, &pool, &registry).await;
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }))
}

async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}

/// Brings the registry in line with the file as it is now.
async fn settle(path: &Path, runtime: &Arc<Runtime>, pool: &PgPool, registry: &Registry) {
    if path.is_file() {
        let _ = registry.load_file(runtime, pool, path).await;
    } else {
        registry.unload_file(path);
    }
}
