//! Plugins in three languages in one host: Rust (orders, inventory, payments), Python
//! (shipping, componentize-py) and JavaScript (notifications, ComponentizeJS), in one chain
//! of events; and the conformance check, passed by every example and failed, with the rule
//! named, by components that break each rule.

use std::time::Duration;

use obx_tests::{admin_url, eventually, plugin, spawn_host};
use serde_json::json;

/// The payment saga's compensation reaches the Python plugin: an order whose payment deadline
/// passes has its shipment cancelled, as inventory releases its stock and orders cancels it.
#[tokio::test]
async fn a_timed_out_payment_cancels_the_shipment_in_python() {
    let host = spawn_host(&["orders", "inventory", "payments", "shipping", "notifications"]).await;
    for (plugin, command, body) in [
        ("payments", "SetPaymentDeadline", json!({ "deadlineMs": 1000 })),
        ("inventory", "AddStock", json!({ "productId": "p-8", "quantity": 5 })),
    ] {
        let a = host.command(plugin, command, body).await;
        assert_eq!(a.status, 200, "{}", a.text);
    }
    let order = host
        .command(
            "orders",
            "CreateOrder",
            json!({ "customerId": "c-8", "amount": 5, "items": [{ "productId": "p-8", "quantity": 2 }] }),
        )
        .await;
    assert_eq!(order.status, 200, "{}", order.text);
    let id = order.body["orderId"].as_str().unwrap().to_string();
    eventually(
        Duration::from_secs(60),
        "the order compensated in every plugin",
        || async {
            let shipment = host.command("shipping", "GetShipment", json!({ "orderId": id })).await;
            let order = host.command("orders", "GetOrder", json!({ "orderId": id })).await;
            let stock = host
                .command("inventory", "GetStock", json!({ "productId": "p-8" }))
                .await;
            shipment.body["status"] == "cancelled" && order.body["status"] == "cancelled" && stock.body["reserved"] == 0
        },
    )
    .await;
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0);
    host.shutdown().await;
}

#[tokio::test]
async fn python_and_javascript_plugins_take_part_in_the_chain() {
    let host = spawn_host(&["orders", "inventory", "payments", "shipping", "notifications"]).await;
    let stock = host
        .command("inventory", "AddStock", json!({ "productId": "p-9", "quantity": 5 }))
        .await;
    assert_eq!(stock.status, 200, "{}", stock.text);
    // A command in Rust ...
    let order = host
        .command(
            "orders",
            "CreateOrder",
            json!({ "customerId": "c-9", "amount": 19.9, "items": [{ "productId": "p-9", "quantity": 1 }] }),
        )
        .await;
    assert_eq!(order.status, 200, "{}", order.text);
    let order_id = order.body["orderId"].as_str().unwrap().to_string();

    // ... whose events are handled in Rust, then in Python, then in JavaScript.
    eventually(
        Duration::from_secs(60),
        "the Python plugin scheduled the shipment",
        || async {
            host.command("shipping", "GetShipment", json!({ "orderId": order_id }))
                .await
                .body["status"]
                == "scheduled"
        },
    )
    .await;
    eventually(
        Duration::from_secs(60),
        "the JavaScript plugin notified the customer",
        || async {
            let a = host
                .command("notifications", "ListNotifications", json!({ "orderId": order_id }))
                .await;
            a.body["notifications"].as_array().is_some_and(|n| n.len() == 1)
        },
    )
    .await;
    let notifications = host
        .command("notifications", "ListNotifications", json!({ "orderId": order_id }))
        .await;
    let message = notifications.body["notifications"][0]["message"].as_str().unwrap();
    assert!(message.contains(&order_id), "{message}");

    let chain: Vec<(String, String)> =
        sqlx::query_as("SELECT event_type, plugin_name FROM obx.outbox_event ORDER BY id")
            .fetch_all(&host.db)
            .await
            .unwrap();
    let chain: Vec<(&str, &str)> = chain.iter().map(|(e, p)| (e.as_str(), p.as_str())).collect();
    assert_eq!(
        chain,
        vec![
            ("OrderCreated", "orders"),
            ("ProductReserved", "inventory"),
            ("PaymentRequested", "payments"),
            ("ShipmentScheduled", "shipping"),
            ("CustomerNotified", "notifications"),
        ]
    );
    host.shutdown().await;
}

#[tokio::test]
async fn every_language_answers_with_typed_errors() {
    let host = spawn_host(&["shipping", "notifications"]).await;
    let a = host.command("shipping", "GetShipment", json!({})).await;
    assert_eq!((a.status, a.code()), (400, "invalid_input"), "{}", a.text);
    let a = host
        .command("shipping", "GetShipment", json!({ "orderId": "nope" }))
        .await;
    assert_eq!((a.status, a.code()), (409, "rejected"), "{}", a.text);
    assert_eq!(a.body["error"]["reason"], "no-shipment");
    let a = host.command("notifications", "ListNotifications", json!({})).await;
    assert_eq!((a.status, a.code()), (400, "invalid_input"), "{}", a.text);
    let a = host
        .command("notifications", "ListNotifications", json!({ "orderId": "none" }))
        .await;
    assert_eq!(
        (a.status, &a.body),
        (200, &json!({ "orderId": "none", "notifications": [] }))
    );
    host.shutdown().await;
}

async fn conformance(component: &str) -> Vec<obx::conformance::Check> {
    let mut config = obx::config::Config::default();
    // The check creates and drops a scratch database of its own: a user that may.
    config.database.url = Some(obx::config::Secret::new(admin_url()));
    config.limits.call_deadline = Duration::from_millis(1500);
    obx::conformance::run(&plugin(component), &config).await.unwrap()
}

#[tokio::test]
async fn the_conformance_check_passes_on_every_example_plugin() {
    for component in [
        "orders",
        "inventory",
        "payments",
        "shipping",
        "notifications",
        "hotswap",
    ] {
        let checks = conformance(component).await;
        let failed: Vec<_> = checks.iter().filter(|c| !c.passed).collect();
        assert!(failed.is_empty(), "{component}: {failed:?}");
        assert!(checks.len() >= 3, "{component}: {checks:?}");
    }
}

#[tokio::test]
async fn the_conformance_check_names_each_broken_rule() {
    let failed_rule = |checks: &[obx::conformance::Check]| {
        let failed: Vec<_> = checks.iter().filter(|c| !c.passed).cloned().collect();
        assert!(!failed.is_empty(), "no rule failed: {checks:?}");
        failed
    };
    // Another world, and a manifest the host refuses.
    let f = failed_rule(&conformance("other_world").await);
    assert!(
        f[0].rule.contains("world") && f[0].detail.contains("does not fit the obx:plugin/plugin"),
        "{f:?}"
    );
    let f = failed_rule(&conformance("hotswap_bad_manifest").await);
    assert!(
        f[0].detail.contains("the manifest is invalid") && f[0].detail.contains("name"),
        "{f:?}"
    );
    // A migration that does not apply to an empty schema.
    let f = failed_rule(&conformance("hotswap_broken").await);
    assert!(
        f[0].rule.contains("migrations") && f[0].detail.contains("migration 2 (broken) failed"),
        "{f:?}"
    );
    // Commands that trap, loop, blow the memory cap or answer garbage instead of typed errors.
    let f = failed_rule(&conformance("testbed").await);
    let failing: Vec<&str> = f.iter().map(|c| c.rule.as_str()).collect();
    for command in ["trap", "loop", "oom", "recurse", "sql_then_ok", "respond"] {
        assert!(
            failing.contains(&format!("command {command} answers").as_str()),
            "{command}: {failing:?}"
        );
    }
    let detail = |name: &str| {
        f.iter()
            .find(|c| c.rule == format!("command {name} answers"))
            .unwrap()
            .detail
            .clone()
    };
    assert!(detail("trap").contains("trapped"), "{}", detail("trap"));
    assert!(detail("loop").contains("deadline"), "{}", detail("loop"));
    assert!(detail("oom").contains("memory limit"), "{}", detail("oom"));
    assert!(detail("respond").contains("not JSON"), "{}", detail("respond"));
    // And the commands that answer with typed errors pass.
    let checks = conformance("testbed").await;
    for command in ["reject", "invalid", "fail", "ok"] {
        assert!(
            checks
                .iter()
                .any(|c| c.passed && c.rule == format!("command {command} answers")),
            "{command}"
        );
    }
}
