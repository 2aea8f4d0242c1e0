//! The plugins this host serves, by name, and the state of each plugin file.
//!
//! Invariant: a plugin is active only after it compiled, its manifest passed the checks
//! and its migrations were applied. Lookups take a snapshot (`ArcSwap`), so a call that
//! has started keeps the version it started with, whatever is activated meanwhile.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sha2::Digest;
use sqlx::PgPool;

use super::manifest::Subscription;
use super::plugin_schema;
use super::{loader, Plugin, Runtime};
use crate::db::sessions::Sessions;
use crate::signal::Signal;

pub struct Registry {
    /// Where each active plugin's login is registered.
    sessions: Arc<Sessions>,
    active: ArcSwap<HashMap<String, Arc<Plugin>>>,
    /// What happened to each file, by path.
    files: Mutex<HashMap<PathBuf, FileState>>,
    /// Notified whenever the set of active plugins changes (consumers follow it).
    changed: Signal,
    /// One turn per plugin name: loads of one plugin, from any file, check that no other
    /// file provides it, migrate and activate one after another (the watcher loads files
    /// side by side). An entry stays for each name this host has loaded.
    turns: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

#[derive(Clone, Default)]
struct FileState {
    /// The plugin this file provides, when it is active.
    plugin: Option<String>,
    last_error: Option<String>,
    failed_at: Option<DateTime<Utc>>,
    /// The file as it was when it was last loaded or tried.
    seen: Option<Fingerprint>,
    /// Its last load failed for a reason that may pass (see [`LoadError`]).
    retry: bool,
    /// Its last load was refused because this other file provides the same plugin: it is
    /// loaded again once that file is gone.
    provided_by: Option<PathBuf>,
}

/// Marks the files refused because another file provided their plugin for a retry: one
/// provides a plugin no longer (all are tried: the one that refused a file may since have
/// been renamed). Each is refused again, and waits again, if its plugin is still provided.
fn retry_refused_for_another(files: &mut HashMap<PathBuf, FileState>) {
    for waiting in files.values_mut().filter(|s| s.provided_by.is_some()) {
        (waiting.retry, waiting.provided_by) = (true, None);
    }
}

/// What a file's metadata say of it: when any of it changes, it is loaded again (and its
/// bytes decide whether anything changed). Size and modification time alone miss a
/// replacement that keeps both (`cp -p`, a build that pins timestamps); a file renamed into
/// place has another inode, and a file written in place a new status-change time, which
/// no one can set back.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Fingerprint {
    len: u64,
    modified: Option<std::time::SystemTime>,
    device: u64,
    inode: u64,
    changed: (i64, i64),
}

impl Fingerprint {
    fn of(path: &Path) -> Option<Fingerprint> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path).ok()?;
        Some(Fingerprint {
            len: meta.len(),
            modified: meta.modified().ok(),
            device: meta.dev(),
            inode: meta.ino(),
            changed: (meta.ctime(), meta.ctime_nsec()),
        })
    }
}

/// Why a file was not loaded, and whether loading it again as it is may succeed: the
/// database failed, or was busy with another host's work on the same plugin, or every
/// compile slot was taken.
struct LoadError {
    message: String,
    may_pass: bool,
    /// Refused because this other file provides the same plugin.
    provided_by: Option<(PathBuf, String)>,
}

impl LoadError {
    fn fixed(message: impl Into<String>) -> LoadError {
        LoadError {
            message: message.into(),
            may_pass: false,
            provided_by: None,
        }
    }

    fn may_pass(message: impl Into<String>, may_pass: bool) -> LoadError {
        LoadError {
            may_pass,
            ..LoadError::fixed(message)
        }
    }
}

/// One line of `GET /v1/plugins`.
#[derive(Debug, Clone, Serialize)]
pub struct PluginStatus {
    pub file: String,
    pub name: Option<String>,
    pub version: Option<String>,
    pub sha256: Option<String>,
    /// `active` or `failed`.
    pub state: &'static str,
    pub loaded_at: Option<DateTime<Utc>>,
    pub commands: Vec<String>,
    pub subscriptions: Vec<Subscription>,
    pub last_error: Option<String>,
    pub failed_at: Option<DateTime<Utc>>,
}

impl Registry {
    pub fn new(sessions: Arc<Sessions>) -> Registry {
        Registry {
            sessions,
            active: Default::default(),
            files: Default::default(),
            changed: Default::default(),
            turns: Default::default(),
        }
    }

    /// Waits for plugin `name`'s turn to be loaded.
    async fn turn(&self, name: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let turn = {
            let mut turns = self.turns.lock().unwrap_or_else(|e| e.into_inner());
            turns.entry(name.to_string()).or_default().clone()
        };
        turn.lock_owned().await
    }

    /// The active version of plugin `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Plugin>> {
        self.active.load().get(name).cloned()
    }

    /// Every active plugin.
    pub fn plugins(&self) -> Vec<Arc<Plugin>> {
        self.active.load().values().cloned().collect()
    }

    /// The files the registry knows of, loaded or failed.
    pub fn files(&self) -> Vec<PathBuf> {
        self.lock_files().keys().cloned().collect()
    }

    /// Whether `path` should be loaded again: the registry does not know it, it changed since
    /// it was last loaded or tried, or that try failed for a reason that may pass.
    pub fn needs_load(&self, path: &Path) -> bool {
        // The file system first: no `stat` while the file map is locked.
        let now = Fingerprint::of(path);
        match self.lock_files().get(path) {
            None => true,
            Some(state) => state.retry || state.seen != now,
        }
    }

    fn lock_files(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, FileState>> {
        self.files.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A wake-up for every change of the active plugins.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Forgets a file that is gone, and unloads the plugin it provided. Calls in flight keep
    /// the version they started with.
    pub fn unload_file(&self, path: &Path) -> Option<String> {
        // The file map stays locked until the active map has changed too: a load of the
        // same plugin from another file (a rename) activates before or after, not between.
        let mut files = self.lock_files();
        let removed = files.remove(path)?;
        retry_refused_for_another(&mut files);
        let name = removed.plugin?;
        self.active.rcu(|active| {
            let mut next = HashMap::clone(active);
            next.remove(&name);
            next
        });
        drop(files);
        tracing::info!(file = %path.display(), plugin = %name, "plugin unloaded");
        metrics::counter!("obx_plugin_unloads_total", "plugin" => name.clone()).increment(1);
        self.changed.notify();
        Some(name)
    }

    /// Loads one component file: compile, validate, migrate, activate. On failure the
    /// previous version (if any) keeps serving and the error is recorded for the file.
    /// Files load side by side; one file's loads must not overlap (the watcher's are one at a
    /// time per file), and loads of one plugin from different files take turns from the
    /// compiled component on.
    pub async fn load_file(
        &self,
        runtime: &Arc<Runtime>,
        pool: &PgPool,
        path: &Path,
        slot_wait: std::time::Duration,
    ) -> Result<Arc<Plugin>, String> {
        let started = std::time::Instant::now();
        // Taken before the file is read: a change while it is read is seen by the next rescan.
        let seen = Fingerprint::of(path);
        let result = self.try_load_file(runtime, pool, path, seen, slot_wait).await;
        metrics::histogram!("obx_plugin_load_seconds").record(started.elapsed().as_secs_f64());
        match result {
            Ok(plugin) => {
                tracing::info!(
                    file = %path.display(), plugin = %plugin.manifest.name, version = %plugin.manifest.version,
                    sha256 = %plugin.sha256, "plugin active"
                );
                Ok(plugin)
            }
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e.message, may_pass = e.may_pass, "plugin not loaded");
                metrics::counter!("obx_plugin_load_failures_total").increment(1);
                let mut files = self.lock_files();
                // Refused for a file that has since been unloaded (its unload could not mark
                // this refusal for a retry, as it was not recorded yet): tried again.
                let provider_gone = e.provided_by.as_ref().is_some_and(|(other, name)| {
                    files.get(other).and_then(|s| s.plugin.as_deref()) != Some(name.as_str())
                });
                let state = files.entry(path.to_path_buf()).or_default();
                state.last_error = Some(e.message.clone());
                state.failed_at = Some(Utc::now());
                state.seen = seen;
                state.retry = e.may_pass || provider_gone;
                state.provided_by = e.provided_by.filter(|_| !provider_gone).map(|(other, _)| other);
                Err(e.message)
            }
        }
    }

    async fn try_load_file(
        &self,
        runtime: &Arc<Runtime>,
        pool: &PgPool,
        path: &Path,
        seen: Option<Fingerprint>,
        slot_wait: std::time::Duration,
    ) -> Result<Arc<Plugin>, LoadError> {
        // A read that failed for the file system (out of descriptors) is tried again at the
        // next rescan; it left the plugin unloaded until its file changed.
        let bytes = loader::read_component(path, runtime.limits().max_component_bytes)
            .await
            .map_err(|e| LoadError::may_pass(e.message, e.may_pass))?;
        // The same bytes as the version this file already serves: nothing to do.
        if let Some(current) = self.active_from(path) {
            if current.sha256 == hex::encode(sha2::Sha256::digest(&bytes)) {
                if let Some(state) = self.lock_files().get_mut(path) {
                    state.seen = seen;
                    (state.retry, state.last_error, state.failed_at) = (false, None, None);
                }
                return Ok(current);
            }
        }
        let plugin = loader::load(runtime, bytes, slot_wait)
            .await
            .map_err(|e| LoadError::may_pass(e.to_string(), e.may_pass()))?;
        let name = plugin.manifest.name.clone();
        let _turn = self.turn(&name).await;
        // Another file provides this plugin: refuse, unless that file is gone (a rename).
        if let Some(other) = self
            .file_providing(&name)
            .filter(|other| other != path && other.exists())
        {
            return Err(LoadError {
                provided_by: Some((other.clone(), name.clone())),
                ..LoadError::fixed(format!("plugin {name:?} is already provided by {}", other.display()))
            });
        }
        plugin_schema::prepare(pool, &self.sessions, &plugin.manifest, runtime.limits())
            .await
            .map_err(|e| LoadError::may_pass(e.to_string(), e.may_pass))?;
        let plugin = Arc::new(plugin);
        self.activate(path, plugin.clone(), seen);
        Ok(plugin)
    }

    /// The active plugin this file provides, if any.
    fn active_from(&self, path: &Path) -> Option<Arc<Plugin>> {
        let name = self.lock_files().get(path)?.plugin.clone()?;
        self.get(&name)
    }

    fn file_providing(&self, name: &str) -> Option<PathBuf> {
        self.lock_files()
            .iter()
            .find(|(_, s)| s.plugin.as_deref() == Some(name))
            .map(|(p, _)| p.clone())
    }

    fn activate(&self, path: &Path, plugin: Arc<Plugin>, seen: Option<Fingerprint>) {
        let name = plugin.manifest.name.clone();
        let mut files = self.lock_files();
        // A file renamed away still names this plugin: it no longer does.
        files.retain(|p, s| p == path || s.plugin.as_deref() != Some(name.as_str()));
        let previous = files.insert(
            path.to_path_buf(),
            FileState {
                plugin: Some(name.clone()),
                seen,
                ..FileState::default()
            },
        );
        if previous
            .as_ref()
            .and_then(|p| p.plugin.as_deref())
            .is_some_and(|old| old != name)
        {
            // The file no longer provides its old plugin.
            retry_refused_for_another(&mut files);
        }
        self.active.rcu(|active| {
            let mut next = HashMap::clone(active);
            // The file may have switched to a different plugin name.
            if let Some(old) = previous
                .as_ref()
                .and_then(|p| p.plugin.as_ref())
                .filter(|old| **old != name)
            {
                next.remove(old);
            }
            next.insert(name.clone(), plugin.clone());
            next
        });
        drop(files);
        metrics::counter!("obx_plugin_loads_total", "plugin" => name).increment(1);
        self.changed.notify();
    }

    /// Every plugin file and its state.
    pub fn status(&self) -> Vec<PluginStatus> {
        let files = self.lock_files().clone();
        let active = self.active.load();
        let mut out: Vec<PluginStatus> = files
            .into_iter()
            .map(|(path, state)| {
                let plugin = state.plugin.as_ref().and_then(|n| active.get(n));
                PluginStatus {
                    file: path.display().to_string(),
                    name: plugin.map(|p| p.manifest.name.clone()),
                    version: plugin.map(|p| p.manifest.version.clone()),
                    sha256: plugin.map(|p| p.sha256.clone()),
                    state: if plugin.is_some() { "active" } else { "failed" },
                    loaded_at: plugin.map(|p| p.loaded_at),
                    commands: plugin.map(|p| p.manifest.commands.clone()).unwrap_or_default(),
                    subscriptions: plugin.map(|p| p.manifest.subscriptions.clone()).unwrap_or_default(),
                    last_error: state.last_error,
                    failed_at: state.failed_at,
                }
            })
            .collect();
        out.sort_by(|a, b| a.file.cmp(&b.file));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Fingerprint;

    /// A file replaced by another of the same size and modification time (here renamed into
    /// place, as a deploy does, with its time copied) is seen as changed. Before, a rescan
    /// took it for the file it had loaded.
    #[test]
    fn a_replacement_with_the_same_size_and_time_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plugin.wasm");
        std::fs::write(&path, b"version 1").unwrap();
        let time = std::fs::metadata(&path).unwrap().modified().unwrap();
        let before = Fingerprint::of(&path).unwrap();
        let next = dir.path().join(".plugin.wasm.tmp");
        std::fs::write(&next, b"version 2").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&next)
            .unwrap()
            .set_modified(time)
            .unwrap();
        std::fs::rename(&next, &path).unwrap();
        let after = Fingerprint::of(&path).unwrap();
        assert_eq!((after.len, after.modified), (before.len, before.modified));
        assert_ne!(after, before);
        assert_eq!(Fingerprint::of(&path), Some(after), "stable while the file stays");
    }
}
