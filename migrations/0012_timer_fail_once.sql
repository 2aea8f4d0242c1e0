-- A timer's failed attempt is recorded once, as an inbox event's is (0009): obx_api.timer_fail
-- matched the timer's schedule (its generation) but not its attempts, so a failure recorded
-- late (from a fresh transaction, after a batch's commit failed) could overwrite a newer
-- attempt another host had recorded meanwhile, and the timer then got one attempt more than
-- consumer.max_attempts. The attempt is now recorded only over the attempts it follows.
CREATE OR REPLACE FUNCTION obx_api.timer_fail(p_name text, p_key text, p_generation bigint, p_attempts integer,
                                              p_error text, p_park boolean, p_retry_ms bigint)
    RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
BEGIN
    UPDATE obx.timer t
    SET attempts = p_attempts, last_error = left(p_error, 8192),
        parked_at = CASE WHEN p_park THEN clock_timestamp() END,
        due_at = CASE WHEN p_park THEN t.due_at
                      ELSE clock_timestamp() + make_interval(secs => least(greatest(p_retry_ms, 0), 86400000) / 1000.0) END
    WHERE t.plugin = v_plugin.name AND t.name = p_name AND t.key = p_key AND t.generation = p_generation
      AND t.attempts = p_attempts - 1;
END $$;
