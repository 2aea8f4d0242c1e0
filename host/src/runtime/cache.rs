//! The compile cache: compiled components, keyed by the SHA-256 of the component file and by
//! the engine's compatibility hash, in a directory the host owns. A restart or a reload of
//! an unchanged file skips compilation.
//!
//! Invariant: only files this host wrote are deserialised. Precompiled code is trusted native
//! code, so the cache lives in its own directory (mode 0700, owned by the host's user), never
//! in the watched plugin directory, and entries are written to a temporary name of their own
//! (hosts that share the directory may have the same pid, in containers) and renamed into
//! place. An entry is read only if it is a regular file of the host's user that no one else
//! may write: a host run as root would otherwise run what another user left in a directory
//! it had made theirs. A temporary file older than [`STALE_TEMP`] is a dead writer's, and
//! goes at the next store.
//!
//! The cache is bounded (`plugins.cache_max_bytes`): an entry's modification time is its last
//! use, and after each store the least recently used entries go until the rest fit. (A
//! Python or JavaScript component compiles to about 35 MB, and componentize-py's output
//! differs from build to build, so every rebuild is a new entry.)

use std::hash::{Hash, Hasher};
use std::io::Write as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use wasmtime::component::Component;
use wasmtime::Engine;

/// How old a temporary file must be to be taken for a dead writer's: a store takes seconds.
const STALE_TEMP: Duration = Duration::from_secs(15 * 60);

/// Where the cache lives and how large it may grow.
#[derive(Debug, Clone)]
pub struct CacheSettings {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

impl CacheSettings {
    /// The cache `plugins` configures, if caching is on.
    pub fn of(plugins: &crate::config::PluginsConfig) -> Option<CacheSettings> {
        plugins.cache_dir().map(|dir| CacheSettings {
            dir,
            max_bytes: plugins.cache_max_bytes,
        })
    }
}

pub struct CompileCache {
    dir: PathBuf,
    engine_key: String,
    max_bytes: u64,
}

impl CompileCache {
    pub fn open(settings: &CacheSettings, engine: &Engine) -> Result<CompileCache> {
        let dir = settings.dir.as_path();
        std::fs::create_dir_all(dir).with_context(|| format!("creating the compile cache {}", dir.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("restricting the compile cache {}", dir.display()))?;
        // Root may change any directory's mode: the owner must be checked too.
        let owner = std::fs::metadata(dir)
            .with_context(|| format!("reading the compile cache {}", dir.display()))?
            .uid();
        let user = effective_uid();
        if owner != user {
            anyhow::bail!(
                "the compile cache {} belongs to uid {owner}, not to this process's uid {user}",
                dir.display()
            );
        }
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        Ok(CompileCache {
            dir: dir.to_path_buf(),
            engine_key: format!("{:016x}", hasher.finish()),
            max_bytes: settings.max_bytes,
        })
    }

    fn path(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{sha256}-{}.cwasm", self.engine_key))
    }

    /// The cached compilation of the component with this hash, if there is a good one.
    pub fn load(&self, engine: &Engine, sha256: &str) -> Option<Component> {
        let path = self.path(sha256);
        let meta = std::fs::symlink_metadata(&path).ok()?;
        if !meta.is_file() || meta.uid() != effective_uid() || meta.mode() & 0o022 != 0 {
            tracing::warn!(
                path = %path.display(), uid = meta.uid(), mode = format!("{:o}", meta.mode()),
                "ignoring a compile cache entry that is not a file this host's user alone may write"
            );
            return None;
        }
        // SAFETY: the file is in the host's own cache directory and was written by `store`
        // from a component this host compiled; wasmtime also checks its compatibility.
        match unsafe { Component::deserialize_file(engine, &path) } {
            Ok(component) => {
                // Used now: the last to be evicted.
                let _ = std::fs::File::options()
                    .write(true)
                    .open(&path)
                    .and_then(|f| f.set_modified(SystemTime::now()));
                Some(component)
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "dropping an unusable compile cache entry");
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Stores a compilation. Failures are logged: the cache is an optimisation.
    pub fn store(&self, sha256: &str, component: &Component) {
        let result = (|| -> Result<()> {
            let bytes = component.serialize().map_err(anyhow::Error::from)?;
            let path = self.path(sha256);
            let unique = uuid::Uuid::new_v4().simple();
            let tmp = path.with_extension(format!("tmp-{}-{unique}", std::process::id()));
            let written = std::fs::File::options()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .and_then(|mut file| file.write_all(&bytes))
                .and_then(|()| std::fs::rename(&tmp, &path));
            if let Err(e) = written {
                let _ = std::fs::remove_file(&tmp);
                return Err(e.into());
            }
            self.evict(&path)
        })();
        if let Err(e) = result {
            tracing::warn!(error = %e, "could not write the compile cache");
        }
    }

    /// Removes the least recently used entries until the cache fits `max_bytes`; `keep`, the
    /// entry just stored, stays even if it alone is larger. Removes dead writers' temporary
    /// files too.
    fn evict(&self, keep: &Path) -> Result<()> {
        let mut entries = Vec::new();
        let stale = SystemTime::now() - STALE_TEMP;
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let path = entry.path();
            let Some(extension) = path.extension().and_then(|e| e.to_str()) else {
                continue;
            };
            let meta = entry.metadata()?;
            if extension == "cwasm" {
                entries.push((meta.modified()?, meta.len(), path));
            } else if extension.starts_with("tmp") && meta.is_file() && meta.modified()? < stale {
                tracing::info!(path = %path.display(), "removing a compile cache writer's leftover");
                let _ = std::fs::remove_file(&path);
            }
        }
        let mut total: u64 = entries.iter().map(|(_, len, _)| len).sum();
        entries.sort();
        for (_, len, path) in entries {
            if total <= self.max_bytes {
                break;
            }
            if path != keep && std::fs::remove_file(&path).is_ok() {
                tracing::info!(path = %path.display(), bytes = len, "compile cache entry evicted");
                total -= len;
            }
        }
        Ok(())
    }
}

/// The user this process acts as.
fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Precompiled code runs as the host: an entry another user could have written is not
    /// read, and (for a host run as root) neither is a directory another user owns.
    #[test]
    fn entries_and_directories_other_users_could_write_are_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let settings = CacheSettings {
            dir: dir.path().join("cache"),
            max_bytes: 1 << 30,
        };
        let engine = Engine::default();
        let cache = CompileCache::open(&settings, &engine).unwrap();
        let component = Component::new(&engine, "(component)").unwrap();
        let sha256 = "ab".repeat(32);
        cache.store(&sha256, &component);
        assert!(cache.load(&engine, &sha256).is_some());
        let entry = cache.path(&sha256);
        std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o622)).unwrap();
        assert!(
            cache.load(&engine, &sha256).is_none(),
            "a group- and world-writable entry"
        );
        std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(cache.load(&engine, &sha256).is_some());

        if effective_uid() == 0 {
            let nobody = 65534;
            std::os::unix::fs::chown(&entry, Some(nobody), None).unwrap();
            assert!(cache.load(&engine, &sha256).is_none(), "another user's entry");
            std::os::unix::fs::chown(&settings.dir, Some(nobody), None).unwrap();
            let e = CompileCache::open(&settings, &engine)
                .err()
                .expect("another user's directory");
            assert!(e.to_string().contains("belongs to uid 65534"), "{e:#}");
        }
    }

    /// Another host with the same pid (in another container) writing the same component
    /// held the temporary name this store used to take, and the store failed (or, with both
    /// writing, could rename a mixed file into place). A writer that died left its temporary
    /// file for good, outside the cache's bound.
    #[test]
    fn a_store_takes_a_temporary_file_of_its_own_and_leftovers_go() {
        let dir = tempfile::tempdir().unwrap();
        let settings = CacheSettings {
            dir: dir.path().to_path_buf(),
            max_bytes: 1 << 30,
        };
        let engine = Engine::default();
        let cache = CompileCache::open(&settings, &engine).unwrap();
        let component = Component::new(&engine, "(component)").unwrap();
        let sha256 = "ab".repeat(32);
        let theirs = cache.path(&sha256).with_extension(format!("tmp{}", std::process::id()));
        std::fs::create_dir(&theirs).unwrap();
        let leftover = dir.path().join(format!("{}-x.tmp-1-dead", "cd".repeat(32)));
        std::fs::write(&leftover, b"half a compilation").unwrap();
        let file = std::fs::File::options().write(true).open(&leftover).unwrap();
        file.set_modified(SystemTime::now() - STALE_TEMP - Duration::from_secs(60))
            .unwrap();
        let live = dir.path().join(format!("{}-x.tmp-2-live", "ef".repeat(32)));
        std::fs::write(&live, b"being written").unwrap();

        cache.store(&sha256, &component);
        assert!(cache.load(&engine, &sha256).is_some(), "stored beside the other writer");
        assert!(!leftover.exists(), "a dead writer's leftover went");
        assert!(live.exists() && theirs.exists(), "a live writer's file stays");
    }

    #[test]
    fn the_least_recently_used_entries_go_when_the_cache_is_full() {
        let dir = tempfile::tempdir().unwrap();
        let settings = CacheSettings {
            dir: dir.path().to_path_buf(),
            max_bytes: 250,
        };
        let cache = CompileCache::open(&settings, &Engine::default()).unwrap();
        let t0 = SystemTime::now() - Duration::from_secs(100);
        let entry = |name: &str, bytes: usize, age: u64| {
            let path = dir.path().join(name);
            std::fs::write(&path, vec![0u8; bytes]).unwrap();
            let file = std::fs::File::options().write(true).open(&path).unwrap();
            file.set_modified(t0 + Duration::from_secs(age)).unwrap();
            path
        };
        let oldest = entry("a.cwasm", 100, 1);
        let used = entry("b.cwasm", 100, 2);
        let newest = entry("c.cwasm", 100, 3);
        let other = entry("notes.txt", 1000, 0);
        cache.evict(&newest).unwrap();
        assert!(!oldest.exists(), "the least recently used entry went");
        assert!(used.exists() && newest.exists(), "the rest fit in 250 bytes");
        assert!(other.exists(), "only cache entries count and go");

        // An entry larger than the whole cache stays once stored; the others make room.
        let huge = entry("d.cwasm", 1000, 4);
        cache.evict(&huge).unwrap();
        assert!(huge.exists() && !used.exists() && !newest.exists());
    }
}
