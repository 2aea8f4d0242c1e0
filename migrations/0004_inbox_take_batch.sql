-- Inbox processors take batches. (obx_api.inbox_claim and obx_api.inbox_take, one event at a
-- time, stay for hosts of the previous version during a rolling deploy.)

-- Inbox mode, batched: claims the calling plugin's next event that may run (as
-- obx_api.inbox_claim does: unprocessed, not parked, not waiting for a retry, the oldest
-- unprocessed event of its key on its topic) and the unprocessed events of its key after it,
-- up to p_limit (at most 64) in all, in inbox order; marks them processed (and in
-- processed_event); all in the calling transaction, which keeps their rows locked. `fresh` is
-- false for an event already in processed_event.
--
-- One key per batch: only the oldest event of a key can be claimed, and the batch holds it,
-- so nobody else can take any event of that key meanwhile, and the batch runs them in order.
-- A batch of many keys would make every other processor walk past all of them. Locking and
-- marking in the transaction itself (not in a savepoint) keeps the rows free of multixacts,
-- which every later scan of the inbox would pay to read. The walk must follow (consumer, seq)
-- and stop at the first event that may run; with stale statistics after a burst the planner
-- may prefer to sort the whole inbox, which the settings rule out (and a plan priced with a
-- ruled-out node would be JIT-compiled at every call: no JIT).
CREATE FUNCTION obx_api.inbox_take_batch(p_limit integer)
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

-- Inbox mode: records a failed attempt of the calling plugin's event: a retry after a delay,
-- or parked with a dead letter (which holds its key). The event is unprocessed again: a
-- batch marked it before its handler's savepoint.
CREATE OR REPLACE FUNCTION obx_api.inbox_fail(p_event_id uuid, p_attempts integer, p_error text, p_park boolean,
    p_retry_after double precision) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_event    obx.inbox_event;
    v_found    boolean;
BEGIN
    UPDATE obx.inbox_event e
    SET attempts = p_attempts, last_error = left(p_error, 8192), parked = p_park,
        processed = false, processed_at = NULL,
        next_attempt_at = CASE WHEN p_park THEN e.next_attempt_at
                               ELSE now() + make_interval(secs => greatest(p_retry_after, 0)) END
    WHERE e.consumer = v_consumer AND e.event_id = p_event_id
    RETURNING * INTO v_event;
    v_found := FOUND;
    IF v_found THEN
        DELETE FROM obx.processed_event p WHERE p.consumer = v_consumer AND p.event_id = p_event_id;
    END IF;
    IF v_found AND p_park THEN
        INSERT INTO obx.dead_letter (consumer, event_id, topic, partition_key, event_type, error, attempts)
        VALUES (v_consumer, p_event_id, v_event.topic, v_event.partition_key, v_event.event_type,
                left(p_error, 8192), p_attempts);
    END IF;
END $$;

-- Events of one key that a batch took (and recorded in processed_event: the caller passes
-- only those) but did not run, because an earlier one of the key failed: unprocessed again,
-- to wait behind it.
CREATE FUNCTION obx_api.inbox_untake(p_event_ids uuid[]) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
BEGIN
    UPDATE obx.inbox_event e SET processed = false, processed_at = NULL
    WHERE e.consumer = v_consumer AND e.event_id = ANY (p_event_ids);
    DELETE FROM obx.processed_event p WHERE p.consumer = v_consumer AND p.event_id = ANY (p_event_ids);
END $$;

REVOKE EXECUTE ON FUNCTION obx_api.inbox_take_batch(integer), obx_api.inbox_untake(uuid[]) FROM PUBLIC;
