-- obx_api.emit_calls: emit_each, told where each call's events begin and end, so that the
-- limits hold per call, as the manifest documents them, and not per statement. A host writes
-- the outbox rows of a whole batch (consumed events, timers) in one statement; emit_each held
-- the statement to one call's limits, read from the plugin's row, which the host that loaded
-- the plugin last wrote. A host whose own limits were larger (during a rolling change of
-- `limits`) cut its batches by its own and had each refused with 54000, then retried one
-- event at a time; a timer batch was charged a failed attempt for every timer in it.
--
-- p_calls holds the number of events of each call, in order. It is read only when the
-- statement as a whole is over a limit: within them, every call is too. It is the caller's
-- word, and a session can always call the function again: the limits keep one statement
-- sane, and confine nothing. What confines a plugin's events is checked row by row below.
--
-- emit_each and emit stay for hosts of the previous versions during a rolling deploy, written
-- on this function, so that the checks live in one body.

CREATE FUNCTION obx_api.emit_calls(
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

-- One call: the statement is the call, and held to its limits as a whole.
CREATE OR REPLACE FUNCTION obx_api.emit_each(
    p_version text, p_traceparents text[], p_event_ids uuid[], p_aggregate_types text[],
    p_aggregate_ids text[], p_event_types text[], p_payloads text[], p_topics text[],
    p_partition_keys text[]
) RETURNS integer
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT obx_api.emit_calls(p_version, ARRAY[coalesce(cardinality(p_event_ids), 0)], p_traceparents,
        p_event_ids, p_aggregate_types, p_aggregate_ids, p_event_types, p_payloads, p_topics,
        p_partition_keys)
$$;

CREATE OR REPLACE FUNCTION obx_api.emit(
    p_version text, p_traceparent text, p_event_ids uuid[], p_aggregate_types text[],
    p_aggregate_ids text[], p_event_types text[], p_payloads text[], p_topics text[],
    p_partition_keys text[]
) RETURNS integer
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT obx_api.emit_calls(p_version, ARRAY[coalesce(cardinality(p_event_ids), 0)],
        array_fill(p_traceparent, ARRAY[coalesce(cardinality(p_event_ids), 0)]), p_event_ids,
        p_aggregate_types, p_aggregate_ids, p_event_types, p_payloads, p_topics, p_partition_keys)
$$;

REVOKE EXECUTE ON FUNCTION obx_api.emit_calls(text, integer[], text[], uuid[], text[], text[], text[], text[], text[], text[])
    FROM PUBLIC;

-- emit_each and emit keep their owner, which runs emit_calls for them: should another role
-- apply this migration than the one that made them, that owner may still call it.
DO $$
BEGIN
    EXECUTE format('GRANT EXECUTE ON FUNCTION obx_api.emit_calls(text, integer[], text[], uuid[], '
                   'text[], text[], text[], text[], text[], text[]) TO %s',
                   (SELECT p.proowner::regrole::text FROM pg_catalog.pg_proc p
                     WHERE p.oid = 'obx_api.emit_each(text, text[], uuid[], text[], text[], text[], '
                                   'text[], text[], text[])'::regprocedure));
END $$;
