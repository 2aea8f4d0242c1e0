-- The host's own schema. Plugins never get any privilege on it: their roles can reach
-- these tables only through the host (the outbox import, the consumers, the relay).
CREATE SCHEMA IF NOT EXISTS obx;
REVOKE ALL ON SCHEMA obx FROM PUBLIC;

-- The transactional outbox (R-DIST-OBX-1). The columns up to published_at are exactly
-- the seed's; plugin_name and plugin_version record which plugin emitted the row, and
-- traceparent the W3C trace context of the command or event that emitted it.
-- Rows stay after publishing, for audit and replay (R-DIST-OBX-3); the retention job
-- deletes published rows once they are old enough.
CREATE TABLE obx.outbox_event (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid        NOT NULL UNIQUE,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    topic           text        NOT NULL,
    partition_key   text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    plugin_name     text        NOT NULL,
    plugin_version  text        NOT NULL,
    traceparent     text
);
-- The relay scans only unpublished rows; a published row leaves this index.
CREATE INDEX ix_outbox_event_unpublished ON obx.outbox_event(id) WHERE published_at IS NULL;
-- Retention deletes by age; rows arrive in time order, so a BRIN index is tiny and enough.
CREATE INDEX ix_outbox_event_created_at ON obx.outbox_event USING brin (created_at);

-- The relay shard of a partition key. Each shard is leased by one relay at a time, and all
-- events of a key fall in one shard: that is what keeps a key's events in commit order with
-- any number of relays. The count (64) is fixed: every host must agree on it.
CREATE FUNCTION obx.outbox_shard(partition_key text) RETURNS integer
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT (((hashtextextended(partition_key, 0) % 64) + 64) % 64)::integer $$;

-- Rows the broker refused, waiting for their next attempt. While a row waits here, the
-- later rows of its partition key wait too, so the key's order holds. Empty when all is well.
CREATE TABLE obx.outbox_delivery_failure (
    outbox_id       bigint      PRIMARY KEY REFERENCES obx.outbox_event(id) ON DELETE CASCADE,
    partition_key   text        NOT NULL,
    attempts        integer     NOT NULL,
    last_error      text        NOT NULL,
    next_attempt_at timestamptz NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_outbox_delivery_failure_key ON obx.outbox_delivery_failure(partition_key, outbox_id);

-- Inbox (R-DIST-OBX-2): events stored on receipt for subscriptions in inbox mode, then
-- processed from here, each in its own transaction. The columns up to processed_at are the
-- seed's; consumer is part of the key so that two plugins can take the same event. The rest
-- is OBX's: arrival order (seq), what the handler needs, and the retry state. Events of a
-- dedup-mode subscription land here too when their key is parked behind a dead letter, so
-- that they wait their turn in order.
CREATE TABLE obx.inbox_event (
    consumer        text        NOT NULL,
    event_id        uuid        NOT NULL,
    topic           text        NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    payload         jsonb       NOT NULL,
    processed       boolean     NOT NULL DEFAULT false,
    processed_at    timestamptz,
    seq             bigint      GENERATED ALWAYS AS IDENTITY,
    event_type      text        NOT NULL,
    partition_key   text,
    headers         jsonb       NOT NULL DEFAULT '{}',
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz,
    last_error      text,
    parked          boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX ix_inbox_event_unprocessed ON obx.inbox_event(received_at) WHERE NOT processed;
CREATE INDEX ix_inbox_event_queue ON obx.inbox_event(consumer, seq) WHERE NOT processed;
CREATE INDEX ix_inbox_event_key ON obx.inbox_event(consumer, topic, partition_key, seq) WHERE NOT processed;
CREATE INDEX ix_inbox_event_processed_at ON obx.inbox_event USING brin (processed_at);

-- Events whose handler kept failing. The event stays in inbox_event, parked, and so do the
-- later events of its key: its key is parked until someone retries or discards it.
CREATE TABLE obx.dead_letter (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer      text        NOT NULL,
    event_id      uuid        NOT NULL,
    topic         text        NOT NULL,
    partition_key text,
    event_type    text        NOT NULL,
    error         text        NOT NULL,
    attempts      integer     NOT NULL,
    status        text        NOT NULL DEFAULT 'parked' CHECK (status IN ('parked', 'retried', 'discarded')),
    parked_at     timestamptz NOT NULL DEFAULT now(),
    resolved_at   timestamptz,
    FOREIGN KEY (consumer, event_id) REFERENCES obx.inbox_event(consumer, event_id) ON DELETE CASCADE
);
CREATE INDEX ix_dead_letter_parked ON obx.dead_letter(consumer, id) WHERE status = 'parked';

-- Messages that are not events OBX can hand to a handler (no eventId header, a value that is
-- not JSON, a key that is not UTF-8, too large): kept with the reason, never retried.
CREATE TABLE obx.quarantine (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer        text        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    key             bytea,
    value           bytea,
    headers         jsonb       NOT NULL,
    reason          text        NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer, topic, kafka_partition, kafka_offset)
);

-- Dedup (the default delivery mode): one row per event a consumer has taken effect on,
-- written in the same transaction as the handler's own writes.
CREATE TABLE obx.processed_event (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX ix_processed_event_processed_at ON obx.processed_event(processed_at);

-- The plugin registry: each plugin owns one schema and one role.
CREATE TABLE obx.plugin (
    name        text        PRIMARY KEY,
    schema_name text        NOT NULL UNIQUE,
    role_name   text        NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Migrations applied to a plugin's schema. An applied migration's checksum must never change.
CREATE TABLE obx.plugin_migration (
    plugin         text        NOT NULL REFERENCES obx.plugin(name),
    id             integer     NOT NULL,
    name           text        NOT NULL,
    checksum       bytea       NOT NULL,
    plugin_version text        NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (plugin, id)
);

-- Idempotency-Key records for commands: written in the command's own transaction, so a
-- stored response exists exactly when the command's effects were committed.
CREATE TABLE obx.idempotency_key (
    plugin       text        NOT NULL,
    key          text        NOT NULL,
    request_hash bytea       NOT NULL,
    status       smallint,
    response     bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (plugin, key)
);
CREATE INDEX ix_idempotency_key_created_at ON obx.idempotency_key(created_at);
