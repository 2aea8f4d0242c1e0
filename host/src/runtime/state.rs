//! The data of one Store: everything a single plugin call can reach.
//!
//! Invariant: a `CallState` lives for exactly one call. It holds the call's transaction,
//! its buffered outbox events and its limits, and it is dropped with its Store, so nothing
//! a guest did, including a trap, can leak into another call.

use std::sync::Arc;
use std::time::Instant;

use wasmtime::component::ResourceTable;
use wasmtime::ResourceLimiter;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::PluginIdentity;
use crate::config::Limits;
use crate::db::sessions::PluginTx;
use crate::outbox::NewEvent;
use crate::runtime::manifest::PayloadContract;
use crate::trace::TraceContext;

pub struct CallState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(super) limiter: MemoryLimiter,
    pub(super) plugin: Arc<PluginIdentity>,
    pub(super) limits: Arc<Limits>,
    /// The host-owned transaction of this call, on a session of the plugin's own role;
    /// `None` while the manifest is read.
    pub(super) tx: Option<PluginTx>,
    /// Statements this call has sent in `tx` (its own and its timers').
    pub(super) sent: u32,
    /// Events emitted so far; written to `outbox_event` in `tx` when the handler succeeds.
    pub(super) events: Vec<NewEvent>,
    /// Payload bytes of `events`.
    pub(super) event_bytes: usize,
    /// What checking this call's payloads against their schemas may still cost (see
    /// `runtime::contract`): one budget for all its emits.
    pub(super) check_budget: u64,
    /// The first reason this call can no longer commit (a failed statement, a limit).
    pub(super) failure: Option<String>,
    /// Whether that first reason was a statement that lost to concurrent work
    /// ([`crate::db::lost_a_race`]: a lock wait past `lock_timeout`, a deadlock).
    pub(super) lost_race: bool,
    /// Wall-clock deadline of the call, Wasm and SQL together.
    pub(super) deadline: Instant,
    pub(super) request_id: String,
    /// The trace context of the call's work (its command's, event's or timer's span): the
    /// timers it schedules record it, and their firings link back to it.
    pub(super) trace: Option<TraceContext>,
    pub(super) log_lines: u32,
    /// Timers scheduled or cancelled so far.
    pub(super) timer_calls: u32,
    /// Payload schemas declared while the manifest is read, and the first bad declaration.
    pub(super) declared: Vec<PayloadContract>,
    pub(super) declaration_error: Option<String>,
}

impl CallState {
    /// The call's transaction, for a statement about to be sent in it (counted in `sent`).
    pub(super) fn sending(&mut self) -> Option<&mut PluginTx> {
        self.sent += 1;
        self.tx.as_mut()
    }

    pub(super) fn new(
        plugin: Arc<PluginIdentity>,
        limits: Arc<Limits>,
        tx: Option<PluginTx>,
        deadline: Instant,
        request_id: String,
        trace: Option<TraceContext>,
    ) -> CallState {
        // WASI for language runtimes only: no preopened directories, no environment, no
        // arguments, no sockets, no name lookup; stdin closed, stdout and stderr discarded.
        let wasi = WasiCtx::builder()
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        CallState {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryLimiter {
                max_bytes: limits.memory_bytes as usize,
                used: 0,
                exceeded: false,
            },
            plugin,
            limits,
            tx,
            events: Vec::new(),
            event_bytes: 0,
            check_budget: super::contract::MAX_CHECK_COST,
            failure: None,
            lost_race: false,
            deadline,
            request_id,
            trace,
            log_lines: 0,
            timer_calls: 0,
            sent: 0,
            declared: Vec::new(),
            declaration_error: None,
        }
    }

    /// Marks the call as unable to commit, keeping the first reason.
    pub(super) fn fail(&mut self, reason: impl Into<String>) {
        if self.failure.is_none() {
            self.failure = Some(reason.into());
        }
    }

    /// Marks the call as unable to commit for a failed statement, keeping with the first
    /// reason whether the statement lost to concurrent work.
    pub(super) fn fail_statement(&mut self, reason: String, lost_race: bool) {
        if self.failure.is_none() {
            self.lost_race = lost_race;
        }
        self.fail(reason);
    }
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// Caps the linear memory of a call: all its memories together, since a component may hold
/// many (each was capped alone, and sixteen of them made sixteen times the cap). Growing past
/// the cap traps (rather than returning -1 to the guest), and the flag lets the caller report
/// the trap as a memory-limit kill.
pub(super) struct MemoryLimiter {
    max_bytes: usize,
    /// The bytes of every memory of the Store, as created and grown.
    used: usize,
    pub(super) exceeded: bool,
}

/// The error a memory-cap trap carries.
#[derive(Debug, thiserror::Error)]
#[error("the plugin tried to grow its memory to {desired} bytes in all, over the cap of {limit} bytes")]
pub struct MemoryLimitExceeded {
    pub desired: usize,
    pub limit: usize,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        // Past the memory's own declared maximum, the growth fails anyway (-1 to the guest):
        // not counted.
        if maximum.is_some_and(|max| desired > max) {
            return Ok(false);
        }
        // Called as each memory is created (from 0) and each time it grows. A growth that
        // then fails for another reason stays counted: the cap errs on the safe side.
        let in_all = self.used.saturating_add(desired.saturating_sub(current));
        if in_all > self.max_bytes {
            self.exceeded = true;
            return Err(MemoryLimitExceeded {
                desired: in_all,
                limit: self.max_bytes,
            }
            .into());
        }
        self.used = in_all;
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }

    // What the pool lets a component hold (see `PER_CALL`), held to again for each Store.
    fn instances(&self) -> usize {
        super::PER_CALL.core_instances as usize
    }

    fn tables(&self) -> usize {
        super::PER_CALL.tables as usize
    }

    fn memories(&self) -> usize {
        super::PER_CALL.memories as usize
    }
}

/// Table elements one table may hold (a large CPython build needs tens of thousands).
pub(super) const MAX_TABLE_ELEMENTS: usize = 200_000;

#[cfg(test)]
mod tests {
    use wasmtime::ResourceLimiter as _;

    use super::MemoryLimiter;

    /// The cap holds for a call's memories together: a component of many memories, each
    /// under the cap, was let grow each to it.
    #[test]
    fn the_memory_cap_holds_for_all_of_a_calls_memories_together() {
        const MIB: usize = 1 << 20;
        let mut limiter = MemoryLimiter {
            max_bytes: 128 * MIB,
            used: 0,
            exceeded: false,
        };
        assert!(limiter.memory_growing(0, 64 * MIB, None).unwrap());
        assert!(limiter.memory_growing(64 * MIB, 96 * MIB, None).unwrap());
        // A second memory: 96 MiB are taken, so 32 are left for it.
        assert!(limiter.memory_growing(0, 32 * MIB, None).unwrap());
        assert!(!limiter.exceeded);
        let refused = limiter.memory_growing(32 * MIB, 33 * MIB, None).unwrap_err();
        assert!(limiter.exceeded);
        assert!(refused.to_string().contains(&(129 * MIB).to_string()), "{refused}");
    }
}
