-- Dedup mode: an event already processed by the calling plugin is a duplicate even when its
-- key is parked behind a dead letter. obx_api.begin_events reported such an event as parked,
-- so the consumer stored it in the inbox behind the dead letter, where its duplicate check
-- waited for the letter to be resolved; a letter left longer than `retention.processed_after`
-- let retention delete the event's processed_event row first, and the retry then ran the
-- event a second time, after the events that followed it. Now the check is made when the
-- event arrives: it is neither parked nor fresh, and is skipped.
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
               u.key IS NOT NULL AND EXISTS (
                   SELECT 1 FROM obx.inbox_event e
                   WHERE e.consumer = v_consumer AND e.topic = u.topic AND e.partition_key = u.key
                     AND NOT e.processed)
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
