-- A due delayed event that the release cannot move now holds up its own key only. The release
-- moved its due events in one statement, which waited at most 200 ms for a lock and then gave
-- up its whole step. An open transaction that still wrote a delayed event's id (it raced the
-- delayed event's own commit: see 0011) makes that event's insert wait at every step, so one
-- plugin's open transaction kept every plugin's delayed events waiting, and a plugin could
-- chain such transactions.
--
-- Now the one statement waits 50 ms at most. When it runs out of lock time, the release takes
-- the due events one at a time, in due order, each in a subtransaction that waits for no
-- other relay's lock (NOWAIT) and 5 ms at most for a twin. An event that cannot move stays,
-- and so does every later event of its topic and key in this step, since a key's events enter
-- the outbox in due order; the events of other keys move. At most 32 events are tried a step
-- (those of a held key are passed over, not tried), so that the subtransactions stay within
-- what each backend keeps in shared memory (64), and at most 10,000 due events are looked at. `held` says how many due events were left
-- because their key was held; when every due event was seen and some were held, the next
-- step is asked for in 100 ms at the soonest, not at once. The due time is compared with the
-- clock read once, so that the index scan stops at the first event not due: with
-- clock_timestamp() in the condition, every step read the whole table (100 ms for a million
-- waiting events, on each relay). Otherwise as in 0013. The new
-- output column changes the function's type, so it is dropped and created again (hosts of
-- the previous version name the two columns they read).
DROP FUNCTION obx.outbox_release_due(integer);
CREATE FUNCTION obx.outbox_release_due(p_limit integer, OUT released integer, OUT next_due_ms bigint,
                                       OUT held integer)
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET lock_timeout = '50ms' AS $$
DECLARE
    v_due    obx.outbox_delayed;
    -- Held keys, as topic, newline, key (a topic name holds no newline).
    v_keys   text[] := '{}';
    v_seen   integer := 0;
    v_tried  integer := 0;
    v_capped boolean := false;
    v_n      integer;
    -- Read once: a volatile clock_timestamp() in the condition cannot bound the index scan,
    -- which then read every waiting delayed event at each step (100 ms for a million).
    v_now    timestamptz := clock_timestamp();
BEGIN
    held := 0;
    BEGIN
        WITH due AS (
            SELECT d.seq FROM obx.outbox_delayed d WHERE d.due_at <= v_now
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
        -- Until the function returns: its own SET clause puts the 50 ms back then.
        PERFORM set_config('lock_timeout', '5ms', true);
        FOR v_due IN
            SELECT * FROM obx.outbox_delayed d WHERE d.due_at <= v_now
            ORDER BY d.due_at, d.seq
        LOOP
            v_seen := v_seen + 1;
            IF v_seen > 10000 THEN
                v_capped := true;
                EXIT;
            END IF;
            IF v_due.topic || E'\n' || v_due.partition_key = ANY (v_keys) THEN
                held := held + 1;
                CONTINUE;
            END IF;
            IF v_tried >= 32 OR released >= p_limit THEN
                v_capped := true;
                EXIT;
            END IF;
            v_tried := v_tried + 1;
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
                v_keys := v_keys || (v_due.topic || E'\n' || v_due.partition_key);
                held := held + 1;
            END;
        END LOOP;
    END;
    SELECT ceil(extract(epoch FROM min(d.due_at) - clock_timestamp()) * 1000)::bigint
    INTO next_due_ms FROM obx.outbox_delayed d;
    IF held > 0 AND NOT v_capped THEN
        next_due_ms := greatest(next_due_ms, 100);
    END IF;
END $$;
