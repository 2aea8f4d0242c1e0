-- A timer remembers the trace context of the call that scheduled it, so that its firing's
-- span links back to that call (a link, not a parent: a timer that schedules itself again
-- would otherwise grow one trace for ever). Added beside the functions of 0007, which stay:
-- a host of the previous version, during a rolling upgrade, still calls them (its schedules
-- then carry no context, and it does not read the column).
ALTER TABLE obx.timer ADD COLUMN traceparent text;

-- obx_api.timer_schedule, with the scheduling call's `traceparent`: at most 128 bytes, or
-- NULL. It is the plugin's own timer's context: a plugin that calls this itself can only
-- mislabel its own traces. The checks are 0007's.
CREATE FUNCTION obx_api.timer_schedule(p_name text, p_key text, p_delay_ms bigint, p_payload text,
                                       p_traceparent text)
    RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
BEGIN
    IF p_name IS NULL OR octet_length(p_name) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'a timer name has 1 to 200 bytes' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_key IS NULL OR octet_length(p_key) NOT BETWEEN 1 AND 1024 THEN
        RAISE EXCEPTION 'a timer key has 1 to 1024 bytes' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_delay_ms IS NULL OR p_delay_ms NOT BETWEEN 0 AND 315576000000 THEN
        RAISE EXCEPTION 'a timer delay is 0 to 10 years' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_payload IS NULL OR octet_length(p_payload) > v_plugin.max_payload_bytes THEN
        RAISE EXCEPTION 'a timer payload is at most % bytes', v_plugin.max_payload_bytes
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF octet_length(p_traceparent) > 128 THEN
        RAISE EXCEPTION 'a trace context has at most 128 bytes' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO obx.timer AS t (plugin, name, key, due_at, payload, traceparent)
    VALUES (v_plugin.name, p_name, p_key,
            clock_timestamp() + make_interval(secs => p_delay_ms / 1000.0), p_payload::json, p_traceparent)
    ON CONFLICT (plugin, name, key) DO UPDATE
    SET due_at = excluded.due_at, payload = excluded.payload, generation = excluded.generation,
        attempts = 0, last_error = NULL, parked_at = NULL, scheduled_at = now(),
        traceparent = excluded.traceparent;
END $$;

-- 0007's signature, for a host of the previous version: the same, with no trace context.
CREATE OR REPLACE FUNCTION obx_api.timer_schedule(p_name text, p_key text, p_delay_ms bigint, p_payload text)
    RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM obx_api.timer_schedule(p_name, p_key, p_delay_ms, p_payload, NULL::text);
END $$;

-- obx_api.timer_take, with each timer's `traceparent`.
CREATE FUNCTION obx_api.timer_take_traced(p_limit integer)
    RETURNS TABLE (name text, key text, payload text, due_at timestamptz, generation bigint, attempts integer,
                   traceparent text)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
BEGIN
    RETURN QUERY
    SELECT t.name, t.key, t.payload::text, t.due_at, t.generation, t.attempts, t.traceparent
    FROM obx.timer t
    WHERE t.plugin = v_plugin.name AND t.parked_at IS NULL AND t.due_at <= clock_timestamp()
    ORDER BY t.due_at
    LIMIT least(greatest(p_limit, 0), 1000)
    FOR UPDATE SKIP LOCKED;
END $$;

REVOKE EXECUTE ON FUNCTION obx_api.timer_schedule(text, text, bigint, text, text),
    obx_api.timer_take_traced(integer) FROM PUBLIC;
