//! The Wasm runtime: compiles plugin components and runs their handlers.
//!
//! One wasmtime [`Engine`] per process, with the pooling allocator and epoch interruption.
//! Each plugin version is compiled once into a [`Plugin`] that holds its `InstancePre`.
//! Every call gets a fresh [`Store`] holding a fresh [`CallState`], with a wall-clock
//! deadline and a memory cap, and the Store is dropped when the call ends.
//!
//! Invariants:
//! * A Store is never reused, so a Store that trapped is never reused.
//! * Nothing a guest does makes the host panic: traps, deadline kills and limit breaches
//!   come back as [`CallError`] values.
//! * Plugins never see sqlx types; the host never hands a transaction to a plugin except
//!   through the `sql` import, under the plugin's role.

pub mod bindings;
pub mod cache;
mod call_metrics;
pub mod contract;
mod host;
pub mod loader;
pub mod manifest;
pub mod plugin_schema;
pub mod registry;
mod state;
pub mod watcher;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::sync::Semaphore;
use wasmtime::component::{HasSelf, Instance, InstancePre, Linker};
use wasmtime::{Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, UpdateDeadline};

use self::bindings::{guest, timer_guest, types::HandlerError};
pub use self::manifest::Manifest;
use self::state::{CallState, MemoryLimitExceeded};
use crate::config::Limits;
use crate::db::sessions::PluginTx;
use crate::outbox::NewEvent;
use crate::sql_policy::PolicyError;
use crate::trace::TraceContext;

/// The bytes the host copies out of a guest's memory for one host call, or for the result
/// of one export (wasmtime's "hostcall fuel"): past it the call traps. Each string of a list
/// is copied whole, and a hostile guest's entries can all point at the same bytes, so without
/// a bound 512 strings over one 8 MiB buffer were 4 GiB for the host, and more any amount.
/// Set here, not left to wasmtime's default (the same today), so that it cannot change
/// unseen: `tests/commands.rs parameters_that_all_alias_one_string_trap_within_a_bound`,
/// `tests/hot_reload.rs a_manifest_whose_commands_all_alias_one_string_is_refused_within_a_bound`.
const HOSTCALL_FUEL: usize = 128 * 1024 * 1024;

/// How often the epoch advances; a runaway guest is stopped within one tick of its deadline.
const EPOCH_TICK: Duration = Duration::from_millis(5);

pub struct Runtime {
    engine: Engine,
    linker: Linker<CallState>,
    limits: Arc<Limits>,
    slots: Semaphore,
    /// `limits.max_concurrent_compiles`: compiles that may run at once. Cranelift cannot be
    /// stopped, so a compile that ran past `limits.compile_timeout` runs on, holding its slot
    /// until it ends; without the bound, each new file that compiles for too long added a
    /// thread and its memory.
    compiles: Arc<Semaphore>,
    cache: Option<cache::CompileCache>,
}

/// A compiled, validated plugin version, ready to be instantiated.
pub struct Plugin {
    pub manifest: Manifest,
    /// Hex SHA-256 of the component file.
    pub sha256: String,
    pub loaded_at: chrono::DateTime<chrono::Utc>,
    /// Whether its compiled code came from the compile cache.
    pub from_cache: bool,
    pub(crate) identity: Arc<PluginIdentity>,
    /// The `obx:plugin` version the component was built against, e.g. "0.2.1".
    pub contract_version: String,
    pub(crate) exports: Exports,
}

/// A component ready to instantiate, with its exports found: `handler` always,
/// `timer-handler` for a `timed-plugin`.
pub(crate) struct Exports {
    pub(crate) pre: InstancePre<CallState>,
    pub(crate) handler: guest::GuestIndices,
    pub(crate) timer_handler: Option<timer_guest::GuestIndices>,
}

impl Plugin {
    /// Whether the plugin exports `timer-handler`, and so may schedule timers.
    pub fn timed(&self) -> bool {
        self.exports.timer_handler.is_some()
    }
}

/// What `describe` returned, with the payload schemas it declared on the way.
pub(crate) struct ManifestRead {
    pub manifest: guest::Manifest,
    pub payloads: Vec<manifest::PayloadContract>,
    /// The first declaration that could not be taken.
    pub declaration_error: Option<String>,
}

/// What host imports need to know about the plugin they serve.
pub(crate) struct PluginIdentity {
    pub name: String,
    pub version: String,
    pub schema: String,
    /// Whether the plugin exports `timer-handler` (only then may it schedule timers).
    pub(crate) timed: bool,
    /// The commands the manifest declares.
    commands: Vec<String>,
    /// The event types the manifest declares, by topic.
    emits: HashMap<String, HashSet<String>>,
    /// Statements already checked by the SQL policy, with their verdicts.
    statements: Mutex<VerdictCache>,
    /// The declared payload schemas, compiled.
    pub(crate) contracts: contract::Contracts,
    /// Its metric handles, registered at its first call (so a placeholder identity that
    /// only reads a manifest registers none).
    metrics: std::sync::OnceLock<call_metrics::CallMetrics>,
    /// The log lines it may still write this second, over all its calls.
    pub(crate) log_budget: host::log::LogBudget,
}

/// Verdicts of the SQL policy by statement text, bounded in entries and in bytes: when
/// either bound is reached the cache is cleared (a plugin that sends ever-new statements
/// only pays for parsing them).
#[derive(Default)]
struct VerdictCache {
    verdicts: HashMap<String, Result<String, PolicyError>>,
    bytes: usize,
}

/// How many verdicts a plugin's cache keeps at most.
const STATEMENT_CACHE_ENTRIES: usize = 1024;
/// How many bytes of statement text (checked and printed back) a plugin's cache keeps at most.
const STATEMENT_CACHE_BYTES: usize = 4 * 1024 * 1024;

impl PluginIdentity {
    fn new(manifest: &Manifest, contracts: contract::Contracts, timed: bool) -> PluginIdentity {
        PluginIdentity {
            contracts,
            timed,
            name: manifest.name.clone(),
            version: manifest.version.clone(),
            schema: manifest.schema().to_string(),
            commands: manifest.commands.clone(),
            emits: manifest.emits.iter().fold(HashMap::new(), |mut by_topic, e| {
                by_topic
                    .entry(e.topic.clone())
                    .or_insert_with(HashSet::new)
                    .insert(e.event_type.clone());
                by_topic
            }),
            statements: Mutex::new(VerdictCache::default()),
            metrics: std::sync::OnceLock::new(),
            log_budget: Default::default(),
        }
    }

    /// Whether the manifest declares `event_type` on `topic`.
    pub(crate) fn declares(&self, topic: &str, event_type: &str) -> bool {
        self.emits.get(topic).is_some_and(|types| types.contains(event_type))
    }

    /// The plugin's metric handles.
    pub(crate) fn metrics(&self) -> &call_metrics::CallMetrics {
        self.metrics
            .get_or_init(|| call_metrics::CallMetrics::new(&self.name, &self.commands))
    }

    /// Runs `sql` through the policy, remembering the verdict.
    pub(crate) fn check_statement(&self, sql: &str, limits: &Limits) -> Result<String, PolicyError> {
        if let Some(verdict) = self.lock_cache().verdicts.get(sql) {
            return verdict.clone();
        }
        // Outside the lock: parsing a large statement must not hold up this plugin's other calls.
        let verdict = crate::sql_policy::check_handler_statement(sql, &self.schema, limits.max_statement_bytes);
        let size = sql.len() + verdict.as_ref().map_or(0, String::len);
        let mut cache = self.lock_cache();
        if cache.verdicts.len() >= STATEMENT_CACHE_ENTRIES || cache.bytes + size > STATEMENT_CACHE_BYTES {
            cache.verdicts.clear();
            cache.bytes = 0;
        }
        if size <= STATEMENT_CACHE_BYTES && cache.verdicts.insert(sql.to_string(), verdict.clone()).is_none() {
            cache.bytes += size;
        }
        verdict
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, VerdictCache> {
        self.statements.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes the verdict cache holds (for its test).
    #[cfg(test)]
    fn cached_bytes(&self) -> usize {
        self.lock_cache().bytes
    }
}

/// Why a call did not succeed.
#[derive(Debug)]
pub enum CallError {
    /// The handler returned an error.
    Handler(HandlerError),
    /// The handler returned, but the call cannot commit: a statement failed, or a limit
    /// was reached.
    Aborted(String),
    /// The guest was stopped.
    Trapped(Trap),
    /// The call could not start: no free call slot within the deadline, or no room in the
    /// instance pool.
    Busy,
}

impl CallError {
    /// Whether this error may be a handler's answer to a statement that lost to concurrent
    /// work ([`CallOutput::lost_race`]): it failed, trapped or returned ok after it. Not a
    /// rejection or invalid input, which are the handler's own answer, nor the deadline or
    /// the memory limit, which cost the host a call slot or memory at every try, whatever
    /// came before.
    pub fn may_follow_a_race(&self) -> bool {
        matches!(
            self,
            CallError::Handler(HandlerError::Failed(_)) | CallError::Aborted(_) | CallError::Trapped(Trap::Fault(_))
        )
    }
}

/// How a guest was stopped.
#[derive(Debug)]
pub enum Trap {
    /// It ran past the call deadline.
    Deadline,
    /// It tried to grow its memory past the cap.
    Memory(String),
    /// It trapped (unreachable, stack overflow, out-of-bounds access, ...), or
    /// instantiation failed.
    Fault(String),
}

/// The end of a call: its result, and what the caller must commit or roll back.
pub struct CallOutput<T> {
    pub result: Result<T, CallError>,
    /// The call's transaction, if the call ended with it intact; `None` after a deadline
    /// kill that interrupted a statement (the transaction was dropped, so it rolls back).
    pub tx: Option<PluginTx>,
    /// Events emitted, in order; meaningful only when `result` is `Ok`.
    pub events: Vec<NewEvent>,
    /// The call's first failure was a statement that lost to concurrent work (a lock wait
    /// past `lock_timeout`, a deadlock, a serialization failure): the handler was not at
    /// fault, whatever it made of the error.
    pub lost_race: bool,
}

/// Freed pooled slots are decommitted one at a time (see `pool`). Batches (8, then 32) paid
/// when every call left pages past the kept prefixes; since the prefixes hold all a Rust
/// plugin touches, its slots have nothing left to decommit, and a batch only kept each freed
/// slot out of use until 31 more were freed, so calls went round ever colder slots. One at a
/// time, such a slot is free again at once, with no system call, and the next call takes it
/// warm: `obx-bench calls`, Wasm minus native, 18.5 / 20.4 µs with 32 against 15.6 / 15.3
/// with 1; 327 `process_madvise` and 1,271 page faults in 4,000 calls against none and 414.
/// A plugin that does leave pages there (Python, JavaScript: megabytes of heap) pays one
/// `madvise`, and its TLB flush, per such memory per call.
const DECOMMIT_BATCH: usize = 1;
/// Bytes of each table reset with memset rather than decommitted (8,192 entries): a Rust
/// plugin's table is a few hundred.
const TABLE_KEEP_RESIDENT: usize = 64 * 1024;
/// Bytes at the start of each linear memory reset in place when its Store drops (zeroed, and
/// the data segments copied back from the image) rather than decommitted. A Rust plugin linked
/// with a 64 KiB stack (`-zstack-size=65536`, as `obx plugin new` and the example plugins
/// are) keeps its stack, its data and its first heap within this prefix, so its calls take
/// no page fault there: the orders plugin's calls took six faults each, on four fresh pages,
/// two of them read and then written (a copy-on-write fault with a TLB flush on the other
/// CPU). Host CPU per call (`obx-bench calls`, one caller), Wasm minus native: 29–49 µs
/// before, 15–16 µs after; in the commands suite, 160–202 µs of host CPU per Wasm command
/// before, 134–141 after (docs/benchmarks.md). A plugin with rustc's default 1 MiB stack
/// gains nothing and pays the reset of its stack's unused bottom, which that suite could not
/// tell from its noise. The prefix stays resident in every memory slot that has served a
/// call: at most this much per slot, `(max_concurrent_calls + 32) × 2` slots (72 MiB at the
/// defaults; 192 KiB measured the same and would be 108 MiB).
pub const MEMORY_KEEP_RESIDENT: usize = 128 * 1024;

impl Runtime {
    /// A runtime with these limits, and a compile cache in `cache_dir` if given.
    pub fn new(limits: Limits, cache: Option<cache::CacheSettings>) -> Result<Arc<Runtime>> {
        let mut config = wasmtime::Config::new();
        config
            .wasm_component_model(true)
            .epoch_interruption(true)
            .max_wasm_stack(1024 * 1024)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool(&limits)));
        without_unused_proposals(&mut config);
        let engine = Engine::new(&config)
            .map_err(anyhow::Error::from)
            .context("creating the Wasm engine")?;

        let mut linker = Linker::<CallState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(anyhow::Error::from)
            .context("linking WASI")?;
        bindings::TimedPlugin::add_to_linker::<_, HasSelf<CallState>>(&mut linker, |s| s)
            .map_err(anyhow::Error::from)
            .context("linking the obx imports")?;

        start_epoch_ticker(&engine);
        let cache = match cache {
            Some(settings) => match cache::CompileCache::open(&settings, &engine) {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(error = format!("{e:#}"), "compile cache disabled");
                    None
                }
            },
            None => None,
        };
        Ok(Arc::new(Runtime {
            engine,
            linker,
            compiles: Arc::new(Semaphore::new(limits.max_concurrent_compiles.max(1) as usize)),
            slots: Semaphore::new(limits.max_concurrent_calls as usize),
            limits: Arc::new(limits),
            cache,
        }))
    }

    /// A compile slot, if one frees within `wait`. The compile holds it until it ends.
    pub(crate) async fn compile_slot(&self, wait: Duration) -> Option<tokio::sync::OwnedSemaphorePermit> {
        tokio::time::timeout(wait, self.compiles.clone().acquire_owned())
            .await
            .ok()?
            .ok()
    }

    /// How many compiles may run at once.
    pub fn compile_slots(&self) -> usize {
        self.limits.max_concurrent_compiles.max(1) as usize
    }

    /// How many compiles run now, those past their timeout included.
    pub fn compiles_running(&self) -> usize {
        self.compile_slots() - self.compiles.available_permits()
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Runs `handle-command` in `tx`. The caller commits or rolls back.
    pub async fn handle_command(
        &self,
        plugin: &Plugin,
        tx: PluginTx,
        command: guest::Command,
        trace: Option<TraceContext>,
    ) -> CallOutput<String> {
        let request_id = command.request_id.clone();
        self.call(plugin, Some(tx), request_id, trace, |exports, instance, store| {
            Box::pin(async move {
                let handler = exports.handler.load(&mut *store, &instance)?;
                handler.call_handle_command(store, &command).await
            })
        })
        .await
    }

    /// Runs `handle-event` in `tx`. The caller commits or rolls back.
    pub async fn handle_event(
        &self,
        plugin: &Plugin,
        tx: PluginTx,
        event: guest::Event,
        trace: Option<TraceContext>,
    ) -> CallOutput<()> {
        let request_id = event.event_id.clone();
        self.call(plugin, Some(tx), request_id, trace, |exports, instance, store| {
            Box::pin(async move {
                let handler = exports.handler.load(&mut *store, &instance)?;
                handler.call_handle_event(store, &event).await
            })
        })
        .await
    }

    /// Runs `handle-timer` in `tx`; the plugin must be [`Plugin::timed`]. The caller commits
    /// or rolls back.
    pub async fn handle_timer(
        &self,
        plugin: &Plugin,
        tx: PluginTx,
        timer: timer_guest::Timer,
        trace: Option<TraceContext>,
    ) -> CallOutput<()> {
        let request_id = format!("timer {}/{}", timer.name, timer.key);
        self.call(plugin, Some(tx), request_id, trace, |exports, instance, store| {
            Box::pin(async move {
                let Some(indices) = &exports.timer_handler else {
                    return Err(wasmtime::Error::msg("the plugin does not export timer-handler"));
                };
                let handler = indices.load(&mut *store, &instance)?;
                handler.call_handle_timer(store, &timer).await
            })
        })
        .await
    }

    /// Reads the manifest of a freshly compiled component, with no transaction.
    async fn read_manifest(&self, exports: &Exports, identity: Arc<PluginIdentity>) -> Result<ManifestRead, CallError> {
        let deadline = Instant::now() + self.limits.call_deadline;
        let state = CallState::new(identity, self.limits.clone(), None, deadline, "manifest".into(), None);
        let mut store = self.store(state);
        let outcome = async {
            let instance = exports.pre.instantiate_async(&mut store).await?;
            let handler = exports.handler.load(&mut store, &instance)?;
            handler.call_describe(&mut store).await
        };
        // The epoch stops Wasm at the deadline, but not a guest blocked on the host, as in a
        // WASI sleep: this bound does. Without it such a `describe` held the load, and the
        // watcher behind it (or the host's start), for ever.
        let Ok(outcome) = tokio::time::timeout(self.limits.call_deadline + Duration::from_secs(1), outcome).await
        else {
            return Err(CallError::Trapped(Trap::Deadline));
        };
        if pool_full(&outcome) {
            return Err(CallError::Busy);
        }
        match outcome {
            Ok(manifest) => {
                let state = store.data_mut();
                Ok(ManifestRead {
                    manifest,
                    payloads: std::mem::take(&mut state.declared),
                    declaration_error: state.declaration_error.take(),
                })
            }
            Err(e) => Err(CallError::Trapped(classify_trap(&store, e))),
        }
    }

    fn store(&self, state: CallState) -> Store<CallState> {
        let deadline = state.deadline;
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.set_hostcall_fuel(HOSTCALL_FUEL);
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| {
            if Instant::now() >= deadline {
                Err(DeadlineExceeded.into())
            } else {
                // Give the executor a turn every tick, so a busy guest cannot hog a worker.
                Ok(UpdateDeadline::YieldCustom(1, Box::pin(tokio::task::yield_now())))
            }
        });
        store
    }

    async fn call<T, F>(
        &self,
        plugin: &Plugin,
        tx: Option<PluginTx>,
        request_id: String,
        trace: Option<TraceContext>,
        invoke: F,
    ) -> CallOutput<T>
    where
        F: for<'a> FnOnce(
            &'a Exports,
            Instance,
            &'a mut Store<CallState>,
        ) -> futures::future::BoxFuture<'a, wasmtime::Result<Result<T, HandlerError>>>,
    {
        let limits = &self.limits;
        let started = Instant::now();
        // A call waits for a slot at most one deadline, and then has a whole deadline of its
        // own: time spent queued is not the handler's to lose.
        let Ok(Ok(_slot)) = tokio::time::timeout(limits.call_deadline, self.slots.acquire()).await else {
            return CallOutput {
                result: Err(CallError::Busy),
                tx,
                events: Vec::new(),
                lost_race: false,
            };
        };
        let deadline = Instant::now() + limits.call_deadline;
        let state = CallState::new(plugin.identity.clone(), limits.clone(), tx, deadline, request_id, trace);
        let mut store = self.store(state);
        // The epoch callback stops Wasm at the deadline; statements are bounded by the
        // statement timeout. This outer bound is a backstop for anything else.
        let backstop = limits.call_deadline + limits.statement_timeout + Duration::from_secs(1);
        let run = async {
            let instance = plugin.exports.pre.instantiate_async(&mut store).await?;
            invoke(&plugin.exports, instance, &mut store).await
        };
        let outcome = match tokio::time::timeout(backstop, run).await {
            Ok(outcome) => outcome,
            Err(_) => {
                // The future owned a borrow of the store only. The session may be in the
                // middle of a statement: it is closed and its backend terminated.
                if let Some(tx) = store.into_data().tx {
                    tx.abandon();
                }
                metrics::counter!("obx_plugin_traps_total", "plugin" => plugin.identity.name.clone(), "kind" => "deadline")
                    .increment(1);
                return CallOutput {
                    result: Err(CallError::Trapped(Trap::Deadline)),
                    tx: None,
                    events: Vec::new(),
                    lost_race: false,
                };
            }
        };
        if pool_full(&outcome) && store.data().sent == 0 {
            // The instance pool is full (other calls hold its memories or tables): the host
            // is busy, as with no call slot, and the call's transaction is as it was. Not the
            // plugin's fault, nor an attempt of the event's. (A component of several core
            // instances may have run a start function before the pool refused the next one:
            // if that sent a statement, the call failed as a trap below, and its caller
            // undoes the transaction's work.)
            return CallOutput {
                result: Err(CallError::Busy),
                tx: store.into_data().tx,
                events: Vec::new(),
                lost_race: false,
            };
        }
        let outcome = outcome.map_err(|e| classify_trap(&store, e));
        let state = store.into_data();
        let counted = plugin.identity.metrics();
        counted.duration.record(started.elapsed().as_secs_f64());
        match &outcome {
            Ok(Ok(_)) => counted.ok.increment(1),
            Ok(Err(_)) => counted.error.increment(1),
            Err(trap) => {
                counted.trap.increment(1);
                let kind = match trap {
                    Trap::Deadline => "deadline",
                    Trap::Memory(_) => "memory",
                    Trap::Fault(_) => "trap",
                };
                metrics::counter!("obx_plugin_traps_total", "plugin" => plugin.identity.name.clone(), "kind" => kind)
                    .increment(1);
            }
        }
        let result = match outcome {
            Err(trap) => Err(CallError::Trapped(trap)),
            Ok(Err(handler_error)) => Err(CallError::Handler(handler_error)),
            Ok(Ok(value)) => match state.failure {
                Some(reason) => Err(CallError::Aborted(reason)),
                None => Ok(value),
            },
        };
        CallOutput {
            result,
            tx: state.tx,
            events: state.events,
            lost_race: state.lost_race,
        }
    }
}

/// The error a deadline kill carries.
#[derive(Debug, thiserror::Error)]
#[error("the call ran past its deadline")]
pub struct DeadlineExceeded;

fn classify_trap(store: &Store<CallState>, error: wasmtime::Error) -> Trap {
    if error.downcast_ref::<DeadlineExceeded>().is_some() {
        return Trap::Deadline;
    }
    // The root cause first (e.g. "wasm trap: wasm `unreachable` instruction executed"),
    // then the whole error with its Wasm backtrace, for the log.
    let detail = format!("{}\n{error:?}", error.root_cause());
    if store.data().limiter.exceeded || error.downcast_ref::<MemoryLimitExceeded>().is_some() {
        return Trap::Memory(detail);
    }
    Trap::Fault(detail)
}

/// The most one call's component may hold. A component that needs more is refused when it
/// is compiled, with its count in the error; the pool has this much for every call slot and
/// the headroom, so that no plugin can fill it and leave other plugins' calls no room. (A
/// component of 16 memories used to hold the room of 8 calls.) The example plugins hold 3
/// core instances (Rust, JavaScript) or 14 (Python), 1 memory and 2 tables each.
#[derive(Clone, Copy)]
struct PerCall {
    core_instances: u32,
    memories: u32,
    tables: u32,
}

const PER_CALL: PerCall = PerCall {
    core_instances: 32,
    memories: 2,
    tables: 4,
};

/// The instance pool: room for [`PER_CALL`] in every call slot, and headroom for manifest
/// reads during loads.
fn pool(limits: &Limits) -> PoolingAllocationConfig {
    let per_call = PER_CALL;
    let instances = limits.max_concurrent_calls + 32;
    let mut pool = PoolingAllocationConfig::default();
    pool.max_core_instances_per_component(per_call.core_instances)
        .max_memories_per_component(per_call.memories)
        .max_tables_per_component(per_call.tables)
        .total_component_instances(instances)
        .total_core_instances(instances * per_call.core_instances)
        .total_memories(instances * per_call.memories)
        .total_tables(instances * per_call.tables)
        .total_stacks(instances)
        .max_memory_size(limits.memory_bytes as usize)
        // Slots are reset with madvise past their kept prefixes (below) when a Store
        // drops. Not `pagemap_scan`: in wasmtime 48 its reset skips written pages that are
        // not present (swapped out, or being migrated by compaction, with no swap at all),
        // which the next Store in the slot would read. With 4 MiB kept resident it took a
        // JavaScript call's host CPU from 955 to 521 µs (4 MiB alone: 863), where page faults
        // and madvise were half of it, and a Python one's from 1,673 to 1,329; a Rust call
        // gains nothing (docs/bench/changes.md, 2026-12-05, fifteenth session).
        .table_elements(state::MAX_TABLE_ELEMENTS)
        // A slot serves again only after its reset.
        .decommit_batch_size(DECOMMIT_BATCH)
        // A table is zeroed with memset up to this size instead of being decommitted:
        // a guest's first call through a table reads the page, then writes it, and on a
        // decommitted page that write is a copy-on-write fault with a TLB flush on every
        // CPU. Wasm host CPU per command 351 -> 290 µs (docs/bench/changes.md).
        .table_keep_resident(TABLE_KEEP_RESIDENT)
        .linear_memory_keep_resident(MEMORY_KEEP_RESIDENT);
    pool
}

/// Turns off the Wasm proposals that wasmtime 48 enables by default and no plugin toolchain
/// here emits (Rust's wasm32-wasip2, componentize-py, componentize-js): garbage-collected
/// types, exceptions, typed function references and 64-bit memories; and says so of stack
/// switching, off by default. Each is runtime code a hostile plugin could otherwise reach,
/// and GC would give a call a heap of its own beside its linear memory. A component that uses
/// one is refused when it is compiled. (A toolchain that starts to emit one, e.g. exceptions
/// for `setjmp`, needs it turned on here first.)
fn without_unused_proposals(config: &mut wasmtime::Config) {
    config
        .wasm_gc(false)
        .wasm_function_references(false)
        .wasm_exceptions(false)
        .wasm_memory64(false)
        .wasm_stack_switching(false);
}

/// Whether an instantiation failed for want of room in the instance pool.
fn pool_full<T>(outcome: &wasmtime::Result<T>) -> bool {
    outcome
        .as_ref()
        .is_err_and(|e| e.downcast_ref::<wasmtime::PoolConcurrencyLimitError>().is_some())
}

/// Advances the engine's epoch every tick for as long as the engine exists.
fn start_epoch_ticker(engine: &Engine) {
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("obx-epoch".into())
        .spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(EPOCH_TICK);
            }
        })
        .expect("spawning the epoch thread");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A component may hold a call's share of the instance pool (`PER_CALL`) and no more: one
    /// that needs more is refused when it is compiled, with its count in the error, so that
    /// it cannot fill the pool and leave other plugins' calls no room. Before, one of 16
    /// memories took the room of eight calls.
    #[test]
    fn a_component_over_a_calls_share_of_the_pool_is_refused_when_compiled() {
        let runtime = Runtime::new(Limits::default(), None).unwrap();
        let instances = |n: u32, module: &str| {
            let mut wat = format!("(component (core module $m {module})");
            for _ in 0..n {
                wat.push_str(" (core instance (instantiate $m))");
            }
            wat.push(')');
            wasmtime::component::Component::new(&runtime.engine, &wat).map_err(|e| format!("{e:#}"))
        };
        let share = PER_CALL;
        assert!(instances(share.core_instances, "").is_ok());
        assert!(instances(share.memories, "(memory 1)").is_ok());
        assert!(instances(share.tables, "(table 1 funcref)").is_ok());
        for (refused, what, most) in [
            (
                instances(share.core_instances + 1, ""),
                "core module instances",
                share.core_instances,
            ),
            (instances(share.memories + 1, "(memory 1)"), "memories", share.memories),
            (instances(share.tables + 1, "(table 1 funcref)"), "tables", share.tables),
        ] {
            let error = refused
                .err()
                .unwrap_or_else(|| panic!("a component over its share of {what} compiled"));
            assert!(
                error.contains(what) && error.contains(&format!("maximum of {most}")),
                "{error}"
            );
        }
    }

    /// Proposals no plugin toolchain emits are off: a component with a GC type, an
    /// exception tag, a typed function reference or a 64-bit memory is refused when it is
    /// compiled, and the same component without it compiles.
    #[test]
    fn components_using_proposals_plugins_do_not_need_are_refused() {
        let runtime = Runtime::new(Limits::default(), None).unwrap();
        let compile = |module: &str| {
            let wat = format!("(component (core module $m {module}) (core instance (instantiate $m)))");
            wasmtime::component::Component::new(&runtime.engine, &wat).map_err(|e| format!("{e:#}"))
        };
        assert!(compile("(memory 1) (table 1 funcref) (func (result i32) i32.const 0)").is_ok());
        for (what, module, said) in [
            (
                "a GC struct type",
                "(type (struct (field i32)))",
                "without the gc feature",
            ),
            (
                "an exception tag",
                "(tag $t) (func (throw $t))",
                "exceptions proposal not enabled",
            ),
            (
                "a typed function reference",
                "(type $f (func)) (func (param (ref null $f)))",
                "function references required",
            ),
            ("a 64-bit memory", "(memory i64 1)", "memory64 must be enabled"),
        ] {
            let error = compile(module).err().unwrap_or_else(|| panic!("{what} compiled"));
            assert!(error.contains(said), "{what}: {error}");
        }
    }

    /// A plugin that sends ever-new large statements cannot grow the verdict cache past its
    /// byte bound.
    #[test]
    fn the_verdict_cache_is_bounded_in_bytes() {
        let manifest = Manifest::empty("p");
        let identity = PluginIdentity::new(&manifest, Default::default(), false);
        let limits = Limits::default();
        let columns = vec!["1"; 20_000].join(", ");
        for i in 0..200 {
            let sql = format!("SELECT {i}, {columns}");
            assert!(sql.len() > 50_000 && sql.len() <= limits.max_statement_bytes);
            identity.check_statement(&sql, &limits).unwrap();
            assert!(identity.cached_bytes() <= STATEMENT_CACHE_BYTES);
        }
        assert!(identity.cached_bytes() > 0);
    }
}
