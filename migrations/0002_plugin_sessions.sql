-- Plugin sessions. Each plugin's statements run on database sessions logged in as the
-- plugin's own role, so that no statement, however it was written, can reach the host's
-- privileges: `RESET ROLE` leaves a plugin session as the plugin. What the host writes in
-- those same transactions (outbox rows, idempotency answers, processed events, inbox marks,
-- plugin migrations) goes through the SECURITY DEFINER functions of schema `obx_api`. They
-- take the plugin from `session_user`, never from an argument, and check what they are
-- given as if a hostile plugin had called them itself, which it can.

-- This installation. `id` names its plugin roles: roles are shared by every database of a
-- cluster, and two services on one cluster may both have a plugin called `orders`.
-- `lock_space` keys the relay's advisory locks, so that they are not public constants.
CREATE TABLE obx.installation (
    id         text    PRIMARY KEY CHECK (id ~ '^[0-9a-f]{8}$'),
    lock_space integer NOT NULL,
    singleton  boolean NOT NULL DEFAULT true UNIQUE CHECK (singleton)
);
INSERT INTO obx.installation (id, lock_space)
VALUES (substr(md5(gen_random_uuid()::text), 1, 8),
        ('x' || substr(md5(gen_random_uuid()::text), 1, 8))::bit(32)::integer & 2147483646);

-- The password each plugin role logs in with. Only the host can read it.
CREATE TABLE obx.plugin_credential (
    role_name text PRIMARY KEY,
    password  text NOT NULL
);

-- The limits obx_api.emit enforces, as configured on the host that last loaded the plugin.
ALTER TABLE obx.plugin
    ADD COLUMN max_emits_per_call      integer NOT NULL DEFAULT 1000,
    ADD COLUMN max_payload_bytes       integer NOT NULL DEFAULT 983040,
    ADD COLUMN max_emit_bytes_per_call bigint  NOT NULL DEFAULT 16777216;

-- The events a plugin declared in its manifests (every version ever loaded, so that hosts
-- on different versions during a rolling deploy agree). obx_api.emit refuses any other;
-- the host also checks each call against the exact version that runs it. An event type on a
-- topic belongs to one plugin: another may not declare it, and so cannot forge it.
CREATE TABLE obx.plugin_emit (
    topic       text        NOT NULL,
    event_type  text        NOT NULL,
    plugin      text        NOT NULL REFERENCES obx.plugin(name) ON DELETE CASCADE,
    declared_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, event_type)
);
CREATE INDEX ix_plugin_emit_plugin ON obx.plugin_emit(plugin);

-- Outbox rows the broker refused for good (too large, an invalid topic): set aside, so that
-- they no longer hold up their key, and counted in `obx status` and the metrics. A refused
-- row holds up its key on its own topic only (Kafka orders a key within a topic), so that one
-- plugin's refused rows cannot hold up another's under the same key.
ALTER TABLE obx.outbox_delivery_failure
    ADD COLUMN set_aside boolean NOT NULL DEFAULT false,
    ADD COLUMN topic     text;
UPDATE obx.outbox_delivery_failure f SET topic = o.topic FROM obx.outbox_event o WHERE o.id = f.outbox_id;
ALTER TABLE obx.outbox_delivery_failure ALTER COLUMN topic SET NOT NULL;
DROP INDEX obx.ix_outbox_delivery_failure_key;
CREATE INDEX ix_outbox_delivery_failure_key ON obx.outbox_delivery_failure(topic, partition_key, outbox_id);
CREATE INDEX ix_outbox_delivery_failure_set_aside ON obx.outbox_delivery_failure(outbox_id) WHERE set_aside;

-- The functions plugin sessions call. Plugin roles get USAGE on this schema and EXECUTE on
-- its functions, and nothing on schema obx.
CREATE SCHEMA obx_api;
REVOKE ALL ON SCHEMA obx_api FROM PUBLIC;
-- Functions the host creates from now on are not executable by PUBLIC (a per-schema default
-- cannot take away the global one, so this is the host role's global default).
ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;

-- The plugin whose role this session logged in as; an error for any other session.
CREATE FUNCTION obx.session_plugin() RETURNS obx.plugin
    LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin;
BEGIN
    SELECT * INTO v_plugin FROM obx.plugin p WHERE p.role_name = session_user;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session user % is not a plugin of this OBX installation', session_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN v_plugin;
END $$;

-- Writes a call's events to the outbox, in emit order, as the calling plugin. Refuses
-- anything the plugin did not declare, Kafka's own topics, and anything over its limits.
-- Every check is in the one INSERT (a row that fails one is not written); only when a row
-- was not written does a second query find out why, for the message.
CREATE FUNCTION obx_api.emit(
    p_version text, p_traceparent text, p_event_ids uuid[], p_aggregate_types text[],
    p_aggregate_ids text[], p_event_types text[], p_payloads text[], p_topics text[],
    p_partition_keys text[]
) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin  obx.plugin;
    v_count   integer := coalesce(cardinality(p_event_ids), 0);
    v_written integer;
    v_bad     text;
BEGIN
    IF v_count = 0 THEN
        RETURN 0;
    END IF;
    SELECT * INTO v_plugin FROM obx.plugin p WHERE p.role_name = session_user;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session user % is not a plugin of this OBX installation', session_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF v_count > v_plugin.max_emits_per_call THEN
        RAISE EXCEPTION 'a call may emit at most % events', v_plugin.max_emits_per_call
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF coalesce(cardinality(p_aggregate_types), -1) <> v_count
       OR coalesce(cardinality(p_aggregate_ids), -1) <> v_count
       OR coalesce(cardinality(p_event_types), -1) <> v_count
       OR coalesce(cardinality(p_payloads), -1) <> v_count
       OR coalesce(cardinality(p_topics), -1) <> v_count
       OR coalesce(cardinality(p_partition_keys), -1) <> v_count THEN
        RAISE EXCEPTION 'emit: the arrays differ in length' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_version IS NULL OR octet_length(p_version) NOT BETWEEN 1 AND 64
       OR octet_length(p_traceparent) > 128 THEN
        RAISE EXCEPTION 'emit: invalid version or trace context' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(array_to_string(p_payloads, '')) > v_plugin.max_emit_bytes_per_call THEN
        RAISE EXCEPTION 'the events of one call may hold at most % payload bytes', v_plugin.max_emit_bytes_per_call
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    INSERT INTO obx.outbox_event
        (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
         plugin_name, plugin_version, created_at, traceparent)
    SELECT e.event_id, e.aggregate_type, e.aggregate_id, e.event_type, e.payload::jsonb, e.topic,
           e.partition_key, v_plugin.name, p_version, clock_timestamp(), p_traceparent
    FROM unnest(p_event_ids, p_aggregate_types, p_aggregate_ids, p_event_types, p_payloads, p_topics,
                p_partition_keys) WITH ORDINALITY
           AS e(event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key, n)
    WHERE e.event_id IS NOT NULL
      AND octet_length(e.aggregate_type) BETWEEN 1 AND 1024
      AND octet_length(e.aggregate_id) BETWEEN 1 AND 1024
      AND octet_length(e.event_type) BETWEEN 1 AND 1024
      AND octet_length(e.partition_key) BETWEEN 1 AND 1024
      AND octet_length(e.payload) <= v_plugin.max_payload_bytes
      AND left(e.topic, 2) <> '__'
      AND EXISTS (SELECT 1 FROM obx.plugin_emit d
                  WHERE d.topic = e.topic AND d.event_type = e.event_type AND d.plugin = v_plugin.name)
    ORDER BY e.n;
    GET DIAGNOSTICS v_written = ROW_COUNT;
    IF v_written = v_count THEN
        RETURN v_count;
    END IF;
    -- Some row was not written: say which and why (the exception undoes the others).
    SELECT format('event %s: %s', e.n, CASE
        WHEN e.event_id IS NULL OR e.payload IS NULL THEN 'no event id or payload'
        WHEN octet_length(e.payload) > v_plugin.max_payload_bytes
          THEN format('the payload is %s bytes, over the limit of %s', octet_length(e.payload),
                      v_plugin.max_payload_bytes)
        WHEN coalesce(octet_length(e.aggregate_type), 0) NOT BETWEEN 1 AND 1024
          OR coalesce(octet_length(e.aggregate_id), 0) NOT BETWEEN 1 AND 1024
          OR coalesce(octet_length(e.event_type), 0) NOT BETWEEN 1 AND 1024
          OR coalesce(octet_length(e.partition_key), 0) NOT BETWEEN 1 AND 1024
          THEN 'aggregate type, aggregate id, event type and partition key must be 1-1024 bytes'
        ELSE format('%s on topic %s is not declared in the manifest', e.event_type, e.topic)
        END) INTO v_bad
    FROM unnest(p_event_ids, p_aggregate_types, p_aggregate_ids, p_event_types, p_payloads, p_topics,
                p_partition_keys) WITH ORDINALITY
           AS e(event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key, n)
    WHERE NOT (e.event_id IS NOT NULL
      AND coalesce(octet_length(e.aggregate_type) BETWEEN 1 AND 1024, false)
      AND coalesce(octet_length(e.aggregate_id) BETWEEN 1 AND 1024, false)
      AND coalesce(octet_length(e.event_type) BETWEEN 1 AND 1024, false)
      AND coalesce(octet_length(e.partition_key) BETWEEN 1 AND 1024, false)
      AND coalesce(octet_length(e.payload) <= v_plugin.max_payload_bytes, false)
      AND coalesce(left(e.topic, 2) <> '__', false)
      AND EXISTS (SELECT 1 FROM obx.plugin_emit d
                  WHERE d.topic = e.topic AND d.event_type = e.event_type AND d.plugin = v_plugin.name))
    ORDER BY e.n
    LIMIT 1;
    RAISE EXCEPTION 'emit refused: %', coalesce(v_bad, 'an event was not written')
        USING ERRCODE = 'insufficient_privilege';
END $$;

-- Claims an Idempotency-Key for the calling plugin. A concurrent request with the same key
-- waits here, on the row, until the first one commits (then it sees the answer) or rolls
-- back (then it claims the key).
CREATE FUNCTION obx_api.claim_idempotency_key(p_key text, p_request_hash bytea,
    OUT fresh boolean, OUT stored_hash bytea, OUT status smallint, OUT response bytea)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin text := (obx.session_plugin()).name;
BEGIN
    INSERT INTO obx.idempotency_key (plugin, key, request_hash)
    VALUES (v_plugin, p_key, p_request_hash)
    ON CONFLICT ON CONSTRAINT idempotency_key_pkey DO NOTHING;
    fresh := FOUND;
    IF NOT fresh THEN
        SELECT k.request_hash, k.status, k.response INTO stored_hash, status, response
        FROM obx.idempotency_key k WHERE k.plugin = v_plugin AND k.key = p_key;
    END IF;
END $$;

-- Stores the answer to a claimed Idempotency-Key of the calling plugin.
CREATE FUNCTION obx_api.store_idempotent_answer(p_key text, p_status smallint, p_response bytea)
    RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE obx.idempotency_key k SET status = p_status, response = p_response
    WHERE k.plugin = (obx.session_plugin()).name AND k.key = p_key;
END $$;

-- Dedup mode, before the handler runs: is the event's key parked behind a dead letter, and
-- if not, is the event new to the calling plugin? A new event is recorded as processed, in
-- this transaction.
CREATE FUNCTION obx_api.begin_event(p_event_id uuid, p_topic text, p_key text,
    OUT parked boolean, OUT fresh boolean)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
BEGIN
    parked := p_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM obx.inbox_event e
        WHERE e.consumer = v_consumer AND e.topic = p_topic AND e.partition_key = p_key AND NOT e.processed);
    fresh := false;
    IF NOT parked THEN
        INSERT INTO obx.processed_event (consumer, event_id) VALUES (v_consumer, p_event_id)
        ON CONFLICT ON CONSTRAINT processed_event_pkey DO NOTHING;
        fresh := FOUND;
    END IF;
END $$;

-- Inbox mode: claims the calling plugin's next event that may run (unprocessed, not parked,
-- not waiting for a retry, and the oldest unprocessed event of its key on its topic), locked
-- for the rest of the transaction. The walk must follow (consumer, seq) and stop at the first
-- event that may run; with stale statistics after a burst the planner may prefer to sort the
-- whole inbox, which the settings rule out.
CREATE FUNCTION obx_api.inbox_claim()
    RETURNS TABLE (event_id uuid, topic text, payload text, event_type text, partition_key text,
                   headers jsonb, attempts integer)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_sort = off SET enable_bitmapscan = off AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
BEGIN
    RETURN QUERY
    SELECT e.event_id, e.topic, e.payload::text, e.event_type, e.partition_key, e.headers, e.attempts
    FROM obx.inbox_event e
    WHERE e.consumer = v_consumer AND NOT e.processed AND NOT e.parked
      AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
      AND (e.partition_key IS NULL OR e.seq = (
           SELECT min(q.seq) FROM obx.inbox_event q
           WHERE q.consumer = e.consumer AND q.topic = e.topic AND q.partition_key = e.partition_key
             AND NOT q.processed))
    ORDER BY e.seq
    LIMIT 1
    FOR UPDATE OF e SKIP LOCKED;
END $$;

-- Inbox mode: marks a claimed event processed (and in processed_event, so that a dedup-mode
-- redelivery is a no-op). Returns whether it was new.
CREATE FUNCTION obx_api.inbox_take(p_event_id uuid) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_fresh    boolean;
BEGIN
    INSERT INTO obx.processed_event (consumer, event_id) VALUES (v_consumer, p_event_id)
    ON CONFLICT ON CONSTRAINT processed_event_pkey DO NOTHING;
    v_fresh := FOUND;
    UPDATE obx.inbox_event e SET processed = true, processed_at = now()
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id;
    RETURN v_fresh;
END $$;

-- Inbox mode: records a failed attempt of the calling plugin's event: a retry after a delay,
-- or parked with a dead letter (which holds its key).
CREATE FUNCTION obx_api.inbox_fail(p_event_id uuid, p_attempts integer, p_error text, p_park boolean,
    p_retry_after double precision) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_event    obx.inbox_event;
BEGIN
    UPDATE obx.inbox_event e
    SET attempts = p_attempts, last_error = left(p_error, 8192), parked = p_park,
        next_attempt_at = CASE WHEN p_park THEN e.next_attempt_at
                               ELSE now() + make_interval(secs => greatest(p_retry_after, 0)) END
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id
    RETURNING * INTO v_event;
    IF FOUND AND p_park THEN
        INSERT INTO obx.dead_letter (consumer, event_id, topic, partition_key, event_type, error, attempts)
        VALUES (v_consumer, p_event_id, v_event.topic, v_event.partition_key, v_event.event_type,
                left(p_error, 8192), p_attempts);
    END IF;
END $$;

-- Plugin migrations: locks the calling plugin's registry row for the rest of the transaction
-- (this serialises its migrations across hosts with a lock no plugin can take), and returns
-- the migrations already applied.
CREATE FUNCTION obx_api.migrations_applied() RETURNS TABLE (id integer, checksum bytea)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin text := (obx.session_plugin()).name;
BEGIN
    PERFORM 1 FROM obx.plugin p WHERE p.name = v_plugin FOR UPDATE;
    RETURN QUERY SELECT m.id, m.checksum FROM obx.plugin_migration m WHERE m.plugin = v_plugin ORDER BY m.id;
END $$;

-- Records a migration the calling plugin's session has just applied, in its transaction.
CREATE FUNCTION obx_api.record_migration(p_id integer, p_name text, p_checksum bytea, p_version text)
    RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO obx.plugin_migration (plugin, id, name, checksum, plugin_version)
    VALUES ((obx.session_plugin()).name, p_id, left(p_name, 200), p_checksum, left(p_version, 64));
END $$;

-- And those that exist already.
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA obx FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA obx_api FROM PUBLIC;

-- A rule for every later host migration: plugin roles can make objects of their own that
-- depend on obx_api's functions (a view over one, say). Change a function with CREATE OR
-- REPLACE and the same signature; to drop one, DROP ... CASCADE, which removes only such
-- objects (a plugin that made them got past the SQL policy).
