-- A release of a key's dead letter (a retry, a discard, the parked row marked processed or
-- deleted) freed every event held behind it in the statement that released it: 3.2 s for
-- 200,000 events here, all under the key's lock, which the consumer's intake of that key
-- waits for. Through the host a release runs within http.request_timeout (30 s), so a key
-- with millions of events behind its letter could not be released there at all: the
-- request timed out, the release was rolled back, and the key's intake had stalled for it.
--
-- Now the release frees the first 1,000 events held behind the letter, in order, and names
-- the key in obx.inbox_key_freeing while it may hold more; the plugin's inbox processors
-- free the rest, 10,000 at a time in a transaction of their own
-- (obx_api.inbox_free_held). Order holds throughout: a key's head is still its first
-- unprocessed event, held or not, so the freed events run and the held ones wait behind
-- them. An event held with no parked event before it is now possible, for as long as its
-- key is named in obx.inbox_key_freeing, and only then.

CREATE TABLE obx.inbox_key_freeing (
    consumer      text NOT NULL,
    topic         text NOT NULL,
    partition_key text NOT NULL,
    -- When a part last freed some: the keys take turns.
    named_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition_key)
);

-- Frees up to `p_most` of a key's held events before its first parked one (all of them if
-- it has none), first to last, and names the key in obx.inbox_key_freeing while one such
-- event is still held, or takes its name off. Returns how many it freed. The caller holds
-- the key's advisory lock. The key's first parked row is locked, not only read, as 0033's
-- trigger did: on an old snapshot (REPEATABLE READ) a row released since is a serialization
-- failure, not a key held for ever. Each part reads from the key's first event: the entries
-- of the events earlier parts freed stay in ix_inbox_event_key_waiting until a vacuum, but
-- the scan that meets them marks them dead and the next skips them (20 parts of 10,000 took
-- 161-189 ms each here, the last no longer than the first).
CREATE FUNCTION obx.inbox_free_key(p_consumer text, p_topic text, p_key text, p_most integer)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_first bigint;
    v_freed integer;
BEGIN
    SELECT p.seq INTO v_first FROM obx.inbox_event p
    WHERE p.consumer = p_consumer AND p.topic = p_topic AND p.partition_key = p_key
      AND p.parked AND NOT p.processed
    ORDER BY p.seq LIMIT 1
    FOR SHARE;
    v_first := coalesce(v_first, 9223372036854775807);
    UPDATE obx.inbox_event e SET held = false
    FROM (SELECT q.consumer, q.event_id FROM obx.inbox_event q
          WHERE q.consumer = p_consumer AND q.topic = p_topic AND q.partition_key = p_key
            AND NOT q.processed AND q.held AND q.seq < v_first
          ORDER BY q.seq LIMIT p_most) h
    WHERE e.consumer = h.consumer AND e.event_id = h.event_id;
    GET DIAGNOSTICS v_freed = ROW_COUNT;
    -- Read again rather than judged by the count, which a row deleted meanwhile would lower.
    IF EXISTS (SELECT 1 FROM obx.inbox_event q
               WHERE q.consumer = p_consumer AND q.topic = p_topic AND q.partition_key = p_key
                 AND NOT q.processed AND q.held AND q.seq < v_first) THEN
        INSERT INTO obx.inbox_key_freeing (consumer, topic, partition_key)
        VALUES (p_consumer, p_topic, p_key)
        ON CONFLICT (consumer, topic, partition_key) DO UPDATE SET named_at = now();
    ELSE
        DELETE FROM obx.inbox_key_freeing f
        WHERE f.consumer = p_consumer AND f.topic = p_topic AND f.partition_key = p_key;
    END IF;
    RETURN v_freed;
END $$;

-- As 0033's, but a release frees at most 1,000 events in its own statement.
CREATE OR REPLACE FUNCTION obx.inbox_key_parked() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_event obx.inbox_event := CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
    v_first bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(
        v_event.consumer || '/' || v_event.topic || '/' || v_event.partition_key, 33));
    PERFORM obx.inbox_free_key(v_event.consumer, v_event.topic, v_event.partition_key, 1000);
    SELECT p.seq INTO v_first FROM obx.inbox_event p
    WHERE p.consumer = v_event.consumer AND p.topic = v_event.topic
      AND p.partition_key = v_event.partition_key AND p.parked AND NOT p.processed
    ORDER BY p.seq LIMIT 1;
    IF v_first IS NOT NULL THEN
        UPDATE obx.inbox_event e SET held = true
        FROM (SELECT q.consumer, q.event_id FROM obx.inbox_event q
              WHERE q.consumer = v_event.consumer AND q.topic = v_event.topic
                AND q.partition_key = v_event.partition_key
                AND NOT q.processed AND NOT q.parked AND NOT q.held AND q.seq > v_first
              ORDER BY q.seq LIMIT 1000) h
        WHERE e.consumer = h.consumer AND e.event_id = h.event_id;
    END IF;
    RETURN NULL;
END $$;

-- One key of the session's plugin named in obx.inbox_key_freeing, the one that waited
-- longest and that no other session is freeing: up to `p_most` (1 to 100,000) of its held
-- events freed. Returns how many, or -1 if no such key was named. An inbox processor calls
-- it now and then, and again at once while it finds a key.
CREATE FUNCTION obx_api.inbox_free_held(p_most integer) RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_consumer text := (obx.session_plugin()).name;
    v_key      record;
BEGIN
    -- The key's lock is tried a key at a time, here and not in the query (which would try
    -- it on every named key before the sort, and hold all it got to the commit): at most
    -- one key is locked. The lock keeps other sessions off the key; a key named no longer
    -- by the time its lock is taken frees nothing.
    FOR v_key IN
        SELECT f.topic, f.partition_key FROM obx.inbox_key_freeing f
        WHERE f.consumer = v_consumer
        ORDER BY f.named_at
    LOOP
        IF pg_try_advisory_xact_lock(hashtextextended(
               v_consumer || '/' || v_key.topic || '/' || v_key.partition_key, 33)) THEN
            RETURN obx.inbox_free_key(v_consumer, v_key.topic, v_key.partition_key,
                                      least(greatest(coalesce(p_most, 1), 1), 100000));
        END IF;
    END LOOP;
    RETURN -1;
END $$;

REVOKE ALL ON obx.inbox_key_freeing FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION obx.inbox_free_key(text, text, text, integer),
                           obx_api.inbox_free_held(integer) FROM PUBLIC;

-- The trigger's function keeps its owner, which runs obx.inbox_free_key for it: should
-- another role apply this migration than the one that made it, that owner may still call it.
DO $$
BEGIN
    EXECUTE format('GRANT EXECUTE ON FUNCTION obx.inbox_free_key(text, text, text, integer) TO %s',
                   (SELECT p.proowner::regrole::text FROM pg_catalog.pg_proc p
                     WHERE p.oid = 'obx.inbox_key_parked()'::regprocedure));
END $$;
