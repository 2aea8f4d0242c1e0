//! `obx-chaos`: the fault-injection suite. Three `obx serve` processes of one service share a
//! real Postgres and a real Kafka-protocol broker (librdkafka's mock cluster, over TCP) under
//! steady command load, while this program kills hosts with SIGKILL, takes the broker down,
//! restarts Postgres, terminates backends mid-transaction and holds a transaction open.
//! Then it checks, from the database and the broker, that:
//!
//! * every event of every committed command took effect (lost = 0),
//! * exactly once (duplicate effects = 0; duplicates on the broker are counted, they are
//!   allowed: publishing is at least once),
//! * in commit order per key (order violations = 0),
//! * and that no command that rolled back left an event anywhere (phantoms = 0);
//! * and the same of timers: each committed command's timer fired once (timers lost = 0,
//!   duplicate timer effects = 0), and none of a failed command's (timer phantoms = 0).
//!
//! The workload is the testbed plugin's `sequenced` command: it takes the next number of a
//! key under the key's row lock and emits it, keyed by the key; so the committed numbers of
//! a key are exactly 1..n, in commit order. One command in twenty asks to fail after
//! emitting. The testbed's event handler records one `effects` row per event it applies
//! (dedup mode), with no unique constraint, so a second application would show. Each command
//! also schedules a timer 300 ms ahead, keyed by its key and number, in its transaction; the
//! testbed's timer handler records a `timers_fired` row, with no unique constraint either.
//!
//! Run it with `cargo xtask chaos` (see docs/reliability.md).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use obx::db::embedded::EmbeddedPostgres;
#[cfg(test)]
use obx::kafka::MockBroker;

mod broker;
use broker::Broker;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use serde_json::{json, Value};
use sqlx::PgPool;

const TOPIC: &str = "testbed.events";

#[derive(Parser)]
#[command(about = "OBX fault-injection suite")]
struct Args {
    /// Hosts of the one service.
    #[arg(long, default_value_t = 3)]
    hosts: usize,
    /// SIGKILLs of a random host.
    #[arg(long, default_value_t = 20)]
    kills: usize,
    /// Concurrent clients sending commands.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Distinct keys of the workload.
    #[arg(long, default_value_t = 48)]
    keys: usize,
    /// Pause of each client between commands. The default load (about 100 commands/s) is
    /// what three hosts on two cores consume with room to spare, so a recovery time measures
    /// the fault, not a backlog.
    #[arg(long, default_value = "40ms", value_parser = humantime::parse_duration)]
    pause: Duration,
    /// The `obx` binary; default: next to this one.
    #[arg(long)]
    obx: Option<PathBuf>,
    /// The plugin directory to serve (must hold testbed.wasm).
    #[arg(long, env = "OBX_TEST_PLUGINS_DIR")]
    plugins: PathBuf,
    /// Also write the report (Markdown) here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// The short run (CI's, about 2 minutes): 5 kills and the broker outage; no Postgres
    /// faults.
    #[arg(long)]
    short: bool,
    /// The broker: `mock` (librdkafka's mock cluster, in this process) or `tansu` (a
    /// process; in-memory storage, so it is not taken down).
    #[arg(long, default_value = "mock")]
    broker: String,
    /// tansu's storage: `memory`, or `sqlite` (kept across a restart, so the suite SIGKILLs
    /// the broker process and starts it again; needs tansu built with `--features libsql`).
    #[arg(long, default_value = "memory")]
    tansu_storage: String,
    /// The tansu binary.
    #[arg(long, default_value = "tansu")]
    tansu: PathBuf,
    /// Hosts join their consumer groups as static members (`consumer.instance_id` =
    /// `host-<n>`), so a restarted host can take back its partitions without a rebalance.
    #[arg(long)]
    static_membership: bool,
}

/// One `obx serve` process slot.
struct HostSlot {
    index: usize,
    port: u16,
    child: Option<Child>,
}

impl Drop for HostSlot {
    /// Whatever way the suite ends, no host outlives it.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct World {
    obx: PathBuf,
    database_url: String,
    bootstrap: String,
    plugin_dir: tempfile::TempDir,
    cache_dir: tempfile::TempDir,
    log_dir: PathBuf,
    http: reqwest::Client,
    /// Ports of hosts that are up, for the clients.
    live: Mutex<Vec<u16>>,
    static_membership: bool,
}

impl World {
    fn spawn(&self, slot: &mut HostSlot) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_dir.join(format!("host-{}.log", slot.index)))?;
        let mut command = Command::new(&self.obx);
        if self.static_membership {
            command.env("OBX_CONSUMER__INSTANCE_ID", format!("host-{}", slot.index));
        }
        let child = command
            .arg("serve")
            .env_remove("OBX_CONFIG")
            // OBX_CHAOS_HOST_LOG: the hosts' RUST_LOG, e.g. "info,obx::outbox::relay=debug".
            .env(
                "RUST_LOG",
                std::env::var("OBX_CHAOS_HOST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("DATABASE_URL", &self.database_url)
            .env("OBX_SERVICE__NAME", "chaos")
            .env("OBX_KAFKA__BROKERS", &self.bootstrap)
            .env("OBX_KAFKA__CREATE_TOPICS", "false")
            .env("OBX_HTTP__LISTEN", format!("127.0.0.1:{}", slot.port))
            .env("OBX_PLUGINS__DIR", self.plugin_dir.path())
            .env("OBX_PLUGINS__CACHE_DIR", self.cache_dir.path())
            .env("OBX_RELAY__POLL_INTERVAL", "200ms")
            .env("OBX_RELAY__BACKOFF_MAX", "1s")
            .env("OBX_CONSUMER__BACKOFF_MAX", "1s")
            .env("OBX_DATABASE__ACQUIRE_TIMEOUT", "2s")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting obx serve")?;
        slot.child = Some(child);
        Ok(())
    }

    async fn wait_ready(&self, port: u16, limit: Duration) -> Result<Duration> {
        let started = Instant::now();
        loop {
            if let Ok(r) = self.http.get(format!("http://127.0.0.1:{port}/readyz")).send().await {
                if r.status() == 200 {
                    return Ok(started.elapsed());
                }
            }
            if started.elapsed() > limit {
                bail!("host on port {port} not ready after {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn pick_host(&self) -> Option<u16> {
        let live = self.live.lock().unwrap();
        (!live.is_empty()).then(|| live[fastrand::usize(..live.len())])
    }

    async fn send(&self, port: u16, body: &Value) -> Result<(u16, Value)> {
        let r = self
            .http
            .post(format!("http://127.0.0.1:{port}/v1/commands/testbed/sequenced"))
            .timeout(Duration::from_secs(10))
            .json(body)
            .send()
            .await?;
        let status = r.status().as_u16();
        Ok((status, r.json().await.unwrap_or(Value::Null)))
    }
}

/// Every command also schedules a timer this far ahead, keyed by its key and number.
const TIMER_MS: u64 = 300;

#[derive(Default)]
struct Load {
    acked: Mutex<Vec<(String, i64)>>,
    failing_nonces: Mutex<Vec<String>>,
    sent: AtomicU64,
    unanswered: AtomicU64,
    refused: AtomicU64,
    stop: AtomicBool,
}

async fn client(world: Arc<World>, load: Arc<Load>, keys: usize, pause: Duration) {
    while !load.stop.load(Ordering::Relaxed) {
        let Some(port) = world.pick_host() else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let key = format!("k{}", fastrand::usize(..keys));
        let nonce = uuid::Uuid::new_v4().to_string();
        let fail = fastrand::u8(..20) == 0;
        if fail {
            // Whatever the answer, this command can never commit.
            load.failing_nonces.lock().unwrap().push(nonce.clone());
        }
        load.sent.fetch_add(1, Ordering::Relaxed);
        match world
            .send(
                port,
                &json!({ "key": key, "nonce": nonce, "fail": fail, "timer_ms": TIMER_MS }),
            )
            .await
        {
            Ok((200, body)) if !fail => {
                let seq = body["seq"].as_i64().unwrap_or(-1);
                load.acked.lock().unwrap().push((key, seq));
            }
            Ok((200, body)) => panic!("a command asked to fail succeeded: {body}"),
            Ok(_) if fail => {}
            Ok(_) => {
                load.refused.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                load.unanswered.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::time::sleep(pause).await;
    }
}

/// One fault's figures.
struct Recovery {
    fault: &'static str,
    /// From the end of the fault until a new command's event took effect.
    seconds: f64,
}

/// Sends a command on `key` until one is acknowledged, then waits for its effect, and for
/// the relay to have caught up (no unpublished row older than a second). The time from
/// `since` is the recovery time.
async fn probe(world: &World, db: &PgPool, schema: &str, key: &str, since: Instant) -> Result<f64> {
    let seq = loop {
        if since.elapsed() > Duration::from_secs(180) {
            bail!("no command on {key} was accepted within 180 s");
        }
        if let Some(port) = world.pick_host() {
            if let Ok((200, body)) = world
                .send(port, &json!({ "key": key, "nonce": "probe", "timer_ms": TIMER_MS }))
                .await
            {
                break body["seq"].as_i64().unwrap_or(-1);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    loop {
        let applied: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {schema}.effects WHERE key = $1 AND seq = $2"
        ))
        .bind(key)
        .bind(seq)
        .fetch_one(db)
        .await
        .ok();
        if applied.unwrap_or(0) > 0 {
            break;
        }
        if since.elapsed() > Duration::from_secs(180) {
            diagnose(world, db, key).await;
            bail!("the effect of {key}#{seq} did not appear within 180 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    loop {
        let behind: Option<i64> = sqlx::query_scalar(
            "SELECT count(*) FROM obx.outbox_event \
             WHERE published_at IS NULL AND created_at < now() - interval '1 second'",
        )
        .fetch_one(db)
        .await
        .ok();
        if behind == Some(0) {
            return Ok(since.elapsed().as_secs_f64());
        }
        if since.elapsed() > Duration::from_secs(180) {
            diagnose(world, db, key).await;
            bail!("the relay did not catch up within 180 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Partitions of the workload's topic (created with this many).
const PARTITIONS: u32 = 8;

/// One key per partition of the workload's topic, named `{prefix}-…`: the relay's producer
/// puts a key in partition murmur2(key) mod partitions (`kafka.partitioner`'s default, the
/// hash of Kafka's Java client).
fn keys_of_every_partition(prefix: &str) -> Vec<String> {
    let mut keys: Vec<Option<String>> = vec![None; PARTITIONS as usize];
    for j in 0.. {
        let key = format!("{prefix}-{j}");
        let slot = &mut keys[obx_tests::murmur2_partition(key.as_bytes(), PARTITIONS) as usize];
        if slot.is_none() {
            *slot = Some(key);
        }
        if keys.iter().all(Option::is_some) {
            break;
        }
    }
    keys.into_iter().flatten().collect()
}

/// [`probe`] on every key at once, one per partition: the recovery of the slowest, so that
/// a fault that holds up some partitions shows in full, whichever key a client would use.
async fn probe_all(world: &Arc<World>, db: &PgPool, schema: &str, keys: Vec<String>, since: Instant) -> Result<f64> {
    let mut probes = tokio::task::JoinSet::new();
    for key in keys {
        let (world, db, schema) = (world.clone(), db.clone(), schema.to_string());
        probes.spawn(async move { probe(&world, &db, &schema, &key, since).await });
    }
    let mut slowest = 0f64;
    while let Some(done) = probes.join_next().await {
        slowest = slowest.max(done??);
    }
    Ok(slowest)
}

/// Prints where the event of `key` is stuck: its outbox row, its dedup row, the dead-letter
/// table, and the consumer group's committed offsets against the topic's end.
async fn diagnose(world: &World, db: &PgPool, key: &str) {
    let row: Option<(i64, Option<String>, i32)> = sqlx::query_as(
        "SELECT o.id, o.published_at::text, obx.outbox_shard(o.partition_key) FROM obx.outbox_event o \
         WHERE o.partition_key = $1 ORDER BY o.id DESC LIMIT 1",
    )
    .bind(key)
    .fetch_optional(db)
    .await
    .unwrap_or(None);
    eprintln!("diagnosis of {key}: outbox row (id, published_at, shard) = {row:?}");
    let processed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM obx.processed_event p JOIN obx.outbox_event o USING (event_id) \
         WHERE o.partition_key = $1",
    )
    .bind(key)
    .fetch_one(db)
    .await
    .unwrap_or(-1);
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.dead_letter")
        .fetch_one(db)
        .await
        .unwrap_or(-1);
    eprintln!("  processed_event rows for it: {processed}; dead letters: {parked}");
    let Ok(consumer) = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &world.bootstrap)
        .set("group.id", "chaos.testbed")
        .create::<rdkafka::consumer::BaseConsumer>()
    else {
        return;
    };
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..8 {
        tpl.add_partition(TOPIC, p);
    }
    let committed = consumer.committed_offsets(tpl, Duration::from_secs(5));
    for p in 0..8 {
        let high = consumer.fetch_watermarks(TOPIC, p, Duration::from_secs(5)).map(|w| w.1);
        let at = committed
            .as_ref()
            .ok()
            .and_then(|c| c.find_partition(TOPIC, p))
            .map(|e| e.offset());
        eprintln!("  partition {p}: committed {at:?}, end {high:?}");
    }
}

async fn connect(url: &str) -> PgPool {
    loop {
        match sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(2))
            .connect(url)
            .await
        {
            Ok(pool) => return pool,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let obx = match args.obx.clone() {
        Some(p) => p,
        None => std::env::current_exe()?.with_file_name("obx"),
    };
    if !obx.exists() {
        bail!(
            "{} is missing: build it with `cargo build --release -p obx`",
            obx.display()
        );
    }
    let started = Instant::now();
    let mut broker = Broker::start(&args.broker, args.tansu.clone(), &args.tansu_storage)?;
    println!(
        "starting Postgres and {} hosts; the broker: {}",
        args.hosts,
        broker.name()
    );
    let mut pg = EmbeddedPostgres::start(&[("max_connections", "300")])?;
    broker.create_topic(TOPIC, PARTITIONS as i32).await?;
    broker.create_topic("testbed.inbox", 4).await?;
    let plugin_dir = tempfile::tempdir()?;
    std::fs::copy(
        args.plugins.join("testbed.wasm"),
        plugin_dir.path().join("testbed.wasm"),
    )
    .context("copying testbed.wasm from the plugin directory")?;
    let log_dir = std::env::temp_dir().join(format!("obx-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&log_dir)?;
    let world = Arc::new(World {
        obx,
        database_url: pg.url("postgres"),
        bootstrap: broker.bootstrap(),
        plugin_dir,
        cache_dir: tempfile::tempdir()?,
        log_dir: log_dir.clone(),
        http: reqwest::Client::builder().pool_max_idle_per_host(0).build()?,
        live: Mutex::new(Vec::new()),
        static_membership: args.static_membership,
    });
    let mut slots: Vec<HostSlot> = (0..args.hosts)
        .map(|index| HostSlot {
            index,
            port: std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port(),
            child: None,
        })
        .collect();
    for slot in &mut slots {
        world.spawn(slot)?;
        world.wait_ready(slot.port, Duration::from_secs(120)).await?;
        world.live.lock().unwrap().push(slot.port);
    }
    let db = connect(&world.database_url).await;
    let schema: String = sqlx::query_scalar("SELECT schema_name FROM obx.plugin WHERE name = 'testbed'")
        .fetch_one(&db)
        .await?;

    let load = Arc::new(Load::default());
    let clients: Vec<_> = (0..args.clients)
        .map(|_| tokio::spawn(client(world.clone(), load.clone(), args.keys, args.pause)))
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;

    let mut recoveries = Vec::new();
    let mut probes = 0usize;
    let mut next_probe_keys = || {
        probes += 1;
        keys_of_every_partition(&format!("probe-{probes}"))
    };

    // 1. SIGKILL a random host, many times; it is started again at once.
    let mut restart_times = Vec::new();
    let kills = if args.short { 5 } else { args.kills };
    for i in 0..kills {
        tokio::time::sleep(Duration::from_millis(1500 + fastrand::u64(..2500))).await;
        let slot = &mut slots[fastrand::usize(..args.hosts)];
        world.live.lock().unwrap().retain(|p| *p != slot.port);
        let mut child = slot.child.take().unwrap();
        let killed = child.kill(); // SIGKILL
        child.wait()?;
        killed?;
        let killed = Instant::now();
        println!(
            "kill {}/{}: host {} at {:.1}s",
            i + 1,
            kills,
            slot.index,
            started.elapsed().as_secs_f64()
        );
        world.spawn(slot)?;
        restart_times.push(
            world
                .wait_ready(slot.port, Duration::from_secs(120))
                .await?
                .as_secs_f64(),
        );
        world.live.lock().unwrap().push(slot.port);
        let seconds = probe_all(&world, &db, &schema, next_probe_keys(), killed).await?;
        recoveries.push(Recovery {
            fault: "SIGKILL of a host",
            seconds,
        });
    }

    // 2. The broker goes away for 8 s: down (the mock cluster), or its process killed.
    let outages = match broker.outage_name() {
        Some(fault) => {
            println!("{fault} at {:.1}s", started.elapsed().as_secs_f64());
            broker.outage(Duration::from_secs(8)).await?;
            let up = Instant::now();
            recoveries.push(Recovery {
                fault,
                seconds: probe_all(&world, &db, &schema, next_probe_keys(), up).await?,
            });
            1
        }
        None => {
            println!("(this broker cannot come back with its data: no outage)");
            0
        }
    };

    let (db, terminated) = if args.short {
        (db, 0)
    } else {
        database_faults(&world, &mut pg, db, &schema, started, &mut recoveries).await?
    };

    tokio::time::sleep(Duration::from_secs(3)).await;
    load.stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await?;
    }
    let load_seconds = started.elapsed().as_secs_f64();
    println!("load stopped at {load_seconds:.1}s; waiting for every committed event to take effect");

    // Drain: every committed number of every key has an effect, or 180 s pass.
    let drain_started = Instant::now();
    let mut lost;
    loop {
        let figures = measure(&db, &schema).await?;
        lost = figures.lost;
        let unpublished: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NULL")
            .fetch_one(&db)
            .await?;
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.timer WHERE parked_at IS NULL")
            .fetch_one(&db)
            .await?;
        if (lost == 0 && unpublished == 0 && pending == 0) || drain_started.elapsed() > Duration::from_secs(180) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let drain_seconds = drain_started.elapsed().as_secs_f64();
    let figures = measure(&db, &schema).await?;

    // Acknowledged commands: each must be committed (its number within 1..n of its key).
    let acked = load.acked.lock().unwrap().clone();
    let acked_lost = acked
        .iter()
        .filter(|(k, s)| *s < 1 || *s > figures.counters.get(k).copied().unwrap_or(0))
        .count();

    // Phantoms: an event of a command that failed, anywhere.
    let failing = load.failing_nonces.lock().unwrap().clone();
    let phantom_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM obx.outbox_event WHERE payload->>'nonce' = ANY($1)")
            .bind(&failing)
            .fetch_one(&db)
            .await?;
    let on_broker = read_topic(&world.bootstrap, figures.committed as usize).await?;
    let failing_set: HashSet<&String> = failing.iter().collect();
    let phantom_messages = on_broker.nonces.iter().filter(|n| failing_set.contains(n)).count();
    let timers = measure_timers(&db, &schema, &figures.counters, &failing).await?;

    for slot in &mut slots {
        if let Some(mut child) = slot.child.take() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }

    let sent = load.sent.load(Ordering::Relaxed);
    let pg_faults = if args.short { 0 } else { 1 };
    let mut by_fault: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in &recoveries {
        by_fault.entry(r.fault).or_default().push(r.seconds);
    }
    let mut report = String::new();
    let mut line = |s: String| {
        println!("{s}");
        report.push_str(&s);
        report.push('\n');
    };
    line(format!(
        "| figure | value |\n| --- | --- |\n\
         | broker | {} |\n| hosts | {} |\n| host kills (SIGKILL) | {kills} |\n| broker outages | {outages} (8 s) |\n\
         | Postgres restarts | {pg_faults} |\n| backends terminated (pg_terminate_backend) | {terminated} |\n\
         | transactions held open | {pg_faults} (15 s) |\n\
         | commands sent | {sent} |\n| commands acknowledged | {} |\n\
         | commands that failed on purpose (must leave nothing) | {} |\n\
         | other commands refused or unanswered during faults | {} / {} |\n\
         | events committed | {} |\n| messages on the broker | {} |\n\
         | duplicates on the broker (allowed: at-least-once) | {} |\n\
         | **lost** (committed, no effect) | **{}** |\n\
         | **acknowledged but not committed** | **{acked_lost}** |\n\
         | **duplicate effects** | **{}** |\n\
         | **per-key order violations** | **{}** |\n\
         | **phantoms** (outbox rows / broker messages of failed commands) | **{phantom_rows} / {phantom_messages}** |\n\
         | timers fired (one per committed command, {TIMER_MS} ms after it) | {} |\n\
         | **timers lost** (committed, never fired) / parked | **{}** / {} |\n\
         | **duplicate timer effects** | **{}** |\n\
         | **timer phantoms** (fired for a command that failed) | **{}** |\n\
         | load phase | {load_seconds:.0} s |\n| drain after the load | {drain_seconds:.1} s |",
        broker.name(),
        args.hosts,
        acked.len(),
        failing.len(),
        load.refused.load(Ordering::Relaxed),
        load.unanswered.load(Ordering::Relaxed),
        figures.committed,
        on_broker.messages,
        on_broker.messages.saturating_sub(on_broker.distinct),
        figures.lost,
        figures.duplicates,
        figures.order_violations,
        timers.fired,
        timers.lost,
        timers.parked,
        timers.duplicates,
        timers.phantoms,
    ));
    line(String::new());
    line("| fault | recovery: min / median / max (s) |\n| --- | --- |".into());
    let restart_median = median(&mut restart_times);
    for (fault, mut seconds) in by_fault {
        let (min, max) = (
            seconds.iter().cloned().fold(f64::INFINITY, f64::min),
            seconds.iter().cloned().fold(0.0, f64::max),
        );
        line(format!(
            "| {fault} | {min:.2} / {:.2} / {max:.2} |",
            median(&mut seconds)
        ));
    }
    line(format!(
        "\nA killed host was serving again (ready) {restart_median:.2} s (median) after its restart."
    ));
    if let Some(path) = &args.report {
        std::fs::write(path, &report)?;
    }
    println!("host logs: {}", log_dir.display());
    let ok = figures.lost == 0
        && acked_lost == 0
        && figures.duplicates == 0
        && figures.order_violations == 0
        && phantom_rows == 0
        && phantom_messages == 0
        && timers.lost == 0
        && timers.duplicates == 0
        && timers.phantoms == 0;
    drop(broker);
    if !ok {
        bail!("the fault suite found lost, duplicated, reordered or phantom events or timers");
    }
    println!("all invariants held");
    Ok(())
}

/// Faults 3-5, of the database: Postgres restarts, the hosts' busy backends are terminated,
/// a transaction is held open. Returns the suite's new pool (the restart closed the old one)
/// and how many backends were terminated.
async fn database_faults(
    world: &Arc<World>,
    pg: &mut EmbeddedPostgres,
    db: PgPool,
    schema: &str,
    started: Instant,
    recoveries: &mut Vec<Recovery>,
) -> Result<(PgPool, i64)> {
    // 3. Postgres restarts (fast shutdown: every session cut, open transactions rolled back).
    println!("Postgres restart at {:.1}s", started.elapsed().as_secs_f64());
    db.close().await;
    let pg_restarted = tokio::task::block_in_place(|| pg.restart().map(|_| Instant::now()))?;
    let db = connect(&world.database_url).await;
    recoveries.push(Recovery {
        fault: "Postgres restart",
        seconds: probe_all(
            world,
            &db,
            schema,
            keys_of_every_partition("probe-pg-restart"),
            pg_restarted,
        )
        .await?,
    });

    // 4. pg_terminate_backend on the hosts' busy sessions, five times.
    println!("terminating backends at {:.1}s", started.elapsed().as_secs_f64());
    let mut terminated = 0i64;
    for _ in 0..5 {
        terminated += sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name LIKE 'obx%' AND state IN ('active', 'idle in transaction') \
             AND pid <> pg_backend_pid()) t",
        )
        .fetch_one(&db)
        .await?;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let after_terminate = Instant::now();
    recoveries.push(Recovery {
        fault: "pg_terminate_backend ×5",
        seconds: probe_all(
            world,
            &db,
            schema,
            keys_of_every_partition("probe-terminate"),
            after_terminate,
        )
        .await?,
    });

    // 5. A transaction held open for 15 s: it has an xid (older than every later commit) and
    //    holds the row lock of one key.
    println!("long transaction at {:.1}s", started.elapsed().as_secs_f64());
    let mut long = db.begin().await?;
    sqlx::query("SELECT txid_current()").execute(&mut *long).await?;
    sqlx::query(&format!(
        "SELECT n FROM {schema}.counters WHERE name = 'seq:k0' FOR UPDATE"
    ))
    .execute(&mut *long)
    .await?;
    tokio::time::sleep(Duration::from_secs(15)).await;
    long.commit().await?;
    let released = Instant::now();
    recoveries.push(Recovery {
        fault: "transaction held 15 s",
        seconds: probe(world, &db, schema, "k0", released).await?,
    });
    Ok((db, terminated))
}

fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

struct Figures {
    committed: i64,
    lost: i64,
    duplicates: i64,
    order_violations: i64,
    /// Each key's last committed number.
    counters: HashMap<String, i64>,
}

/// Compares what committed (each key's numbers 1..n) with what took effect.
async fn measure(db: &PgPool, schema: &str) -> Result<Figures> {
    let counters: HashMap<String, i64> = sqlx::query_as::<_, (String, i64)>(&format!(
        "SELECT substr(name, 5), n FROM {schema}.counters WHERE name LIKE 'seq:%'"
    ))
    .fetch_all(db)
    .await?
    .into_iter()
    .collect();
    // Effects in the order they were applied.
    let effects: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT key, seq FROM {schema}.effects WHERE topic = $1 AND key IS NOT NULL AND seq IS NOT NULL \
         ORDER BY at, ctid"
    ))
    .bind(TOPIC)
    .fetch_all(db)
    .await?;
    let mut applied: HashMap<&str, Vec<i64>> = HashMap::new();
    for (key, seq) in &effects {
        applied.entry(key.as_str()).or_default().push(*seq);
    }
    let (mut committed, mut lost, mut duplicates, mut order_violations) = (0, 0, 0, 0);
    for (key, n) in &counters {
        committed += n;
        let seqs = applied.remove(key.as_str()).unwrap_or_default();
        let mut seen = HashSet::new();
        let mut last = 0;
        for seq in seqs {
            if !seen.insert(seq) {
                duplicates += 1;
                continue;
            }
            if seq <= last {
                order_violations += 1;
            }
            last = last.max(seq);
        }
        lost += (1..=*n).filter(|s| !seen.contains(s)).count() as i64;
    }
    // Effects of keys with nothing committed would be phantoms; count them as duplicates of
    // nothing.
    duplicates += applied.values().map(|v| v.len() as i64).sum::<i64>();
    Ok(Figures {
        committed,
        lost,
        duplicates,
        order_violations,
        counters,
    })
}

/// What became of the timers the workload's commands scheduled.
struct TimerFigures {
    fired: i64,
    /// Committed numbers whose timer never fired.
    lost: i64,
    parked: i64,
    /// Firings beyond the first of one (key, number).
    duplicates: i64,
    /// Firings that carry the nonce of a command that failed.
    phantoms: i64,
}

async fn measure_timers(
    db: &PgPool,
    schema: &str,
    counters: &HashMap<String, i64>,
    failing: &[String],
) -> Result<TimerFigures> {
    let rows: Vec<(String, i64, Option<String>)> = sqlx::query_as(&format!(
        "SELECT payload->>'key', (payload->>'seq')::bigint, payload->>'nonce' \
         FROM {schema}.timers_fired WHERE name = 'seq'"
    ))
    .fetch_all(db)
    .await?;
    let failing: HashSet<&str> = failing.iter().map(String::as_str).collect();
    let mut seen = HashSet::new();
    let (mut duplicates, mut phantoms) = (0, 0);
    for (key, seq, nonce) in &rows {
        if nonce.as_deref().is_some_and(|n| failing.contains(n)) {
            phantoms += 1;
        }
        if !seen.insert((key.as_str(), *seq)) {
            duplicates += 1;
        }
    }
    let lost = counters
        .iter()
        .map(|(key, n)| (1..=*n).filter(|s| !seen.contains(&(key.as_str(), *s))).count() as i64)
        .sum();
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.timer WHERE parked_at IS NOT NULL")
        .fetch_one(db)
        .await?;
    Ok(TimerFigures {
        fired: rows.len() as i64,
        lost,
        parked,
        duplicates,
        phantoms,
    })
}

struct OnBroker {
    messages: usize,
    distinct: usize,
    nonces: Vec<String>,
}

/// Reads the whole topic as a fresh consumer group: every message, by `eventId` header.
async fn read_topic(bootstrap: &str, at_least: usize) -> Result<OnBroker> {
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("chaos-audit-{}", uuid::Uuid::new_v4()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()?;
    consumer.subscribe(&[TOPIC])?;
    let (mut messages, mut ids, mut nonces) = (0usize, HashSet::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match tokio::time::timeout(Duration::from_secs(5), consumer.recv()).await {
            Ok(Ok(m)) => {
                messages += 1;
                if let Some(headers) = m.headers() {
                    for h in headers.iter() {
                        if h.key == "eventId" {
                            ids.insert(h.value.map(|v| v.to_vec()).unwrap_or_default());
                        }
                    }
                }
                if let Some(Ok(text)) = m.payload_view::<str>() {
                    if let Ok(v) = serde_json::from_str::<Value>(text) {
                        if let Some(n) = v["nonce"].as_str() {
                            nonces.push(n.to_string());
                        }
                    }
                }
            }
            Ok(Err(e)) => bail!("reading {TOPIC}: {e}"),
            Err(_) if messages >= at_least => break,
            Err(_) if Instant::now() > deadline => break,
            Err(_) => {}
        }
    }
    Ok(OnBroker {
        messages,
        distinct: ids.len(),
        nonces,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::producer::{FutureProducer, FutureRecord};

    /// The probe keys land where the suite assumes: one in each partition, as the relay's
    /// producer (`kafka.partitioner`'s default) places them.
    #[tokio::test]
    async fn probe_keys_cover_every_partition() {
        let broker = MockBroker::start(1).unwrap();
        broker.create_topic(TOPIC, PARTITIONS as i32).unwrap();
        let partitioner = obx::config::KafkaConfig::default().partitioner.librdkafka_name();
        let producer: FutureProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", broker.bootstrap())
            .set("partitioner", partitioner)
            .create()
            .unwrap();
        let mut partitions = Vec::new();
        for key in keys_of_every_partition("probe-7") {
            let partition = producer
                .send(FutureRecord::to(TOPIC).key(&key).payload("x"), Duration::from_secs(10))
                .await
                .unwrap()
                .partition;
            assert_eq!(
                partition as u32,
                obx_tests::murmur2_partition(key.as_bytes(), PARTITIONS),
                "{key}"
            );
            partitions.push(partition);
        }
        partitions.sort();
        assert_eq!(partitions, (0..PARTITIONS as i32).collect::<Vec<_>>());
    }
}
