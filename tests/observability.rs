//! What operators see: Prometheus series that move as events flow, and one W3C trace
//! followed from an HTTP command, through the outbox and Kafka, into the span of the handler
//! of the event it caused. A binary of its own: it installs the process's tracing subscriber
//! and reads the process-wide metrics.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use obx_tests::{
    consume, eventually, metric_value, producer, send_event, send_event_with_id, spawn_host, spawn_host_with, TestHost,
};
use serde_json::json;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// Spans as they were opened: name and fields.
type Spans = Arc<Mutex<Vec<(String, HashMap<String, String>)>>>;

/// Events at WARN and above, as text: target and fields.
type Events = Arc<Mutex<Vec<String>>>;

struct Capture(Spans, Events);

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &tracing::span::Attributes<'_>, _: &tracing::span::Id, _: Context<'_, S>) {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        self.0
            .lock()
            .unwrap()
            .push((attrs.metadata().name().to_string(), fields));
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() > tracing::Level::WARN {
            return;
        }
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        self.1
            .lock()
            .unwrap()
            .push(format!("{} {fields:?}", event.metadata().target()));
    }
}

fn captured() -> &'static (Spans, Events) {
    static CAPTURED: OnceLock<(Spans, Events)> = OnceLock::new();
    CAPTURED.get_or_init(|| {
        let (spans, events) = (Spans::default(), Events::default());
        let subscriber = tracing_subscriber::registry().with(Capture(spans.clone(), events.clone()));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this binary");
        (spans, events)
    })
}

fn spans() -> Spans {
    captured().0.clone()
}

fn events() -> Events {
    captured().1.clone()
}

#[tokio::test]
async fn one_traceparent_is_followed_from_the_http_command_to_the_event_handler() {
    let spans = spans();
    let host = spawn_host(&["orders", "inventory"]).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{caller_span}-01");
    let answer = host
        .request(
            "orders",
            "CreateOrder",
            json!({ "customerId": "t", "amount": 5 }).to_string().into_bytes(),
            &[("content-type", "application/json"), ("traceparent", &traceparent)],
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    let returned = answer.headers["traceparent"].to_str().unwrap().to_string();
    assert!(returned.starts_with(&format!("00-{trace_id}-")), "{returned}");
    let command_span = returned.split('-').nth(2).unwrap().to_string();

    // The command's span: our trace, our span as its parent.
    let find = |name: &str, field: &str, value: &str| {
        spans
            .lock()
            .unwrap()
            .iter()
            .find(|(n, f)| n == name && f.get(field).map(String::as_str) == Some(value))
            .cloned()
    };
    let (_, command) = find("command", "span_id", &command_span).expect("a command span");
    assert_eq!(command["trace_id"], trace_id);
    assert_eq!(command["parent_span_id"], caller_span);

    // The outbox row and the Kafka message carry the command's span as the parent.
    let stored: Option<String> = sqlx::query_scalar("SELECT traceparent FROM obx.outbox_event")
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert_eq!(stored.as_deref(), Some(returned.as_str()));
    let messages = consume(
        &host.host.brokers.bootstrap,
        &host.topic("order.events"),
        1,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(messages[0].header("traceparent"), Some(returned.as_str()));

    // The inventory handler's span: same trace, the command's span as its parent.
    eventually(Duration::from_secs(30), "the event handler's span", || async {
        find("event", "parent_span_id", &command_span).is_some()
    })
    .await;
    let (_, event) = find("event", "parent_span_id", &command_span).unwrap();
    assert_eq!(event["trace_id"], trace_id);
    assert_eq!(event["plugin"], "inventory");
    assert_eq!(event["event_type"], "OrderCreated");
    host.shutdown().await;
}

/// Sum of the samples of a metric whose labels contain `labels`.
fn sample(metrics: &str, name: &str, labels: &str) -> Option<f64> {
    let mut found = None;
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let metric = series.split('{').next().unwrap_or(series);
        if metric == name && series.contains(labels) {
            *found.get_or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    found
}

#[tokio::test]
async fn metrics_move_as_events_flow() {
    let _ = spans();
    let host = spawn_host(&["orders", "testbed"]).await;
    let before = host.get("/metrics").await.text;
    let p = producer(&host.host.brokers.bootstrap);

    // Commands (one that traps), events (one of them twice, one that fails until parked).
    for i in 0..5 {
        let a = host
            .command(
                "orders",
                "CreateOrder",
                json!({ "customerId": format!("m{i}"), "amount": 1 }),
            )
            .await;
        assert_eq!(a.status, 200);
    }
    assert_eq!(host.command("testbed", "trap", json!({ "id": "t" })).await.status, 500);
    // A repeated Idempotency-Key: the second answer is a replay, counted as one.
    let key = uuid::Uuid::new_v4().to_string();
    let order = json!({ "customerId": "keyed", "amount": 1 });
    for _ in 0..2 {
        let a = host
            .command_with_key("orders", "CreateOrder", order.clone(), &key)
            .await;
        assert_eq!(a.status, 200, "{}", a.text);
    }
    let id = uuid::Uuid::new_v4();
    for _ in 0..2 {
        send_event_with_id(&p, &host.topic("testbed.events"), "k", "Thing", &json!({}), id).await;
    }
    send_event(
        &p,
        &host.topic("testbed.events"),
        "poison",
        "Thing",
        &json!({ "reject": true }),
    )
    .await;
    send_event(&p, &host.topic("testbed.inbox"), "i", "Thing", &json!({})).await;

    let moved = |name: &'static str, labels: &'static str| {
        let before = sample(&before, name, labels).unwrap_or(0.0);
        move |now: &str| sample(now, name, labels).is_some_and(|v| v > before)
    };
    let moved_by = |by: f64, name: &'static str, labels: &'static str| {
        let before = sample(&before, name, labels).unwrap_or(0.0);
        move |now: &str| sample(now, name, labels).is_some_and(|v| v >= before + by)
    };
    type Check = Box<dyn Fn(&str) -> bool>;
    let checks: Vec<(&str, Check)> = vec![
        ("outbox published", Box::new(moved("obx_outbox_published_total", ""))),
        (
            "commit-to-ack latency",
            Box::new(moved("obx_outbox_commit_to_ack_seconds_count", "")),
        ),
        (
            // A histogram (aggregatable across hosts), not a summary.
            "commit-to-ack histogram buckets",
            Box::new(moved("obx_outbox_commit_to_ack_seconds_bucket", "le=\"+Inf\"")),
        ),
        (
            "outbox backlog",
            Box::new(|m: &str| sample(m, "obx_outbox_backlog", "").is_some()),
        ),
        (
            "oldest unpublished",
            Box::new(|m: &str| sample(m, "obx_outbox_oldest_unpublished_seconds", "").is_some()),
        ),
        (
            "consumer lag",
            Box::new(|m: &str| sample(m, "obx_consumer_lag", "plugin=\"testbed\"").is_some()),
        ),
        (
            "dedup hits",
            Box::new(moved("obx_consumer_dedup_hits_total", "plugin=\"testbed\"")),
        ),
        (
            "inbox backlog",
            Box::new(|m: &str| sample(m, "obx_inbox_backlog", "plugin=\"testbed\"").is_some()),
        ),
        (
            "dead letters",
            Box::new(|m: &str| sample(m, "obx_dead_letters_parked", "plugin=\"testbed\"") == Some(1.0)),
        ),
        (
            "plugin calls",
            Box::new(moved("obx_plugin_calls_total", "plugin=\"orders\"")),
        ),
        (
            "plugin latency",
            Box::new(moved("obx_plugin_call_duration_seconds_count", "plugin=\"orders\"")),
        ),
        (
            "plugin traps",
            Box::new(moved("obx_plugin_traps_total", "plugin=\"testbed\",kind=\"trap\"")),
        ),
        (
            "plugin loads",
            Box::new(|m: &str| sample(m, "obx_plugin_loads_total", "plugin=\"orders\"").is_some()),
        ),
        (
            // Counted through the plugin's own handles: at least these five, under their
            // command (another test of this binary may add its own).
            "commands that succeeded",
            Box::new(moved_by(
                5.0,
                "obx_commands_total",
                "plugin=\"orders\",command=\"CreateOrder\",outcome=\"ok\"",
            )),
        ),
        (
            "command latency",
            Box::new(moved_by(5.0, "obx_command_duration_seconds_count", "plugin=\"orders\"")),
        ),
        (
            "commands replayed",
            Box::new(moved(
                "obx_commands_total",
                "plugin=\"orders\",command=\"CreateOrder\",outcome=\"replayed\"",
            )),
        ),
        (
            "commands that failed",
            Box::new(moved(
                "obx_commands_total",
                "plugin=\"testbed\",command=\"trap\",outcome=\"plugin_trap\"",
            )),
        ),
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let now = loop {
        let now = host.get("/metrics").await.text;
        if checks.iter().all(|(_, check)| check(&now)) || tokio::time::Instant::now() > deadline {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let failing: Vec<&str> = checks
        .iter()
        .filter(|(_, check)| !check(&now))
        .map(|(name, _)| *name)
        .collect();
    assert!(failing.is_empty(), "series that did not move: {failing:?}\n{now}");

    // And the status summary reports the same state.
    let status = host.get("/v1/status").await.body;
    assert_eq!(status["ready"], true);
    let testbed = status["consumption"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["plugin"] == "testbed")
        .unwrap()
        .clone();
    assert_eq!(testbed["dead_letters"], 1, "{status}");
    assert!(status["plugins"].as_array().unwrap().len() >= 2);
    host.shutdown().await;
}

/// Plugin and command names that no loaded plugin knows add no metric series: a client
/// making names up would otherwise grow the host's memory, and every scrape, without bound.
#[tokio::test]
async fn made_up_plugin_and_command_names_add_no_metric_series() {
    let host = spawn_host(&["testbed"]).await;
    for i in 0..20 {
        let answer = host.command(&format!("madeup{i}"), "x", json!({})).await;
        assert_eq!(answer.status, 404, "{}", answer.text);
        let answer = host.command("testbed", &format!("madeup{i}"), json!({})).await;
        assert_eq!(answer.status, 404, "{}", answer.text);
    }
    let rendered = obx::telemetry::metrics().render();
    assert!(!rendered.contains("madeup"), "a made-up name became a label");
    assert!(
        metric_value(r#"obx_commands_total{plugin="testbed",command="unknown",outcome="unknown_command"}"#) >= 20.0,
        "{rendered}"
    );
    host.shutdown().await;
}

/// A host with the testbed plugin whose calls wait for the tests' locks (20 s) rather than
/// failing, so that a statement or a commit can be made slow on purpose.
async fn patient_host() -> Arc<TestHost> {
    // The log is captured from before the host starts.
    events();
    let host = spawn_host_with(&["testbed"], |c| {
        c.limits.lock_timeout = Duration::from_secs(20);
        c.limits.statement_timeout = Duration::from_secs(20);
        c.limits.call_deadline = Duration::from_secs(20);
    })
    .await;
    Arc::new(host)
}

/// Sends the testbed command `emit` with `body` (and `key` as its Idempotency-Key, if any)
/// while another session holds `lock` (a `LOCK TABLE`) for 1.3 s, longer than the slow
/// threshold; asserts it answered 200, and returns the log line of the slow `step`.
async fn slow_step(
    host: &Arc<TestHost>,
    lock: &str,
    body: serde_json::Value,
    key: Option<&'static str>,
    step: &str,
) -> String {
    let events = events();
    let mut held = host.db.begin().await.unwrap();
    sqlx::query(lock).execute(&mut *held).await.unwrap();
    let call = {
        let host = host.clone();
        tokio::spawn(async move {
            match key {
                Some(key) => host.command_with_key("testbed", "emit", body, key).await,
                None => host.command("testbed", "emit", body).await,
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    held.commit().await.unwrap();
    let answer = call.await.unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text);
    let logged = events.lock().unwrap().join("\n");
    let wanted = format!("\"step\": \"{step}\"");
    let line = logged
        .lines()
        .find(|l| l.contains("a plugin session's round trip was slow") && l.contains(&wanted));
    assert!(line.is_some(), "no slow {step} line: {logged}");
    logged
}

/// A slow commit is logged, by the host, without the values it carried: a commit's round
/// trip holds the events' payloads as text, which a database driver's slow-statement log
/// would print whole.
#[tokio::test]
async fn a_slow_commit_is_logged_without_the_payloads_it_carried() {
    let host = patient_host().await;
    let marker = "card-4111-1111-kept-out-of-logs";
    // The commit's outbox insert waits for the lock.
    let body = json!({ "id": "slow", "payload": { "card": marker } });
    let logged = slow_step(&host, "LOCK TABLE obx.outbox_event IN SHARE MODE", body, None, "commit").await;
    let stored = host
        .count(&format!(
            "SELECT count(*) FROM obx.outbox_event WHERE payload->>'card' = '{marker}'"
        ))
        .await;
    assert_eq!(stored, 1, "the event was committed");
    assert!(!logged.contains(marker), "a payload reached the log: {logged}");
}

/// A slow `BEGIN` (here, an `Idempotency-Key` claim that waits for a lock) is logged as the
/// commit is: its duration, not the key it carried.
#[tokio::test]
async fn a_slow_begin_is_logged_without_the_key_it_claimed() {
    let host = patient_host().await;
    let key = "key-of-customer-7-kept-out-of-logs";
    // The claim's insert waits for the lock.
    let body = json!({ "id": "claimed", "payload": {} });
    let lock = "LOCK TABLE obx.idempotency_key IN EXCLUSIVE MODE";
    let logged = slow_step(&host, lock, body, Some(key), "begin").await;
    let claimed = host
        .count(&format!("SELECT count(*) FROM obx.idempotency_key WHERE key = '{key}'"))
        .await;
    assert_eq!(claimed, 1, "the key was claimed and answered");
    assert!(!logged.contains(key), "an Idempotency-Key reached the log: {logged}");
}

/// A slow plugin statement is logged with the start of its text and the plugin's name, and
/// without the values bound to it.
#[tokio::test]
async fn a_slow_plugin_statement_is_logged_without_its_values() {
    let events = events();
    let host = patient_host().await;
    let marker = "secret-name-kept-out-of-logs";
    sqlx::query("INSERT INTO testbed.counters (name, n) VALUES ($1, 0)")
        .bind(marker)
        .execute(&host.db)
        .await
        .unwrap();
    let mut lock = host.db.begin().await.unwrap();
    sqlx::query("SELECT n FROM testbed.counters WHERE name = $1 FOR UPDATE")
        .bind(marker)
        .execute(&mut *lock)
        .await
        .unwrap();
    // Waits for the test's lock.
    let statement = "UPDATE counters SET n = n + 1 WHERE name = $1";
    let call = {
        let host = host.clone();
        tokio::spawn(async move {
            let sql = json!({ "id": "s", "mode": "execute", "sql": statement, "params": [marker] });
            host.command("testbed", "sql", sql).await
        })
    };
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    lock.commit().await.unwrap();
    let answer = call.await.unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text);
    let logged = events.lock().unwrap().join("\n");
    let line = logged
        .lines()
        .find(|l| l.contains("a plugin statement was slow") && l.contains(statement));
    let line = line.unwrap_or_else(|| panic!("no slow-statement line: {logged}"));
    assert!(line.contains("\"plugin\": \"testbed\""), "{line}");
    assert!(!logged.contains(marker), "a bound value reached the log: {logged}");
}
