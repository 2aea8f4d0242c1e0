//! The compile cache: compiled components, keyed by the SHA-256 of the component file and by
//! the engine's compatibility hash, in a directory the host owns. A restart or a reload of
//! an unchanged file skips compilation.
//!
//! Invariant: only files this host wrote are deserialised. Precompiled code is trusted native
//! code, so the cache lives in its own directory (mode 0700), never in the watched plugin
//! directory, and entries are written to a temporary name and renamed into place.

use std::hash::{Hash, Hasher};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use wasmtime::component::Component;
use wasmtime::Engine;

pub struct CompileCache {
    dir: PathBuf,
    engine_key: String,
}

impl CompileCache {
    pub fn open(dir: &Path, engine: &Engine) -> Result<CompileCache> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating the compile cache {}", dir.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("restricting the compile cache {}", dir.display()))?;
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        Ok(CompileCache {
            dir: dir.to_path_buf(),
            engine_key: format!("{:016x}", hasher.finish()),
        })
    }

    fn path(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{sha256}-{}.cwasm", self.engine_key))
    }

    /// The cached compilation of the component with this hash, if there is a good one.
    pub fn load(&self, engine: &Engine, sha256: &str) -> Option<Component> {
        let path = self.path(sha256);
        if !path.exists() {
            return None;
        }
        // SAFETY: the file is in the host's own cache directory and was written by `store`
        // from a component this host compiled; wasmtime also checks its compatibility.
        match unsafe { Component::deserialize_file(engine, &path) } {
            Ok(component) => Some(component),
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
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, &path)?;
            Ok(())
        })();
        if let Err(e) = result {
            tracing::warn!(error = %e, "could not write the compile cache");
        }
    }
}

/// `$XDG_CACHE_HOME/obx/components`, or `~/.cache/obx/components`.
pub fn default_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("obx").join("components"))
}
