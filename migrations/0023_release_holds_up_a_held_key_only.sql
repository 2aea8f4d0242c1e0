-- A due delayed event that the release cannot move now holds up its own key only. The release
-- moved its due events in one statement, which waited at most 200 ms for a lock and then gave
-- up its whole step. An open transaction that still wrote a delayed event's id (it raced the
-- delayed event's own commit: see 0011) makes that event's insert wait at every step, so one
-- plugin's open transaction kept every plugin's delayed events waiting, and a plugin could
-- chain such transactions. Now, when the statement runs out of lock time, the release takes
-- the due events one at a time, each in a subtransaction, waiting for no lock of another
-- relay (NOWAIT) and 20 ms at most for a twin: an event that cannot move stays, and so does
-- every later event of its key in this step (a key's events enter the outbox in due order);
-- the rest move. At most 32 at a time, so that the subtransactions stay within what each
-- backend keeps in shared memory (64). When events were held and all the due ones were seen,
-- the next step comes in 100 ms at the soonest, not at once. Otherwise as in 0013.
CREATE OR REPLACE FUNCTION obx.outbox_release_due(p_limit integer, OUT released integer, OUT next_due_ms bigint)
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET lock_timeout = '200ms' AS $$
DECLARE
    v_due  obx.outbox_delayed;
    v_held text[] := '{}';
    v_seen integer := 0;
    v_n    integer;
BEGIN
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
    EXCEPTION WHEN lock_not_available THEN
        released := 0;
        PERFORM set_config('lock_timeout', '20ms', true);
        FOR v_due IN
            SELECT * FROM obx.outbox_delayed d WHERE d.due_at <= clock_timestamp()
            ORDER BY d.due_at, d.seq LIMIT least(greatest(p_limit, 1), 32)
        LOOP
            v_seen := v_seen + 1;
            CONTINUE WHEN v_due.partition_key = ANY (v_held);
            BEGIN
                -- Gone: another relay moved it, and committed.
                PERFORM 1 FROM obx.outbox_delayed d WHERE d.seq = v_due.seq FOR UPDATE NOWAIT;
                CONTINUE WHEN NOT FOUND;
                DELETE FROM obx.outbox_delayed d WHERE d.seq = v_due.seq;
                INSERT INTO obx.outbox_event
                    (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
                     created_at, plugin_name, plugin_version, traceparent, publish_after)
                VALUES (v_due.event_id, v_due.aggregate_type, v_due.aggregate_id, v_due.event_type,
                        v_due.payload, v_due.topic, v_due.partition_key, clock_timestamp(),
                        v_due.plugin_name, v_due.plugin_version, v_due.traceparent, v_due.due_at)
                ON CONFLICT (event_id) DO NOTHING;
                GET DIAGNOSTICS v_n = ROW_COUNT;
                released := released + v_n;
            EXCEPTION WHEN lock_not_available THEN
                v_held := v_held || v_due.partition_key;
            END;
        END LOOP;
    END;
    SELECT ceil(extract(epoch FROM min(d.due_at) - clock_timestamp()) * 1000)::bigint
    INTO next_due_ms FROM obx.outbox_delayed d;
    IF cardinality(v_held) > 0 AND v_seen < 32 THEN
        next_due_ms := greatest(next_due_ms, 100);
    END IF;
END $$;
