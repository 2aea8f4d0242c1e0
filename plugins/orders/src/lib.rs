//! The seed's CreateOrder handler as an OBX plugin: it inserts the order and, in the same
//! transaction, emits OrderCreated through the outbox (aggregate `Order`, topic
//! `order.events`, partition key = the order id).

use obx_sdk::{
    emit, invalid, query, reject, Command, Event, Guest, HandlerError, Manifest, Migration, OutboxEvent, SqlValue,
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
        Manifest {
            name: "orders".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commands: vec!["CreateOrder".into()],
            subscriptions: vec![],
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
            other => Err(invalid(format!("unknown command {other}"))),
        }
    }

    fn handle_event(_event: Event) -> Result<(), HandlerError> {
        Ok(())
    }
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
