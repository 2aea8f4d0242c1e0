//! Payload contracts (`obx:plugin/contract`): a plugin declares the JSON Schema of an event's
//! payload, and the host holds it to it on both sides. `emit` refuses a payload that breaks
//! the schema, naming the field, and the call commits nothing; a consumed event whose
//! payload breaks it is parked at once, before the handler, while valid events and events
//! of other types flow.

use std::time::Duration;

use obx::dispatch::CommandRequest;
use obx_tests::{eventually, producer, send_event, spawn_host, TestHost};
use serde_json::json;

/// The testbed's contracts: ItemEmitted on this topic needs `id` (a string) and, if
/// present, `i` as an integer; Checked on testbed.events needs `qty`, an integer >= 1.
const CONTRACT_TOPIC: &str = "testbed.contract";

async fn emit(host: &TestHost, payload: serde_json::Value) -> Result<(), String> {
    run(host, json!({ "topic": CONTRACT_TOPIC, "payload": payload })).await
}

/// The testbed's `emit` command with its arguments.
async fn run(host: &TestHost, arguments: serde_json::Value) -> Result<(), String> {
    let request = CommandRequest {
        plugin: "testbed".into(),
        command: "emit".into(),
        payload: arguments.to_string(),
        idempotency_key: None,
        request_id: uuid::Uuid::new_v4().to_string(),
        parent_trace: None,
    };
    match host.host.dispatcher.run_command(request).await {
        Ok(_) => Ok(()),
        // What the operator sees in the log: the code and the host's reason.
        Err(e) => Err(format!("{} {e:?}", e.code())),
    }
}

#[tokio::test]
async fn emit_refuses_a_payload_that_breaks_its_declared_schema_and_names_the_field() {
    let host = spawn_host(&["testbed"]).await;
    let rows = || host.count("SELECT count(*) FROM obx.outbox_event WHERE event_type = 'ItemEmitted'");
    assert_eq!(emit(&host, json!({ "id": "a", "i": 1 })).await, Ok(()));
    assert_eq!(rows().await, 1);

    let refused = emit(&host, json!({ "id": "b", "i": "one" })).await.unwrap_err();
    eprintln!("refused: {refused}");
    assert!(refused.contains("/i"), "the field is not named: {refused}");
    assert!(refused.contains("breaks its declared schema"), "{refused}");
    let missing = emit(&host, json!({ "i": 2 })).await.unwrap_err();
    assert!(missing.contains("id"), "{missing}");
    // Nothing of the refused calls committed.
    assert_eq!(rows().await, 1);
    // Over HTTP the caller gets a 500 with no internals; the reason is the operator's.
    let answer = host
        .command(
            "testbed",
            "emit",
            json!({ "topic": CONTRACT_TOPIC, "payload": { "id": 3 } }),
        )
        .await;
    assert_eq!(answer.status, 500, "{}", answer.text);
    assert!(!answer.text.contains("schema"), "{}", answer.text);
    host.shutdown().await;
}

/// The testbed declares ItemWritten on its contract topic as an array whose every item is
/// one of 1,000 numbers: a few bytes of payload can ask the host for a million comparisons.
/// The host bounds what the checks of one event, and of one call's emits, may cost before
/// they run; past the bound the call fails at once and commits nothing.
#[tokio::test]
async fn a_payload_too_costly_to_check_is_refused_before_the_check_runs() {
    let host = spawn_host(&["testbed"]).await;
    let rows = || host.count("SELECT count(*) FROM obx.outbox_event WHERE event_type = 'ItemWritten'");
    let written = |items: usize, count: u64| {
        json!({ "topic": CONTRACT_TOPIC, "event_type": "ItemWritten", "count": count,
                "payload": vec![999; items] })
    };
    // 1,000 items: about 3 million units (a value compared with 1,000 others), within the bound.
    assert_eq!(run(&host, written(1_000, 1)).await, Ok(()));
    assert_eq!(rows().await, 1);
    // And an item that is none of the numbers is named.
    let e = run(
        &host,
        json!({ "topic": CONTRACT_TOPIC, "event_type": "ItemWritten", "payload": [1, 1000] }),
    )
    .await
    .unwrap_err();
    assert!(e.contains("breaks its declared schema at /1"), "{e}");

    // 5,000 items (20 KB): refused before the check, in well under the call's deadline.
    let started = std::time::Instant::now();
    let e = run(&host, written(5_000, 1)).await.unwrap_err();
    assert!(e.contains("is too costly to check against its declared schema"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    // Two events of 1,000 items in one call: the second is past the call's budget.
    let e = run(&host, written(1_000, 2)).await.unwrap_err();
    assert!(e.contains("too costly") && e.contains("are left"), "{e}");
    assert_eq!(rows().await, 1, "nothing of the refused calls committed");
    // The host goes on serving, and the budget is per call.
    assert_eq!(run(&host, written(1_000, 1)).await, Ok(()));
    assert_eq!(emit(&host, json!({ "id": "after" })).await, Ok(()));
    assert_eq!(rows().await, 2);
    host.shutdown().await;
}

/// A consumed event is weighed the same way: one too costly to check is parked before the
/// handler, and one that is dear but within the bound (3.6 million units, a long check that
/// runs off the runtime's worker) is checked and handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumed_event_too_costly_to_check_is_parked_and_a_dear_one_is_handled() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    let topic = host.topic("testbed.events");
    let dear = send_event(&p, &topic, "k1", "Weighed", &json!(vec![999; 1_200])).await;
    let too_dear = send_event(&p, &topic, "k2", "Weighed", &json!(vec![999; 3_000])).await;
    eventually(Duration::from_secs(20), "one handled and one parked", || async {
        effects(&host, dear).await == 1
            && host
                .count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
                .await
                == 1
    })
    .await;
    let (event_id, error): (uuid::Uuid, String) = sqlx::query_as("SELECT event_id, error FROM obx.dead_letter")
        .fetch_one(&host.db)
        .await
        .unwrap();
    assert_eq!(event_id, too_dear);
    assert!(
        error.contains("is too costly to check against its declared schema"),
        "{error}"
    );
    assert_eq!(effects(&host, too_dear).await, 0);
    host.shutdown().await;
}

async fn effects(host: &TestHost, event_id: uuid::Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM testbed.effects WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(&host.db)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_consumed_event_that_breaks_its_declared_schema_is_parked_before_the_handler() {
    let host = spawn_host(&["testbed"]).await;
    let p = producer(&host.host.brokers.bootstrap);
    let topic = host.topic("testbed.events");
    let valid = send_event(&p, &topic, "k1", "Checked", &json!({ "qty": 2 })).await;
    let broken = send_event(&p, &topic, "k2", "Checked", &json!({ "qty": "lots" })).await;
    let behind = send_event(&p, &topic, "k2", "Checked", &json!({ "qty": 3 })).await;
    // Another type on the topic has no declared schema: not checked.
    let other = send_event(&p, &topic, "k3", "Thing", &json!({ "qty": "lots" })).await;
    eventually(
        Duration::from_secs(20),
        "the valid events handled and the broken one parked",
        || async {
            effects(&host, valid).await == 1
                && effects(&host, other).await == 1
                && host
                    .count("SELECT count(*) FROM obx.dead_letter WHERE status = 'parked'")
                    .await
                    == 1
        },
    )
    .await;
    let (event_id, attempts, error): (uuid::Uuid, i32, String) =
        sqlx::query_as("SELECT event_id, attempts, error FROM obx.dead_letter")
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert_eq!(event_id, broken);
    assert_eq!(attempts, 1, "a payload that breaks the contract is not retried");
    assert!(error.contains("/qty") && error.contains("declared schema"), "{error}");
    assert_eq!(effects(&host, broken).await, 0, "the handler never saw it");
    // Its key waits behind it, as behind any parked event.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(effects(&host, behind).await, 0);
    host.shutdown().await;
}
