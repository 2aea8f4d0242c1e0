-- An event's payload was held to limits.max_payload_bytes as the plugin wrote it. The relay
-- publishes it as jsonb prints it (payload::text), which prints every number in full: the
-- 9-byte 1e131071 prints as 131,072 digits. A payload of 90 KB made of such numbers was
-- taken, and printing it passes the gigabyte Postgres can build, so every claim of the
-- relay's shard that reached it failed, and no event of any plugin on that shard was
-- published again. Smaller ones printed to tens of megabytes, which the relay read, many to
-- a claim, before the producer set them aside as too large.
--
-- Now the payload as printed is held to the same bound, in the one function every emit
-- passes through (emit, emit_each and emit_delayed call it). The host checks the same before
-- it calls it (host/src/jsonb.rs), with the reason. emit_calls is restated whole (CREATE OR
-- REPLACE keeps its grants); it gains that check, and parses each payload once, and nothing
-- else changes.
--
-- Events stored before, still to be published, whose numbers alone print past their plugin's
-- bound are set aside, as the relay sets aside a row the broker refuses for good: their keys
-- move on, and they stay for an operator to see. Each number is printed on its own (at most
-- about 147 KB), so finding them never prints a whole payload.

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
    SELECT e.event_id, e.aggregate_type, e.aggregate_id, e.event_type, j.payload, e.topic,
           e.partition_key, v_plugin.name, p_version, clock_timestamp(), e.traceparent
    FROM unnest(p_event_ids, p_aggregate_types, p_aggregate_ids, p_event_types, p_payloads, p_topics,
                p_partition_keys, p_traceparents) WITH ORDINALITY
           AS e(event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
                traceparent, n)
         -- Parsed once (OFFSET 0 keeps the planner from copying the expression into both
         -- places it is used); a payload over the bound as written is not parsed at all.
         CROSS JOIN LATERAL (SELECT CASE WHEN octet_length(e.payload) <= v_plugin.max_payload_bytes
                                         THEN e.payload::jsonb END AS payload OFFSET 0) AS j
    WHERE e.event_id IS NOT NULL
      AND octet_length(e.aggregate_type) BETWEEN 1 AND 1024
      AND octet_length(e.aggregate_id) BETWEEN 1 AND 1024
      AND octet_length(e.event_type) BETWEEN 1 AND 1024
      AND octet_length(e.partition_key) BETWEEN 1 AND 1024
      AND octet_length(j.payload::text) <= v_plugin.max_payload_bytes
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
        WHEN octet_length(e.payload::jsonb::text) > v_plugin.max_payload_bytes
          THEN format('the payload is %s bytes as jsonb prints it (numbers in full: 1e100 as 101 '
                      'digits), over the limit of %s', octet_length(e.payload::jsonb::text),
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
      AND coalesce(octet_length(e.payload::jsonb::text) <= v_plugin.max_payload_bytes, false)
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

INSERT INTO obx.outbox_delivery_failure
    (outbox_id, topic, partition_key, attempts, last_error, next_attempt_at, set_aside)
SELECT o.id, o.topic, o.partition_key, 1,
       'its payload prints past limits.max_payload_bytes as jsonb prints it (numbers in full); '
       'set aside by migration 0035',
       'infinity', true
FROM obx.outbox_event o
LEFT JOIN obx.plugin p ON p.name = o.plugin_name
WHERE o.published_at IS NULL
  AND (SELECT coalesce(sum(octet_length(n::text)), 0)
         FROM jsonb_path_query(o.payload, 'strict $.** ? (@.type() == "number")') AS n)
      > coalesce(p.max_payload_bytes, 983040)
ON CONFLICT (outbox_id) DO UPDATE SET
    set_aside = true, next_attempt_at = 'infinity', last_error = EXCLUDED.last_error,
    updated_at = now();
