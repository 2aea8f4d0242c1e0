//! Delayed events (`outbox.emit-delayed`) against real Postgres and a Kafka-protocol broker:
//! published at or after their due time, never before; never, from a call that rolled back;
//! in their key's order at their due time, holding back no event already due; once each with
//! several relays; and a plugin session that calls the database function itself gets the
//! same checks.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use obx_tests::{broker, consume, eventually, spawn_host, spawn_host_on, spawn_host_with, TestHost};
use serde_json::json;
use sqlx::Connection;

/// Commands the testbed's `sequenced` (an event of `key` on testbed.events with the key's next
/// seq), delayed by `delay_ms` when given; returns the seq.
async fn sequenced(host: &TestHost, key: &str, delay_ms: Option<u64>) -> i64 {
    let mut body = json!({ "key": key });
    if let Some(ms) = delay_ms {
        body["delay_ms"] = json!(ms);
    }
    let a = host.command("testbed", "sequenced", body).await;
    assert_eq!(a.status, 200, "{}", a.text);
    a.body["seq"].as_i64().unwrap()
}

async fn published(host: &TestHost, key: &str, seq: i64) -> bool {
    sqlx::query_scalar(
        "SELECT count(*) = 1 FROM obx.outbox_event \
         WHERE partition_key = $1 AND (payload->>'seq')::bigint = $2 AND published_at IS NOT NULL",
    )
    .bind(key)
    .bind(seq)
    .fetch_one(&host.db)
    .await
    .unwrap()
}

/// The seqs of each key on testbed.events, in the broker's order, first copies only.
async fn seqs_on_the_broker(bootstrap: &str, topic: &str, expected: usize) -> HashMap<String, Vec<i64>> {
    let mut messages = consume(bootstrap, topic, expected, Duration::from_secs(30)).await;
    messages.sort_by_key(|m| (m.partition, m.offset));
    let mut seen = HashSet::new();
    let mut seqs: HashMap<String, Vec<i64>> = HashMap::new();
    for m in messages {
        if seen.insert(m.header("eventId").unwrap().to_string()) {
            let seq = m.json()["seq"].as_i64().unwrap();
            seqs.entry(m.key.clone().unwrap()).or_default().push(seq);
        }
    }
    assert_eq!(seen.len(), expected, "{seqs:?}");
    seqs
}

async fn seqs_of(host: &TestHost, key: &str, expected: usize) -> Vec<i64> {
    let all = seqs_on_the_broker(&host.host.brokers.bootstrap, &host.topic("testbed.events"), expected).await;
    all.get(key).cloned().unwrap_or_default()
}

#[tokio::test]
async fn a_delayed_event_is_published_after_its_due_time_never_before() {
    let host = spawn_host(&["testbed"]).await;
    let seq = sequenced(&host, "late", Some(1500)).await;
    // Committed, and waiting outside the outbox the relay claims from, due 1.5 s after the
    // call wrote it.
    let waiting: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM due_at - created_at)::float8 FROM obx.outbox_delayed")
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert!((waiting - 1.5).abs() < 1e-3, "due {waiting} s after its write");
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_event WHERE partition_key = 'late'")
            .await,
        0
    );
    let status = host.get("/v1/status").await;
    assert_eq!(
        (&status.body["outbox"]["delayed"], &status.body["outbox"]["backlog"]),
        (&json!(1), &json!(0)),
        "{}",
        status.text
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(!published(&host, "late", seq).await, "published before its due time");
    eventually(Duration::from_secs(10), "the delayed event published", || {
        published(&host, "late", seq)
    })
    .await;
    let early: bool = sqlx::query_scalar(
        "SELECT created_at < publish_after OR published_at < publish_after FROM obx.outbox_event WHERE partition_key = 'late'",
    )
    .fetch_one(&host.db)
    .await
    .unwrap();
    assert!(!early, "released or published before its due time");
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_delayed").await, 0);
    assert_eq!(seqs_of(&host, "late", 1).await, vec![seq]);
    host.shutdown().await;
}

#[tokio::test]
async fn a_delayed_event_waits_for_its_time_in_its_keys_order_and_holds_back_nothing() {
    let host = spawn_host(&["testbed"]).await;
    let delayed = sequenced(&host, "k", Some(1500)).await;
    let due_before = sequenced(&host, "k", None).await;
    // The event after the delayed one goes out at once.
    eventually(Duration::from_secs(5), "the undelayed event published", || {
        published(&host, "k", due_before)
    })
    .await;
    assert!(!published(&host, "k", delayed).await, "the delayed event went early");
    eventually(Duration::from_secs(10), "the delayed event published", || {
        published(&host, "k", delayed)
    })
    .await;
    let after = sequenced(&host, "k", None).await;
    eventually(Duration::from_secs(5), "the last event published", || {
        published(&host, "k", after)
    })
    .await;
    assert_eq!(
        seqs_of(&host, "k", 3).await,
        vec![due_before, delayed, after],
        "a delayed event takes its place at its due time"
    );
    host.shutdown().await;
}

#[tokio::test]
async fn a_rolled_back_calls_delayed_event_never_exists() {
    let host = spawn_host(&["testbed"]).await;
    let a = host
        .command(
            "testbed",
            "sequenced",
            json!({ "key": "gone", "delay_ms": 100, "fail": true }),
        )
        .await;
    assert_eq!(a.status, 500, "{}", a.text);
    // A delay over ten years is refused, with the reason in the log, and the call fails.
    let a = host
        .command(
            "testbed",
            "sequenced",
            json!({ "key": "never", "delay_ms": 315_576_000_001u64 }),
        )
        .await;
    assert_eq!(a.status, 500, "{}", a.text);
    let committed = sequenced(&host, "kept", Some(100)).await;
    eventually(Duration::from_secs(10), "the committed delayed event published", || {
        published(&host, "kept", committed)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_delayed").await
            + host
                .count("SELECT count(*) FROM obx.outbox_event WHERE partition_key <> 'kept'")
                .await,
        0,
        "a failed call's delayed event exists"
    );
    host.shutdown().await;
}

/// 300 delayed events of 30 keys, due over seconds, with three relays: each is published
/// once, and each key's events reach the broker in due order.
#[tokio::test]
async fn three_relays_publish_each_delayed_event_once_in_due_order() {
    let broker = broker();
    let first = spawn_host_with(&["testbed"], |c| broker.configure(c)).await;
    let mut others = Vec::new();
    for _ in 0..2 {
        others.push(spawn_host_on(&first.database_url, &["testbed"], |c| broker.configure(c)).await);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Each key's delays fall as its seq rises, so later writes tend to be due first: seq n of
    // 10 is due (11 - n) * 300 ms after its write.
    for round in 1..=10u64 {
        for k in 0..30 {
            let host = [&first, &others[0], &others[1]][k % 3];
            sequenced(host, &format!("d{k}"), Some((11 - round) * 300)).await;
        }
    }
    eventually(Duration::from_secs(30), "every delayed event published", || async {
        first
            .count("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NOT NULL")
            .await
            == 300
    })
    .await;
    assert_eq!(first.count("SELECT count(*) FROM obx.outbox_delayed").await, 0);
    let on_the_broker = seqs_on_the_broker(&broker.bootstrap, &first.topic("testbed.events"), 300).await;
    // The broker holds each key's events in the outbox's (release) order, and the delays
    // did reorder them: somewhere a later write was due first.
    let release_order: Vec<(String, Vec<i64>)> = sqlx::query_as(
        "SELECT partition_key, array_agg((payload->>'seq')::bigint ORDER BY id) FROM obx.outbox_event GROUP BY 1",
    )
    .fetch_all(&first.db)
    .await
    .unwrap();
    assert_eq!(release_order.len(), 30);
    for (key, seqs) in &release_order {
        assert_eq!(on_the_broker.get(key), Some(seqs), "key {key}");
    }
    assert!(
        release_order
            .iter()
            .any(|(_, seqs)| seqs.windows(2).any(|w| w[0] > w[1])),
        "no event was due before one written earlier: {release_order:?}"
    );
    for h in others {
        h.shutdown().await;
    }
    first.shutdown().await;
}

/// What a plugin's session gets if it calls the function itself, past the SQL policy: the
/// checks of `emit`, a bounded delay, and no way to publish an event early or twice.
#[tokio::test]
async fn a_plugin_session_calling_emit_delayed_itself_gets_every_check() {
    let host = spawn_host(&["testbed"]).await;
    let mut s = host.plugin_session("testbed").await;
    let call = |delays: Vec<i64>, topic: &'static str| {
        let id = uuid::Uuid::new_v4();
        sqlx::query(
            "SELECT obx_api.emit_delayed('1', NULL, ARRAY[$1]::uuid[], ARRAY['A'], ARRAY['a'], ARRAY['Sequenced'], \
             ARRAY['{}'], ARRAY[$2], ARRAY['a'], $3)",
        )
        .bind(id)
        .bind(topic)
        .bind(delays)
    };
    for (delays, topic, why) in [
        (vec![-1], "testbed.events", "a negative delay"),
        (vec![315_576_000_001], "testbed.events", "a delay over ten years"),
        (vec![1000, 1000], "testbed.events", "arrays of different lengths"),
        (vec![1000], "other.events", "an undeclared topic"),
    ] {
        let mut tx = s.begin().await.unwrap();
        let r = call(delays, topic).execute(&mut *tx).await;
        assert!(r.is_err(), "{why} was accepted");
        tx.rollback().await.unwrap();
    }
    // Emitting one event id twice, once delayed: refused, not published twice.
    let mut tx = s.begin().await.unwrap();
    let id = uuid::Uuid::new_v4();
    let twice = sqlx::query(
        "SELECT obx_api.emit_delayed('1', NULL, ARRAY[$1, $1]::uuid[], ARRAY['A','A'], ARRAY['a','a'], \
         ARRAY['Sequenced','Sequenced'], ARRAY['{}','{}'], ARRAY['testbed.events','testbed.events'], \
         ARRAY['a','a'], ARRAY[1000, 1000]::bigint[])",
    )
    .bind(id)
    .execute(&mut *tx)
    .await;
    assert!(twice.is_err(), "one event id was stored twice");
    tx.rollback().await.unwrap();
    // Nor may it read or change the waiting events, or release them early.
    for statement in [
        "SELECT * FROM obx.outbox_delayed",
        "UPDATE obx.outbox_delayed SET due_at = now()",
        "SELECT obx.outbox_release_due(10)",
    ] {
        let r = sqlx::query(statement).execute(&mut s).await;
        assert!(r.is_err(), "a plugin ran {statement}");
    }
    s.close().await.unwrap();
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_delayed").await, 0);
    host.shutdown().await;
}

/// `obx_api.emit` on a plugin session, one event of id `id` on testbed.events.
fn emit_now(id: uuid::Uuid) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(
        "SELECT obx_api.emit('1', NULL, ARRAY[$1]::uuid[], ARRAY['A'], ARRAY['a'], ARRAY['Sequenced'], \
         ARRAY['{}'], ARRAY['testbed.events'], ARRAY['a'])",
    )
    .bind(id)
}

/// `obx_api.emit_delayed` on a plugin session, one event of id `id`, due in `delay_ms`.
fn emit_later(
    id: uuid::Uuid,
    delay_ms: i64,
) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(
        "SELECT obx_api.emit_delayed('1', NULL, ARRAY[$1]::uuid[], ARRAY['A'], ARRAY['a'], ARRAY['Sequenced'], \
         ARRAY['{}'], ARRAY['testbed.events'], ARRAY['a'], ARRAY[$2]::bigint[])",
    )
    .bind(id)
    .bind(delay_ms)
}

/// The race a twin comes from: `a` writes a delayed event of id `twin` due at once; `b`'s
/// emit of the same id waits for `a`, and goes through when `a` commits. Returns `b`, which
/// keeps its transaction open, holding the twin.
async fn open_twin(
    host: &TestHost,
    a: &mut sqlx::PgConnection,
    mut b: sqlx::PgConnection,
    twin: uuid::Uuid,
) -> sqlx::PgConnection {
    sqlx::query("BEGIN").execute(&mut *a).await.unwrap();
    emit_later(twin, 0).execute(&mut *a).await.unwrap();
    // The wait for `a` may outlast the role's lock timeout on a slow machine.
    sqlx::raw_sql("BEGIN; SET LOCAL lock_timeout = '30s'")
        .execute(&mut b)
        .await
        .unwrap();
    let racing = tokio::spawn(async move {
        let written = emit_now(twin).execute(&mut b).await;
        (b, written)
    });
    eventually(Duration::from_secs(10), "b's emit waits for a", || async {
        host.lock_waits().await >= 1
    })
    .await;
    sqlx::query("COMMIT").execute(&mut *a).await.unwrap();
    let (b, written) = racing.await.unwrap();
    written.expect("the racing emit goes through");
    b
}

/// A delayed event's id is its own while it waits: another emit of it is refused, with the
/// reason (it used to make the delayed event vanish at its release). A transaction that still
/// wrote it, racing the delayed event's own commit, and stays open does not stop the relay:
/// other events are published meanwhile (the release used to wait for that transaction, and
/// every relay's step with it), and the delayed event is released, once, when it ends.
#[tokio::test]
async fn an_id_waiting_delayed_is_its_own_and_an_open_twin_does_not_stop_the_relay() {
    // Plugin sessions idle in a transaction for a minute and more before Postgres ends them.
    let host = spawn_host_with(&["testbed"], |c| {
        c.limits.call_deadline = Duration::from_secs(30);
        c.limits.statement_timeout = Duration::from_secs(30);
    })
    .await;
    let mut a = host.plugin_session("testbed").await;
    let mut b = host.plugin_session("testbed").await;
    let waiting = uuid::Uuid::new_v4();
    emit_later(waiting, 600_000).execute(&mut a).await.unwrap();
    let refused = emit_now(waiting).execute(&mut b).await.unwrap_err();
    assert!(refused.to_string().contains("taken by a delayed event"), "{refused}");

    let twin = uuid::Uuid::new_v4();
    let mut b = open_twin(&host, &mut a, b, twin).await;
    // The id the database wrote: a plugin's ids are made its own.
    let stored = obx::outbox::stored_event_id(&host.plugin_role("testbed").await, twin);

    let seq = sequenced(&host, "other", None).await;
    eventually(Duration::from_secs(10), "another event published meanwhile", || async {
        published(&host, "other", seq).await
    })
    .await;
    let held = format!("SELECT count(*) FROM obx.outbox_delayed WHERE event_id = '{stored}'");
    assert_eq!(
        host.count(&held).await,
        1,
        "released while its twin's transaction is open"
    );

    sqlx::query("ROLLBACK").execute(&mut b).await.unwrap();
    let sent =
        format!("SELECT count(*) FROM obx.outbox_event WHERE event_id = '{stored}' AND published_at IS NOT NULL");
    eventually(
        Duration::from_secs(10),
        "the delayed event released and published",
        || async { host.count(&sent).await == 1 },
    )
    .await;
    a.close().await.unwrap();
    b.close().await.unwrap();
    host.shutdown().await;
}

/// A delayed event whose id an open transaction holds (the race above) holds up its own key
/// only: due delayed events of other keys are released and published meanwhile, behind 40 of
/// its key (more than the release tries in a step), and the next one of its key waits behind
/// it; when the transaction ends, they go out in their order. The release used to give up its
/// whole step after its 200 ms lock wait, at every step, so that one plugin's open
/// transaction kept every plugin's delayed events waiting.
#[tokio::test]
async fn a_delayed_event_held_by_an_open_twin_holds_up_its_key_only() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.limits.call_deadline = Duration::from_secs(30);
        c.limits.statement_timeout = Duration::from_secs(30);
    })
    .await;
    let mut a = host.plugin_session("testbed").await;
    let b = host.plugin_session("testbed").await;
    let twin = uuid::Uuid::new_v4();
    let mut b = open_twin(&host, &mut a, b, twin).await;
    // The id the database wrote: a plugin's ids are made its own.
    let stored = obx::outbox::stored_event_id(&host.plugin_role("testbed").await, twin);

    // Delayed events due after the held one (a delay of 0 publishes at once): 41 of its key,
    // then one of another.
    let behind = sequenced(&host, "a", Some(50)).await;
    for _ in 0..40 {
        emit_later(uuid::Uuid::new_v4(), 50).execute(&mut a).await.unwrap();
    }
    let other = sequenced(&host, "other", Some(50)).await;
    eventually(
        Duration::from_secs(10),
        "a delayed event of another key published meanwhile",
        || async { published(&host, "other", other).await },
    )
    .await;
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_delayed WHERE partition_key = 'a'")
            .await,
        42,
        "the held event and those of its key behind it wait"
    );

    sqlx::query("ROLLBACK").execute(&mut b).await.unwrap();
    eventually(Duration::from_secs(10), "the key's two events published", || async {
        published(&host, "a", behind).await
            && host
                .count(&format!(
                    "SELECT count(*) FROM obx.outbox_event WHERE event_id = '{stored}' AND published_at IS NOT NULL"
                ))
                .await
                == 1
    })
    .await;
    let in_order = host
        .count(&format!(
            "SELECT count(*) FROM obx.outbox_event t, obx.outbox_event s \
             WHERE t.event_id = '{stored}' AND s.partition_key = 'a' \
               AND (s.payload->>'seq')::bigint = {behind} AND t.id < s.id"
        ))
        .await;
    assert_eq!(in_order, 1, "the held event went out after the one behind it");
    a.close().await.unwrap();
    b.close().await.unwrap();
    host.shutdown().await;
}

/// A release reads the due delayed events only, however many wait: it compared `due_at` with
/// `clock_timestamp()`, which cannot bound an index scan, so every relay step read every
/// waiting event (100 ms for a million). Counted as the rows and index entries one release reads.
#[tokio::test]
async fn a_release_reads_the_due_events_only() {
    let host = spawn_host_with(&["testbed"], |c| c.relay.enabled = false).await;
    let waiting = host
        .count(
            "WITH w AS (INSERT INTO obx.outbox_delayed (event_id, aggregate_type, aggregate_id, event_type, \
                 payload, topic, partition_key, created_at, plugin_name, plugin_version, due_at) \
               SELECT gen_random_uuid(), 'A', 'a', 'Sequenced', '{}', 'testbed.events', 'k' || n % 7, now(), \
                      'testbed', '1', now() + interval '1 hour' + n * interval '1 ms' \
               FROM generate_series(1, 10000) n RETURNING 1) SELECT count(*) FROM w",
        )
        .await;
    assert_eq!(waiting, 10_000);
    // With statistics, as autovacuum keeps them: without, the planner reads the small table whole.
    sqlx::query("ANALYZE obx.outbox_delayed")
        .execute(&host.db)
        .await
        .unwrap();
    let mut tx = host.db.begin().await.unwrap();
    let released: i32 = sqlx::query_scalar("SELECT released FROM obx.outbox_release_due(1000)")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(released, 0);
    // Rows a scan of the table read, and entries a scan of its index returned.
    let read: i64 = sqlx::query_scalar(
        "SELECT pg_stat_get_xact_tuples_returned('obx.outbox_delayed'::regclass) \
              + pg_stat_get_xact_tuples_returned('obx.ix_outbox_delayed_due'::regclass)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert!(
        read < 100,
        "a release with nothing due read {read} of 10,000 waiting events"
    );
    tx.rollback().await.unwrap();
    host.shutdown().await;
}

/// With no delayed event waiting, the release says so (NULL), and an idle relay waits for a
/// commit or its poll. It said "due in 0 ms" (greatest() skips a NULL), so every idle relay
/// stepped at `relay.min_step_interval`: some 400 transactions a second per idle host.
#[tokio::test]
async fn an_idle_relay_with_nothing_delayed_waits_for_its_poll() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.relay.poll_interval = Duration::from_secs(2);
        c.consumer.enabled = false;
    })
    .await;
    let next: Option<i64> = sqlx::query_scalar("SELECT next_due_ms FROM obx.outbox_release_due(1)")
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert_eq!(next, None, "nothing is delayed, yet something is said to be due");

    let commits = || host.commits_so_far();
    let before = commits().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let per_second = (commits().await - before) as f64 / 4.5;
    // What is left: the timer loop's probe and the relay's poll, a few a second.
    assert!(
        per_second < 60.0,
        "an idle host commits {per_second:.0} transactions a second"
    );

    // A delayed event still goes out when due, and the relay is idle again after it.
    let seq = sequenced(&host, "idle-after", Some(300)).await;
    eventually(Duration::from_secs(10), "the delayed event is published", || {
        published(&host, "idle-after", seq)
    })
    .await;
    let before = commits().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let per_second = (commits().await - before) as f64 / 4.5;
    assert!(
        per_second < 60.0,
        "after a release, an idle host commits {per_second:.0} a second"
    );
    host.shutdown().await;
}
