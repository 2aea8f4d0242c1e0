-- An inbox event's failed attempt is recorded once. A processor records an attempt under the
-- row lock of its claim, or, when the claim's transaction is gone (its commit was refused,
-- or its session was abandoned), in a transaction of its own; by then another processor may
-- have claimed the event again and recorded the same attempt, parked it, or handled it. The
-- attempt is recorded only if the event is still where the claim left it: not parked, with
-- the attempts the claim saw, and either unprocessed or marked processed by this very
-- transaction (the claim's own mark). Returns whether it was recorded.
CREATE FUNCTION obx_api.inbox_fail_attempt(p_event_id uuid, p_attempts integer, p_error text,
    p_park boolean, p_retry_after double precision) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_found    boolean;
BEGIN
    -- FOR UPDATE waits for a processor that holds the row, then checks its latest version.
    PERFORM 1 FROM obx.inbox_event e
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id AND NOT e.parked
      AND e.attempts = p_attempts - 1
      AND (NOT e.processed OR e.xmin = pg_current_xact_id()::xid)
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF p_park THEN
        v_found := obx.park_event(v_consumer, p_event_id, p_attempts, p_error);
    ELSE
        UPDATE obx.inbox_event e
        SET attempts = p_attempts, last_error = left(p_error, 8192), processed = false,
            processed_at = NULL, next_attempt_at = now() + make_interval(secs => greatest(p_retry_after, 0))
        WHERE e.consumer = v_consumer AND e.event_id = p_event_id;
        v_found := FOUND;
    END IF;
    IF v_found THEN
        DELETE FROM obx.processed_event p WHERE p.consumer = v_consumer AND p.event_id = p_event_id;
    END IF;
    RETURN v_found;
END $$;

-- Hosts of the previous version, during a rolling deploy, keep calling obx_api.inbox_fail:
-- it now records through the same check.
CREATE OR REPLACE FUNCTION obx_api.inbox_fail(p_event_id uuid, p_attempts integer, p_error text, p_park boolean,
    p_retry_after double precision) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM obx_api.inbox_fail_attempt(p_event_id, p_attempts, p_error, p_park, p_retry_after);
END $$;

REVOKE EXECUTE ON FUNCTION obx_api.inbox_fail_attempt(uuid, integer, text, boolean, double precision) FROM PUBLIC;

-- Plugin roles get it when their plugin loads, as every obx_api function (the host loads its
-- plugins after the migrations, before any processor runs); hosts of the previous version
-- call obx_api.inbox_fail, which runs as its owner.
