-- A batch of inbox events stops before the first event of its key that waits: parked, or
-- waiting for its retry. The batch took every unprocessed event of the key after its head, and
-- so ran a parked event, and the events behind it, again and again: a call that lost its
-- transaction (stopped by its backstop while blocked in the host) rolled its whole batch back,
-- the events before the failed one included, so the key's head came before the failed event,
-- which then ran early in the next batch, and after its parking in every batch, for ever,
-- while the events before it never committed. The rest of the function is as in
-- 0004_inbox_take_batch.sql.
CREATE OR REPLACE FUNCTION obx_api.inbox_take_batch(p_limit integer)
    RETURNS TABLE (event_id uuid, topic text, payload text, event_type text, partition_key text,
                   headers jsonb, attempts integer, fresh boolean)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_sort = off SET enable_bitmapscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_head     obx.inbox_event;
    v_limit    integer := least(greatest(coalesce(p_limit, 1), 1), 64);
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
        v_limit := 1;
    END IF;
    RETURN QUERY
    WITH run AS (
        SELECT r.consumer, r.event_id
        FROM obx.inbox_event r
        WHERE r.consumer = v_consumer AND r.topic = v_head.topic
          AND r.partition_key IS NOT DISTINCT FROM v_head.partition_key
          AND NOT r.processed AND r.seq >= v_head.seq
          AND (v_head.partition_key IS NOT NULL OR r.event_id = v_head.event_id)
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
        FOR UPDATE OF r
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
