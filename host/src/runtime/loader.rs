//! Turns the bytes of a component file into a [`Plugin`], or says clearly why not.
//!
//! The steps, each with its own error: the size cap; the header (a component, not a core
//! module or something else); compilation, off the async runtime and within a time bound;
//! the world (the component's imports and exports must match `obx:plugin/plugin`); and the
//! manifest, read from the component and checked, including its migrations' SQL.
//!
//! None of this touches the database: `obx plugin check` runs it offline.

use std::sync::Arc;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, InstancePre};

use super::bindings::{guest, timer_guest};
use super::contract::Contracts;
use super::manifest::Manifest;
use super::state::CallState;
use super::{CallError, Exports, Plugin, PluginIdentity, Runtime, Trap};

/// Why a component was not loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("the file is {size} bytes, over the limit of {limit} bytes (limits.max_component_bytes)")]
    TooLarge { size: u64, limit: u64 },
    #[error("not a WebAssembly file: {0}")]
    NotWasm(String),
    #[error(
        "this is a core WebAssembly module, not a component; build the plugin for \
         wasm32-wasip2, or wrap the module with `wasm-tools component new`"
    )]
    CoreModule,
    #[error("the component failed to compile: {0}")]
    Compile(String),
    #[error("compiling took longer than {0:?} (limits.compile_timeout)")]
    CompileTimeout(std::time::Duration),
    #[error(
        "no compile slot freed within {waited:?}: all {slots} (limits.max_concurrent_compiles) are \
         taken, by compiles that ran past limits.compile_timeout and cannot be stopped; a watching \
         host tries the file again at its next rescan"
    )]
    CompilersBusy { waited: std::time::Duration, slots: usize },
    #[error(
        "the instance pool had no room to read the manifest; a watching host tries the file again at its next rescan"
    )]
    PoolFull,
    #[error("the component does not fit the obx:plugin/plugin@0.2 world: {0}")]
    WrongWorld(String),
    #[error("reading the manifest failed: {0}")]
    Manifest(String),
    #[error("the manifest is invalid: {0}")]
    InvalidManifest(String),
}

impl LoadError {
    /// Whether loading the same bytes again may succeed.
    pub fn may_pass(&self) -> bool {
        matches!(self, LoadError::CompilersBusy { .. } | LoadError::PoolFull)
    }
}

/// The longest a load that others wait behind (at start, where files load one after
/// another) waits for a compile slot, so that they are not held up for long by compiles
/// that ran past their time.
pub const SLOT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The compiled component, and whether it came from the compile cache. A cache hit takes no
/// compile slot. A compile takes one (waiting for it at most `slot_wait`, and never longer
/// than `limits.compile_timeout`) and has `limits.compile_timeout` to finish; past it the
/// load fails, the compile runs on to its end on its slot, and its result is not cached, so
/// that the file is refused every time.
async fn compiled(
    runtime: &Arc<Runtime>,
    bytes: Vec<u8>,
    sha256: &str,
    slot_wait: std::time::Duration,
) -> Result<(Component, bool), LoadError> {
    let timeout = runtime.limits().compile_timeout;
    let cached = {
        let (runtime, sha256) = (runtime.clone(), sha256.to_string());
        tokio::task::spawn_blocking(move || runtime.cache.as_ref()?.load(&runtime.engine, &sha256))
    };
    if let Ok(Ok(Some(component))) = tokio::time::timeout(timeout, cached).await {
        metrics::counter!("obx_plugin_compile_cache_hits_total").increment(1);
        return Ok((component, true));
    }
    let wait = timeout.min(slot_wait);
    let Some(slot) = runtime.compile_slot(wait).await else {
        let (waited, slots) = (wait, runtime.compile_slots());
        return Err(LoadError::CompilersBusy { waited, slots });
    };
    let compile = {
        let (runtime, sha256) = (runtime.clone(), sha256.to_string());
        tokio::task::spawn_blocking(move || {
            // Held until the compile ends, past the timeout below if need be.
            let _slot = slot;
            let started = std::time::Instant::now();
            let component = Component::new(&runtime.engine, &bytes)?;
            if let Some(cache) = runtime.cache.as_ref().filter(|_| started.elapsed() <= timeout) {
                cache.store(&sha256, &component);
            }
            Ok::<_, wasmtime::Error>(component)
        })
    };
    match tokio::time::timeout(timeout, compile).await {
        Err(_) => Err(LoadError::CompileTimeout(timeout)),
        Ok(Err(join)) => Err(LoadError::Compile(format!("the compiler crashed: {join}"))),
        Ok(Ok(Err(e))) => Err(LoadError::Compile(format!("{e:#}"))),
        Ok(Ok(Ok(component))) => Ok((component, false)),
    }
}

/// Why a component file could not be read, and whether reading it again may succeed.
pub struct ReadError {
    pub message: String,
    pub may_pass: bool,
}

/// Reads a component file, but never more than `limit` bytes of it: a larger file (an
/// artefact dropped in the directory by mistake, a sparse file of many GiB) is refused as
/// too large without being read whole, which could take the host's memory. What is not a
/// regular file is refused at once: a FIFO put in the file's place (the watcher checks the
/// kind of a file before it reads it, but the name can change in between) held the read,
/// and every load behind it, until something wrote to it.
pub async fn read_component(path: &std::path::Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    use tokio::io::AsyncReadExt;
    // The file system failed (out of descriptors, an I/O error): it may not the next time.
    // Not a file the host may not read: changing its mode changes it, which loads it again.
    let reading = |e: std::io::Error| ReadError {
        message: format!("reading {}: {e}", path.display()),
        may_pass: e.kind() != std::io::ErrorKind::PermissionDenied,
    };
    let too_large = |size| ReadError {
        message: LoadError::TooLarge { size, limit }.to_string(),
        may_pass: false,
    };
    // Not blocking: opening a FIFO for reading waits for a writer. Regular files ignore it.
    let file = tokio::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .await
        .map_err(reading)?;
    let meta = file.metadata().await.map_err(reading)?;
    if !meta.is_file() {
        return Err(ReadError {
            message: format!("{} is not a regular file", path.display()),
            may_pass: false,
        });
    }
    let size = meta.len();
    if size > limit {
        return Err(too_large(size));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    // It may have grown since.
    file.take(limit + 1).read_to_end(&mut bytes).await.map_err(reading)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Loads a component: checks, compiles and validates it, waiting at most `slot_wait` for a
/// compile slot (see [`SLOT_WAIT`]).
pub async fn load(runtime: &Arc<Runtime>, bytes: Vec<u8>, slot_wait: std::time::Duration) -> Result<Plugin, LoadError> {
    let limits = runtime.limits();
    let size = bytes.len() as u64;
    if size > limits.max_component_bytes {
        return Err(LoadError::TooLarge {
            size,
            limit: limits.max_component_bytes,
        });
    }
    check_header(&bytes)?;
    let sha256 = hex::encode(Sha256::digest(&bytes));

    let (component, from_cache) = compiled(runtime, bytes, &sha256, slot_wait).await?;

    let instance_pre = runtime
        .linker
        .instantiate_pre(&component)
        .map_err(|e| LoadError::WrongWorld(format!("{e:#}")))?;
    let exports = find_exports(instance_pre)?;
    let timed = exports.timer_handler.is_some();
    let contract_version = contract_version(&component, &runtime.engine);

    // The manifest call runs under a placeholder identity: it has no transaction, so the
    // identity serves only its log lines.
    let placeholder = Manifest {
        name: "(loading)".into(),
        version: sha256[..12].to_string(),
        commands: vec![],
        subscriptions: vec![],
        emits: vec![],
        migrations: vec![],
        payloads: vec![],
    };
    let read = runtime
        .read_manifest(
            &exports,
            Arc::new(PluginIdentity::new(&placeholder, Default::default(), false)),
        )
        .await
        .map_err(|e| match e {
            CallError::Trapped(Trap::Deadline) => LoadError::Manifest("describe() ran past the call deadline".into()),
            CallError::Trapped(Trap::Memory(m) | Trap::Fault(m)) => LoadError::Manifest(m),
            CallError::Busy => LoadError::PoolFull,
            other => LoadError::Manifest(format!("{other:?}")),
        })?;
    if let Some(e) = read.declaration_error {
        return Err(LoadError::InvalidManifest(format!("contract: {e}")));
    }
    let mut manifest = Manifest::from(read.manifest);
    manifest.payloads = read.payloads;
    manifest
        .validate(runtime.limits().max_statement_bytes)
        .map_err(LoadError::InvalidManifest)?;
    // Off the async runtime: compiling a plugin's schemas and checking its examples is
    // bounded (`runtime::contract`), but can take a while.
    let payloads = manifest.payloads.clone();
    let contracts = tokio::task::spawn_blocking(move || Contracts::compile(&payloads))
        .await
        .map_err(|e| LoadError::InvalidManifest(format!("contract: {e}")))?
        .map_err(LoadError::InvalidManifest)?;

    Ok(Plugin {
        identity: Arc::new(PluginIdentity::new(&manifest, contracts, timed)),
        manifest,
        sha256,
        loaded_at: chrono::Utc::now(),
        from_cache,
        contract_version,
        exports,
    })
}

/// Finds `handler` (required) and `timer-handler` (a `timed-plugin`'s) among the exports.
fn find_exports(pre: InstancePre<CallState>) -> Result<Exports, LoadError> {
    let handler = guest::GuestIndices::new(&pre).map_err(|e| LoadError::WrongWorld(format!("{e:#}")))?;
    let exports_timers = pre.component().get_export_index(None, TIMER_HANDLER).is_some();
    let timer_handler = if exports_timers {
        Some(timer_guest::GuestIndices::new(&pre).map_err(|e| LoadError::WrongWorld(format!("{e:#}")))?)
    } else {
        None
    };
    Ok(Exports {
        pre,
        handler,
        timer_handler,
    })
}

/// The export name of `timer-handler`; any 0.2.x version matches it.
const TIMER_HANDLER: &str = "obx:plugin/timer-handler@0.2.1";

/// The `obx:plugin` version of the component's `handler` export, e.g. "0.2.0".
fn contract_version(component: &Component, engine: &wasmtime::Engine) -> String {
    component
        .component_type()
        .exports(engine)
        .find_map(|(name, _)| name.strip_prefix("obx:plugin/handler@").map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

/// The 8-byte preamble: `\0asm`, then the version and layer. Core modules are version 1,
/// layer 0; components are layer 1.
fn check_header(bytes: &[u8]) -> Result<(), LoadError> {
    if bytes.len() < 8 || &bytes[0..4] != b"\0asm" {
        return Err(LoadError::NotWasm(
            "it does not start with the \\0asm magic bytes".into(),
        ));
    }
    match (bytes[6], bytes[7]) {
        (0, 0) => Err(LoadError::CoreModule),
        (1, 0) => Ok(()),
        (layer_lo, layer_hi) => Err(LoadError::NotWasm(format!(
            "unknown layer {} in the header",
            u16::from_le_bytes([layer_lo, layer_hi])
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO in a component file's place is refused at once, not read until a writer comes.
    #[tokio::test]
    async fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plugin.wasm");
        let c_path = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let read = tokio::time::timeout(std::time::Duration::from_secs(10), read_component(&path, 1 << 20))
            .await
            .expect("the read of a FIFO returned");
        let e = read.expect_err("a FIFO is refused");
        assert!(e.message.contains("is not a regular file"), "{}", e.message);
        assert!(!e.may_pass);
    }

    #[test]
    fn header_tells_modules_from_components() {
        assert!(matches!(check_header(b"hello world"), Err(LoadError::NotWasm(_))));
        assert!(matches!(check_header(b"\0asm\x01\0\0\0"), Err(LoadError::CoreModule)));
        assert!(check_header(b"\0asm\x0d\0\x01\0").is_ok());
        assert!(matches!(check_header(b"\0asm"), Err(LoadError::NotWasm(_))));
    }
}
