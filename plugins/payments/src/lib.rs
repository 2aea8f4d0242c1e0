//! Requests payment for reserved orders, and holds each order to a payment deadline: the
//! example chain's saga. Payments are a critical flow, so this plugin takes its events in
//! `inbox` mode: each ProductReserved is stored in the inbox on receipt, and processed from
//! there in its own transaction.
//!
//! * ProductReserved (inventory.events) → a `payments` row, PaymentRequested
//!   (payment.events), and a durable timer `payment-deadline` for the order, all in one
//!   transaction.
//! * `ConfirmPayment`, before the deadline, cancels it and emits PaymentConfirmed. After the
//!   deadline it is refused while the deadline's timer is there to time the payment out, even
//!   if it has not fired yet (it fires late when the hosts were down or the timers have a
//!   backlog; a parked one fires when an operator retries it): the payment row records its
//!   deadline. A payment whose timer an operator cancelled has no deadline left.
//! * If the deadline fires first, the payment times out and PaymentTimedOut is emitted:
//!   inventory releases the order's stock and orders cancels the order (the compensation).
//!
//! Both ends take the deadline's timer row before the payment's row (a confirmation cancels
//! the timer first; a firing holds it from the start), so a confirmation and a firing at the
//! same moment never deadlock: one waits for the other, and then sees its outcome.

use obx_sdk::{
    emit, execute, invalid, query, reject, Command, DeliveryMode, Event, Guest, HandlerError, Manifest, Migration,
    OutboxEvent, SqlValue, Subscription, Timer,
};
use serde::Deserialize;
use serde_json::json;

struct Payments;

/// The timer that holds a requested payment to its deadline, keyed by the order id.
const DEADLINE: &str = "payment-deadline";

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ProductReserved {
    order_id: String,
    customer_id: String,
    amount: String,
}

impl Guest for Payments {
    fn describe() -> Manifest {
        // What it takes in (one that breaks the contract is parked before the handler) and
        // what it sends on.
        for (topic, event, schema, example) in [
            (
                "inventory.events",
                "ProductReserved",
                include_str!("../../contracts/ProductReserved.schema.json"),
                include_str!("../../contracts/ProductReserved.example.json"),
            ),
            (
                "payment.events",
                "PaymentRequested",
                include_str!("../../contracts/PaymentRequested.schema.json"),
                include_str!("../../contracts/PaymentRequested.example.json"),
            ),
            (
                "payment.events",
                "PaymentConfirmed",
                include_str!("../../contracts/PaymentConfirmed.schema.json"),
                include_str!("../../contracts/PaymentConfirmed.example.json"),
            ),
            (
                "payment.events",
                "PaymentTimedOut",
                include_str!("../../contracts/PaymentTimedOut.schema.json"),
                include_str!("../../contracts/PaymentTimedOut.example.json"),
            ),
        ] {
            obx_sdk::declare_payload(topic, event, schema, Some(example));
        }
        Manifest {
            name: "payments".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commands: ["GetPayment", "ConfirmPayment", "SetPaymentDeadline"]
                .into_iter()
                .map(String::from)
                .collect(),
            subscriptions: vec![Subscription {
                topic: "inventory.events".into(),
                event_types: vec!["ProductReserved".into()],
                mode: DeliveryMode::Inbox,
            }],
            emits: obx_sdk::emits(
                "payment.events",
                &["PaymentRequested", "PaymentConfirmed", "PaymentTimedOut"],
            ),
            migrations: vec![
                Migration {
                    id: 1,
                    name: "payments".into(),
                    sql: include_str!("../migrations/0001_payments.sql").into(),
                },
                Migration {
                    id: 2,
                    name: "payment deadline".into(),
                    sql: include_str!("../migrations/0002_payment_deadline.sql").into(),
                },
                Migration {
                    id: 3,
                    name: "deadline on the payment".into(),
                    sql: include_str!("../migrations/0003_deadline_at.sql").into(),
                },
            ],
        }
    }

    fn handle_command(command: Command) -> Result<String, HandlerError> {
        let p: serde_json::Value = serde_json::from_str(&command.payload).map_err(|e| invalid(e.to_string()))?;
        match command.name.as_str() {
            "GetPayment" => get_payment(order_id(&p)?),
            "ConfirmPayment" => confirm_payment(order_id(&p)?),
            "SetPaymentDeadline" => {
                let ms = p["deadlineMs"]
                    .as_i64()
                    .filter(|ms| (1..=86_400_000).contains(ms))
                    .ok_or_else(|| invalid("deadlineMs is a number of milliseconds, 1 to 86400000"))?;
                execute("UPDATE settings SET payment_deadline_ms = $1", &[SqlValue::Int(ms)])?;
                Ok(json!({ "deadlineMs": ms }).to_string())
            }
            other => Err(invalid(format!("unknown command {other}"))),
        }
    }

    fn handle_event(event: Event) -> Result<(), HandlerError> {
        let reserved: ProductReserved =
            serde_json::from_str(&event.payload).map_err(|e| invalid(format!("ProductReserved: {e}")))?;
        let rows = query(
            // The deadline from now: no later than the timer's, which is counted from its
            // scheduling below.
            "INSERT INTO payments (order_id, customer_id, amount, deadline_at) \
             SELECT $1, $2, $3, clock_timestamp() + s.payment_deadline_ms * interval '1 millisecond' \
             FROM settings s \
             ON CONFLICT (order_id) DO NOTHING RETURNING (SELECT payment_deadline_ms FROM settings) AS deadline_ms",
            &[
                SqlValue::Text(reserved.order_id.clone()),
                SqlValue::Text(reserved.customer_id.clone()),
                SqlValue::Numeric(reserved.amount.clone()),
            ],
        )?;
        let Some(deadline_ms) = rows.value(0, "deadline_ms").and_then(SqlValue::as_int) else {
            return Ok(()); // requested already
        };
        let deadline = json!({ "orderId": reserved.order_id, "deadlineMs": deadline_ms }).to_string();
        obx_sdk::schedule_timer(DEADLINE, &reserved.order_id, deadline_ms as u64, &deadline)?;
        emit(&payment_event(
            &reserved.order_id,
            "PaymentRequested",
            json!({ "orderId": reserved.order_id, "amount": reserved.amount, "causationId": event.event_id }),
        ))?;
        Ok(())
    }
}

/// The deadline passed before a confirmation: the payment times out, and the saga compensates.
impl obx_sdk::TimerGuest for Payments {
    fn handle_timer(timer: Timer) -> Result<(), HandlerError> {
        if timer.name != DEADLINE {
            obx_sdk::log(obx_sdk::Level::Warn, &format!("unknown timer {}", timer.name));
            return Ok(());
        }
        let timed_out = execute(
            "UPDATE payments SET status = 'timed_out', settled_at = now() WHERE order_id = $1 AND status = 'requested'",
            &[SqlValue::Text(timer.key.clone())],
        )?;
        if timed_out == 1 {
            let payload: serde_json::Value = serde_json::from_str(&timer.payload).unwrap_or_default();
            emit(&payment_event(&timer.key, "PaymentTimedOut", payload))?;
        }
        Ok(())
    }
}

fn order_id(p: &serde_json::Value) -> Result<&str, HandlerError> {
    p["orderId"].as_str().ok_or_else(|| invalid("orderId is required"))
}

fn get_payment(id: &str) -> Result<String, HandlerError> {
    let rows = query(
        "SELECT status, amount FROM payments WHERE order_id = $1",
        &[SqlValue::Text(id.into())],
    )?;
    let status = rows.value(0, "status").and_then(SqlValue::as_str);
    let amount = rows.value(0, "amount").and_then(SqlValue::as_str);
    Ok(json!({ "orderId": id, "status": status, "amount": amount }).to_string())
}

/// Confirms a requested payment before its deadline. Confirming again answers the same; a
/// payment that timed out, or that was never requested, cannot be confirmed, nor can one
/// whose deadline passed while its timer is there: the refusal undoes the timer's
/// cancellation, and the timer, late as it may be, times the payment out.
fn confirm_payment(id: &str) -> Result<String, HandlerError> {
    // The timer row first (see the module's note on lock order).
    let timed = obx_sdk::cancel_timer(DEADLINE, id)?;
    let rows = query(
        "UPDATE payments SET status = 'confirmed', settled_at = now() \
         WHERE order_id = $1 AND status = 'requested' \
           AND (NOT $2 OR deadline_at IS NULL OR clock_timestamp() < deadline_at) \
         RETURNING amount",
        &[SqlValue::Text(id.into()), SqlValue::Boolean(timed)],
    )?;
    if let Some(amount) = rows.value(0, "amount").and_then(SqlValue::as_str) {
        emit(&payment_event(
            id,
            "PaymentConfirmed",
            json!({ "orderId": id, "amount": amount }),
        ))?;
        return Ok(json!({ "orderId": id, "status": "confirmed" }).to_string());
    }
    let rows = query(
        "SELECT status FROM payments WHERE order_id = $1",
        &[SqlValue::Text(id.into())],
    )?;
    match rows.value(0, "status").and_then(SqlValue::as_str) {
        Some("confirmed") => Ok(json!({ "orderId": id, "status": "confirmed" }).to_string()),
        Some("timed_out") => Err(reject(
            "payment-timed-out",
            "the payment deadline passed; the order was cancelled",
        )),
        Some("requested") => Err(reject(
            "payment-timed-out",
            "the payment deadline passed; the order is cancelled when its deadline timer fires",
        )),
        _ => Err(reject("no-payment", "no payment was requested for this order")),
    }
}

fn payment_event(order_id: &str, event_type: &str, payload: serde_json::Value) -> OutboxEvent {
    OutboxEvent {
        event_id: None,
        aggregate_type: "Payment".into(),
        aggregate_id: order_id.into(),
        event_type: event_type.into(),
        payload: payload.to_string(),
        topic: "payment.events".into(),
        partition_key: Some(order_id.into()),
    }
}

obx_sdk::export_plugin!(Payments, timers);
