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
        // Root may change any directory's mode: the owner is checked first.
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
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("restricting the compile cache {}", dir.display()))?;
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
        let file = match std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring a compile cache entry that cannot be opened");
                return None;
            }
        };
        // What was opened is checked, and what is checked is what is read: the name could
        // change in between.
        let meta = file.metadata().ok()?;
        if !meta.is_file() || meta.uid() != effective_uid() || meta.mode() & 0o022 != 0 {
            tracing::warn!(
                path = %path.display(), uid = meta.uid(), mode = format!("{:o}", meta.mode()),
                "ignoring a compile cache entry that is not a file this host's user alone may write"
            );
            return None;
        }
        // SAFETY: the file is in the host's own cache directory and was written by `store`
        // from a component this host compiled; wasmtime also checks its compatibility.
        match unsafe { deserialize_open(engine, &file) } {
            Ok(component) => {
                // Used now: the last to be evicted (its owner may set the time through any
                // descriptor).
                let _ = file.set_modified(SystemTime::now());
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

/// Deserialises the open file `file` itself: through its `/proc/self/fd` name, which opens the
/// same file whatever its path now names, or else from its bytes.
///
/// # Safety
///
/// As [`Component::deserialize_file`]: the file must hold a serialised component.
unsafe fn deserialize_open(engine: &Engine, file: &std::fs::File) -> wasmtime::Result<Component> {
    use std::io::Read as _;
    use std::os::fd::AsRawFd as _;
    let by_descriptor = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    if by_descriptor.exists() {
        // SAFETY: the caller's.
        return unsafe { Component::deserialize_file(engine, &by_descriptor) };
    }
    let mut bytes = Vec::new();
    (&*file).read_to_end(&mut bytes)?;
    // SAFETY: the caller's.
    unsafe { Component::deserialize(engine, bytes) }
}

/// The user this process acts as.
fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Precompiled code runs as the host: an entry another user could have written, or a link
    /// in an entry's place, is not read, and (for a host run as root) neither is a directory
    /// another user owns, whose mode stays as it was.
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
        let entry = cache.path(&sha256);
        let long_ago = SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::open(&entry).unwrap().set_modified(long_ago).unwrap();
        assert!(cache.load(&engine, &sha256).is_some());
        let used = std::fs::metadata(&entry).unwrap().modified().unwrap();
        assert!(used > long_ago + Duration::from_secs(60), "a load marks the entry used");
        std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o622)).unwrap();
        assert!(
            cache.load(&engine, &sha256).is_none(),
            "a group- and world-writable entry"
        );
        std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(cache.load(&engine, &sha256).is_some());
        // A link in the entry's place is not followed, even to a good entry.
        let real = dir.path().join("elsewhere.cwasm");
        std::fs::rename(&entry, &real).unwrap();
        std::os::unix::fs::symlink(&real, &entry).unwrap();
        assert!(cache.load(&engine, &sha256).is_none(), "a symbolic link");
        std::fs::remove_file(&entry).unwrap();
        std::fs::rename(&real, &entry).unwrap();
        assert!(cache.load(&engine, &sha256).is_some());

        if effective_uid() == 0 {
            let nobody = 65534;
            std::os::unix::fs::chown(&entry, Some(nobody), None).unwrap();
            assert!(cache.load(&engine, &sha256).is_none(), "another user's entry");
            std::os::unix::fs::chown(&settings.dir, Some(nobody), None).unwrap();
            std::fs::set_permissions(&settings.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
            let e = CompileCache::open(&settings, &engine)
                .err()
                .expect("another user's directory");
            assert!(e.to_string().contains("belongs to uid 65534"), "{e:#}");
            let mode = std::fs::metadata(&settings.dir).unwrap().mode() & 0o777;
            assert_eq!(mode, 0o755, "the refused directory's mode is not changed");
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
