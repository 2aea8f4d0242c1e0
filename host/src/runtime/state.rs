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
    /// Events emitted so far; written to `outbox_event` in `tx` when the handler succeeds.
    pub(super) events: Vec<NewEvent>,
    /// Payload bytes of `events`.
    pub(super) event_bytes: usize,
    /// What checking this call's payloads against their schemas may still cost (see
    /// `runtime::contract`): one budget for all its emits.
    pub(super) check_budget: u64,
    /// The first reason this call can no longer commit (a failed statement, a limit).
    pub(super) failure: Option<String>,
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
                exceeded: false,
            },
            plugin,
            limits,
            tx,
            events: Vec::new(),
            event_bytes: 0,
            check_budget: super::contract::MAX_CHECK_COST,
            failure: None,
            deadline,
            request_id,
            trace,
            log_lines: 0,
            timer_calls: 0,
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
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// Caps linear memory. Growing past the cap traps (rather than returning -1 to the guest),
/// and the flag lets the caller report the trap as a memory-limit kill.
pub(super) struct MemoryLimiter {
    max_bytes: usize,
    pub(super) exceeded: bool,
}

/// The error a memory-cap trap carries.
#[derive(Debug, thiserror::Error)]
#[error("the plugin tried to grow its memory to {desired} bytes, over the cap of {limit} bytes")]
pub struct MemoryLimitExceeded {
    pub desired: usize,
    pub limit: usize,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.max_bytes {
            self.exceeded = true;
            return Err(MemoryLimitExceeded {
                desired,
                limit: self.max_bytes,
            }
            .into());
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }

    fn instances(&self) -> usize {
        64
    }

    fn tables(&self) -> usize {
        64
    }

    fn memories(&self) -> usize {
        16
    }
}

/// Table elements one table may hold (a large CPython build needs tens of thousands).
pub(super) const MAX_TABLE_ELEMENTS: usize = 200_000;
