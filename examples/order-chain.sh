#!/usr/bin/env bash
# The whole chain from one command, against a running host (`cargo xtask run`):
#
#   CreateOrder (orders, Rust) ─ OrderCreated ─► inventory (Rust, dedup) ─ ProductReserved ─►
#   payments (Rust, inbox) ─ PaymentRequested ─► shipping (Python) ─ ShipmentScheduled ─►
#   notifications (JavaScript)
#
# Each plugin writes its own rows and emits its next event through the outbox, in one
# transaction; the relay publishes committed events; consumers take them exactly once.
set -euo pipefail
host="${OBX_URL:-http://127.0.0.1:8080}"
post() { curl -sS -X POST "$host/v1/commands/$1/$2" -H 'content-type: application/json' -d "$3"; }

echo "1. stock p-1 in inventory:"
post inventory AddStock '{"productId": "p-1", "quantity": 10}'; echo

echo "2. create an order for 3 of p-1 (one command):"
order=$(post orders CreateOrder '{"customerId": "c-1", "amount": 42.50, "items": [{"productId": "p-1", "quantity": 3}]}')
echo "$order"
id=$(printf '%s' "$order" | sed -n 's/.*"orderId":"\([^"]*\)".*/\1/p')

echo "3. wait for the chain to reach the JavaScript plugin at its end"
for _ in $(seq 1 100); do
  notes=$(post notifications ListNotifications "{\"orderId\": \"$id\"}")
  case "$notes" in *ships*) break ;; esac
  sleep 0.2
done
echo "   inventory (Rust):           $(post inventory GetStock '{"productId": "p-1"}')"
echo "   payments (Rust, inbox):     $(post payments GetPayment "{\"orderId\": \"$id\"}")"
echo "   shipping (Python):          $(post shipping GetShipment "{\"orderId\": \"$id\"}")"
echo "   notifications (JavaScript): $notes"
