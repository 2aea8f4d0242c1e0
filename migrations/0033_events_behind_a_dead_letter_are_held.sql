-- Events waiting behind a dead letter are held, and a claim no longer reads them or their
-- keys. After 0032 a claim's walk still read a parked key's backlog, and its fallback still
-- visited every key with a parked event: whoever can write to a subscribed topic could send,
-- for 100,000 keys of their own, an event the handler refuses and one more behind it. The
-- events behind filled the walk's first 256, every claim fell back, and each fallback made
-- two index descents per parked key: about a second, past a 300 ms statement timeout, so no
-- event of the plugin moved (tests/consume.rs
-- a_flood_of_parked_keys_with_backlogs_does_not_hold_up_its_plugin).
--
-- Now an unprocessed event with a key is `held` while an earlier event of its key is parked,
-- and the walk and the fallback's topics and keys read only events neither parked nor held.
-- The consumer stores an event behind a parked one held, and triggers keep the flag after
-- that, whoever writes the rows (a host of the previous version during a rolling deploy, an
-- operator's SQL):
--   * the consumer reads the key's parked row FOR SHARE (obx.inbox_event_held), so that a
--     release running at the same time either waits for the store or is waited for by it,
--     and either way sees the new row (a release's own update of the parked row takes the
--     row lock first, and its trigger's statements a snapshot after that); it does so only
--     when the plugin has a parked event at all, so that storing costs nothing more
--     otherwise (a trigger on every stored row took a sixth of the intake's rate);
--   * an event made unprocessed again (a batch's events that did not run behind a failed
--     one) is held if its key has a parked event;
--   * an event parked holds its key's later events, up to 1,000 of those already there, and
--     one released (retried, discarded, or gone) frees them.
-- The flag is a shortcut, not the rule: what makes an event its key's head is unchanged, the
-- first unprocessed event of the key, parked or held or neither, now read from two indexes
-- instead of one. An event the flag misses (stored while its key's event was being parked,
-- or by another writer, or past the first 1,000 of a backlog) is only read again, as every
-- such event was before; an event held with no parked event before it would never run, and
-- the triggers see that none is.
ALTER TABLE obx.inbox_event ADD COLUMN held boolean NOT NULL DEFAULT false;

UPDATE obx.inbox_event e SET held = true
WHERE NOT e.processed AND NOT e.parked AND e.partition_key IS NOT NULL
  AND EXISTS (SELECT 1 FROM obx.inbox_event p
              WHERE p.consumer = e.consumer AND p.topic = e.topic AND p.partition_key = e.partition_key
                AND NOT p.processed AND p.parked AND p.seq < e.seq);

-- The keys' events that can run, and the events that wait (parked, or held behind one): a
-- key's unprocessed events are in one or the other. The walk, the fallback's topics and keys
-- and a batch's candidates read the first; the head checks read both.
DROP INDEX obx.ix_inbox_event_key;
CREATE INDEX ix_inbox_event_key_live ON obx.inbox_event (consumer, topic, partition_key, seq)
    WHERE NOT processed AND NOT parked AND NOT held;
CREATE INDEX ix_inbox_event_key_waiting ON obx.inbox_event (consumer, topic, partition_key, seq)
    WHERE NOT processed AND (parked OR held);
DROP INDEX obx.ix_inbox_event_runnable;
CREATE INDEX ix_inbox_event_runnable ON obx.inbox_event (consumer, seq)
    WHERE NOT processed AND NOT parked AND NOT held;

-- A key's parked events, for the triggers below.
CREATE INDEX ix_inbox_event_parked ON obx.inbox_event (consumer, topic, partition_key, seq)
    WHERE parked AND NOT processed;

-- Whether an event of `p_consumer`, `p_topic` and `p_key` is to be held: its key has a parked
-- event. The parked row is read FOR SHARE (see above). The consumer stores an event with
-- it, once it has seen that the plugin has a parked event at all; the trigger below makes
-- an event unprocessed again with it. It runs as its owner: FOR SHARE needs more than the
-- INSERT a writer may have.
CREATE FUNCTION obx.inbox_event_held(p_consumer text, p_topic text, p_key text) RETURNS boolean
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT p_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM obx.inbox_event p
        WHERE p.consumer = p_consumer AND p.topic = p_topic AND p.partition_key = p_key
          AND p.parked AND NOT p.processed
        FOR SHARE)
$$;

-- An event made unprocessed again (a batch's events that did not run behind a failed one)
-- is held if its key has a parked event.
CREATE FUNCTION obx.inbox_event_hold() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.held := obx.inbox_event_held(NEW.consumer, NEW.topic, NEW.partition_key);
    RETURN NEW;
END $$;
CREATE TRIGGER inbox_event_unprocessed_behind_a_dead_letter BEFORE UPDATE OF processed ON obx.inbox_event
    FOR EACH ROW WHEN (OLD.processed AND NOT NEW.processed AND NOT NEW.parked AND NEW.partition_key IS NOT NULL)
    EXECUTE FUNCTION obx.inbox_event_hold();

-- When an event of a key is parked, or a parked one is released (retried, discarded, marked
-- processed, deleted), the key's events before its first parked event are freed, and up to
-- 1,000 after it held: parking costs the same behind any backlog, and the rest of a backlog
-- that was there before the park is read by claims as before 0033 (events stored later are
-- held as they come). The key's changes are taken one at a time (an advisory lock for the
-- transaction, then statements with snapshots after it), so that two releases of one key,
-- each seeing the other's event still parked, cannot leave its events held.
CREATE FUNCTION obx.inbox_key_parked() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_event obx.inbox_event := CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
    v_first bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(
        v_event.consumer || '/' || v_event.topic || '/' || v_event.partition_key, 33));
    -- Locked, not only read: in a transaction that keeps one snapshot (REPEATABLE READ, an
    -- operator's), a parked row another session has released since is a serialization
    -- failure here, not a key whose events stay held.
    SELECT p.seq INTO v_first FROM obx.inbox_event p
    WHERE p.consumer = v_event.consumer AND p.topic = v_event.topic
      AND p.partition_key = v_event.partition_key AND p.parked AND NOT p.processed
    ORDER BY p.seq LIMIT 1
    FOR SHARE;
    UPDATE obx.inbox_event e SET held = false
    WHERE e.consumer = v_event.consumer AND e.topic = v_event.topic
      AND e.partition_key = v_event.partition_key AND NOT e.processed AND e.held
      AND e.seq < coalesce(v_first, 9223372036854775807);
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
CREATE TRIGGER inbox_key_parked_or_released AFTER UPDATE OF parked, processed ON obx.inbox_event
    FOR EACH ROW WHEN (NEW.partition_key IS NOT NULL
        AND (OLD.parked AND NOT OLD.processed) <> (NEW.parked AND NOT NEW.processed))
    EXECUTE FUNCTION obx.inbox_key_parked();
CREATE TRIGGER inbox_key_parked_event_deleted AFTER DELETE ON obx.inbox_event
    FOR EACH ROW WHEN (OLD.partition_key IS NOT NULL AND OLD.parked AND NOT OLD.processed)
    EXECUTE FUNCTION obx.inbox_key_parked();
REVOKE EXECUTE ON FUNCTION obx.inbox_event_held(text, text, text), obx.inbox_event_hold(),
                           obx.inbox_key_parked() FROM PUBLIC;

-- As 0032's, with the topics and keys of the events that can run only: a key whose events
-- all wait is not visited. A key's head is its first event that can run, if no earlier one
-- waits.
CREATE OR REPLACE FUNCTION obx.inbox_heads(p_consumer text)
    RETURNS TABLE (event_id uuid, seq bigint)
    LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp SET max_parallel_workers_per_gather = 0 AS $$
    WITH RECURSIVE topics(topic) AS (
        (SELECT q.topic FROM obx.inbox_event q
         WHERE q.consumer = p_consumer AND NOT q.processed AND NOT q.parked AND NOT q.held
         ORDER BY q.topic LIMIT 1)
      UNION ALL
        SELECT n.topic FROM topics t CROSS JOIN LATERAL (
            SELECT q.topic FROM obx.inbox_event q
            WHERE q.consumer = p_consumer AND NOT q.processed AND NOT q.parked AND NOT q.held
              AND q.topic > t.topic
            ORDER BY q.topic LIMIT 1) n
    ), keys(topic, partition_key) AS (
        -- Within a topic, so that a step stops at its events with no key, which sort last.
        SELECT t.topic, f.partition_key FROM topics t CROSS JOIN LATERAL (
            SELECT q.partition_key FROM obx.inbox_event q
            WHERE q.consumer = p_consumer AND NOT q.processed AND NOT q.parked AND NOT q.held
              AND q.topic = t.topic AND q.partition_key IS NOT NULL
            ORDER BY q.partition_key LIMIT 1) f
      UNION ALL
        SELECT k.topic, n.partition_key FROM keys k CROSS JOIN LATERAL (
            SELECT q.partition_key FROM obx.inbox_event q
            WHERE q.consumer = p_consumer AND NOT q.processed AND NOT q.parked AND NOT q.held
              AND q.topic = k.topic AND q.partition_key > k.partition_key
            ORDER BY q.partition_key LIMIT 1) n
    )
    SELECT h.event_id, h.seq FROM keys k CROSS JOIN LATERAL (
        SELECT e.event_id, e.seq, e.next_attempt_at FROM obx.inbox_event e
        WHERE e.consumer = p_consumer AND e.topic = k.topic AND e.partition_key = k.partition_key
          AND NOT e.processed AND NOT e.parked AND NOT e.held
        ORDER BY e.seq LIMIT 1) h
    -- A scalar subquery, one index descent per key: as NOT EXISTS it may be planned as a
    -- hash of all the consumer's waiting events.
    WHERE (h.next_attempt_at IS NULL OR h.next_attempt_at <= now())
      AND h.seq < coalesce((
          SELECT min(w.seq) FROM obx.inbox_event w
          WHERE w.consumer = p_consumer AND w.topic = k.topic AND w.partition_key = k.partition_key
            AND NOT w.processed AND (w.parked OR w.held)), 9223372036854775807)
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

-- As 0032's, with the walk over the events that can run, and each "first unprocessed event
-- of the key" read from the key's events that can run and from those that wait.
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
    -- The head among the consumer's first 256 events that can run, in order
    -- (ix_inbox_event_runnable): each one's row is read by its primary key and locked as the
    -- walk reaches it, so the walk stops at the first that can be taken.
    SELECT e.* INTO v_head
    FROM (SELECT q.consumer, q.event_id, q.seq FROM obx.inbox_event q
          WHERE q.consumer = v_consumer AND NOT q.processed AND NOT q.parked AND NOT q.held
          ORDER BY q.seq
          LIMIT 256) w
    JOIN obx.inbox_event e ON e.consumer = w.consumer AND e.event_id = w.event_id
    WHERE NOT e.processed AND NOT e.parked
      AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
      AND (e.partition_key IS NULL OR (
           e.seq = (
               SELECT min(q.seq) FROM obx.inbox_event q
               WHERE q.consumer = e.consumer AND q.topic = e.topic AND q.partition_key = e.partition_key
                 AND NOT q.processed AND NOT q.parked AND NOT q.held)
           AND e.seq < coalesce((
               SELECT min(q.seq) FROM obx.inbox_event q
               WHERE q.consumer = e.consumer AND q.topic = e.topic AND q.partition_key = e.partition_key
                 AND NOT q.processed AND (q.parked OR q.held)), 9223372036854775807)))
    ORDER BY w.seq
    LIMIT 1
    FOR UPDATE OF e SKIP LOCKED;
    IF v_head.event_id IS NULL THEN
        -- Nothing at the front of the queue can be taken (keys in backoff, keys other
        -- processors hold): the heads, key by key, the first 64 tried in turn, each locked by
        -- its primary key (another session's skipped) and checked again.
        SELECT array_agg(h.event_id ORDER BY h.seq) INTO v_candidates FROM (
            SELECT h.event_id, h.seq FROM obx.inbox_heads(v_consumer) h
            ORDER BY h.seq LIMIT 64) h;
        FOREACH v_id IN ARRAY coalesce(v_candidates, '{}') LOOP
            SELECT * INTO v_head
            FROM obx.inbox_event e
            WHERE e.consumer = v_consumer AND e.event_id = v_id
              AND NOT e.processed AND NOT e.parked
              AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
              AND (e.partition_key IS NULL OR (
                   e.seq = (
                       SELECT min(q.seq) FROM obx.inbox_event q
                       WHERE q.consumer = e.consumer AND q.topic = e.topic AND q.partition_key = e.partition_key
                         AND NOT q.processed AND NOT q.parked AND NOT q.held)
                   AND e.seq < coalesce((
                       SELECT min(q.seq) FROM obx.inbox_event q
                       WHERE q.consumer = e.consumer AND q.topic = e.topic AND q.partition_key = e.partition_key
                         AND NOT q.processed AND (q.parked OR q.held)), 9223372036854775807)))
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
              AND NOT r.processed AND NOT r.parked AND NOT r.held AND r.seq >= v_head.seq
              AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= now())
              -- Before the first that waits: in backoff among the batch's next events (a key's
              -- whole backlog would be read at every batch), or parked or held.
              AND r.seq < coalesce(least(
                  (SELECT min(w.seq) FROM (
                      SELECT q.seq, q.next_attempt_at FROM obx.inbox_event q
                      WHERE q.consumer = v_consumer AND q.topic = v_head.topic
                        AND q.partition_key = v_head.partition_key
                        AND NOT q.processed AND NOT q.parked AND NOT q.held AND q.seq > v_head.seq
                      ORDER BY q.seq
                      LIMIT v_limit) w
                   WHERE w.next_attempt_at > now()),
                  (SELECT min(q.seq) FROM obx.inbox_event q
                   WHERE q.consumer = v_consumer AND q.topic = v_head.topic
                     AND q.partition_key = v_head.partition_key
                     AND NOT q.processed AND (q.parked OR q.held) AND q.seq > v_head.seq)),
                  9223372036854775807)
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
          AND NOT r.processed AND NOT r.parked AND NOT r.held
          AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= now())
          AND r.seq < coalesce(least(
              (SELECT min(q.seq) FROM obx.inbox_event q
               WHERE q.consumer = v_consumer AND q.topic = v_head.topic
                 AND q.partition_key = v_head.partition_key
                 AND NOT q.processed AND NOT q.parked AND NOT q.held
                 AND q.seq > v_head.seq AND q.event_id <> ALL (v_locked)),
              (SELECT min(q.seq) FROM obx.inbox_event q
               WHERE q.consumer = v_consumer AND q.topic = v_head.topic
                 AND q.partition_key = v_head.partition_key
                 AND NOT q.processed AND (q.parked OR q.held) AND q.seq > v_head.seq)),
              9223372036854775807)
          AND NOT EXISTS (
              SELECT 1 FROM obx.inbox_event q
              WHERE q.consumer = v_consumer AND q.topic = v_head.topic
                AND q.partition_key = v_head.partition_key
                AND NOT q.processed AND NOT q.parked AND NOT q.held AND q.seq < v_head.seq)
          AND NOT EXISTS (
              SELECT 1 FROM obx.inbox_event q
              WHERE q.consumer = v_consumer AND q.topic = v_head.topic
                AND q.partition_key = v_head.partition_key
                AND NOT q.processed AND (q.parked OR q.held) AND q.seq < v_head.seq)
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

-- As 0025's, with "its key has an unprocessed event in the inbox" read from both indexes.
CREATE OR REPLACE FUNCTION obx_api.begin_events(p_event_ids uuid[], p_topics text[], p_keys text[])
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
               u.key IS NOT NULL AND (
                   EXISTS (
                       SELECT 1 FROM obx.inbox_event e
                       WHERE e.consumer = v_consumer AND e.topic = u.topic AND e.partition_key = u.key
                         AND NOT e.processed AND NOT e.parked AND NOT e.held)
                   OR EXISTS (
                       SELECT 1 FROM obx.inbox_event e
                       WHERE e.consumer = v_consumer AND e.topic = u.topic AND e.partition_key = u.key
                         AND NOT e.processed AND (e.parked OR e.held)))
               AND NOT EXISTS (
                   SELECT 1 FROM obx.processed_event p
                   WHERE p.consumer = v_consumer AND p.event_id = u.event_id) AS parked
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
