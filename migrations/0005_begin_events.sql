-- Dedup mode records its events with one statement per batch (obx_api.begin_event, one event
-- at a time, stays for hosts of the previous version during a rolling deploy); and one
-- function parks an event, in either mode.

-- Dedup mode, before a batch's handlers run: for each event, in the order given (at most 64),
-- whether its key is parked behind a dead letter, and if not, whether the event is new to the
-- calling plugin. New events are recorded as processed, in the calling transaction; of an
-- event given twice, only the first is new. The caller takes this before its first savepoint,
-- and gives back (obx_api.forget_events) the records of the events it did not run.
CREATE FUNCTION obx_api.begin_events(p_event_ids uuid[], p_topics text[], p_keys text[])
    RETURNS TABLE (parked boolean, fresh boolean)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_column
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_count    integer := coalesce(cardinality(p_event_ids), 0);
BEGIN
    IF v_count > 64 OR coalesce(cardinality(p_topics), 0) <> v_count
       OR coalesce(cardinality(p_keys), 0) <> v_count THEN
        RAISE EXCEPTION 'begin_events takes up to 64 events, with a topic and a key each'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    WITH given AS (
        SELECT u.event_id, u.topic, u.key, u.n,
               u.key IS NOT NULL AND EXISTS (
                   SELECT 1 FROM obx.inbox_event e
                   WHERE e.consumer = v_consumer AND e.topic = u.topic AND e.partition_key = u.key
                     AND NOT e.processed) AS parked
        FROM unnest(p_event_ids, p_topics, p_keys) WITH ORDINALITY AS u(event_id, topic, key, n)
    ), recorded AS (
        INSERT INTO obx.processed_event (consumer, event_id)
        SELECT DISTINCT v_consumer, g.event_id FROM given g WHERE NOT g.parked
        ON CONFLICT ON CONSTRAINT processed_event_pkey DO NOTHING
        RETURNING processed_event.event_id
    )
    SELECT g.parked,
           NOT g.parked
           AND EXISTS (SELECT 1 FROM recorded r WHERE r.event_id = g.event_id)
           AND g.n = (SELECT min(d.n) FROM given d WHERE d.event_id = g.event_id AND NOT d.parked)
    FROM given g
    ORDER BY g.n;
END $$;

-- Gives back the records obx_api.begin_events made in this very transaction for events the
-- batch did not run (a failed handler's, and those after it). Records of any other
-- transaction stay: a plugin that calls this itself can only undo its own uncommitted work.
CREATE FUNCTION obx_api.forget_events(p_event_ids uuid[]) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
BEGIN
    DELETE FROM obx.processed_event p
    WHERE p.consumer = v_consumer AND p.event_id = ANY (p_event_ids)
      AND p.xmin = pg_current_xact_id()::xid;
END $$;

-- Parks a consumer's event that is in the inbox: the row is parked (unprocessed) with its
-- attempts and error, and a dead letter names it; later events of its key wait behind it.
-- The one place an event is parked: the consumer calls it for a dedup-mode event (stored in
-- the inbox just before, in the same transaction), obx_api.inbox_fail for an inbox event.
-- Returns whether the event was there.
CREATE FUNCTION obx.park_event(p_consumer text, p_event_id uuid, p_attempts integer, p_error text)
    RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_event obx.inbox_event;
BEGIN
    UPDATE obx.inbox_event e
    SET attempts = p_attempts, last_error = left(p_error, 8192), parked = true,
        processed = false, processed_at = NULL
    WHERE e.consumer = p_consumer AND e.event_id = p_event_id
    RETURNING * INTO v_event;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO obx.dead_letter (consumer, event_id, topic, partition_key, event_type, error, attempts)
    VALUES (p_consumer, p_event_id, v_event.topic, v_event.partition_key, v_event.event_type,
            left(p_error, 8192), p_attempts);
    RETURN true;
END $$;

-- Inbox mode: records a failed attempt of the calling plugin's event: a retry after a delay,
-- or parked (obx.park_event). The event is unprocessed again: a batch marked it before its
-- handler's savepoint.
CREATE OR REPLACE FUNCTION obx_api.inbox_fail(p_event_id uuid, p_attempts integer, p_error text, p_park boolean,
    p_retry_after double precision) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_found    boolean;
BEGIN
    IF p_park THEN
        v_found := obx.park_event(v_consumer, p_event_id, p_attempts, p_error);
    ELSE
        UPDATE obx.inbox_event e
        SET attempts = p_attempts, last_error = left(p_error, 8192), processed = false,
            processed_at = NULL, next_attempt_at = now() + make_interval(secs => greatest(p_retry_after, 0))
        WHERE e.consumer = v_consumer AND e.event_id = p_event_id;
        v_found := FOUND;
    END IF;
    IF v_found THEN
        DELETE FROM obx.processed_event p WHERE p.consumer = v_consumer AND p.event_id = p_event_id;
    END IF;
END $$;

REVOKE EXECUTE ON FUNCTION obx.park_event(text, uuid, integer, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION obx_api.begin_events(uuid[], text[], text[]),
                           obx_api.forget_events(uuid[]) FROM PUBLIC;
