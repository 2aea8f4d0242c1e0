-- Delayed events (`outbox.emit-delayed` of obx:plugin@0.2.1). A delayed event waits here, not
-- in obx.outbox_event, so that the relay's claim never walks past events that are not due.
-- The relay releases due events into obx.outbox_event (obx.outbox_release_due): a released
-- event takes its place in its key's order at that moment, after every event of its key
-- already in the outbox and before every one that comes later. It never holds back events of
-- its key that are already due, and none holds it back past its due time.
CREATE TABLE obx.outbox_delayed (
    -- Emit order, for events due at the same moment.
    seq             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid        NOT NULL UNIQUE,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    topic           text        NOT NULL,
    partition_key   text        NOT NULL,
    created_at      timestamptz NOT NULL,
    plugin_name     text        NOT NULL,
    plugin_version  text        NOT NULL,
    traceparent     text,
    due_at          timestamptz NOT NULL
);
CREATE INDEX ix_outbox_delayed_due ON obx.outbox_delayed(due_at, seq);

-- When a released event was due; NULL for an event published on commit. Its created_at is
-- the moment it was released into the outbox.
ALTER TABLE obx.outbox_event ADD COLUMN publish_after timestamptz;

-- Writes a call's delayed events, as the calling plugin: obx_api.emit checks and writes them
-- exactly as it does any event, then they move to obx.outbox_delayed in this same
-- transaction, each due p_delays_ms after the database's clock. Checks its input as if a
-- hostile plugin called it, which it can.
CREATE FUNCTION obx_api.emit_delayed(
    p_version text, p_traceparent text, p_event_ids uuid[], p_aggregate_types text[],
    p_aggregate_ids text[], p_event_types text[], p_payloads text[], p_topics text[],
    p_partition_keys text[], p_delays_ms bigint[]
) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_count integer := coalesce(cardinality(p_event_ids), 0);
    v_moved integer;
BEGIN
    IF coalesce(cardinality(p_delays_ms), -1) <> v_count THEN
        RAISE EXCEPTION 'emit: the arrays differ in length' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_delays_ms) AS d(ms) WHERE ms IS NULL OR ms NOT BETWEEN 0 AND 315576000000) THEN
        RAISE EXCEPTION 'an event delay is 0 to 10 years' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_count = 0 THEN
        RETURN 0;
    END IF;
    PERFORM obx_api.emit(p_version, p_traceparent, p_event_ids, p_aggregate_types, p_aggregate_ids,
                         p_event_types, p_payloads, p_topics, p_partition_keys);
    WITH moved AS (
        DELETE FROM obx.outbox_event o WHERE o.event_id = ANY(p_event_ids) AND o.published_at IS NULL
        RETURNING o.*
    )
    INSERT INTO obx.outbox_delayed
        (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
         created_at, plugin_name, plugin_version, traceparent, due_at)
    SELECT m.event_id, m.aggregate_type, m.aggregate_id, m.event_type, m.payload, m.topic,
           m.partition_key, m.created_at, m.plugin_name, m.plugin_version, m.traceparent,
           m.created_at + make_interval(secs => d.ms / 1000.0)
    FROM moved m JOIN unnest(p_event_ids, p_delays_ms) AS d(event_id, ms) USING (event_id)
    ORDER BY m.id;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> v_count THEN
        RAISE EXCEPTION 'emit: an event id appears twice in one call' USING ERRCODE = 'unique_violation';
    END IF;
    RETURN v_count;
END $$;
REVOKE EXECUTE ON FUNCTION obx_api.emit_delayed(text, text, uuid[], text[], text[], text[], text[], text[], text[], bigint[])
    FROM PUBLIC;

-- Moves up to p_limit due delayed events into the outbox, earliest first, and says how long
-- until the next one is due. Movers take their rows in one order and wait for one another,
-- so the events of a key enter the outbox in due order however many relays run. An event
-- whose id another event took meanwhile is that event (consumers would drop it as a
-- duplicate): it is not published twice.
CREATE FUNCTION obx.outbox_release_due(p_limit integer, OUT released integer, OUT next_due_ms bigint)
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
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
    SELECT ceil(greatest(extract(epoch FROM min(d.due_at) - clock_timestamp()), 0) * 1000)::bigint
    INTO next_due_ms FROM obx.outbox_delayed d;
END $$;
