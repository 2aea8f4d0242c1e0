//! Host bindings for the `obx:plugin/plugin` world in `wit/obx.wit`. Generated code only:
//! the implementations of the imports live in `runtime/host/`, one file per interface.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "obx:plugin/plugin",
    imports: {
        // SQL reaches Postgres, so it is async; emit and log only touch the call's state.
        "obx:plugin/sql": async,
    },
    exports: { default: async },
});

pub use exports::obx::plugin::handler as guest;
pub use obx::plugin::{contract, log, outbox, sql, types};
