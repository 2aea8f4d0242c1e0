//! Requests payment for reserved orders. Payments are a critical flow, so this plugin takes
//! its events in `inbox` mode: each ProductReserved is stored in the inbox on receipt, and
//! processed from there in its own transaction.
//!
//! ProductReserved (inventory.events) → a `payments` row and PaymentRequested (payment.events).

use obx_sdk::{
    emit, execute, invalid, query, Command, DeliveryMode, Event, Guest, HandlerError, Manifest, Migration, OutboxEvent,
    SqlValue, Subscription,
};
use serde::Deserialize;
use serde_json::json;

struct Payments;

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
        obx_sdk::declare_payload(
            "inventory.events",
            "ProductReserved",
            include_str!("../../contracts/ProductReserved.schema.json"),
            Some(include_str!("../../contracts/ProductReserved.example.json")),
        );
        obx_sdk::declare_payload(
            "payment.events",
            "PaymentRequested",
            include_str!("../../contracts/PaymentRequested.schema.json"),
            Some(include_str!("../../contracts/PaymentRequested.example.json")),
        );
        Manifest {
            name: "payments".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commands: vec!["GetPayment".into()],
            subscriptions: vec![Subscription {
                topic: "inventory.events".into(),
                event_types: vec!["ProductReserved".into()],
                mode: DeliveryMode::Inbox,
            }],
            emits: obx_sdk::emits("payment.events", &["PaymentRequested"]),
            migrations: vec![Migration {
                id: 1,
                name: "payments".into(),
                sql: include_str!("../migrations/0001_payments.sql").into(),
            }],
        }
    }

    fn handle_command(command: Command) -> Result<String, HandlerError> {
        match command.name.as_str() {
            "GetPayment" => {
                let p: serde_json::Value =
                    serde_json::from_str(&command.payload).map_err(|e| invalid(e.to_string()))?;
                let id = p["orderId"].as_str().ok_or_else(|| invalid("orderId is required"))?;
                let rows = query(
                    "SELECT status, amount FROM payments WHERE order_id = $1",
                    &[SqlValue::Text(id.into())],
                )?;
                let status = rows.value(0, "status").and_then(SqlValue::as_str);
                let amount = rows.value(0, "amount").and_then(SqlValue::as_str);
                Ok(json!({ "orderId": id, "status": status, "amount": amount }).to_string())
            }
            other => Err(invalid(format!("unknown command {other}"))),
        }
    }

    fn handle_event(event: Event) -> Result<(), HandlerError> {
        let reserved: ProductReserved =
            serde_json::from_str(&event.payload).map_err(|e| invalid(format!("ProductReserved: {e}")))?;
        let inserted = execute(
            "INSERT INTO payments (order_id, customer_id, amount) VALUES ($1, $2, $3) ON CONFLICT (order_id) DO NOTHING",
            &[
                SqlValue::Text(reserved.order_id.clone()),
                SqlValue::Text(reserved.customer_id.clone()),
                SqlValue::Numeric(reserved.amount.clone()),
            ],
        )?;
        if inserted == 1 {
            emit(&OutboxEvent {
                event_id: None,
                aggregate_type: "Payment".into(),
                aggregate_id: reserved.order_id.clone(),
                event_type: "PaymentRequested".into(),
                payload:
                    json!({ "orderId": reserved.order_id, "amount": reserved.amount, "causationId": event.event_id })
                        .to_string(),
                topic: "payment.events".into(),
                partition_key: Some(reserved.order_id.clone()),
            })?;
        }
        Ok(())
    }
}

obx_sdk::export_plugin!(Payments);
