//! The example chain's saga, end to end through Kafka: payments holds each reserved order to a
//! payment deadline (a durable timer). ConfirmPayment cancels it and emits PaymentConfirmed,
//! and orders marks the order paid; if the deadline fires first, PaymentTimedOut makes
//! inventory release the stock (the compensation) and orders cancel the order.

use std::collections::HashMap;
use std::time::Duration;

use obx_tests::{consume, eventually, spawn_host, Answer, TestHost};
use serde_json::{json, Value};

/// The chain's three Rust plugins, a 1.5 s payment deadline, and 100 of product p-1.
async fn chain(deadline_ms: u64) -> TestHost {
    let host = spawn_host(&["orders", "inventory", "payments"]).await;
    let a = host
        .command("payments", "SetPaymentDeadline", json!({ "deadlineMs": deadline_ms }))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    let a = host
        .command("inventory", "AddStock", json!({ "productId": "p-1", "quantity": 100 }))
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    host
}

async fn order(host: &TestHost, quantity: u32) -> String {
    let a = host
        .command(
            "orders",
            "CreateOrder",
            json!({ "customerId": "c-1", "amount": 10, "items": [{ "productId": "p-1", "quantity": quantity }] }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text);
    a.body["orderId"].as_str().unwrap().to_string()
}

/// Waits until payments has requested the payment of each of `orders`.
async fn requested<'a>(host: &TestHost, orders: impl IntoIterator<Item = &'a String>) {
    for id in orders {
        eventually(Duration::from_secs(30), "the payment requested", || async {
            payment(host, id).await == "requested"
        })
        .await;
    }
}

/// ConfirmPayment for the order `id`.
async fn confirm(host: &TestHost, id: &str) -> Answer {
    host.command("payments", "ConfirmPayment", json!({ "orderId": id }))
        .await
}

/// `a` is a confirmation refused for a deadline that passed.
fn refused_after_the_deadline(a: &Answer) {
    assert_eq!(
        (a.status, &a.body["error"]["reason"]),
        (409, &json!("payment-timed-out")),
        "{}",
        a.text
    );
}

async fn field(host: &TestHost, plugin: &str, command: &str, body: Value, name: &str) -> Value {
    let a = host.command(plugin, command, body).await;
    assert_eq!(a.status, 200, "{}", a.text);
    a.body[name].clone()
}

async fn payment(host: &TestHost, id: &str) -> Value {
    field(host, "payments", "GetPayment", json!({ "orderId": id }), "status").await
}

async fn order_status(host: &TestHost, id: &str) -> Value {
    field(host, "orders", "GetOrder", json!({ "orderId": id }), "status").await
}

async fn reserved(host: &TestHost) -> Value {
    field(host, "inventory", "GetStock", json!({ "productId": "p-1" }), "reserved").await
}

/// The event types on payment.events, per order, in the broker's order.
async fn payment_events(host: &TestHost, expected: usize) -> HashMap<String, Vec<String>> {
    let mut messages = consume(
        &host.host.brokers.bootstrap,
        &host.topic("payment.events"),
        expected,
        Duration::from_secs(20),
    )
    .await;
    messages.sort_by_key(|m| (m.partition, m.offset));
    let mut by_order: HashMap<String, Vec<String>> = HashMap::new();
    for m in &messages {
        by_order
            .entry(m.key.clone().unwrap())
            .or_default()
            .push(m.header("eventType").unwrap().to_string());
    }
    by_order
}

#[tokio::test]
async fn a_confirmed_payment_completes_the_order_and_a_missed_deadline_compensates_it() {
    let host = chain(1500).await;
    let paid = order(&host, 3).await;
    let late = order(&host, 4).await;
    requested(&host, [&paid, &late]).await;
    assert_eq!(reserved(&host).await, 7);
    assert_eq!(
        host.count("SELECT count(*) FROM obx.timer").await,
        2,
        "two deadlines pending"
    );

    // One ending: confirmed in time. Confirming again answers the same, and emits nothing.
    for _ in 0..2 {
        let a = confirm(&host, &paid).await;
        assert_eq!((a.status, &a.body["status"]), (200, &json!("confirmed")), "{}", a.text);
    }
    // The other: its deadline passes. PaymentTimedOut releases its stock and cancels it.
    eventually(Duration::from_secs(30), "the late order compensated", || async {
        order_status(&host, &late).await == "cancelled" && reserved(&host).await == 3
    })
    .await;
    assert_eq!(payment(&host, &late).await, "timed_out");
    eventually(Duration::from_secs(30), "the paid order", || async {
        order_status(&host, &paid).await == "paid"
    })
    .await;
    let a = confirm(&host, &late).await;
    refused_after_the_deadline(&a);

    // Well past both deadlines, the cancelled timer never fired.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(payment(&host, &paid).await, "confirmed");
    assert_eq!(order_status(&host, &paid).await, "paid");
    assert_eq!(host.count("SELECT count(*) FROM obx.timer").await, 0);
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0);
    let events = payment_events(&host, 4).await;
    assert_eq!(events[&paid], ["PaymentRequested", "PaymentConfirmed"], "{events:?}");
    assert_eq!(events[&late], ["PaymentRequested", "PaymentTimedOut"], "{events:?}");
    host.shutdown().await;
}

/// The deadline holds however late its timer fires (the hosts were down, the timers had a
/// backlog): a confirmation after it is refused, and leaves the payment to the timer, which
/// times it out when it fires and compensates the order. A payment whose timer an operator
/// cancelled has no deadline left, and can be confirmed.
#[tokio::test]
async fn a_confirmation_after_the_deadline_is_refused_before_its_late_timer_fires() {
    let host = chain(600_000).await;
    let late = order(&host, 2).await;
    let kept = order(&host, 3).await;
    requested(&host, [&late, &kept]).await;
    // Both deadlines pass, and no host has fired their timers yet.
    let passed = sqlx::query("UPDATE payments.payments SET deadline_at = clock_timestamp() - interval '1 second'")
        .execute(&host.db)
        .await
        .unwrap();
    assert_eq!(passed.rows_affected(), 2);
    // An operator cancels one of the two timers.
    let a = host
        .post_json(
            "/v1/timers/cancel",
            json!({ "plugin": "payments", "name": "payment-deadline", "key": kept }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text);

    let a = confirm(&host, &late).await;
    refused_after_the_deadline(&a);
    // Nothing changed: the payment waits for its timer, which is still there.
    assert_eq!(payment(&host, &late).await, "requested");
    let timer = format!("SELECT count(*) FROM obx.timer WHERE key = '{late}'");
    assert_eq!(host.count(&timer).await, 1);
    // The payment with no timer left is confirmed.
    let a = confirm(&host, &kept).await;
    assert_eq!((a.status, &a.body["status"]), (200, &json!("confirmed")), "{}", a.text);

    // The late timer fires.
    sqlx::query("UPDATE obx.timer SET due_at = now() WHERE key = $1")
        .bind(&late)
        .execute(&host.db)
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "both orders settled", || async {
        order_status(&host, &late).await == "cancelled"
            && order_status(&host, &kept).await == "paid"
            && reserved(&host).await == 3
    })
    .await;
    assert_eq!(payment(&host, &late).await, "timed_out");
    let events = payment_events(&host, 4).await;
    assert_eq!(events[&late], ["PaymentRequested", "PaymentTimedOut"], "{events:?}");
    assert_eq!(events[&kept], ["PaymentRequested", "PaymentConfirmed"], "{events:?}");
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0);
    host.shutdown().await;
}

/// Confirmations sent right at the deadline race its firing. Each order still ends one way
/// only: its confirmation's answer, the payment, the events, the order and the stock agree,
/// and no call deadlocks or fails.
#[tokio::test]
async fn a_confirmation_racing_the_deadline_ends_each_order_one_way() {
    let host = chain(1000).await;
    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(order(&host, 1).await);
    }
    requested(&host, &ids).await;
    // Confirm each around its deadline: the requests span it.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut answers = HashMap::new();
    for id in &ids {
        let a = confirm(&host, id).await;
        assert!(a.status == 200 || a.status == 409, "{} {}", a.status, a.text);
        answers.insert(id.clone(), a.status == 200);
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let confirmed = answers.values().filter(|c| **c).count() as i64;
    eventually(Duration::from_secs(30), "every order settled", || async {
        host.count("SELECT count(*) FROM obx.timer").await == 0
            && host
                .count("SELECT count(*) FROM obx.outbox_event WHERE published_at IS NULL")
                .await
                == 0
            && reserved(&host).await == json!(confirmed)
    })
    .await;
    let events = payment_events(&host, 40).await;
    for id in &ids {
        let (status, event, order) = if answers[id] {
            ("confirmed", "PaymentConfirmed", "paid")
        } else {
            ("timed_out", "PaymentTimedOut", "cancelled")
        };
        assert_eq!(payment(&host, id).await, status, "{id}");
        assert_eq!(events[id], ["PaymentRequested", event], "{id}");
        eventually(Duration::from_secs(30), "the order settled", || async {
            order_status(&host, id).await == order
        })
        .await;
    }
    assert_eq!(host.count("SELECT count(*) FROM obx.dead_letter").await, 0);
    println!("{confirmed} of 20 confirmed in time");
    host.shutdown().await;
}
