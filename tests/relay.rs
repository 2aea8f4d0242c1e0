//! The outbox relay against a real Kafka-protocol broker: the librdkafka mock cluster by
//! default, or the broker in `KAFKA_BROKERS`. Each test's host has a topic prefix of its own
//! on an external broker, so tests can share one.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use obx_tests::{
    broker, consume, eventually, metric_value, murmur2_partition, run_kafkajs, spawn_host, spawn_host_with,
    test_config, Received, TestBroker, TestHost,
};
use serde_json::json;

/// One of the testbed's declared topics (it may emit to no others).
fn topic(name: &str) -> String {
    format!("testbed.{name}")
}

/// Messages, in the order the broker holds them (a key lives in one partition), whose `seq`
/// is not above the previous one of their key; a second copy of an event (at least once)
/// is skipped.
fn key_order_violations(messages: &[Received]) -> usize {
    let mut sorted: Vec<&Received> = messages.iter().collect();
    sorted.sort_by_key(|m| (m.partition, m.offset));
    let mut seen: HashSet<&str> = HashSet::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut violations = 0;
    for m in sorted {
        if !seen.insert(m.header("eventId").unwrap()) {
            continue;
        }
        let seq = m.json()["seq"].as_i64().unwrap();
        if last.insert(m.key.as_deref().unwrap(), seq).is_some_and(|p| p >= seq) {
            violations += 1;
        }
    }
    violations
}

async fn unpublished(host: &TestHost) -> i64 {
    host.count("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NULL")
        .await
}

async fn all_published(host: &TestHost, total: i64) {
    eventually(Duration::from_secs(30), "every row published", || async {
        host.count("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NOT NULL")
            .await
            == total
    })
    .await;
}

#[tokio::test]
async fn every_committed_row_is_published_once_with_key_value_and_headers() {
    let host = spawn_host(&["orders"]).await;
    let bootstrap = host.host.brokers.bootstrap.clone();
    let mut order_ids = HashSet::new();
    for i in 0..20 {
        let a = host
            .command(
                "orders",
                "CreateOrder",
                json!({ "customerId": format!("c-{i}"), "amount": 10 }),
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.text);
        order_ids.insert(a.body["orderId"].as_str().unwrap().to_string());
    }
    all_published(&host, 20).await;

    // The seed's topic. With an external broker other tests may write here too: keep ours.
    let messages = consume(
        &bootstrap,
        &host.topic("order.events"),
        usize::MAX,
        Duration::from_secs(5),
    )
    .await;
    let ours: Vec<_> = messages
        .iter()
        .filter(|m| m.key.as_ref().is_some_and(|k| order_ids.contains(k)))
        .collect();
    assert_eq!(ours.len(), 20, "each committed row once");
    let rows: Vec<(uuid::Uuid, String, String)> =
        sqlx::query_as("SELECT event_id, partition_key, payload::text FROM obx.outbox_event")
            .fetch_all(&host.db)
            .await
            .unwrap();
    for (event_id, key, payload) in rows {
        let m = ours
            .iter()
            .find(|m| m.header("eventId") == Some(&event_id.to_string()))
            .expect("published");
        assert_eq!(m.key.as_deref(), Some(key.as_str()));
        assert_eq!(m.json(), serde_json::from_str::<serde_json::Value>(&payload).unwrap());
        assert_eq!(m.header("eventType"), Some("OrderCreated"));
        assert_eq!(m.header("aggregateType"), Some("Order"));
        assert_eq!(m.header("aggregateId"), Some(key.as_str()));
        assert_eq!(m.header("obx-plugin"), Some("orders"), "the emitting plugin is named");
    }
    host.shutdown().await;
}

#[tokio::test]
async fn a_rolled_back_command_publishes_nothing() {
    let host = spawn_host(&["testbed"]).await;
    let bootstrap = host.host.brokers.bootstrap.clone();
    let t = topic("rollback");
    for command in ["fail", "trap", "reject"] {
        let a = host
            .command("testbed", "emit", json!({ "id": command, "topic": t, "count": 1 }))
            .await;
        assert_eq!(a.status, 200);
        // The same events, from a call that then fails.
        let a = host
            .command("testbed", command, json!({ "id": format!("{command}-x") }))
            .await;
        assert!(a.status >= 400);
    }
    all_published(&host, 3).await;
    let messages = consume(&bootstrap, &host.topic(&t), usize::MAX, Duration::from_secs(3)).await;
    assert_eq!(messages.len(), 3, "only the three committed events");
    let testbed_topic = consume(
        &bootstrap,
        &host.topic("testbed.events"),
        usize::MAX,
        Duration::from_secs(2),
    )
    .await;
    assert!(
        testbed_topic
            .iter()
            .all(|m| !m.key.as_deref().unwrap_or("").ends_with("-x")),
        "a failed call's event reached the broker"
    );
    host.shutdown().await;
}

#[tokio::test]
async fn a_batch_spanning_topics_reaches_each_topic() {
    let host = spawn_host(&["testbed"]).await;
    let bootstrap = host.host.brokers.bootstrap.clone();
    let topics = [topic("alpha"), topic("beta"), topic("gamma")];
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "multi", "topics": topics, "count": 9 }),
        )
        .await;
    assert_eq!((a.status, &a.body["emitted"]), (200, &json!(9)));
    all_published(&host, 9).await;
    for (n, t) in topics.iter().enumerate() {
        let messages = consume(&bootstrap, &host.topic(t), usize::MAX, Duration::from_secs(3)).await;
        let mut indexes: Vec<u64> = messages.iter().map(|m| m.json()["i"].as_u64().unwrap()).collect();
        indexes.sort();
        assert_eq!(indexes, vec![n as u64, n as u64 + 3, n as u64 + 6], "topic {t}");
    }
    host.shutdown().await;
}

#[tokio::test]
async fn three_relays_keep_per_key_order_without_duplicates() {
    let broker = broker();
    let first = spawn_host_with(&["testbed"], |c| broker.configure(c)).await;
    let url = first.database_url.clone();
    let mut others = Vec::new();
    for _ in 0..2 {
        others.push(obx_tests::spawn_host_on(&url, &["testbed"], |c| broker.configure(c)).await);
    }
    let hosts: Vec<&TestHost> = std::iter::once(&first).chain(others.iter()).collect();
    // Let the relays share the shards out before the load starts.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // 100 commands, each emitting one event for each of 100 keys: seq = the command's index.
    // Commands go to the three hosts in turn, one after another, so commit order is seq order.
    let t = topic("order");
    let keys: Vec<String> = (0..100).map(|k| format!("key-{k}")).collect();
    for seq in 0..100 {
        let host = hosts[seq % 3];
        let a = host
            .command(
                "testbed",
                "emit",
                json!({ "id": format!("s{seq}"), "topic": t, "keys": keys, "seq": seq }),
            )
            .await;
        assert_eq!((a.status, &a.body["emitted"]), (200, &json!(100)), "{}", a.text);
    }
    all_published(&first, 10_000).await;

    let messages = consume(&broker.bootstrap, &first.topic(&t), 10_000, Duration::from_secs(30)).await;
    assert_eq!(messages.len(), 10_000);
    let ids: HashSet<&str> = messages.iter().map(|m| m.header("eventId").unwrap()).collect();
    assert_eq!(ids.len(), 10_000, "duplicates on the broker");
    assert_eq!(key_order_violations(&messages), 0, "per-key order violations");
    // Each relay did part of the work.
    let shards: Vec<i64> = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND classid = (SELECT (lock_space & 2147483646)::oid FROM obx.installation) GROUP BY pid",
    )
    .fetch_all(&first.db)
    .await
    .unwrap();
    assert_eq!(shards.len(), 3, "three relays hold shards: {shards:?}");
    for h in others {
        h.shutdown().await;
    }
    first.shutdown().await;
}

#[tokio::test]
async fn commands_succeed_while_the_broker_is_down_and_the_backlog_drains_after() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: needs the mock cluster to take the broker down");
        return;
    };
    let host = spawn_host_with(&["testbed"], |c| broker.configure(c)).await;
    let t = topic("outage");
    let a = host
        .command("testbed", "emit", json!({ "id": "before", "topic": t, "count": 5 }))
        .await;
    assert_eq!(a.status, 200);
    all_published(&host, 5).await;

    mock.down(1).unwrap();
    for i in 0..20 {
        let a = host
            .command(
                "testbed",
                "emit",
                json!({ "id": format!("down-{i}"), "topic": t, "count": 5 }),
            )
            .await;
        assert_eq!(a.status, 200, "commands keep succeeding: {}", a.text);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        unpublished(&host).await,
        100,
        "rows accumulate while the broker is down"
    );

    mock.up(1).unwrap();
    all_published(&host, 105).await;
    let messages = consume(&broker.bootstrap, &host.topic(&t), 105, Duration::from_secs(30)).await;
    let ids: HashSet<&str> = messages.iter().map(|m| m.header("eventId").unwrap()).collect();
    assert_eq!(ids.len(), 105, "everything delivered");
    host.shutdown().await;
}

fn producer_rebuilds() -> f64 {
    metric_value("obx_relay_producer_rebuilds_total")
}

#[tokio::test]
async fn a_producer_whose_acknowledgements_stall_while_the_broker_answers_is_replaced_and_key_order_holds() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: needs the mock cluster to fail produce requests");
        return;
    };
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.relay.ack_timeout = Duration::from_millis(500);
        c.relay.stall_timeout = Duration::from_secs(1);
    })
    .await;
    let t = topic("gamma");
    let keys: Vec<String> = (0..5).map(|k| format!("key-{k}")).collect();
    let emit = |seq: i64| {
        let (host, t, keys) = (&host, t.clone(), keys.clone());
        async move {
            let a = host
                .command(
                    "testbed",
                    "emit",
                    json!({ "id": format!("s{seq}"), "topic": t, "keys": keys, "seq": seq }),
                )
                .await;
            assert_eq!(a.status, 200, "{}", a.text);
        }
    };
    emit(0).await;
    all_published(&host, 5).await;
    let before = producer_rebuilds();

    // The broker answers metadata, but refuses the next 60 produce requests with a
    // retriable error: the producer retries with backoff, and its acknowledgements stall.
    mock.fail_requests(
        rdkafka::types::RDKafkaApiKey::Produce,
        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        60,
    );
    for seq in 1..20 {
        emit(seq).await;
    }
    eventually(Duration::from_secs(30), "a new producer", || async {
        producer_rebuilds() > before
    })
    .await;
    all_published(&host, 100).await;

    // Every row reached the broker, and each key's first copies are in commit order.
    // All of the topic: the old producer's messages may be there too, as second copies.
    let messages = consume(&broker.bootstrap, &host.topic(&t), 1000, Duration::from_secs(8)).await;
    let ids: HashSet<&str> = messages.iter().map(|m| m.header("eventId").unwrap()).collect();
    assert_eq!(ids.len(), 100, "every event on the broker");
    assert_eq!(key_order_violations(&messages), 0, "per-key order violations");
    host.shutdown().await;
}

#[tokio::test]
async fn a_relay_killed_between_send_and_mark_sends_again() {
    let broker = broker();
    let host = spawn_host_with(&["testbed"], |c| broker.configure(c)).await;
    let url = host.database_url.clone();
    // Hold the relay inside its mark: the UPDATE of published_at sleeps.
    sqlx::raw_sql(
        "CREATE FUNCTION public.stall() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$; \
         CREATE TRIGGER stall BEFORE UPDATE OF published_at ON obx.outbox_event \
           FOR EACH STATEMENT EXECUTE FUNCTION public.stall();",
    )
    .execute(&host.db)
    .await
    .unwrap();
    let t = topic("killed");
    let physical = host.topic(&t);
    let a = host
        .command("testbed", "emit", json!({ "id": "k", "topic": t, "count": 10 }))
        .await;
    assert_eq!(a.status, 200);
    // The messages reach the broker; then the relay is killed before its mark commits.
    let first = consume(&broker.bootstrap, &physical, 10, Duration::from_secs(10)).await;
    assert_eq!(first.len(), 10, "sent");
    let TestHost { host: killed, db, .. } = host;
    killed.kill().await;
    sqlx::raw_sql("DROP TRIGGER stall ON obx.outbox_event")
        .execute(&db)
        .await
        .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NULL")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(left, 10, "the mark died with the relay");

    // A new host on the same database sends them again.
    let again = obx_tests::spawn_host_on(&url, &["testbed"], |c| broker.configure(c)).await;
    all_published(&again, 10).await;
    let all = consume(&broker.bootstrap, &physical, 20, Duration::from_secs(10)).await;
    let ids: HashSet<&str> = all.iter().map(|m| m.header("eventId").unwrap()).collect();
    assert_eq!(ids.len(), 10, "no loss");
    assert_eq!(all.len(), 20, "each sent twice: a duplicate is allowed, a loss is not");
    again.shutdown().await;
}

#[tokio::test]
async fn kcat_reads_key_value_and_headers() {
    let Ok(kcat) = which("kcat") else {
        panic!("kcat is not installed: `cargo xtask test` installs it (apt-get install kcat)");
    };
    let host = spawn_host(&["orders"]).await;
    let bootstrap = host.host.brokers.bootstrap.clone();
    // kcat as a user runs it: with the system's librdkafka, not the one cargo's
    // LD_LIBRARY_PATH would hand it from this build.
    let kcat_cmd = || {
        let mut cmd = tokio::process::Command::new(&kcat);
        cmd.env_remove("LD_LIBRARY_PATH");
        cmd
    };
    let metadata = kcat_cmd()
        .args(["-b", &bootstrap, "-L", "-m", "10"])
        .output()
        .await
        .unwrap();
    let external = std::env::var("KAFKA_BROKERS").is_ok_and(|b| !b.trim().is_empty());
    if !metadata.status.success() || String::from_utf8_lossy(&metadata.stderr).contains("ERROR") {
        let version = kcat_cmd().arg("-V").output().await.unwrap();
        let why = format!(
            "kcat {} cannot talk to the broker at {bootstrap}: {}",
            String::from_utf8_lossy(&version.stdout)
                .lines()
                .find(|l| l.starts_with("Version"))
                .unwrap_or("(version unknown)")
                .trim(),
            String::from_utf8_lossy(&metadata.stderr).trim()
        );
        // Debian's kcat (librdkafka 2.0.2) cannot talk to tansu 0.6.0: that pair is skipped,
        // and says so. Against the mock cluster it must work.
        assert!(external, "{why}");
        eprintln!("SKIPPED kcat against the external broker: {why}");
        host.shutdown().await;
        return;
    }
    let a = host
        .command("orders", "CreateOrder", json!({ "customerId": "kc", "amount": 7.5 }))
        .await;
    let order_id = a.body["orderId"].as_str().unwrap().to_string();
    all_published(&host, 1).await;
    let out = kcat_cmd()
        .args([
            "-b",
            &bootstrap,
            "-C",
            "-t",
            &host.topic("order.events"),
            "-o",
            "beginning",
            "-e",
            "-q",
        ])
        .args(["-f", "%k|%s|%h\\n"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&order_id))
        .unwrap_or_else(|| panic!("kcat saw: {stdout}"));
    let parts: Vec<&str> = line.splitn(3, '|').collect();
    assert_eq!(parts[0], order_id);
    let value: serde_json::Value = serde_json::from_str(parts[1]).unwrap();
    assert_eq!(value["customerId"], "kc");
    assert_eq!(value["amount"], "7.5");
    let event_id: uuid::Uuid = sqlx::query_scalar("SELECT event_id FROM obx.outbox_event")
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert!(parts[2].contains(&format!("eventId={event_id}")), "{line}");
    assert!(parts[2].contains("eventType=OrderCreated"), "{line}");
    assert!(parts[2].contains("aggregateType=Order"), "{line}");
    assert!(parts[2].contains(&format!("aggregateId={order_id}")), "{line}");
    host.shutdown().await;
}

/// Kafka orders a key's messages only within a partition: when OBX and a service that
/// follows the seed (kafkajs) both write one aggregate's events to one topic, they must put
/// its key on the same partition, and so must a Java producer.
#[tokio::test]
async fn obx_kafkajs_and_the_java_hash_put_each_key_on_the_same_partition() {
    const KEYS: usize = 1000;
    const PARTITIONS: u32 = 8;
    let broker = broker();
    let host = spawn_host_with(&["testbed"], |c| broker.configure(c)).await;
    let t = host.topic(&topic("alpha"));
    broker.create_topic_with(&t, PARTITIONS as i32).await;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("aggregate-{i}")).collect();
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "p", "topic": topic("alpha"), "keys": keys }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    all_published(&host, KEYS as i64).await;
    run_kafkajs(
        "produce-keys.js",
        &[&broker.bootstrap, &t, "aggregate-", &KEYS.to_string()],
    )
    .await;

    let messages = consume(&broker.bootstrap, &t, 2 * KEYS, Duration::from_secs(30)).await;
    let mut by_obx = HashMap::new();
    let mut by_kafkajs = HashMap::new();
    for m in &messages {
        let key = m.key.clone().expect("every message has a key");
        match (m.header("obx-plugin"), m.header("source")) {
            (Some("testbed"), _) => by_obx.insert(key, m.partition),
            (_, Some("kafkajs")) => by_kafkajs.insert(key, m.partition),
            _ => panic!("a message of neither producer: {m:?}"),
        };
    }
    assert_eq!(
        (by_obx.len(), by_kafkajs.len()),
        (KEYS, KEYS),
        "each key once from each producer"
    );
    for key in &keys {
        let java = murmur2_partition(key.as_bytes(), PARTITIONS) as i32;
        assert_eq!(
            (by_obx[key], by_kafkajs[key]),
            (java, java),
            "{key}: OBX, kafkajs, Java"
        );
    }
    let used: HashSet<i32> = by_obx.values().copied().collect();
    assert_eq!(used.len(), PARTITIONS as usize, "the keys spread over every partition");
    host.shutdown().await;
}

/// A producer and Kafka settings for `replay` with `host`'s brokers and topic prefix.
fn replay_producer(host: &TestHost) -> (rdkafka::producer::FutureProducer, obx::config::KafkaConfig) {
    let producer = obx::outbox::relay::producer(
        &host.host.brokers,
        &Default::default(),
        &Default::default(),
        Some(Duration::from_secs(10)),
    )
    .unwrap();
    let kafka = obx::config::KafkaConfig {
        topic_prefix: host.topic_prefix.clone(),
        ..Default::default()
    };
    (producer, kafka)
}

#[tokio::test]
async fn replay_republishes_stored_events_marked_as_replays() {
    let host = spawn_host(&["testbed"]).await;
    let bootstrap = host.host.brokers.bootstrap.clone();
    let t = topic("replay");
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "r", "topic": t, "keys": ["a", "b", "a", "c"] }),
        )
        .await;
    assert_eq!(a.status, 200);
    all_published(&host, 4).await;
    let (producer, kafka) = replay_producer(&host);
    let filter = obx::outbox::replay::ReplayFilter {
        aggregate_id: Some("a".into()),
        ..Default::default()
    };
    const PAGE_BYTES: usize = 16 << 20;
    let sent = obx::outbox::replay::replay(&host.db, &producer, &kafka, &filter, PAGE_BYTES)
        .await
        .unwrap();
    assert_eq!(sent, 2);
    let messages = consume(&bootstrap, &host.topic(&t), 6, Duration::from_secs(10)).await;
    let replays: Vec<_> = messages
        .iter()
        .filter(|m| m.header("obx-replay") == Some("true"))
        .collect();
    assert_eq!(replays.len(), 2);
    assert!(replays.iter().all(|m| m.key.as_deref() == Some("a")));
    // Without a filter, replay refuses to send the whole outbox.
    let all = obx::outbox::replay::replay(&host.db, &producer, &kafka, &Default::default(), PAGE_BYTES).await;
    assert!(all.is_err());
    // Any id the caller gives is taken: `i64::MIN - 1` overflowed (a panic in a debug build).
    let lowest = obx::outbox::replay::ReplayFilter {
        from_id: Some(i64::MIN),
        to_id: Some(0),
        ..Default::default()
    };
    let none = obx::outbox::replay::replay(&host.db, &producer, &kafka, &lowest, PAGE_BYTES).await;
    assert_eq!(none.unwrap(), 0);
    // Pages cut by their bytes, a row each: the replay goes on to the end of the range (it
    // stopped after the first page, as if the range had ended).
    let every = obx::outbox::replay::ReplayFilter {
        from_id: Some(0),
        ..Default::default()
    };
    let sent = obx::outbox::replay::replay(&host.db, &producer, &kafka, &every, 1).await;
    assert_eq!(sent.unwrap(), 4);
    host.shutdown().await;
}

/// A replay sends published events only, and leaves the rest to the relay in its key's order.
/// It sent any stored row in its range, so that an event could go out before an earlier one of
/// its key that the relay held (a refused send waiting out its backoff), out of order.
#[tokio::test]
async fn a_replay_leaves_unpublished_events_to_the_relay() {
    let broker = broker();
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.relay.enabled = false;
    })
    .await;
    let t = topic("replay");
    // Nobody published to it yet: a broker that does not create topics on use needs it.
    broker.create_topic(&host.topic(&t)).await;
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "u", "topic": t, "keys": ["a", "a", "b"] }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    // The first of key a was published; the second waits behind nothing but the relay.
    host.count(
        "WITH p AS (UPDATE obx.outbox_event SET published_at = now() \
                    WHERE id = (SELECT min(id) FROM obx.outbox_event) RETURNING 1) \
         SELECT count(*) FROM p",
    )
    .await;
    let (producer, kafka) = replay_producer(&host);
    let every = obx::outbox::replay::ReplayFilter {
        from_id: Some(0),
        ..Default::default()
    };
    let sent = obx::outbox::replay::replay(&host.db, &producer, &kafka, &every, 16 << 20)
        .await
        .unwrap();
    assert_eq!(sent, 1, "a replay sent events the relay has not published");
    // Asked for three, the topic holds the one replayed.
    let messages = consume(&host.host.brokers.bootstrap, &host.topic(&t), 3, Duration::from_secs(5)).await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].header("obx-replay"), Some("true"));
    host.shutdown().await;
}

/// A replay through the admin API with `?parts=true` answers in parts: past half of
/// `http.request_timeout` it stops at a page's end, every event sent so far acknowledged,
/// and says where the rest begins; the same filter from there goes on. A long replay was cut
/// at the timeout (503 "took longer"), and its retry started over, so that it never ended.
#[tokio::test]
async fn a_replay_through_the_api_answers_in_parts_within_the_request_timeout() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: needs the mock cluster to slow the broker");
        return;
    };
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.http.request_timeout = Duration::from_secs(4);
        // Pages of two rows.
        c.relay.batch_max_bytes = 8 * 1024;
    })
    .await;
    let t = topic("replay");
    let keys: Vec<String> = (0..40).map(|k| format!("k{k}")).collect();
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "r", "topic": t, "keys": keys, "payload_bytes": 3000 }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    all_published(&host, 40).await;
    // Each page now waits at least 100 ms for its acknowledgements: twenty pages take longer
    // than a part (2 s).
    mock.delay(1, Duration::from_millis(100)).unwrap();
    let mut filter = json!({ "from_id": 0 });
    let (mut parts, mut replayed) = (0, 0);
    loop {
        let a = host.post_json("/v1/outbox/replay?parts=true", filter.clone()).await;
        assert_eq!(a.status, 200, "{}", a.text);
        parts += 1;
        replayed += a.body["replayed"].as_u64().unwrap();
        if a.body["done"] == true {
            break;
        }
        filter = json!({ "from_id": a.body["next_from_id"] });
        assert!(parts < 20, "{}", a.text);
    }
    assert!(parts >= 2, "the replay answered in {parts} part");
    assert_eq!(replayed, 40);
    let messages = consume(&broker.bootstrap, &host.topic(&t), 80, Duration::from_secs(15)).await;
    let replays: HashSet<&str> = messages
        .iter()
        .filter(|m| m.header("obx-replay") == Some("true"))
        .map(|m| m.header("eventId").unwrap())
        .collect();
    assert_eq!(replays.len(), 40, "each event replayed");
    // A filter Postgres cannot take is the caller's fault, not 503 `replay_failed`.
    let a = host
        .post_json("/v1/outbox/replay", json!({ "aggregate_type": "a\u{0}b" }))
        .await;
    assert_eq!((a.status, a.code()), (400, "bad_request"), "{}", a.text);
    host.shutdown().await;
}

/// A replay compares against what the hosts recorded: against a database its hosts have
/// not yet migrated to record anything (before migration 0017), it finds nothing to compare
/// (it failed with Postgres's missing-column error). A host, which records, still fails.
#[tokio::test]
async fn a_replay_against_a_database_that_records_no_settings_yet_compares_nothing() {
    use obx::db::installation::check_shared_kafka_settings;
    let host = spawn_host(&[]).await;
    let refused = check_shared_kafka_settings(&host.db, Some("murmur2"), "other.", false).await;
    assert!(format!("{:#}", refused.unwrap_err()).contains("kafka.topic_prefix"));
    // As before migration 0017.
    sqlx::raw_sql("ALTER TABLE obx.installation DROP COLUMN kafka_partitioner, DROP COLUMN kafka_topic_prefix")
        .execute(&host.db)
        .await
        .unwrap();
    check_shared_kafka_settings(&host.db, Some("murmur2"), "other.", false)
        .await
        .unwrap();
    let recording = check_shared_kafka_settings(&host.db, Some("murmur2"), "other.", true).await;
    assert!(format!("{:#}", recording.unwrap_err()).contains("recording"));
    host.shutdown().await;
}

#[tokio::test]
async fn retention_deletes_old_published_rows_only() {
    let host = spawn_host(&["testbed"]).await;
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "old", "topic": topic("retention"), "count": 30 }),
        )
        .await;
    assert_eq!(a.status, 200);
    all_published(&host, 30).await;
    // Stop the host (and its relay), keep its database.
    let TestHost { host: h, db, .. } = host;
    h.shutdown().await.unwrap();
    // Age twenty of them; keep one of those unpublished, and publish another only now (after
    // an outage of eight days, say).
    sqlx::raw_sql(
        "UPDATE obx.outbox_event SET created_at = now() - interval '8 days', \
           published_at = now() - interval '8 days' WHERE id IN \
           (SELECT id FROM obx.outbox_event ORDER BY id LIMIT 20); \
         UPDATE obx.outbox_event SET published_at = NULL WHERE id = (SELECT min(id) FROM obx.outbox_event); \
         UPDATE obx.outbox_event SET published_at = now() WHERE id = (SELECT min(id) + 1 FROM obx.outbox_event)",
    )
    .execute(&db)
    .await
    .unwrap();
    let config = obx::config::RetentionConfig {
        batch_size: 7,
        ..Default::default()
    };
    let deleted = obx::retention::outbox(&db, &config).await.unwrap();
    assert_eq!(deleted, 18, "rows published long ago, in batches of 7");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM obx.outbox_event")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(
        left, 12,
        "the unpublished old row, the one published late, and the ten young ones stay"
    );
}

fn which(name: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join(name)).find(|p| p.exists()))
        .ok_or(())
}

/// Shard locks of each relay connection, as Postgres sees them.
async fn shard_locks(host: &TestHost) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
         WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = 'obx-relay' \
           AND a.datname = current_database() AND l.objsubid = 2 \
           AND l.classid = (SELECT (lock_space & 2147483646)::oid FROM obx.installation) \
         GROUP BY l.pid ORDER BY 1",
    )
    .fetch_all(&host.db)
    .await
    .unwrap()
}

/// Relays that join one after another share the 64 shards out evenly: each relay ends with
/// its fair share (or a little less), and all 64 are held. (`relay::tests` checks the
/// double-lock case the fault suite found, where a relay kept shards it believed released.)
#[tokio::test]
async fn relays_that_join_later_get_their_fair_share_of_shards() {
    let broker = broker();
    let first = spawn_host_with(&["testbed"], |c| broker.configure(c)).await;
    let url = first.database_url.clone();
    let mut hosts = vec![first];
    for n in 2..=4usize {
        hosts.push(obx_tests::spawn_host_on(&url, &["testbed"], |c| broker.configure(c)).await);
        let fair = 64usize.div_ceil(n) as i64;
        let mut last = Vec::new();
        let settled = tokio::time::timeout(Duration::from_secs(15), async {
            loop {
                last = shard_locks(&hosts[0]).await;
                // Every relay holds its fair share or one less, and all 64 are held.
                let total: i64 = last.iter().sum();
                if last.len() == n && total == 64 && last.iter().all(|c| *c <= fair && *c >= fair - n as i64) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        assert!(
            settled.is_ok(),
            "{n} relays: shard locks per relay {last:?} (fair {fair})"
        );
    }
    for host in hosts {
        host.shutdown().await;
    }
}

/// A row the broker refuses for good (here: larger than the producer may send, as after a
/// configuration change) is set aside and counted; the later rows of its key go out.
#[tokio::test]
async fn a_row_the_broker_refuses_for_good_is_set_aside_and_its_key_moves_on() {
    let host = spawn_host(&["testbed"]).await;
    let bootstrap = host.host.brokers.bootstrap.clone();
    let t = topic("events");
    rows_by_hand_then_two_emitted(&host, &t, &["jsonb_build_object('pad', repeat('x', 2000000))"], 2).await;
    let messages = consume(&bootstrap, &host.topic(&t), 2, Duration::from_secs(10)).await;
    assert_eq!(messages.len(), 2);
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_delivery_failure WHERE set_aside AND attempts = 1")
            .await,
        1
    );
    let status = host.get("/v1/status").await;
    assert_eq!(status.body["outbox"]["rows_set_aside"], 1, "{}", status.text);
    assert_eq!(status.body["outbox"]["backlog"], 0, "{}", status.text);
    host.shutdown().await;
}

/// Writes a row of key `k` on topic `t` by hand for each of `payloads` (SQL expressions), in
/// order, has testbed emit two more of the key, and waits until `published` rows are published.
async fn rows_by_hand_then_two_emitted(host: &TestHost, t: &str, payloads: &[&str], published: i64) {
    for payload in payloads {
        sqlx::query(&format!(
            "INSERT INTO obx.outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, \
                                           partition_key, plugin_name, plugin_version) \
             VALUES (gen_random_uuid(), 'Item', 'k', 'ItemEmitted', {payload}, $1, 'k', 'testbed', 'old')"
        ))
        .bind(t)
        .execute(&host.db)
        .await
        .unwrap();
    }
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "after", "topic": t, "key": "k", "count": 2 }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    eventually(
        Duration::from_secs(60),
        "the key's other rows are published",
        || async {
            host.count("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NOT NULL")
                .await
                == published
        },
    )
    .await;
}

/// A stored row whose payload Postgres cannot print (`jsonb` prints numbers in full: 8,200 of
/// `1e131071` print past a gigabyte), which `obx_api.emit_calls` refuses since migration 0035
/// and which came in another way (here: written by hand, after a row of the same key). Every
/// claim of its shard failed on it ("out of memory"), and nothing on that shard was published
/// again. The relay now sets it aside, judged by its numbers without printing it whole, and
/// its key moves on in order. Postgres builds about a gigabyte once, in the failed claim.
#[tokio::test]
async fn a_row_whose_payload_postgres_cannot_print_is_set_aside_and_its_key_moves_on() {
    let host = spawn_host(&["testbed"]).await;
    let bootstrap = host.host.brokers.bootstrap.clone();
    let t = topic("events");
    let rows = [
        "'{\"first\": true}'::jsonb",
        "('[' || repeat('1e131071,', 8200) || '1]')::jsonb",
    ];
    rows_by_hand_then_two_emitted(&host, &t, &rows, 3).await;
    // One key, one partition: in the order the rows were written, the one set aside left out.
    let mut messages = consume(&bootstrap, &host.topic(&t), 3, Duration::from_secs(10)).await;
    messages.sort_by_key(|m| (m.partition, m.offset));
    let order: Vec<serde_json::Value> = messages.iter().map(|m| m.json()).collect();
    assert_eq!(order.len(), 3, "{order:?}");
    assert_eq!(
        (&order[0]["first"], &order[1]["i"], &order[2]["i"]),
        (&json!(true), &json!(0), &json!(1))
    );
    assert_eq!(
        host.count(
            "SELECT count(*) FROM obx.outbox_delivery_failure \
             WHERE set_aside AND last_error LIKE 'Postgres cannot print its payload: its numbers alone%'"
        )
        .await,
        1
    );
    host.shutdown().await;
}

/// A host whose relay lingers 100 ms, so that each command's rows of a key go in one produce
/// batch, however slow the machine.
async fn batching_host(broker: &TestBroker) -> TestHost {
    spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.relay.linger_ms = 100;
    })
    .await
}

/// One testbed command that emits a row to topic `t` for each of `keys`, in order.
async fn emit_keys(host: &TestHost, t: &str, keys: &[&str]) {
    let a = host
        .command("testbed", "emit", json!({ "id": keys[0], "topic": t, "keys": keys }))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
}

/// The rows set aside: key, the row's place in its command (`i`), attempts.
async fn set_aside_rows(host: &TestHost) -> Vec<(String, String, i32)> {
    sqlx::query_as(
        "SELECT o.partition_key, o.payload->>'i', f.attempts FROM obx.outbox_delivery_failure f \
         JOIN obx.outbox_event o ON o.id = f.outbox_id WHERE f.set_aside",
    )
    .fetch_all(&host.db)
    .await
    .unwrap()
}

/// A broker refuses a whole produce batch for one row too large (or one bad record), and
/// librdkafka fails every row of the batch with that error. Such rows go again one at a
/// time, in order, and only a row the broker refuses alone is set aside. Before, every row of
/// the batch was set aside with the one that caused it.
#[tokio::test]
async fn rows_of_a_batch_refused_as_too_large_go_again_alone_and_only_a_row_refused_alone_is_set_aside() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: needs the mock cluster to refuse produce requests");
        return;
    };
    let host = batching_host(&broker).await;
    let t = topic("beta");
    // The rows of one command: a key's rows are in one partition, so in one produce batch.
    let emit = |keys: &'static [&'static str]| emit_keys(&host, &t, keys);
    let set_aside = || async {
        host.count("SELECT count(*) FROM obx.outbox_delivery_failure WHERE set_aside")
            .await
    };
    emit(&["warm", "warm"]).await;
    all_published(&host, 2).await;
    let too_large = rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE;
    let produce = rdkafka::types::RDKafkaApiKey::Produce;

    // The request is refused (with the rows of one key or of both); each of its rows then
    // goes alone, and through.
    mock.fail_requests(produce, too_large, 1);
    emit(&["a", "c", "a", "c", "a"]).await;
    all_published(&host, 7).await;
    assert_eq!(set_aside().await, 0, "a row of a refused batch was set aside");

    // The batch is refused, and then its first row alone: only that row is set aside.
    mock.fail_requests(produce, too_large, 2);
    emit(&["b", "b", "b"]).await;
    all_published(&host, 9).await;
    let aside = set_aside_rows(&host).await;
    assert_eq!(aside, vec![("b".to_string(), "0".to_string(), 2)]);

    // On the broker, each key's rows in their order, the one set aside missing.
    let messages = consume(&broker.bootstrap, &host.topic(&t), 9, Duration::from_secs(10)).await;
    let mut sorted: Vec<&Received> = messages.iter().collect();
    sorted.sort_by_key(|m| (m.partition, m.offset));
    let mut seen = HashSet::new();
    let mut by_key: HashMap<String, Vec<i64>> = HashMap::new();
    for m in sorted
        .into_iter()
        .filter(|m| seen.insert(m.header("eventId").unwrap().to_string()))
    {
        by_key
            .entry(m.key.clone().unwrap())
            .or_default()
            .push(m.json()["i"].as_i64().unwrap());
    }
    assert_eq!(by_key["a"], vec![0, 2, 4]);
    assert_eq!(by_key["c"], vec![1, 3]);
    assert_eq!(by_key["b"], vec![1, 2]);
    host.shutdown().await;
}

/// A broker that refuses a record's timestamp (older than the topic's `message.timestamp.*`
/// settings allow) refuses it at every attempt: the row keeps its `created_at`. Such a row
/// (here a day old: a trigger backdates the rows) is handled as one refused for good, again
/// alone and then set aside, and its key moves on. It was retried for ever, with its key held.
#[tokio::test]
async fn a_row_whose_timestamp_the_broker_refuses_is_set_aside_and_its_key_moves_on() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: needs the mock cluster to refuse produce requests");
        return;
    };
    let host = batching_host(&broker).await;
    let t = topic("beta");
    let emit = |keys: &'static [&'static str]| emit_keys(&host, &t, keys);
    emit(&["warm"]).await;
    all_published(&host, 1).await;
    sqlx::raw_sql(
        "CREATE FUNCTION public.backdate() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN NEW.created_at := NEW.created_at - interval '1 day'; RETURN NEW; END $$; \
         CREATE TRIGGER backdate BEFORE INSERT ON obx.outbox_event FOR EACH ROW EXECUTE FUNCTION public.backdate()",
    )
    .execute(&host.db)
    .await
    .unwrap();
    // The batch is refused, and then its first row alone.
    mock.fail_requests(
        rdkafka::types::RDKafkaApiKey::Produce,
        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_TIMESTAMP,
        2,
    );
    emit(&["t", "t", "t"]).await;
    all_published(&host, 3).await;
    let aside = set_aside_rows(&host).await;
    assert_eq!(aside, vec![("t".to_string(), "0".to_string(), 2)]);

    // Refused again, it stays set aside.
    mock.fail_requests(
        rdkafka::types::RDKafkaApiKey::Produce,
        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_TIMESTAMP,
        1,
    );
    let a = host.post_json("/v1/outbox/replay", json!({ "set_aside": true })).await;
    assert_eq!(
        (a.status, &a.body["replayed"], &a.body["refused"]),
        (200, &json!(0), &json!(1)),
        "{}",
        a.text
    );
    assert_eq!(set_aside_rows(&host).await.len(), 1);
    // The topic takes it now: the operator sends it by a replay of the rows set aside, and
    // it lands after its key's later rows, marked published.
    let a = host.post_json("/v1/outbox/replay", json!({ "set_aside": true })).await;
    assert_eq!((a.status, &a.body["replayed"]), (200, &json!(1)), "{}", a.text);
    assert!(set_aside_rows(&host).await.is_empty());
    all_published(&host, 4).await;
    let got = consume(
        &host.host.brokers.bootstrap,
        &host.topic(&t),
        4,
        Duration::from_secs(20),
    )
    .await;
    let t_rows = got.iter().filter(|m| m.key.as_deref() == Some("t"));
    let last = t_rows.max_by_key(|m| m.offset).expect("key t's messages");
    assert_eq!(
        (last.json()["i"].clone(), last.header("obx-replay")),
        (json!(0), Some("true"))
    );
    let a = host.post_json("/v1/outbox/replay", json!({ "set_aside": true })).await;
    assert_eq!((a.status, &a.body["replayed"]), (200, &json!(0)), "{}", a.text);
    host.shutdown().await;
}

/// A fresh row whose timestamp the broker refuses is ahead of the brokers' clock (the
/// database's clock is ahead of theirs), not too old: time mends that, so it is retried, its
/// key held, and lands in its key's order. It was set aside, and with it every row of the
/// backlog, each key's order lost for good.
#[tokio::test]
async fn a_fresh_row_whose_timestamp_the_broker_refuses_waits_and_keeps_its_keys_order() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: needs the mock cluster to refuse produce requests");
        return;
    };
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.relay.linger_ms = 100;
        c.relay.backoff_max = Duration::from_millis(500);
    })
    .await;
    let t = topic("beta");
    emit_keys(&host, &t, &["warm"]).await;
    all_published(&host, 1).await;
    mock.fail_requests(
        rdkafka::types::RDKafkaApiKey::Produce,
        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_TIMESTAMP,
        3,
    );
    emit_keys(&host, &t, &["u", "u", "u"]).await;
    all_published(&host, 4).await;
    assert!(set_aside_rows(&host).await.is_empty(), "a fresh row was set aside");
    let got = consume(
        &host.host.brokers.bootstrap,
        &host.topic(&t),
        4,
        Duration::from_secs(20),
    )
    .await;
    let mut rows: Vec<_> = got.iter().filter(|m| m.key.as_deref() == Some("u")).collect();
    rows.sort_by_key(|m| m.offset);
    let order: Vec<i64> = rows.iter().map(|m| m.json()["i"].as_i64().unwrap()).collect();
    assert_eq!(order, vec![0, 1, 2], "key u's rows out of order");
    host.shutdown().await;
}

/// A key with a row in flight from an earlier step sends nothing after it until the broker
/// has answered that row. Here the broker answers late (past `ack_timeout`, so the next step
/// claims the key's next row) and refuses the first row with an error the producer does not
/// retry: sent meanwhile, in a produce request of its own, the next row landed first.
#[tokio::test]
async fn a_keys_next_row_waits_for_its_row_in_flight_and_follows_it_when_that_one_is_refused() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: needs the mock cluster to answer late and refuse produce requests");
        return;
    };
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.relay.ack_timeout = Duration::from_millis(300);
        c.relay.backoff_max = Duration::from_secs(1);
    })
    .await;
    let t = topic("gamma");
    let emit = |seq: i64| {
        let (host, t) = (&host, t.clone());
        async move {
            let a = host
                .command(
                    "testbed",
                    "emit",
                    json!({ "id": format!("s{seq}"), "topic": t, "keys": ["k"], "seq": seq }),
                )
                .await;
            assert_eq!(a.status, 200, "{}", a.text);
        }
    };
    emit(0).await;
    all_published(&host, 1).await;
    // The next produce request is refused (on arrival), and every answer comes 2 s late.
    mock.fail_requests(
        rdkafka::types::RDKafkaApiKey::Produce,
        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
        1,
    );
    mock.delay(1, Duration::from_secs(2)).unwrap();
    emit(1).await;
    // Past the step's ack_timeout: the next steps claim the key's next row.
    tokio::time::sleep(Duration::from_millis(800)).await;
    emit(2).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    mock.delay(1, Duration::ZERO).unwrap();
    all_published(&host, 3).await;
    let messages = consume(&broker.bootstrap, &host.topic(&t), 3, Duration::from_secs(8)).await;
    let ids: HashSet<&str> = messages.iter().map(|m| m.header("eventId").unwrap()).collect();
    assert_eq!(ids.len(), 3, "every event on the broker");
    assert_eq!(key_order_violations(&messages), 0, "per-key order violations");
    host.shutdown().await;
}

/// Rows the broker never answers (here, of a topic whose partitions have no leader) do not
/// hold up the other topics: past `stall_timeout`, while the broker answers, each is recorded
/// as failing (counted, with the reason), and claims pass it and its key by while it waits. Before, they stayed at the head of every claim: with a batch's worth
/// of them nothing else was ever published, and the producer was replaced every
/// `stall_timeout`, sending every row in flight again.
#[tokio::test]
async fn rows_the_broker_never_answers_hold_up_only_their_own_keys() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: needs the mock cluster to take a partition's leader away");
        return;
    };
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.relay.batch_size = 20;
        c.relay.ack_timeout = Duration::from_millis(500);
        c.relay.stall_timeout = Duration::from_secs(1);
        c.relay.backoff_max = Duration::from_secs(2);
    })
    .await;
    let (dead, alive) = (host.topic(&topic("alpha")), host.topic(&topic("beta")));
    broker.create_topic(&dead).await;
    broker.create_topic(&alive).await;
    for p in 0..4 {
        mock.lead(&dead, p, None).unwrap();
    }
    let keys: Vec<String> = (0..30).map(|k| format!("k{k}")).collect();
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "dead", "topic": topic("alpha"), "keys": keys }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The other topic's rows flow meanwhile.
    for i in 0..15 {
        let a = host
            .command(
                "testbed",
                "emit",
                json!({ "id": format!("alive{i}"), "topic": topic("beta"), "key": "b" }),
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.text);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eventually(
        Duration::from_secs(15),
        "the other topic's rows are published",
        || async {
            host.count(
                "SELECT count(*) FROM obx.outbox_event WHERE published_at IS NOT NULL AND topic = 'testbed.beta'",
            )
            .await
                == 15
        },
    )
    .await;
    let failing = host.get("/v1/status").await;
    assert!(
        failing.body["outbox"]["rows_failing"].as_i64() > Some(0),
        "{}",
        failing.text
    );
    // The partitions get their leader back: every row goes out, once, each key in order.
    for p in 0..4 {
        mock.lead(&dead, p, Some(1)).unwrap();
    }
    all_published(&host, 45).await;
    let messages = consume(&broker.bootstrap, &dead, 1000, Duration::from_secs(8)).await;
    let ids: HashSet<&str> = messages.iter().map(|m| m.header("eventId").unwrap()).collect();
    assert_eq!(ids.len(), 30, "every event of the dead topic on the broker");
    host.shutdown().await;
}

/// A row that waits for another attempt holds up the later rows of its key on its own topic
/// only: a key is ordered within a topic, and another topic may be another plugin's.
#[tokio::test]
async fn a_refused_row_holds_up_its_key_on_its_topic_only() {
    let host = spawn_host(&["testbed"]).await;
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "first", "topic": topic("alpha"), "key": "k" }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    all_published(&host, 1).await;
    // As if the broker had refused a row of key k on testbed.alpha, to be tried in an hour.
    sqlx::raw_sql(
        "UPDATE obx.outbox_event SET published_at = NULL; \
         INSERT INTO obx.outbox_delivery_failure (outbox_id, topic, partition_key, attempts, last_error, next_attempt_at) \
         SELECT id, topic, partition_key, 1, 'refused', now() + interval '1 hour' FROM obx.outbox_event",
    )
    .execute(&host.db)
    .await
    .unwrap();
    for t in ["alpha", "beta"] {
        let a = host
            .command("testbed", "emit", json!({ "id": t, "topic": topic(t), "key": "k" }))
            .await;
        assert_eq!(a.status, 200, "{}", a.text);
    }
    eventually(
        Duration::from_secs(20),
        "key k on testbed.beta is published",
        || async {
            host.count(
                "SELECT count(*) FROM obx.outbox_event WHERE topic = 'testbed.beta' AND published_at IS NOT NULL",
            )
            .await
                == 1
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_event WHERE topic = 'testbed.alpha' AND published_at IS NOT NULL")
            .await,
        0,
        "key k on testbed.alpha went past its refused row"
    );
    host.shutdown().await;
}

/// A row the broker refuses more than a thousand times still has its refusal recorded, with
/// the longest backoff. The backoff was `power(2, attempts)` seconds capped after the fact: past
/// 1,023 attempts (8.5 hours of a missing ACL at a 30 s backoff) the double overflowed, the
/// record failed, and with it every step of the relay that held the row's shard, each one
/// sending its other rows again.
#[tokio::test]
async fn a_row_refused_more_than_a_thousand_times_has_its_refusal_recorded() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: needs the mock cluster to refuse produce requests");
        return;
    };
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.relay.backoff_max = Duration::from_secs(5);
    })
    .await;
    let a = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "first", "topic": topic("alpha"), "key": "k" }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    all_published(&host, 1).await;
    // As if the broker had refused the row 1,100 times, and it were due again.
    mock.fail_requests(
        rdkafka::types::RDKafkaApiKey::Produce,
        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
        1,
    );
    sqlx::raw_sql(
        "UPDATE obx.outbox_event SET published_at = NULL; \
         INSERT INTO obx.outbox_delivery_failure (outbox_id, topic, partition_key, attempts, last_error, next_attempt_at) \
         SELECT id, topic, partition_key, 1100, 'refused', now() - interval '1 second' FROM obx.outbox_event",
    )
    .execute(&host.db)
    .await
    .unwrap();
    eventually(Duration::from_secs(10), "the 1,101st refusal recorded", || async {
        host.count(
            "SELECT count(*) FROM obx.outbox_delivery_failure \
             WHERE attempts = 1101 AND next_attempt_at > now() + interval '3 seconds'",
        )
        .await
            == 1
    })
    .await;
    all_published(&host, 1).await;
    host.shutdown().await;
}

/// A relay whose claims hold at most 64 KiB of payload (`relay.batch_max_bytes`) still
/// publishes every row, in each key's order: rows of 30 KB go out two at a time, and a row
/// larger than the bound alone.
#[tokio::test]
async fn claims_bounded_in_bytes_publish_every_row_in_key_order() {
    let broker = broker();
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.relay.batch_max_bytes = 64 * 1024;
    })
    .await;
    let t = topic("order");
    let keys: Vec<String> = (0..5).map(|k| format!("key-{k}")).collect();
    for seq in 0..20 {
        let pad = "p".repeat(if seq == 10 { 200_000 } else { 30_000 });
        let a = host
            .command(
                "testbed",
                "emit",
                json!({ "id": format!("s{seq}"), "topic": t, "keys": keys, "payload": { "seq": seq, "pad": pad } }),
            )
            .await;
        assert_eq!((a.status, &a.body["emitted"]), (200, &json!(5)), "{}", a.text);
    }
    all_published(&host, 100).await;
    let messages = consume(&broker.bootstrap, &host.topic(&t), 100, Duration::from_secs(30)).await;
    assert_eq!(messages.len(), 100);
    assert_eq!(key_order_violations(&messages), 0, "per-key order violations");
    host.shutdown().await;
}

/// Every host of an installation relays with the same `kafka.partitioner` and
/// `kafka.topic_prefix`: the first host records them, and a host whose settings differ
/// refuses to start, naming the setting and how to change it on purpose. Otherwise a relay
/// that took shards over would put a key's later events on another partition or topic.
#[tokio::test]
async fn a_host_whose_partitioner_or_topic_prefix_differs_from_its_peers_refuses_to_start() {
    let broker = broker();
    let first = spawn_host_with(&["testbed"], |c| broker.configure(c)).await;
    let plugins = tempfile::tempdir().unwrap();
    let differing = |adjust: &dyn Fn(&mut obx::config::Config)| {
        let mut config = test_config(&first.database_url, plugins.path());
        broker.configure(&mut config);
        config.kafka.topic_prefix = first.topic_prefix.clone();
        adjust(&mut config);
        config
    };
    let partitioner = differing(&|c| c.kafka.partitioner = obx::config::Partitioner::ConsistentRandom);
    let e = obx::app::start(partitioner)
        .await
        .err()
        .expect("a host with another partitioner started");
    let e = format!("{e:#}");
    assert!(
        e.contains("kafka.partitioner") && e.contains("kafka_partitioner = NULL"),
        "{e}"
    );
    // Nor may a replay publish with another partitioner.
    let replaying = differing(&|c| c.kafka.partitioner = obx::config::Partitioner::ConsistentRandom);
    let producer = obx::outbox::relay::producer(
        &first.host.brokers,
        &replaying.kafka,
        &Default::default(),
        Some(Duration::from_secs(5)),
    )
    .unwrap();
    let every = obx::outbox::replay::ReplayFilter {
        from_id: Some(0),
        ..Default::default()
    };
    let e = obx::outbox::replay::replay(&first.db, &producer, &replaying.kafka, &every, 1 << 20).await;
    assert!(format!("{:#}", e.unwrap_err()).contains("kafka.partitioner"));
    let prefix = differing(&|c| c.kafka.topic_prefix = "elsewhere.".into());
    let e = obx::app::start(prefix)
        .await
        .err()
        .expect("a host with another topic prefix started");
    assert!(format!("{e:#}").contains("kafka.topic_prefix"), "{e:#}");
    // The same settings, or a partitioner that places keys alike, or another partitioner on
    // a host that does not relay: each starts.
    for (what, config) in [
        ("the same settings", differing(&|_| {})),
        (
            "murmur2 with murmur2_random",
            differing(&|c| c.kafka.partitioner = obx::config::Partitioner::Murmur2),
        ),
        (
            "another partitioner, the relay off",
            differing(&|c| {
                c.kafka.partitioner = obx::config::Partitioner::ConsistentRandom;
                c.relay.enabled = false;
            }),
        ),
    ] {
        let host = obx::app::start(config)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        host.shutdown().await.unwrap();
    }
    first.shutdown().await;
}
