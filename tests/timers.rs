//! Durable timers (`obx:plugin/timers`, the `timed-plugin` world of obx:plugin@0.2.1). A
//! plugin schedules a timer in the transaction of its call; the host fires `handle-timer` at
//! or after its due time, in a transaction of its own, once, with any number of hosts. The
//! testbed's `schedule` and `cancel` commands drive them; its timer handler records each
//! firing in `timers_fired` (no key: a second effect would show as a second row).

use std::time::Duration;

use obx_tests::{admin_url, eventually, spawn_host, spawn_host_on, spawn_host_with, Gate, TestHost};
use serde_json::{json, Value};

async fn schedule(host: &TestHost, body: Value) -> u16 {
    let answer = host.command("testbed", "schedule", body).await;
    answer.status
}

async fn fired(host: &TestHost) -> i64 {
    host.count("SELECT count(*) FROM testbed.timers_fired").await
}

#[tokio::test]
async fn a_timer_fires_once_after_its_due_time_and_never_before() {
    let host = spawn_host(&["testbed"]).await;
    let status = schedule(
        &host,
        json!({ "name": "deadline", "key": "order-1", "delay_ms": 1500, "payload": { "order": 1 } }),
    )
    .await;
    assert_eq!(status, 200);
    // Scheduled 1.5 s ahead: nothing may fire within the first second.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(fired(&host).await, 0, "the timer fired before its due time");
    eventually(Duration::from_secs(10), "the timer fires", || async {
        fired(&host).await == 1
    })
    .await;
    // It fired at or after its due time, with its payload, on the first attempt.
    let early = host
        .count("SELECT count(*) FROM testbed.timers_fired WHERE at < due_at")
        .await;
    assert_eq!(early, 0);
    let row: (String, String, Value, i32) =
        sqlx::query_as("SELECT name, key, payload, attempt FROM testbed.timers_fired")
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert_eq!(row, ("deadline".into(), "order-1".into(), json!({ "order": 1 }), 1));
    // And once: the timer is gone, and nothing fires again.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(fired(&host).await, 1);
    assert_eq!(host.count("SELECT count(*) FROM obx.timer").await, 0);
    host.shutdown().await;
}

#[tokio::test]
async fn a_timer_scheduled_by_a_call_that_rolled_back_never_fires() {
    let host = spawn_host(&["testbed"]).await;
    let status = schedule(&host, json!({ "name": "t", "key": "k", "delay_ms": 0, "fail": true })).await;
    assert_eq!(status, 500);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(host.count("SELECT count(*) FROM obx.timer").await, 0);
    assert_eq!(fired(&host).await, 0);
    host.shutdown().await;
}

/// A timed plugin whose earliest timer is not due takes no batch: its loop probes the
/// index for that due time and sleeps. Each idle turn took a batch, a transaction on a plugin
/// session four times a second for every timed plugin on every host, which also kept those
/// sessions from ever closing. Counted by Postgres (`track_functions` for the plugin's role).
#[tokio::test]
async fn an_idle_timed_plugin_takes_no_batch() {
    use sqlx::{Connection, Executor};
    let host = spawn_host(&["testbed"]).await;
    let role = host.plugin_role("testbed").await;
    let mut admin = sqlx::PgConnection::connect(&admin_url()).await.unwrap();
    admin
        .execute(format!("ALTER ROLE \"{role}\" SET track_functions = 'pl'").as_str())
        .await
        .unwrap();
    // Sessions opened before keep their settings: ended, they are opened again with it.
    admin
        .execute(format!("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'").as_str())
        .await
        .unwrap();
    assert_eq!(
        schedule(&host, json!({ "name": "t", "key": "later", "delay_ms": 60_000 })).await,
        200
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let batches = host
        .count("SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_user_functions WHERE funcname = 'timer_take_traced'")
        .await;
    assert!(batches <= 1, "{batches} batches taken in 3 s with no timer due");
    host.shutdown().await;
}

#[tokio::test]
async fn a_cancelled_timer_never_fires() {
    let host = spawn_host(&["testbed"]).await;
    assert_eq!(
        schedule(&host, json!({ "name": "t", "key": "k", "delay_ms": 800 })).await,
        200
    );
    // The operator sees it, through the admin API.
    let listed = host.get("/v1/timers?plugin=testbed").await;
    assert_eq!(listed.body.as_array().map(Vec::len), Some(1), "{}", listed.text);
    assert_eq!(listed.body[0]["key"], "k", "{}", listed.text);
    let cancelled = host
        .command("testbed", "cancel", json!({ "name": "t", "key": "k" }))
        .await;
    assert_eq!((cancelled.status, cancelled.body.clone()), (200, json!(true)));
    let again = host
        .command("testbed", "cancel", json!({ "name": "t", "key": "k" }))
        .await;
    assert_eq!(again.body, json!(false), "nothing was left to cancel");
    tokio::time::sleep(Duration::from_millis(1800)).await;
    assert_eq!(fired(&host).await, 0);
    // Its plugin still has counts, all zero, for the gauges: one with no timer left was left
    // out, and its gauges kept their last values.
    let counts = obx::timers::counts(&host.db).await.unwrap();
    let testbed = counts.iter().find(|c| c.plugin == "testbed").expect("testbed's counts");
    assert_eq!((testbed.pending, testbed.parked), (0, 0));
    host.shutdown().await;
}

/// A timer that an earlier timer of the same batch rescheduled (or cancelled) does not fire
/// on the schedule it was taken with. The batch read its due timers once, so `b`, moved ten
/// minutes ahead by `a`'s handler, fired at once anyway, and again ten minutes later.
#[tokio::test]
async fn a_timer_rescheduled_by_another_of_its_batch_fires_on_its_new_schedule_only() {
    let host = spawn_host(&["testbed"]).await;
    let a = json!({ "name": "a", "key": "k", "delay_ms": 60_000, "payload": { "then": { "name": "b", "delay_ms": 600_000 } } });
    assert_eq!(schedule(&host, a).await, 200);
    assert_eq!(
        schedule(&host, json!({ "name": "b", "key": "k", "delay_ms": 60_000 })).await,
        200
    );
    // Due together, `a` first, so that one batch takes both.
    let due = host
        .count(
            "WITH u AS (UPDATE obx.timer SET due_at = now() - CASE name WHEN 'a' THEN interval '1 s' ELSE interval '0' END \
             RETURNING 1) SELECT count(*) FROM u",
        )
        .await;
    assert_eq!(due, 2);
    eventually(Duration::from_secs(10), "a fires", || async { fired(&host).await >= 1 }).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let names: Vec<String> = sqlx::query_scalar("SELECT name FROM testbed.timers_fired ORDER BY at")
        .fetch_all(&host.db)
        .await
        .unwrap();
    assert_eq!(names, ["a"], "b fired on the schedule a replaced");
    let ahead = host
        .count("SELECT count(*) FROM obx.timer WHERE name = 'b' AND due_at > now() + interval '9 min'")
        .await;
    assert_eq!(ahead, 1, "b waits for its new due time");
    host.shutdown().await;
}

/// Waits until the host's one timer is parked; its attempts and last error.
async fn the_parked_timer(host: &TestHost) -> (i32, String) {
    eventually(Duration::from_secs(20), "the timer is parked", || async {
        host.count("SELECT count(*) FROM obx.timer WHERE parked_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    sqlx::query_as("SELECT attempts, last_error FROM obx.timer")
        .fetch_one(&host.db)
        .await
        .unwrap()
}

/// A handler that fails is called again after a backoff, each attempt rolled back, and the
/// timer is parked after `consumer.max_attempts`, with its error, and fires no more.
#[tokio::test]
async fn a_failing_timer_is_retried_then_parked() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.max_attempts = 3).await;
    let body = json!({ "name": "t", "key": "k", "delay_ms": 0, "payload": { "fail": true } });
    assert_eq!(schedule(&host, body).await, 200);
    let (attempts, error) = the_parked_timer(&host).await;
    assert_eq!(attempts, 3);
    assert!(error.contains("the testbed's timer failed"), "{error}");
    // The operator sees it in /v1/status.
    let status = host.get("/v1/status").await;
    assert_eq!(status.body["timers"][0]["plugin"], "testbed", "{}", status.text);
    assert_eq!(status.body["timers"][0]["parked"], 1, "{}", status.text);
    assert_eq!(status.body["timers"][0]["pending"], 0, "{}", status.text);
    // Every attempt rolled back, its effect too.
    assert_eq!(fired(&host).await, 0);
    // The admin API lists it, and sends it back to fire: it fails again, and is parked again.
    let first_parked: String = sqlx::query_scalar("SELECT parked_at::text FROM obx.timer")
        .fetch_one(&host.db)
        .await
        .unwrap();
    let listed = host.get("/v1/timers?parked=true").await;
    assert_eq!(listed.body[0]["name"], "t", "{}", listed.text);
    assert_eq!(listed.body[0]["attempts"], 3, "{}", listed.text);
    let retried = host
        .post_json(
            "/v1/timers/retry",
            json!({ "plugin": "testbed", "name": "t", "key": "k" }),
        )
        .await;
    assert_eq!(retried.status, 200, "{}", retried.text);
    eventually(Duration::from_secs(10), "the retried timer is parked again", || async {
        host.count(&format!(
            "SELECT count(*) FROM obx.timer WHERE attempts = 3 AND parked_at > '{first_parked}'::timestamptz"
        ))
        .await
            == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let attempts: i64 = host.count("SELECT attempts::bigint FROM obx.timer").await;
    assert_eq!(attempts, 3, "a parked timer fired again");
    host.shutdown().await;
}

/// A host whose timer handlers give up a lock wait after 100 ms, whose timers are parked
/// after two counted attempts, whose backoff is 50 ms doubling up to `backoff_max` and whose
/// lost races go uncounted for `grace`, with a timer due now whose handler waits for the
/// gate, which the test holds.
async fn a_timer_at_the_gate(grace: Duration, backoff_max: Duration) -> (TestHost, Gate) {
    let host = spawn_host_with(&["testbed"], |c| {
        c.consumer.max_attempts = 2;
        c.consumer.backoff_initial = Duration::from_millis(50);
        c.consumer.backoff_max = backoff_max;
        c.consumer.contention_grace = grace;
        c.limits.lock_timeout = Duration::from_millis(100);
    })
    .await;
    let gate = Gate::hold(&host.database_url).await;
    let body = json!({ "name": "t", "key": "k", "delay_ms": 0, "payload": { "gate": true } });
    assert_eq!(schedule(&host, body).await, 200);
    (host, gate)
}

/// Releases `gate` and waits for the one timer to fire.
async fn the_timer_fires_once_the_gate_opens(host: &TestHost, gate: Gate) {
    gate.release().await;
    eventually(Duration::from_secs(10), "the timer fires", || async {
        fired(host).await == 1
    })
    .await;
}

/// A timer whose handler waits past `limits.lock_timeout` for a lock another session holds
/// lost to concurrent work: it is due again after the backoff, as the same attempt, for as
/// long as the lock is held, and fires once when it goes. Each such failure was charged,
/// and the timer parked after `consumer.max_attempts`.
#[tokio::test]
async fn a_timer_that_loses_to_a_lock_is_not_charged_an_attempt() {
    let (host, gate) = a_timer_at_the_gate(Duration::from_secs(600), Duration::from_millis(100)).await;
    eventually(Duration::from_secs(20), "the timer loses a race", || async {
        host.count("SELECT count(*) FROM obx.timer WHERE last_error IS NOT NULL")
            .await
            == 1
    })
    .await;
    // Ten tries or so, each a lock wait of 100 ms and a backoff.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (attempts, parked, error): (i32, bool, Option<String>) =
        sqlx::query_as("SELECT attempts, parked_at IS NOT NULL, last_error FROM obx.timer")
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert_eq!((attempts, parked), (0, false), "{error:?}");
    assert!(error.as_deref().unwrap_or_default().contains("lock"), "{error:?}");
    the_timer_fires_once_the_gate_opens(&host, gate).await;
    let attempt = host.count("SELECT attempt::bigint FROM testbed.timers_fired").await;
    assert_eq!(attempt, 1, "the lock waits were counted as attempts");
    host.shutdown().await;
}

/// A timer whose handler keeps losing to a lock is tried less and less often while the lock
/// stays: after a quarter of the time since its first lost race, at least the backoff and at
/// most `consumer.backoff_max` (`obx_api.timer_defer`). At the attempt's backoff it was tried
/// every lock wait and backoff, about 40 times in these 6 s.
#[tokio::test]
async fn a_timer_held_at_a_lock_is_tried_less_and_less_often() {
    let (host, gate) = a_timer_at_the_gate(Duration::from_secs(600), Duration::from_secs(2)).await;
    let tries = host.tries_at_a_lock("testbed", Duration::from_secs(6)).await;
    assert!((3..=20).contains(&tries), "{tries} tries in 6 s");
    the_timer_fires_once_the_gate_opens(&host, gate).await;
    host.shutdown().await;
}

/// A timer scheduled again starts a new episode of contention: its first lost race after
/// that is not charged, however long ago the old episode began (`obx_api.timer_defer` keeps
/// `contended_since` only when it is not older than `scheduled_at`). Without that, a timer
/// that had lost races once kept its old episode, and its next lost race past the grace was
/// charged at once.
#[tokio::test]
async fn a_timer_scheduled_again_starts_a_new_episode_of_contention() {
    let (host, gate) = a_timer_at_the_gate(Duration::from_secs(3), Duration::from_millis(100)).await;
    let lost = "SELECT count(*) FROM obx.timer WHERE last_error IS NOT NULL";
    eventually(Duration::from_secs(20), "the timer loses a race", || async {
        host.count(lost).await == 1
    })
    .await;
    // Due again past the old episode's grace (3 s), the gate still held.
    let body = json!({ "name": "t", "key": "k", "delay_ms": 4000, "payload": { "gate": true } });
    // A firing holds the timer's row while its handler waits at the gate, and scheduling it
    // again may wait past the lock timeout (100 ms) for that row: a caller tries again.
    eventually(Duration::from_secs(20), "the timer is scheduled again", || async {
        schedule(&host, body.clone()).await == 200
    })
    .await;
    assert_eq!(host.count(lost).await, 0, "scheduling it again clears its error");
    eventually(
        Duration::from_secs(20),
        "the timer scheduled again loses a race",
        || async { host.count(lost).await == 1 },
    )
    .await;
    let (attempts, parked, error): (i32, bool, Option<String>) =
        sqlx::query_as("SELECT attempts, parked_at IS NOT NULL, last_error FROM obx.timer")
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert_eq!((attempts, parked), (0, false), "the old episode was kept: {error:?}");
    the_timer_fires_once_the_gate_opens(&host, gate).await;
    host.shutdown().await;
}

/// Past `consumer.contention_grace` from its first lost race, a timer whose handler keeps
/// losing to a lock is charged again, and parked after `consumer.max_attempts`: a lock
/// nobody releases ends in a parked timer, not in one tried for ever.
#[tokio::test]
async fn a_timer_that_keeps_losing_past_the_grace_is_parked() {
    let (host, gate) = a_timer_at_the_gate(Duration::from_secs(1), Duration::from_millis(100)).await;
    let (attempts, error) = the_parked_timer(&host).await;
    assert_eq!(attempts, 2, "{error}");
    assert!(error.contains("lock"), "{error}");
    gate.release().await;
    assert_eq!(fired(&host).await, 0);
    host.shutdown().await;
}

/// A handler that schedules its own timer again keeps the new schedule, also when it cancels
/// the timer first (a new row): the firing ends the generation it fired, and generations are
/// never reused.
#[tokio::test]
async fn a_timer_its_handler_schedules_again_fires_again() {
    let host = spawn_host(&["testbed"]).await;
    for (key, cancel_first) in [("k", false), ("c", true)] {
        let body = json!({
            "name": "tick", "key": key, "delay_ms": 0,
            "payload": { "then": { "name": "tick", "delay_ms": 200, "cancel_first": cancel_first } }
        });
        assert_eq!(schedule(&host, body).await, 200);
    }
    eventually(Duration::from_secs(10), "each timer fires twice", || async {
        fired(&host).await == 4
    })
    .await;
    // The second schedules carried `{}`: no third firing.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(fired(&host).await, 4);
    assert_eq!(host.count("SELECT count(*) FROM obx.timer").await, 0);
    host.shutdown().await;
}

/// Taking due timers reads the due ones only, however many are pending: the take compared
/// `due_at` with `clock_timestamp()`, which cannot bound an index scan, so every poll of every
/// host read all of the plugin's pending timers (100 ms for a million). Counted as the rows
/// and index entries one take reads.
#[tokio::test]
async fn taking_due_timers_reads_the_due_ones_only() {
    let host = spawn_host(&["testbed"]).await;
    let pending = host
        .count(
            "WITH p AS (INSERT INTO obx.timer (plugin, name, key, due_at, payload) \
               SELECT 'testbed', 't', 'k' || n, now() + interval '1 hour', '{}' \
               FROM generate_series(1, 10000) n RETURNING 1) SELECT count(*) FROM p",
        )
        .await;
    assert_eq!(pending, 10_000);
    // With statistics, as autovacuum keeps them: without, the planner may read the table whole.
    sqlx::query("ANALYZE obx.timer").execute(&host.db).await.unwrap();
    let index = host.count("SELECT 'obx.ix_timer_due'::regclass::oid::bigint").await;
    let table = host.count("SELECT 'obx.timer'::regclass::oid::bigint").await;
    let mut session = host.plugin_session("testbed").await;
    sqlx::Executor::execute(&mut session, "BEGIN").await.unwrap();
    let taken: i64 = sqlx::query_scalar("SELECT count(*) FROM obx_api.timer_take_traced(32)")
        .fetch_one(&mut session)
        .await
        .unwrap();
    assert_eq!(taken, 0);
    // Rows a scan of the table read, and entries a scan of its index returned.
    let read: i64 = sqlx::query_scalar(
        "SELECT pg_stat_get_xact_tuples_returned($1::oid) + pg_stat_get_xact_tuples_returned($2::oid)",
    )
    .bind(table)
    .bind(index)
    .fetch_one(&mut session)
    .await
    .unwrap();
    assert!(
        read < 100,
        "a take with nothing due read {read} of 10,000 pending timers"
    );
    sqlx::Executor::execute(&mut session, "ROLLBACK").await.unwrap();
    host.shutdown().await;
}

/// A handler that breaks a deferred constraint returns `ok`, and the violation would show
/// only at the batch's commit: it is checked after the handler instead, as that timer's own
/// failure, so the timer is parked and the other timers of its batch fire.
#[tokio::test]
async fn a_timer_whose_handler_breaks_a_deferred_constraint_is_parked_alone() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.max_attempts = 2).await;
    let bad = json!({ "name": "t", "key": "bad", "delay_ms": 0, "payload": { "defer_violation": true } });
    assert_eq!(schedule(&host, bad).await, 200);
    for i in 0..5 {
        let body = json!({ "name": "t", "key": format!("good{i}"), "delay_ms": 0 });
        assert_eq!(schedule(&host, body).await, 200);
    }
    eventually(Duration::from_secs(10), "the bad timer is parked", || async {
        host.count("SELECT count(*) FROM obx.timer WHERE parked_at IS NOT NULL AND attempts = 2")
            .await
            == 1
    })
    .await;
    let error: String = sqlx::query_scalar("SELECT last_error FROM obx.timer")
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert!(error.contains("deferred_once"), "{error}");
    eventually(Duration::from_secs(10), "the good timers fire", || async {
        fired(&host).await == 5
    })
    .await;
    assert_eq!(host.count("SELECT count(*) FROM testbed.deferred").await, 0);
    host.shutdown().await;
}

/// A handler that breaks a deferred constraint for a moment and mends it before it returns
/// fires at its first attempt wherever it stands in its batch: the check after a handler
/// leaves the constraints deferred for the next one. It made them immediate for the rest of
/// the batch, so that each such timer after the first failed its first attempt.
#[tokio::test]
async fn a_timer_that_mends_a_deferred_constraint_fires_at_once_anywhere_in_its_batch() {
    let host = spawn_host(&["testbed"]).await;
    for i in 0..4 {
        let body =
            json!({ "name": "t", "key": format!("k{i}"), "delay_ms": 60_000, "payload": { "defer_then_mend": true } });
        assert_eq!(schedule(&host, body).await, 200);
    }
    // Due together, so that one batch takes all four.
    let due = host
        .count("WITH u AS (UPDATE obx.timer SET due_at = now() RETURNING 1) SELECT count(*) FROM u")
        .await;
    assert_eq!(due, 4);
    eventually(Duration::from_secs(20), "the four timers fire", || async {
        fired(&host).await == 4
    })
    .await;
    assert_eq!(
        host.count("SELECT count(*) FROM testbed.timers_fired WHERE attempt > 1")
            .await,
        0,
        "a timer failed its first attempt"
    );
    assert_eq!(host.count("SELECT count(*) FROM testbed.deferred").await, 4);
    host.shutdown().await;
}

/// A batch whose commit the database refuses charges none of its timers: they fire again one
/// per transaction, and only the timer whose work cannot commit is charged. Here one timer of
/// six emits an event over the payload limit that another host, with smaller limits, recorded
/// for the plugin when it loaded it last (the row is updated as it would have written it):
/// this host lets the event through, the database refuses it at the commit. Before, each
/// failed commit charged all six, and with two attempts all six were parked, none fired.
#[tokio::test]
async fn a_timer_batch_whose_commit_is_refused_charges_only_the_timer_at_fault() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.max_attempts = 2).await;
    host.limits_recorded_by_another_host("testbed", "max_payload_bytes = 1000")
        .await;
    let big =
        json!({ "name": "t", "key": "big", "delay_ms": 60_000, "payload": { "emit": { "payload_bytes": 2000 } } });
    assert_eq!(schedule(&host, big).await, 200);
    for i in 0..5 {
        let body = json!({ "name": "t", "key": format!("good{i}"), "delay_ms": 60_000 });
        assert_eq!(schedule(&host, body).await, 200);
    }
    // Due together, so that one batch takes all six.
    let due = host
        .count("WITH u AS (UPDATE obx.timer SET due_at = now() RETURNING 1) SELECT count(*) FROM u")
        .await;
    assert_eq!(due, 6);
    eventually(Duration::from_secs(20), "the good timers fire", || async {
        fired(&host).await == 5
    })
    .await;
    eventually(Duration::from_secs(20), "the big timer is parked", || async {
        host.count("SELECT count(*) FROM obx.timer WHERE key = 'big' AND parked_at IS NOT NULL AND attempts = 2")
            .await
            == 1
    })
    .await;
    assert_eq!(
        host.count("SELECT count(*) FROM obx.timer").await,
        1,
        "only the big timer is left"
    );
    let error: String = sqlx::query_scalar("SELECT last_error FROM obx.timer")
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert!(error.contains("over the limit of 1000"), "{error}");
    assert_eq!(
        host.count("SELECT count(*) FROM testbed.timers_fired WHERE key = 'big'")
            .await,
        0
    );
    host.shutdown().await;
}

/// Each plugin gets a batch in turn: a plugin with thousands of timers due does not hold up
/// another's. Both have a backlog, so that whichever comes first in the registry's order, a
/// loop that served one plugin until it had nothing due would be caught.
#[tokio::test]
async fn a_plugins_backlog_does_not_hold_up_another_plugins_timers() {
    let host = spawn_host(&["testbed", "orders"]).await;
    // orders handles no timers (its SDK export fails them): an attempt shows it was fired.
    sqlx::query(
        "INSERT INTO obx.timer (plugin, name, key, due_at, payload) \
         SELECT p, 'backlog', 'k' || g, clock_timestamp(), '{}' \
         FROM unnest(ARRAY['testbed', 'orders']) p, generate_series(1, 2000) g",
    )
    .execute(&host.db)
    .await
    .unwrap();
    let attempted = || host.count("SELECT count(*) FROM obx.timer WHERE plugin = 'orders' AND attempts >= 1");
    eventually(Duration::from_secs(20), "both plugins' timers fire", || async {
        fired(&host).await > 0 && attempted().await > 0
    })
    .await;
    let (testbed, orders) = (fired(&host).await, attempted().await);
    assert!(
        testbed < 2000 && orders < 2000,
        "one plugin waited for the other's whole backlog: {testbed} / {orders}"
    );
    host.shutdown().await;
}

/// A plugin whose timer handler takes long (here it waits for a lock the test holds) holds up
/// no other plugin's timers: each plugin's batch runs at once with the others'.
#[tokio::test]
async fn a_plugins_slow_timer_handler_does_not_hold_up_another_plugins_timers() {
    let host = spawn_host_with(&["testbed", "orders"], |c| {
        c.limits.call_deadline = Duration::from_secs(30);
        c.limits.lock_timeout = Duration::from_secs(30);
        c.limits.statement_timeout = Duration::from_secs(30);
    })
    .await;
    let gate = Gate::hold(&host.database_url).await;
    let slow = json!({ "name": "slow", "key": "k", "delay_ms": 0, "payload": { "gate": true } });
    assert_eq!(schedule(&host, slow).await, 200);
    eventually(Duration::from_secs(10), "testbed's timer handler waits", || async {
        host.lock_waits().await >= 1
    })
    .await;
    // orders handles no timers (its SDK export fails them): an attempt shows it was fired.
    sqlx::query(
        "INSERT INTO obx.timer (plugin, name, key, due_at, payload) VALUES ('orders', 't', 'k', clock_timestamp(), '{}')",
    )
    .execute(&host.db)
    .await
    .unwrap();
    let attempted = "SELECT count(*) FROM obx.timer WHERE plugin = 'orders' AND attempts >= 1";
    eventually(Duration::from_secs(5), "orders' timer fired meanwhile", || async {
        host.count(attempted).await == 1
    })
    .await;
    assert_eq!(fired(&host).await, 0, "testbed's timer is still waiting");
    gate.release().await;
    eventually(Duration::from_secs(10), "testbed's timer fires", || async {
        fired(&host).await == 1
    })
    .await;
    host.shutdown().await;
}

/// Three hosts of one service fire 300 timers, all due at about the same moment: each takes
/// effect exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_three_hosts_each_timer_fires_once() {
    let first = spawn_host(&["testbed"]).await;
    let url = first.database_url.clone();
    let second = spawn_host_on(&url, &["testbed"], |_| {}).await;
    let third = spawn_host_on(&url, &["testbed"], |_| {}).await;
    let hosts = [&first, &second, &third];
    for i in 0..300 {
        let host = hosts[i % 3];
        let body = json!({ "name": "t", "key": format!("k{i}"), "delay_ms": 1000 });
        assert_eq!(schedule(host, body).await, 200);
    }
    eventually(Duration::from_secs(30), "300 timers fire", || async {
        fired(&first).await >= 300
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fired(&first).await, 300);
    let keys = first
        .count("SELECT count(DISTINCT key) FROM testbed.timers_fired")
        .await;
    assert_eq!(keys, 300, "a timer took effect twice");
    for host in [third, second, first] {
        host.shutdown().await;
    }
}

/// Bad input gets a clear refusal, and nothing is scheduled.
#[tokio::test]
async fn malformed_timers_are_refused_with_the_reason() {
    let host = spawn_host(&["testbed"]).await;
    let cases = [
        (json!({ "name": "", "key": "k", "delay_ms": 0 }), "name"),
        (json!({ "name": "x".repeat(201), "key": "k", "delay_ms": 0 }), "name"),
        // 300 characters, 1,200 bytes: the limit is in bytes.
        (
            json!({ "name": "t", "key": "\u{1F600}".repeat(300), "delay_ms": 0 }),
            "key",
        ),
        (json!({ "name": "t", "key": "", "delay_ms": 0 }), "key"),
        (
            json!({ "name": "t", "key": "k", "delay_ms": 400_000_000_000u64 }),
            "ten years",
        ),
    ];
    for (body, reason) in cases {
        let answer = host.command("testbed", "schedule", body.clone()).await;
        assert_eq!(answer.status, 400, "{body}: {}", answer.text);
        assert!(answer.text.contains(reason), "{body}: {}", answer.text);
    }
    assert_eq!(host.count("SELECT count(*) FROM obx.timer").await, 0);
    host.shutdown().await;
}

/// The functions behind the import name the plugin from the session's login: a plugin that
/// calls them with SQL of its own (had it got past the SQL policy) reaches only its own
/// timers, never another plugin's.
#[tokio::test]
async fn a_plugin_cannot_reach_another_plugins_timers() {
    use sqlx::Connection;
    let host = spawn_host(&["testbed", "legacy"]).await;
    assert_eq!(
        schedule(&host, json!({ "name": "t", "key": "k", "delay_ms": 60_000 })).await,
        200
    );
    let mut legacy = host.plugin_session("legacy").await;
    let cancelled: bool = sqlx::query_scalar("SELECT obx_api.timer_cancel('t', 'k')")
        .fetch_one(&mut legacy)
        .await
        .unwrap();
    assert!(!cancelled);
    let mut tx = legacy.begin().await.unwrap();
    let taken: Vec<(String,)> = sqlx::query_as("SELECT name FROM obx_api.timer_take(10)")
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert!(taken.is_empty());
    tx.rollback().await.unwrap();
    let read = sqlx::query("SELECT * FROM obx.timer").fetch_all(&mut legacy).await;
    assert!(read.is_err(), "a plugin read the host's timer table");
    assert_eq!(host.count("SELECT count(*) FROM obx.timer").await, 1);
    legacy.close().await.unwrap();
    host.shutdown().await;
}

/// A timer keeps the trace context of the call that scheduled it (its firing links back to
/// it): checked like the rest of a schedule, read back only by the plugin's own sessions, and
/// a host of the previous version, which schedules without one, still can.
#[tokio::test]
async fn a_timer_keeps_its_scheduling_trace_context_within_its_limits() {
    use sqlx::Connection;
    let host = spawn_host(&["testbed", "legacy"]).await;
    assert_eq!(
        schedule(&host, json!({ "name": "t", "key": "k", "delay_ms": 60_000 })).await,
        200
    );
    let recorded = "SELECT count(*) FROM obx.timer WHERE traceparent LIKE '00-%'";
    assert_eq!(
        host.count(recorded).await,
        1,
        "the command's trace context was recorded"
    );

    let mut legacy = host.plugin_session("legacy").await;
    let long = "x".repeat(129);
    let refused = sqlx::query("SELECT obx_api.timer_schedule('t', 'k', 0, '{}', $1)")
        .bind(&long)
        .execute(&mut legacy)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("trace context"), "{refused}");
    let mut tx = legacy.begin().await.unwrap();
    let taken: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT name, traceparent FROM obx_api.timer_take_traced(10)")
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    assert!(taken.is_empty(), "another plugin's timer was taken: {taken:?}");
    tx.rollback().await.unwrap();
    legacy.close().await.unwrap();

    // What a host of the previous version sends: the schedule is replaced, with no context.
    let mut testbed = host.plugin_session("testbed").await;
    sqlx::query("SELECT obx_api.timer_schedule('t', 'k', 60000, '{}')")
        .execute(&mut testbed)
        .await
        .unwrap();
    testbed.close().await.unwrap();
    assert_eq!(host.count(recorded).await, 0);
    assert_eq!(host.count("SELECT count(*) FROM obx.timer").await, 1);
    host.shutdown().await;
}

/// A failed attempt is recorded once: a record that comes late, over attempts another host
/// has recorded since, changes nothing (it would have given the timer an attempt more).
#[tokio::test]
async fn a_timers_failed_attempt_is_recorded_once() {
    let host = spawn_host(&["testbed"]).await;
    assert_eq!(
        schedule(&host, json!({ "name": "t", "key": "k", "delay_ms": 600_000 })).await,
        200
    );
    let generation: i64 = sqlx::query_scalar("SELECT generation FROM obx.timer")
        .fetch_one(&host.db)
        .await
        .unwrap();
    let mut s = host.plugin_session("testbed").await;
    for (attempts, error) in [(1, "first"), (2, "second"), (1, "late"), (4, "skipped one")] {
        sqlx::query("SELECT obx_api.timer_fail('t', 'k', $1, $2, $3, false, 600000)")
            .bind(generation)
            .bind(attempts)
            .bind(error)
            .execute(&mut s)
            .await
            .unwrap();
    }
    let (attempts, error): (i32, String) = sqlx::query_as("SELECT attempts, last_error FROM obx.timer")
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert_eq!((attempts, error.as_str()), (2, "second"));
    host.shutdown().await;
}

/// A component built against obx:plugin@0.2.0 runs next to 0.2.1 ones, unchanged: the host
/// links both, and says which version each targets.
#[tokio::test]
async fn a_plugin_of_the_0_2_0_contract_runs_beside_a_timed_one() {
    let host = spawn_host(&["testbed", "legacy"]).await;
    let answer = host.command("legacy", "ping", json!({})).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert!(answer.body["pong"].is_string());
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_event WHERE event_type = 'Pinged'")
            .await,
        1
    );
    let legacy = host.host.registry.get("legacy").unwrap();
    let testbed = host.host.registry.get("testbed").unwrap();
    assert_eq!(legacy.contract_version, "0.2.0");
    assert!(!legacy.timed());
    assert_eq!(testbed.contract_version, "0.2.1");
    assert!(testbed.timed());
    assert_eq!(
        schedule(&host, json!({ "name": "t", "key": "k", "delay_ms": 0 })).await,
        200
    );
    eventually(Duration::from_secs(10), "the timer fires", || async {
        fired(&host).await == 1
    })
    .await;
    host.shutdown().await;
}

/// A batch of timers stops starting handlers once their emits reach one call's limit
/// (`limits.max_emit_bytes_per_call`): it holds its events until its commit, in one
/// statement. Nine due timers that emit 400 KB each fire in batches of three, not in one of
/// 3.6 MB (32 timers of 16 MiB each held 512 MiB, in a statement Postgres could never take).
#[tokio::test]
async fn a_timer_batch_emits_about_one_calls_limit_at_most() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.limits.max_emit_bytes_per_call = 1_000_000;
        // Unpublished, the outbox rows keep the id of the transaction that wrote them.
        c.relay.enabled = false;
    })
    .await;
    // Due at once, so that one batch could take them all.
    sqlx::query(
        "INSERT INTO obx.timer (plugin, name, key, due_at, payload) \
         SELECT 'testbed', 'big', 'k' || i, clock_timestamp(), \
                jsonb_build_object('emit', jsonb_build_object('topic', 'testbed.alpha', 'payload_bytes', 400000)) \
         FROM generate_series(1, 9) AS i",
    )
    .execute(&host.db)
    .await
    .unwrap();
    eventually(Duration::from_secs(20), "every timer fires", || async {
        fired(&host).await == 9
    })
    .await;
    // A batch's events are written by one statement at its commit, outside the timers'
    // savepoints: at most three 400 KB emits (the third reaches the 1 MB limit) share one.
    let largest = host.largest_outbox_batch("testbed.alpha").await;
    assert!(largest <= 3, "a batch fired {largest} timers of 400 KB of emits each");
    assert_eq!(
        host.count("SELECT count(*) FROM obx.outbox_event WHERE topic = 'testbed.alpha'")
            .await,
        9
    );
    host.shutdown().await;
}

/// With `limits.max_emit_bytes_per_call` at 0 (no emits allowed), due timers still fire: a
/// batch's bound on its emits stops it only after its first handler. Counted before it, it
/// stopped every batch before its first timer, and the loop spun on empty batches.
#[tokio::test]
async fn timers_fire_where_no_emits_are_allowed() {
    let host = spawn_host_with(&["testbed"], |c| c.limits.max_emit_bytes_per_call = 0).await;
    sqlx::query(
        "INSERT INTO obx.timer (plugin, name, key, due_at, payload) \
         VALUES ('testbed', 't', 'k', clock_timestamp(), '{}')",
    )
    .execute(&host.db)
    .await
    .unwrap();
    eventually(Duration::from_secs(10), "the timer fires", || async {
        fired(&host).await == 1
    })
    .await;
    host.shutdown().await;
}

/// Timer batches hold at most `consumer.batch_max_bytes` of payloads (the first timer
/// always): with room for one large timer a batch, due timers still all fire, once each.
#[tokio::test]
async fn timers_larger_than_a_batch_s_bytes_fire_one_batch_each() {
    let host = spawn_host_with(&["testbed"], |c| c.consumer.batch_max_bytes = 64 * 1024).await;
    let pad = "p".repeat(40_000);
    for k in 0..5 {
        let body = json!({ "name": "big", "key": format!("k{k}"), "delay_ms": 300, "payload": { "pad": pad } });
        assert_eq!(schedule(&host, body).await, 200);
    }
    eventually(Duration::from_secs(15), "every large timer fires", || async {
        fired(&host).await == 5
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fired(&host).await, 5, "a timer fired twice");
    assert_eq!(host.count("SELECT count(*) FROM obx.timer").await, 0);
    host.shutdown().await;
}
