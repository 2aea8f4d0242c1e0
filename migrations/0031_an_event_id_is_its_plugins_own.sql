-- Event ids were one namespace that plugins wrote into: an event id a plugin gave was stored
-- as given. Every event id is unique in the outbox, and a consumer records the ids of the
-- events it processed, whoever produced them. So a plugin could give another plugin's event
-- ids (it reads them on the topics it consumes, or derives the ones that plugin derives):
-- first, and the other plugin's emits of them failed; later (past the outbox's retention),
-- and a consumer of both skipped the real event as one it had already processed. Two
-- services with a plugin of the same name that derive ids from the same keys collided in a
-- consumer of both in the same way.
--
-- Now every id a plugin's session passes becomes the plugin's own, here, whichever function
-- the session calls: obx.event_id_in(role, id), the role being obx_<installation>_<plugin>.
-- The same plugin passing the same id gets the same event id, so a retried emit is still one
-- event; but no plugin can feasibly write an id that is, or will be, another plugin's, in this
-- installation or another. The host computes the same function, to tell the plugin what
-- `emit` wrote (host/src/outbox/mod.rs, stored_event_id). A host of the previous version
-- still tells its plugins the ids as it passed them, during a rolling deploy.
--
-- emit_calls and emit_delayed are restated whole (CREATE OR REPLACE keeps their grants); each
-- gains the mapping of its ids and nothing else.

-- An id's first 6 bytes (a UUIDv7's millisecond timestamp, for the ids the host assigns), then
-- bytes 7 to 16 of SHA-256 over a fixed prefix, the role's name, a zero byte and the id's 16
-- bytes, marked as a UUID of version 8 (RFC 9562's custom layout). The ids of a plugin's
-- events thus still grow with time, as the outbox's and the consumers' indexes want, and the
-- 74 hashed bits are what another role could only find by a search of about 2^74 hashes. The zero byte ends the name, which holds
-- none: two (role, id) pairs never hash the same input. A role's name is
-- obx_<hex>_[a-z][a-z0-9_]*, so its text is its bytes in any encoding, and the cast to bytea
-- reads no escape in it.
--
-- One SQL expression, which Postgres may inline where it is called (a PL/pgSQL function
-- would prepare its expressions again in every transaction, as every command is). Only its
-- owner may call it, from the functions below, whose search path is pinned (its operators
-- are not qualified). No literal holds a backslash: a body is read under the calling
-- session's standard_conforming_strings.
CREATE FUNCTION obx.event_id_in(p_role text, p_given uuid) RETURNS uuid
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.encode(pg_catalog.set_byte(pg_catalog.set_byte(
               pg_catalog.substr(pg_catalog.uuid_send(p_given), 1, 6)
                 || pg_catalog.substr(pg_catalog.sha256(('obx event id ' || p_role)::bytea || pg_catalog.decode('00', 'hex')
                                 || pg_catalog.uuid_send(p_given)), 7, 10),
               6, (pg_catalog.get_byte(pg_catalog.sha256(('obx event id ' || p_role)::bytea || pg_catalog.decode('00', 'hex')
                                 || pg_catalog.uuid_send(p_given)), 6) & 15) | 128),
               8, (pg_catalog.get_byte(pg_catalog.sha256(('obx event id ' || p_role)::bytea || pg_catalog.decode('00', 'hex')
                                 || pg_catalog.uuid_send(p_given)), 8) & 63) | 128), 'hex')::uuid
$$;
REVOKE EXECUTE ON FUNCTION obx.event_id_in(text, uuid) FROM PUBLIC;

CREATE OR REPLACE FUNCTION obx_api.emit_calls(
    p_version text, p_calls integer[], p_traceparents text[], p_event_ids uuid[],
    p_aggregate_types text[], p_aggregate_ids text[], p_event_types text[], p_payloads text[],
    p_topics text[], p_partition_keys text[]
) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin  obx.plugin;
    v_count   integer := coalesce(cardinality(p_event_ids), 0);
    v_written integer;
    v_bad     text;
    v_bad_calls bigint;
    v_sizes   bigint;
    v_most    bigint;
    v_heaviest bigint;
    v_i       integer;
BEGIN
    IF v_count = 0 THEN
        RETURN 0;
    END IF;
    SELECT * INTO v_plugin FROM obx.plugin p WHERE p.role_name = session_user;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session user % is not a plugin of this OBX installation', session_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF coalesce(cardinality(p_aggregate_types), -1) <> v_count
       OR coalesce(cardinality(p_aggregate_ids), -1) <> v_count
       OR coalesce(cardinality(p_event_types), -1) <> v_count
       OR coalesce(cardinality(p_payloads), -1) <> v_count
       OR coalesce(cardinality(p_topics), -1) <> v_count
       OR coalesce(cardinality(p_partition_keys), -1) <> v_count
       OR coalesce(cardinality(p_traceparents), -1) <> v_count THEN
        RAISE EXCEPTION 'emit: the arrays differ in length' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_version IS NULL OR octet_length(p_version) NOT BETWEEN 1 AND 64 THEN
        RAISE EXCEPTION 'emit: invalid version' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_count > v_plugin.max_emits_per_call
       OR octet_length(array_to_string(p_payloads, '')) > v_plugin.max_emit_bytes_per_call THEN
        -- Over a limit as a whole: each call must be within them. The events are numbered
        -- as unnest numbers them, whatever the arrays' bounds say.
        SELECT count(*) FILTER (WHERE c.size IS NULL OR c.size < 1), coalesce(sum(c.size), 0)
          INTO v_bad_calls, v_sizes
          FROM unnest(p_calls) AS c(size);
        IF v_bad_calls > 0 OR v_sizes <> v_count THEN
            RAISE EXCEPTION 'emit: the calls do not add up to the events'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        SELECT max(k.events), max(k.bytes) INTO v_most, v_heaviest
          FROM (SELECT count(*) AS events, sum(octet_length(e.payload)) AS bytes
                  FROM (SELECT c.n, generate_series(c.upto - c.size + 1, c.upto) AS i
                          FROM (SELECT c.n, c.size, sum(c.size) OVER (ORDER BY c.n) AS upto
                                  FROM unnest(p_calls) WITH ORDINALITY AS c(size, n)) AS c) AS c
                  JOIN unnest(p_payloads) WITH ORDINALITY AS e(payload, n) ON e.n = c.i
                 GROUP BY c.n) AS k;
        IF v_most > v_plugin.max_emits_per_call THEN
            RAISE EXCEPTION 'a call may emit at most % events', v_plugin.max_emits_per_call
                USING ERRCODE = 'program_limit_exceeded';
        END IF;
        IF v_heaviest > v_plugin.max_emit_bytes_per_call THEN
            RAISE EXCEPTION 'the events of one call may hold at most % payload bytes',
                v_plugin.max_emit_bytes_per_call USING ERRCODE = 'program_limit_exceeded';
        END IF;
    END IF;
    -- Every event id becomes the plugin's own, in place (after the checks of the arrays' sizes);
    -- the rest of the body is 0015's.
    FOR v_i IN array_lower(p_event_ids, 1)..array_upper(p_event_ids, 1) LOOP
        p_event_ids[v_i] := obx.event_id_in(v_plugin.role_name, p_event_ids[v_i]);
    END LOOP;
    INSERT INTO obx.outbox_event
        (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
         plugin_name, plugin_version, created_at, traceparent)
    SELECT e.event_id, e.aggregate_type, e.aggregate_id, e.event_type, e.payload::jsonb, e.topic,
           e.partition_key, v_plugin.name, p_version, clock_timestamp(), e.traceparent
    FROM unnest(p_event_ids, p_aggregate_types, p_aggregate_ids, p_event_types, p_payloads, p_topics,
                p_partition_keys, p_traceparents) WITH ORDINALITY
           AS e(event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
                traceparent, n)
    WHERE e.event_id IS NOT NULL
      AND octet_length(e.aggregate_type) BETWEEN 1 AND 1024
      AND octet_length(e.aggregate_id) BETWEEN 1 AND 1024
      AND octet_length(e.event_type) BETWEEN 1 AND 1024
      AND octet_length(e.partition_key) BETWEEN 1 AND 1024
      AND octet_length(e.payload) <= v_plugin.max_payload_bytes
      AND coalesce(octet_length(e.traceparent), 0) <= 128
      AND left(e.topic, 2) <> '__'
      AND EXISTS (SELECT 1 FROM obx.plugin_emit d
                  WHERE d.topic = e.topic AND d.event_type = e.event_type AND d.plugin = v_plugin.name)
      AND NOT EXISTS (SELECT 1 FROM obx.outbox_delayed w WHERE w.event_id = e.event_id)
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
        WHEN octet_length(e.traceparent) > 128 THEN 'the trace context is over 128 bytes'
        WHEN EXISTS (SELECT 1 FROM obx.outbox_delayed w WHERE w.event_id = e.event_id)
          THEN format('the event id %s is taken by a delayed event', e.event_id)
        ELSE format('%s on topic %s is not declared in the manifest', e.event_type, e.topic)
        END) INTO v_bad
    FROM unnest(p_event_ids, p_aggregate_types, p_aggregate_ids, p_event_types, p_payloads, p_topics,
                p_partition_keys, p_traceparents) WITH ORDINALITY
           AS e(event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
                traceparent, n)
    WHERE NOT (e.event_id IS NOT NULL
      AND coalesce(octet_length(e.aggregate_type) BETWEEN 1 AND 1024, false)
      AND coalesce(octet_length(e.aggregate_id) BETWEEN 1 AND 1024, false)
      AND coalesce(octet_length(e.event_type) BETWEEN 1 AND 1024, false)
      AND coalesce(octet_length(e.partition_key) BETWEEN 1 AND 1024, false)
      AND coalesce(octet_length(e.payload) <= v_plugin.max_payload_bytes, false)
      AND coalesce(octet_length(e.traceparent), 0) <= 128
      AND coalesce(left(e.topic, 2) <> '__', false)
      AND EXISTS (SELECT 1 FROM obx.plugin_emit d
                  WHERE d.topic = e.topic AND d.event_type = e.event_type AND d.plugin = v_plugin.name)
      AND NOT EXISTS (SELECT 1 FROM obx.outbox_delayed w WHERE w.event_id = e.event_id))
    ORDER BY e.n
    LIMIT 1;
    RAISE EXCEPTION 'emit refused: %', coalesce(v_bad, 'an event was not written')
        USING ERRCODE = 'insufficient_privilege';
END $$;

CREATE OR REPLACE FUNCTION obx_api.emit_delayed(
    p_version text, p_traceparent text, p_event_ids uuid[], p_aggregate_types text[],
    p_aggregate_ids text[], p_event_types text[], p_payloads text[], p_topics text[],
    p_partition_keys text[], p_delays_ms bigint[]
) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_count integer := coalesce(cardinality(p_event_ids), 0);
    v_moved integer;
    v_ids   uuid[];
BEGIN
    IF coalesce(cardinality(p_delays_ms), -1) <> v_count THEN
        RAISE EXCEPTION 'emit: the arrays differ in length' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_delays_ms) AS d(ms) WHERE ms IS NULL OR ms NOT BETWEEN 0 AND 315576000000) THEN
        RAISE EXCEPTION 'an event delay is 0 to 10 years' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_count = 0 THEN
        RETURN 0;
    END IF;
    PERFORM obx_api.emit(p_version, p_traceparent, p_event_ids, p_aggregate_types, p_aggregate_ids,
                         p_event_types, p_payloads, p_topics, p_partition_keys);
    -- The ids the events were written with (emit_calls made them the plugin's own).
    v_ids := ARRAY(SELECT obx.event_id_in(p.role_name, i.id)
                     FROM unnest(p_event_ids) WITH ORDINALITY AS i(id, n)
                     JOIN obx.plugin p ON p.role_name = session_user
                    ORDER BY i.n);
    WITH moved AS (
        DELETE FROM obx.outbox_event o WHERE o.event_id = ANY(v_ids) AND o.published_at IS NULL
        RETURNING o.*
    )
    INSERT INTO obx.outbox_delayed
        (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
         created_at, plugin_name, plugin_version, traceparent, due_at)
    SELECT m.event_id, m.aggregate_type, m.aggregate_id, m.event_type, m.payload, m.topic,
           m.partition_key, m.created_at, m.plugin_name, m.plugin_version, m.traceparent,
           m.created_at + make_interval(secs => d.ms / 1000.0)
    FROM moved m JOIN unnest(v_ids, p_delays_ms) AS d(event_id, ms) USING (event_id)
    ORDER BY m.id;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> v_count THEN
        RAISE EXCEPTION 'emit: an event id appears twice in one call' USING ERRCODE = 'unique_violation';
    END IF;
    RETURN v_count;
END $$;

-- The delayed events waiting now were written with the ids as given: no consumer has seen
-- them, and an emit of one of their ids would now be written as the plugin's own id and not
-- be refused as theirs. They take the ids they would have now, unless another event has that
-- id already: a plugin could have written an id and its own derived id before this migration,
-- and the unique index would refuse the update (or the release would later drop the event).
-- Those keep theirs, and the migration says how many.
DO $$
DECLARE
    v_waiting bigint;
    v_renamed bigint;
BEGIN
    SELECT count(*) INTO v_waiting FROM obx.outbox_delayed d JOIN obx.plugin p ON p.name = d.plugin_name;
    UPDATE obx.outbox_delayed d SET event_id = obx.event_id_in(p.role_name, d.event_id)
      FROM obx.plugin p
     WHERE p.name = d.plugin_name
       AND NOT EXISTS (SELECT 1 FROM obx.outbox_delayed w
                        WHERE w.event_id = obx.event_id_in(p.role_name, d.event_id))
       AND NOT EXISTS (SELECT 1 FROM obx.outbox_event o
                        WHERE o.event_id = obx.event_id_in(p.role_name, d.event_id));
    GET DIAGNOSTICS v_renamed = ROW_COUNT;
    IF v_renamed < v_waiting THEN
        RAISE WARNING '% waiting delayed events keep the ids they were written with: another event has the new one',
            v_waiting - v_renamed;
    END IF;
END $$;

-- emit_calls and emit_delayed keep their owner, which runs obx.event_id_in for them: should
-- another role apply this migration than the one that made them, that owner may still call it.
DO $$
BEGIN
    EXECUTE format('GRANT EXECUTE ON FUNCTION obx.event_id_in(text, uuid) TO %s',
                   (SELECT p.proowner::regrole::text FROM pg_catalog.pg_proc p
                     WHERE p.oid = 'obx_api.emit_calls(text, integer[], text[], uuid[], text[], '
                                   'text[], text[], text[], text[], text[])'::regprocedure));
    EXECUTE format('GRANT EXECUTE ON FUNCTION obx.event_id_in(text, uuid) TO %s',
                   (SELECT p.proowner::regrole::text FROM pg_catalog.pg_proc p
                     WHERE p.oid = 'obx_api.emit_delayed(text, text, uuid[], text[], text[], '
                                   'text[], text[], text[], text[], bigint[])'::regprocedure));
END $$;
