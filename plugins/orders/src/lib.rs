//! The seed's CreateOrder handler as an OBX plugin: it inserts the order and, in the same
//! transaction, emits OrderCreated through the outbox (aggregate `Order`, topic
//! `order.events`, partition key = the order id).
//!
//! It follows the payment saga (payment.events): PaymentConfirmed marks a pending order
//! `paid`, PaymentTimedOut marks it `cancelled`. `GetOrder` shows an order's status.

use obx_sdk::{
    emit, execute, invalid, query, reject, Command, DeliveryMode, Event, Guest, HandlerError, Manifest, Migration,
    OutboxEvent, SqlValue, Subscription,
};
use serde::{Deserialize, Serialize};

struct Orders;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateOrder {
    /// Optional: a client-chosen id makes the command naturally idempotent.
    order_id: Option<String>,
    customer_id: String,
    amount: serde_json::Number,
    #[serde(default)]
    items: Vec<Item>,
}

#[derive(Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Item {
    product_id: String,
    quantity: u32,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct OrderCreated<'a> {
    order_id: &'a str,
    customer_id: &'a str,
    amount: &'a str,
    items: &'a [Item],
}

impl Guest for Orders {
    fn describe() -> Manifest {
        obx_sdk::declare_payload(
            "order.events",
            "OrderCreated",
            include_str!("../../contracts/OrderCreated.schema.json"),
            Some(include_str!("../../contracts/OrderCreated.example.json")),
        );
        obx_sdk::declare_payload(
            "payment.events",
            "PaymentConfirmed",
            include_str!("../../contracts/PaymentConfirmed.schema.json"),
            Some(include_str!("../../contracts/PaymentConfirmed.example.json")),
        );
        obx_sdk::declare_payload(
            "payment.events",
            "PaymentTimedOut",
            include_str!("../../contracts/PaymentTimedOut.schema.json"),
            Some(include_str!("../../contracts/PaymentTimedOut.example.json")),
        );
        Manifest {
            name: "orders".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commands: vec!["CreateOrder".into(), "GetOrder".into()],
            subscriptions: vec![Subscription {
                topic: "payment.events".into(),
                event_types: vec!["PaymentConfirmed".into(), "PaymentTimedOut".into()],
                mode: DeliveryMode::Dedup,
            }],
            emits: obx_sdk::emits("order.events", &["OrderCreated"]),
            migrations: vec![Migration {
                id: 1,
                name: "orders".into(),
                sql: include_str!("../migrations/0001_orders.sql").into(),
            }],
        }
    }

    fn handle_command(command: Command) -> Result<String, HandlerError> {
        match command.name.as_str() {
            "CreateOrder" => create_order(&command.payload),
            "GetOrder" => get_order(&command.payload),
            other => Err(invalid(format!("unknown command {other}"))),
        }
    }

    /// The saga's outcome for the order: paid, or cancelled (its stock is released by
    /// inventory, on the same event). Only a pending order changes.
    fn handle_event(event: Event) -> Result<(), HandlerError> {
        let status = match event.event_type.as_str() {
            "PaymentConfirmed" => "paid",
            "PaymentTimedOut" => "cancelled",
            _ => return Ok(()),
        };
        let p: serde_json::Value = serde_json::from_str(&event.payload).map_err(|e| invalid(e.to_string()))?;
        let id = p["orderId"].as_str().ok_or_else(|| invalid("no orderId"))?;
        if uuid_shaped(id) {
            execute(
                "UPDATE orders SET status = $2 WHERE id = $1 AND status = 'pending'",
                &[SqlValue::Uuid(id.into()), SqlValue::Text(status.into())],
            )?;
        }
        Ok(())
    }
}

fn get_order(payload: &str) -> Result<String, HandlerError> {
    let p: serde_json::Value = serde_json::from_str(payload).map_err(|e| invalid(e.to_string()))?;
    let id = p["orderId"].as_str().filter(|id| uuid_shaped(id));
    let id = id.ok_or_else(|| invalid("orderId is an order's UUID"))?;
    let rows = query(
        "SELECT status, amount FROM orders WHERE id = $1",
        &[SqlValue::Uuid(id.into())],
    )?;
    let status = rows.value(0, "status").and_then(SqlValue::as_str);
    let amount = rows.value(0, "amount").and_then(SqlValue::as_str);
    Ok(serde_json::json!({ "orderId": id, "status": status, "amount": amount }).to_string())
}

/// Whether `id` has the shape of a UUID (the `orders.id` type); anything else names no order.
fn uuid_shaped(id: &str) -> bool {
    id.len() == 36
        && id.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

fn create_order(payload: &str) -> Result<String, HandlerError> {
    let cmd: CreateOrder = serde_json::from_str(payload).map_err(|e| invalid(format!("CreateOrder: {e}")))?;
    if cmd.customer_id.trim().is_empty() {
        return Err(invalid("customerId must not be empty"));
    }
    let amount = cmd.amount.to_string();
    if !cmd.amount.as_f64().is_some_and(|a| a > 0.0 && a < 1e10) {
        return Err(invalid("amount must be a positive number below 10^10"));
    }
    if cmd.items.iter().any(|i| i.quantity == 0 || i.product_id.is_empty()) {
        return Err(invalid("each item needs a productId and a quantity of at least 1"));
    }
    let order_id = match &cmd.order_id {
        Some(id) => SqlValue::Uuid(id.clone()),
        None => SqlValue::Null,
    };
    let items = serde_json::to_string(&cmd.items).expect("items serialise");
    let rows = query(
        "INSERT INTO orders (id, customer_id, amount, status, items) \
         VALUES (COALESCE($1, gen_random_uuid()), $2, $3, 'pending', $4) \
         ON CONFLICT (id) DO NOTHING \
         RETURNING id",
        &[
            order_id,
            SqlValue::Text(cmd.customer_id.clone()),
            SqlValue::Numeric(amount.clone()),
            SqlValue::Json(items),
        ],
    )?;
    let Some(id) = rows.value(0, "id").and_then(SqlValue::as_str).map(str::to_string) else {
        return Err(reject("order-exists", "an order with this id already exists"));
    };

    let event = OrderCreated {
        order_id: &id,
        customer_id: &cmd.customer_id,
        amount: &amount,
        items: &cmd.items,
    };
    emit(&OutboxEvent {
        event_id: None,
        aggregate_type: "Order".into(),
        aggregate_id: id.clone(),
        event_type: "OrderCreated".into(),
        payload: serde_json::to_string(&event).expect("event serialises"),
        topic: "order.events".into(),
        partition_key: Some(id.clone()),
    })?;
    Ok(serde_json::json!({ "orderId": id, "status": "pending" }).to_string())
}

obx_sdk::export_plugin!(Orders);
