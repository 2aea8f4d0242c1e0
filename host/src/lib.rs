//! OBX: a host process for event-driven services. Domain logic lives in WebAssembly
//! plugins; the host owns the Postgres transaction of every command and event, and a
//! plugin can emit events only through the transactional outbox.
//!
//! See ARCHITECTURE.md for the code map and the invariants.

pub mod api;
pub mod app;
#[cfg(test)]
mod architecture;
pub mod catalog;
pub mod cli;
pub mod config;
pub mod conformance;
pub mod db;
pub mod dispatch;
pub mod idempotency;
pub mod inbox;
pub mod jsonb;
pub mod kafka;
pub mod otel;
pub mod outbox;
pub mod paging;
pub mod retention;
pub mod runtime;
pub mod scaffold;
pub mod signal;
pub mod sql_policy;
pub mod telemetry;
pub mod text;
pub mod timers;
pub mod trace;
