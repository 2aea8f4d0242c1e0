-- The host's own schema. Plugins never get any privilege on it: their roles can reach
-- these tables only through the host (the outbox import, the consumers, the relay).
CREATE SCHEMA IF NOT EXISTS obx;
REVOKE ALL ON SCHEMA obx FROM PUBLIC;

-- The transactional outbox (R-DIST-OBX-1). The columns up to published_at are exactly
-- the seed's; plugin_name and plugin_version record which plugin emitted the row.
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
    plugin_version  text        NOT NULL
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
-- processed from here. Keyed by consumer too, so that two plugins can take the same event.
CREATE TABLE obx.inbox_event (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    topic        text        NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    payload      jsonb       NOT NULL,
    processed    boolean     NOT NULL DEFAULT false,
    processed_at timestamptz,
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX ix_inbox_event_unprocessed ON obx.inbox_event(received_at) WHERE NOT processed;

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
