#!/usr/bin/env bash
# The payment saga's two endings, against a running host (`cargo xtask run`):
#
#   ProductReserved ─► payments: PaymentRequested + a durable timer "payment-deadline"
#     ├─ ConfirmPayment before the deadline ─► timer cancelled, PaymentConfirmed ─► orders: paid
#     └─ the deadline fires first ─► PaymentTimedOut ─► inventory releases the stock (the
#                                                        compensation), orders: cancelled
#
# The deadline is 15 minutes unless set; this script sets it to DEADLINE_MS (default 3000).
set -euo pipefail
host="${OBX_URL:-http://127.0.0.1:8080}"
deadline="${DEADLINE_MS:-3000}"
post() { curl -sS -X POST "$host/v1/commands/$1/$2" -H 'content-type: application/json' -d "$3"; }
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^\",}]*\).*/\1/p"; }
status() { post "$1" "$2" "{\"orderId\": \"$3\"}" | field status; }
wait_for() { # plugin command order-id wanted-status
  for _ in $(seq 1 150); do
    [ "$(status "$1" "$2" "$3")" = "$4" ] && return 0
    sleep 0.2
  done
  echo "   (still not $4 after 30 s)"; return 1
}

echo "1. a payment deadline of $deadline ms, and stock:"
post payments SetPaymentDeadline "{\"deadlineMs\": $deadline}"; echo
post inventory AddStock '{"productId": "p-saga", "quantity": 10}'; echo

order() { post orders CreateOrder "{\"customerId\": \"c-1\", \"amount\": 10, \"items\": [{\"productId\": \"p-saga\", \"quantity\": $1}]}" | field orderId; }
paid=$(order 2)
late=$(order 3)
echo "2. two orders: $paid (2 of p-saga) and $late (3 of p-saga)"
wait_for payments GetPayment "$paid" requested
wait_for payments GetPayment "$late" requested
echo "   payments requested; reserved: $(post inventory GetStock '{"productId": "p-saga"}')"

echo "3. confirm the first payment in time:"
post payments ConfirmPayment "{\"orderId\": \"$paid\"}"; echo
wait_for orders GetOrder "$paid" paid
echo "   order $paid: $(status orders GetOrder "$paid")"

echo "4. let the second one's deadline pass:"
wait_for orders GetOrder "$late" cancelled
echo "   payment $late: $(status payments GetPayment "$late")"
echo "   order $late:   $(status orders GetOrder "$late")"
echo "   stock after the compensation: $(post inventory GetStock '{"productId": "p-saga"}')"
echo "   confirming it now is refused:"
post payments ConfirmPayment "{\"orderId\": \"$late\"}"; echo
