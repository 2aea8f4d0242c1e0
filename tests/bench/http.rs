//! The HTTP suite: what a client of the service sees. wrk (a load generator in its own
//! process, as a user would run one) keeps 16 connections busy with
//! `POST /v1/commands/orders/CreateOrder` against a host that also runs its relay and the
//! inventory plugin's consumer of `OrderCreated`; pgbench runs the handler's SQL on the same
//! database in the same run, as the ceiling.

use std::process::Command;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use sqlx::PgPool;

use crate::{chart, compare, cpu, profile, run_pgbench, Env};

/// What wrk measured.
struct Wrk {
    rate: f64,
    p50_ms: f64,
    p99_ms: f64,
}

pub async fn run(duration: Duration, connections: usize, sample: bool) -> Result<()> {
    let env = Env::start()?;
    let plugins = tempfile::tempdir()?;
    for name in ["orders", "inventory"] {
        std::fs::copy(obx_tests::plugin(name), plugins.path().join(format!("{name}.wasm")))?;
    }
    let url = env.database().await?;
    let mut config = env.config(&url, plugins.path());
    config.database.plugin_max_connections = connections as u32;
    let host = obx::app::start(config).await?;
    let pool = PgPool::connect(&url).await?;
    wait_subscribed(&host, &pool).await?;
    let (schema, role, password): (String, String, String) = sqlx::query_as(
        "SELECT p.schema_name, p.role_name, c.password FROM obx.plugin p \
         JOIN obx.plugin_credential c ON c.role_name = p.role_name WHERE p.name = 'orders'",
    )
    .fetch_one(&pool)
    .await?;

    let orders = |pool: &PgPool| {
        let sql = format!("SELECT count(*) FROM \"{schema}\".orders");
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>(&sql).fetch_one(&pool).await }
    };
    let (orders_at_start, consumed_at_start) = (orders(&pool).await?, consumed(&pool).await?);
    let cpu_at_start = cpu::Cpu::now();
    let pgbench = run_pgbench(&env, &url, (&role, &password), connections, duration).await?;
    // pgbench's events go out through the relay and the consumer too: let both finish with
    // them before wrk starts. How far the consumer kept up says what the ceiling includes.
    let before = orders(&pool).await?;
    let pgbench_cpu = cpu_at_start.per_command((before - orders_at_start) as u64);
    let pgbench_consumed = consumed(&pool).await? - consumed_at_start;
    crate::wait_published(&pool).await?;
    wait_consumed(&pool, before).await?;
    let consumed_before = consumed(&pool).await?;
    let batches_before = transactions(&pool).await?;

    let target = format!("{}/v1/commands/orders/CreateOrder", host.url());
    // The measured run is never sampled: perf and the counting below cost the host's CPU,
    // and pgbench's run had neither.
    let cpu_at_wrk = cpu::Cpu::now();
    let wrk = run_wrk(&target, connections, duration).await?;
    let stopped = Instant::now();
    let commands = orders(&pool).await? - before;
    let wrk_cpu = cpu_at_wrk.per_command(commands as u64);
    let consumed_at_stop = consumed(&pool).await? - consumed_before;
    // The consumer's backlog at the end of the run, and how long it took to clear.
    let caught_up = wait_consumed(&pool, consumed_before + commands).await?;
    crate::wait_published(&pool).await?;
    let published = stopped.elapsed();
    let batches = transactions(&pool).await?;
    // Where the CPU goes, from a second run of its own, sampled.
    let window = if sample {
        let scratch = tempfile::tempdir()?;
        let sampling = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            // The orders count is read at the window's ends only: read every 100 ms, as it was,
            // its scans of the growing table were a tenth of Postgres's work in the window.
            let at_start = orders(&pool).await?;
            let mut window = profile::sample(
                scratch.path(),
                "http",
                duration - Duration::from_secs(2),
                &AtomicU64::new(0),
            )
            .await?;
            window.commands = (orders(&pool).await? - at_start).max(0) as u64;
            anyhow::Ok(window)
        };
        let (sampled, window) = tokio::join!(run_wrk(&target, connections, duration), sampling);
        sampled?;
        Some(window?)
    } else {
        None
    };
    host.shutdown().await?;

    out!("## Commands over HTTP: wrk, {connections} connections, {duration:?}, relay and consumer running\n");
    out!("`POST /v1/commands/orders/CreateOrder` (no Idempotency-Key) against a host serving `orders` and");
    out!("`inventory` (which consumes every `OrderCreated`), with {connections} plugin sessions. wrk runs in its");
    out!("own process on the same 2 CPUs.\n");
    out!(
        "| | commands/s | ratio to pgbench | p50 | p99 | CPU per command, every CPU, µs | of it the host process, µs | Postgres, µs | the load generator, µs |"
    );
    out!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    out!(
        "| pgbench, the same SQL on the plugin's login (ceiling) | {pgbench:.0} | 1.00 | | | {:.0} | {:.0} | {:.0} | {:.0} |",
        pgbench_cpu.machine,
        pgbench_cpu.host,
        pgbench_cpu.postgres,
        pgbench_cpu.load
    );
    out!(
        "| OBX over HTTP | {:.0} | {:.2} | {:.1} ms | {:.1} ms | {:.0} | {:.0} | {:.0} | {:.0} |\n",
        wrk.rate,
        wrk.rate / pgbench,
        wrk.p50_ms,
        wrk.p99_ms,
        wrk_cpu.machine,
        wrk_cpu.host,
        wrk_cpu.postgres,
        wrk_cpu.load
    );
    out!(
        "CPU is counted over each run alone: the host process runs the relay and the consumer during \
         pgbench's run too, for pgbench's events, and what a consumer leaves for after a run is in \
         neither row. The host process holds the broker (librdkafka's mock cluster) unless \
         `KAFKA_BROKERS` names one; the load generator is pgbench in the first row, wrk in the \
         second.\n"
    );
    budget(pgbench, pgbench_cpu.postgres, &wrk_cpu);
    out!(
        "{commands} orders were committed; inventory had handled {consumed_at_stop} of their events when wrk \
         stopped, and all of them {:.1} s later; the relay had published every row {:.1} s after the stop.\n",
        caught_up.as_secs_f64(),
        published.as_secs_f64()
    );
    let pgbench_events = (before - orders_at_start).max(1);
    out!(
        "During pgbench's run the consumer handled {pgbench_consumed} of its {pgbench_events} events \
         ({:.0} %), the rest after it; during wrk's, {:.0} %.\n",
        100.0 * pgbench_consumed as f64 / pgbench_events as f64,
        100.0 * consumed_at_stop as f64 / commands.max(1) as f64
    );
    let (events, steps) = (batches.0.since(&batches_before.0), batches.1.since(&batches_before.1));
    out!(
        "Transactions for wrk's commands: the consumer's {} (a mean of {:.1} events each), the relay's \
         marks {} (a mean of {:.1} rows each).\n",
        events.transactions,
        events.per_transaction(),
        steps.transactions,
        steps.per_transaction()
    );
    compare(chart::Comparison::new(
        "http",
        "CreateOrder over HTTP, relay and consumer running",
        "commands/s",
        ("pgbench, same SQL", pgbench),
        vec![("OBX over HTTP (wrk)".into(), wrk.rate)],
    ));
    if let Some(window) = window {
        out!("CPU time per command over HTTP, µs, on every CPU, sampled by `perf` in a second wrk run of");
        out!("its own (the measured run above is not sampled); the relay, the consumer and their Postgres");
        out!("work are in the figures, spread over the stages they run:\n");
        out!("| stage | Wasm handler over HTTP |");
        out!("| --- | ---: |");
        let rows = profile::breakdown(&window);
        for (label, us) in profile::labels().zip(&rows) {
            if *us > 0.0 {
                out!("| {label} | {us:.1} |");
            }
        }
        out!("| **total** | **{:.0}** |\n", rows.iter().sum::<f64>());
    }
    Ok(())
}

/// What the target, 0.70× pgbench over HTTP, leaves a command of every CPU, against
/// what the run's commands took outside the host process.
fn budget(pgbench: f64, pgbench_postgres: f64, wrk: &cpu::PerCommand) {
    const TARGET: f64 = 0.70;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let allowed = cpus as f64 * 1e6 / (TARGET * pgbench);
    let outside = wrk.postgres + wrk.load;
    let left = if outside <= allowed {
        format!("leaving {:.0} µs", allowed - outside)
    } else {
        format!("{:.0} µs past it", outside - allowed)
    };
    out!(
        "At {TARGET:.2}× pgbench ({:.0} commands/s) these {cpus} CPUs allow {allowed:.0} µs of CPU per \
         command, everything included. Outside the host process, each command over HTTP took \
         {:.0} µs of Postgres and {:.0} µs of wrk ({outside:.0} µs together, {:.0} % of the \
         allowance, {left}); the host, with the handler, the relay and the consumer, took {:.0}.\n",
        TARGET * pgbench,
        wrk.postgres,
        wrk.load,
        100.0 * outside / allowed,
        wrk.host
    );
    let most = cpus as f64 * 1e6 / outside.max(1.0);
    out!(
        "At this run's cost per command outside the host, even a host that took no CPU at all \
         could serve {:.0} commands/s here, {:.2}× pgbench. Per command, Postgres ran {:.1}× the \
         CPU of a pgbench transaction: the command's statements with the plugin session's checks \
         and clearing, the consumer's transaction for its event and the relay's mark, where \
         pgbench's figure has only the part of the consumer's and relay's work for its events \
         done during its run. pgbench runs first, so what its inserts leave Postgres to do \
         (autovacuum, a checkpoint) falls in wrk's run.\n",
        most,
        most / pgbench,
        wrk.postgres / pgbench_postgres.max(1.0)
    );
}

/// Waits until the inventory consumer handles events: one order goes through the whole
/// path first, so that the run measures a consumer at work rather than one still joining.
async fn wait_subscribed(host: &obx::app::Host, pool: &PgPool) -> Result<()> {
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{}/v1/commands/orders/CreateOrder", host.url()))
        .json(&serde_json::json!({ "customerId": "c-warm-up", "amount": 1 }))
        .send()
        .await?;
    anyhow::ensure!(r.status() == 200, "the warm-up command failed: {}", r.status());
    wait_consumed(pool, 1).await.map(drop)
}

/// Events the dedup consumer has handled.
async fn consumed(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM obx.processed_event")
        .fetch_one(pool)
        .await?)
}

/// Rows and the transactions that wrote them: the consumer's dedup records, and the relay's
/// marks of published outbox rows. Transaction ids only grow, so the difference of two
/// readings counts the transactions in between.
async fn transactions(pool: &PgPool) -> Result<(Written, Written)> {
    let count = |sql: &'static str| async move {
        let (rows, transactions) = sqlx::query_as::<_, (i64, i64)>(sql).fetch_one(pool).await?;
        Ok::<_, sqlx::Error>(Written { rows, transactions })
    };
    Ok((
        count("SELECT count(*), count(DISTINCT xmin::text) FROM obx.processed_event").await?,
        count("SELECT count(*), count(DISTINCT xmin::text) FROM obx.outbox_event WHERE published_at IS NOT NULL")
            .await?,
    ))
}

/// Rows of one table, and the transactions that wrote them.
struct Written {
    rows: i64,
    transactions: i64,
}

impl Written {
    fn since(&self, earlier: &Written) -> Written {
        Written {
            rows: self.rows - earlier.rows,
            transactions: self.transactions - earlier.transactions,
        }
    }

    fn per_transaction(&self) -> f64 {
        self.rows as f64 / self.transactions.max(1) as f64
    }
}

/// Waits for the consumer to have handled `total` events; returns how long that took.
async fn wait_consumed(pool: &PgPool, total: i64) -> Result<Duration> {
    let started = Instant::now();
    while consumed(pool).await? < total {
        if started.elapsed() > Duration::from_secs(300) {
            bail!("the consumer did not catch up within 5 minutes");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(started.elapsed())
}

/// Runs wrk with a POST of one CreateOrder body on every request.
async fn run_wrk(url: &str, connections: usize, duration: Duration) -> Result<Wrk> {
    let script = tempfile::Builder::new().suffix(".lua").tempfile()?;
    std::fs::write(
        script.path(),
        "wrk.method = \"POST\"\n\
         wrk.body = '{\"customerId\":\"c-1\",\"amount\":10}'\n\
         wrk.headers[\"Content-Type\"] = \"application/json\"\n",
    )?;
    let mut cmd = Command::new("wrk");
    cmd.args(["--latency", "-t", "2", "-c", &connections.to_string()])
        .args(["-d", &format!("{}s", duration.as_secs().max(1)), "-s"])
        .arg(script.path())
        .arg(url);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await?
        .context("running wrk (Debian: apt-get install wrk)")?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() {
        bail!("wrk failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    }
    parse_wrk(&text)
}

fn parse_wrk(text: &str) -> Result<Wrk> {
    if let Some(line) = text.lines().find(|l| l.contains("Non-2xx or 3xx responses")) {
        bail!("commands failed over HTTP: {}", line.trim());
    }
    if let Some(line) = text.lines().find(|l| l.contains("Socket errors")) {
        bail!("wrk saw socket errors: {}", line.trim());
    }
    let rate = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no Requests/sec in wrk's output: {text}"))?;
    let percentile = |p: &str| -> Result<f64> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(p))
            .and_then(|v| milliseconds(v.trim()))
            .with_context(|| format!("no {p} latency in wrk's output: {text}"))
    };
    Ok(Wrk {
        rate,
        p50_ms: percentile("50%")?,
        p99_ms: percentile("99%")?,
    })
}

/// wrk's durations: `812.00us`, `4.21ms`, `1.02s`, `2.00m`.
fn milliseconds(v: &str) -> Option<f64> {
    let split = v.find(|c: char| c.is_ascii_alphabetic())?;
    let (n, unit) = v.split_at(split);
    let n: f64 = n.parse().ok()?;
    Some(match unit {
        "us" => n / 1000.0,
        "ms" => n,
        "s" => n * 1000.0,
        "m" => n * 60_000.0,
        _ => return None,
    })
}
