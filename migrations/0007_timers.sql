-- Durable timers (the `timers` import of obx:plugin@0.2.1). A plugin schedules and cancels
-- them in the transaction of its call, through obx_api.timer_schedule / timer_cancel; the
-- host fires a due timer in a transaction of its own on the plugin's session: it takes the
-- timer (obx_api.timer_take, row locked), runs `handle-timer`, and deletes it in that same
-- transaction (obx_api.timer_done), so the handler's effects and the timer's end commit
-- together, once. `generation` names one schedule, from a sequence, never reused: a handler
-- that schedules its own timer again (or cancels it and schedules it anew) replaces the row,
-- and the firing's delete, which names the generation it fired, leaves the new schedule
-- alone. No foreign key to obx.plugin: loading a plugin locks its row there for as long as
-- its migrations run, and a key would make every new schedule wait for that.
CREATE SEQUENCE obx.timer_generation;
CREATE TABLE obx.timer (
    plugin       text        NOT NULL,
    name         text        NOT NULL,
    key          text        NOT NULL,
    due_at       timestamptz NOT NULL,
    -- `json`, not `jsonb`: the handler gets back the very text it scheduled.
    payload      json        NOT NULL,
    generation   bigint      NOT NULL DEFAULT nextval('obx.timer_generation'),
    -- Failed attempts so far; the next call's `attempt` is this plus one.
    attempts     integer     NOT NULL DEFAULT 0,
    last_error   text,
    -- Set when the timer failed `consumer.max_attempts` times: it no longer fires.
    parked_at    timestamptz,
    scheduled_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (plugin, name, key)
);
CREATE INDEX ix_timer_due ON obx.timer(plugin, due_at) WHERE parked_at IS NULL;

-- Schedules (or replaces) the calling plugin's timer (p_name, p_key), due p_delay_ms from the
-- database's clock. Checks its input as if a hostile plugin called it, which it can.
CREATE FUNCTION obx_api.timer_schedule(p_name text, p_key text, p_delay_ms bigint, p_payload text)
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
    INSERT INTO obx.timer AS t (plugin, name, key, due_at, payload)
    VALUES (v_plugin.name, p_name, p_key,
            clock_timestamp() + make_interval(secs => p_delay_ms / 1000.0), p_payload::json)
    ON CONFLICT (plugin, name, key) DO UPDATE
    SET due_at = excluded.due_at, payload = excluded.payload, generation = excluded.generation,
        attempts = 0, last_error = NULL, parked_at = NULL, scheduled_at = now();
END $$;

-- Cancels the calling plugin's timer (p_name, p_key); whether one was there.
CREATE FUNCTION obx_api.timer_cancel(p_name text, p_key text)
    RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
BEGIN
    DELETE FROM obx.timer t WHERE t.plugin = v_plugin.name AND t.name = p_name AND t.key = p_key;
    RETURN FOUND;
END $$;

-- Takes up to p_limit of the calling plugin's due timers, earliest first, locking them for
-- this transaction; timers another session holds are skipped.
CREATE FUNCTION obx_api.timer_take(p_limit integer)
    RETURNS TABLE (name text, key text, payload text, due_at timestamptz, generation bigint, attempts integer)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
BEGIN
    RETURN QUERY
    SELECT t.name, t.key, t.payload::text, t.due_at, t.generation, t.attempts
    FROM obx.timer t
    WHERE t.plugin = v_plugin.name AND t.parked_at IS NULL AND t.due_at <= clock_timestamp()
    ORDER BY t.due_at
    LIMIT least(greatest(p_limit, 0), 1000)
    FOR UPDATE SKIP LOCKED;
END $$;

-- Ends a timer that fired, unless it was scheduled again since (another generation).
CREATE FUNCTION obx_api.timer_done(p_name text, p_key text, p_generation bigint)
    RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin obx.plugin := obx.session_plugin();
BEGIN
    DELETE FROM obx.timer t
    WHERE t.plugin = v_plugin.name AND t.name = p_name AND t.key = p_key AND t.generation = p_generation;
END $$;

-- Records a failed firing: due again after p_retry_ms, or parked.
CREATE FUNCTION obx_api.timer_fail(p_name text, p_key text, p_generation bigint, p_attempts integer,
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
    WHERE t.plugin = v_plugin.name AND t.name = p_name AND t.key = p_key AND t.generation = p_generation;
END $$;

REVOKE EXECUTE ON FUNCTION obx_api.timer_schedule(text, text, bigint, text), obx_api.timer_cancel(text, text),
    obx_api.timer_take(integer), obx_api.timer_done(text, text, bigint),
    obx_api.timer_fail(text, text, bigint, integer, text, boolean, bigint) FROM PUBLIC;
