-- With no delayed event waiting, obx.outbox_release_due said the next one was due in 0 ms
-- (greatest() skips a NULL), so every idle relay stepped at relay.min_step_interval, some
-- 200 steps and 400 transactions a second per host, instead of waiting for a commit or
-- relay.poll_interval. next_due_ms is now NULL when nothing waits; the relay already treats
-- a time past due as now. Only that line differs from 0008's body; 0011's lock_timeout stays.
CREATE OR REPLACE FUNCTION obx.outbox_release_due(p_limit integer, OUT released integer, OUT next_due_ms bigint)
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET lock_timeout = '200ms' AS $$
BEGIN
    WITH due AS (
        SELECT d.seq FROM obx.outbox_delayed d WHERE d.due_at <= clock_timestamp()
        ORDER BY d.due_at, d.seq LIMIT p_limit FOR UPDATE
    ), moved AS (
        DELETE FROM obx.outbox_delayed d USING due WHERE d.seq = due.seq RETURNING d.*
    )
    INSERT INTO obx.outbox_event
        (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
         created_at, plugin_name, plugin_version, traceparent, publish_after)
    SELECT m.event_id, m.aggregate_type, m.aggregate_id, m.event_type, m.payload, m.topic,
           m.partition_key, clock_timestamp(), m.plugin_name, m.plugin_version, m.traceparent, m.due_at
    FROM moved m ORDER BY m.due_at, m.seq
    ON CONFLICT (event_id) DO NOTHING;
    GET DIAGNOSTICS released = ROW_COUNT;
    SELECT ceil(extract(epoch FROM min(d.due_at) - clock_timestamp()) * 1000)::bigint
    INTO next_due_ms FROM obx.outbox_delayed d;
END $$;
