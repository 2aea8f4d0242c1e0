"""Schedules shipments for orders awaiting payment: an OBX plugin in Python (componentize-py).

PaymentRequested (payment.events, dedup) -> a `shipments` row and ShipmentScheduled
(shipping.events, key = the order id), in the event's transaction.
PaymentTimedOut (payment.events, dedup) -> the shipment is cancelled: the payment saga's
compensation, here. Both events have the order id as their key, so the timeout never
arrives before the request.
Command GetShipment {"orderId"} -> the shipment.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports import handler
from wit_world.imports import contract, log, outbox, sql, types

MIGRATION_1 = """
CREATE TABLE shipments (
    order_id     text        PRIMARY KEY,
    carrier      text        NOT NULL,
    status       text        NOT NULL DEFAULT 'scheduled',
    scheduled_at timestamptz NOT NULL DEFAULT now()
)
"""


# The contract of the event it emits: emit holds its payloads to it; obx catalog shows it.
SHIPMENT_SCHEDULED = {
    "title": "ShipmentScheduled",
    "description": "An order's shipment was scheduled, to go once its payment is confirmed (it is cancelled if the payment times out). Emitted by shipping on shipping.events, keyed by the order id.",
    "type": "object",
    "required": ["orderId", "carrier"],
    "properties": {
        "orderId": {"type": "string", "minLength": 1},
        "carrier": {"type": "string", "enum": ["dhl", "ups"]},
        "causationId": {"type": "string", "description": "The eventId of the PaymentRequested it answers."},
    },
}
SHIPMENT_SCHEDULED_EXAMPLE = {"orderId": "0b7e5c1a-9a8f-4c1e-8e5e-2f3b6c7d8e9f", "carrier": "dhl"}


def invalid(message: str) -> Err:
    return Err(types.HandlerError_InvalidInput(message))


def failed(message: str) -> Err:
    return Err(types.HandlerError_Failed(message))


def run_sql(statement: str, params: list):
    """Runs a query; a SQL error becomes a handler failure (the host logs it)."""
    try:
        return sql.query(statement, params)
    except Err as e:
        raise failed(f"sql: {e.value}")


def carrier_for(order_id: str) -> str:
    # A real plugin would ask a rate table; this one spreads orders over two carriers.
    return "dhl" if sum(order_id.encode()) % 2 == 0 else "ups"


class Handler(exports.Handler):
    def describe(self) -> handler.Manifest:
        contract.declare_payload(
            "shipping.events",
            "ShipmentScheduled",
            json.dumps(SHIPMENT_SCHEDULED),
            json.dumps(SHIPMENT_SCHEDULED_EXAMPLE),
        )
        return handler.Manifest(
            name="shipping",
            version="0.1.0",
            commands=["GetShipment"],
            subscriptions=[
                handler.Subscription(
                    topic="payment.events",
                    event_types=["PaymentRequested", "PaymentTimedOut"],
                    mode=handler.DeliveryMode.DEDUP,
                )
            ],
            emits=[handler.EventDeclaration(topic="shipping.events", event_type="ShipmentScheduled")],
            migrations=[handler.Migration(id=1, name="shipments", sql=MIGRATION_1)],
        )

    def handle_command(self, command: handler.Command) -> str:
        if command.name != "GetShipment":
            raise invalid(f"unknown command {command.name}")
        try:
            order_id = json.loads(command.payload)["orderId"]
        except (ValueError, KeyError, TypeError):
            raise invalid("GetShipment needs {\"orderId\": ...}")
        rows = run_sql(
            "SELECT carrier, status FROM shipments WHERE order_id = $1",
            [types.SqlValue_Text(str(order_id))],
        )
        if not rows.rows:
            raise Err(types.HandlerError_Rejected(types.Rejection("no-shipment", "no shipment for this order")))
        carrier, status = rows.rows[0]
        return json.dumps({"orderId": order_id, "carrier": carrier.value, "status": status.value})

    def handle_event(self, event: handler.Event) -> None:
        try:
            payment = json.loads(event.payload)
            order_id = str(payment["orderId"])
        except (ValueError, KeyError, TypeError):
            raise invalid(f"{event.event_type} needs an orderId")
        if event.event_type == "PaymentTimedOut":
            run_sql(
                "UPDATE shipments SET status = 'cancelled' WHERE order_id = $1 AND status = 'scheduled' "
                "RETURNING order_id",
                [types.SqlValue_Text(order_id)],
            )
            log.log(log.Level.INFO, f"shipment for order {order_id} cancelled: its payment timed out")
            return
        carrier = carrier_for(order_id)
        inserted = run_sql(
            "INSERT INTO shipments (order_id, carrier) VALUES ($1, $2) "
            "ON CONFLICT (order_id) DO NOTHING RETURNING order_id",
            [types.SqlValue_Text(order_id), types.SqlValue_Text(carrier)],
        )
        if not inserted.rows:
            return
        try:
            outbox.emit(
                outbox.Event(
                    event_id=None,
                    aggregate_type="Shipment",
                    aggregate_id=order_id,
                    event_type="ShipmentScheduled",
                    payload=json.dumps({"orderId": order_id, "carrier": carrier, "causationId": event.event_id}),
                    topic="shipping.events",
                    partition_key=order_id,
                )
            )
        except Err as e:
            raise failed(f"emit: {e.value}")
        log.log(log.Level.INFO, f"shipment scheduled for order {order_id} with {carrier}")
