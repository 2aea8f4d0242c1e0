-- A handler whose statement lost to concurrent work (a lock wait past lock_timeout, a
-- deadlock, a serialization failure) is not at fault: the host tries its event or timer
-- again after a backoff without counting an attempt, for `consumer.contention_grace` from
-- the first such failure (`contended_since`); past it they count, so that a lock nobody
-- releases ends in a dead letter. Counted from the first, a reload's migration or an
-- operator's LOCK TABLE held for longer than the attempts' backoffs parked every event of
-- the keys in flight, and their keys with them. These two record such a try as
-- inbox_fail_attempt (0009) and timer_fail (0012) record a failed attempt, under the same
-- guards (a record never lands on an event another processor has since claimed, or on a
-- timer rescheduled since it was taken), and answer 'first' or 'again' (recorded, the
-- attempt count as it was), 'charge' (past the grace: the caller records a failed attempt)
-- or 'gone'. The retry is timed from the clock, not from the transaction's start, which a
-- lock wait has put in the past.
ALTER TABLE obx.inbox_event ADD COLUMN contended_since timestamptz;
ALTER TABLE obx.timer ADD COLUMN contended_since timestamptz;

CREATE FUNCTION obx_api.inbox_defer(p_event_id uuid, p_attempts integer, p_error text,
    p_retry_after double precision, p_grace double precision) RETURNS text
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_since    timestamptz;
BEGIN
    SELECT e.contended_since INTO v_since FROM obx.inbox_event e
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id AND NOT e.parked
      AND e.attempts = p_attempts
      AND (NOT e.processed OR e.xmin = pg_current_xact_id()::xid)
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'gone';
    END IF;
    IF coalesce(p_grace, 0) <= 0
       OR v_since < clock_timestamp() - make_interval(secs => p_grace) THEN
        RETURN 'charge';
    END IF;
    UPDATE obx.inbox_event e
    SET last_error = left(p_error, 8192), processed = false, processed_at = NULL,
        contended_since = coalesce(v_since, clock_timestamp()),
        next_attempt_at = clock_timestamp() + make_interval(secs => greatest(p_retry_after, 0))
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id;
    DELETE FROM obx.processed_event p WHERE p.consumer = v_consumer AND p.event_id = p_event_id;
    RETURN CASE WHEN v_since IS NULL THEN 'first' ELSE 'again' END;
END $$;
REVOKE EXECUTE ON FUNCTION obx_api.inbox_defer(uuid, integer, text, double precision, double precision)
    FROM PUBLIC;

-- A timer's episode of contention ends when it is scheduled again (scheduled_at moves past
-- it) or retried by an operator (which clears it).
CREATE FUNCTION obx_api.timer_defer(p_name text, p_key text, p_generation bigint, p_attempts integer,
                                    p_error text, p_retry_ms bigint, p_grace_ms bigint)
    RETURNS text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
    v_since  timestamptz;
BEGIN
    SELECT CASE WHEN t.contended_since >= t.scheduled_at THEN t.contended_since END INTO v_since
    FROM obx.timer t
    WHERE t.plugin = v_plugin.name AND t.name = p_name AND t.key = p_key AND t.generation = p_generation
      AND t.attempts = p_attempts AND t.parked_at IS NULL
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'gone';
    END IF;
    IF coalesce(p_grace_ms, 0) <= 0
       OR v_since < clock_timestamp() - make_interval(secs => p_grace_ms / 1000.0) THEN
        RETURN 'charge';
    END IF;
    UPDATE obx.timer t
    SET last_error = left(p_error, 8192), contended_since = coalesce(v_since, clock_timestamp()),
        due_at = clock_timestamp() + make_interval(secs => least(greatest(p_retry_ms, 0), 86400000) / 1000.0)
    WHERE t.plugin = v_plugin.name AND t.name = p_name AND t.key = p_key AND t.generation = p_generation;
    RETURN CASE WHEN v_since IS NULL THEN 'first' ELSE 'again' END;
END $$;
REVOKE EXECUTE ON FUNCTION obx_api.timer_defer(text, text, bigint, integer, text, bigint, bigint) FROM PUBLIC;

-- Plugin roles get both when their plugin loads, as every obx_api function (after the
-- migrations); hosts of the previous version never call them.
