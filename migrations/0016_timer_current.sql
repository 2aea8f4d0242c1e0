-- Whether the calling plugin's timer (p_name, p_key) is still as a batch took it: the same
-- schedule (generation) and not parked. A batch reads its due timers once, and the handler
-- of an earlier timer of the batch may have rescheduled or cancelled a later one, which then
-- fired on the schedule it no longer had (a rescheduled timer fired twice, a cancelled one
-- once).
CREATE FUNCTION obx_api.timer_current(p_name text, p_key text, p_generation bigint)
    RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM obx.timer t
                   WHERE t.plugin = (obx.session_plugin()).name AND t.name = p_name AND t.key = p_key
                     AND t.generation = p_generation AND t.parked_at IS NULL)
$$;

REVOKE EXECUTE ON FUNCTION obx_api.timer_current(text, text, bigint) FROM PUBLIC;
