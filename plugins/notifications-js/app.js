// Notifies customers of scheduled shipments: an OBX plugin in JavaScript (ComponentizeJS).
//
// ShipmentScheduled (shipping.events, dedup) -> a `notifications` row and CustomerNotified
// (notification.events, key = the order id), in the event's transaction.
// Command ListNotifications {"orderId"} -> the notifications sent for the order.

import { query, execute } from 'obx:plugin/sql@0.2.1';
import { emit } from 'obx:plugin/outbox@0.2.1';
import { log } from 'obx:plugin/log@0.2.1';
import { declarePayload } from 'obx:plugin/contract@0.2.1';

// The contract of the event it emits: emit holds its payloads to it; obx catalog shows it.
const CUSTOMER_NOTIFIED = {
  title: 'CustomerNotified',
  description: 'A customer was told that their order ships. Emitted by notifications on notification.events, keyed by the order id.',
  type: 'object',
  required: ['orderId', 'channel'],
  properties: {
    orderId: { type: 'string', minLength: 1 },
    channel: { type: 'string', enum: ['email'] },
    causationId: { type: 'string', description: 'The eventId of the ShipmentScheduled it answers.' },
  },
};
const CUSTOMER_NOTIFIED_EXAMPLE = { orderId: '0b7e5c1a-9a8f-4c1e-8e5e-2f3b6c7d8e9f', channel: 'email' };

const MIGRATION_1 = `
CREATE TABLE notifications (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id   text        NOT NULL,
    channel    text        NOT NULL,
    message    text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)`;

const text = (value) => ({ tag: 'text', val: value });
const invalid = (message) => ({ tag: 'invalid-input', val: message });
const failed = (message) => ({ tag: 'failed', val: message });

// An import that returns `result` throws its error; hand it on as a handler failure.
function sql(run) {
  try {
    return run();
  } catch (e) {
    throw failed(`sql: ${JSON.stringify(e.payload ?? e)}`);
  }
}

function parse(payload, what) {
  try {
    return JSON.parse(payload);
  } catch (e) {
    throw invalid(`${what}: ${e.message}`);
  }
}

export const handler = {
  describe() {
    declarePayload(
      'notification.events',
      'CustomerNotified',
      JSON.stringify(CUSTOMER_NOTIFIED),
      JSON.stringify(CUSTOMER_NOTIFIED_EXAMPLE),
    );
    return {
      name: 'notifications',
      version: '0.1.0',
      commands: ['ListNotifications'],
      subscriptions: [{ topic: 'shipping.events', eventTypes: ['ShipmentScheduled'], mode: 'dedup' }],
      emits: [{ topic: 'notification.events', eventType: 'CustomerNotified' }],
      migrations: [{ id: 1, name: 'notifications', sql: MIGRATION_1 }],
    };
  },

  handleCommand(command) {
    if (command.name !== 'ListNotifications') {
      throw invalid(`unknown command ${command.name}`);
    }
    const { orderId } = parse(command.payload, 'ListNotifications');
    if (typeof orderId !== 'string') {
      throw invalid('ListNotifications needs {"orderId": "..."}');
    }
    const rows = sql(() =>
      query('SELECT channel, message FROM notifications WHERE order_id = $1 ORDER BY id', [text(orderId)]),
    );
    const notifications = rows.rows.map(([channel, message]) => ({ channel: channel.val, message: message.val }));
    return JSON.stringify({ orderId, notifications });
  },

  handleEvent(event) {
    const { orderId, carrier } = parse(event.payload, 'ShipmentScheduled');
    if (typeof orderId !== 'string') {
      throw invalid('ShipmentScheduled needs an orderId');
    }
    const message = `Your order ${orderId} ships with ${carrier}.`;
    sql(() =>
      execute('INSERT INTO notifications (order_id, channel, message) VALUES ($1, $2, $3)', [
        text(orderId),
        text('email'),
        text(message),
      ]),
    );
    try {
      emit({
        aggregateType: 'Notification',
        aggregateId: orderId,
        eventType: 'CustomerNotified',
        payload: JSON.stringify({ orderId, channel: 'email', causationId: event.eventId }),
        topic: 'notification.events',
        partitionKey: orderId,
      });
    } catch (e) {
      throw failed(`emit: ${JSON.stringify(e.payload ?? e)}`);
    }
    log('info', `notified the customer of order ${orderId}`);
  },
};
