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
    obx::telemetry::init_logging();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        match cli.bench {
            Bench::Relay { rows, rate, duration } => relay(rows, rate, duration).await,
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

    let kafka = obx::config::KafkaConfig {
        brokers: env.broker.bootstrap.clone(),
        // The mock cluster creates topics on first use, and does not serve CreateTopics.
        create_topics: env.broker.mock.is_none(),
        ..Default::default()
    };
    let brokers = obx::kafka::Brokers::start(&kafka)?;
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
        owns_all: Default::default(),
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
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let results = [median(&mut off), median(&mut on)];
    println!(
        "## Command throughput (CreateOrder, 16 concurrent clients, 3 runs of {:?} each, medians)\n",
        duration / 3
    );
    println!("| | commands/s | runs |");
    println!("| --- | ---: | --- |");
    println!(
        "| relay off | {:.0} | {} |",
        results[0],
        off.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ")
    );
    println!(
        "| relay on | {:.0} | {} |",
        results[1],
        on.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ")
    );
    println!("| change | {:+.1} % | |\n", (results[1] / results[0] - 1.0) * 100.0);

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

async fn consume(events: u32) -> Result<()> {
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let env = Env::start()?;
    println!("# Consumption benchmark\n");
    println!("machine: {}\n", machine());
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
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let span: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM max(at) - min(at))::float8 FROM testbed.effects WHERE topic = $1",
        )
        .bind(topic)
        .fetch_one(&pool)
        .await?;
        rates.push((mode, (events - 1) as f64 / span));
    }
    host.shutdown().await?;
    println!("## {events} events, 100 keys, 8 partitions; the handler inserts one row per event\n");
    println!("| | events/s | ratio to raw |");
    println!("| --- | ---: | ---: |");
    println!("| raw rdkafka consume (ceiling) | {raw_rate:.0} | 1.00 |");
    for (mode, rate) in rates {
        println!(
            "| OBX consume + {mode} + handler | {rate:.0} | {:.3} |",
            rate / raw_rate
        );
    }
    Ok(())
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
    let body = json!({ "id": "lat", "topic": "bench.latency", "count": per_command });
    let sent = open_loop_with(
        &format!("{}/v1/commands/testbed/emit", host.url()),
        body,
        commands,
        duration,
    )
    .await?;
    let pool = PgPool::connect(&url).await?;
    wait_published(&pool).await?;
    let rendered = obx::telemetry::metrics().render();
    let q = |quantile: &str| {
        quantile_of(&rendered, "obx_outbox_commit_to_ack_seconds", quantile).unwrap_or(f64::NAN) * 1000.0
    };
    println!("## Commit-to-ack latency at {rate} events/s: {commands} commands/s of {per_command} events, {duration:?} ({sent} commands)\n");
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
    println!("# Hot reload benchmark\n");
    println!("machine: {}\n", machine());
    println!("From the atomic rename into the watched directory to the first command answered by the");
    println!("new version (debounce: 50 ms). \"Compiled\": an empty compile cache; \"from the cache\": the");
    println!("same file again after a delete.\n");
    println!("| plugin | language | size | compiled | from the cache |");
    println!("| --- | --- | ---: | ---: | ---: |");
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
        println!(
            "| {plugin} | {language} | {:.1} MB | {:.2} s | {:.3} s |",
            size as f64 / 1e6,
            times[0].as_secs_f64(),
            times[1].as_secs_f64()
        );
        host.shutdown().await?;
    }
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
    let body = json!({ "customerId": "c-rate", "amount": 10 });
    open_loop_with(&format!("{base}/v1/commands/orders/CreateOrder"), body, rate, duration).await
}

/// Posts `body` to `url` at a fixed rate for `duration`, whatever the latency.
async fn open_loop_with(url: &str, body: serde_json::Value, rate: u32, duration: Duration) -> Result<u64> {
    let client = reqwest::Client::new();
    let url = url.to_string();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut sent = 0u64;
    while started.elapsed() < duration {
        tick.tick().await;
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        tasks.spawn(async move { client.post(&url).json(&body).send().await.map(|r| r.status().as_u16()) });
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
