// Sends one event the way a NestJS service following the seed does: a kafkajs producer,
// eventId and eventType headers, a JSON value, the aggregate id as the key.
// Usage: node produce.js BROKERS TOPIC KEY EVENT_ID EVENT_TYPE JSON
const { Kafka, logLevel } = require('kafkajs');

async function main() {
  const [brokers, topic, key, eventId, eventType, json] = process.argv.slice(2);
  const kafka = new Kafka({ clientId: 'seed-service', brokers: brokers.split(','), logLevel: logLevel.WARN });
  const producer = kafka.producer({ idempotent: process.env.IDEMPOTENT === '1' });
  await producer.connect();
  await producer.send({
    topic,
    messages: [{ key, value: JSON.stringify(JSON.parse(json)), headers: { eventId, eventType } }],
  });
  await producer.disconnect();
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
