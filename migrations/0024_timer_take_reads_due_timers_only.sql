-- Taking due timers reads the due ones only. The condition `due_at <= clock_timestamp()`
-- cannot bound an index scan (clock_timestamp() is volatile, so it is evaluated row by row as
-- a filter): when fewer timers than asked for were due, the take read every pending timer of
-- the plugin, at every poll of every host (about 100 ms for a million pending). The clock is
-- now read once, into a variable, which the scan of ix_timer_due takes as its bound. Otherwise
-- as in 0010 (timer_take_traced) and 0007 (timer_take, which hosts of earlier versions call).
CREATE OR REPLACE FUNCTION obx_api.timer_take_traced(p_limit integer)
    RETURNS TABLE (name text, key text, payload text, due_at timestamptz, generation bigint, attempts integer,
                   traceparent text)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
    v_now    timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    SELECT t.name, t.key, t.payload::text, t.due_at, t.generation, t.attempts, t.traceparent
    FROM obx.timer t
    WHERE t.plugin = v_plugin.name AND t.parked_at IS NULL AND t.due_at <= v_now
    ORDER BY t.due_at
    LIMIT least(greatest(p_limit, 0), 1000)
    FOR UPDATE SKIP LOCKED;
END $$;

CREATE OR REPLACE FUNCTION obx_api.timer_take(p_limit integer)
    RETURNS TABLE (name text, key text, payload text, due_at timestamptz, generation bigint, attempts integer)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
    v_now    timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    SELECT t.name, t.key, t.payload::text, t.due_at, t.generation, t.attempts
    FROM obx.timer t
    WHERE t.plugin = v_plugin.name AND t.parked_at IS NULL AND t.due_at <= v_now
    ORDER BY t.due_at
    LIMIT least(greatest(p_limit, 0), 1000)
    FOR UPDATE SKIP LOCKED;
END $$;
