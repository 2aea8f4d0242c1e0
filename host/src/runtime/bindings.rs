//! Host bindings for the `obx:plugin` worlds in `wit/obx.wit`. Generated code only: the
//! implementations of the imports live in `runtime/host/`, one file per interface.
//!
//! The bindings are those of `timed-plugin`, the larger world: its imports are all of
//! `plugin`'s and `timers`. A component of either world links against them, and one built
//! against `obx:plugin@0.2.0` too (the component model matches 0.2.x names to one another).
//! Its exports are looked up one interface at a time (`runtime::loader`), so that a component
//! without `timer-handler` loads as a plain `plugin`.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "obx:plugin/timed-plugin",
    imports: {
        // SQL and timers reach Postgres, so they are async; emit and log only touch the
        // call's state.
        "obx:plugin/sql": async,
        "obx:plugin/timers": async,
    },
    exports: { default: async },
});

pub use exports::obx::plugin::handler as guest;
pub use exports::obx::plugin::timer_handler as timer_guest;
pub use obx::plugin::{contract, log, outbox, sql, timers, types};
