//! Hot loading: watches the plugin directory and loads, reloads and unloads plugins as their
//! files appear, change and disappear, with no restart.
//!
//! A file is acted on only after it has been quiet for `plugins.debounce`, so a copy in
//! progress is not loaded half-written; even so, a file that does not compile, does not fit
//! the world or whose migrations fail leaves the previous version serving (see
//! [`Registry::load_file`]). Hidden files and names that do not end in `.wasm` (editors'
//! temporary files) are ignored. The recommended way to deploy is to write to a temporary
//! name in the same directory and rename it into place: the rename is atomic.
//!
//! Events can be lost: the kernel's queue overflows, or the directory is replaced whole
//! (the watch stays on the old one). So every `plugins.rescan_interval`, and at once when
//! notify says events were dropped, the watcher compares the directory with what the
//! registry knows ([`Registry::needs_load`]): a file it has not loaded as it is now, a file
//! whose last load failed for a reason that may pass (the database), and a file that is
//! gone are queued as if an event had named them. The directory is watched anew at each
//! rescan (a directory made again may even get the old one's inode number, so the watcher
//! cannot tell), and the comparison that follows covers the moment between.
//!
//! Files are loaded side by side, [`LOADS_AT_ONCE`] at most and one at a time per file: a
//! load can take minutes (a long migration, or another host's that it waits for, or its
//! plugin's turn), and the other plugins' files do not wait for it. Loads of one plugin from
//! two files take turns in the registry ([`Registry::load_file`]). Compiles still run no more
//! at once than there are compile slots: a load here waits for one up to
//! `limits.compile_timeout`, as it holds up no other file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use sqlx::PgPool;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::registry::Registry;
use super::Runtime;
use crate::config::PluginsConfig;

/// A component file name: `*.wasm`, not hidden.
pub fn is_component_name(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|name| !name.starts_with('.') && name.ends_with(".wasm"))
}

/// The component files of a plugin directory, in name order. Hidden files and editors'
/// temporary files are ignored.
pub fn component_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading the plugin directory {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| is_component_name(p) && p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

/// How many files the watcher loads at once.
pub const LOADS_AT_ONCE: usize = 8;

/// What the watcher hears from notify.
enum Seen {
    /// Something happened to this file.
    File(PathBuf),
    /// Events may have been dropped: compare the whole directory.
    Rescan,
}

/// Starts watching the plugin directory. The returned task runs until `shutdown`.
pub fn spawn(
    config: &PluginsConfig,
    runtime: Arc<Runtime>,
    pool: PgPool,
    registry: Arc<Registry>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>> {
    let (dir, debounce, every) = (config.dir.clone(), config.debounce, config.rescan_interval);
    let (tx, mut rx) = mpsc::unbounded_channel::<Seen>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
        Ok(event) => {
            if event.need_rescan() {
                let _ = tx.send(Seen::Rescan);
            }
            // Reading a file changes nothing. Without this, hosts that share a directory
            // wake each other forever: each load reads the file, and each read is an event.
            use notify::event::{AccessKind, AccessMode, EventKind};
            if matches!(event.kind, EventKind::Access(kind) if kind != AccessKind::Close(AccessMode::Write)) {
                return;
            }
            for path in event.paths {
                let _ = tx.send(Seen::File(path));
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "plugin directory watch error; rescanning the directory");
            let _ = tx.send(Seen::Rescan);
        }
    })
    .context("starting the plugin directory watcher")?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching {}", dir.display()))?;
    tracing::info!(dir = %dir.display(), "watching the plugin directory");

    Ok(tokio::spawn(async move {
        let mut watched = Watched { dir, watcher };
        let mut rescan = tokio::time::interval_at(Instant::now() + every, every);
        rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Files with recent events, and when they become due.
        let mut pending: HashMap<PathBuf, Due> = HashMap::new();
        let mut loads = Loads::new(LOADS_AT_ONCE);
        loop {
            let next_due = loads.next_due(&pending);
            tokio::select! {
                seen = rx.recv() => match seen {
                    Some(Seen::File(path)) if is_component_name(&path) => {
                        pending.insert(path, Due { at: Instant::now() + debounce, recheck: false });
                    }
                    Some(Seen::File(_)) => {}
                    Some(Seen::Rescan) => watched.queue_stale(&registry, &mut pending, debounce),
                    None => return,
                },
                _ = rescan.tick() => {
                    watched.watch_again();
                    watched.queue_stale(&registry, &mut pending, debounce);
                }
                _ = sleep_until(next_due) => {
                    for path in loads.take_due(&mut pending, &registry) {
                        let (runtime, pool, registry) = (runtime.clone(), pool.clone(), registry.clone());
                        loads.start(path.clone(), async move { settle(&path, &runtime, &pool, &registry).await });
                    }
                }
                Some(unloaded) = loads.next_done() => {
                    if unloaded {
                        // A file refused for the plugin this one provided may load now.
                        watched.queue_stale(&registry, &mut pending, debounce);
                    }
                }
                // Loads in progress are cancelled: a load can take minutes (a migration).
                _ = shutdown.changed() => return loads.cancel().await,
            }
        }
    }))
}

/// When a pending file is due, and whether it was queued by a rescan rather than an event:
/// such a file is loaded only if the registry is still behind on it when it is due (its
/// load may have been in progress when it was queued).
#[derive(Clone, Copy)]
struct Due {
    at: Instant,
    recheck: bool,
}

/// The loads in progress, one per file, at most `limit`.
struct Loads {
    limit: usize,
    running: tokio::task::JoinSet<bool>,
    files: HashMap<tokio::task::Id, PathBuf>,
}

impl Loads {
    fn new(limit: usize) -> Loads {
        Loads {
            limit: limit.max(1),
            running: tokio::task::JoinSet::new(),
            files: HashMap::new(),
        }
    }

    fn busy(&self, path: &Path) -> bool {
        self.files.values().any(|p| p == path)
    }

    /// When the next pending file that may start now becomes due; none while the loads
    /// are at their limit.
    fn next_due(&self, pending: &HashMap<PathBuf, Due>) -> Option<Instant> {
        if self.files.len() >= self.limit {
            return None;
        }
        pending.iter().filter(|(p, _)| !self.busy(p)).map(|(_, d)| d.at).min()
    }

    /// The due files that may start now, earliest first, taken out of `pending`: not one
    /// being loaded, and no more than the limit leaves room for. A file a rescan queued
    /// that the registry is no longer behind on is dropped.
    fn take_due(&self, pending: &mut HashMap<PathBuf, Due>, registry: &Registry) -> Vec<PathBuf> {
        let now = Instant::now();
        let mut due: Vec<(Instant, PathBuf)> = pending
            .iter()
            .filter(|(p, d)| d.at <= now && !self.busy(p))
            .map(|(p, d)| (d.at, p.clone()))
            .collect();
        due.sort();
        let mut start = Vec::new();
        for (_, path) in due {
            if start.len() + self.files.len() >= self.limit {
                break;
            }
            let recheck = pending.remove(&path).is_some_and(|d| d.recheck);
            if !recheck || registry.needs_load(&path) {
                start.push(path);
            }
        }
        start
    }

    fn start(&mut self, path: PathBuf, load: impl std::future::Future<Output = bool> + Send + 'static) {
        let id = self.running.spawn(load).id();
        self.files.insert(id, path);
    }

    /// Waits for a load to end, and returns whether it unloaded a plugin. Pending for ever
    /// when none is running.
    async fn next_done(&mut self) -> Option<bool> {
        if self.running.is_empty() {
            return std::future::pending().await;
        }
        let done = self.running.join_next_with_id().await?;
        match done {
            Ok((id, unloaded)) => {
                self.files.remove(&id);
                Some(unloaded)
            }
            Err(e) => {
                // The next rescan finds the file behind, and queues it again.
                let file = self.files.remove(&e.id());
                tracing::error!(file = ?file, error = %e, "a plugin load ended without an answer");
                Some(false)
            }
        }
    }

    /// Cancels the loads in progress, and waits until they have let go of what they hold.
    async fn cancel(mut self) {
        self.running.shutdown().await;
    }
}

/// The watched directory and its watch.
struct Watched {
    dir: PathBuf,
    watcher: RecommendedWatcher,
}

impl Watched {
    /// Watches the directory by its path again: if it was removed and made again, or renamed
    /// over, the old watch hears nothing of the new one.
    fn watch_again(&mut self) {
        let _ = self.watcher.unwatch(&self.dir);
        if let Err(e) = self.watcher.watch(&self.dir, RecursiveMode::NonRecursive) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot watch the plugin directory");
        }
    }

    /// Queues every file the registry is behind on: a component file not loaded as it is
    /// now, or whose last load may succeed if tried again, and a file it knows that is gone.
    /// A file may be queued while its load is in progress (the registry is behind on it until
    /// that load ends), so each is checked again when it is due.
    fn queue_stale(&self, registry: &Registry, pending: &mut HashMap<PathBuf, Due>, debounce: Duration) {
        let files = match component_files(&self.dir) {
            Ok(files) => files,
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "cannot rescan the plugin directory");
                return;
            }
        };
        let due = Due {
            at: Instant::now() + debounce,
            recheck: true,
        };
        let gone = registry.files().into_iter().filter(|known| !files.contains(known));
        for path in files.iter().filter(|f| registry.needs_load(f)).cloned().chain(gone) {
            tracing::debug!(file = %path.display(), "queued by a rescan of the plugin directory");
            pending.entry(path).or_insert(due);
        }
    }
}

async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}

/// Brings the registry in line with the file as it is now. Returns whether it unloaded a
/// plugin.
async fn settle(path: &Path, runtime: &Arc<Runtime>, pool: &PgPool, registry: &Registry) -> bool {
    if path.is_file() {
        let slot_wait = runtime.limits().compile_timeout;
        let _ = registry.load_file(runtime, pool, path, slot_wait).await;
        false
    } else {
        registry.unload_file(path).is_some()
    }
}
