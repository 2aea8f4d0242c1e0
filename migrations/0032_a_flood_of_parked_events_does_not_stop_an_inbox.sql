-- A flood of parked events no longer stops a plugin's inbox. Whoever can write to a topic a
-- plugin subscribes to can send events its handler refuses; each is parked at its first
-- attempt, with no key or with a key of its own, so that nothing waits behind it. 0029's
-- claim still read them: its walk took the consumer's first 256 unprocessed events, parked
-- ones included, and when all of them were parked it fell back to obx.inbox_heads, which
-- read every parked event with no key and made two index descents per key with a parked
-- event. With 200,000 of them a claim passed a 300 ms statement timeout at every try, and
-- no event of the plugin moved (tests/consume.rs
-- a_flood_of_parked_events_does_not_hold_up_its_plugin).
--
-- Now the walk reads an index of the events that are neither processed nor parked, and the
-- heads' events with no key one of those with no key. A parked event is never a head, so
-- neither can miss one; what decides a head is unchanged: the first unprocessed event of its
-- key, parked or not (ix_inbox_event_key). The fallback still enumerates every key with an
-- unprocessed event, parked or not: an index of the keys' events that are not parked made
-- inbox claims a quarter slower in obx-bench consume (docs/bench/changes.md).
DROP INDEX obx.ix_inbox_event_queue;
CREATE INDEX ix_inbox_event_runnable ON obx.inbox_event (consumer, seq) WHERE NOT processed AND NOT parked;
CREATE INDEX ix_inbox_event_runnable_keyless ON obx.inbox_event (consumer, topic, seq)
    WHERE NOT processed AND NOT parked AND partition_key IS NULL;

-- As 0029's, with the events that have no key read from ix_inbox_event_runnable_keyless.
CREATE OR REPLACE FUNCTION obx.inbox_heads(p_consumer text)
    RETURNS TABLE (event_id uuid, seq bigint)
    LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp SET max_parallel_workers_per_gather = 0 AS $$
    WITH RECURSIVE topics(topic) AS (
        (SELECT q.topic FROM obx.inbox_event q
         WHERE q.consumer = p_consumer AND NOT q.processed ORDER BY q.topic LIMIT 1)
      UNION ALL
        SELECT n.topic FROM topics t CROSS JOIN LATERAL (
            SELECT q.topic FROM obx.inbox_event q
            WHERE q.consumer = p_consumer AND NOT q.processed AND q.topic > t.topic
            ORDER BY q.topic LIMIT 1) n
    ), keys(topic, partition_key) AS (
        -- Within a topic, so that a step stops at its events with no key, which sort last.
        SELECT t.topic, f.partition_key FROM topics t CROSS JOIN LATERAL (
            SELECT q.partition_key FROM obx.inbox_event q
            WHERE q.consumer = p_consumer AND NOT q.processed AND q.topic = t.topic
              AND q.partition_key IS NOT NULL
            ORDER BY q.partition_key LIMIT 1) f
      UNION ALL
        SELECT k.topic, n.partition_key FROM keys k CROSS JOIN LATERAL (
            SELECT q.partition_key FROM obx.inbox_event q
            WHERE q.consumer = p_consumer AND NOT q.processed AND q.topic = k.topic
              AND q.partition_key > k.partition_key
            ORDER BY q.partition_key LIMIT 1) n
    )
    SELECT h.event_id, h.seq FROM keys k CROSS JOIN LATERAL (
        SELECT e.event_id, e.seq, e.parked, e.next_attempt_at FROM obx.inbox_event e
        WHERE e.consumer = p_consumer AND e.topic = k.topic AND e.partition_key = k.partition_key
          AND NOT e.processed
        ORDER BY e.seq LIMIT 1) h
    WHERE NOT h.parked AND (h.next_attempt_at IS NULL OR h.next_attempt_at <= now())
    UNION ALL
    SELECT n.event_id, n.seq FROM topics t CROSS JOIN LATERAL (
        SELECT e.event_id, e.seq FROM obx.inbox_event e
        WHERE e.consumer = p_consumer AND e.topic = t.topic AND e.partition_key IS NULL
          AND NOT e.processed AND NOT e.parked
          AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
        -- In ix_inbox_event_runnable_keyless: the parked ones are not read.
        ORDER BY e.seq LIMIT 64) n
$$;
REVOKE EXECUTE ON FUNCTION obx.inbox_heads(text) FROM PUBLIC;

-- As 0029's, with the walk over the events that are not parked.
CREATE OR REPLACE FUNCTION obx_api.inbox_take_batch(p_limit integer)
    RETURNS TABLE (event_id uuid, topic text, payload text, event_type text, partition_key text,
                   headers jsonb, attempts integer, fresh boolean)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_sort = off SET enable_bitmapscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_head     obx.inbox_event;
    v_limit    integer := least(greatest(coalesce(p_limit, 1), 1), 64);
    v_locked   uuid[];
    v_candidates uuid[];
    v_id       uuid;
BEGIN
    -- The head among the consumer's first 256 unprocessed events that are not parked, in
    -- order (ix_inbox_event_runnable): each one's row is read by its primary key and locked
    -- as the walk reaches it, so the walk stops at the first that can be taken.
    SELECT e.* INTO v_head
    FROM (SELECT q.consumer, q.event_id, q.seq FROM obx.inbox_event q
          WHERE q.consumer = v_consumer AND NOT q.processed AND NOT q.parked
          ORDER BY q.seq
          LIMIT 256) w
    JOIN obx.inbox_event e ON e.consumer = w.consumer AND e.event_id = w.event_id
    WHERE NOT e.processed AND NOT e.parked
      AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
      AND (e.partition_key IS NULL OR e.seq = (
           SELECT min(q.seq) FROM obx.inbox_event q
           WHERE q.consumer = e.consumer AND q.topic = e.topic AND q.partition_key = e.partition_key
             AND NOT q.processed))
    ORDER BY w.seq
    LIMIT 1
    FOR UPDATE OF e SKIP LOCKED;
    IF v_head.event_id IS NULL THEN
        -- Nothing at the front of the queue can be taken (a parked key's backlog, keys in
        -- backoff, keys other processors hold): the heads, key by key, the first 64 tried in
        -- turn, each locked by its primary key (another session's skipped) and checked again.
        SELECT array_agg(h.event_id ORDER BY h.seq) INTO v_candidates FROM (
            SELECT h.event_id, h.seq FROM obx.inbox_heads(v_consumer) h
            ORDER BY h.seq LIMIT 64) h;
        FOREACH v_id IN ARRAY coalesce(v_candidates, '{}') LOOP
            SELECT * INTO v_head
            FROM obx.inbox_event e
            WHERE e.consumer = v_consumer AND e.event_id = v_id
              AND NOT e.processed AND NOT e.parked
              AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
              AND (e.partition_key IS NULL OR e.seq = (
                   SELECT min(q.seq) FROM obx.inbox_event q
                   WHERE q.consumer = e.consumer AND q.topic = e.topic AND q.partition_key = e.partition_key
                     AND NOT q.processed))
            FOR UPDATE OF e SKIP LOCKED;
            EXIT WHEN FOUND;
        END LOOP;
    END IF;
    IF v_head.event_id IS NULL THEN
        RETURN;
    END IF;
    IF v_head.partition_key IS NULL THEN
        v_locked := ARRAY[v_head.event_id];
    ELSE
        -- The candidates, locked; a row another session holds is left out, and ends the batch.
        SELECT coalesce(array_agg(c.event_id), ARRAY[v_head.event_id]) INTO v_locked FROM (
            SELECT r.event_id
            FROM obx.inbox_event r
            WHERE r.consumer = v_consumer AND r.topic = v_head.topic
              AND r.partition_key = v_head.partition_key
              AND NOT r.processed AND r.seq >= v_head.seq
              AND NOT r.parked AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= now())
              -- The first that waits among the batch's next events only: a key's whole backlog
              -- would be read at every batch.
              AND r.seq < coalesce((
                  SELECT min(w.seq) FROM (
                      SELECT q.seq, q.parked, q.next_attempt_at FROM obx.inbox_event q
                      WHERE q.consumer = v_consumer AND q.topic = v_head.topic
                        AND q.partition_key = v_head.partition_key
                        AND NOT q.processed AND q.seq > v_head.seq
                      ORDER BY q.seq
                      LIMIT v_limit) w
                  WHERE w.parked OR w.next_attempt_at > now()), 9223372036854775807)
            ORDER BY r.seq
            LIMIT v_limit
            FOR UPDATE OF r SKIP LOCKED) c;
    END IF;
    -- A new statement, a new snapshot: the locked rows up to the first unprocessed event of the
    -- key that is not among them (held by another session, or waiting, or past the limit).
    RETURN QUERY
    WITH run AS (
        SELECT r.consumer, r.event_id
        FROM obx.inbox_event r
        WHERE r.consumer = v_consumer AND r.event_id = ANY (v_locked)
          AND NOT r.processed AND NOT r.parked
          AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= now())
          AND r.seq < coalesce((
              SELECT min(q.seq) FROM obx.inbox_event q
              WHERE q.consumer = v_consumer AND q.topic = v_head.topic
                AND q.partition_key = v_head.partition_key
                AND NOT q.processed AND q.seq > v_head.seq AND q.event_id <> ALL (v_locked)),
              9223372036854775807)
          AND NOT EXISTS (
              SELECT 1 FROM obx.inbox_event q
              WHERE q.consumer = v_consumer AND q.topic = v_head.topic
                AND q.partition_key = v_head.partition_key
                AND NOT q.processed AND q.seq < v_head.seq)
    ), marked AS (
        UPDATE obx.inbox_event e SET processed = true, processed_at = now()
        FROM run c
        WHERE e.consumer = c.consumer AND e.event_id = c.event_id
        RETURNING e.event_id, e.topic, e.payload::text AS payload, e.event_type, e.partition_key,
                  e.headers, e.attempts, e.seq
    ), recorded AS (
        INSERT INTO obx.processed_event (consumer, event_id)
        SELECT v_consumer, m.event_id FROM marked m
        ON CONFLICT ON CONSTRAINT processed_event_pkey DO NOTHING
        RETURNING processed_event.event_id
    )
    SELECT m.event_id, m.topic, m.payload, m.event_type, m.partition_key, m.headers, m.attempts,
           EXISTS (SELECT 1 FROM recorded r WHERE r.event_id = m.event_id)
    FROM marked m
    ORDER BY m.seq;
END $$;
