//! Reserves stock for new orders, as the seed's ProductReserved handler does: a
//! `reserved_quantity` update that takes effect once per event, because the host runs it in
//! the same transaction as the `processed_event` dedup row (delivery mode `dedup`).
//!
//! OrderCreated (order.events) → ProductReserved, or ProductReservationFailed when stock is
//! short (inventory.events, key = the order id).
//!
//! PaymentTimedOut (payment.events) → the order's reservations are released: the saga's
//! compensation when an order's payment deadline passes.

use obx_sdk::{
    emit, execute, invalid, log, query, Command, DeliveryMode, Event, Guest, HandlerError, Level, Manifest, Migration,
    OutboxEvent, SqlValue, Subscription,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

struct Inventory;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderCreated {
    order_id: String,
    customer_id: String,
    amount: String,
    #[serde(default)]
    items: Vec<Item>,
}

#[derive(Deserialize, Serialize, Clone)]
#[serde(rename_all = "camelCase")]
struct Item {
    product_id: String,
    quantity: u32,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AddStock {
    product_id: String,
    quantity: u32,
}

impl Guest for Inventory {
    fn describe() -> Manifest {
        // The event it consumes: one that breaks the contract is parked before the handler.
        obx_sdk::declare_payload(
            "order.events",
            "OrderCreated",
            include_str!("../../contracts/OrderCreated.schema.json"),
            Some(include_str!("../../contracts/OrderCreated.example.json")),
        );
        obx_sdk::declare_payload(
            "payment.events",
            "PaymentTimedOut",
            include_str!("../../contracts/PaymentTimedOut.schema.json"),
            Some(include_str!("../../contracts/PaymentTimedOut.example.json")),
        );
        // The events it emits: `emit` holds its own payloads to these.
        obx_sdk::declare_payload(
            "inventory.events",
            "ProductReserved",
            include_str!("../../contracts/ProductReserved.schema.json"),
            Some(include_str!("../../contracts/ProductReserved.example.json")),
        );
        obx_sdk::declare_payload(
            "inventory.events",
            "ProductReservationFailed",
            include_str!("../../contracts/ProductReservationFailed.schema.json"),
            Some(include_str!("../../contracts/ProductReservationFailed.example.json")),
        );
        Manifest {
            name: "inventory".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commands: vec!["AddStock".into(), "GetStock".into()],
            subscriptions: vec![
                Subscription {
                    topic: "order.events".into(),
                    event_types: vec!["OrderCreated".into()],
                    mode: DeliveryMode::Dedup,
                },
                Subscription {
                    topic: "payment.events".into(),
                    event_types: vec!["PaymentTimedOut".into()],
                    mode: DeliveryMode::Dedup,
                },
            ],
            emits: obx_sdk::emits("inventory.events", &["ProductReserved", "ProductReservationFailed"]),
            migrations: vec![Migration {
                id: 1,
                name: "products and reservations".into(),
                sql: include_str!("../migrations/0001_stock.sql").into(),
            }],
        }
    }

    fn handle_command(command: Command) -> Result<String, HandlerError> {
        match command.name.as_str() {
            "AddStock" => {
                let c: AddStock =
                    serde_json::from_str(&command.payload).map_err(|e| invalid(format!("AddStock: {e}")))?;
                let rows = query(
                    "INSERT INTO products (id, quantity) VALUES ($1, $2) \
                     ON CONFLICT (id) DO UPDATE SET quantity = products.quantity + EXCLUDED.quantity, updated_at = now() \
                     RETURNING quantity, reserved_quantity",
                    &[SqlValue::Text(c.product_id.clone()), SqlValue::Int(c.quantity.into())],
                )?;
                Ok(stock_json(&c.product_id, &rows))
            }
            "GetStock" => {
                let p: serde_json::Value =
                    serde_json::from_str(&command.payload).map_err(|e| invalid(e.to_string()))?;
                let id = p["productId"]
                    .as_str()
                    .ok_or_else(|| invalid("productId is required"))?;
                let rows = query(
                    "SELECT quantity, reserved_quantity FROM products WHERE id = $1",
                    &[SqlValue::Text(id.into())],
                )?;
                Ok(stock_json(id, &rows))
            }
            other => Err(invalid(format!("unknown command {other}"))),
        }
    }

    fn handle_event(event: Event) -> Result<(), HandlerError> {
        if event.event_type == "PaymentTimedOut" {
            let p: serde_json::Value =
                serde_json::from_str(&event.payload).map_err(|e| invalid(format!("PaymentTimedOut: {e}")))?;
            let order_id = p["orderId"]
                .as_str()
                .ok_or_else(|| invalid("PaymentTimedOut: no orderId"))?;
            return release(order_id);
        }
        let order: OrderCreated =
            serde_json::from_str(&event.payload).map_err(|e| invalid(format!("OrderCreated: {e}")))?;
        // Product rows are locked in one order, whatever the order's item order: two
        // orders that share products never wait for each other in a cycle.
        let mut items: Vec<&Item> = order.items.iter().collect();
        items.sort_by(|a, b| a.product_id.cmp(&b.product_id));
        for item in items {
            let reserved = execute(
                "UPDATE products SET reserved_quantity = reserved_quantity + $2, updated_at = now() \
                 WHERE id = $1 AND quantity - reserved_quantity >= $2",
                &[
                    SqlValue::Text(item.product_id.clone()),
                    SqlValue::Int(item.quantity.into()),
                ],
            )?;
            if reserved == 0 {
                // Not enough stock is a business outcome, announced as an event, not an error.
                log(
                    Level::Warn,
                    &format!("order {}: not enough {}", order.order_id, item.product_id),
                );
                return reservation_failed(&order, item);
            }
            execute(
                "INSERT INTO reservations (order_id, product_id, quantity) VALUES ($1, $2, $3)",
                &[
                    SqlValue::Text(order.order_id.clone()),
                    SqlValue::Text(item.product_id.clone()),
                    SqlValue::Int(item.quantity.into()),
                ],
            )?;
        }
        emit(&OutboxEvent {
            event_id: None,
            aggregate_type: "Order".into(),
            aggregate_id: order.order_id.clone(),
            event_type: "ProductReserved".into(),
            payload: json!({
                "orderId": order.order_id,
                "customerId": order.customer_id,
                "amount": order.amount,
                "items": order.items,
                "causationId": event.event_id,
            })
            .to_string(),
            topic: "inventory.events".into(),
            partition_key: Some(order.order_id.clone()),
        })?;
        Ok(())
    }
}

/// Announces that the order could not be reserved. Reservations made for earlier items of
/// the same order are released first, so that the event's transaction leaves no partial
/// reservation behind.
fn reservation_failed(order: &OrderCreated, short: &Item) -> Result<(), HandlerError> {
    release(&order.order_id)?;
    emit(&OutboxEvent {
        event_id: None,
        aggregate_type: "Order".into(),
        aggregate_id: order.order_id.clone(),
        event_type: "ProductReservationFailed".into(),
        payload: json!({ "orderId": order.order_id, "productId": short.product_id, "reason": "insufficient-stock" })
            .to_string(),
        topic: "inventory.events".into(),
        partition_key: Some(order.order_id.clone()),
    })?;
    Ok(())
}

/// Gives the order's reserved stock back and forgets its reservations; a second release
/// finds none. The product rows are locked first, in id order, as reservations take them, so
/// a release and a reservation that share products never wait for each other in a cycle.
fn release(order_id: &str) -> Result<(), HandlerError> {
    let order = [SqlValue::Text(order_id.into())];
    query(
        "SELECT id FROM products WHERE id IN (SELECT product_id FROM reservations WHERE order_id = $1) \
         ORDER BY id FOR UPDATE",
        &order,
    )?;
    execute(
        "UPDATE products p SET reserved_quantity = p.reserved_quantity - r.quantity, updated_at = now() \
         FROM reservations r WHERE r.order_id = $1 AND r.product_id = p.id",
        &order,
    )?;
    execute("DELETE FROM reservations WHERE order_id = $1", &order)?;
    Ok(())
}

fn stock_json(id: &str, rows: &obx_sdk::RowSet) -> String {
    let get = |name| rows.value(0, name).and_then(SqlValue::as_int);
    json!({ "productId": id, "quantity": get("quantity"), "reserved": get("reserved_quantity") }).to_string()
}

obx_sdk::export_plugin!(Inventory);
