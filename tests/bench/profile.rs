//! The per-command cost breakdown and the flame graph of the commands suite.
//!
//! `perf` samples every CPU (the host and its Postgres backends alike) while one kind of
//! handler runs, with DWARF call graphs; `perf script` and inferno fold the samples into
//! stacks; each stack is given to the first stage whose frames it contains. A stage's CPU
//! time divided by the commands completed while sampling is its cost per command.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use inferno::collapse::Collapse;

/// Sampling frequency per CPU, in Hz.
pub const FREQUENCY: &str = "499";

/// One sampled window: folded stacks (frames `;`-joined, process name first) with their CPU
/// time in nanoseconds, and the commands completed meanwhile.
pub struct Window {
    pub stacks: Vec<(String, u64)>,
    pub commands: u64,
}

/// Whether `perf` can sample the whole machine here.
pub fn available() -> Result<()> {
    let status = Command::new("perf")
        .args(["record", "-a", "-o", "/dev/null", "--", "true"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .context("running perf (Debian: apt-get install linux-perf)")?;
    if !status.success() {
        bail!("`perf record -a` is not permitted here (kernel.perf_event_paranoid, or not root)");
    }
    Ok(())
}

/// Samples the machine for `duration` while commands complete into `done`.
pub async fn sample(dir: &Path, name: &str, duration: Duration, done: &AtomicU64) -> Result<Window> {
    let data = dir.join(format!("{name}.perf"));
    let before = done.load(Ordering::Relaxed);
    let record = {
        let data = data.clone();
        let secs = format!("{:.1}", duration.as_secs_f64());
        tokio::task::spawn_blocking(move || {
            Command::new("perf")
                // cpu-clock: each sample's period is in nanoseconds on every machine (the
                // default event is `cycles` where there is a PMU).
                .args(["record", "-a", "-e", "cpu-clock", "-F", FREQUENCY])
                .args(["--call-graph", "dwarf,8192", "-q", "-o"])
                .arg(&data)
                .args(["--", "sleep", &secs])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
        })
    };
    let status = record.await??;
    let commands = done.load(Ordering::Relaxed) - before;
    if !status.success() {
        bail!("perf record failed: {status}");
    }
    // Symbolising takes seconds: off the async workers, which still serve the load.
    let name = name.to_string();
    let folded = tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
        let script = Command::new("perf")
            .args(["script", "--no-inline", "-i"])
            .arg(&data)
            .output()
            .context("running perf script")?;
        let _ = std::fs::remove_file(&data);
        let mut folded = Vec::new();
        inferno::collapse::perf::Folder::default().collapse(&script.stdout[..], &mut folded)?;
        // For a closer look (grep, inferno-flamegraph): OBX_BENCH_FOLDED=<dir> keeps them.
        if let Some(keep) = std::env::var_os("OBX_BENCH_FOLDED") {
            std::fs::write(Path::new(&keep).join(format!("{name}.folded")), &folded)?;
        }
        Ok(folded)
    })
    .await??;
    let stacks = String::from_utf8_lossy(&folded)
        .lines()
        .filter_map(|line| {
            let (stack, weight) = line.rsplit_once(' ')?;
            Some((stack.to_string(), weight.parse().ok()?))
        })
        // The idle loop is not a cost.
        .filter(|(stack, _): &(String, u64)| !stack.starts_with("swapper"))
        .collect();
    Ok(Window { stacks, commands })
}

/// A stage of a command, recognised by any of its frames, in the host or in Postgres.
struct Stage {
    label: &'static str,
    postgres: bool,
    frames: &'static [&'static str],
}

const fn stage(label: &'static str, postgres: bool, frames: &'static [&'static str]) -> Stage {
    Stage {
        label,
        postgres,
        frames,
    }
}

/// The stages, most specific first: a stack counts for the first that matches.
const STAGES: &[Stage] = &[
    stage("host: pool acquire", false, &["PoolInner", "pool::inner"]),
    stage(
        "host: BEGIN (and the call's start)",
        false,
        &["Sessions::begin", "Sessions::try_begin"],
    ),
    stage("host: Idempotency-Key claim", false, &["obx::idempotency::"]),
    // `instantiate_async` is inlined in some builds; `_instantiate` is its body.
    stage(
        "host: instantiation",
        false,
        &["instantiate_async", "InstancePre<T>::_instantiate"],
    ),
    stage("host: SQL policy", false, &["check_statement", "sql_policy"]),
    stage(
        "host: `sql` host calls (binding, the statement)",
        false,
        &["obx::runtime::host::sql"],
    ),
    stage("host: `outbox`, `log` host calls", false, &["obx::runtime::host::"]),
    stage("host: guest code", false, &["wasm[", "module_start"]),
    stage(
        "host: Store drop, memory reset",
        false,
        &[
            "Store<T>::into_data",
            "PoolingInstanceAllocator",
            "decommit",
            "drop_in_place<wasmtime",
        ],
    ),
    stage("host: other Wasm runtime", false, &["wasmtime", "cranelift"]),
    stage("host: outbox insert", false, &["obx::outbox::writer"]),
    stage(
        "host: COMMIT, session check and clearing",
        false,
        &["PluginTx::finish", "PluginTx::commit", "PluginTx::rollback"],
    ),
    stage(
        "host: metrics",
        false,
        &["metrics::", "metrics_exporter", "metrics_util"],
    ),
    stage("host: tracing", false, &["tracing_subscriber", "tracing_core"]),
    stage("host: relay (claim, mark)", false, &["obx::outbox::relay"]),
    stage("host: consumer (poll, dedup, batches)", false, &["obx::inbox::"]),
    stage(
        "host: HTTP (hyper, axum)",
        false,
        &["hyper::", "axum::", "tower::", "tower_http::"],
    ),
    stage("host: native handler's and other statements (sqlx)", false, &["sqlx"]),
    stage("host: JSON", false, &["serde_json"]),
    stage(
        "host: kernel (network, scheduling)",
        false,
        &["entry_SYSCALL", "asm_sysvec", "asm_common_interrupt"],
    ),
    stage("host: async runtime, other", false, &[""]),
    stage(
        "Postgres: PL/pgSQL (obx_api.emit_calls, the call's checks)",
        true,
        &["plpgsql"],
    ),
    stage(
        "Postgres: parse, analyse, plan",
        true,
        &[
            "pg_parse_query",
            "pg_analyze_and_rewrite",
            "pg_plan_queries",
            "parse_analyze",
        ],
    ),
    stage(
        "Postgres: COMMIT (WAL flush)",
        true,
        &["CommitTransaction", "XLogFlush"],
    ),
    stage(
        "Postgres: session clearing (RESET, DISCARD, CLOSE, UNLISTEN)",
        true,
        &["ProcessUtility"],
    ),
    stage("Postgres: the handler's statements", true, &["PortalRun", "Executor"]),
    stage(
        "Postgres: network",
        true,
        &["secure_read", "secure_write", "pq_getbyte", "pq_flush", "epoll_wait"],
    ),
    stage("Postgres: other", true, &[""]),
];

/// Threads that are not stages of a command, by name: the Kafka clients' own threads (and
/// the mock broker's), and the load generators.
const THREADS: &[(&str, &str)] = &[
    ("Kafka client threads (librdkafka, mock broker)", "rdk:"),
    ("load generator (wrk)", "wrk"),
];

/// The rows of [`breakdown`]: every stage, the [`THREADS`], then the other processes (the
/// kernel's threads, perf).
pub fn labels() -> impl Iterator<Item = &'static str> {
    STAGES
        .iter()
        .map(|s| s.label)
        .chain(THREADS.iter().map(|(label, _)| *label))
        .chain(["other processes"])
}

/// Microseconds of CPU per command, one for each of [`labels`].
pub fn breakdown(window: &Window) -> Vec<f64> {
    let mut ns = vec![0u64; STAGES.len() + THREADS.len() + 1];
    for (stack, weight) in &window.stacks {
        let process = stack.split(';').next().unwrap_or_default();
        let postgres = process == "postgres";
        let ours = postgres || process.starts_with("tokio-rt-worker") || process.starts_with("obx");
        let stage = STAGES
            .iter()
            .position(|s| ours && s.postgres == postgres && s.frames.iter().any(|f| stack.contains(f)))
            .or_else(|| {
                let thread = THREADS.iter().position(|(_, name)| process.starts_with(name))?;
                Some(STAGES.len() + thread)
            });
        ns[stage.unwrap_or(STAGES.len() + THREADS.len())] += weight;
    }
    let commands = window.commands.max(1) as f64;
    ns.into_iter().map(|n| n as f64 / 1e3 / commands).collect()
}

/// The flame graph of a window, as SVG.
pub fn flame_graph(window: &Window, title: &str) -> Result<Vec<u8>> {
    let lines: Vec<String> = window.stacks.iter().map(|(s, w)| format!("{s} {w}")).collect();
    let mut options = inferno::flamegraph::Options::default();
    options.title = title.to_string();
    options.count_name = "ns".to_string();
    let mut svg = Vec::new();
    inferno::flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut svg)?;
    Ok(svg)
}

/// A shared counter of completed commands.
pub fn counter() -> Arc<AtomicU64> {
    Arc::new(AtomicU64::new(0))
}
