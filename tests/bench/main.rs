//! `obx-bench`: OBX's benchmarks, each next to its ceiling, measured in one run on one
//! machine. Run them with `cargo xtask bench` (release build).
//!
//! * `relay` — the relay's drain rate over 100,000 stored rows, next to raw rdkafka
//!   producing the same messages to the same broker; commit-to-ack latency at a fixed event
//!   rate; and command throughput with the relay running and without it.
//!
//! Postgres runs as a throwaway cluster with `fsync` on, as in production; Kafka is the
//! librdkafka mock cluster (in memory, real protocol) unless `KAFKA_BROKERS` is set.

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

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
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
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        match cli.bench {
            Bench::Relay { rows, rate, duration } => relay(rows, rate, duration).await,
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
        config
    }
}

async fn relay(rows: u32, rate: u32, duration: Duration) -> Result<()> {
    let env = Env::start()?;
    println!("# Relay benchmark\n");
    println!("machine: {}", machine());
    println!(
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

    let brokers = obx::kafka::Brokers::start(&obx::config::KafkaConfig {
        brokers: env.broker.bootstrap.clone(),
        ..Default::default()
    })?;
    let kafka = obx::config::KafkaConfig::default();
    let producer = obx::outbox::relay::producer(&brokers, &kafka, 1, None)?;
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
    };
    let started = Instant::now();
    let task = tokio::spawn(relay.run());
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NULL")
            .fetch_one(&pool)
            .await?;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let drain = started.elapsed();
    let _ = stop.send(true);
    let _ = task.await;
    let relay_rate = rows as f64 / drain.as_secs_f64();
    let raw_rate = rows as f64 / raw.as_secs_f64();
    println!("## Drain of {rows} stored rows\n");
    println!("| | events/s | time |");
    println!("| --- | ---: | ---: |");
    println!(
        "| raw rdkafka produce (ceiling) | {raw_rate:.0} | {:.2} s |",
        raw.as_secs_f64()
    );
    println!("| OBX relay | {relay_rate:.0} | {:.2} s |", drain.as_secs_f64());
    println!("| ratio | {:.2} | |\n", relay_rate / raw_rate);
    pool.close().await;

    // 2. Command throughput without the relay and with it, then latency at a fixed rate.
    let plugins = tempfile::tempdir()?;
    std::fs::copy(obx_tests::plugin("orders"), plugins.path().join("orders.wasm"))?;
    let mut results = Vec::new();
    for relay_on in [false, true] {
        let url = env.database().await?;
        let mut config = env.config(&url, plugins.path());
        config.relay.enabled = relay_on;
        let host = obx::app::start(config).await?;
        let (done, elapsed) = closed_loop(&host.url(), 16, duration).await?;
        results.push(done as f64 / elapsed.as_secs_f64());
        host.shutdown().await?;
    }
    println!("## Command throughput (CreateOrder, 16 concurrent clients, {duration:?})\n");
    println!("| | commands/s |");
    println!("| --- | ---: |");
    println!("| relay off | {:.0} |", results[0]);
    println!("| relay on | {:.0} |", results[1]);
    println!("| change | {:+.1} % |\n", (results[1] / results[0] - 1.0) * 100.0);

    let url = env.database().await?;
    let config = env.config(&url, plugins.path());
    let host = obx::app::start(config).await?;
    let metrics = obx::telemetry::metrics();
    let sent = open_loop(&host.url(), rate, duration).await?;
    let pool = PgPool::connect(&url).await?;
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NULL")
            .fetch_one(&pool)
            .await?;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let rendered = metrics.render();
    let q = |quantile: &str| -> f64 {
        quantile_of(&rendered, "obx_outbox_commit_to_ack_seconds", quantile).unwrap_or(f64::NAN) * 1000.0
    };
    println!("## Commit-to-ack latency at {rate} events/s for {duration:?} ({sent} commands)\n");
    println!("| p50 | p90 | p99 | p99.9 | max |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    println!(
        "| {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
        q("0.5"),
        q("0.9"),
        q("0.99"),
        q("0.999"),
        q("1")
    );
    host.shutdown().await?;
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
                .headers(row.headers());
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

/// Sends CreateOrder at a fixed rate for `duration`, whatever the latency; returns how many.
async fn open_loop(base: &str, rate: u32, duration: Duration) -> Result<u64> {
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/commands/orders/CreateOrder");
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut sent = 0u64;
    while started.elapsed() < duration {
        tick.tick().await;
        let (client, url) = (client.clone(), url.clone());
        tasks.spawn(async move {
            let body = json!({ "customerId": "c-rate", "amount": 10 });
            client.post(&url).json(&body).send().await.map(|r| r.status().as_u16())
        });
        sent += 1;
    }
    while let Some(r) = tasks.join_next().await {
        let status = r??;
        anyhow::ensure!(status == 200, "command failed: {status}");
    }
    Ok(sent)
}

/// A quantile from Prometheus text output.
fn quantile_of(rendered: &str, metric: &str, quantile: &str) -> Option<f64> {
    let prefix = format!("{metric}{{quantile=\"{quantile}\"}} ");
    rendered
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
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
