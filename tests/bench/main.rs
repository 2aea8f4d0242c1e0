//! `obx-bench`: OBX's benchmarks, each next to its ceiling, measured in one run on one
//! machine. `cargo xtask bench` (release build) runs `report`: every suite, then writes
//! `docs/benchmarks.md` and its charts (`docs/bench/*.svg`).
//!
//! * `commands` — commands/s through the Wasm handler, next to the same logic as a native
//!   Rust handler in the same transaction, and next to pgbench running the same SQL.
//! * `profile` — where a command's CPU goes, stage by stage, native and Wasm, from `perf`
//!   samples of every CPU; and the flame graph of the Wasm run.
//! * `http` — commands/s over HTTP (wrk, 16 connections) with the relay and the inventory
//!   consumer running, next to pgbench with the same SQL; and where its CPU goes.
//! * `rss` — the host's resident memory with no plugin and with ten.
//! * `relay` — the relay's drain rate over 100,000 stored rows, next to raw rdkafka
//!   producing the same messages to the same broker; commit-to-ack latency at a fixed event
//!   rate; and command throughput with the relay running and without it.
//!
//! Postgres runs as a throwaway cluster with `fsync` on, as in production; Kafka is the
//! librdkafka mock cluster (in memory, real protocol) unless `KAFKA_BROKERS` is set.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use obx::config::{Config, Secret};
use obx::db::embedded::EmbeddedPostgres;
use obx::outbox::relay::{OutboxRow, OUTBOX_ROW_COLUMNS};
use rdkafka::producer::FutureProducer;
use serde_json::json;
use sqlx::PgPool;

mod chart;
mod cpu;
mod profile;

/// What the suites print, kept for the report.
static REPORT: std::sync::Mutex<Report> = std::sync::Mutex::new(Report {
    markdown: String::new(),
    comparisons: Vec::new(),
});

struct Report {
    markdown: String,
    comparisons: Vec<chart::Comparison>,
}

/// Prints a line and keeps it for the report.
macro_rules! out {
    ($($arg:tt)*) => {{
        let line = format!($($arg)*);
        println!("{line}");
        let mut report = $crate::REPORT.lock().unwrap();
        report.markdown.push_str(&line);
        report.markdown.push('\n');
    }};
}

/// Records a figure next to its ceiling, for the summary table and a chart.
fn compare(comparison: chart::Comparison) {
    REPORT.lock().unwrap().comparisons.push(comparison);
}

// After `out!`, which it uses.
mod calls;
mod http;
mod timers;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// Commit-to-ack latency at a fixed event rate, with several events per command.
    Latency {
        /// Events per second.
        #[arg(long, default_value_t = 1000)]
        rate: u32,
        /// Events each command emits (the testbed plugin's `emit`).
        #[arg(long, default_value_t = 5)]
        per_command: u32,
        #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
        duration: Duration,
    },
    /// Hot reload: from the atomic rename of a component into the watched directory to its
    /// version serving, for plugins in Rust, Python and JavaScript; compiled, and from the cache.
    Reload,
    /// Consume plus dedup (and inbox) throughput, next to a raw consume of the same messages.
    Consume {
        #[arg(long, default_value_t = 50_000)]
        events: u32,
    },
    /// Every suite, then docs/benchmarks.md and docs/bench/*.svg.
    Report {
        /// Where to write the report.
        #[arg(long, default_value = "docs/benchmarks.md")]
        out: std::path::PathBuf,
    },
    /// Commands/s: the Wasm handler, the same logic natively, and pgbench with the same SQL.
    Commands {
        /// How long each variant runs in each round.
        #[arg(long, default_value = "6s", value_parser = humantime::parse_duration)]
        duration: Duration,
        #[arg(long, default_value_t = 16)]
        clients: usize,
        /// Interleaved rounds of pgbench, native and Wasm; the report gives the medians.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Each Wasm command with an `Idempotency-Key` of its own (claimed, answered).
        #[arg(long)]
        idempotency_keys: bool,
    },
    /// Where a command's CPU goes (`perf`, every CPU), native and Wasm, and the flame graph
    /// of the Wasm run.
    Profile {
        #[arg(long, default_value = "8s", value_parser = humantime::parse_duration)]
        duration: Duration,
        #[arg(long, default_value_t = 16)]
        clients: usize,
        /// Where the flame graph goes.
        #[arg(long, default_value = "docs/bench")]
        charts: std::path::PathBuf,
    },
    /// One call's host CPU, Wasm against native, one caller alone: the call path's own cost.
    Calls {
        #[arg(long, default_value_t = 5000)]
        calls: u32,
        #[arg(long, default_value_t = 6)]
        rounds: usize,
        #[arg(long, value_enum, default_value = "both")]
        only: calls::Only,
        /// Each call a whole command, BEGIN to COMMIT: the native handler's in the host's
        /// transaction shape, and the Wasm one through the dispatcher.
        #[arg(long)]
        whole: bool,
    },
    /// Commands/s over HTTP: wrk against `POST /v1/commands/orders/CreateOrder`, with the
    /// relay and the inventory consumer running; pgbench with the same SQL in the same run.
    Http {
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        duration: Duration,
        #[arg(long, default_value_t = 16)]
        connections: usize,
        /// Sample the run with perf and print where its CPU goes.
        #[arg(long)]
        profile: bool,
    },
    /// Resident memory of `obx serve` with no plugin and with ten.
    Rss,
    /// Timer firing lateness at a steady rate, and the CPU of 100,000 pending timers.
    Timers {
        /// Timers due per second.
        #[arg(long, default_value_t = 1000)]
        rate: u32,
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        duration: Duration,
    },
    /// Relay drain rate, commit-to-ack latency, and the relay's cost to command throughput.
    Relay {
        /// Rows to drain.
        #[arg(long, default_value_t = 100_000)]
        rows: u32,
        /// Event rate for the latency run, per second.
        #[arg(long, default_value_t = 1000)]
        rate: u32,
        /// Length of the latency and throughput runs.
        #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
        duration: Duration,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    obx::telemetry::init_logging(obx::telemetry::LogFormat::Text);
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        match cli.bench {
            Bench::Relay { rows, rate, duration } => relay(rows, rate, duration).await,
            Bench::Report { out } => report(&out).await,
            Bench::Commands {
                duration,
                clients,
                rounds,
                idempotency_keys,
            } => commands(duration, clients, rounds, idempotency_keys).await,
            Bench::Profile {
                duration,
                clients,
                charts,
            } => profile_commands(duration, clients, &charts).await,
            Bench::Http {
                duration,
                connections,
                profile,
            } => http::run(duration, connections, profile).await,
            Bench::Calls {
                calls,
                rounds,
                only,
                whole,
            } => calls::run(calls, rounds, only, whole).await,
            Bench::Rss => rss().await,
            Bench::Timers { rate, duration } => timers::run(rate, duration).await,
            Bench::Consume { events } => consume(events).await,
            Bench::Reload => reload().await,
            Bench::Latency {
                rate,
                per_command,
                duration,
            } => latency(rate, per_command, duration).await,
        }
    })
}

struct Env {
    pg: EmbeddedPostgres,
    broker: obx_tests::TestBroker,
}

impl Env {
    fn start() -> Result<Env> {
        // Production-like durability: fsync on.
        let pg = EmbeddedPostgres::start(&[("fsync", "on"), ("full_page_writes", "on")])?;
        Ok(Env {
            pg,
            broker: obx_tests::broker(),
        })
    }

    async fn database(&self) -> Result<String> {
        let name = format!("bench_{}", uuid::Uuid::new_v4().simple());
        let admin = PgPool::connect(&self.pg.url("postgres")).await?;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await?;
        admin.close().await;
        Ok(self.pg.url(&name))
    }

    fn config(&self, database_url: &str, plugin_dir: &std::path::Path) -> Config {
        let mut config = Config::default();
        config.http.listen = "127.0.0.1:0".parse().unwrap();
        config.database.url = Some(Secret::new(database_url));
        config.database.max_connections = 32;
        config.plugins.dir = plugin_dir.to_path_buf();
        config.kafka.brokers = self.broker.bootstrap.clone();
        config.kafka.create_topics = self.broker.mock.is_none();
        config
    }
}

async fn relay(rows: u32, rate: u32, duration: Duration) -> Result<()> {
    let env = Env::start()?;
    out!("# Relay benchmark\n");
    out!("machine: {}", machine());
    out!(
        "broker: {}\n",
        if env.broker.mock.is_some() {
            "librdkafka mock cluster (in process)"
        } else {
            "KAFKA_BROKERS"
        }
    );

    // 1. Drain: rows stored up front, then the relay publishes them; raw rdkafka sends the
    //    very same messages (key, value, headers) to the same broker.
    let url = env.database().await?;
    let pool = PgPool::connect(&url).await?;
    obx::db::migrate(&pool).await?;
    sqlx::query(
        "INSERT INTO obx.outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, \
                                       partition_key, plugin_name, plugin_version) \
         SELECT gen_random_uuid(), 'Order', 'order-' || (i % 1000), 'OrderCreated', \
                jsonb_build_object('orderId', 'order-' || i, 'customerId', 'c-' || (i % 97), 'amount', i), \
                'bench.drain', 'order-' || (i % 1000), 'bench', '1' \
         FROM generate_series(1, $1) AS i",
    )
    .bind(rows as i64)
    .execute(&pool)
    .await?;
    let stored: Vec<OutboxRow> = sqlx::query_as(&format!(
        "SELECT {OUTBOX_ROW_COLUMNS} FROM obx.outbox_event o ORDER BY o.id"
    ))
    .fetch_all(&pool)
    .await?;

    let kafka = obx::config::KafkaConfig {
        brokers: env.broker.bootstrap.clone(),
        // The mock cluster creates topics on first use, and does not serve CreateTopics.
        create_topics: env.broker.mock.is_none(),
        ..Default::default()
    };
    let brokers = obx::kafka::Brokers::start(&kafka)?;
    let relay = obx::config::RelayConfig {
        linger_ms: 1,
        ..Default::default()
    };
    let producer = obx::outbox::relay::producer(&brokers, &kafka, &relay, None)?;
    let raw = raw_produce(&producer, &stored, "bench.raw").await?;
    drop(producer);

    let relay_config = obx::config::RelayConfig::default();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let signal = obx::signal::Signal::default();
    let relay = obx::outbox::relay::Relay {
        database_url: url.clone(),
        brokers: Arc::new(brokers),
        kafka: kafka.clone(),
        config: relay_config.clone(),
        signal: signal.subscribe(),
        shutdown: stopped,
        owns_all: Default::default(),
    };
    let started = Instant::now();
    let task = tokio::spawn(relay.run());
    wait_published(&pool).await?;
    let drain = started.elapsed();
    let _ = stop.send(true);
    let _ = task.await;
    let relay_rate = rows as f64 / drain.as_secs_f64();
    let raw_rate = rows as f64 / raw.as_secs_f64();
    out!("## Drain of {rows} stored rows\n");
    out!("| | events/s | time |");
    out!("| --- | ---: | ---: |");
    out!(
        "| raw rdkafka produce (ceiling) | {raw_rate:.0} | {:.2} s |",
        raw.as_secs_f64()
    );
    out!("| OBX relay | {relay_rate:.0} | {:.2} s |", drain.as_secs_f64());
    out!("| ratio | {:.2} | |\n", relay_rate / raw_rate);
    compare(chart::Comparison::new(
        "relay-drain",
        "Relay drain rate",
        "events/s",
        ("raw rdkafka produce", raw_rate),
        vec![("OBX relay".into(), relay_rate)],
    ));
    pool.close().await;

    // 2. Command throughput without the relay and with it, then latency at a fixed rate.
    let plugins = tempfile::tempdir()?;
    std::fs::copy(obx_tests::plugin("orders"), plugins.path().join("orders.wasm"))?;
    // Alternate off and on, three times each, and compare medians: single runs on a 2-core
    // machine vary by more than the effect being measured.
    let mut off = Vec::new();
    let mut on = Vec::new();
    for round in 0..6 {
        let relay_on = round % 2 == 1;
        let url = env.database().await?;
        let mut config = env.config(&url, plugins.path());
        config.relay.enabled = relay_on;
        let host = obx::app::start(config).await?;
        let (done, elapsed) = closed_loop(&host.url(), 16, duration / 3).await?;
        let rate = done as f64 / elapsed.as_secs_f64();
        if relay_on {
            on.push(rate)
        } else {
            off.push(rate)
        }
        host.shutdown().await?;
    }
    // Each list is printed in order of rate.
    off.sort_by(f64::total_cmp);
    on.sort_by(f64::total_cmp);
    let results = [median(off.clone()), median(on.clone())];
    out!(
        "## Command throughput (CreateOrder, 16 concurrent clients, 3 runs of {:?} each, medians)\n",
        duration / 3
    );
    out!("| | commands/s | runs |");
    out!("| --- | ---: | --- |");
    out!(
        "| relay off | {:.0} | {} |",
        results[0],
        off.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ")
    );
    out!(
        "| relay on | {:.0} | {} |",
        results[1],
        on.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ")
    );
    out!("| change | {:+.1} % | |\n", (results[1] / results[0] - 1.0) * 100.0);

    let url = env.database().await?;
    let config = env.config(&url, plugins.path());
    let host = obx::app::start(config).await?;
    let metrics = obx::telemetry::metrics();
    // The histogram counts since the process started: measure what this run adds.
    let baseline = metrics.render();
    let sent = open_loop(&host.url(), rate, duration).await?;
    let pool = PgPool::connect(&url).await?;
    wait_published(&pool).await?;
    let rendered = metrics.render();
    let q = |quantile: &str| -> f64 {
        quantile_of(&baseline, &rendered, "obx_outbox_commit_to_ack_seconds", quantile).unwrap_or(f64::NAN) * 1000.0
    };
    out!(
        "## Commit-to-ack latency at {rate} events/s for {duration:?} ({})\n",
        sent.describe()
    );
    latency_table(&q);
    host.shutdown().await?;
    Ok(())
}

async fn consume(events: u32) -> Result<()> {
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let env = Env::start()?;
    out!("# Consumption benchmark\n");
    out!("machine: {}\n", machine());
    let topics = ["testbed.events", "testbed.inbox"];
    if let Some(mock) = &env.broker.mock {
        for t in topics {
            mock.create_topic(t, 8)?;
        }
    }
    // Seed-style events, 100 keys. The inbox topic is filled later, once the dedup run is
    // over, so that the two modes are measured one at a time.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &env.broker.bootstrap)
        .set("linger.ms", "5")
        .create()?;
    produce_events(&producer, "testbed.events", events).await?;

    // Raw consume: the ceiling.
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &env.broker.bootstrap)
        .set("group.id", "bench-raw")
        .set("enable.auto.commit", "false")
        .create()?;
    let mut assignment = TopicPartitionList::new();
    for p in 0..8 {
        assignment.add_partition_offset("testbed.events", p, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let mut first = None;
    for _ in 0..events {
        consumer.recv().await?;
        first.get_or_insert_with(Instant::now);
    }
    let raw = first.map(|f| f.elapsed()).unwrap_or_default();
    let raw_rate = (events - 1) as f64 / raw.as_secs_f64();

    // OBX: the testbed plugin takes testbed.events in dedup mode, testbed.inbox in inbox mode.
    let plugins = tempfile::tempdir()?;
    std::fs::copy(obx_tests::plugin("testbed"), plugins.path().join("testbed.wasm"))?;
    let url = env.database().await?;
    let mut config = env.config(&url, plugins.path());
    config.kafka.create_topics = false;
    let host = obx::app::start(config).await?;
    let pool = PgPool::connect(&url).await?;
    let mut rates = Vec::new();
    for (mode, topic) in [("dedup", "testbed.events"), ("inbox", "testbed.inbox")] {
        if mode == "inbox" {
            produce_events(&producer, topic, events).await?;
        }
        loop {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM testbed.effects WHERE topic = $1")
                .bind(topic)
                .fetch_one(&pool)
                .await?;
            if n >= events as i64 {
                break;
            }
            // The rate comes from the effects' own clocks: polling only has to notice the
            // end, and each poll is a scan of the whole table, on the CPUs being measured.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let span: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM max(at) - min(at))::float8 FROM testbed.effects WHERE topic = $1",
        )
        .bind(topic)
        .fetch_one(&pool)
        .await?;
        rates.push((mode, (events - 1) as f64 / span));
    }
    // The dedup path's SQL, one transaction per event, on the plugin's own login.
    let (role, password): (String, String) = sqlx::query_as(
        "SELECT p.role_name, c.password FROM obx.plugin p \
         JOIN obx.plugin_credential c ON c.role_name = p.role_name WHERE p.name = 'testbed'",
    )
    .fetch_one(&pool)
    .await?;
    host.shutdown().await?;
    let script = "BEGIN;\n\
         SELECT parked, fresh FROM obx_api.begin_event(gen_random_uuid(), 'testbed.events', 'key-1');\n\
         INSERT INTO effects (event_id, topic, key, seq, attempt) VALUES (gen_random_uuid(), 'testbed.events', 'key-1', 1, 1);\n\
         COMMIT;\n";
    let pgbench = run_pgbench_script(&env, &url, (&role, &password), 8, Duration::from_secs(8), script).await?;
    let intake = inbox_intake(&env, plugins.path(), &producer, events).await?;
    let latencies = consume_latency(&env, plugins.path(), &producer).await?;

    out!("## {events} events, 100 keys, 8 partitions; the handler inserts one row per event\n");
    out!("| | events/s | ratio to raw | ratio to pgbench |");
    out!("| --- | ---: | ---: | ---: |");
    out!("| raw rdkafka consume (ceiling) | {raw_rate:.0} | 1.00 | |");
    out!(
        "| pgbench: the dedup path's SQL, a transaction per event (ceiling) | {pgbench:.0} | {:.3} | 1.00 |",
        pgbench / raw_rate
    );
    for (mode, rate) in &rates {
        out!(
            "| OBX consume + {mode} + handler | {rate:.0} | {:.3} | {:.2} |",
            rate / raw_rate,
            rate / pgbench
        );
    }
    out!(
        "| OBX inbox intake alone (no processors) | {intake:.0} | {:.3} | |\n",
        intake / raw_rate
    );
    out!("### One event at a time: 10 events/s in dedup mode, from the produce to the handler's commit\n");
    out!("| | p50 | p99 |");
    out!("| --- | ---: | ---: |");
    for (label, p50, p99) in &latencies {
        out!("| {label} | {p50:.1} ms | {p99:.1} ms |");
    }
    out!("");
    compare(chart::Comparison::new(
        "consume",
        "Consume, then dedup or inbox, then the handler",
        "events/s",
        ("raw rdkafka consume", raw_rate),
        rates
            .iter()
            .map(|(m, r)| (format!("OBX {m}"), *r))
            .chain([("OBX inbox intake".to_string(), intake)])
            .collect(),
    ));
    compare(chart::Comparison::new(
        "consume-pgbench",
        "Consume in dedup mode, against a transaction per event",
        "events/s",
        ("pgbench, same SQL", pgbench),
        vec![("OBX dedup".into(), rates[0].1)],
    ));
    Ok(())
}

/// Produce-to-commit latency of single events at 10 per second, in dedup mode: batched (the
/// default) and one event per transaction (`batch_max_events = 1`, as before batching). Each
/// runs on topics of its own (a topic prefix) with a consumer group of its own; the handler's
/// row records the commit's clock (`clock_timestamp()`, the same machine's clock).
async fn consume_latency(
    env: &Env,
    plugins: &std::path::Path,
    producer: &FutureProducer,
) -> Result<Vec<(&'static str, f64, f64)>> {
    let mut results = Vec::new();
    for (n, (label, batch)) in [("batched (default)", None), ("one event per transaction", Some(1))]
        .into_iter()
        .enumerate()
    {
        let prefix = format!("lat{n}.");
        let topic = format!("{prefix}testbed.events");
        if let Some(mock) = &env.broker.mock {
            // Both of the plugin's topics: one that appeared later would change the
            // subscription, and its rebalance would stall the measured run for seconds.
            mock.create_topic(&topic, 8)?;
            mock.create_topic(&format!("{prefix}testbed.inbox"), 8)?;
        }
        let url = env.database().await?;
        let mut config = env.config(&url, plugins);
        config.kafka.create_topics = env.broker.mock.is_none();
        config.kafka.topic_prefix = prefix;
        config.service.name = format!("bench-lat{n}");
        if let Some(b) = batch {
            config.consumer.batch_max_events = b;
        }
        let host = obx::app::start(config).await?;
        let pool = PgPool::connect(&url).await?;
        let effects = |pool: PgPool| async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM testbed.effects")
                .fetch_one(&pool)
                .await
        };
        // Warm-up: events on every partition prove the consumer owns them all; then the
        // group is left to settle (metadata refreshes every 5 s) before the measured run.
        produce_events(producer, &topic, 100).await?;
        while effects(pool.clone()).await? < 100 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_secs(6)).await;
        let mut sent = std::collections::HashMap::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        for i in 0..100u32 {
            tick.tick().await;
            let id = uuid::Uuid::new_v4();
            let headers = rdkafka::message::OwnedHeaders::new()
                .insert(rdkafka::message::Header {
                    key: "eventId",
                    value: Some(id.to_string().as_str()),
                })
                .insert(rdkafka::message::Header {
                    key: "eventType",
                    value: Some("Thing"),
                });
            let value = json!({ "seq": i }).to_string();
            let key = format!("key-{}", i % 10);
            let record = rdkafka::producer::FutureRecord::to(&topic)
                .key(&key)
                .payload(&value)
                .headers(headers);
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
            sent.insert(id, now.as_secs_f64());
            producer
                .send(record, Duration::from_secs(5))
                .await
                .map_err(|(e, _)| e)?;
        }
        while effects(pool.clone()).await? < 200 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let rows: Vec<(uuid::Uuid, f64)> =
            sqlx::query_as("SELECT event_id, extract(epoch FROM at)::float8 FROM testbed.effects")
                .fetch_all(&pool)
                .await?;
        let mut ms: Vec<f64> = rows
            .iter()
            .filter_map(|(id, at)| Some((at - sent.get(id)?) * 1000.0))
            .collect();
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
        results.push((label, at(0.5), at(0.99)));
        host.shutdown().await?;
    }
    Ok(results)
}

/// Inbox intake alone: `events` events wait on a topic of their own (a topic prefix, so
/// that nothing else is there to consume) until a host with no inbox processors starts and
/// stores them; the rate is over the span of their `received_at` (each storing statement's
/// transaction start).
async fn inbox_intake(env: &Env, plugins: &std::path::Path, producer: &FutureProducer, events: u32) -> Result<f64> {
    let prefix = "intake.";
    if let Some(mock) = &env.broker.mock {
        mock.create_topic(&format!("{prefix}testbed.inbox"), 8)?;
    }
    produce_events(producer, &format!("{prefix}testbed.inbox"), events).await?;
    let url = env.database().await?;
    let mut config = env.config(&url, plugins);
    config.kafka.create_topics = env.broker.mock.is_none();
    config.kafka.topic_prefix = prefix.into();
    config.consumer.inbox_processors = 0;
    config.service.name = "bench-intake".into();
    let host = obx::app::start(config).await?;
    let pool = PgPool::connect(&url).await?;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.inbox_event")
            .fetch_one(&pool)
            .await?;
        if n >= events as i64 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the inbox took only {n} of {events} events");
        // As above: the rate comes from the rows' clocks; a poll is a scan on measured CPUs.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (span, statements): (f64, i64) = sqlx::query_as(
        "SELECT extract(epoch FROM max(received_at) - min(received_at))::float8, count(DISTINCT received_at) \
         FROM obx.inbox_event",
    )
    .fetch_one(&pool)
    .await?;
    host.shutdown().await?;
    println!("inbox intake: {events} events in {statements} statements over {span:.2} s");
    Ok((events - 1) as f64 / span.max(1e-3))
}

async fn latency(rate: u32, per_command: u32, duration: Duration) -> Result<()> {
    let env = Env::start()?;
    let plugins = tempfile::tempdir()?;
    std::fs::copy(obx_tests::plugin("testbed"), plugins.path().join("testbed.wasm"))?;
    let url = env.database().await?;
    let mut config = env.config(&url, plugins.path());
    config.consumer.enabled = false;
    let host = obx::app::start(config).await?;
    let commands = rate / per_command.max(1);
    let body = json!({ "id": "lat", "topic": "testbed.alpha", "count": per_command });
    let url_of_emit = format!("{}/v1/commands/testbed/emit", host.url());
    let pool = PgPool::connect(&url).await?;
    // The topic exists, and the producer knows its partitions, before the measured run: a
    // topic created by its first message makes that message wait for metadata.
    if let Some(mock) = &env.broker.mock {
        mock.create_topic("testbed.alpha", 8)?;
    }
    open_loop_with(&url_of_emit, body.clone(), commands, Duration::from_secs(1)).await?;
    wait_published(&pool).await?;
    // The histogram counts since the process started: measure what this run adds.
    let baseline = obx::telemetry::metrics().render();
    let sent = open_loop_with(&url_of_emit, body, commands, duration).await?;
    wait_published(&pool).await?;
    let rendered = obx::telemetry::metrics().render();
    let q = |quantile: &str| {
        quantile_of(&baseline, &rendered, "obx_outbox_commit_to_ack_seconds", quantile).unwrap_or(f64::NAN) * 1000.0
    };
    out!(
        "## Commit-to-ack latency at {rate} events/s: {commands} commands/s of {per_command} events, {duration:?} ({})\n",
        sent.describe()
    );
    let stem = match per_command {
        1 => "latency".to_string(),
        n => format!("latency-{n}-per-command"),
    };
    compare(chart::Comparison::plain(
        &stem,
        &format!("Commit-to-ack latency at {rate} events/s, {per_command} per command"),
        "ms",
        vec![
            ("p50".into(), q("0.5")),
            ("p90".into(), q("0.9")),
            ("p99".into(), q("0.99")),
            ("p99.9".into(), q("0.999")),
        ],
    ));
    latency_table(&q);
    host.shutdown().await?;
    Ok(())
}

/// The commit-to-ack quantiles, in milliseconds, as a table row.
fn latency_table(q: &dyn Fn(&str) -> f64) {
    out!("| p50 | p90 | p99 | p99.9 |");
    out!("| ---: | ---: | ---: | ---: |");
    out!(
        "| {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
        q("0.5"),
        q("0.9"),
        q("0.99"),
        q("0.999")
    );
}

async fn wait_published(pool: &PgPool) -> Result<()> {
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NULL")
            .fetch_one(pool)
            .await?;
        if left == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn reload() -> Result<()> {
    let env = Env::start()?;
    out!("# Hot reload benchmark\n");
    out!("machine: {}\n", machine());
    out!("From the atomic rename into the watched directory to the first command answered by the");
    out!("new version (debounce: 50 ms). \"Compiled\": an empty compile cache; \"from the cache\": the");
    out!("same file again after a delete.\n");
    let mut reloads = Vec::new();
    out!("| plugin | language | size | compiled | from the cache |");
    out!("| --- | --- | ---: | ---: | ---: |");
    for (component, language, plugin, command, body) in [
        ("orders", "Rust", "orders", "CreateOrder", json!({})),
        ("shipping", "Python", "shipping", "GetShipment", json!({})),
        (
            "notifications",
            "JavaScript",
            "notifications",
            "ListNotifications",
            json!({}),
        ),
    ] {
        let source = obx_tests::plugin(component);
        let size = std::fs::metadata(&source)?.len();
        let dir = tempfile::tempdir()?;
        let cache = tempfile::tempdir()?;
        let url = env.database().await?;
        let mut config = env.config(&url, dir.path());
        config.plugins.debounce = Duration::from_millis(50);
        config.plugins.cache_dir = Some(cache.path().to_path_buf());
        config.consumer.enabled = false;
        let host = obx::app::start(config).await?;
        let client = reqwest::Client::new();
        let command_url = format!("{}/v1/commands/{plugin}/{command}", host.url());
        let mut times = Vec::new();
        for _ in 0..2 {
            let tmp = dir.path().join(format!(".{component}.tmp"));
            let target = dir.path().join(format!("{component}.wasm"));
            std::fs::copy(&source, &tmp)?;
            let started = Instant::now();
            std::fs::rename(&tmp, &target)?;
            loop {
                let r = client.post(&command_url).json(&body).send().await?;
                let code: serde_json::Value = r.json().await.unwrap_or_default();
                if code["error"]["code"] != "unknown_plugin" {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            times.push(started.elapsed());
            std::fs::remove_file(&target)?;
            loop {
                let r = client.post(&command_url).json(&body).send().await?;
                let code: serde_json::Value = r.json().await.unwrap_or_default();
                if code["error"]["code"] == "unknown_plugin" {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        out!(
            "| {plugin} | {language} | {:.1} MB | {:.2} s | {:.3} s |",
            size as f64 / 1e6,
            times[0].as_secs_f64(),
            times[1].as_secs_f64()
        );
        reloads.push((format!("{language}, compiled"), times[0].as_secs_f64()));
        reloads.push((format!("{language}, from the cache"), times[1].as_secs_f64()));
        host.shutdown().await?;
    }
    compare(chart::Comparison::plain(
        "reload",
        "Hot reload: rename to first answer",
        "s",
        reloads,
    ));
    Ok(())
}

/// Sends `count` seed-style events (eventId and eventType headers, JSON value, 100 keys).
async fn produce_events(producer: &FutureProducer, topic: &str, count: u32) -> Result<()> {
    let mut deliveries = Vec::new();
    for i in 0..count {
        let id = uuid::Uuid::new_v4().to_string();
        let key = format!("key-{}", i % 100);
        let value = json!({ "seq": i }).to_string();
        let headers = rdkafka::message::OwnedHeaders::new()
            .insert(rdkafka::message::Header {
                key: "eventId",
                value: Some(id.as_str()),
            })
            .insert(rdkafka::message::Header {
                key: "eventType",
                value: Some("Thing"),
            });
        let record = rdkafka::producer::FutureRecord::to(topic)
            .key(&key)
            .payload(&value)
            .headers(headers);
        deliveries.push(producer.send_result(record).map_err(|(e, _)| e)?);
    }
    for d in deliveries {
        d.await?.map_err(|(e, _)| e)?;
    }
    Ok(())
}

/// Sends the rows as the relay would, to `topic`, and waits for every acknowledgement.
async fn raw_produce(producer: &FutureProducer, rows: &[OutboxRow], topic: &str) -> Result<Duration> {
    let started = Instant::now();
    let mut deliveries = Vec::with_capacity(rows.len());
    for row in rows {
        loop {
            let record = rdkafka::producer::FutureRecord::to(topic)
                .key(row.partition_key.as_str())
                .payload(row.payload.as_str())
                .timestamp(row.created_at.timestamp_millis())
                .headers(row.headers(&Default::default()));
            match producer.send_result(record) {
                Ok(d) => {
                    deliveries.push(d);
                    break;
                }
                Err((
                    rdkafka::error::KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull),
                    _,
                )) => tokio::time::sleep(Duration::from_millis(1)).await,
                Err((e, _)) => return Err(e.into()),
            }
        }
    }
    for d in deliveries {
        d.await.context("producer dropped")?.map_err(|(e, _)| e)?;
    }
    Ok(started.elapsed())
}

/// `clients` loops sending CreateOrder back to back for `duration`; returns commands done.
async fn closed_loop(base: &str, clients: usize, duration: Duration) -> Result<(u64, Duration)> {
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/commands/orders/CreateOrder");
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            while started.elapsed() < duration {
                let body = json!({ "customerId": format!("c-{c}"), "amount": 10 });
                let r = client.post(&url).json(&body).send().await?;
                anyhow::ensure!(r.status() == 200, "command failed: {}", r.status());
                done += 1;
            }
            anyhow::Ok(done)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok((total, started.elapsed()))
}

/// Sends CreateOrder at a fixed rate for `duration`, whatever the latency; returns how many, and how many failed.
async fn open_loop(base: &str, rate: u32, duration: Duration) -> Result<Sent> {
    let body = json!({ "customerId": "c-rate", "amount": 10 });
    open_loop_with(&format!("{base}/v1/commands/orders/CreateOrder"), body, rate, duration).await
}

/// What an open loop sent, and how many of its commands were not answered 200.
#[derive(Clone, Copy)]
struct Sent {
    commands: u64,
    /// Answered with another status (`busy` when the machine cannot keep the rate), or not
    /// answered at all.
    failed: u64,
}

impl Sent {
    /// The run's size for a heading, with its failures when there were any: a machine that
    /// cannot keep the rate refuses commands, and the latency then is that of the rest.
    fn describe(&self) -> String {
        match self.failed {
            0 => format!("{} commands", self.commands),
            n => format!(
                "{} commands, {n} of them not answered 200: the machine did not keep the rate",
                self.commands
            ),
        }
    }
}

/// Posts `body` to `url` at a fixed rate for `duration`, whatever the latency, and counts
/// the commands not answered 200 rather than stopping at the first.
async fn open_loop_with(url: &str, body: serde_json::Value, rate: u32, duration: Duration) -> Result<Sent> {
    let client = reqwest::Client::new();
    let url = url.to_string();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut sent = Sent { commands: 0, failed: 0 };
    while started.elapsed() < duration {
        tick.tick().await;
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        tasks.spawn(async move { client.post(&url).json(&body).send().await.map(|r| r.status().as_u16()) });
        sent.commands += 1;
    }
    let mut first_failure = None;
    while let Some(r) = tasks.join_next().await {
        let failure = match r? {
            Ok(200) => continue,
            Ok(status) => format!("answered {status}"),
            Err(e) => format!("{e}"),
        };
        sent.failed += 1;
        first_failure.get_or_insert(failure);
    }
    if let Some(failure) = first_failure {
        eprintln!(
            "{} of {} commands failed, the first: {failure}",
            sent.failed, sent.commands
        );
    }
    Ok(sent)
}

/// A quantile of what a Prometheus histogram counted between two scrapes, from its
/// cumulative buckets, interpolated within the bucket it falls in (as PromQL's
/// `histogram_quantile` does).
fn quantile_of(before: &str, after: &str, metric: &str, quantile: &str) -> Option<f64> {
    let q: f64 = quantile.parse().ok()?;
    let prefix = format!("{metric}_bucket{{le=\"");
    let buckets_of = |rendered: &str| -> Vec<(f64, f64)> {
        let mut buckets: Vec<(f64, f64)> = rendered
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .filter_map(|rest| {
                let (bound, count) = rest.split_once("\"} ")?;
                let bound = if bound == "+Inf" {
                    f64::INFINITY
                } else {
                    bound.parse().ok()?
                };
                Some((bound, count.trim().parse().ok()?))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        buckets
    };
    let earlier = buckets_of(before);
    let buckets: Vec<(f64, f64)> = buckets_of(after)
        .into_iter()
        .map(|(bound, count)| {
            let was = earlier.iter().find(|(b, _)| *b == bound).map_or(0.0, |(_, c)| *c);
            (bound, count - was)
        })
        .collect();
    let total = buckets.last()?.1;
    if total == 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for (bound, count) in buckets {
        if count >= rank {
            if bound.is_infinite() {
                return Some(lower);
            }
            let inside = count - below;
            let share = if inside > 0.0 { (rank - below) / inside } else { 1.0 };
            return Some(lower + (bound - lower) * share);
        }
        (lower, below) = (bound, count);
    }
    None
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").parse::<u64>().unwrap_or(0))
        })
        .unwrap_or(0);
    format!("{cpus} CPUs ({model}), {:.0} GiB RAM", mem as f64 / 1024.0 / 1024.0)
}

/// The handler's statement, as it runs on the plugin's own session.
const INSERT_ORDER: &str = "INSERT INTO orders (id, customer_id, amount, status, items) \
     VALUES (COALESCE($1, gen_random_uuid()), $2, $3, 'pending', $4) ON CONFLICT (id) DO NOTHING RETURNING id";

/// A run's commands/s, and the CPU each command cost.
type Measured = (f64, cpu::PerCommand);

/// One round of the commands suite: pgbench, then the native handler, then the Wasm one.
struct Round {
    pgbench: Measured,
    native: Measured,
    wasm: Measured,
}

impl Round {
    fn handler(&self, wasm: bool) -> Measured {
        if wasm {
            self.wasm
        } else {
            self.native
        }
    }
}

/// Commands/s three ways, on one database: pgbench running the handler's SQL on the plugin's
/// own login (the ceiling), the same logic as native Rust in the host's transaction shape
/// (a plugin session, the outbox through `obx_api.emit_calls`, the session cleared with the
/// commit), and the orders plugin's Wasm handler through the dispatcher (no HTTP in any of
/// them; relay and consumers off), in `rounds` interleaved rounds of `duration` each, native
/// and Wasm taking turns to run first. On a shared machine a single run of each is as much
/// luck as measure (pgbench alone has ranged 1,700-7,600 tps within an hour here), so each
/// figure is the median over the rounds, and each ratio the median of the rounds' own ratios.
async fn commands(duration: Duration, clients: usize, rounds: usize, keys: bool) -> Result<()> {
    let env = Env::start()?;
    let plugins = tempfile::tempdir()?;
    let (host, url) = orders_host(&env, plugins.path(), clients).await?;
    let pool = PgPool::connect(&url).await?;
    let (schema, role, password): (String, String, String) = sqlx::query_as(
        "SELECT p.schema_name, p.role_name, c.password FROM obx.plugin p \
         JOIN obx.plugin_credential c ON c.role_name = p.role_name WHERE p.name = 'orders'",
    )
    .fetch_one(&pool)
    .await?;
    let truncate = format!("TRUNCATE \"{schema}\".orders, obx.outbox_event CASCADE");
    let mut measured = Vec::new();
    for round in 0..rounds.max(1) {
        sqlx::query(&truncate).execute(&pool).await?;
        let cpu = cpu::Cpu::now();
        let pgbench = run_pgbench(&env, &url, (&role, &password), clients, duration).await?;
        let pgbench_cpu = cpu.per_command((pgbench * duration.as_secs_f64()) as u64);
        // Native first in the first round, Wasm in the second, and so on: whatever the run
        // before does to the machine (a checkpoint it started, caches it left) falls on both.
        let native_first = round % 2 == 0;
        let mut native = None;
        let mut wasm = None;
        for native_turn in [native_first, !native_first] {
            sqlx::query(&truncate).execute(&pool).await?;
            if native_turn {
                native = Some(with_cpu(|done| native_orders(&host, clients, duration, done)).await?);
            } else {
                wasm = Some(with_cpu(|done| wasm_orders(&host, clients, duration, done, keys)).await?);
            }
        }
        let (native, wasm) = (native.expect("ran"), wasm.expect("ran"));
        measured.push(Round {
            pgbench: (pgbench, pgbench_cpu),
            native,
            wasm,
        });
    }
    host.shutdown().await?;
    report_commands(duration, clients, &measured, keys);
    Ok(())
}

fn report_commands(duration: Duration, clients: usize, rounds: &[Round], keys: bool) {
    let med = |f: &dyn Fn(&Round) -> f64| median(rounds.iter().map(f).collect());
    let pgbench = med(&|r| r.pgbench.0);
    let (native, wasm) = (med(&|r| r.native.0), med(&|r| r.wasm.0));
    out!(
        "## Command throughput: CreateOrder, {clients} concurrent callers, {} interleaved rounds of {duration:?} each, no HTTP\n",
        rounds.len()
    );
    out!("Medians over the rounds; a ratio is the median of the rounds' own ratios.\n");
    out!("| | commands/s | ratio to pgbench | CPU per command, every CPU, µs | of it the host process, µs | Postgres, µs |");
    out!("| --- | ---: | ---: | ---: | ---: | ---: |");
    out!(
        "| pgbench, the same SQL on the plugin's login (ceiling) | {pgbench:.0} | 1.00 | {:.0} | | {:.0} |",
        med(&|r| r.pgbench.1.machine),
        med(&|r| r.pgbench.1.postgres)
    );
    let wasm_label = if keys {
        "Wasm handler (orders plugin) through the dispatcher, each command with an Idempotency-Key"
    } else {
        "Wasm handler (orders plugin) through the dispatcher"
    };
    for (label, wasm) in [
        ("native Rust handler, the host's transaction shape", false),
        (wasm_label, true),
    ] {
        let run = |r: &Round| r.handler(wasm);
        out!(
            "| {label} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} |",
            med(&|r| run(r).0),
            med(&|r| run(r).0 / r.pgbench.0),
            med(&|r| run(r).1.machine),
            med(&|r| run(r).1.host),
            med(&|r| run(r).1.postgres)
        );
    }
    out!(
        "\nThe cost of Wasm is the gap between the last two rows: Wasm at {:.2}× the native rate \
         (the median of the rounds' ratios), {:.0} µs more of the host's CPU per command.\n",
        med(&|r| r.wasm.0 / r.native.0),
        med(&|r| r.wasm.1.host - r.native.1.host)
    );
    out!(
        "Each round, commands/s (pgbench / native / Wasm, and Wasm's ratio to native); after \
         pgbench, native ran first in odd rounds, Wasm in even ones:\n"
    );
    for (i, r) in rounds.iter().enumerate() {
        out!(
            "- round {}: {:.0} / {:.0} / {:.0}, {:.2}{}",
            i + 1,
            r.pgbench.0,
            r.native.0,
            r.wasm.0,
            r.wasm.0 / r.native.0,
            if i % 2 == 0 { "" } else { " (Wasm first)" }
        );
    }
    out!("");
    compare(chart::Comparison::new(
        "commands",
        "CreateOrder commands",
        "commands/s",
        ("pgbench, same SQL", pgbench),
        vec![("native Rust handler".into(), native), ("Wasm handler".into(), wasm)],
    ));
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Runs `suite` with a fresh command counter; its rate, and the CPU each command cost.
async fn with_cpu<F, Fut>(suite: F) -> Result<Measured>
where
    F: FnOnce(Arc<AtomicU64>) -> Fut,
    Fut: std::future::Future<Output = Result<f64>>,
{
    let done = profile::counter();
    let cpu = cpu::Cpu::now();
    let rate = suite(done.clone()).await?;
    Ok((rate, cpu.per_command(done.load(Ordering::Relaxed))))
}

/// The trace context the native handler and pgbench give their outbox rows, as the host gives
/// a command's.
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// pgbench, logged in as the plugin's role: BEGIN, the insert, the outbox row through
/// `obx_api.emit_calls`, COMMIT, each a prepared statement; the last two in one round trip (a
/// pipeline), as the host sends its outbox rows with the commit.
async fn run_pgbench(env: &Env, url: &str, login: (&str, &str), clients: usize, duration: Duration) -> Result<f64> {
    let payload = r#"{"orderId":"o","customerId":"c-1","amount":"10","status":"pending","items":[]}"#;
    let script = format!(
        "BEGIN;\n\
         INSERT INTO orders (id, customer_id, amount, status, items) VALUES (gen_random_uuid(), 'c-1', 10, 'pending', '[]') \
         ON CONFLICT (id) DO NOTHING RETURNING id;\n\
         \\startpipeline\n\
         SELECT obx_api.emit_calls('0.1.0', ARRAY[1], ARRAY['{TRACEPARENT}'], ARRAY[gen_random_uuid()], ARRAY['Order'], \
         ARRAY['o'], ARRAY['OrderCreated'], ARRAY['{payload}'], ARRAY['order.events'], ARRAY['o']);\n\
         COMMIT;\n\
         \\endpipeline\n"
    );
    run_pgbench_script(env, url, login, clients, duration, &script).await
}

/// pgbench running `sql` (each statement prepared), logged in as a plugin's role; its tps.
async fn run_pgbench_script(
    env: &Env,
    url: &str,
    (role, password): (&str, &str),
    clients: usize,
    duration: Duration,
    sql: &str,
) -> Result<f64> {
    let script = tempfile::NamedTempFile::new()?;
    std::fs::write(script.path(), sql)?;
    let bindir = obx::db::embedded::find_bindir()?;
    let database = url.rsplit('/').next().unwrap_or("postgres").to_string();
    let mut cmd = std::process::Command::new(bindir.join("pgbench"));
    cmd.args(["-n", "-M", "prepared", "-j", "2", "-h", "127.0.0.1", "-U", role])
        .env("PGPASSWORD", password)
        .args(["-p", &env.pg.port().to_string(), "-c", &clients.to_string()])
        .args(["-T", &duration.as_secs().max(1).to_string(), "-f"])
        .arg(script.path())
        .arg(&database);
    let out = tokio::task::spawn_blocking(move || cmd.output()).await??;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "pgbench failed: {}{}",
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no tps in pgbench's output: {text}"))
}

/// A host serving the orders plugin from `plugins`, relay and consumers off, with a plugin
/// session for each of `clients`; and its database URL.
async fn orders_host(env: &Env, plugins: &std::path::Path, clients: usize) -> Result<(obx::app::Host, String)> {
    std::fs::copy(obx_tests::plugin("orders"), plugins.join("orders.wasm"))?;
    let url = env.database().await?;
    let mut config = env.config(&url, plugins);
    config.relay.enabled = false;
    config.consumer.enabled = false;
    config.database.plugin_max_connections = clients as u32;
    Ok((obx::app::start(config).await?, url))
}

/// Where a command's CPU goes, in microseconds, native and Wasm (see `profile.rs`); and the
/// flame graph of the Wasm run, written to `charts`.
async fn profile_commands(duration: Duration, clients: usize, charts: &std::path::Path) -> Result<()> {
    out!("## Where a command's CPU goes: CreateOrder, {clients} concurrent callers, no HTTP\n");
    if let Err(e) = profile::available() {
        out!("Not measured: {e:#}.\n");
        return Ok(());
    }
    let env = Env::start()?;
    let plugins = tempfile::tempdir()?;
    let (host, _url) = orders_host(&env, plugins.path(), clients).await?;
    let scratch = tempfile::tempdir()?;
    // Sampling starts a second into each run and ends a second before it.
    let run = duration + Duration::from_secs(2);
    let sample = |name: &'static str, done: Arc<AtomicU64>| {
        let dir = scratch.path().to_path_buf();
        async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            profile::sample(&dir, name, duration, &done).await
        }
    };
    let done = profile::counter();
    let (rate, native) = tokio::join!(native_orders(&host, clients, run, done.clone()), sample("native", done));
    let (native_rate, native) = (rate?, native?);
    let done = profile::counter();
    let (rate, wasm) = tokio::join!(
        wasm_orders(&host, clients, run, done.clone(), false),
        sample("wasm", done)
    );
    let (wasm_rate, wasm) = (rate?, wasm?);
    host.shutdown().await?;

    let native_rows = profile::breakdown(&native);
    let wasm_rows = profile::breakdown(&wasm);
    out!("CPU time per command, µs, on every CPU (the host and its Postgres backends), sampled by");
    out!("`perf` at {} Hz for {duration:?} in each run:\n", profile::FREQUENCY);
    out!("| stage | native handler | Wasm handler |");
    out!("| --- | ---: | ---: |");
    for ((label, native), wasm) in profile::labels().zip(&native_rows).zip(&wasm_rows) {
        if *native > 0.0 || *wasm > 0.0 {
            out!("| {label} | {native:.1} | {wasm:.1} |");
        }
    }
    out!(
        "| **total** | **{:.0}** | **{:.0}** |",
        native_rows.iter().sum::<f64>(),
        wasm_rows.iter().sum::<f64>()
    );
    out!("| commands/s over the run | {native_rate:.0} | {wasm_rate:.0} |\n");
    std::fs::create_dir_all(charts)?;
    std::fs::write(
        charts.join("commands-flame.svg"),
        profile::flame_graph(&wasm, "CreateOrder through the Wasm handler: every CPU")?,
    )?;
    out!("![flame graph of the Wasm run](bench/commands-flame.svg)\n");
    Ok(())
}

/// The orders handler's logic in native Rust, in the transaction shape the host gives a
/// Wasm handler: the host's own plugin sessions, outbox writer and commit.
async fn native_orders(host: &obx::app::Host, clients: usize, duration: Duration, done: Arc<AtomicU64>) -> Result<f64> {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        let sessions = host.sessions.clone();
        let done_total = done.clone();
        tasks.spawn(async move {
            let mut done = 0u64;
            while started.elapsed() < duration {
                native_command(&sessions, c).await?;
                done += 1;
                done_total.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(done)
        });
    }
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        total += r??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// One whole native command for caller `c`, in the host's transaction shape: a plugin
/// session's BEGIN, the handler, the outbox row written with the COMMIT.
async fn native_command(sessions: &obx::db::sessions::Sessions, c: usize) -> Result<()> {
    let mut tx = sessions.begin("orders").await?;
    let event = native_create_order(&mut tx, c).await?;
    let rows = obx::outbox::writer::CallRows {
        version: "0.1.0",
        traceparent: TRACEPARENT,
        events: &[event],
    };
    let per_statement = obx::outbox::writer::PerStatement {
        events: 1000,
        payload_bytes: 16 << 20,
    };
    obx::outbox::writer::insert_at_commit(&mut tx, &[rows], per_statement);
    Ok(tx.commit().await?)
}

/// The native handler's work for caller `c`: its input parsed, the order inserted in `tx`,
/// and the event it emits built (the caller writes it, or not).
async fn native_create_order(tx: &mut obx::db::sessions::PluginTx, c: usize) -> Result<obx::outbox::NewEvent> {
    let input: serde_json::Value =
        serde_json::from_str(&json!({ "customerId": format!("c-{c}"), "amount": 10 }).to_string())?;
    let customer = input["customerId"].as_str().unwrap_or_default().to_string();
    let amount = sqlx::types::BigDecimal::from(input["amount"].as_i64().unwrap_or(0));
    let id: uuid::Uuid = sqlx::query_scalar(INSERT_ORDER)
        .bind(None::<uuid::Uuid>)
        .bind(&customer)
        .bind(&amount)
        .bind(json!([]))
        .fetch_one(&mut **tx)
        .await?;
    let payload = json!({
        "orderId": id.to_string(), "customerId": customer,
        "amount": amount.to_string(), "status": "pending", "items": [],
    });
    Ok(obx::outbox::NewEvent {
        event_id: uuid::Uuid::now_v7(),
        aggregate_type: "Order".into(),
        aggregate_id: id.to_string(),
        event_type: "OrderCreated".into(),
        payload: payload.to_string(),
        topic: "order.events".into(),
        partition_key: id.to_string(),
        delay_ms: 0,
    })
}

/// CreateOrder through the dispatcher: a fresh Store per call, the Wasm handler, the
/// host's transaction; with `keys`, each command with an `Idempotency-Key` of its own.
async fn wasm_orders(
    host: &obx::app::Host,
    clients: usize,
    duration: Duration,
    done: Arc<AtomicU64>,
    keys: bool,
) -> Result<f64> {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        let dispatcher = host.dispatcher.clone();
        let done_total = done.clone();
        tasks.spawn(async move {
            let mut done = 0u64;
            while started.elapsed() < duration {
                wasm_command(&dispatcher, c, keys).await?;
                done += 1;
                done_total.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(done)
        });
    }
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        total += r??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// One CreateOrder for caller `c` through the dispatcher (with `key`, with an
/// `Idempotency-Key` of its own).
async fn wasm_command(dispatcher: &obx::dispatch::Dispatcher, c: usize, key: bool) -> Result<()> {
    let request = obx::dispatch::CommandRequest {
        plugin: "orders".into(),
        command: "CreateOrder".into(),
        payload: json!({ "customerId": format!("c-{c}"), "amount": 10 }).to_string(),
        idempotency_key: key.then(|| uuid::Uuid::now_v7().to_string()),
        request_id: String::new(),
        parent_trace: None,
    };
    dispatcher
        .run_command(request)
        .await
        .map_err(|e| anyhow::anyhow!("CreateOrder: {e}"))?;
    Ok(())
}

/// The ten plugins of the memory figure: the examples, the test plugins, and copies of
/// `hotswap` built under other names by `cargo xtask bench`.
const TEN_PLUGINS: [&str; 10] = [
    "orders",
    "inventory",
    "payments",
    "shipping",
    "notifications",
    "testbed",
    "hotswap",
    "bench_extra_a",
    "bench_extra_b",
    "bench_extra_c",
];

/// Resident memory of an `obx serve` process (release build), started from a warm compile
/// cache, after one command: with no plugin, and with ten.
async fn rss() -> Result<()> {
    let obx = std::env::current_exe()?.with_file_name("obx");
    anyhow::ensure!(
        obx.exists(),
        "{} is missing: `cargo xtask bench` builds it",
        obx.display()
    );
    let env = Env::start()?;
    let mut figures = Vec::new();
    for count in [0usize, 10] {
        let dir = tempfile::tempdir()?;
        for name in &TEN_PLUGINS[..count] {
            std::fs::copy(obx_tests::plugin(name), dir.path().join(format!("{name}.wasm")))?;
        }
        let cache = tempfile::tempdir()?;
        let url = env.database().await?;
        let mut measured = (0, 0);
        // The first start fills the compile cache; the second is measured.
        for _ in 0..2 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let mut child = std::process::Command::new(&obx)
                .arg("serve")
                .env_remove("OBX_CONFIG")
                .env("RUST_LOG", "warn")
                .env("DATABASE_URL", &url)
                .env("OBX_KAFKA__BROKERS", &env.broker.bootstrap)
                .env("OBX_KAFKA__CREATE_TOPICS", env.broker.mock.is_none().to_string())
                .env("OBX_HTTP__LISTEN", format!("127.0.0.1:{port}"))
                .env("OBX_PLUGINS__DIR", dir.path())
                .env("OBX_PLUGINS__CACHE_DIR", cache.path())
                .stderr(std::process::Stdio::null())
                .spawn()?;
            let client = reqwest::Client::new();
            let base = format!("http://127.0.0.1:{port}");
            let started = Instant::now();
            loop {
                if let Ok(r) = client.get(format!("{base}/readyz")).send().await {
                    if r.status() == 200 {
                        break;
                    }
                }
                anyhow::ensure!(
                    started.elapsed() < Duration::from_secs(300),
                    "obx serve did not become ready"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if count > 0 {
                let r = client
                    .post(format!("{base}/v1/commands/orders/CreateOrder"))
                    .json(&json!({ "customerId": "c-1", "amount": 10 }))
                    .send()
                    .await?;
                anyhow::ensure!(r.status() == 200, "CreateOrder: {}", r.status());
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            let status = std::fs::read_to_string(format!("/proc/{}/status", child.id()))?;
            let kib = |field: &str| -> u64 {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(field))
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            measured = (kib("VmRSS:"), kib("VmHWM:"));
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            child.wait()?;
        }
        figures.push((count, measured));
    }
    let mib = |kib: u64| kib as f64 / 1024.0;
    let (none, ten) = (figures[0].1, figures[1].1);
    out!("## Host memory\n");
    out!("`obx serve`, release build, started from a warm compile cache, after one command.\n");
    out!("| plugins | RSS | peak RSS |");
    out!("| ---: | ---: | ---: |");
    for (count, (rss, hwm)) in &figures {
        out!("| {count} | {:.1} MiB | {:.1} MiB |", mib(*rss), mib(*hwm));
    }
    out!(
        "\nEach plugin adds about {:.1} MiB ({}).\n",
        mib(ten.0.saturating_sub(none.0)) / 10.0,
        TEN_PLUGINS.join(", ")
    );
    compare(chart::Comparison::plain(
        "rss",
        "Host resident memory",
        "MiB",
        vec![("no plugin".into(), mib(none.0)), ("ten plugins".into(), mib(ten.0))],
    ));
    Ok(())
}

/// Runs every suite, then writes the report and its charts.
async fn report(path: &std::path::Path) -> Result<()> {
    commands(Duration::from_secs(6), 16, 5, false).await?;
    calls::run(5000, 6, calls::Only::Both, false).await?;
    calls::run(2000, 6, calls::Only::Both, true).await?;
    let charts = path.parent().unwrap_or(std::path::Path::new(".")).join("bench");
    profile_commands(Duration::from_secs(8), 16, &charts).await?;
    http::run(Duration::from_secs(10), 16, true).await?;
    relay(100_000, 1000, Duration::from_secs(21)).await?;
    latency(1000, 1, Duration::from_secs(20)).await?;
    latency(1000, 5, Duration::from_secs(20)).await?;
    consume(50_000).await?;
    reload().await?;
    rss().await?;
    timers::run(1000, Duration::from_secs(10)).await?;

    let report = REPORT.lock().unwrap();
    std::fs::create_dir_all(&charts)?;
    let mut doc = String::new();
    doc.push_str(HEADER);
    doc.push_str(&format!(
        "\n**Machine:** {}; Linux {}; {}. Postgres is a throwaway cluster with `fsync=on`; the \
         broker is librdkafka's mock cluster (in process, real Kafka protocol) unless \
         `KAFKA_BROKERS` is set. The load generator shares the machine with the host, Postgres and \
         the broker.\n\n",
        machine(),
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        postgres_version()
    ));
    doc.push_str("## Summary: each figure against its ceiling\n\n");
    doc.push_str("| figure | OBX | ceiling | ratio |\n| --- | ---: | ---: | ---: |\n");
    for c in &report.comparisons {
        if let Some((ceiling, value)) = &c.ceiling {
            for (label, v) in &c.bars {
                doc.push_str(&format!(
                    "| {}: {label} ({}) | {} | {} ({ceiling}) | {} |\n",
                    c.title,
                    c.unit,
                    chart::format_value(*v),
                    chart::format_value(*value),
                    chart::format_ratio(v / value)
                ));
            }
        }
    }
    doc.push('\n');
    for c in &report.comparisons {
        std::fs::write(charts.join(format!("{}.svg", c.stem)), c.svg())?;
        doc.push_str(&format!("![{}](bench/{}.svg)\n\n", c.title, c.stem));
    }
    doc.push_str("## Details\n\n");
    for line in report.markdown.lines() {
        // The suites' headings, one level down; their machine lines are said above.
        if line.starts_with("machine:") {
            continue;
        }
        if line.starts_with('#') {
            doc.push('#');
        }
        doc.push_str(line);
        doc.push('\n');
    }
    doc.push_str(NOTES);
    // Measurements of design changes, kept by hand: each compares two builds, which one run
    // of this tool cannot do.
    if let Ok(changes) = std::fs::read_to_string(charts.join("changes.md")) {
        doc.push('\n');
        doc.push_str(&changes);
    }
    std::fs::write(path, doc)?;
    println!("wrote {} and {}/*.svg", path.display(), charts.display());
    Ok(())
}

fn postgres_version() -> String {
    obx::db::embedded::find_bindir()
        .ok()
        .and_then(|d| {
            std::process::Command::new(d.join("postgres"))
                .arg("--version")
                .output()
                .ok()
        })
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

const HEADER: &str = "# Benchmarks

Written by `cargo xtask bench` (the `obx-bench report` command in `tests/bench`, release
build): every figure below was measured in one run, on one machine, next to its ceiling, and
the charts were drawn by the same run. Re-run it to check them; expect some noise on a shared
2-core machine, more for throughput than for latency.

```sh
cargo xtask bench                               # everything; rewrites this file and docs/bench/
cargo xtask bench -- commands --rounds 9        # one suite, printed only
cargo xtask bench -- calls --calls 10000        # one call's host CPU, Wasm against native
cargo xtask bench -- calls --whole              # the same, each call a whole command, BEGIN to COMMIT
cargo xtask bench -- http --profile             # wrk over HTTP, relay and consumer running
cargo xtask bench -- relay --rows 100000
cargo xtask bench -- latency --rate 1000 --per-command 1
cargo xtask bench -- consume --events 20000
cargo xtask bench -- reload
cargo xtask bench -- rss
cargo xtask bench -- timers --rate 1000 --duration 10s
```
";

const NOTES: &str = "
## Reading the figures

- **Commands.** pgbench runs the handler's statements on the plugin's own login (`BEGIN`,
  the insert, then the outbox row through `obx_api.emit_calls` and `COMMIT` in one round trip, a
  pipeline, as the host sends them) with nothing else: that is what Postgres itself can do
  here. The native handler adds what the host does around any
  handler: a pool, JSON in and out, the session's check and clearing with the commit. The
  Wasm handler adds a fresh instance per call (pooling allocator), the guest's JSON work,
  and the host calls for SQL and emit. The CPU columns are every CPU's busy time and the
  host process's own, divided by the commands: on a shared machine they move less than the
  rate from run to run. The three run in turn, five rounds of 6 s, and the table gives each
  figure's median: pgbench alone has ranged from 1,700 to 7,600 tps within an hour on this
  machine, so a single run of each said more about the neighbours than about OBX.
- **Where a command's CPU goes.** Every CPU is sampled, so the table counts the Postgres
  backends' work for a command next to the host's; each sampled stack goes to the first
  stage whose frames it holds (`tests/bench/profile.rs` lists them). Postgres's own symbols
  are only those it exports, which is enough for the stages named here. The machine is
  saturated in both runs, so the totals are close to 2 CPUs divided by the rate.
- **HTTP.** What a client sees: wrk keeps 16 connections busy while the same host relays
  every row to Kafka and the inventory plugin consumes every `OrderCreated` (its own
  transaction per batch of events, its own outbox row per event). All of it shares the 2
  CPUs with wrk and Postgres. pgbench runs the command's SQL against the same host, whose
  relay and consumer take its events too (all with the partition key `'o'`, so on one shard
  and one partition), but they fall behind it and catch up after: the table says how many
  of pgbench's events the consumer handled during its run. The ratio therefore counts as
  cost the host's HTTP, its command path and nearly all of the consumer's and the relay's
  work (a second plugin call and a second outbox row per command), which the ceiling
  mostly leaves for later.
- **Relay drain.** Per batch of 1,000 the relay claims (index scan, row locks), waits for
  acknowledgements, and marks `published_at`, which writes a new row version and its index
  entries: that, not Kafka, is most of the gap to raw produce. The mark does not wait for
  the disk (a lost mark only means a row is sent again).
- **Latency.** The host records commit-to-ack times in a Prometheus histogram (buckets of
  1, 2, 3, 5, 7.5, 10, 15, 20, 30 ms and up); the quantiles here are interpolated within
  their bucket, as PromQL's `histogram_quantile` does.
- **Consume.** The ceiling is a raw consumer that does nothing with a message. In dedup
  mode OBX runs whatever a lane has queued (up to `consumer.batch_max_events`) in one
  transaction, the batch's dedup rows in one statement and no savepoint between handlers;
  inbox mode stores first (one statement per batch) and handles later, a processor taking a
  key's next events in one transaction.
- **Reload.** Python and JavaScript components are large (an interpreter inside); their
  first compile takes seconds, and the compile cache makes every later load fast.
";
