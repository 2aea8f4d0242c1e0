//! The host side of each `obx:plugin` import, one file per WIT interface.

pub(crate) mod contract;
pub(crate) mod log;
mod numeric;
mod outbox;
mod sql;
mod timers;

impl super::bindings::types::Host for super::state::CallState {}
