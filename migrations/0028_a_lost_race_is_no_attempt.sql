-- A handler whose statement lost to concurrent work (a lock wait past lock_timeout, a
-- deadlock, a serialization failure) is not at fault: the host tries its event or timer
-- again after a backoff without counting an attempt. Counted, a reload's migration or an
-- operator's LOCK TABLE held for longer than the attempts' backoffs parked every event of
-- the keys in flight, and their keys with them. These two record such a try as
-- inbox_fail_attempt (0009) and timer_fail (0012) record a failed attempt, but leave the
-- attempt count as it is; the same guards keep a record from landing on an event another
-- processor has since claimed, or on a timer rescheduled since it was taken.
CREATE FUNCTION obx_api.inbox_defer(p_event_id uuid, p_attempts integer, p_error text,
    p_retry_after double precision) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
BEGIN
    PERFORM 1 FROM obx.inbox_event e
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id AND NOT e.parked
      AND e.attempts = p_attempts
      AND (NOT e.processed OR e.xmin = pg_current_xact_id()::xid)
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE obx.inbox_event e
    SET last_error = left(p_error, 8192), processed = false, processed_at = NULL,
        next_attempt_at = now() + make_interval(secs => greatest(p_retry_after, 0))
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id;
    DELETE FROM obx.processed_event p WHERE p.consumer = v_consumer AND p.event_id = p_event_id;
    RETURN true;
END $$;
REVOKE EXECUTE ON FUNCTION obx_api.inbox_defer(uuid, integer, text, double precision) FROM PUBLIC;

CREATE FUNCTION obx_api.timer_defer(p_name text, p_key text, p_generation bigint, p_attempts integer,
                                    p_error text, p_retry_ms bigint)
    RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
BEGIN
    UPDATE obx.timer t
    SET last_error = left(p_error, 8192),
        due_at = clock_timestamp() + make_interval(secs => least(greatest(p_retry_ms, 0), 86400000) / 1000.0)
    WHERE t.plugin = v_plugin.name AND t.name = p_name AND t.key = p_key AND t.generation = p_generation
      AND t.attempts = p_attempts AND t.parked_at IS NULL;
END $$;
REVOKE EXECUTE ON FUNCTION obx_api.timer_defer(text, text, bigint, integer, text, bigint) FROM PUBLIC;

-- Plugin roles get both when their plugin loads, as every obx_api function (after the
-- migrations); hosts of the previous version never call them.
