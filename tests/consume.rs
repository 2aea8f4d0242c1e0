//! Event consumption against a real Postgres and a real Kafka-protocol broker: each
//! event's handler takes effect once, in dedup mode and in inbox mode; poison events are
//! parked with their key; bad input is quarantined; the three example plugins chain.

use std::time::Duration;

use obx_tests::{
    broker, consume, eventually, metric_value, producer, run_kafkajs, send_event, send_event_with_id, send_raw,
    spawn_host, spawn_host_on, spawn_host_with, with_raw_header, Gate, TestBroker, TestHost,
};
use serde_json::json;

const DEDUP: &str = "testbed.events";
const INBOX: &str = "testbed.inbox";

/// The reasons of every quarantined message.
async fn quarantine_reasons(host: &TestHost) -> Vec<String> {
    sqlx::query_scalar("SELECT reason FROM obx.quarantine")
        .fetch_all(&host.db)
        .await
        .unwrap()
}

async fn effects(host: &TestHost, event_id: uuid::Uuid) -> i64 {
    host.count(&format!(
        "SELECT count(*) FROM testbed.effects WHERE event_id = '{event_id}'"
    ))
    .await
}

async fn total_effects(host: &TestHost) -> i64 {
    host.count("SELECT count(*) FROM testbed.effects").await
}

/// Effects that happened before an effect of their key with a lower `seq`: 0 when every
/// key's events took effect in order.
async fn key_disorder(host: &TestHost) -> i64 {
    host.count(
        "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY key ORDER BY at) AS prev \
         FROM testbed.effects) t WHERE prev > seq",
    )
    .await
}

/// Exactly `n` effects, each of a different event: every event took effect once.
async fn assert_each_effect_once(host: &TestHost, n: i64) {
    assert_eq!(total_effects(host).await, n, "effects");
    assert_eq!(
        host.count("SELECT count(DISTINCT event_id) FROM testbed.effects").await,
        n,
        "events with an effect"
    );
}

/// `n` events written in fewer than `n` transactions: rows written by one transaction share
/// its start time, and `stamps` counts the distinct times.
async fn assert_batched(host: &TestHost, n: i64, stamps: &str) {
    let transactions = host.count(stamps).await;
    assert!(
        transactions < n,
        "{n} events took {transactions} transactions: no batch"
    );
}

/// A host of the testbed service whose consumer does not run, and the broker topic of
/// `logical`, created (nobody consumes it yet, so nobody created it). Events sent there wait
/// on the broker, so that [`next_host`]'s lanes find them queued and take them in batches.
async fn not_consuming(broker: &TestBroker, logical: &str) -> (TestHost, String) {
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.consumer.enabled = false;
    })
    .await;
    let topic = host.topic(logical);
    broker.create_topic(&topic).await;
    (host, topic)
}

/// The next host of `idle`'s service, on its database, consuming, once `idle` has stopped.
async fn next_host(broker: &TestBroker, idle: TestHost, adjust: impl FnOnce(&mut obx::config::Config)) -> TestHost {
    let url = idle.database_url.clone();
    idle.shutdown().await;
    spawn_host_on(&url, &["testbed"], |c| {
        broker.configure(c);
        adjust(c);
    })
    .await
}

#[tokio::test]
async fn the_same_event_delivered_twice_has_one_effect() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    for topic in [DEDUP, INBOX] {
        let id = uuid::Uuid::new_v4();
        for _ in 0..3 {
            send_event_with_id(&p, &host.topic(topic), "k", "Thing", &json!({ "n": 1 }), id).await;
        }
        // A later event proves the three copies were all consumed.
        let later = send_event(&p, &host.topic(topic), "k", "Thing", &json!({})).await;
        eventually(Duration::from_secs(20), "the later event", || async {
            effects(&host, later).await == 1
        })
        .await;
        assert_eq!(effects(&host, id).await, 1, "{topic}: one effect for three deliveries");
    }
    host.shutdown().await;
}

/// A host stopped in process (`Host::kill`), then the next host of the service: each event
/// has one effect, and the next host goes on past them. `kill` aborts the host's tasks, but
/// its consumers wind down on their own and commit their offsets, so this need not see a
/// redelivery;
/// `a_host_killed_with_sigkill_after_its_batches_commit_and_before_its_offsets_do_has_one_effect_per_event`
/// is the crash before the offset commit.
#[tokio::test]
async fn a_host_killed_in_process_and_the_next_one_have_one_effect_per_event() {
    let broker = broker();
    // Offsets are stored after each commit; the timer never commits them before the kill.
    let never_commit = |c: &mut obx::config::Config| {
        broker.configure(c);
        c.consumer.auto_commit_interval_ms = 600_000;
    };
    let host = spawn_host_with(&["testbed"], never_commit).await;
    let url = host.database_url.clone();
    let p = producer(&broker.bootstrap);
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(
            send_event(
                &p,
                &host.topic(DEDUP),
                &format!("k{}", i % 4),
                "Thing",
                &json!({ "seq": i }),
            )
            .await,
        );
    }
    eventually(Duration::from_secs(20), "20 effects", || async {
        total_effects(&host).await == 20
    })
    .await;
    let TestHost { host: crashed, db, .. } = host;
    crashed.kill().await;
    drop(db);

    // The next host of the service: any of the twenty it gets again is a dedup hit.
    let next = spawn_host_on(&url, &["testbed"], |c| broker.configure(c)).await;
    let marker = send_event(&p, &next.topic(DEDUP), "k0", "Thing", &json!({ "seq": 99 })).await;
    eventually(
        Duration::from_secs(30),
        "the marker after the redelivered events",
        || async { effects(&next, marker).await == 1 },
    )
    .await;
    for id in ids {
        assert_eq!(effects(&next, id).await, 1, "event {id} took effect more than once");
    }
    assert_eq!(total_effects(&next).await, 21);
    next.shutdown().await;
}

/// Kills (SIGKILL) the host process it holds when dropped, so that a failed test leaves no
/// host behind.
struct HostProcess(std::process::Child);

impl Drop for HostProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts [`host_process_to_kill`] as a host of the service on `database_url`, with `env`
/// besides; SIGKILLed when dropped.
fn host_process(broker: &TestBroker, database_url: &str, env: &[(&str, &str)]) -> HostProcess {
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", "host_process_to_kill", "--ignored", "--test-threads=1"])
        .env("OBX_CHILD_DATABASE_URL", database_url)
        .env("OBX_CHILD_BROKERS", &broker.bootstrap)
        .env("OBX_CHILD_MOCK_BROKER", if broker.mock.is_some() { "1" } else { "0" })
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    HostProcess(command.spawn().expect("starting the host process"))
}

/// The offsets the consumer group of `plugin` in `host`'s service committed on `topic`'s
/// partitions, as the broker has them (absent: none committed).
fn committed_offsets(broker: &TestBroker, host: &TestHost, plugin: &str, topic: &str) -> Vec<i64> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let db = host.database_url.rsplit('/').next().unwrap();
    let group = format!("test-{db}.{plugin}");
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &broker.bootstrap)
        .set("group.id", &group)
        .create()
        .unwrap();
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
    let mut partitions = rdkafka::TopicPartitionList::new();
    for p in metadata.topics()[0].partitions() {
        partitions.add_partition(topic, p.id());
    }
    let committed = consumer.committed_offsets(partitions, Duration::from_secs(10)).unwrap();
    committed
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            rdkafka::Offset::Offset(o) => Some(o),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_host_killed_with_sigkill_after_its_batches_commit_and_before_its_offsets_do_has_one_effect_per_event() {
    let broker = broker();
    // The database and the topic of a testbed service; its events wait on the broker, so
    // that the host process's lanes take them in batches.
    let (setup, topic) = not_consuming(&broker, DEDUP).await;
    let p = producer(&broker.bootstrap);
    let mut ids = Vec::new();
    for i in 0..200 {
        ids.push(send_event(&p, &topic, &format!("k{}", i % 8), "Thing", &json!({ "seq": i })).await);
    }
    let process = host_process(&broker, &setup.database_url, &[]);
    eventually(
        Duration::from_secs(60),
        "200 effects, committed by the host process",
        || async { total_effects(&setup).await == 200 },
    )
    .await;
    // SIGKILL: no shutdown, no final offset commit.
    drop(process);
    assert!(
        committed_offsets(&broker, &setup, "testbed", &topic)
            .iter()
            .all(|&o| o == 0),
        "the killed host committed offsets: the crash came too late to test anything"
    );

    // The next host of the service gets all two hundred again: each is a dedup hit.
    let next = next_host(&broker, setup, |_| {}).await;
    let marker = send_event(&p, &topic, "k0", "Thing", &json!({ "seq": 999 })).await;
    eventually(
        Duration::from_secs(30),
        "the marker after the redelivered events",
        || async { effects(&next, marker).await == 1 },
    )
    .await;
    for id in ids {
        assert_eq!(effects(&next, id).await, 1, "event {id} took effect more than once");
    }
    assert_eq!(total_effects(&next).await, 201);
    assert_eq!(key_disorder(&next).await, 0);
    next.shutdown().await;
}

/// The lease sessions (of this test's database) that hold a partition beside their group
/// membership.
const LEASE_HOLDERS: &str = "SELECT l.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
    WHERE a.application_name = 'obx-consumer-leases' AND a.datname = current_database() \
      AND l.locktype = 'advisory' AND l.granted GROUP BY l.pid HAVING count(*) >= 2";

/// Waits (30 s at most) until `n` lease sessions of `host`'s database hold partitions.
async fn await_lease_holders(host: &TestHost, n: i64, what: &str) {
    let holders = format!("SELECT count(*) FROM ({LEASE_HOLDERS}) s");
    eventually(Duration::from_secs(30), what, || async {
        host.count(&holders).await == n
    })
    .await;
}

/// Sends one event to each of the keys `k0`..`k39` of `topic`, and waits (20 s at most)
/// until each has taken effect once on `host`. Returns the time from the first send.
async fn send_40_keys_and_await_their_effects(host: &TestHost, bootstrap: &str, topic: &str, what: &str) -> Duration {
    let p = producer(bootstrap);
    let sent = std::time::Instant::now();
    for i in 0..40 {
        send_event(&p, topic, &format!("k{i}"), "Thing", &json!({ "seq": i })).await;
    }
    eventually(Duration::from_secs(20), what, || async {
        total_effects(host).await == 40
    })
    .await;
    let took = sent.elapsed();
    assert_each_effect_once(host, 40).await;
    took
}

/// A host whose lease sessions end while it lives (here, each one as soon as it begins, for
/// 2 s, while the other host takes every partition) finds its partitions leased by the
/// other: it starts over with a new client, gets its share back, and consumes it. The
/// stuck check, which would rescue a client that stopped fetching, is off.
#[tokio::test]
async fn a_host_whose_lease_session_ended_while_it_lived_starts_over_and_consumes_its_share() {
    let broker = broker();
    let with = |c: &mut obx::config::Config| {
        broker.configure(c);
        c.consumer.stuck_after = Duration::ZERO;
    };
    let a = spawn_host_with(&["testbed"], with).await;
    let topic = a.topic(DEDUP);
    await_lease_holders(&a, 1, "A leases partitions").await;
    let a_pid = a
        .count(&format!("SELECT min(pid)::bigint FROM ({LEASE_HOLDERS}) s"))
        .await;
    let b = spawn_host_on(&a.database_url, &["testbed"], with).await;
    await_lease_holders(&a, 2, "both hosts lease partitions").await;
    let end_b = format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = 'obx-consumer-leases' AND datname = current_database() AND pid <> {a_pid}"
    );
    let until = std::time::Instant::now() + Duration::from_secs(2);
    while std::time::Instant::now() < until {
        a.count(&end_b).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    await_lease_holders(&a, 2, "both hosts lease partitions again").await;
    send_40_keys_and_await_their_effects(&a, &broker.bootstrap, &topic, "40 effects").await;
    assert_eq!(key_disorder(&a).await, 0);
    b.shutdown().await;
    a.shutdown().await;
}

/// A host whose lanes hold the whole in-flight budget (64 MiB: here 340 events of 200 KB,
/// whose handlers wait for a row lock the test holds) still steps its leases: its loop,
/// waiting for budget, used to step nothing, so a newcomer got no partition for as long as
/// the lanes were stuck. Now the newcomer gets its share (past the hand-over bound of the
/// partitions whose events are stuck in the lanes), and once the lock goes every event takes
/// effect once.
#[tokio::test]
async fn a_host_whose_lanes_hold_the_whole_budget_still_hands_partitions_over() {
    let broker = broker();
    let with = |c: &mut obx::config::Config| {
        broker.configure(c);
        c.consumer.stuck_after = Duration::ZERO;
        c.consumer.max_attempts = 1000;
        c.limits.call_deadline = Duration::from_secs(120);
        c.limits.statement_timeout = Duration::from_secs(120);
        c.limits.lock_timeout = Duration::from_secs(120);
        c.http.request_timeout = Duration::from_secs(300);
    };
    let a = spawn_host_with(&["testbed"], with).await;
    let topic = a.topic(DEDUP);
    await_lease_holders(&a, 1, "A leases partitions").await;
    let gate = Gate::hold(&a.database_url).await;
    let p = producer(&broker.bootstrap);
    let pad = "p".repeat(200_000);
    for i in 0..340 {
        let payload = json!({ "gate": true, "seq": i, "pad": pad });
        send_event(&p, &topic, &format!("k{i}"), "Thing", &payload).await;
    }
    eventually(Duration::from_secs(30), "A's handlers wait for the gate", || async {
        a.lock_waits().await >= 1
    })
    .await;
    // The lanes take what the budget lets in.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let b = spawn_host_on(&a.database_url, &["testbed"], with).await;
    await_lease_holders(&a, 2, "A hands partitions over to B while its lanes hold the budget").await;
    gate.release().await;
    eventually(Duration::from_secs(60), "every event takes effect", || async {
        total_effects(&a).await == 340
    })
    .await;
    assert_each_effect_once(&a, 340).await;
    b.shutdown().await;
    a.shutdown().await;
}

/// Partitions a host handed over to a newcomer come back to it when the newcomer stops,
/// and it reads them again (a partition paused for its hand-over must not stay paused). The
/// stuck check, which would rescue it, is off.
#[tokio::test]
async fn partitions_handed_over_and_leased_back_are_read_again() {
    let broker = broker();
    let with = |c: &mut obx::config::Config| {
        broker.configure(c);
        c.consumer.stuck_after = Duration::ZERO;
    };
    let a = spawn_host_with(&["testbed"], with).await;
    await_lease_holders(&a, 1, "A leases partitions").await;
    let b = spawn_host_on(&a.database_url, &["testbed"], with).await;
    await_lease_holders(&a, 2, "A hands partitions over to B").await;
    b.shutdown().await;
    send_40_keys_and_await_their_effects(&a, &broker.bootstrap, &a.topic(DEDUP), "40 effects, all by A").await;
    a.shutdown().await;
}

/// A SIGKILLed host's partitions move to the survivor through their leases: Postgres ends
/// the dead host's lease session with its process. Both hosts' group sessions last 60 s, so
/// under the broker's group coordinator every event sent after the kill to one of the dead
/// host's partitions would wait a minute; here all of them take effect within 20 s.
#[tokio::test]
async fn a_sigkilled_hosts_partitions_move_to_the_survivor_without_waiting_for_a_group_session() {
    let broker = broker();
    let (setup, topic) = not_consuming(&broker, DEDUP).await;
    let process = host_process(&broker, &setup.database_url, &[("OBX_CHILD_SESSION_TIMEOUT_S", "60")]);
    let survivor = next_host(&broker, setup, |c| {
        c.consumer.session_timeout = Duration::from_secs(60);
        c.consumer.heartbeat_interval = Duration::from_secs(1);
    })
    .await;
    await_lease_holders(&survivor, 2, "both hosts lease partitions").await;
    drop(process);
    let took =
        send_40_keys_and_await_their_effects(&survivor, &broker.bootstrap, &topic, "40 effects after the kill").await;
    eprintln!("every partition handled {took:?} after the first send");
    assert_eq!(key_disorder(&survivor).await, 0);
    survivor.shutdown().await;
}

/// The host process that the SIGKILL tests start and kills; it runs only as that
/// test's child. Its consumer stores offsets after each commit, but commits them to Kafka
/// only every ten minutes: the kill comes after the database commits and before any offset
/// reaches the broker.
#[tokio::test]
#[ignore = "the host process of the SIGKILL test, which runs it"]
async fn host_process_to_kill() {
    let url = std::env::var("OBX_CHILD_DATABASE_URL").expect("run by the SIGKILL test only");
    let plugins = tempfile::tempdir().unwrap();
    let testbed = obx_tests::plugin("testbed");
    std::fs::copy(&testbed, plugins.path().join(testbed.file_name().unwrap())).unwrap();
    let mut config = obx_tests::test_config(&url, plugins.path());
    config.kafka.brokers = std::env::var("OBX_CHILD_BROKERS").unwrap();
    config.kafka.create_topics = std::env::var("OBX_CHILD_MOCK_BROKER").as_deref() != Ok("1");
    config.consumer.auto_commit_interval_ms = 600_000;
    if let Ok(seconds) = std::env::var("OBX_CHILD_SESSION_TIMEOUT_S") {
        config.consumer.session_timeout = Duration::from_secs(seconds.parse().unwrap());
        config.consumer.heartbeat_interval = Duration::from_secs(1);
    }
    let _host = obx::app::start(config).await.expect("starting the host");
    std::future::pending::<()>().await;
}

/// Rejoins of the consumer of `plugin` in this process.
fn rejoins(plugin: &str) -> f64 {
    metric_value(&format!("obx_consumer_rejoins_total{{plugin=\"{plugin}\"}}"))
}

#[tokio::test]
async fn a_consumer_that_holds_partitions_with_lag_and_makes_no_progress_rejoins_its_group() {
    let broker = broker();
    let Some(mock) = &broker.mock else {
        eprintln!("skipped: the fault (failing fetches) needs the mock cluster");
        return;
    };
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.consumer.stuck_after = Duration::from_secs(1);
        c.kafka
            .properties
            .insert("fetch.error.backoff.ms".into(), obx::config::Secret::new("100"));
    })
    .await;
    let p = producer(&host.host.brokers.bootstrap);
    let first = send_event(&p, &host.topic(DEDUP), "K", "Thing", &json!({ "seq": 0 })).await;
    eventually(Duration::from_secs(30), "the first event", || async {
        effects(&host, first).await == 1
    })
    .await;
    let before = rejoins("testbed");

    // The next 15 fetches fail (about 3 s, longer than `stuck_after`): the consumer holds
    // its partitions, the broker has new messages on them, and nothing arrives.
    mock.fail_requests(
        rdkafka::types::RDKafkaApiKey::Fetch,
        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        15,
    );
    send_many(&p, &host.topic(DEDUP), "K", 1..21).await;
    eventually(Duration::from_secs(30), "the stuck consumer rejoins", || async {
        rejoins("testbed") > before
    })
    .await;
    // Once fetches succeed again, the rejoined consumer takes every event, once, in order.
    eventually(Duration::from_secs(60), "all events after the rejoin", || async {
        total_effects(&host).await == 21
    })
    .await;
    assert_each_effect_once(&host, 21).await;
    assert_eq!(key_disorder(&host).await, 0, "per-key order");
    host.shutdown().await;
}

#[tokio::test]
async fn two_hosts_process_each_inbox_row_exactly_once_in_key_order() {
    let broker = broker();
    let with = |c: &mut obx::config::Config| {
        broker.configure(c);
        c.consumer.inbox_processors = 3;
    };
    let a = spawn_host_with(&["testbed"], with).await;
    let b = spawn_host_on(&a.database_url, &["testbed"], with).await;
    let p = producer(&broker.bootstrap);
    for seq in 0..300 {
        send_event(
            &p,
            &a.topic(INBOX),
            &format!("key-{}", seq % 30),
            "Thing",
            &json!({ "seq": seq }),
        )
        .await;
    }
    eventually(Duration::from_secs(60), "300 inbox rows processed", || async {
        a.count("SELECT count(*) FROM obx.inbox_event WHERE processed").await == 300
    })
    .await;
    assert_each_effect_once(&a, 300).await;
    // Within a key, effects happened in seq order.
    let disorder = key_disorder(&a).await;
    assert_eq!(disorder, 0, "per-key order in the inbox");
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test]
async fn a_poison_event_is_parked_with_its_key_while_others_flow() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.max_attempts = 3).await;
    let p = producer(&host.host.brokers.bootstrap);
    let a1 = send_event(&p, &host.topic(DEDUP), "A", "Thing", &json!({ "seq": 1 })).await;
    let a2 = send_event(
        &p,
        &host.topic(DEDUP),
        "A",
        "Thing",
        &json!({ "seq": 2, "poison": true }),
    )
    .await;
    let a3 = send_event(&p, &host.topic(DEDUP), "A", "Thing", &json!({ "seq": 3 })).await;
    let b: Vec<_> = send_many(&p, &host.topic(DEDUP), "B", 4..8).await;

    eventually(Duration::from_secs(20), "key B flows", || async {
        let mut all = true;
        for id in &b {
            all &= effects(&host, *id).await == 1;
        }
        all
    })
    .await;
    eventually(Duration::from_secs(20), "the poison event parked", || async {
        host.count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
            .await
            == 1
    })
    .await;
    let (dead_id, attempts, error): (i64, i32, String) =
        sqlx::query_as("SELECT id, attempts, error FROM obx.dead_letter")
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert_eq!(attempts, 3);
    assert!(error.contains("poisoned"), "{error}");
    assert_eq!(effects(&host, a1).await, 1);
    assert_eq!(effects(&host, a2).await, 0);
    // A3 waits behind A2, in order.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(effects(&host, a3).await, 0, "A3 overtook the parked A2");
    let letters = obx::inbox::dlq::list(&host.db, Some("testbed"), false, &Default::default())
        .await
        .unwrap()
        .rows;
    assert_eq!((letters.len(), letters[0].waiting), (1, 1));

    // The operator fixes the cause and retries: A2 then A3 run, in that order.
    cure_and_retry(&host, dead_id, a2, a3).await;
    let order = host
        .count(
            "SELECT count(*) FROM testbed.effects x, testbed.effects y WHERE x.seq = 2 AND y.seq = 3 AND x.at < y.at",
        )
        .await;
    assert_eq!(order, 1, "A2 ran before A3");
    assert!(
        obx::inbox::dlq::retry(&host.db, dead_id).await.is_err(),
        "a resolved letter cannot be retried again"
    );
    host.shutdown().await;
}

/// A copy of an event processed before its key was parked (a redelivery: an offset not yet
/// committed, a lease moved) is a duplicate, skipped when it arrives. It was stored in the
/// inbox behind the dead letter, its duplicate check put off until the letter was resolved:
/// a letter left longer than `retention.processed_after` let retention delete the event's
/// dedup record first, and the retry ran it a second time, after the events that followed it.
#[tokio::test]
async fn a_copy_of_an_event_processed_before_its_key_was_parked_is_not_stored_behind_it() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.max_attempts = 1).await;
    let p = producer(&host.host.brokers.bootstrap);
    let topic = host.topic(DEDUP);
    let a1 = send_event(&p, &topic, "A", "Thing", &json!({ "seq": 1 })).await;
    let poison = json!({ "seq": 2, "poison": true });
    let a2 = send_event(&p, &topic, "A", "Thing", &poison).await;
    eventually(Duration::from_secs(20), "A1 done and A2 parked", || async {
        effects(&host, a1).await == 1
            && host
                .count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
                .await
                == 1
    })
    .await;

    // A1 again, then A3: A3 waits behind A2 in the inbox, and A1 came before it.
    send_event_with_id(&p, &topic, "A", "Thing", &json!({ "seq": 1 }), a1).await;
    let a3 = send_event(&p, &topic, "A", "Thing", &json!({ "seq": 3 })).await;
    let stored = |id: uuid::Uuid| format!("SELECT count(*) FROM obx.inbox_event WHERE event_id = '{id}'");
    eventually(Duration::from_secs(20), "A3 stored behind A2", || async {
        host.count(&stored(a3)).await == 1
    })
    .await;
    assert_eq!(host.count(&stored(a1)).await, 0, "A1's copy was stored behind A2");

    let dead_id: i64 = sqlx::query_scalar("SELECT id FROM obx.dead_letter")
        .fetch_one(&host.db)
        .await
        .unwrap();
    cure_and_retry(&host, dead_id, a2, a3).await;
    assert_eq!(effects(&host, a1).await, 1);
    host.shutdown().await;
}

/// What an operator does for the poisoned `a2` parked as dead letter `dead_id`: takes the
/// poison out of its stored payload and retries it; then waits until `a2`, and `a3` behind
/// it, took effect.
async fn cure_and_retry(host: &TestHost, dead_id: i64, a2: uuid::Uuid, a3: uuid::Uuid) {
    sqlx::query("UPDATE obx.inbox_event SET payload = payload - 'poison' WHERE event_id = $1")
        .bind(a2)
        .execute(&host.db)
        .await
        .unwrap();
    obx::inbox::dlq::retry(&host.db, dead_id).await.unwrap();
    eventually(Duration::from_secs(20), "A2 and A3 after the retry", || async {
        effects(host, a2).await == 1 && effects(host, a3).await == 1
    })
    .await;
}

/// The operator's lists answer a page at a time, and their `Link` headers lead through every
/// row once, in the list's order: 2,500 dead letters (the lists were cut at 1,000 without a
/// word), quarantined messages, and timers that share a due time (their names order them).
/// A limit out of range or a cursor the list did not give is a 400.
#[tokio::test]
async fn the_operators_lists_come_in_pages_that_hold_every_row_once() {
    let host = spawn_host(&["testbed"]).await;
    for setup in [
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, parked) \
         SELECT 'ghost', gen_random_uuid(), 't', '{}', 'Thing', true FROM generate_series(1, 2500)",
        "INSERT INTO obx.dead_letter (consumer, event_id, topic, event_type, error, attempts) \
         SELECT consumer, event_id, topic, event_type, 'failed', 1 FROM obx.inbox_event WHERE consumer = 'ghost'",
        "INSERT INTO obx.quarantine (consumer, topic, kafka_partition, kafka_offset, headers, reason) \
         SELECT 'ghost', 't', 0, n, '{}', 'no eventId' FROM generate_series(1, 5) n",
        "INSERT INTO obx.timer (plugin, name, key, due_at, payload) \
         SELECT 'ghost', 't', n::text, '2100-01-01', '{}' FROM generate_series(1, 7) n",
    ] {
        sqlx::query(setup).execute(&host.db).await.unwrap();
    }

    let (letters, pages) = walk_pages(&host, "/v1/dlq?plugin=ghost").await;
    assert_eq!((letters.len(), pages), (2500, 3));
    let ids: Vec<i64> = letters.iter().map(|d| d["id"].as_i64().unwrap()).collect();
    assert!(
        ids.windows(2).all(|w| w[0] > w[1]),
        "dead letters newest first, each once"
    );
    let (quarantined, pages) = walk_pages(&host, "/v1/quarantine?plugin=ghost&limit=2").await;
    assert_eq!((quarantined.len(), pages), (5, 3));
    let ids: Vec<i64> = quarantined.iter().map(|q| q["id"].as_i64().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] > w[1]), "{ids:?}");
    let (timers, pages) = walk_pages(&host, "/v1/timers?plugin=ghost&limit=3").await;
    let keys: Vec<&str> = timers.iter().map(|t| t["key"].as_str().unwrap()).collect();
    assert_eq!((keys, pages), (vec!["1", "2", "3", "4", "5", "6", "7"], 3));

    for bad in [
        "/v1/dlq?limit=0",
        "/v1/dlq?limit=1001",
        "/v1/dlq?after=x",
        "/v1/quarantine?after=-",
        "/v1/timers?after=zz",
        "/v1/timers?after=00",
        // Postgres refuses a NUL: the request's fault, not 503 `database_unavailable`.
        "/v1/dlq?plugin=%00",
        "/v1/timers?plugin=a%00b",
        "/v1/quarantine?plugin=%00",
    ] {
        let answer = host.get(bad).await;
        assert_eq!(
            (answer.status, answer.code()),
            (400, "bad_request"),
            "{bad}: {}",
            answer.text
        );
    }
    host.shutdown().await;
}

/// A dead letter's retry whose commit is still running at `http.request_timeout` (a trigger
/// makes the update take 1.2 s and a deferred one the commit 1.5 s; the timeout is 2 s) is
/// answered with what it came to, as a command is. It was 503 `timeout`, while Postgres went
/// on to commit it: an operator was told the letter was still parked.
#[tokio::test]
async fn a_retry_still_committing_at_the_request_timeout_is_answered_done() {
    let host = spawn_host_with(&[], |c| c.http.request_timeout = Duration::from_secs(2)).await;
    for setup in [
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, parked) \
         VALUES ('ghost', gen_random_uuid(), 't', '{}', 'Thing', true)",
        "INSERT INTO obx.dead_letter (consumer, event_id, topic, event_type, error, attempts) \
         SELECT consumer, event_id, topic, event_type, 'failed', 1 FROM obx.inbox_event",
        "CREATE FUNCTION public.slow_update() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(1.2); RETURN NEW; END $$",
        "CREATE TRIGGER slow_update BEFORE UPDATE ON obx.dead_letter FOR EACH ROW EXECUTE FUNCTION public.slow_update()",
        "CREATE FUNCTION public.slow_commit() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$",
        "CREATE CONSTRAINT TRIGGER slow_commit AFTER UPDATE ON obx.dead_letter \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.slow_commit()",
    ] {
        sqlx::query(setup).execute(&host.db).await.unwrap();
    }
    let id = host.count("SELECT id FROM obx.dead_letter").await;
    let answer = host.post_json(&format!("/v1/dlq/{id}/retry"), json!({})).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert_eq!(answer.body["status"], "retried", "{}", answer.text);
    assert_eq!(
        host.count("SELECT count(*) FROM obx.dead_letter WHERE status = 'retried'")
            .await,
        1
    );
    host.shutdown().await;
}

/// Every row of a list, from `first` on through its `Link` headers, and how many pages it took.
async fn walk_pages(host: &TestHost, first: &str) -> (Vec<serde_json::Value>, usize) {
    let (mut rows, mut pages, mut path) = (Vec::new(), 0, first.to_string());
    loop {
        let answer = host.get(&path).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.text);
        rows.extend(answer.body.as_array().expect("a list is an array").iter().cloned());
        pages += 1;
        // A cursor that led back to an earlier page would walk for ever.
        assert!(pages <= 1_000, "{first}: still paging after {pages} pages");
        let Some(link) = answer.headers.get("link") else {
            return (rows, pages);
        };
        let link = link.to_str().unwrap();
        assert!(link.ends_with("; rel=\"next\""), "{link}");
        path = link.split_once('<').unwrap().1.split_once('>').unwrap().0.to_string();
    }
}

/// Events A1-A6 and B1-B6, interleaved; A4 carries `defer_violation` (what its handler leaves
/// for its commit), the others nothing. Their ids, A's and B's.
async fn a_and_b(
    broker: &TestBroker,
    topic: &str,
    defer_violation: serde_json::Value,
) -> (Vec<uuid::Uuid>, Vec<uuid::Uuid>) {
    let p = producer(&broker.bootstrap);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for seq in 1..=6 {
        let defer = if seq == 4 {
            defer_violation.clone()
        } else {
            json!(false)
        };
        let payload = json!({ "seq": seq, "defer_violation": defer });
        a.push(send_event(&p, topic, "A", "Thing", &payload).await);
        b.push(send_event(&p, topic, "B", "Thing", &json!({ "seq": 100 + seq })).await);
    }
    (a, b)
}

/// Waits until every event of key B and A1-A3 took effect once and one event is parked, then
/// checks that A5 and A6 wait behind the parked A4, in the inbox.
async fn a4_parked_while_b_flows(host: &TestHost, a: &[uuid::Uuid], b: &[uuid::Uuid]) {
    eventually(Duration::from_secs(30), "key B flows, A4 is parked", || async {
        let mut done = host
            .count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
            .await
            == 1;
        for id in b.iter().chain(&a[..3]) {
            done &= effects(host, *id).await == 1;
        }
        done
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, id) in a.iter().enumerate().skip(3) {
        assert_eq!(effects(host, *id).await, 0, "A{} ran although A4 is parked", i + 1);
    }
}

#[tokio::test]
async fn a_batch_around_a_poison_event_commits_the_others_once_and_parks_it_with_its_key() {
    poison_in_a_batch(json!(true)).await;
}

/// A dedup batch takes no savepoint per event: a handler that wrote its effect and then
/// failed rolls the whole batch back, so its write never commits, and the events before it,
/// done again, commit once.
#[tokio::test]
async fn a_handler_that_fails_after_writing_in_a_batch_commits_nothing_and_the_others_once() {
    poison_in_a_batch(json!("after-effect")).await;
}

/// Six events of key A, the fourth poisoned as `poison` says, between twelve of key B, all
/// in one lane's batches.
async fn poison_in_a_batch(poison: serde_json::Value) {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, DEDUP).await;
    let p = producer(&broker.bootstrap);
    let mut a = Vec::new();
    let mut b = Vec::new();
    for seq in 1..=6 {
        let poison = if seq == 4 { poison.clone() } else { json!(false) };
        a.push(send_event(&p, &topic, "A", "Thing", &json!({ "seq": seq, "poison": poison })).await);
        b.push(send_event(&p, &topic, "B", "Thing", &json!({ "seq": 100 + 2 * seq })).await);
        b.push(send_event(&p, &topic, "B", "Thing", &json!({ "seq": 101 + 2 * seq })).await);
    }
    // One lane takes every partition (and key).
    let host = next_host(&broker, first, |c| {
        c.consumer.lanes = 1;
        c.consumer.max_attempts = 2;
    })
    .await;
    a4_parked_while_b_flows(&host, &a, &b).await;
    let letters = obx::inbox::dlq::list(&host.db, Some("testbed"), false, &Default::default())
        .await
        .unwrap()
        .rows;
    assert_eq!((letters.len(), letters[0].waiting), (1, 2));
    assert_eq!(letters[0].attempts, 2);
    // Every effect once, each key in order.
    assert_each_effect_once(&host, 15).await;
    let disorder = key_disorder(&host).await;
    assert_eq!(disorder, 0, "per-key order across batches");
    assert_batched(
        &host,
        15,
        "SELECT count(DISTINCT processed_at) FROM obx.processed_event WHERE consumer = 'testbed'",
    )
    .await;
    host.shutdown().await;
}

/// A batch stops at a failed event and does the events before it again without it; when one
/// of those now fails too (a handler that fails only sometimes), both failures count as
/// attempts: the poison event is tried `max_attempts` times in all, not once more.
#[tokio::test]
async fn every_failure_a_batch_meets_counts_as_an_attempt_even_when_its_redo_fails() {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, DEDUP).await;
    let p = producer(&broker.bootstrap);
    send_event(&p, &topic, "A", "Thing", &json!({ "seq": 1, "gate": true })).await;
    // The gate's handler waits while the two events below queue behind it, so that the lane
    // takes them in one batch.
    let gate = Gate::hold(&first.database_url).await;
    let host = next_host(&broker, first, |c| {
        c.consumer.lanes = 1;
        c.consumer.max_attempts = 3;
        c.limits.call_deadline = Duration::from_secs(30);
        c.limits.lock_timeout = Duration::from_secs(30);
        c.limits.statement_timeout = Duration::from_secs(30);
    })
    .await;
    eventually(Duration::from_secs(30), "the gate's handler waits", || async {
        host.lock_waits().await >= 1
    })
    .await;
    // Runs: the batch runs the flaky event (its run 1), then fails on the poison one; done
    // again without it, the flaky event fails (run 2); alone, it succeeds (run 3).
    let flaky = send_event(&p, &topic, "A", "Thing", &json!({ "seq": 2, "flaky": 2 })).await;
    let poison = send_event(&p, &topic, "A", "Thing", &json!({ "seq": 3, "poison": "counted" })).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    gate.release().await;
    eventually(Duration::from_secs(30), "the poison event is dead-lettered", || async {
        host.count("SELECT count(*) FROM obx.dead_letter WHERE consumer = 'testbed'")
            .await
            == 1
    })
    .await;
    assert_eq!(
        host.count("SELECT last_value FROM testbed.flaky_runs").await,
        3,
        "the flaky event ran in a batch with the poison event, again without it, then alone"
    );
    assert_eq!(effects(&host, flaky).await, 1);
    let letters = obx::inbox::dlq::list(&host.db, Some("testbed"), false, &Default::default())
        .await
        .unwrap()
        .rows;
    assert_eq!((letters[0].event_id, letters[0].attempts), (poison, 3));
    let runs = host.count("SELECT last_value FROM testbed.poison_runs").await;
    assert_eq!(
        runs, 3,
        "the poison event's handler ran {runs} times for max_attempts 3"
    );
    host.shutdown().await;
}

/// A handler that returns `ok` but breaks a deferred constraint (`defer_violation`: true), or
/// leaves a deferred trigger that raises its own error (`"raise"`, SQLSTATE P0001): its
/// batch's commit is refused. The events go one at a time, the refusal counts as that event's
/// failed attempt, and it is parked with its key; the rest commit once. (It was taken for the
/// database being away, and retried for ever without counting: a constraint's refusal until
/// the first fix, any other refusal until the second.)
async fn a_refused_commit_parks_its_event(logical: &str, defer_violation: serde_json::Value) {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, logical).await;
    if defer_violation == "raise" {
        first.make_deferred_raise().await;
    }
    let (a, b) = a_and_b(&broker, &topic, defer_violation).await;
    let host = next_host(&broker, first, |c| {
        c.consumer.lanes = 1;
        c.consumer.max_attempts = 2;
    })
    .await;
    a4_parked_while_b_flows(&host, &a, &b).await;
    let letters = obx::inbox::dlq::list(&host.db, Some("testbed"), false, &Default::default())
        .await
        .unwrap()
        .rows;
    assert_eq!((letters.len(), letters[0].attempts), (1, 2), "{logical}");
    assert_eq!(letters[0].event_id, a[3]);
    assert!(letters[0].error.contains("commit was refused"), "{}", letters[0].error);
    // A late record of the same attempt (a second processor's, whose claim also lost its
    // transaction) is dropped: still one dead letter (CI once saw two, and waited for one).
    let mut session = host.plugin_session("testbed").await;
    let late: bool = sqlx::query_scalar("SELECT obx_api.inbox_fail_attempt($1, 2, 'late', true, 0)")
        .bind(a[3])
        .fetch_one(&mut session)
        .await
        .unwrap();
    assert!(!late, "{logical}: a parked event's attempt was recorded again");
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 1);
    assert_each_effect_once(&host, 9).await;
    assert_eq!(key_disorder(&host).await, 0);
    host.shutdown().await;
}

/// A claim made while another session holds an event's row, recording that event's failed
/// attempt (a processor whose claim's transaction was lost records it apart), stops before
/// that event: the events behind it on its key wait too. (Here the record commits after the
/// claim; one that commits between the claim's two statements is seen by the second, which
/// stops at any unprocessed event the claim does not hold.) The claim used to wait for the
/// row, then drop the event from its batch once it saw the attempt, but let the events behind
/// it in, by a stop it had fixed before the wait: they ran before it, out of their key's order
/// (CI once saw A5 run while A4 was parked). It now waits for no row but the head's.
#[tokio::test]
async fn a_claim_that_meets_an_attempt_being_recorded_stops_before_its_event() {
    let broker = broker();
    let (host, _) = not_consuming(&broker, INBOX).await;
    store_ten_inbox_events(&host, -1).await;
    let fourth: uuid::Uuid =
        sqlx::query_scalar("SELECT event_id FROM obx.inbox_event WHERE (payload->>'seq')::int = 3")
            .fetch_one(&host.db)
            .await
            .unwrap();
    let mut recorder = host.plugin_session("testbed").await;
    sqlx::Executor::execute(&mut recorder, "BEGIN").await.unwrap();
    let recorded: bool = sqlx::query_scalar("SELECT obx_api.inbox_fail_attempt($1, 1, 'lost', false, 60)")
        .bind(fourth)
        .fetch_one(&mut recorder)
        .await
        .unwrap();
    assert!(recorded);
    let mut claimer = host.plugin_session("testbed").await;
    let claimer_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut claimer)
        .await
        .unwrap();
    let claim = tokio::spawn(async move {
        // A claim that waits for the row (as the old one did) outlasts the role's lock timeout.
        sqlx::Executor::execute(&mut claimer, "BEGIN; SET LOCAL lock_timeout = '30s'")
            .await
            .unwrap();
        let seqs: Vec<i32> =
            sqlx::query_scalar("SELECT (payload::jsonb->>'seq')::int FROM obx_api.inbox_take_batch(64)")
                .fetch_all(&mut claimer)
                .await
                .unwrap();
        seqs
    });
    // The record commits once the claim has returned, or waits for the recorder.
    eventually(
        Duration::from_secs(10),
        "the claim returns or waits for the record",
        || async {
            claim.is_finished()
                || host
                    .count(&format!("SELECT cardinality(pg_blocking_pids({claimer_pid}))::bigint"))
                    .await
                    > 0
        },
    )
    .await;
    sqlx::Executor::execute(&mut recorder, "COMMIT").await.unwrap();
    let seqs = claim.await.unwrap();
    assert_eq!(
        seqs,
        [0, 1, 2],
        "the claim ran past an event whose attempt was being recorded"
    );
    host.shutdown().await;
}

/// A handler blocked in the host (a WASI sleep, which the epoch cannot stop) is stopped by
/// the call's backstop, which loses its transaction: the attempt is recorded apart, and the
/// event waits its backoff and is parked in the end, with its key, while others flow. In
/// inbox mode such an event was claimed again at once, for ever, without counting.
async fn a_handler_blocked_in_the_host_is_parked(logical: &str) {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, logical).await;
    let p = producer(&broker.bootstrap);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for seq in 1..=6 {
        let sleep = if seq == 4 { json!(600_000) } else { json!(null) };
        a.push(send_event(&p, &topic, "A", "Thing", &json!({ "seq": seq, "sleep_ms": sleep })).await);
        b.push(send_event(&p, &topic, "B", "Thing", &json!({ "seq": 100 + seq })).await);
    }
    let host = next_host(&broker, first, |c| {
        c.consumer.lanes = 1;
        c.consumer.max_attempts = 2;
        c.limits.call_deadline = Duration::from_millis(500);
        c.limits.statement_timeout = Duration::from_millis(500);
    })
    .await;
    a4_parked_while_b_flows(&host, &a, &b).await;
    let letters = obx::inbox::dlq::list(&host.db, Some("testbed"), false, &Default::default())
        .await
        .unwrap()
        .rows;
    assert_eq!((letters.len(), letters[0].attempts), (1, 2), "{logical}");
    assert_eq!(letters[0].event_id, a[3]);
    assert_each_effect_once(&host, 9).await;
    assert_eq!(key_disorder(&host).await, 0);
    host.shutdown().await;
}

#[tokio::test]
async fn an_inbox_handler_blocked_in_the_host_is_parked_not_retried_for_ever() {
    a_handler_blocked_in_the_host_is_parked(INBOX).await;
}

#[tokio::test]
async fn a_dedup_handler_blocked_in_the_host_is_parked_not_retried_for_ever() {
    a_handler_blocked_in_the_host_is_parked(DEDUP).await;
}

#[tokio::test]
async fn a_dedup_event_whose_commit_is_refused_is_parked_not_retried_for_ever() {
    a_refused_commit_parks_its_event(DEDUP, json!(true)).await;
}

#[tokio::test]
async fn an_inbox_event_whose_commit_is_refused_is_parked_not_retried_for_ever() {
    a_refused_commit_parks_its_event(INBOX, json!(true)).await;
}

#[tokio::test]
async fn a_dedup_event_whose_commit_a_deferred_trigger_refuses_is_parked() {
    a_refused_commit_parks_its_event(DEDUP, json!("raise")).await;
}

#[tokio::test]
async fn an_inbox_event_whose_commit_a_deferred_trigger_refuses_is_parked() {
    a_refused_commit_parks_its_event(INBOX, json!("raise")).await;
}

/// The next host of `first`'s service, consuming, whose handlers give up a lock wait after
/// 100 ms, and whose events are parked after two counted attempts; lost races go uncounted
/// for `grace`.
async fn racing_host(broker: &TestBroker, first: TestHost, grace: Duration) -> TestHost {
    next_host(broker, first, |c| {
        c.consumer.max_attempts = 2;
        c.consumer.backoff_initial = Duration::from_millis(50);
        c.consumer.backoff_max = Duration::from_millis(100);
        c.consumer.contention_grace = grace;
        c.limits.lock_timeout = Duration::from_millis(100);
    })
    .await
}

/// Waits until a session of the testbed waits for a lock: its consumer runs, and a handler
/// is at the gate.
async fn a_handler_waits_at_the_gate(host: &TestHost) {
    let role = host.plugin_role("testbed").await;
    let waiting =
        format!("SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}' AND wait_event_type = 'Lock'");
    eventually(Duration::from_secs(30), "a handler waits at the gate", || async {
        host.count(&waiting).await >= 1
    })
    .await;
}

/// A handler whose statement waits past `limits.lock_timeout` for a lock another session
/// holds (a reload's migration, an operator's `LOCK TABLE`) lost to concurrent work and is
/// not at fault: its event runs again after the backoff, as the same attempt, for as long as
/// the lock is held (within `consumer.contention_grace`), and takes effect once, in its key's
/// order, when the lock goes. Each such failure was charged, and the event parked after
/// `consumer.max_attempts` (here within half a second), its key with it. With `at_commit`,
/// the wait is plugin code's at the commit (a deferred trigger), which is the event's lost
/// race too.
async fn a_handler_that_loses_to_a_lock_is_not_charged_an_attempt(logical: &str, at_commit: bool) {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, logical).await;
    let waits = if at_commit {
        first.make_deferred_gate().await;
        json!({ "seq": 1, "defer_violation": "raise" })
    } else {
        json!({ "seq": 1, "gate": true })
    };
    let gate = Gate::hold(&first.database_url).await;
    let p = producer(&broker.bootstrap);
    let a1 = send_event(&p, &topic, "A", "Thing", &waits).await;
    let a2 = send_event(&p, &topic, "A", "Thing", &json!({ "seq": 2 })).await;
    let host = racing_host(&broker, first, Duration::from_secs(600)).await;
    a_handler_waits_at_the_gate(&host).await;
    // Ten tries or so, each a lock wait of 100 ms and a backoff.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let parked = "SELECT count(*) FROM obx.dead_letter";
    assert_eq!(
        host.count(parked).await,
        0,
        "{logical}: an event parked for a lock wait"
    );
    if logical == INBOX {
        let (attempts, error): (i32, Option<String>) =
            sqlx::query_as("SELECT attempts, last_error FROM obx.inbox_event WHERE event_id = $1")
                .bind(a1)
                .fetch_one(&host.db)
                .await
                .unwrap();
        assert_eq!(attempts, 0, "{error:?}");
        assert!(error.as_deref().unwrap_or_default().contains("lock"), "{error:?}");
    }
    assert_eq!(total_effects(&host).await, 0, "{logical}");
    gate.release().await;
    eventually(Duration::from_secs(20), "both events take effect", || async {
        total_effects(&host).await == 2
    })
    .await;
    assert_each_effect_once(&host, 2).await;
    assert_eq!(key_disorder(&host).await, 0, "{logical}");
    assert_eq!(host.count(parked).await, 0, "{logical}");
    for id in [a1, a2] {
        let attempt = host
            .count(&format!(
                "SELECT attempt::int8 FROM testbed.effects WHERE event_id = '{id}'"
            ))
            .await;
        assert_eq!(attempt, 1, "{logical}: the lock waits were counted as attempts");
    }
    host.shutdown().await;
}

/// Past `consumer.contention_grace` from its first lost race, a handler that keeps losing
/// is charged again, and its event parked after `consumer.max_attempts`: a lock nobody
/// releases (a forgotten transaction) ends in a dead letter, not in a key, or in dedup mode a
/// partition, held up for ever.
///
/// With `at_commit`, the lock is plugin code's at the commit (a deferred trigger), a lost
/// race of the event's too. Such a commit was taken for the database's failure and retried
/// without end: its key (in dedup mode, its partition) held up for ever.
async fn a_handler_that_keeps_losing_past_the_grace_is_parked(logical: &str, at_commit: bool) {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, logical).await;
    let waits = if at_commit {
        first.make_deferred_gate().await;
        json!({ "seq": 1, "defer_violation": "raise" })
    } else {
        json!({ "seq": 1, "gate": true })
    };
    let gate = Gate::hold(&first.database_url).await;
    let p = producer(&broker.bootstrap);
    let a1 = send_event(&p, &topic, "A", "Thing", &waits).await;
    let host = racing_host(&broker, first, Duration::from_secs(1)).await;
    eventually(Duration::from_secs(30), "the event is parked", || async {
        host.count("SELECT count(*) FROM obx.dead_letter").await == 1
    })
    .await;
    let (event_id, attempts, error): (uuid::Uuid, i32, String) =
        sqlx::query_as("SELECT event_id, attempts, error FROM obx.dead_letter")
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert_eq!((event_id, attempts), (a1, 2), "{logical}: {error}");
    let cause = if at_commit {
        "commit lost to concurrent work"
    } else {
        "lock"
    };
    assert!(error.contains(cause), "{logical}: {error}");
    gate.release().await;
    assert_eq!(total_effects(&host).await, 0, "{logical}");
    host.shutdown().await;
}

/// An event whose outbox rows wait at the commit for a lock on the host's own table (a newer
/// host's migration, an operator's `LOCK`) did nothing wrong: the race is the host's, lost
/// before the `COMMIT`, and the event is tried again as the database's failure, never
/// charged, whatever the grace; it takes effect once the lock goes. Taken for the event's
/// lost race, every event whose handler emits was parked once the grace had passed.
async fn an_event_whose_outbox_rows_wait_on_the_hosts_lock_is_not_charged(logical: &str) {
    use sqlx::Connection;
    let broker = broker();
    let (first, topic) = not_consuming(&broker, logical).await;
    let p = producer(&broker.bootstrap);
    let emit = json!({ "topic": "testbed.alpha" });
    let a1 = send_event(&p, &topic, "A", "Thing", &json!({ "seq": 1, "emit": emit })).await;
    let mut lock = sqlx::PgConnection::connect(&first.database_url).await.unwrap();
    for statement in ["BEGIN", "LOCK TABLE obx.outbox_event IN SHARE MODE"] {
        sqlx::query(statement).execute(&mut lock).await.unwrap();
    }
    let host = racing_host(&broker, first, Duration::from_secs(1)).await;
    a_handler_waits_at_the_gate(&host).await;
    // Past the grace (1 s), and far past two attempts' tries.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let parked = "SELECT count(*) FROM obx.dead_letter";
    assert_eq!(host.count(parked).await, 0, "{logical}: parked for the host's lock");
    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();
    eventually(Duration::from_secs(20), "the event takes effect", || async {
        total_effects(&host).await == 1
    })
    .await;
    let attempt = host
        .count(&format!(
            "SELECT attempt::int8 FROM testbed.effects WHERE event_id = '{a1}'"
        ))
        .await;
    assert_eq!(attempt, 1, "{logical}: the host's lock waits were counted as attempts");
    assert_eq!(host.count(parked).await, 0, "{logical}");
    host.shutdown().await;
}

#[tokio::test]
async fn a_dedup_event_whose_outbox_rows_wait_on_the_hosts_lock_is_not_charged() {
    an_event_whose_outbox_rows_wait_on_the_hosts_lock_is_not_charged(DEDUP).await;
}

#[tokio::test]
async fn an_inbox_event_whose_outbox_rows_wait_on_the_hosts_lock_is_not_charged() {
    an_event_whose_outbox_rows_wait_on_the_hosts_lock_is_not_charged(INBOX).await;
}

#[tokio::test]
async fn a_dedup_event_whose_commit_keeps_losing_past_the_grace_is_parked() {
    a_handler_that_keeps_losing_past_the_grace_is_parked(DEDUP, true).await;
}

#[tokio::test]
async fn an_inbox_event_whose_commit_keeps_losing_past_the_grace_is_parked() {
    a_handler_that_keeps_losing_past_the_grace_is_parked(INBOX, true).await;
}

#[tokio::test]
async fn a_dedup_handler_that_keeps_losing_past_the_grace_is_parked() {
    a_handler_that_keeps_losing_past_the_grace_is_parked(DEDUP, false).await;
}

#[tokio::test]
async fn an_inbox_handler_that_keeps_losing_past_the_grace_is_parked() {
    a_handler_that_keeps_losing_past_the_grace_is_parked(INBOX, false).await;
}

/// A handler that keeps losing to a lock is tried less and less often while the lock stays:
/// after a quarter of the time since its first lost race, at least the backoff and at most
/// `consumer.backoff_max`. At the attempt's backoff it was tried every lock wait and backoff
/// (here 150 ms, about 40 tries in 6 s; with the defaults about 550 in the grace), each try a
/// transaction.
async fn a_handler_held_at_a_lock_is_tried_less_and_less_often(logical: &str) {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, logical).await;
    let gate = Gate::hold(&first.database_url).await;
    let p = producer(&broker.bootstrap);
    send_event(&p, &topic, "A", "Thing", &json!({ "seq": 1, "gate": true })).await;
    let host = next_host(&broker, first, |c| {
        c.consumer.backoff_initial = Duration::from_millis(50);
        c.consumer.backoff_max = Duration::from_secs(2);
        c.limits.lock_timeout = Duration::from_millis(100);
    })
    .await;
    // Tries at 0, 0.15, 0.31, 0.51, 0.76, 1.1, 1.5, 2.0, 2.6, 3.4, 4.3, 5.5 s.
    let tries = host.tries_at_a_lock("testbed", Duration::from_secs(6)).await;
    assert!((3..=20).contains(&tries), "{logical}: {tries} tries in 6 s");
    gate.release().await;
    eventually(Duration::from_secs(10), "the event takes effect", || async {
        total_effects(&host).await == 1
    })
    .await;
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0, "{logical}");
    host.shutdown().await;
}

#[tokio::test]
async fn a_dedup_handler_held_at_a_lock_is_tried_less_and_less_often() {
    a_handler_held_at_a_lock_is_tried_less_and_less_often(DEDUP).await;
}

#[tokio::test]
async fn an_inbox_handler_held_at_a_lock_is_tried_less_and_less_often() {
    a_handler_held_at_a_lock_is_tried_less_and_less_often(INBOX).await;
}

#[tokio::test]
async fn a_dedup_handler_that_loses_to_a_lock_is_not_charged_an_attempt() {
    a_handler_that_loses_to_a_lock_is_not_charged_an_attempt(DEDUP, false).await;
}

#[tokio::test]
async fn an_inbox_handler_that_loses_to_a_lock_is_not_charged_an_attempt() {
    a_handler_that_loses_to_a_lock_is_not_charged_an_attempt(INBOX, false).await;
}

#[tokio::test]
async fn a_dedup_event_whose_commit_loses_to_a_lock_is_not_charged_an_attempt() {
    a_handler_that_loses_to_a_lock_is_not_charged_an_attempt(DEDUP, true).await;
}

#[tokio::test]
async fn an_inbox_event_whose_commit_loses_to_a_lock_is_not_charged_an_attempt() {
    a_handler_that_loses_to_a_lock_is_not_charged_an_attempt(INBOX, true).await;
}

/// An event whose commit plugin code holds past the host's bound (`commit_within`: four
/// statement timeouts and 2 s, here 6 s; Postgres times no part of a `COMMIT`) is cut off at
/// every attempt. Each cut counts as a failed attempt, and the event is parked in the end
/// while the other key flows. A cut was taken for the database's failure: never counted, the
/// event was tried for ever, and its partition (dedup) or key (inbox) held up with it.
async fn a_commit_cut_off_parks_its_event(logical: &str) {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, logical).await;
    // Far past the cut (6 s), however slowly the backend is ended on a loaded machine.
    first.make_deferred_sleep(30.0).await;
    let (a, b) = a_and_b(&broker, &topic, json!("raise")).await;
    let host = next_host(&broker, first, |c| {
        c.consumer.lanes = 1;
        c.consumer.max_attempts = 2;
        c.limits.statement_timeout = Duration::from_secs(1);
    })
    .await;
    eventually(Duration::from_secs(90), "the held event parked", || async {
        host.count("SELECT count(*) FROM obx.dead_letter").await == 1
    })
    .await;
    a4_parked_while_b_flows(&host, &a, &b).await;
    let letters = obx::inbox::dlq::list(&host.db, Some("testbed"), false, &Default::default())
        .await
        .unwrap()
        .rows;
    assert_eq!((letters.len(), letters[0].attempts), (1, 2), "{logical}");
    assert_eq!(letters[0].event_id, a[3]);
    assert!(letters[0].error.contains("cut off"), "{}", letters[0].error);
    assert_each_effect_once(&host, 9).await;
    assert_eq!(key_disorder(&host).await, 0);
    host.shutdown().await;
}

#[tokio::test]
async fn a_dedup_event_whose_commit_is_cut_off_is_parked() {
    a_commit_cut_off_parks_its_event(DEDUP).await;
}

#[tokio::test]
async fn an_inbox_event_whose_commit_is_cut_off_is_parked() {
    a_commit_cut_off_parks_its_event(INBOX).await;
}

/// A batch of events stops starting handlers once their emits reach one call's limit
/// (`limits.max_emit_bytes_per_call`): it holds its events until its commit, in one
/// statement. Nine queued events whose handlers emit 400 KB each commit in batches of three
/// at most, in either mode (a batch of 64 events of 16 MiB of emits each held 1 GiB).
async fn a_batch_emits_about_one_calls_limit_at_most(logical: &str) {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, logical).await;
    let p = producer(&broker.bootstrap);
    let emit = json!({ "topic": "testbed.alpha", "payload_bytes": 400_000 });
    for seq in 0..9 {
        send_event(&p, &topic, "k", "Thing", &json!({ "seq": seq, "emit": emit })).await;
    }
    let host = next_host(&broker, first, |c| {
        c.consumer.lanes = 1;
        c.limits.max_emit_bytes_per_call = 1_000_000;
        // Unpublished, the outbox rows keep the id of the transaction that wrote them.
        c.relay.enabled = false;
    })
    .await;
    eventually(Duration::from_secs(30), "9 events handled", || async {
        total_effects(&host).await == 9
    })
    .await;
    // A batch's events are written by one statement at its commit, outside any savepoint:
    // at most three 400 KB emits (the third reaches the 1 MB limit) share a transaction.
    let largest = host.largest_outbox_batch("testbed.alpha").await;
    assert!(
        largest <= 3,
        "{logical}: a batch committed {largest} events of 400 KB of emits each"
    );
    assert_eq!(key_disorder(&host).await, 0);
    host.shutdown().await;
}

#[tokio::test]
async fn a_dedup_batch_emits_about_one_calls_limit_at_most() {
    a_batch_emits_about_one_calls_limit_at_most(DEDUP).await;
}

#[tokio::test]
async fn an_inbox_batch_emits_about_one_calls_limit_at_most() {
    a_batch_emits_about_one_calls_limit_at_most(INBOX).await;
}

#[tokio::test]
async fn a_burst_is_stored_in_the_inbox_in_batches_in_order_and_handled_once() {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, INBOX).await;
    let p = producer(&broker.bootstrap);
    let mut ids = Vec::new();
    for seq in 0..90 {
        // A duplicate in the burst is stored once.
        let id = send_event(&p, &topic, &format!("k{}", seq % 3), "Thing", &json!({ "seq": seq })).await;
        if seq == 40 {
            send_event_with_id(&p, &topic, "k1", "Thing", &json!({ "seq": seq }), id).await;
        }
        ids.push(id);
    }
    let host = next_host(&broker, first, |c| c.consumer.lanes = 1).await;
    eventually(Duration::from_secs(30), "90 inbox rows processed", || async {
        host.count("SELECT count(*) FROM obx.inbox_event WHERE processed").await == 90
    })
    .await;
    assert_eq!(total_effects(&host).await, 90, "each event handled once");
    // Stored in arrival order: within each key, seq follows the order sent.
    let disorder = host
        .count(
            "SELECT count(*) FROM (SELECT (payload->>'seq')::int AS sent, \
                    lag((payload->>'seq')::int) OVER (PARTITION BY partition_key ORDER BY seq) AS prev \
             FROM obx.inbox_event) t WHERE prev > sent",
        )
        .await;
    assert_eq!(disorder, 0, "inbox order within a key");
    // Rows stored by one statement share its transaction's start time.
    assert_batched(&host, 90, "SELECT count(DISTINCT received_at) FROM obx.inbox_event").await;
    host.shutdown().await;
}

#[tokio::test]
async fn inbox_processors_handle_batches_and_park_a_poison_event_with_its_key() {
    inbox_poison_in_a_batch(json!(true)).await;
}

/// An inbox batch runs first without savepoints: a handler that wrote its effect and then
/// failed rolls that run back whole; the batch taken again with savepoints commits the
/// others once, and the failed write never.
#[tokio::test]
async fn an_inbox_handler_that_fails_after_writing_in_a_batch_commits_nothing_and_the_others_once() {
    inbox_poison_in_a_batch(json!("after-effect")).await;
}

/// Sixty events over two keys, the 32nd poisoned as `poison` says, through two inbox
/// processors.
async fn inbox_poison_in_a_batch(poison: serde_json::Value) {
    let broker = broker();
    let (first, topic) = not_consuming(&broker, INBOX).await;
    let p = producer(&broker.bootstrap);
    let mut ids = Vec::new();
    for seq in 0..60 {
        let poison = if seq == 31 { poison.clone() } else { json!(false) };
        ids.push(
            send_event(
                &p,
                &topic,
                &format!("k{}", seq % 2),
                "Thing",
                &json!({ "seq": seq, "poison": poison }),
            )
            .await,
        );
    }
    let host = next_host(&broker, first, |c| {
        c.consumer.max_attempts = 2;
        c.consumer.inbox_processors = 2;
    })
    .await;
    // k0 (even seqs) flows; k1 stops at 31, parked, and 33..59 wait behind it.
    eventually(Duration::from_secs(30), "k0 done and k1 parked at 31", || async {
        host.count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
            .await
            == 1
            && host.count("SELECT count(*) FROM obx.inbox_event WHERE processed").await == 30 + 15
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE processed").await,
        45
    );
    assert_each_effect_once(&host, 45).await;
    assert_eq!(effects(&host, ids[31]).await, 0);
    let letters = obx::inbox::dlq::list(&host.db, Some("testbed"), false, &Default::default())
        .await
        .unwrap()
        .rows;
    assert_eq!((letters.len(), letters[0].waiting, letters[0].attempts), (1, 14, 2));
    let disorder = key_disorder(&host).await;
    assert_eq!(disorder, 0, "per-key order across batches");
    assert_batched(
        &host,
        45,
        "SELECT count(DISTINCT processed_at) FROM obx.inbox_event WHERE processed",
    )
    .await;
    host.shutdown().await;
}

async fn send_many(
    p: &rdkafka::producer::FutureProducer,
    topic: &str,
    key: &str,
    seqs: std::ops::Range<i64>,
) -> Vec<uuid::Uuid> {
    let mut ids = Vec::new();
    for seq in seqs {
        ids.push(send_event(p, topic, key, "Thing", &json!({ "seq": seq })).await);
    }
    ids
}

/// A parked key's backlog does not hold up its plugin's other keys. An inbox claim looked
/// for its head by walking the consumer's unprocessed events in order, and the events
/// waiting behind a dead letter are unprocessed: every claim walked them all (3.5 s for
/// 200,000 on this machine), and past the plugin's statement timeout (2 s by default) no
/// event of the plugin moved. Here 100,000 events wait behind a dead letter and the
/// statement timeout is 300 ms; another key's events take effect, in order, and so do
/// events with no key, while the parked key's wait.
#[tokio::test]
async fn a_parked_keys_backlog_does_not_hold_up_its_plugins_other_keys() {
    parked_flood(Flood {
        backlog: 100_000,
        ..Flood::default()
    })
    .await;
}

/// A flood of parked events does not hold up its plugin. Whoever can write to a subscribed
/// topic can send events the handler refuses, each parked at its first attempt: with no key,
/// or each with a key of its own, so that nothing waits behind them. A claim's walk read
/// them all the same: its first 256 unprocessed events were all parked, so it fell back to
/// each key's head, which read every parked event with no key and made two index descents
/// per parked key. Here 200,000 such events are parked (half with no key, half each with a
/// key of its own) and the statement timeout is 300 ms; the events behind them take effect.
#[tokio::test]
async fn a_flood_of_parked_events_does_not_hold_up_its_plugin() {
    parked_flood(Flood {
        parked: 200_000,
        key: "CASE WHEN g % 2 = 0 THEN 'flood-' || g END",
        ..Flood::default()
    })
    .await;
}

/// The same flood, parked events with no key only, behind a key in backoff with 300 events:
/// the walk's first 256 cannot run, so each claim falls back to the keys' heads, and finds
/// the events with no key among those that are not parked. (It read the parked ones too,
/// one by one: 32 ms a claim for these 200,000, 0.6 ms now; a timeout would take millions,
/// so this test shows the fallback's results, not that cost.)
#[tokio::test]
async fn a_flood_of_parked_events_with_no_key_does_not_hold_up_a_claims_fallback() {
    parked_flood(Flood {
        parked: 200_000,
        stalled: 300,
        ..Flood::default()
    })
    .await;
}

/// A flood of parked keys, each with an event waiting behind its dead letter, does not hold
/// up its plugin. The events behind were in the walk: its first 256 could not run, every
/// claim fell back to the keys' heads, and the fallback made two index descents for each of
/// the 100,000 parked keys, about a second, past the 300 ms statement timeout. Now an event
/// behind a dead letter is held, out of the walk, and its key is not visited.
#[tokio::test]
async fn a_flood_of_parked_keys_with_backlogs_does_not_hold_up_its_plugin() {
    parked_flood(Flood {
        parked: 100_000,
        key: "'flood-' || g",
        followed: true,
        ..Flood::default()
    })
    .await;
}

/// A flood of parked keys does not hold up a claim's fallback: behind a key in backoff with
/// 300 events, each claim falls back to the keys' heads, and visited each of the 100,000
/// parked keys; now only the keys with an event that can run.
#[tokio::test]
async fn a_flood_of_parked_keys_does_not_hold_up_a_claims_fallback() {
    parked_flood(Flood {
        parked: 100_000,
        key: "'flood-' || g",
        stalled: 300,
        ..Flood::default()
    })
    .await;
}

/// An event stored while its key's dead letter is released is held only as long as the
/// letter is parked, whichever of the two commits first. The store reads the parked row FOR
/// SHARE (`obx.inbox_event_held`, as the consumer stores an event): a release that comes second waits for the store, then frees the new event with the
/// others; a store that comes second waits for the release, then finds the letter no longer
/// parked. Held for ever, the event would never run: a claim does not read held events.
#[tokio::test]
async fn an_event_stored_while_its_dead_letter_is_released_is_not_left_held() {
    let host = spawn_host(&[]).await;
    let store = |n: i64| {
        format!(
            "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, held) \
             VALUES ('ghost', gen_random_uuid(), 't', '{{\"n\": {n}}}', 'Thing', 'K', \
                     obx.inbox_event_held('ghost', 't', 'K'))"
        )
    };
    let park = |parked: bool| {
        format!("UPDATE obx.inbox_event SET parked = {parked} WHERE consumer = 'ghost' AND payload->>'n' = '0'")
    };
    let held = || host.count("SELECT count(*) FROM obx.inbox_event WHERE held");
    let waiting = || a_session_waits_for_a_lock(&host, "a session waits for a lock");
    sqlx::query(&store(0)).execute(&host.db).await.unwrap();
    sqlx::query(&park(true)).execute(&host.db).await.unwrap();

    // The store first: the release waits for it, and frees the stored event.
    let mut first = host.db.begin().await.unwrap();
    sqlx::query(&store(1)).execute(&mut *first).await.unwrap();
    let release = tokio::spawn({
        let db = host.db.clone();
        async move { sqlx::query(&park(false)).execute(&db).await.unwrap() }
    });
    waiting().await;
    first.commit().await.unwrap();
    release.await.unwrap();
    assert_eq!(held().await, 0, "the release frees an event stored before it");

    // Parked again, its event is held again; the release first: the store waits for it, and
    // the event it stores is not held.
    sqlx::query(&park(true)).execute(&host.db).await.unwrap();
    assert_eq!(held().await, 1, "parking holds the key's later events");
    let mut first = host.db.begin().await.unwrap();
    sqlx::query(&park(false)).execute(&mut *first).await.unwrap();
    let stored = tokio::spawn({
        let db = host.db.clone();
        let sql = store(2);
        async move { sqlx::query(&sql).execute(&db).await.unwrap() }
    });
    waiting().await;
    first.commit().await.unwrap();
    stored.await.unwrap();
    assert_eq!(held().await, 0, "an event stored behind a released letter is not held");
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE consumer = 'ghost'")
            .await,
        3
    );
    host.shutdown().await;
}

/// Two dead letters of one key released at the same time do not leave the key's events
/// held. Each release, seeing the other's letter still parked, kept them held; now a key's
/// releases are taken one at a time, and the second sees what the first did.
#[tokio::test]
async fn two_dead_letters_of_one_key_released_together_leave_nothing_held() {
    let host = spawn_host(&[]).await;
    sqlx::query(
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, parked) \
         SELECT 'ghost', gen_random_uuid(), 't', jsonb_build_object('n', n), 'Thing', 'K', n < 2 \
         FROM generate_series(0, 2) n ORDER BY n",
    )
    .execute(&host.db)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE obx.inbox_event SET held = obx.inbox_event_held(consumer, topic, partition_key) WHERE NOT parked",
    )
    .execute(&host.db)
    .await
    .unwrap();
    let held = || host.count("SELECT count(*) FROM obx.inbox_event WHERE held");
    assert_eq!(held().await, 1);
    let discard = |n: i64| {
        format!(
            "UPDATE obx.inbox_event SET parked = false, processed = true \
             WHERE consumer = 'ghost' AND payload->>'n' = '{n}'"
        )
    };
    let mut first = host.db.begin().await.unwrap();
    sqlx::query(&discard(0)).execute(&mut *first).await.unwrap();
    let second = tokio::spawn({
        let db = host.db.clone();
        let sql = discard(1);
        async move { sqlx::query(&sql).execute(&db).await.unwrap() }
    });
    a_session_waits_for_a_lock(&host, "the second release waits for the first").await;
    first.commit().await.unwrap();
    second.await.unwrap();
    assert_eq!(held().await, 0, "the key's last event is free");
    host.shutdown().await;
}

/// A release in a transaction that keeps one snapshot (REPEATABLE READ, as an operator's
/// session may) fails rather than leave a key's events held: it saw the key's earlier dead
/// letter still parked, released since by another session, and held the events behind it
/// for ever.
#[tokio::test]
async fn a_release_on_an_old_snapshot_fails_rather_than_hold_a_key_for_ever() {
    let host = spawn_host(&[]).await;
    sqlx::query(
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, parked, held) \
         SELECT 'ghost', gen_random_uuid(), 't', jsonb_build_object('n', n), 'Thing', 'K', n IN (0, 2), n > 0 \
         FROM generate_series(0, 3) n ORDER BY n",
    )
    .execute(&host.db)
    .await
    .unwrap();
    let release = |n: i64| format!("UPDATE obx.inbox_event SET parked = false WHERE payload->>'n' = '{n}'");
    let mut old = host.db.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *old)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM obx.inbox_event")
        .execute(&mut *old)
        .await
        .unwrap();
    sqlx::query(&release(0)).execute(&host.db).await.unwrap();
    let refused = sqlx::query(&release(2)).execute(&mut *old).await.unwrap_err();
    assert_eq!(
        refused.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("40001"),
        "{refused}"
    );
    drop(old);
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE held AND seq > (SELECT min(seq) FROM obx.inbox_event WHERE parked)")
            .await,
        1,
        "the event behind the letter still parked stays held"
    );
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE held AND seq < (SELECT min(seq) FROM obx.inbox_event WHERE parked)")
            .await,
        0,
        "the events before it are free"
    );
    host.shutdown().await;
}

/// Parking an event costs the same behind any backlog, and releasing it frees the events
/// held behind it a part at a time: the park holds the first 1,000 of the 20,000 events
/// already behind it (those stored later are held as they come); the release frees the first
/// 1,000 held and names the key, and each later part frees up to 10,000 more, in order,
/// until none is left and the key is no longer named. The release freed all 21,000 in its own
/// statement before (3.2 s per 200,000 here), so a key with millions behind its letter could
/// not be released through the API within its request timeout. Each statement here runs under
/// a 5 s statement timeout; the consumer is no plugin's, so no processor frees a part.
#[tokio::test]
async fn a_key_with_a_long_backlog_is_parked_and_released_in_short_statements() {
    let host = spawn_host(&[]).await;
    sqlx::query(
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key) \
         SELECT 'ghost', gen_random_uuid(), 't', jsonb_build_object('n', n), 'Thing', 'K' \
         FROM generate_series(0, 20000) n ORDER BY n",
    )
    .execute(&host.db)
    .await
    .unwrap();
    let short = |sql: String| {
        let db = host.db.clone();
        async move {
            let mut tx = db.begin().await.unwrap();
            sqlx::query("SET LOCAL statement_timeout = '5s'")
                .execute(&mut *tx)
                .await
                .unwrap();
            let freed: Option<i32> = sqlx::query_scalar(&sql).fetch_optional(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
            freed
        }
    };
    let park = |parked: bool| {
        short(format!(
            "UPDATE obx.inbox_event SET parked = {parked} WHERE consumer = 'ghost' AND payload->>'n' = '0' \
             RETURNING 0"
        ))
    };
    let held = || host.count("SELECT count(*) FROM obx.inbox_event WHERE held");
    let named = || host.count("SELECT count(*) FROM obx.inbox_key_freeing WHERE consumer = 'ghost'");
    park(true).await;
    assert_eq!(held().await, 1000);
    sqlx::query(
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, held) \
         SELECT 'ghost', gen_random_uuid(), 't', jsonb_build_object('n', n), 'Thing', 'K', \
                obx.inbox_event_held('ghost', 't', 'K') \
         FROM generate_series(20001, 40000) n ORDER BY n",
    )
    .execute(&host.db)
    .await
    .unwrap();
    assert_eq!(held().await, 21_000);
    assert_eq!(named().await, 0);
    // First to last: no free event comes after a held one.
    let passed = || {
        host.count(
            "SELECT count(*) FROM obx.inbox_event f WHERE NOT f.held AND NOT f.processed \
             AND f.seq > (SELECT min(h.seq) FROM obx.inbox_event h WHERE h.held)",
        )
    };
    park(false).await;
    assert_eq!((held().await, named().await), (20_000, 1), "the release frees 1,000");
    assert_eq!(passed().await, 0);
    let part = || short("SELECT obx.inbox_free_key('ghost', 't', 'K', 10000)".to_string());
    for (freed, left, still_named) in [(10_000, 10_000, 1), (10_000, 0, 0), (0, 0, 0)] {
        assert_eq!(part().await, Some(freed));
        assert_eq!((held().await, named().await), (left, still_named));
        assert_eq!(passed().await, 0);
    }
    host.shutdown().await;
}

/// A dead letter discarded through the API with 12,000 events held behind it: the release
/// frees the first 1,000, the plugin's inbox processors free the rest in parts, and every
/// event of the key takes effect once, in order. No event stays held and no key stays named.
#[tokio::test]
async fn a_long_backlog_behind_a_discarded_letter_is_freed_by_the_processors_in_order() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.max_attempts = 1).await;
    a_backlog_behind_a_discarded_letter_takes_effect(&host, 12_000, &[]).await;
    assert_each_effect_once(&host, 12_000).await;
    assert_eq!(host.count("SELECT count(*) FROM obx.inbox_event WHERE held").await, 0);
    host.shutdown().await;
}

/// A part that runs past the plugin's statement timeout is tried again smaller, so that a
/// slow database frees a long backlog too. Here a trigger makes every tenth event a plugin's
/// session frees take a millisecond more, so a part of 10,000 takes over a second against a
/// 500 ms timeout: at a fixed size every part failed, and the key stayed held after the
/// release's first 1,000.
#[tokio::test]
async fn a_part_past_the_statement_timeout_is_tried_again_smaller() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.consumer.max_attempts = 1;
        c.limits.statement_timeout = Duration::from_millis(500);
    })
    .await;
    let role = host.plugin_role("testbed").await;
    let slow = [
        format!(
            "CREATE FUNCTION public.slow_free() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF session_user = '{role}' AND NEW.seq % 10 = 0 THEN PERFORM pg_sleep(0.001); END IF; \
             RETURN NEW; END $$"
        ),
        "CREATE TRIGGER slow_free BEFORE UPDATE ON obx.inbox_event FOR EACH ROW \
         WHEN (OLD.held AND NOT NEW.held) EXECUTE FUNCTION public.slow_free()"
            .to_string(),
    ];
    a_backlog_behind_a_discarded_letter_takes_effect(&host, 6000, &slow).await;
    host.shutdown().await;
}

/// Key A's dead letter (the consumer's `max_attempts` is 1) with `events` held behind it,
/// then `setup`, then the letter discarded through the API: every event of key A takes
/// effect, in order, and no key stays named for freeing.
async fn a_backlog_behind_a_discarded_letter_takes_effect(host: &TestHost, events: i64, setup: &[String]) {
    let p = producer(&host.host.brokers.bootstrap);
    let topic = host.topic(INBOX);
    send_event(&p, &topic, "A", "Thing", &json!({ "seq": 0, "poison": true })).await;
    eventually(Duration::from_secs(20), "key A parked", || async {
        host.count("SELECT count(*) FROM obx.dead_letter").await == 1
    })
    .await;
    sqlx::query(&format!(
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, held) \
         SELECT e.consumer, gen_random_uuid(), e.topic, jsonb_build_object('seq', g), 'Thing', 'A', \
                obx.inbox_event_held(e.consumer, e.topic, 'A') \
         FROM obx.inbox_event e, generate_series(1, {events}) g WHERE e.parked ORDER BY g"
    ))
    .execute(&host.db)
    .await
    .unwrap();
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE held").await,
        events
    );
    for sql in setup {
        sqlx::query(sql).execute(&host.db).await.unwrap();
    }
    let id = host.count("SELECT id FROM obx.dead_letter").await;
    let answer = host.post_json(&format!("/v1/dlq/{id}/discard"), json!({})).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    eventually(Duration::from_secs(120), "key A's backlog takes effect", || async {
        host.count("SELECT count(*) FROM testbed.effects WHERE key = 'A'").await == events
    })
    .await;
    assert_eq!(key_disorder(host).await, 0, "key A in order");
    assert_eq!(host.count("SELECT count(*) FROM obx.inbox_key_freeing").await, 0);
}

/// A processor's part locks one named key at most, and the keys take turns: with five keys
/// named, `obx_api.inbox_free_held` on the plugin's own session frees a part of the one named
/// longest and holds one advisory lock. (Trying the key's lock in the query's `WHERE` took
/// it for every named key the sort read, and held them all to the commit, so the releases
/// and parks of every such key waited for the part; and a key was named again at the back
/// of the queue only after its last part.) No inbox processor runs here.
#[tokio::test]
async fn a_part_locks_one_named_key_and_the_keys_take_turns() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.inbox_processors = 0).await;
    for key in ["K1", "K2", "K3", "K4", "K5"] {
        for sql in [
            format!(
                "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, parked) \
                 VALUES ('testbed', gen_random_uuid(), 't', '{{}}', 'Thing', '{key}', true)"
            ),
            format!(
                "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, held) \
                 SELECT 'testbed', gen_random_uuid(), 't', jsonb_build_object('n', n), 'Thing', '{key}', \
                        obx.inbox_event_held('testbed', 't', '{key}') \
                 FROM generate_series(1, 1500) n ORDER BY n"
            ),
            format!("UPDATE obx.inbox_event SET parked = false WHERE partition_key = '{key}' AND parked"),
        ] {
            sqlx::query(&sql).execute(&host.db).await.unwrap();
        }
    }
    let named = || host.count("SELECT count(*) FROM obx.inbox_key_freeing");
    assert_eq!(named().await, 5);
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE held").await,
        5 * 500
    );
    let mut session = host.plugin_session("testbed").await;
    for (key, left) in [
        ("K1", 400),
        ("K2", 400),
        ("K3", 400),
        ("K4", 400),
        ("K5", 400),
        ("K1", 300),
    ] {
        let mut tx = sqlx::Connection::begin(&mut session).await.unwrap();
        let freed: i32 = sqlx::query_scalar("SELECT obx_api.inbox_free_held(100)")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        let locks: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        tx.commit().await.unwrap();
        assert_eq!((freed, locks), (100, 1), "a part of {key}");
        let held = host
            .count(&format!(
                "SELECT count(*) FROM obx.inbox_event WHERE held AND partition_key = '{key}'"
            ))
            .await;
        assert_eq!(held, left, "the part was {key}'s");
    }
    // What a plugin can do with them: free its own held events early (harmless: a key's head
    // is its first unprocessed event, held or not), at most 100,000 and at least one a call,
    // and nothing else.
    let freed: i32 = sqlx::query_scalar("SELECT obx_api.inbox_free_held(NULL)")
        .fetch_one(&mut session)
        .await
        .unwrap();
    assert_eq!(freed, 1);
    for refused in [
        "SELECT obx.inbox_free_key('testbed', 't', 'K1', 100)",
        "DELETE FROM obx.inbox_key_freeing",
        "INSERT INTO obx.inbox_key_freeing (consumer, topic, partition_key) VALUES ('other', 't', 'K')",
    ] {
        let e = sqlx::query(refused).execute(&mut session).await.unwrap_err();
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .unwrap_or_default()
            .to_string();
        assert_eq!(code, "42501", "{refused}: {e}");
    }
    assert_eq!(named().await, 5);
    host.shutdown().await;
}

/// Waits until one session of the host's database waits for a lock.
async fn a_session_waits_for_a_lock(host: &TestHost, what: &str) {
    eventually(Duration::from_secs(10), what, || async {
        host.count(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await
            == 1
    })
    .await
}

/// What [`parked_flood`] puts in the inbox before two events with no key and three of key B.
struct Flood {
    /// Events of key A, waiting behind its dead letter.
    backlog: i64,
    /// Events of key C, the first in backoff for an hour: a walk that meets them first
    /// cannot run any of its first 256, and the claim falls back to the keys' heads.
    stalled: i64,
    /// Events parked as the consumer parks a refused event, at its first attempt.
    parked: i64,
    /// Each parked event's key, an SQL expression of its number `g`.
    key: &'static str,
    /// Each parked event with a key has an event waiting behind it.
    followed: bool,
}

impl Default for Flood {
    fn default() -> Self {
        Flood {
            backlog: 0,
            stalled: 0,
            parked: 0,
            key: "NULL",
            followed: false,
        }
    }
}

/// Key A's dead letter with two events behind it, then what `flood` says, then two events
/// with no key and three of key B: those five take effect, B's in order, with the plugin's
/// statement timeout at 300 ms; key A's and key C's wait, and the events behind a dead letter
/// are held.
async fn parked_flood(flood: Flood) {
    let host = spawn_host_with(&["testbed"], |c| {
        c.consumer.max_attempts = 1;
        c.limits.statement_timeout = Duration::from_millis(300);
        c.limits.lock_timeout = Duration::from_millis(100);
    })
    .await;
    let p = producer(&host.host.brokers.bootstrap);
    let topic = host.topic(INBOX);
    send_event(&p, &topic, "A", "Thing", &json!({ "seq": 1, "poison": true })).await;
    eventually(Duration::from_secs(20), "key A parked", || async {
        host.count("SELECT count(*) FROM obx.dead_letter").await == 1
    })
    .await;
    // Two more of key A, stored by the consumer behind its dead letter.
    send_many(&p, &topic, "A", 2..4).await;
    eventually(Duration::from_secs(20), "key A's events stored", || async {
        host.count("SELECT count(*) FROM obx.inbox_event WHERE partition_key = 'A'")
            .await
            == 3
    })
    .await;
    let followers = if flood.followed { flood.parked } else { 0 };
    // Rows as the consumer stores them (held behind a parked event of their key), on the
    // topic of key A's dead letter.
    let rows = [
        (flood.backlog, "'A'", "false", "NULL"),
        (flood.stalled.min(1), "'C'", "false", "now() + interval '1 hour'"),
        (flood.stalled - flood.stalled.min(1), "'C'", "false", "NULL"),
        (flood.parked, flood.key, "true", "NULL"),
        (followers, flood.key, "false", "NULL"),
        (2, "NULL", "false", "NULL"),
    ];
    for (events, key, parked, next_attempt_at) in rows {
        sqlx::query(&format!(
            "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, \
                                          attempts, last_error, parked, next_attempt_at, held) \
             SELECT e.consumer, gen_random_uuid(), e.topic, jsonb_build_object('seq', g), 'Thing', \
                    {key}, {parked}::int, CASE WHEN {parked} THEN 'refused' END, {parked}, {next_attempt_at}, \
                    NOT {parked} AND obx.inbox_event_held(e.consumer, e.topic, {key}) \
             FROM obx.inbox_event e, generate_series(1, {events}) g WHERE e.parked AND e.partition_key = 'A'",
        ))
        .execute(&host.db)
        .await
        .unwrap();
    }
    let b = send_many(&p, &topic, "B", 1..4).await;
    eventually(
        Duration::from_secs(30),
        "key B and the events with no key flow",
        || async {
            let mut all = host
                .count("SELECT count(*) FROM testbed.effects WHERE key IS NULL")
                .await
                == 2;
            for id in &b {
                all &= effects(&host, *id).await == 1;
            }
            all
        },
    )
    .await;
    // Key B in order (the events with no key are independent of each other).
    let b_disorder = host
        .count(
            "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (ORDER BY at) AS prev \
             FROM testbed.effects WHERE key = 'B') t WHERE prev > seq",
        )
        .await;
    assert_eq!(b_disorder, 0);
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE parked").await,
        flood.parked + 1,
        "the parked events stay parked"
    );
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE held").await,
        flood.backlog + followers + 2,
        "the events behind a dead letter are held, and only those"
    );
    assert_eq!(
        host.count("SELECT count(*) FROM testbed.effects WHERE key IN ('A', 'C')")
            .await,
        0
    );
    host.shutdown().await;
}

/// A plugin's parked events are discarded together (`POST /v1/dlq/discard?plugin=`, `obx dlq
/// discard --parked PLUGIN`), as each is by its id: marked processed without running, and
/// their keys move on. One id at a time, a flood of refused events took an operator a request
/// per event.
#[tokio::test]
async fn a_plugins_parked_events_are_discarded_together() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    let topic = host.topic(INBOX);
    let (mut bad, mut next) = (Vec::new(), Vec::new());
    for key in ["K1", "K2", "K3"] {
        bad.push(send_event(&p, &topic, key, "Thing", &json!({ "reject": true })).await);
        next.push(send_event(&p, &topic, key, "Thing", &json!({ "seq": 2 })).await);
    }
    eventually(Duration::from_secs(20), "three parked", || async {
        host.count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
            .await
            == 3
    })
    .await;
    let refused = host.post_json("/v1/dlq/discard", json!({})).await;
    assert_eq!(
        (refused.status, refused.code()),
        (400, "bad_request"),
        "{}",
        refused.text
    );
    let other = host.post_json("/v1/dlq/discard?plugin=ghost", json!({})).await;
    assert_eq!(
        (other.status, other.code()),
        (404, "unknown_plugin"),
        "a name that is no plugin's and no letter's: {}",
        other.text
    );

    let answer = host.post_json("/v1/dlq/discard?plugin=testbed", json!({})).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert_eq!(answer.body["discarded"], 3);
    assert_eq!(answer.body["more"], false);
    eventually(Duration::from_secs(20), "the keys move on", || async {
        let mut all = true;
        for id in &next {
            all &= effects(&host, *id).await == 1;
        }
        all
    })
    .await;
    for id in &bad {
        assert_eq!(effects(&host, *id).await, 0, "a discarded event never runs");
    }
    assert_eq!(
        host.count("SELECT count(*) FROM obx.dead_letter WHERE status = 'discarded' AND resolved_at IS NOT NULL")
            .await,
        3
    );
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE parked OR NOT processed")
            .await,
        0
    );
    for id in &bad {
        let recorded = host
            .count(&format!(
                "SELECT count(*) FROM obx.processed_event WHERE consumer = 'testbed' AND event_id = '{id}'"
            ))
            .await;
        assert_eq!(
            recorded, 1,
            "a discarded event is recorded as processed: delivered again, a duplicate"
        );
    }
    let again = host.post_json("/v1/dlq/discard?plugin=testbed", json!({})).await;
    assert_eq!(again.body["discarded"], 0, "{}", again.text);

    // Past a batch: 1,001 parked; the first answer says up to which id it discards, and a
    // letter parked after it is left to a later request.
    let park = |n: i64| {
        sqlx::query(
            "WITH e AS ( \
                 INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, \
                                              attempts, last_error, parked) \
                 SELECT 'testbed', gen_random_uuid(), 'bulk', '{}', 'Thing', 'bulk-' || g, 1, 'refused', true \
                 FROM generate_series(1, $1) g \
                 RETURNING consumer, event_id, topic, partition_key, event_type) \
             INSERT INTO obx.dead_letter (consumer, event_id, topic, partition_key, event_type, error, attempts) \
             SELECT consumer, event_id, topic, partition_key, event_type, 'refused', 1 FROM e",
        )
        .bind(n)
        .execute(&host.db)
    };
    park(1001).await.unwrap();
    let first = host.post_json("/v1/dlq/discard?plugin=testbed", json!({})).await;
    assert_eq!(
        (&first.body["discarded"], &first.body["more"]),
        (&json!(1000), &json!(true)),
        "{}",
        first.text
    );
    park(1).await.unwrap();
    let through = first.body["through"].as_i64().unwrap();
    let rest = host
        .post_json(&format!("/v1/dlq/discard?plugin=testbed&through={through}"), json!({}))
        .await;
    assert_eq!(
        (&rest.body["discarded"], &rest.body["more"]),
        (&json!(1), &json!(false)),
        "{}",
        rest.text
    );
    assert_eq!(
        host.count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
            .await,
        1,
        "the letter parked after the first request is left"
    );
    host.shutdown().await;
}

#[tokio::test]
async fn a_discarded_dead_letter_releases_its_key_in_inbox_mode() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    // A rejection is not retried: parked at once.
    let bad = send_event(&p, &host.topic(INBOX), "K", "Thing", &json!({ "reject": true })).await;
    let next = send_event(&p, &host.topic(INBOX), "K", "Thing", &json!({ "seq": 2 })).await;
    eventually(Duration::from_secs(20), "parked", || async {
        host.count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked' AND attempts = 1")
            .await
            == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(effects(&host, next).await, 0, "waits behind the parked event");
    let id: i64 = sqlx::query_scalar("SELECT id FROM obx.dead_letter")
        .fetch_one(&host.db)
        .await
        .unwrap();
    obx::inbox::dlq::discard(&host.db, id).await.unwrap();
    eventually(Duration::from_secs(20), "the key moves on", || async {
        effects(&host, next).await == 1
    })
    .await;
    assert_eq!(effects(&host, bad).await, 0, "a discarded event never runs");
    host.shutdown().await;
}

/// A discarded dead letter of a dedup subscription is recorded as processed: delivered again
/// (a crash before the offset commit, an offset reset, an outbox replay), it is a dedup hit.
/// It used to run then, the event the operator had discarded, taking effect if it now could.
#[tokio::test]
async fn a_discarded_dedup_dead_letter_does_not_run_when_delivered_again() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.max_attempts = 1).await;
    let p = producer(&host.host.brokers.bootstrap);
    let topic = host.topic(DEDUP);
    let bad = uuid::Uuid::new_v4();
    // Fails on the first flaky run only: parked after it (one attempt allowed).
    send_event_with_id(&p, &topic, "K", "Thing", &json!({ "flaky": 1 }), bad).await;
    eventually(Duration::from_secs(20), "parked", || async {
        host.count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
            .await
            == 1
    })
    .await;
    let id: i64 = sqlx::query_scalar("SELECT id FROM obx.dead_letter")
        .fetch_one(&host.db)
        .await
        .unwrap();
    obx::inbox::dlq::discard(&host.db, id).await.unwrap();
    send_event_with_id(&p, &topic, "K", "Thing", &json!({ "flaky": 1 }), bad).await;
    let next = send_event(&p, &topic, "K", "Thing", &json!({ "seq": 2 })).await;
    eventually(Duration::from_secs(20), "the key moves on", || async {
        effects(&host, next).await == 1
    })
    .await;
    assert_eq!(
        effects(&host, bad).await,
        0,
        "a discarded event ran when delivered again"
    );
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 1);
    host.shutdown().await;
}

/// Each kind of message that is not an event is quarantined with its reason, and the events
/// after it on the partition are handled. A key with a NUL or over 1 KiB (which Postgres
/// cannot store, or index) was retried for ever, holding up the partition and then the
/// consumer.
#[tokio::test]
async fn each_bad_input_class_is_quarantined_and_the_partition_moves_on() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.max_message_bytes = 1024).await;
    let p = producer(&host.host.brokers.bootstrap);
    let id = uuid::Uuid::new_v4().to_string();
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2000));
    // Random, so that Postgres could not compress it into an index entry.
    let long_key: Vec<u8> = (0..3000).map(|_| fastrand::alphanumeric() as u8).collect();
    // key, value, headers, the reason expected
    type Case<'a> = (Option<&'a [u8]>, &'a [u8], Vec<(&'a str, &'a [u8])>, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (Some(b"k"), b"{}", vec![("eventType", b"T")], "no eventId header"),
        (
            Some(b"k"),
            b"{}",
            vec![("eventId", b"not-a-uuid"), ("eventType", b"T")],
            "not a UUID",
        ),
        (
            Some(b"k"),
            b"{}",
            vec![("eventId", id.as_bytes())],
            "no eventType header",
        ),
        (
            Some(b"k"),
            b"{not json",
            vec![("eventId", id.as_bytes()), ("eventType", b"T")],
            "not JSON",
        ),
        (
            Some(b"\xff\xfek"),
            b"{}",
            vec![("eventId", id.as_bytes()), ("eventType", b"T")],
            "key is not UTF-8",
        ),
        (
            Some(b"a\0b"),
            b"{}",
            vec![("eventId", id.as_bytes()), ("eventType", b"T")],
            "key holds a NUL",
        ),
        (
            Some(long_key.as_slice()),
            b"{}",
            vec![("eventId", id.as_bytes()), ("eventType", b"T")],
            "key is 3000 bytes",
        ),
        (
            Some(b"k"),
            big.as_bytes(),
            vec![("eventId", id.as_bytes()), ("eventType", b"T")],
            "the value is 2010 bytes",
        ),
    ];
    for (key, value, headers, _) in &cases {
        send_raw(&p, &host.topic(DEDUP), *key, Some(value), headers).await;
    }
    let good = send_event(&p, &host.topic(DEDUP), "k", "Thing", &json!({ "seq": 1 })).await;
    eventually(Duration::from_secs(20), "the good event after the bad ones", || async {
        effects(&host, good).await == 1
    })
    .await;
    let reasons = quarantine_reasons(&host).await;
    assert_eq!(reasons.len(), cases.len(), "{reasons:?}");
    for (_, _, _, expected) in &cases {
        let matching = reasons.iter().filter(|r| r.contains(expected)).count();
        assert_eq!(matching, 1, "one quarantined message for {expected:?}: {reasons:?}");
    }
    assert_eq!(total_effects(&host).await, 1);
    host.shutdown().await;
}

/// A header whose name is not UTF-8 (to most Kafka clients, names are bytes) is skipped, as
/// one whose value is not: the event is handled, and so are the ones after it. rdkafka's
/// header reader panicked on it, which ended the plugin's consumer on every host that took
/// the partition in turn.
#[tokio::test]
async fn a_header_name_that_is_not_utf8_does_not_stop_the_consumer() {
    use rdkafka::message::{Header, OwnedHeaders};
    let host = spawn_host_with(&["testbed"], |c| c.consumer.lanes = 1).await;
    let p = producer(&host.host.brokers.bootstrap);
    let id = uuid::Uuid::new_v4();
    let (id_text, topic) = (id.to_string(), host.topic(DEDUP));
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "eventId",
            value: Some(id_text.as_bytes()),
        })
        .insert(Header {
            key: "eventType",
            value: Some(b"Thing".as_slice()),
        });
    let record = rdkafka::producer::FutureRecord::to(&topic)
        .key("k")
        .payload(r#"{"seq": 1}"#)
        .headers(with_raw_header(headers, b"\xff\xfe", b"v"));
    p.send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let after = send_event(&p, &topic, "k", "Thing", &json!({ "seq": 2 })).await;
    eventually(Duration::from_secs(20), "both events handled", || async {
        effects(&host, id).await == 1 && effects(&host, after).await == 1
    })
    .await;
    host.shutdown().await;
}

/// A plugin whose inbox steps keep failing (here its role may no longer log in) waits out a
/// backoff of its own; another plugin's inbox events go on at once. The processors used to
/// back off as a whole, so that every other plugin's events waited for it too.
#[tokio::test]
async fn a_plugin_whose_inbox_steps_fail_holds_up_no_other_plugins_inbox() {
    let host = spawn_host_with(&["testbed", "orders"], |c| {
        c.consumer.backoff_initial = Duration::from_secs(30);
        c.consumer.backoff_max = Duration::from_secs(60);
    })
    .await;
    let role: String = sqlx::query_scalar("SELECT role_name FROM obx.plugin WHERE name = 'orders'")
        .fetch_one(&host.db)
        .await
        .unwrap();
    sqlx::query(&format!("ALTER ROLE \"{role}\" NOLOGIN"))
        .execute(&host.db)
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1")
        .bind(&role)
        .execute(&host.db)
        .await
        .unwrap();
    let p = producer(&host.host.brokers.bootstrap);
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(send_event(&p, &host.topic(INBOX), &format!("k{i}"), "Thing", &json!({ "seq": i })).await);
    }
    eventually(Duration::from_secs(10), "testbed's 20 inbox events handled", || async {
        let mut handled = 0;
        for id in &ids {
            handled += effects(&host, *id).await;
        }
        handled == 20
    })
    .await;
    host.shutdown().await;
}

/// A value Postgres cannot store as `jsonb` (the escape `\u0000`, in a value or a key, valid
/// JSON for everyone else) is quarantined with that reason, in either mode: in inbox mode
/// storing it failed, and the partition retried it for ever. An escaped backslash before
/// `u0000` is text, not NUL, and goes through. So is a header holding NUL.
#[tokio::test]
async fn a_value_with_a_nul_escape_is_quarantined_and_the_partition_moves_on() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    for topic in [INBOX, DEDUP] {
        for value in [r#"{"s": "a\u0000b"}"#, r#"{"a\u0000": 1}"#] {
            let id = uuid::Uuid::new_v4().to_string();
            let headers = vec![("eventId", id.as_bytes()), ("eventType", b"Thing".as_slice())];
            send_raw(&p, &host.topic(topic), Some(b"k"), Some(value.as_bytes()), &headers).await;
        }
    }
    let id = uuid::Uuid::new_v4().to_string();
    let headers = vec![
        ("eventId", id.as_bytes()),
        ("eventType", b"Thing".as_slice()),
        ("note", b"a\0b".as_slice()),
    ];
    send_raw(&p, &host.topic(INBOX), Some(b"k"), Some(b"{}"), &headers).await;
    let text = send_event(&p, &host.topic(INBOX), "k", "Thing", &json!({ "s": "\\u0000" })).await;
    let good = send_event(&p, &host.topic(DEDUP), "k", "Thing", &json!({ "seq": 1 })).await;
    eventually(
        Duration::from_secs(30),
        "the good events after the bad ones",
        || async { effects(&host, good).await == 1 && effects(&host, text).await == 1 },
    )
    .await;
    let reasons = quarantine_reasons(&host).await;
    assert_eq!(reasons.len(), 5, "{reasons:?}");
    assert_eq!(
        reasons.iter().filter(|r| r.contains("\\u0000")).count(),
        4,
        "{reasons:?}"
    );
    assert_eq!(
        reasons.iter().filter(|r| r.contains("\"note\" holds a NUL")).count(),
        1,
        "{reasons:?}"
    );
    host.shutdown().await;
}

/// JSON that Postgres's `jsonb` refuses all the same (a lone surrogate escape, an exponent
/// past `numeric`'s range) is quarantined with the reason, in either mode, and the partition
/// moves on: storing it (in the inbox, or at parking) failed at every try, holding the
/// partition for ever. The host's check (`jsonb::refusal`) names it now; a value it missed
/// would still be quarantined with Postgres's own reason when the inbox refuses it.
#[tokio::test]
async fn a_value_postgres_refuses_is_quarantined_and_the_partition_moves_on() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    for topic in [INBOX, DEDUP] {
        for value in [r#"{"s": "a\udc00b"}"#, r#"{"n": 1e1000000}"#] {
            let id = uuid::Uuid::new_v4().to_string();
            let headers = vec![("eventId", id.as_bytes()), ("eventType", b"Thing".as_slice())];
            send_raw(&p, &host.topic(topic), Some(b"k"), Some(value.as_bytes()), &headers).await;
        }
    }
    let inbox = send_event(&p, &host.topic(INBOX), "k", "Thing", &json!({ "seq": 1 })).await;
    let dedup = send_event(&p, &host.topic(DEDUP), "k", "Thing", &json!({ "seq": 1 })).await;
    eventually(
        Duration::from_secs(30),
        "the good events after the bad ones",
        || async { effects(&host, inbox).await == 1 && effects(&host, dedup).await == 1 },
    )
    .await;
    let reasons = quarantine_reasons(&host).await;
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    for (what, count) in [("surrogate escape", 2), ("numeric", 2)] {
        assert_eq!(
            reasons
                .iter()
                .filter(|r| r.contains("cannot be stored") && r.contains(what))
                .count(),
            count,
            "{reasons:?}"
        );
    }
    host.shutdown().await;
}

/// Headers are bounded as the value is: a message whose headers hold over 64 KiB is
/// quarantined, with the first 64 KiB of them kept, and the partition moves on. Before, they
/// went whole into the inbox, each handler call and the quarantine.
#[tokio::test]
async fn a_message_with_headers_over_64_kib_is_quarantined_with_them_cut() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    let big = "h".repeat(40 * 1024);
    for topic in [INBOX, DEDUP] {
        let id = uuid::Uuid::new_v4().to_string();
        let headers = vec![
            ("eventId", id.as_bytes()),
            ("eventType", b"Thing".as_slice()),
            ("a", big.as_bytes()),
            ("b", big.as_bytes()),
        ];
        send_raw(&p, &host.topic(topic), Some(b"k"), Some(b"{}"), &headers).await;
    }
    let inbox = send_event(&p, &host.topic(INBOX), "k", "Thing", &json!({ "seq": 1 })).await;
    let dedup = send_event(&p, &host.topic(DEDUP), "k", "Thing", &json!({ "seq": 1 })).await;
    eventually(
        Duration::from_secs(30),
        "the good events after the big ones",
        || async { effects(&host, inbox).await == 1 && effects(&host, dedup).await == 1 },
    )
    .await;
    let rows: Vec<(String, i32)> = sqlx::query_as("SELECT reason, octet_length(headers::text) FROM obx.quarantine")
        .fetch_all(&host.db)
        .await
        .unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (reason, bytes) in &rows {
        assert!(reason.starts_with("the headers hold 822"), "{reason}");
        assert!(*bytes < 8 * 1024, "{bytes} bytes of headers kept");
    }
    host.shutdown().await;
}

/// A handler's error is the plugin's words: one with a NUL (which no Postgres text holds) or
/// of any length is recorded, cut to 4 KiB, and the event parked, in either mode. Before,
/// recording it failed at every try: in dedup mode the partition stopped, in inbox mode the
/// event ran again and again, uncounted.
#[tokio::test]
async fn a_handler_error_with_a_nul_and_no_end_is_recorded_and_the_event_parked() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.max_attempts = 2).await;
    let p = producer(&host.host.brokers.bootstrap);
    let failing = json!({ "fail": { "bytes": 1_000_000 } });
    let inbox = send_event(&p, &host.topic(INBOX), "k", "Thing", &failing).await;
    let dedup = send_event(&p, &host.topic(DEDUP), "k", "Thing", &failing).await;
    eventually(Duration::from_secs(30), "both events parked", || async {
        host.count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
            .await
            == 2
    })
    .await;
    let errors: Vec<(uuid::Uuid, String)> = sqlx::query_as("SELECT event_id, error FROM obx.dead_letter")
        .fetch_all(&host.db)
        .await
        .unwrap();
    for (id, error) in &errors {
        assert!([inbox, dedup].contains(id), "{id}");
        assert!(error.contains("the handler's words\u{FFFD}w"), "{}", &error[..100]);
        assert!(
            error.len() < 5000 && error.ends_with("(1000000 bytes)"),
            "{} bytes",
            error.len()
        );
    }
    host.shutdown().await;
}

#[tokio::test]
async fn an_event_handler_emits_follow_ups_through_the_outbox() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    let id = send_event(
        &p,
        &host.topic(DEDUP),
        "saga-1",
        "Thing",
        &json!({ "then": "testbed.saga" }),
    )
    .await;
    eventually(Duration::from_secs(20), "the follow-up published", || async {
        host.count("SELECT count(*) FROM obx.outbox_event WHERE topic = 'testbed.saga' AND published_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    let payload: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM obx.outbox_event WHERE topic = 'testbed.saga'")
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert_eq!(payload["causationId"], id.to_string());
    host.shutdown().await;
}

/// An event of a type its subscription does not list is skipped, and counted: a producer
/// that renames a type would otherwise see its events vanish with no trace.
#[tokio::test]
async fn an_event_of_an_unlisted_type_is_skipped_and_counted() {
    let host = spawn_host(&["orders", "inventory"]).await;
    let skipped = || metric_value("obx_consumer_skipped_total{plugin=\"inventory\"}");
    let before = skipped();
    let p = producer(&host.host.brokers.bootstrap);
    let topic = host.topic("order.events");
    // One, then three more: alone, or in a run that a batch takes.
    send_event(&p, &topic, "o-1", "OrderPlaced", &json!({ "orderId": "o-1" })).await;
    eventually(Duration::from_secs(20), "the first skipped", || async {
        skipped() >= before + 1.0
    })
    .await;
    for n in 2..5 {
        send_event(&p, &topic, &format!("o-{n}"), "OrderPlaced", &json!({ "orderId": n })).await;
    }
    eventually(Duration::from_secs(20), "all four skipped", || async {
        skipped() >= before + 4.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(skipped(), before + 4.0, "each counted once");
    host.shutdown().await;
}

/// Failed handler attempts of a plugin's events so far, from the host's metrics.
fn failed_attempts(plugin: &str) -> f64 {
    metric_value(&format!(
        "obx_events_handled_total{{outcome=\"failed\",plugin=\"{plugin}\"}}"
    ))
}

#[tokio::test]
async fn inventory_takes_concurrent_orders_with_items_in_opposite_orders_without_a_deadlock() {
    // An event per transaction: the most chances for two to hold part of each other's rows.
    let host = spawn_host_with(&["orders", "inventory"], |c| c.consumer.batch_max_events = 1).await;
    let products = ["p-1", "p-2", "p-3"];
    for p in products {
        let a = host
            .command("inventory", "AddStock", json!({ "productId": p, "quantity": 100_000 }))
            .await;
        assert_eq!(a.status, 200, "{}", a.text);
    }
    let failed_before = failed_attempts("inventory");
    // 16 clients, 40 orders each, every order takes all three products: half of them in
    // one order, half in the other.
    let url = format!("{}/v1/commands/orders/CreateOrder", host.url);
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..16 {
        let url = url.clone();
        clients.spawn(async move {
            let client = reqwest::Client::new();
            for i in 0..40 {
                let mut items: Vec<_> = products
                    .iter()
                    .map(|p| json!({ "productId": p, "quantity": 1 }))
                    .collect();
                if (c + i) % 2 == 1 {
                    items.reverse();
                }
                let body = json!({ "customerId": format!("c-{c}"), "amount": 1, "items": items });
                let r = client.post(&url).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
            }
        });
    }
    while let Some(r) = clients.join_next().await {
        r.unwrap();
    }
    eventually(Duration::from_secs(60), "640 orders reserved", || async {
        host.count("SELECT count(*) FROM inventory.reservations").await == 3 * 640
    })
    .await;
    for p in products {
        let stock = host.command("inventory", "GetStock", json!({ "productId": p })).await;
        assert_eq!(stock.body["reserved"].as_i64(), Some(640), "{p}");
    }
    // Postgres counts the deadlocks it broke; a lock wait past lock_timeout fails the
    // handler, which the metrics count.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let deadlocks = host
        .count("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .await;
    assert_eq!(deadlocks, 0, "Postgres broke deadlocks");
    assert_eq!(
        failed_attempts("inventory") - failed_before,
        0.0,
        "handler attempts failed"
    );
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0);
    host.shutdown().await;
}

#[tokio::test]
async fn the_three_plugin_chain_runs_end_to_end() {
    let host = spawn_host(&["orders", "inventory", "payments"]).await;
    let a = host
        .command("inventory", "AddStock", json!({ "productId": "p-1", "quantity": 10 }))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    let order = host
        .command(
            "orders",
            "CreateOrder",
            json!({ "customerId": "c-1", "amount": 42.5, "items": [{ "productId": "p-1", "quantity": 3 }] }),
        )
        .await;
    assert_eq!(order.status, 200, "{}", order.text);
    let order_id = order.body["orderId"].as_str().unwrap().to_string();

    // orders → OrderCreated → inventory (dedup) → ProductReserved → payments (inbox).
    eventually(Duration::from_secs(30), "the payment", || async {
        host.command("payments", "GetPayment", json!({ "orderId": order_id }))
            .await
            .body["status"]
            == "requested"
    })
    .await;
    let stock = host
        .command("inventory", "GetStock", json!({ "productId": "p-1" }))
        .await;
    assert_eq!(
        (stock.body["quantity"].as_i64(), stock.body["reserved"].as_i64()),
        (Some(10), Some(3))
    );
    let payment = host
        .command("payments", "GetPayment", json!({ "orderId": order_id }))
        .await;
    assert_eq!(payment.body["amount"], "42.50");
    // Every event of the chain was recorded in the outbox with its provenance.
    let chain: Vec<(String, String)> =
        sqlx::query_as("SELECT event_type, plugin_name FROM obx.outbox_event ORDER BY id")
            .fetch_all(&host.db)
            .await
            .unwrap();
    assert_eq!(
        chain,
        vec![
            ("OrderCreated".into(), "orders".into()),
            ("ProductReserved".into(), "inventory".into()),
            ("PaymentRequested".into(), "payments".into())
        ]
    );
    host.shutdown().await;
}

#[tokio::test]
async fn consumption_retention_keeps_unprocessed_rows() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    for i in 0..5 {
        send_event(&p, &host.topic(INBOX), &format!("r{i}"), "Thing", &json!({})).await;
    }
    eventually(Duration::from_secs(20), "processed", || async {
        host.count("SELECT count(*) FROM obx.inbox_event WHERE processed").await == 5
    })
    .await;
    sqlx::raw_sql(
        "UPDATE obx.processed_event SET processed_at = now() - interval '30 days'; \
         UPDATE obx.inbox_event SET processed_at = now() - interval '30 days' \
           WHERE event_id IN (SELECT event_id FROM obx.inbox_event ORDER BY seq LIMIT 3); \
         UPDATE obx.inbox_event SET processed = false, processed_at = NULL, parked = true \
           WHERE event_id IN (SELECT event_id FROM obx.inbox_event ORDER BY seq LIMIT 1);",
    )
    .execute(&host.db)
    .await
    .unwrap();
    let report = obx::retention::run_once(&host.db, &Default::default()).await.unwrap();
    let deleted = |name| report.iter().find(|(n, _)| *n == name).unwrap().1;
    assert_eq!(deleted("processed_event"), 5);
    assert_eq!(deleted("inbox"), 2, "the old processed rows only");
    assert_eq!(
        host.count("SELECT count(*) FROM obx.inbox_event WHERE NOT processed")
            .await,
        1
    );
    host.shutdown().await;
}

/// The retention job's deletes, and the deletes of dead letters they cascade to, find their
/// rows by an index: a scan of a whole table per batch (or, for the cascade, per deleted
/// row) holds back vacuum for as long as it runs. Read from the plans, with sequential scans
/// priced out, so that any one left shows.
#[tokio::test]
async fn every_retention_delete_is_served_by_an_index() {
    let host = spawn_host(&[]).await;
    let mut conn = host.db.acquire().await.unwrap();
    sqlx::Executor::execute(&mut *conn, "SET enable_seqscan = off")
        .await
        .unwrap();
    let cascade = (
        "dead_letter cascade",
        "DELETE FROM ONLY obx.dead_letter WHERE $1 = consumer AND $2 = event_id".to_string(),
    );
    for (name, sql) in obx::retention::delete_statements().chain([cascade]) {
        let explain = format!("EXPLAIN {sql}");
        let query = sqlx::query_scalar::<_, String>(&explain);
        let query = if name == "dead_letter cascade" {
            query.bind("c").bind(uuid::Uuid::nil())
        } else {
            query.bind(3600.0_f64).bind(100_i64)
        };
        let plan = query.fetch_all(&mut *conn).await.unwrap().join("\n");
        assert!(!plan.contains("Seq Scan"), "{name}: {plan}");
    }
    drop(conn);
    host.shutdown().await;
}

#[tokio::test]
async fn events_from_a_kafkajs_producer_following_the_seed_are_consumed() {
    let host = spawn_host(&["testbed"]).await;
    let id = uuid::Uuid::new_v4();
    let payload = json!({ "orderId": "order-7", "seq": 7 }).to_string();
    run_kafkajs(
        "produce.js",
        &[
            &host.host.brokers.bootstrap,
            &host.topic(DEDUP),
            "order-7",
            &id.to_string(),
            "OrderCreated",
            &payload,
        ],
    )
    .await;
    eventually(Duration::from_secs(20), "the kafkajs event handled", || async {
        effects(&host, id).await == 1
    })
    .await;
    let (key, seq): (String, i64) = sqlx::query_as("SELECT key, seq FROM testbed.effects WHERE event_id = $1")
        .bind(id)
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert_eq!((key.as_str(), seq), ("order-7", 7));
    host.shutdown().await;
}

/// `obx status` counts what waits on each partition a consumer reads, including one where
/// nothing was ever committed (librdkafka calls its lag unknown): here the first event of a
/// partition keeps failing, so it and the event behind it wait.
#[tokio::test]
async fn consumer_lag_counts_events_held_up_on_a_partition_with_nothing_committed() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.consumer.max_attempts = 1000;
        c.consumer.backoff_initial = Duration::from_millis(500);
        c.consumer.backoff_max = Duration::from_millis(500);
    })
    .await;
    let lag = || async {
        let status = host.get("/v1/status").await;
        status.body["consumption"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["plugin"] == "testbed"))
            .map(|r| r["lag"].clone())
    };
    eventually(Duration::from_secs(20), "no lag, known, before any event", || async {
        lag().await == Some(json!(0))
    })
    .await;
    let p = producer(&host.host.brokers.bootstrap);
    send_event(
        &p,
        &host.topic(DEDUP),
        "A",
        "Thing",
        &json!({ "seq": 1, "poison": true }),
    )
    .await;
    let behind = send_event(&p, &host.topic(DEDUP), "A", "Thing", &json!({ "seq": 2 })).await;
    eventually(Duration::from_secs(20), "a lag of the two waiting events", || async {
        lag().await == Some(json!(2))
    })
    .await;
    assert_eq!(
        effects(&host, behind).await,
        0,
        "the event behind the failing one waits"
    );
    host.shutdown().await;
}

/// CloudEvents in Kafka's binary mode, both ways: OBX's messages on a topic configured for it
/// carry the `ce_*` headers (and those of other topics do not), and a message that is only
/// a CloudEvent (no `eventId`, an id that is not a UUID) is handled once per source and id.
#[tokio::test]
async fn cloudevents_go_out_in_binary_mode_and_cloudevents_only_messages_are_handled_once() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.kafka.cloudevents.topics = vec!["testbed.alpha".into()];
        c.kafka.cloudevents.source = "//orders.example.com".into();
    })
    .await;
    let bootstrap = host.host.brokers.bootstrap.clone();
    for topic in ["testbed.alpha", "testbed.beta"] {
        let a = host
            .command("testbed", "emit", json!({ "id": "ce", "topic": topic, "key": "agg-1" }))
            .await;
        assert_eq!(a.status, 200, "{}", a.text);
    }
    let row: (uuid::Uuid, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT event_id, created_at FROM obx.outbox_event WHERE topic = 'testbed.alpha'")
            .fetch_one(&host.db)
            .await
            .unwrap();
    let alpha = consume(&bootstrap, &host.topic("testbed.alpha"), 1, Duration::from_secs(20)).await;
    let m = &alpha[0];
    assert_eq!(m.header("ce_specversion"), Some("1.0"));
    assert_eq!(m.header("ce_id"), Some(row.0.to_string().as_str()));
    assert_eq!(m.header("eventId"), m.header("ce_id"), "the seed's headers stay");
    assert_eq!(m.header("ce_type"), Some("ItemEmitted"));
    assert_eq!(m.header("ce_source"), Some("//orders.example.com/testbed"));
    assert_eq!(m.header("ce_subject"), Some("agg-1"));
    assert_eq!(m.header("content-type"), Some("application/json"));
    let time = chrono::DateTime::parse_from_rfc3339(m.header("ce_time").unwrap()).unwrap();
    assert_eq!(time, row.1, "ce_time is the row's time, in RFC 3339");
    let beta = consume(&bootstrap, &host.topic("testbed.beta"), 1, Duration::from_secs(20)).await;
    assert!(beta[0].header("eventId").is_some());
    assert!(
        beta[0].headers.keys().all(|k| !k.starts_with("ce_")),
        "a topic not configured has no CloudEvents headers: {:?}",
        beta[0].headers
    );

    // A CloudEvents-only producer: the same event twice, and an equal id from another source.
    let p = producer(&bootstrap);
    let topic = host.topic(DEDUP);
    let cloudevent = |source: &'static str, seq: &'static [u8]| {
        let (p, topic) = (p.clone(), topic.clone());
        async move {
            let headers: [(&str, &[u8]); 5] = [
                ("ce_specversion", b"1.0"),
                ("ce_id", b"invoice-42"),
                ("ce_source", source.as_bytes()),
                ("ce_type", b"com.example.InvoicePaid"),
                ("content-type", b"application/json"),
            ];
            let value = [&b"{\"seq\": "[..], seq, b"}"].concat();
            send_raw(&p, &topic, Some(b"inv-42"), Some(&value), &headers).await;
        }
    };
    cloudevent("/billing", b"1").await;
    cloudevent("/billing", b"1").await;
    cloudevent("/refunds", b"2").await;
    let billing = obx::inbox::cloudevent_id("/billing", "invoice-42");
    let refunds = obx::inbox::cloudevent_id("/refunds", "invoice-42");
    eventually(Duration::from_secs(20), "both sources' events handled", || async {
        effects(&host, billing).await >= 1 && effects(&host, refunds).await >= 1
    })
    .await;
    // A later event of the key proves the second copy was consumed too.
    let later = send_event(&p, &topic, "inv-42", "Thing", &json!({ "seq": 3 })).await;
    eventually(Duration::from_secs(20), "the later event", || async {
        effects(&host, later).await == 1
    })
    .await;
    assert_eq!(
        effects(&host, billing).await,
        1,
        "the redelivered CloudEvent took effect once"
    );
    assert_eq!(effects(&host, refunds).await, 1);
    assert_eq!(
        host.count("SELECT count(*) FROM obx.quarantine").await,
        0,
        "nothing quarantined"
    );
    host.shutdown().await;
}

/// The testbed statement that waits for the [`Gate`]'s row lock, as a `sql` command.
fn gate_command() -> serde_json::Value {
    json!({ "id": "slot", "mode": "execute", "sql": "UPDATE counters SET n = n + 1 WHERE name = 'gate'" })
}

/// A consuming testbed host with one call slot, a 3 s call deadline and one attempt per
/// event (any attempt counted parks it), its consumer seen running.
async fn one_slot_host(broker: &TestBroker, logical: &str, lock_timeout: Duration) -> TestHost {
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.consumer.lanes = 1;
        c.consumer.max_attempts = 1;
        c.limits.max_concurrent_calls = 1;
        c.limits.call_deadline = Duration::from_secs(3);
        c.limits.lock_timeout = lock_timeout;
        c.limits.statement_timeout = Duration::from_secs(10);
    })
    .await;
    let p = producer(&broker.bootstrap);
    let warm = send_event(&p, &host.topic(logical), "warm", "Thing", &json!({})).await;
    eventually(Duration::from_secs(30), "the consumer runs", || async {
        effects(&host, warm).await == 1
    })
    .await;
    host
}

/// Two commands in turn hold the host's one call slot for 4 s (each waits 2 s for a row lock
/// the test holds, its lock timeout), so an event that comes meanwhile waits past the 3 s
/// call deadline for a slot and is refused as busy. That is the host's load, not the
/// handler's failure: with `max_attempts` 1 the event was parked at once; now it is tried
/// again, its attempt not counted, and runs once when the slot is free. The second command
/// waited 2 s for the slot and still had its whole deadline for the lock (it was stopped at
/// its deadline, 504, when the wait counted).
async fn an_event_refused_a_call_slot_is_not_charged_an_attempt(logical: &str) {
    let broker = broker();
    let host = one_slot_host(&broker, logical, Duration::from_secs(2)).await;
    let p = producer(&broker.bootstrap);
    let gate = Gate::hold(&host.database_url).await;
    let first = host.command("testbed", "sql", gate_command());
    let rest = async {
        eventually(
            Duration::from_secs(10),
            "the first command waits for the gate",
            || async { host.lock_waits().await >= 1 },
        )
        .await;
        // Queued for the slot behind the first, ahead of the event.
        let second = host.command("testbed", "sql", gate_command());
        let event = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            send_event(&p, &host.topic(logical), "k", "Thing", &json!({})).await
        };
        tokio::join!(second, event)
    };
    let (first, (second, id)) = tokio::join!(first, rest);
    // Each held the slot until its lock timeout: the slot was taken for 4 s on end.
    for answer in [&first, &second] {
        assert_eq!(answer.status, 409, "{}", answer.text);
        assert!(answer.text.contains("lock_timeout"), "{}", answer.text);
    }
    gate.release().await;
    eventually(Duration::from_secs(30), "the event runs", || async {
        effects(&host, id).await == 1
    })
    .await;
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0, "{logical}");
    host.shutdown().await;
}

#[tokio::test]
async fn a_dedup_event_refused_a_call_slot_is_not_charged_an_attempt() {
    an_event_refused_a_call_slot_is_not_charged_an_attempt(DEDUP).await;
}

#[tokio::test]
async fn an_inbox_event_refused_a_call_slot_is_not_charged_an_attempt() {
    an_event_refused_a_call_slot_is_not_charged_an_attempt(INBOX).await;
}

/// A call's deadline starts when it gets its call slot: an event that waited most of a
/// deadline for the slot (a command held it, waiting for the gate until its own deadline)
/// still has a whole one. It waits for the gate too, which opens 2 s after it got the slot:
/// its deadline used to count from before the wait, so it was killed then, and parked.
#[tokio::test]
async fn an_event_that_gets_its_call_slot_late_still_has_its_whole_deadline() {
    let broker = broker();
    let host = one_slot_host(&broker, DEDUP, Duration::from_secs(10)).await;
    let p = producer(&broker.bootstrap);
    let gate = Gate::hold(&host.database_url).await;
    let command = host.command("testbed", "sql", gate_command());
    let event = async {
        eventually(Duration::from_secs(10), "the command waits for the gate", || async {
            host.lock_waits().await >= 1
        })
        .await;
        send_event(&p, &host.topic(DEDUP), "k", "Thing", &json!({ "gate": true })).await
    };
    let (answer, id) = tokio::join!(command, event);
    // The command was stopped at its deadline; the event has the slot now and waits.
    assert_eq!(answer.status, 504, "{}", answer.text);
    tokio::time::sleep(Duration::from_secs(2)).await;
    gate.release().await;
    eventually(Duration::from_secs(30), "the event runs", || async {
        effects(&host, id).await == 1
    })
    .await;
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0);
    host.shutdown().await;
}

/// Stores ten inbox events of key `A` for the testbed in one statement, as the consumer's
/// intake would (`seq` 0 to 9; the event `seq` = `gate_at` waits for the [`Gate`]).
async fn store_ten_inbox_events(host: &TestHost, gate_at: i64) {
    store_ten_inbox_events_emitting(host, gate_at, None).await;
}

/// [`store_ten_inbox_events`], each event's handler emitting a follow-up to `then`, if given.
async fn store_ten_inbox_events_emitting(host: &TestHost, gate_at: i64, then: Option<&str>) {
    let then = then.map_or("NULL".to_string(), |t| format!("'{t}'"));
    host.count(&format!(
        "WITH stored AS (INSERT INTO obx.inbox_event \
             (consumer, event_id, topic, payload, event_type, partition_key, headers) \
           SELECT 'testbed', gen_random_uuid(), '{INBOX}', \
                  jsonb_strip_nulls(jsonb_build_object('seq', n, 'gate', n = {gate_at}, 'then', {then})), \
                  'Thing', 'A', '{{}}' \
           FROM generate_series(0, 9) AS n ORDER BY n RETURNING 1) \
         SELECT count(*) FROM stored"
    ))
    .await;
}

/// How many of the ten inbox events were marked in the transaction that took event `seq`.
async fn taken_with(host: &TestHost, seq: i64) -> i64 {
    host.count(&format!(
        "SELECT count(*) FROM obx.inbox_event WHERE processed_at = \
           (SELECT processed_at FROM obx.inbox_event WHERE (payload->>'seq')::int = {seq})"
    ))
    .await
}

async fn await_ten_processed_once(host: &TestHost) {
    eventually(Duration::from_secs(30), "ten inbox rows processed", || async {
        host.count("SELECT count(*) FROM obx.inbox_event WHERE processed").await == 10
    })
    .await;
    assert_each_effect_once(host, 10).await;
    assert_eq!(key_disorder(host).await, 0);
}

/// An inbox batch starts handlers for at most a second after its first returned
/// (`handling::RUN_BUDGET`): a batch holds a shared processor, a plugin session and its key's
/// row locks, and 32 slow handlers would hold them for minutes while other plugins' events
/// wait. Here the second of ten events of one key waits 1.2 s for the gate: its batch commits
/// the first two, and the other eight go in a batch after them, in order, each once. (All
/// ten went in one transaction before.)
#[tokio::test]
async fn an_inbox_batch_stops_starting_handlers_after_its_time_budget() {
    let broker = broker();
    let (first, _) = not_consuming(&broker, INBOX).await;
    // Stored before any processor runs, so that one batch can take all ten.
    store_ten_inbox_events(&first, 1).await;
    let gate = Gate::hold(&first.database_url).await;
    let host = next_host(&broker, first, |c| {
        c.consumer.inbox_processors = 1;
        c.limits.call_deadline = Duration::from_secs(10);
        c.limits.lock_timeout = Duration::from_secs(10);
    })
    .await;
    eventually(
        Duration::from_secs(30),
        "the second handler waits for the gate",
        || async { host.lock_waits().await >= 1 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    gate.release().await;
    await_ten_processed_once(&host).await;
    assert_eq!(
        taken_with(&host, 1).await,
        2,
        "the slow event's batch: the event before it, and none after"
    );
    host.shutdown().await;
}

/// An event of a batch that finds no call slot ends the batch with the events before it, as
/// the time budget does: the busy call never touched the transaction. Here the first of ten
/// inbox events waits for the gate while two commands queue for the host's one slot; once it
/// returns, they hold the slot in turn for 2 s each (each waits for the row the batch
/// locked, until its lock timeout), so the second event waits past its 3 s call deadline.
/// The batch commits the first event alone, and the other nine follow in order, each once.
/// (The whole batch was rolled back before, the first event's work with it, and the ten ran
/// again together.)
#[tokio::test]
async fn an_inbox_batch_that_runs_out_of_call_slots_keeps_the_events_it_ran() {
    let broker = broker();
    let (first, _) = not_consuming(&broker, INBOX).await;
    store_ten_inbox_events(&first, 0).await;
    let gate = Gate::hold(&first.database_url).await;
    let host = next_host(&broker, first, |c| {
        c.consumer.inbox_processors = 1;
        c.limits.max_concurrent_calls = 1;
        c.limits.call_deadline = Duration::from_secs(3);
        c.limits.lock_timeout = Duration::from_secs(2);
    })
    .await;
    eventually(
        Duration::from_secs(30),
        "the first event waits for the gate",
        || async { host.lock_waits().await >= 1 },
    )
    .await;
    let commands = async {
        let first = host.command("testbed", "sql", gate_command());
        let second = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            host.command("testbed", "sql", gate_command()).await
        };
        tokio::join!(first, second)
    };
    let release = async {
        // Both commands are queued for the slot by then.
        tokio::time::sleep(Duration::from_millis(600)).await;
        gate.release().await;
    };
    let ((first_answer, second_answer), ()) = tokio::join!(commands, release);
    assert_eq!(first_answer.status, 409, "{}", first_answer.text);
    assert!(
        second_answer.status == 200 || second_answer.status == 409,
        "{}",
        second_answer.text
    );
    await_ten_processed_once(&host).await;
    assert_eq!(taken_with(&host, 0).await, 1, "the first event's batch ended after it");
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0);
    host.shutdown().await;
}

/// A batch writes its handlers' outbox rows in as few `obx_api.emit_calls` statements as the
/// per-call limits allow (it wrote one `obx_api.emit` statement per event). Ten events of one
/// batch each emit a follow-up, with `limits.max_emits_per_call` 4: the batch commits, its
/// rows in the events' order, each row with its own event's trace context.
#[tokio::test]
async fn a_batch_writes_its_handlers_outbox_rows_together_within_the_per_call_limits() {
    let broker = broker();
    let (first, _) = not_consuming(&broker, INBOX).await;
    store_ten_inbox_events_emitting(&first, -1, Some("testbed.saga")).await;
    let host = next_host(&broker, first, |c| {
        c.consumer.inbox_processors = 1;
        c.limits.max_emits_per_call = 4;
    })
    .await;
    await_ten_processed_once(&host).await;
    assert_eq!(taken_with(&host, 0).await, 10, "one batch");
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT (i.payload->>'seq')::int8, o.traceparent FROM obx.outbox_event o \
         JOIN obx.inbox_event i ON i.event_id::text = o.payload->>'causationId' \
         WHERE o.topic = 'testbed.saga' ORDER BY o.id",
    )
    .fetch_all(&host.db)
    .await
    .unwrap();
    let seqs: Vec<i64> = rows.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(seqs, (0..10).collect::<Vec<_>>(), "the rows follow the events' order");
    let traces: std::collections::HashSet<&str> = rows.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(traces.len(), 10, "each row carries its own event's trace: {rows:?}");
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0);
    host.shutdown().await;
}

/// The database holds each call of a batch's outbox statement to the limits recorded for the
/// plugin, not the statement as a whole. Here another host, whose `limits.max_emits_per_call`
/// is 4, loaded the plugin last (the row is updated as it would have written it); this host's
/// limit is the default, and it writes the ten follow-ups of one batch in one statement. The
/// batch commits whole. The statement was refused before, and the ten ran one by one.
#[tokio::test]
async fn a_batch_commits_whole_when_another_host_recorded_smaller_limits() {
    let broker = broker();
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.consumer.inbox_processors = 1;
    })
    .await;
    host.limits_recorded_by_another_host("testbed", "max_emits_per_call = 4")
        .await;
    store_ten_inbox_events_emitting(&host, -1, Some("testbed.saga")).await;
    await_ten_processed_once(&host).await;
    assert_eq!(taken_with(&host, 0).await, 10, "one batch");
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_event WHERE topic = 'testbed.saga'")
            .await,
        10
    );
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0);
    host.shutdown().await;
}

/// The budget does not count the wait for the first call slot: a batch whose first call
/// waited 2.5 s for the host's one slot (a command held it, waiting for the gate until its
/// 3 s lock timeout) still runs its ten events together. Counted, it ended after the first
/// event, and an overloaded host ran batches of one.
#[tokio::test]
async fn an_inbox_batch_that_waited_for_a_call_slot_still_runs_whole() {
    let broker = broker();
    let host = spawn_host_with(&["testbed"], |c| {
        broker.configure(c);
        c.consumer.inbox_processors = 1;
        c.limits.max_concurrent_calls = 1;
        c.limits.call_deadline = Duration::from_secs(5);
        c.limits.lock_timeout = Duration::from_secs(3);
    })
    .await;
    let gate = Gate::hold(&host.database_url).await;
    let command = host.command("testbed", "sql", gate_command());
    let store = async {
        eventually(Duration::from_secs(10), "the command waits for the gate", || async {
            host.lock_waits().await >= 1
        })
        .await;
        // No event waits for the gate; the processor takes them within its 500 ms poll.
        store_ten_inbox_events(&host, -1).await;
    };
    let (answer, ()) = tokio::join!(command, store);
    assert_eq!(answer.status, 409, "{}", answer.text);
    gate.release().await;
    await_ten_processed_once(&host).await;
    assert_eq!(taken_with(&host, 0).await, 10, "one batch");
    host.shutdown().await;
}
