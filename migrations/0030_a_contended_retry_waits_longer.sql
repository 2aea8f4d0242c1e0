-- A try that lost to concurrent work (0028) was due again after the backoff of the attempt
-- it repeats, 100 ms at the first attempt. With the defaults, a lock held for the whole
-- 10-minute grace was tried about 550 times per event (each try a transaction that waits
-- out lock_timeout, 1 s), a race lost at once (NOWAIT, a serialization failure) about
-- 6,000 times, and every key in that state at once (a reload's migration holding a table)
-- did so. Now
-- the wait grows with the episode: a quarter of the time since its first lost race, at
-- least the attempt's backoff and at most p_retry_max (`consumer.backoff_max`). The first
-- tries come as quickly as before; a lock released after t seconds is seen at most t/4
-- (or backoff_max) later; the whole grace costs about 105 and 140 tries.
--
-- The functions of 0028 keep their signatures for hosts of the previous version, with their
-- behaviour (the wait is the attempt's backoff): they call these with p_retry_max equal to
-- it.

-- How long a try that lost a race waits, in seconds, `p_contended` seconds into its episode:
-- a quarter of it, at least `p_least` (the attempt's backoff) and at most `p_most`, unless
-- `p_least` is more. Never negative.
CREATE FUNCTION obx.contended_wait(p_contended double precision, p_least double precision,
    p_most double precision) RETURNS double precision
    LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT greatest(coalesce(p_least, 0), least(coalesce(p_most, 0), greatest(p_contended, 0) / 4), 0::double precision)
$$;
REVOKE EXECUTE ON FUNCTION obx.contended_wait(double precision, double precision, double precision) FROM PUBLIC;

CREATE FUNCTION obx_api.inbox_defer(p_event_id uuid, p_attempts integer, p_error text,
    p_retry_after double precision, p_retry_max double precision, p_grace double precision)
    RETURNS text
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_since    timestamptz;
    v_now      timestamptz;
BEGIN
    SELECT e.contended_since INTO v_since FROM obx.inbox_event e
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id AND NOT e.parked
      AND e.attempts = p_attempts
      AND (NOT e.processed OR e.xmin = pg_current_xact_id()::xid)
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'gone';
    END IF;
    -- After the row's lock: the retry is timed from when the try is recorded.
    v_now := clock_timestamp();
    IF coalesce(p_grace, 0) <= 0 OR v_since < v_now - make_interval(secs => p_grace) THEN
        RETURN 'charge';
    END IF;
    UPDATE obx.inbox_event e
    SET last_error = left(p_error, 8192), processed = false, processed_at = NULL,
        contended_since = coalesce(v_since, v_now),
        next_attempt_at = v_now + make_interval(secs => obx.contended_wait(
            extract(epoch FROM v_now - coalesce(v_since, v_now))::double precision,
            p_retry_after, p_retry_max))
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id;
    DELETE FROM obx.processed_event p WHERE p.consumer = v_consumer AND p.event_id = p_event_id;
    RETURN CASE WHEN v_since IS NULL THEN 'first' ELSE 'again' END;
END $$;
REVOKE EXECUTE ON FUNCTION obx_api.inbox_defer(uuid, integer, text, double precision, double precision,
    double precision) FROM PUBLIC;

CREATE OR REPLACE FUNCTION obx_api.inbox_defer(p_event_id uuid, p_attempts integer, p_error text,
    p_retry_after double precision, p_grace double precision) RETURNS text
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT obx_api.inbox_defer(p_event_id, p_attempts, p_error, p_retry_after, p_retry_after, p_grace)
$$;

CREATE FUNCTION obx_api.timer_defer(p_name text, p_key text, p_generation bigint, p_attempts integer,
                                    p_error text, p_retry_ms bigint, p_retry_max_ms bigint, p_grace_ms bigint)
    RETURNS text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
    v_since  timestamptz;
    v_now    timestamptz;
    v_wait   double precision;
BEGIN
    SELECT CASE WHEN t.contended_since >= t.scheduled_at THEN t.contended_since END INTO v_since
    FROM obx.timer t
    WHERE t.plugin = v_plugin.name AND t.name = p_name AND t.key = p_key AND t.generation = p_generation
      AND t.attempts = p_attempts AND t.parked_at IS NULL
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'gone';
    END IF;
    -- After the row's lock: the retry is timed from when the try is recorded.
    v_now := clock_timestamp();
    IF coalesce(p_grace_ms, 0) <= 0 OR v_since < v_now - make_interval(secs => p_grace_ms / 1000.0) THEN
        RETURN 'charge';
    END IF;
    v_wait := obx.contended_wait(extract(epoch FROM v_now - coalesce(v_since, v_now))::double precision,
                                 least(greatest(p_retry_ms, 0), 86400000) / 1000.0,
                                 least(greatest(p_retry_max_ms, 0), 86400000) / 1000.0);
    UPDATE obx.timer t
    SET last_error = left(p_error, 8192), contended_since = coalesce(v_since, v_now),
        due_at = v_now + make_interval(secs => v_wait)
    WHERE t.plugin = v_plugin.name AND t.name = p_name AND t.key = p_key AND t.generation = p_generation;
    RETURN CASE WHEN v_since IS NULL THEN 'first' ELSE 'again' END;
END $$;
REVOKE EXECUTE ON FUNCTION obx_api.timer_defer(text, text, bigint, integer, text, bigint, bigint, bigint)
    FROM PUBLIC;

CREATE OR REPLACE FUNCTION obx_api.timer_defer(p_name text, p_key text, p_generation bigint, p_attempts integer,
                                               p_error text, p_retry_ms bigint, p_grace_ms bigint)
    RETURNS text LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT obx_api.timer_defer(p_name, p_key, p_generation, p_attempts, p_error, p_retry_ms, p_retry_ms, p_grace_ms)
$$;

-- The wrappers keep their owner, which runs the new functions for them: should another role
-- apply this migration than the one that made them, that owner may still call them.
DO $$
BEGIN
    EXECUTE format('GRANT EXECUTE ON FUNCTION obx_api.inbox_defer(uuid, integer, text, double precision, '
                   'double precision, double precision) TO %s',
                   (SELECT p.proowner::regrole::text FROM pg_catalog.pg_proc p
                     WHERE p.oid = 'obx_api.inbox_defer(uuid, integer, text, double precision, '
                                   'double precision)'::regprocedure));
    EXECUTE format('GRANT EXECUTE ON FUNCTION obx_api.timer_defer(text, text, bigint, integer, text, bigint, '
                   'bigint, bigint) TO %s',
                   (SELECT p.proowner::regrole::text FROM pg_catalog.pg_proc p
                     WHERE p.oid = 'obx_api.timer_defer(text, text, bigint, integer, text, bigint, '
                                   'bigint)'::regprocedure));
END $$;
