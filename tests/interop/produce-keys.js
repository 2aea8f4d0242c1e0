// Sends one message for each of the keys PREFIX0 … PREFIX{N-1} with a kafkajs producer and
// its default partitioner (murmur2, as Kafka's Java client computes it), as a service that
// follows the seed sends its events. Each message carries the header `source: kafkajs`.
// Usage: node produce-keys.js BROKERS TOPIC PREFIX N
const { Kafka, logLevel } = require('kafkajs');

async function main() {
  const [brokers, topic, prefix, n] = process.argv.slice(2);
  const kafka = new Kafka({ clientId: 'seed-service', brokers: brokers.split(','), logLevel: logLevel.WARN });
  const producer = kafka.producer({ idempotent: process.env.IDEMPOTENT === '1' });
  await producer.connect();
  const messages = [];
  for (let i = 0; i < Number(n); i++) {
    messages.push({ key: `${prefix}${i}`, value: JSON.stringify({ i }), headers: { source: 'kafkajs' } });
  }
  await producer.send({ topic, messages });
  await producer.disconnect();
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
