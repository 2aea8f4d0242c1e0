//! What one plugin call costs the host itself, with nothing else running: the same
//! CreateOrder, one after another on one session, by the Wasm handler through the runtime
//! and by the native handler's statements, in rounds that take turns.
//!
//! The commands suite measures rates on a machine shared with Postgres, where every
//! microsecond of the host's CPU is also taken from Postgres, and its rounds move by tens of
//! per cent. Here one caller runs alone and the figure is this process's CPU per call, which
//! moves by a few microseconds from run to run: enough to tell whether a change to the call
//! path removed work, before the commands suite says whether the rate follows. "Wasm minus
//! native" is everything the Wasm path adds: the runtime's work (instantiation, the reset,
//! the guest, lifting and lowering) and the host's call path around it (the SQL policy's
//! lookup, the parameters' binding, the call's metrics).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use obx::runtime::bindings::guest;
use serde_json::json;

use crate::cpu::Cpu;
use crate::{native_create_order, orders_host, Env};

/// One round's figures: host CPU and wall time per call, µs.
struct PerCall {
    cpu: f64,
    wall: f64,
}

/// Which handlers run: both (the comparison), or one alone (for `perf record`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Only {
    Both,
    Wasm,
    Native,
}

/// What a round needs of the host.
#[derive(Clone)]
struct Parts {
    runtime: Arc<obx::runtime::Runtime>,
    registry: Arc<obx::runtime::registry::Registry>,
    sessions: Arc<obx::db::sessions::Sessions>,
    dispatcher: Arc<obx::dispatch::Dispatcher>,
    /// Each call a whole command, BEGIN to COMMIT.
    whole: bool,
}

pub async fn run(calls: u32, rounds: usize, only: Only, whole: bool) -> Result<()> {
    if whole {
        out!("## One command's cost to the host: CreateOrder, BEGIN to COMMIT, one caller, {calls} commands a round\n");
    } else {
        out!("## One call's cost to the host: CreateOrder, one caller, {calls} calls a round\n");
    }
    let env = Env::start()?;
    let plugins = tempfile::tempdir()?;
    let (host, _url) = orders_host(&env, plugins.path(), 1).await?;
    let parts = Parts {
        runtime: host.runtime.clone(),
        registry: host.registry.clone(),
        sessions: host.sessions.clone(),
        dispatcher: host.dispatcher.clone(),
        whole,
    };
    // Each round on a worker thread, as a request is served: `block_on`'s thread would add
    // a futex wake to each of the caller's round trips.
    let on_worker = |handler: Handler, calls: u32| {
        let parts = parts.clone();
        async move { tokio::spawn(round(parts, handler, calls)).await? }
    };
    let wasm_round = |calls: u32| on_worker(Handler::Wasm, calls);
    let native_round = |calls: u32| on_worker(Handler::Native, calls);
    // A first round of each warms the session's statement cache and the instance pool.
    wasm_round(calls.min(500)).await?;
    native_round(calls.min(500)).await?;
    if only != Only::Both {
        for _ in 0..rounds {
            let per = match only {
                Only::Wasm => wasm_round(calls).await?,
                _ => native_round(calls).await?,
            };
            out!("host CPU {:.1} µs per call, wall {:.1} µs", per.cpu, per.wall);
        }
        host.shutdown().await?;
        return Ok(());
    }
    out!("| round | Wasm: host CPU per call, µs | native | Wasm minus native | Wasm: wall per call, µs | native |");
    out!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    let (mut wasm_cpu, mut native_cpu) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        let (wasm, native) = if round % 2 == 1 {
            let native = native_round(calls).await?;
            (wasm_round(calls).await?, native)
        } else {
            let wasm = wasm_round(calls).await?;
            (wasm, native_round(calls).await?)
        };
        out!(
            "| {round} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            wasm.cpu,
            native.cpu,
            wasm.cpu - native.cpu,
            wasm.wall,
            native.wall
        );
        wasm_cpu.push(wasm.cpu);
        native_cpu.push(native.cpu);
    }
    let (wasm, native) = (crate::median(wasm_cpu), crate::median(native_cpu));
    out!(
        "\nMedians: Wasm {wasm:.1} µs of host CPU per call, native {native:.1}, Wasm minus native {:.1}.\n",
        wasm - native
    );
    host.shutdown().await?;
    Ok(())
}

/// One handler of a round.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Handler {
    Wasm,
    Native,
}

/// `calls` CreateOrders by `handler`, one after another in one transaction that is rolled
/// back. Wasm: the call through the runtime (a fresh Store, the guest, its `sql` and `outbox`
/// host calls), without the dispatcher's begin and commit, which the native round leaves out
/// too. Native: the input parsed, the insert, the event built (not written: the Wasm calls'
/// events are not either).
async fn round(parts: Parts, handler: Handler, calls: u32) -> Result<PerCall> {
    if parts.whole {
        return whole_round(parts, handler, calls).await;
    }
    let plugin = parts.registry.get("orders").context("orders is loaded")?;
    let mut tx = parts.sessions.begin("orders").await?;
    let (cpu, started) = (Cpu::now(), Instant::now());
    for c in 0..calls {
        if handler == Handler::Native {
            let event = native_create_order(&mut tx, c as usize).await?;
            anyhow::ensure!(!std::hint::black_box(event).payload.is_empty(), "the event was built");
            continue;
        }
        let command = guest::Command {
            name: "CreateOrder".into(),
            payload: json!({ "customerId": format!("c-{c}"), "amount": 10 }).to_string(),
            request_id: String::new(),
        };
        let output = parts.runtime.handle_command(&plugin, tx, command, None).await;
        output.result.map_err(|e| anyhow::anyhow!("CreateOrder: {e:?}"))?;
        anyhow::ensure!(output.events.len() == 1, "CreateOrder emits one event");
        tx = output.tx.context("the call kept its transaction")?;
    }
    let wall = started.elapsed();
    let cpu = cpu.per_command(calls as u64).host;
    tx.rollback().await?;
    Ok(PerCall {
        cpu,
        wall: wall.as_secs_f64() * 1e6 / calls as f64,
    })
}

/// `calls` whole CreateOrder commands by `handler`, one after another, each in a transaction
/// of its own: native, the session's BEGIN, the handler, the outbox row with the COMMIT;
/// Wasm, the same through the dispatcher (its spans, metrics and checks included).
async fn whole_round(parts: Parts, handler: Handler, calls: u32) -> Result<PerCall> {
    let (cpu, started) = (Cpu::now(), Instant::now());
    for c in 0..calls as usize {
        match handler {
            Handler::Native => crate::native_command(&parts.sessions, c).await?,
            Handler::Wasm => crate::wasm_command(&parts.dispatcher, c, false).await?,
        }
    }
    Ok(PerCall {
        cpu: cpu.per_command(calls as u64).host,
        wall: started.elapsed().as_secs_f64() * 1e6 / calls as f64,
    })
}
