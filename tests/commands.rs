//! Commands over HTTP: one transaction per command, holding the domain writes and the
//! outbox rows together; every way a handler can fail leaves neither; idempotency keys;
//! HTTP errors with stable codes and no leaked internals.

use std::time::Duration;

use obx_tests::{eventually, peak_rss, reset_peak_rss, spawn_host, spawn_host_with, Gate, TestHost};
use serde_json::json;

async fn rows_for(host: &TestHost, id: &str) -> (i64, i64) {
    let items = host
        .count(&format!("SELECT count(*) FROM testbed.items WHERE id = '{id}'"))
        .await;
    let events = host
        .count(&format!(
            "SELECT count(*) FROM obx.outbox_event WHERE aggregate_id = '{id}'"
        ))
        .await;
    (items, events)
}

#[tokio::test]
async fn create_order_commits_the_order_and_its_event_together() {
    let host = spawn_host(&["orders"]).await;
    let answer = host
        .command(
            "orders",
            "CreateOrder",
            json!({ "customerId": "c-1", "amount": 42.5, "items": [{ "productId": "p-1", "quantity": 2 }] }),
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    let order_id = answer.body["orderId"].as_str().unwrap().to_string();

    let row: (String, String, String) =
        sqlx::query_as("SELECT customer_id, amount::text, status FROM orders.orders WHERE id = $1::uuid")
            .bind(&order_id)
            .fetch_one(&host.db)
            .await
            .unwrap();
    assert_eq!(row, ("c-1".into(), "42.50".into(), "pending".into()));

    let event: (
        String,
        String,
        String,
        String,
        String,
        serde_json::Value,
        String,
        String,
    ) = sqlx::query_as(
        "SELECT aggregate_type, aggregate_id, event_type, topic, partition_key, payload, plugin_name, \
                plugin_version \
         FROM obx.outbox_event",
    )
    .fetch_one(&host.db)
    .await
    .unwrap();
    assert_eq!(event.0, "Order");
    assert_eq!(event.1, order_id);
    assert_eq!(event.2, "OrderCreated");
    assert_eq!(event.3, "order.events");
    assert_eq!(event.4, order_id, "partition key = order id");
    assert_eq!(event.5["orderId"], order_id);
    assert_eq!(event.5["customerId"], "c-1");
    assert_eq!(event.5["items"][0]["productId"], "p-1");
    assert_eq!((event.6.as_str(), event.7.as_str()), ("orders", "0.1.0"));
    host.shutdown().await;
}

#[tokio::test]
async fn a_business_rejection_commits_nothing() {
    let host = spawn_host(&["orders", "testbed"]).await;
    let id = "11111111-1111-4111-8111-111111111111";
    let first = host
        .command(
            "orders",
            "CreateOrder",
            json!({ "orderId": id, "customerId": "c", "amount": 1 }),
        )
        .await;
    assert_eq!(first.status, 200, "{}", first.text);
    let again = host
        .command(
            "orders",
            "CreateOrder",
            json!({ "orderId": id, "customerId": "c", "amount": 1 }),
        )
        .await;
    assert_eq!(again.status, 409, "{}", again.text);
    assert_eq!(again.code(), "rejected");
    assert_eq!(again.body["error"]["reason"], "order-exists");
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_event").await, 1);

    let r = host.command("testbed", "reject", json!({ "id": "r1" })).await;
    assert_eq!((r.status, r.code()), (409, "rejected"));
    assert_eq!(r.body["error"]["reason"], "testbed-says-no");
    assert_eq!(rows_for(&host, "r1").await, (0, 0));
    host.shutdown().await;
}

#[tokio::test]
async fn every_failing_ending_rolls_back_and_the_host_keeps_serving() {
    let host = spawn_host(&["testbed"]).await;
    let cases = [
        ("invalid", 400, "invalid_input"),
        ("fail", 500, "handler_failed"),
        ("trap", 500, "plugin_trap"),
        ("oom", 500, "memory_limit"),
        ("recurse", 500, "plugin_trap"),
        ("sql_then_ok", 500, "transaction_aborted"),
        ("loop", 504, "deadline_exceeded"),
    ];
    for (i, (command, status, code)) in cases.into_iter().enumerate() {
        let id = format!("case-{i}");
        let answer = host.command("testbed", command, json!({ "id": id })).await;
        assert_eq!(
            (answer.status, answer.code()),
            (status, code),
            "{command}: {}",
            answer.text
        );
        assert_eq!(rows_for(&host, &id).await, (0, 0), "{command} left rows behind");
        assert!(
            !answer.text.contains("secret internals"),
            "{command} leaked: {}",
            answer.text
        );
        // The host keeps serving, and the plugin too: a fresh Store per call.
        let ok = host
            .command("testbed", "ok", json!({ "id": format!("after-{i}") }))
            .await;
        assert_eq!(ok.status, 200, "after {command}: {}", ok.text);
    }
    assert_eq!(rows_for(&host, "after-6").await, (1, 1));
    host.shutdown().await;
}

/// Nothing a call leaves in its instance's memory reaches a later call: pooled memory is
/// reset when its Store is dropped, after a call that returned and after one that trapped.
/// The probe grows its memory as far as the stained call's went, and scans all of it.
#[tokio::test]
async fn no_memory_of_a_call_reaches_the_next() {
    let host = spawn_host(&["testbed"]).await;
    let number = |text: &str| {
        text.trim()
            .parse::<u64>()
            .unwrap_or_else(|_| panic!("not a count: {text}"))
    };
    // The testbed's stained statics lie in the prefix that is reset in place (its data
    // copied back from the image); its 4 MiB stain reaches far past it, into what is
    // decommitted. (If a build lost the plugins' 64 KiB stack, they would not.)
    let statics = host.command("testbed", "statics", json!({})).await;
    assert_eq!(statics.status, 200, "{}", statics.text);
    for name in ["stained", "seeded"] {
        let address = statics.body[name].as_u64().unwrap_or(u64::MAX);
        assert!(
            address + 4096 <= obx::runtime::MEMORY_KEEP_RESIDENT as u64,
            "{name} at {address}: past the kept prefix"
        );
    }
    // The probe sees a stain within one call: a later zero means something.
    let same = host.command("testbed", "stain_then_residue", json!({})).await;
    assert_eq!(same.status, 200, "{}", same.text);
    assert!(number(&same.text) >= 512 * 1024, "{}", same.text);
    let stained = host.command("testbed", "stain", json!({})).await;
    assert_eq!(stained.status, 200, "{}", stained.text);
    let pages = number(&stained.text);
    for round in 0..10 {
        if round % 2 == 1 {
            let trapped = host.command("testbed", "stain_then_trap", json!({})).await;
            assert_eq!(trapped.code(), "plugin_trap", "{}", trapped.text);
        } else if round > 0 {
            let stained = host.command("testbed", "stain", json!({})).await;
            assert_eq!(stained.status, 200, "{}", stained.text);
        }
        let residue = host.command("testbed", "residue", json!({ "pages": pages })).await;
        assert_eq!(residue.status, 200, "{}", residue.text);
        assert_eq!(
            number(&residue.text),
            0,
            "round {round}: a call saw a stain of an earlier one"
        );
    }
    host.shutdown().await;
}

/// A payload nested as deep as serde_json reads (128 levels) fits a plugin linked with a
/// 64 KiB Wasm stack, as the example plugins and `obx plugin new` projects are: the testbed
/// parses it into a tree, recursively, and answers. One level deeper is refused with a 400,
/// by the host or by the plugin's own parser, and never traps.
#[tokio::test]
async fn a_payload_as_deep_as_the_host_takes_fits_a_64_kib_plugin_stack() {
    let host = spawn_host(&["testbed"]).await;
    let json_ct = [("content-type", "application/json")];
    let nested = |levels: usize| {
        format!(
            r#"{{"id":"deep-{levels}","v":{}1{}}}"#,
            "[".repeat(levels),
            "]".repeat(levels)
        )
    };
    let mut deepest = 0;
    for levels in 100..200 {
        let a = host
            .request("testbed", "ok", nested(levels).into_bytes(), &json_ct)
            .await;
        if a.status == 400 {
            // The host's parser, or serde_json's limit in the plugin: an answer, not a trap.
            assert!(["invalid_json", "invalid_input"].contains(&a.code()), "{}", a.text);
            break;
        }
        let id = format!("deep-{levels}");
        assert_eq!(
            (a.status, &a.body["id"]),
            (200, &json!(id)),
            "{levels} levels: {}",
            a.text
        );
        deepest = levels;
    }
    assert!((120..199).contains(&deepest), "the host took {deepest} levels");
    host.shutdown().await;
}

/// A command cut off while it waits to claim an Idempotency-Key (another transaction holds
/// the key; here the HTTP request timeout ends it) leaves nothing behind: its session is
/// closed, not pooled inside the transaction its `BEGIN` began with the claim in it (which
/// held the key against every retry, and let the next command's commit commit the claim).
#[tokio::test]
async fn a_command_cut_off_while_its_key_claim_waits_leaves_no_session_in_a_transaction() {
    use sqlx::Connection;
    let host = spawn_host_with(&["testbed"], |c| {
        c.http.request_timeout = Duration::from_secs(2);
        // Nothing else takes a testbed session meanwhile (an inbox step would, and end the
        // transaction it found).
        c.consumer.enabled = false;
        c.limits.lock_timeout = Duration::from_secs(30);
        c.limits.statement_timeout = Duration::from_secs(30);
    })
    .await;
    let mut holder = sqlx::PgConnection::connect(&host.database_url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("INSERT INTO obx.idempotency_key (plugin, key, request_hash) VALUES ('testbed', 'k-gone', '\\x00')")
        .execute(&mut holder)
        .await
        .unwrap();
    let cut = host
        .command_with_key("testbed", "counter", json!({ "id": "gone" }), "k-gone")
        .await;
    assert_eq!(cut.status, 503, "{}", cut.text);
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();

    let role = host.plugin_role("testbed").await;
    let in_transaction =
        format!("SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}' AND state LIKE 'idle in transaction%'");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        host.count(&in_transaction).await,
        0,
        "a plugin session was left in a transaction"
    );
    let retry = host
        .command_with_key("testbed", "counter", json!({ "id": "gone" }), "k-gone")
        .await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert!(
        retry.headers.get("idempotent-replayed").is_none(),
        "{:?}",
        retry.headers
    );
    assert_eq!(retry.body, json!({ "n": 1 }));
    host.shutdown().await;
}

#[tokio::test]
async fn the_same_idempotency_key_runs_the_handler_once() {
    let host = spawn_host(&["testbed"]).await;
    let first = host
        .command_with_key("testbed", "counter", json!({ "id": "c" }), "key-1")
        .await;
    let second = host
        .command_with_key("testbed", "counter", json!({ "id": "c" }), "key-1")
        .await;
    assert_eq!((first.status, second.status), (200, 200));
    assert_eq!(first.body, json!({ "n": 1 }));
    assert_eq!(second.body, json!({ "n": 1 }), "replayed, not re-run");
    assert_eq!(second.headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(host.count("SELECT n FROM testbed.counters WHERE name = 'c'").await, 1);

    // Another key runs again.
    let third = host
        .command_with_key("testbed", "counter", json!({ "id": "c" }), "key-2")
        .await;
    assert_eq!(third.body, json!({ "n": 2 }));

    // The same key with another request is refused.
    let other = host
        .command_with_key("testbed", "counter", json!({ "id": "d" }), "key-1")
        .await;
    assert_eq!((other.status, other.code()), (422, "idempotency_key_reused"));

    // A rejection is an answer too: it is replayed, and nothing of it was committed.
    let r1 = host
        .command_with_key("testbed", "reject", json!({ "id": "rk" }), "key-3")
        .await;
    let r2 = host
        .command_with_key("testbed", "reject", json!({ "id": "rk" }), "key-3")
        .await;
    assert_eq!((r1.status, r2.status), (409, 409));
    assert_eq!(r1.body, r2.body);
    assert!(r2.headers.get("idempotent-replayed").is_some());
    assert_eq!(rows_for(&host, "rk").await, (0, 0));

    // A failure is not an answer: the retry runs the handler again.
    let f1 = host
        .command_with_key("testbed", "trap", json!({ "id": "fk" }), "key-4")
        .await;
    assert_eq!(f1.status, 500);
    assert_eq!(
        host.count("SELECT count(*) FROM obx.idempotency_key WHERE key = 'key-4'")
            .await,
        0
    );
    host.shutdown().await;
}

/// The key is claimed and answered by SQL text the host writes (in the round trips of the
/// `BEGIN` and the `COMMIT`): a key made of quotes, backslashes and SQL is stored as given,
/// and replays.
#[tokio::test]
async fn an_idempotency_key_made_of_quotes_and_backslashes_is_kept_as_given() {
    let host = spawn_host(&["testbed"]).await;
    let key = r#"k');COMMIT;SELECT('\''"x"#;
    let first = host
        .command_with_key("testbed", "counter", json!({ "id": "q" }), key)
        .await;
    let second = host
        .command_with_key("testbed", "counter", json!({ "id": "q" }), key)
        .await;
    assert_eq!((first.status, second.status), (200, 200), "{}", first.text);
    assert_eq!(
        (first.body.clone(), second.body),
        (json!({ "n": 1 }), json!({ "n": 1 }))
    );
    assert!(second.headers.get("idempotent-replayed").is_some());
    let stored: Vec<String> = sqlx::query_scalar("SELECT key FROM obx.idempotency_key")
        .fetch_all(&host.db)
        .await
        .unwrap();
    assert_eq!(stored, vec![key.to_string()]);
    host.shutdown().await;
}

#[tokio::test]
async fn concurrent_requests_with_one_key_run_the_handler_once() {
    let host = spawn_host(&["testbed"]).await;
    let host = std::sync::Arc::new(host);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let host = host.clone();
        tasks.push(tokio::spawn(async move {
            host.command_with_key("testbed", "counter", json!({ "id": "race" }), "race-key")
                .await
                .body
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), json!({ "n": 1 }));
    }
    assert_eq!(
        host.count("SELECT n FROM testbed.counters WHERE name = 'race'").await,
        1
    );
}

/// A command whose handler fails because its statement waited past `limits.lock_timeout`
/// for a lock another session holds lost to concurrent work: it is answered 503
/// `contention` (send it again), not 500, which tells a client the handler is at fault;
/// nothing of it commits, and the same request passes once the lock is gone. A handler that
/// answers the same error with a rejection keeps its answer.
#[tokio::test]
async fn a_command_that_loses_to_a_lock_is_answered_contention() {
    let host = spawn_host_with(&["testbed"], |c| c.limits.lock_timeout = Duration::from_millis(100)).await;
    let gate = Gate::hold(&host.database_url).await;
    // `counter` fails on a SQL error; `sql` rejects with it.
    let answer = host.command("testbed", "counter", json!({ "id": "gate" })).await;
    assert_eq!(answer.status, 503, "{}", answer.text);
    assert_eq!(answer.body["error"]["code"], "contention", "{}", answer.text);
    let wait = json!({ "mode": "execute", "sql": "UPDATE counters SET n = n + 1 WHERE name = 'gate'" });
    let answer = host.command("testbed", "sql", wait).await;
    assert_eq!(
        (answer.status, &answer.body["error"]["reason"]),
        (409, &json!("timeout")),
        "{}",
        answer.text
    );
    // With an Idempotency-Key: nothing is stored for the key, and its retry runs.
    let keyed = host
        .command_with_key("testbed", "counter", json!({ "id": "gate" }), "contended-1")
        .await;
    assert_eq!(keyed.status, 503, "{}", keyed.text);
    gate.release().await;
    let keyed = host
        .command_with_key("testbed", "counter", json!({ "id": "gate" }), "contended-1")
        .await;
    assert_eq!((keyed.status, &keyed.body["n"]), (200, &json!(1)), "{}", keyed.text);
    let answer = host.command("testbed", "counter", json!({ "id": "gate" })).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert_eq!(answer.body["n"], 2, "{}", answer.text);
    host.shutdown().await;
}

/// A command whose commit waits past `limits.lock_timeout` (a deferred unique check behind
/// another transaction's insert of the same value) lost to concurrent work too: 503
/// `contention`, nothing committed; it was 503 `database_unavailable`, which blames the
/// database.
#[tokio::test]
async fn a_command_whose_commit_loses_to_a_lock_is_answered_contention() {
    use sqlx::Connection;
    let host = spawn_host_with(&["testbed"], |c| c.limits.lock_timeout = Duration::from_millis(100)).await;
    let mut other = sqlx::PgConnection::connect(&host.database_url).await.unwrap();
    for statement in ["BEGIN", "INSERT INTO testbed.deferred (id) VALUES ('taken')"] {
        sqlx::query(statement).execute(&mut other).await.unwrap();
    }
    let insert = json!({ "mode": "execute", "sql": "INSERT INTO deferred (id) VALUES ('taken')" });
    let answer = host.command("testbed", "sql", insert.clone()).await;
    assert_eq!(answer.status, 503, "{}", answer.text);
    assert_eq!(answer.body["error"]["code"], "contention", "{}", answer.text);
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    let answer = host.command("testbed", "sql", insert).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert_eq!(host.count("SELECT count(*) FROM testbed.deferred").await, 1);
    host.shutdown().await;
}

/// Sessions are not pinged before a call: when every session of a plugin has ended (a server
/// restart, an operator), the next calls still find a live one, however many were pooled.
///
/// The calls that fill the pool wait on a row lock the test holds, not on CPU: a statement
/// that burns CPU for long enough to overlap ten calls ran past the call deadline on a
/// loaded machine.
#[tokio::test]
async fn when_every_pooled_session_has_ended_the_next_commands_still_run() {
    let host = std::sync::Arc::new(spawn_host(&["testbed"]).await);
    let gate = Gate::hold(&host.database_url).await;
    let wait = json!({
        "id": "s", "mode": "execute",
        "sql": "UPDATE counters SET n = n + 1 WHERE name = 'gate'",
    });
    let busy: Vec<_> = (0..10)
        .map(|_| {
            let (host, wait) = (host.clone(), wait.clone());
            tokio::spawn(async move { host.command("testbed", "sql", wait).await })
        })
        .collect();
    let role = host.plugin_role("testbed").await;
    let waiting =
        format!("SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}' AND wait_event_type = 'Lock'");
    // Released within the plugin role's lock_timeout (1 s): as soon as five calls wait.
    let started = std::time::Instant::now();
    while host.count(&waiting).await < 5 && started.elapsed() < Duration::from_millis(600) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gate.release().await;
    for task in busy {
        let answer = task.await.unwrap();
        assert_eq!(answer.status, 200, "{}", answer.text);
    }
    assert_eq!(
        host.count("SELECT n FROM testbed.counters WHERE name = 'gate'").await,
        10
    );
    let pooled = format!("SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}'");
    assert!(host.count(&pooled).await >= 5, "the calls ran on several sessions");
    let ended = host
        .count(&format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = '{role}'"
        ))
        .await;
    assert!(ended >= 5, "{ended} sessions ended");
    for i in 0..3 {
        let answer = host
            .command("testbed", "ok", json!({ "id": format!("after-{i}") }))
            .await;
        assert_eq!(answer.status, 200, "{}", answer.text);
    }
}

#[tokio::test]
async fn http_errors_have_stable_codes() {
    let host = spawn_host(&["testbed"]).await;
    let json_ct = [("content-type", "application/json")];

    let a = host.command("nope", "x", json!({})).await;
    assert_eq!((a.status, a.code()), (404, "unknown_plugin"));
    let a = host.command("testbed", "nope", json!({})).await;
    assert_eq!((a.status, a.code()), (404, "unknown_command"));
    let a = host.request("testbed", "ok", b"{not json".to_vec(), &json_ct).await;
    assert_eq!((a.status, a.code()), (400, "invalid_json"));
    let a = host.request("testbed", "ok", Vec::new(), &json_ct).await;
    assert_eq!((a.status, a.code()), (400, "invalid_json"));
    // JSON's grammar allows these; Postgres's jsonb, and serde_json, do not.
    for body in [r#"{"a":"\ud800"}"#, r#"{"n":1e999999}"#, r#"{"a":"\u0000"}"#] {
        let a = host.request("testbed", "ok", body.as_bytes().to_vec(), &json_ct).await;
        assert_eq!((a.status, a.code()), (400, "invalid_json"), "{body}");
    }
    let a = host
        .request("testbed", "ok", b"{}".to_vec(), &[("content-type", "text/plain")])
        .await;
    assert_eq!((a.status, a.code()), (415, "unsupported_media_type"));
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2 * 1024 * 1024));
    let a = host.request("testbed", "ok", big.into_bytes(), &json_ct).await;
    assert_eq!((a.status, a.code()), (413, "payload_too_large"));
    let long_key = "k".repeat(300);
    let a = host
        .command_with_key("testbed", "ok", json!({ "id": "k" }), &long_key)
        .await;
    assert_eq!((a.status, a.code()), (400, "invalid_idempotency_key"));
    // A key a proxy could fold or trim, or two keys of which one would be taken: refused,
    // and nothing ran.
    let body = json!({ "id": "two-keys" }).to_string().into_bytes();
    let outbox = "SELECT count(*) FROM obx.outbox_event";
    let before = host.count(outbox).await;
    for keys in [
        &[("idempotency-key", "a b")][..],
        &[("idempotency-key", "a\tb")],
        &[("idempotency-key", "k-1"), ("idempotency-key", "k-2")],
    ] {
        let mut headers = json_ct.to_vec();
        headers.extend_from_slice(keys);
        let a = host.request("testbed", "emit", body.clone(), &headers).await;
        assert_eq!((a.status, a.code()), (400, "invalid_idempotency_key"), "{keys:?}");
    }
    assert_eq!(host.count(outbox).await, before);
    let a = host.command("testbed", "respond", json!({ "body": "not json" })).await;
    assert_eq!((a.status, a.code()), (500, "invalid_response"));
    let a = host.get("/v1/nothing-here").await;
    assert_eq!((a.status, a.code()), (404, "not_found"));

    // A failed statement's database text stays in the log.
    let a = host.command("testbed", "sql_then_ok", json!({ "id": "z" })).await;
    assert!(!a.text.to_lowercase().contains("division by zero"), "{}", a.text);

    let health = host.get("/healthz").await;
    assert_eq!(health.status, 200);
    let ready = host.get("/readyz").await;
    assert_eq!(ready.status, 200);
    host.shutdown().await;
}

#[tokio::test]
async fn plugins_are_listed_with_their_manifest() {
    let host = spawn_host(&["orders", "testbed"]).await;
    let a = host.get("/v1/plugins").await;
    assert_eq!(a.status, 200);
    let plugins = a.body["plugins"].as_array().unwrap();
    let orders = plugins.iter().find(|p| p["name"] == "orders").expect("orders listed");
    assert_eq!(orders["state"], "active");
    assert_eq!(orders["version"], "0.1.0");
    assert_eq!(orders["commands"], json!(["CreateOrder", "GetOrder"]));
    assert_eq!(orders["sha256"].as_str().unwrap().len(), 64);
    host.shutdown().await;
}

#[tokio::test]
async fn plugin_migrations_are_recorded_and_a_changed_one_is_refused() {
    let host = spawn_host(&["orders"]).await;
    let recorded = host
        .count("SELECT count(*) FROM obx.plugin_migration WHERE plugin = 'orders' AND id = 1")
        .await;
    assert_eq!(recorded, 1);
    // Pretend the applied migration had other text than the plugin's: as when a new build
    // edits an applied migration. The next host to load it must refuse the plugin.
    sqlx::query("UPDATE obx.plugin_migration SET checksum = '\\x00' WHERE plugin = 'orders'")
        .execute(&host.db)
        .await
        .unwrap();
    let url = host.database_url.clone();
    host.shutdown().await;
    let next = obx_tests::spawn_host_on(&url, &["orders"], |_| {}).await;
    let a = next
        .command("orders", "CreateOrder", json!({ "customerId": "c", "amount": 3 }))
        .await;
    assert_eq!(a.code(), "unknown_plugin", "the plugin must not be active");
    let plugins = next.get("/v1/plugins").await.body;
    let error = plugins["plugins"][0]["last_error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("migration 1 (orders) was changed"), "{plugins}");
    assert_eq!(plugins["plugins"][0]["state"], "failed");
    next.shutdown().await;
}

/// An event whose payload Postgres's jsonb cannot store (`\u0000`) is refused at the emit,
/// with the reason, rather than failing the commit as a database error; nothing of the call
/// is committed.
#[tokio::test]
async fn an_event_payload_with_a_nul_escape_is_refused_at_the_emit_with_the_reason() {
    let host = spawn_host(&["testbed"]).await;
    let answer = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "nul", "payload_text": r#"{"s": "a\u0000b"}"# }),
        )
        .await;
    // The guest's emit got the reason (`outbox::tests::refuses_bad_fields`); the caller gets
    // the failed call, as for any refused emit, and not a database error at the commit.
    assert_eq!(
        (answer.status, answer.code()),
        (500, "transaction_aborted"),
        "{}",
        answer.text
    );
    assert_eq!(host.count("SELECT count(*) FROM obx.outbox_event").await, 0);
    host.shutdown().await;
}

/// A guest that emits a million events (ignoring every refusal past the limit), or returns
/// a response of megabytes, or grows its memory without end: each gets a clear error,
/// nothing it did is committed, and the next call is served.
#[tokio::test]
async fn hostile_guests_get_a_clear_error_and_the_host_keeps_serving() {
    let host = spawn_host(&["testbed"]).await;
    let flood = host
        .command(
            "testbed",
            "emit",
            json!({ "id": "flood", "count": 1_000_000, "ignore_errors": true }),
        )
        .await;
    // Refused past limits.max_emits_per_call; a slow debug build may reach the deadline
    // before the guest gives up. Either way nothing is committed.
    assert!(
        matches!(
            (flood.status, flood.code()),
            (500, "transaction_aborted") | (504, "deadline_exceeded")
        ),
        "{}",
        flood.text
    );
    let flooded = host
        .count("SELECT count(*) FROM obx.outbox_event WHERE aggregate_id LIKE 'flood-%'")
        .await;
    assert_eq!(flooded, 0);

    let cases = [
        // Over limits.max_payload_bytes (1 MiB).
        (json!({ "id": "big", "bytes": 4 << 20 }), 500, "invalid_response"),
        // Over the 64 MiB memory cap of the test host: the guest's allocation fails.
        (json!({ "id": "bigger", "bytes": 200 << 20 }), 500, "memory_limit"),
    ];
    for (payload, status, code) in cases {
        let answer = host.command("testbed", "huge", payload.clone()).await;
        assert_eq!(
            (answer.status, answer.code()),
            (status, code),
            "{payload}: {}",
            answer.text
        );
        assert!(answer.text.len() < 1024, "the error body carries the response");
    }
    let ok = host.command("testbed", "ok", json!({ "id": "after-hostile" })).await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    host.shutdown().await;
}

/// A command whose commit is refused for what its handler left (a deferred constraint, or
/// a deferred trigger's own error) gets 500 `transaction_aborted`, as a refused emit does,
/// with the database's text kept in the log: the same command would be refused again. It
/// was 503 `database_unavailable`, which tells a client to retry.
#[tokio::test]
async fn a_command_whose_commit_is_refused_is_answered_500_not_503() {
    let host = spawn_host(&["testbed"]).await;
    host.make_deferred_raise().await;
    for sql in [
        "INSERT INTO deferred (id) VALUES ('twice'), ('twice')",
        "INSERT INTO deferred_raise (id) VALUES ('refused')",
    ] {
        let a = host
            .command("testbed", "sql", json!({ "sql": sql, "mode": "execute" }))
            .await;
        assert_eq!((a.status, a.code()), (500, "transaction_aborted"), "{sql}: {}", a.text);
        assert!(
            !a.text.contains("refuses"),
            "the database's text reached the client: {}",
            a.text
        );
    }
    assert_eq!(host.count("SELECT count(*) FROM testbed.deferred").await, 0);
    let ok = host.command("testbed", "ok", json!({ "id": "after" })).await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    host.shutdown().await;
}

/// Makes, on the testbed plugin's session (as a plugin past the SQL policy could), the table
/// `slow_commit` whose deferred trigger sleeps at commit for its row's `seconds`.
async fn make_slow_commit(host: &TestHost) {
    let mut session = host.plugin_session("testbed").await;
    sqlx::raw_sql(
        "CREATE TABLE slow_commit (id text, seconds float8); \
         CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN PERFORM pg_sleep(NEW.seconds); RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow_commit \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()",
    )
    .execute(&mut session)
    .await
    .unwrap();
}

/// The testbed `sql` command whose commit takes `seconds` (see [`make_slow_commit`]).
fn slow_commit(id: &str, seconds: f64) -> serde_json::Value {
    json!({ "mode": "execute", "sql": format!("INSERT INTO slow_commit (id, seconds) VALUES ('{id}', {seconds})") })
}

/// A client that goes away while its command commits does not undo the commit: once the
/// `COMMIT` is sent, it runs to its end (here plugin code holds it 3 s, and the client closes
/// its connection once it runs). hyper drops the request's work when its client goes; that
/// ended the session's backend in the middle of the `COMMIT`, which rolled the command back.
#[tokio::test]
async fn a_command_whose_client_goes_away_during_its_commit_commits() {
    use tokio::io::AsyncWriteExt;
    let host = spawn_host_with(&["testbed"], |c| c.limits.statement_timeout = Duration::from_secs(10)).await;
    make_slow_commit(&host).await;
    let body = slow_commit("gone", 3.0).to_string();
    let mut peer = tokio::net::TcpStream::connect(host.host.addr).await.unwrap();
    let request = format!(
        "POST /v1/commands/testbed/sql HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    peer.write_all(request.as_bytes()).await.unwrap();
    // The commit's deferred trigger sleeps: the `COMMIT` was sent.
    let role = host.plugin_role("testbed").await;
    eventually(Duration::from_secs(10), "the commit runs", || async {
        host.count(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}' AND wait_event = 'PgSleep'"
        ))
        .await
            == 1
    })
    .await;
    drop(peer);
    eventually(Duration::from_secs(10), "the command committed", || async {
        host.count("SELECT count(*) FROM testbed.slow_commit WHERE id = 'gone'")
            .await
            == 1
    })
    .await;
    host.shutdown().await;
}

/// A request whose `Idempotency-Key` another request still holds (that one's commit takes
/// 3 s; the claim waits the role's 1 s lock timeout) is answered 409
/// `idempotency_key_in_use`: the key's owner is running, and the database is fine. It was 503
/// `database_unavailable`. The owner then commits, and a retry replays its answer.
#[tokio::test]
async fn a_request_whose_key_another_still_holds_is_answered_409_in_use() {
    let host = spawn_host_with(&["testbed"], |c| c.limits.statement_timeout = Duration::from_secs(10)).await;
    make_slow_commit(&host).await;
    let first = host.command_with_key("testbed", "sql", slow_commit("held", 3.0), "k-held");
    let second = async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        host.command_with_key("testbed", "sql", slow_commit("held", 3.0), "k-held")
            .await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.status, 200, "{}", first.text);
    assert_eq!(
        (second.status, second.code()),
        (409, "idempotency_key_in_use"),
        "{}",
        second.text
    );
    let retry = host
        .command_with_key("testbed", "sql", slow_commit("held", 3.0), "k-held")
        .await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert_eq!(
        retry.headers.get("idempotent-replayed").map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(host.count("SELECT count(*) FROM testbed.slow_commit").await, 1);
    host.shutdown().await;
}

/// A command whose `COMMIT` is still running when `http.request_timeout` passes (a deferred
/// trigger makes it take 4 s; the timeout is 3 s) is answered with its outcome. It was 503
/// `timeout` while Postgres went on to commit it, and a client told 503 runs the command
/// again. A commit that outlasts a second timeout (8 s against 6) is answered 504
/// `outcome_unknown`. (A second of margin each way was too little on a loaded machine.)
#[tokio::test]
async fn a_command_still_committing_at_the_request_timeout_is_answered_with_its_outcome() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.http.request_timeout = Duration::from_secs(3);
        c.limits.statement_timeout = Duration::from_secs(30);
    })
    .await;
    make_slow_commit(&host).await;
    let a = host.command("testbed", "sql", slow_commit("late", 4.0)).await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(
        host.count("SELECT count(*) FROM testbed.slow_commit WHERE id = 'late'")
            .await,
        1
    );

    let a = host.command("testbed", "sql", slow_commit("later", 8.0)).await;
    assert_eq!((a.status, a.code()), (504, "outcome_unknown"), "{}", a.text);
    host.shutdown().await;
}

/// A keyed rejection after a failed statement (the handler caught the error and rejected, its
/// transaction aborted) is stored, and a retry with the key replays it: the rollback to the
/// handler's savepoint comes first in the commit's round trip, before the check that an
/// aborted transaction refuses.
#[tokio::test]
async fn a_keyed_rejection_after_a_failed_statement_is_stored_and_replayed() {
    let host = spawn_host(&["testbed"]).await;
    let failing = json!({ "sql": "SELECT 1 / 0" });
    let first = host.command_with_key("testbed", "sql", failing.clone(), "k-div").await;
    assert_eq!(first.body["error"]["reason"], "database:22012", "{}", first.text);
    let again = host.command_with_key("testbed", "sql", failing, "k-div").await;
    assert_eq!((again.status, again.text.as_str()), (first.status, first.text.as_str()));
    assert_eq!(
        again.headers.get("idempotent-replayed").unwrap(),
        "true",
        "{}",
        again.text
    );
    host.shutdown().await;
}

/// A keyed rejection whose answer is still being committed at `http.request_timeout` (a
/// trigger makes storing it take 4 s; the timeout is 3 s, so 6 s for the outcome) is answered
/// with the rejection, and a retry replays it. It was 503 `timeout` ("send it again") while
/// the answer committed.
#[tokio::test]
async fn a_rejection_whose_answer_is_still_committing_at_the_request_timeout_is_answered() {
    let host = spawn_host_with(&["testbed"], |c| {
        c.http.request_timeout = Duration::from_secs(3);
        c.limits.statement_timeout = Duration::from_secs(30);
    })
    .await;
    sqlx::raw_sql(
        "CREATE FUNCTION public.slow_answer() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(4); RETURN NEW; END $$; \
         CREATE TRIGGER slow_answer BEFORE UPDATE ON obx.idempotency_key \
         FOR EACH ROW EXECUTE FUNCTION public.slow_answer()",
    )
    .execute(&host.db)
    .await
    .unwrap();
    let a = host
        .command_with_key("testbed", "reject", json!({ "id": "slow-reject" }), "k-slow-reject")
        .await;
    assert_eq!(a.status, 409, "{}", a.text);
    sqlx::raw_sql("DROP TRIGGER slow_answer ON obx.idempotency_key")
        .execute(&host.db)
        .await
        .unwrap();
    let again = host
        .command_with_key("testbed", "reject", json!({ "id": "slow-reject" }), "k-slow-reject")
        .await;
    assert_eq!(again.status, 409, "{}", again.text);
    assert_eq!(
        again.headers.get("idempotent-replayed").unwrap(),
        "true",
        "{}",
        again.text
    );
    host.shutdown().await;
}

/// A command whose commit's round trip fails on the server's side (here its backend is
/// terminated while plugin code runs at the `COMMIT`) is answered 504 `outcome_unknown`: such
/// a failure may come after the `COMMIT` completed, since the statements that clear the
/// session follow it in the same message (a shutdown or a `pg_terminate_backend` right
/// then). It was 503 `database_unavailable`, which tells a client that a retry is safe.
#[tokio::test]
async fn a_command_whose_commit_fails_on_the_server_is_answered_outcome_unknown() {
    let host = spawn_host_with(&["testbed"], |c| c.limits.statement_timeout = Duration::from_secs(10)).await;
    make_slow_commit(&host).await;
    let role = host.plugin_role("testbed").await;
    let sleeping = format!("FROM pg_stat_activity WHERE usename = '{role}' AND wait_event = 'PgSleep'");
    let terminate = async {
        eventually(Duration::from_secs(10), "the commit runs its trigger", || async {
            host.count(&format!("SELECT count(*) {sleeping}")).await == 1
        })
        .await;
        host.count(&format!(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) {sleeping}) t"
        ))
        .await
    };
    let (a, terminated) = tokio::join!(host.command("testbed", "sql", slow_commit("cut", 8.0)), terminate);
    assert_eq!(terminated, 1);
    assert_eq!((a.status, a.code()), (504, "outcome_unknown"), "{}", a.text);
    // The host serves on, on a new session.
    let a = host.command("testbed", "sql", slow_commit("next", 0.0)).await;
    assert_eq!(a.status, 200, "{}", a.text);
    host.shutdown().await;
}

/// A handler's error text is the plugin's to make as long as its memory allows; the client,
/// the stored answer of an `Idempotency-Key` and the log get its first 4 KiB. An 8 MiB
/// rejection went whole into each (and a body of 1 MiB echoed back cost 1 MiB per answer).
#[tokio::test]
async fn a_handlers_error_text_is_cut_before_it_reaches_the_client_and_the_stored_answer() {
    let host = spawn_host(&["testbed"]).await;
    let a = host
        .command_with_key("testbed", "reject", json!({ "id": "long", "bytes": 8 << 20 }), "k-long")
        .await;
    assert_eq!(
        (a.status, a.code()),
        (409, "rejected"),
        "{}",
        &a.text[..200.min(a.text.len())]
    );
    assert!(a.text.len() < 16 << 10, "the answer is {} bytes", a.text.len());
    assert!(
        a.text.contains("bytes)"),
        "the cut says so: {}",
        &a.text[a.text.len().saturating_sub(100)..]
    );
    let stored = host
        .count("SELECT coalesce(max(octet_length(response)), 0)::bigint FROM obx.idempotency_key")
        .await;
    assert!(stored > 0 && stored < 16 << 10, "the stored answer is {stored} bytes");
    host.shutdown().await;
}

/// A guest can hand `sql` a list of parameters that all are the same bytes of its memory,
/// and each is copied whole: 512 parameters over one 8 MiB string would be 4 GiB for the host
/// (a longer list, any amount). The host copies at most 128 MiB for one host call; past it
/// the call traps, and the host serves on.
#[tokio::test]
async fn parameters_that_all_alias_one_string_trap_within_a_bound() {
    let host = spawn_host(&["testbed"]).await;
    reset_peak_rss();
    let before = peak_rss();
    let a = host
        .command("testbed", "aliased_params", json!({ "count": 512, "bytes": 8 << 20 }))
        .await;
    let grew = peak_rss().saturating_sub(before);
    assert_eq!((a.status, a.code()), (500, "plugin_trap"), "{}", a.text);
    assert!(grew < 512 << 20, "the host's peak memory grew by {} MiB", grew >> 20);
    // A few parameters of that size are fine.
    let a = host
        .command("testbed", "aliased_params", json!({ "count": 2, "bytes": 8 << 20 }))
        .await;
    assert_eq!(a.body, json!({ "ran": true }), "{}", a.text);
    host.shutdown().await;
}
