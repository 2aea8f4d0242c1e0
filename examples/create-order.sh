#!/usr/bin/env bash
# Sends one CreateOrder command to a running host (`cargo xtask run`), twice with the same
# Idempotency-Key, and shows that the second answer is the stored first one.
set -euo pipefail
host="${OBX_URL:-http://127.0.0.1:8080}"
key="example-$(date +%s)"
body='{"customerId": "c-1", "amount": 42.50, "items": [{"productId": "p-1", "quantity": 2}]}'
for attempt in 1 2; do
  echo "attempt $attempt:"
  curl -sS -i -X POST "$host/v1/commands/orders/CreateOrder" \
    -H 'content-type: application/json' -H "idempotency-key: $key" -d "$body" \
    | grep -iE '^(HTTP|idempotent-replayed|x-request-id)|orderId'
done
echo "plugins:"
curl -sS "$host/v1/plugins"
echo
