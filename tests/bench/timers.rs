//! The timers suite: how late timers fire at a steady rate, and what 100,000 pending timers
//! cost a host while none is due.

use std::time::{Duration, Instant};

use anyhow::Result;
use sqlx::PgPool;

use crate::{chart, compare, Env};

/// Fires `rate` timers a second for `duration`, due one after another, and reports how late
/// each fired (from its due time to its handler's insert); then leaves 100,000 timers pending,
/// due in an hour, and compares the machine's CPU over 10 s with the same host idle.
pub async fn run(rate: u32, duration: Duration) -> Result<()> {
    let env = Env::start()?;
    let plugins = tempfile::tempdir()?;
    std::fs::copy(obx_tests::plugin("testbed"), plugins.path().join("testbed.wasm"))?;
    let url = env.database().await?;
    let config = env.config(&url, plugins.path());
    let host = obx::app::start(config).await?;
    let pool = PgPool::connect(&url).await?;
    // Past the host's start (consumers joining, the relay's first steps).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = machine_cpu(Duration::from_secs(10)).await?;
    schedule(&pool, 100_000, Duration::from_secs(3600), rate).await?;
    // The steady state: the bulk insert's own aftermath (autovacuum and analyze of the new
    // rows, hint bits) is not what pending timers cost.
    sqlx::query("VACUUM ANALYZE obx.timer").execute(&pool).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pending = machine_cpu(Duration::from_secs(10)).await?;
    sqlx::query("DELETE FROM obx.timer").execute(&pool).await?;

    let count = (u64::from(rate) * duration.as_secs()).max(1) as i64;
    let started = Instant::now();
    schedule(&pool, count, Duration::from_secs(1), rate).await?;
    loop {
        let fired: i64 = sqlx::query_scalar("SELECT count(*) FROM testbed.timers_fired")
            .fetch_one(&pool)
            .await?;
        if fired >= count || started.elapsed() > duration + Duration::from_secs(120) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (fired, p50, p99, max): (i64, f64, f64, f64) = sqlx::query_as(
        "SELECT count(*), \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM at - due_at)::float8) * 1000, \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM at - due_at)::float8) * 1000, \
                (max(extract(epoch FROM at - due_at)) * 1000)::float8 \
         FROM testbed.timers_fired",
    )
    .fetch_one(&pool)
    .await?;
    let early: i64 = sqlx::query_scalar("SELECT count(*) FROM testbed.timers_fired WHERE at < due_at")
        .fetch_one(&pool)
        .await?;

    out!("## Timers: firing lateness at {rate} timers/s for {duration:?} ({fired} of {count} fired)\n");
    out!("From each timer's due time to its handler's insert (the testbed records `clock_timestamp()`).\n");
    out!("| p50 | p99 | max | fired before their due time |");
    out!("| ---: | ---: | ---: | ---: |");
    out!("| {p50:.1} ms | {p99:.1} ms | {max:.1} ms | {early} |\n");
    compare(chart::Comparison::plain(
        "timer-lateness",
        &format!("Timer firing lateness at {rate} timers/s"),
        "ms",
        vec![("p50".into(), p50), ("p99".into(), p99)],
    ));
    out!("### Timers: 100,000 pending, none due\n");
    out!("The whole machine's CPU over 10 s (every process: the host, Postgres, the broker), with the host idle and then with 100,000 timers pending an hour ahead.\n");
    out!("| host idle | 100,000 timers pending |");
    out!("| ---: | ---: |");
    out!("| {:.1} % | {:.1} % |\n", idle * 100.0, pending * 100.0);
    pool.close().await;
    host.shutdown().await?;
    Ok(())
}

/// Inserts `count` testbed timers directly, as committed schedules: the first due
/// `first_due` from now, the next ones `1/rate` s apart.
async fn schedule(pool: &PgPool, count: i64, first_due: Duration, rate: u32) -> Result<()> {
    sqlx::query(
        "INSERT INTO obx.timer (plugin, name, key, due_at, payload) \
         SELECT 'testbed', 'bench', 'k' || g, \
                clock_timestamp() + make_interval(secs => $2 + g::float8 / $3), '{}' \
         FROM generate_series(1, $1) g",
    )
    .bind(count)
    .bind(first_due.as_secs_f64())
    .bind(f64::from(rate.max(1)))
    .execute(pool)
    .await?;
    Ok(())
}

/// The share of the machine's CPU time that was busy over `window` (/proc/stat).
async fn machine_cpu(window: Duration) -> Result<f64> {
    fn sample() -> Result<(u64, u64)> {
        let stat = std::fs::read_to_string("/proc/stat")?;
        let fields: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        let total: u64 = fields.iter().sum();
        let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
        Ok((total, idle))
    }
    let (total0, idle0) = sample()?;
    tokio::time::sleep(window).await;
    let (total1, idle1) = sample()?;
    let total = total1.saturating_sub(total0).max(1);
    Ok(1.0 - idle1.saturating_sub(idle0) as f64 / total as f64)
}
