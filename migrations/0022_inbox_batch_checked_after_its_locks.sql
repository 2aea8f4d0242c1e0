-- A batch of inbox events is checked again once its rows are locked, with what has committed
-- by then. 0019's one statement fixed where the batch stops (the first event of the key that
-- waits) from its snapshot, before it locked the rows. When another session held one of them
-- while it recorded that event's failed attempt (a processor whose claim's transaction was
-- lost records it apart), the lock wait ended with the event waiting for its retry: the
-- recheck of the locked row dropped it from the batch, but the stop, computed before, let the
-- events behind it in, and they ran before it, out of their key's order (CI once saw A5 take
-- effect while A4 was parked).
--
-- Now one statement locks the candidates, skipping any row another session holds, and a
-- second one, with a snapshot taken after the locks, keeps them up to the first unprocessed
-- event of the key that is not among them (one held elsewhere, or waiting, or the first past
-- the limit), and nothing at all if an event before the head is unprocessed again. The events
-- it keeps are locked, so what it saw of them stays true until the commit. No lock is waited
-- for beyond the head's. The candidates of a key are found with `=` (0019's IS NOT DISTINCT
-- FROM could not use ix_inbox_event_key, and walked the consumer's whole queue); an event
-- with no key is a batch of its own. The head's choice and the marking are as in 0019.
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
BEGIN
    SELECT * INTO v_head
    FROM obx.inbox_event e
    WHERE e.consumer = v_consumer AND NOT e.processed AND NOT e.parked
      AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
      AND (e.partition_key IS NULL OR e.seq = (
           SELECT min(q.seq) FROM obx.inbox_event q
           WHERE q.consumer = e.consumer AND q.topic = e.topic AND q.partition_key = e.partition_key
             AND NOT q.processed))
    ORDER BY e.seq
    LIMIT 1
    FOR UPDATE OF e SKIP LOCKED;
    IF NOT FOUND THEN
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
