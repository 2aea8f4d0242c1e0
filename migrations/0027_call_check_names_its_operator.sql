-- obx_api.call_check(p_started), from 0026, compared the two starts with IS DISTINCT FROM,
-- whose `=` is looked up through the session's search_path. The function has no search_path
-- of its own (so that the session keeps its plan), and the plugin it guards against is one
-- that got past the SQL policy: such a plugin could also put a schema of its own before
-- pg_catalog, with an `=` on two bigints that always holds, and so pass the check. The
-- operator is named here, as every other call in the function is.
CREATE OR REPLACE FUNCTION obx_api.call_check(p_started bigint, OUT started bigint)
    LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    started := pg_catalog.int8(pg_catalog.date_part('epoch', pg_catalog.now()) OPERATOR(pg_catalog.*) 1000000);
    PERFORM pg_catalog.pg_advisory_unlock_all();
    IF p_started IS NULL OR started OPERATOR(pg_catalog.<>) p_started THEN
        RAISE EXCEPTION 'the plugin ended the host''s transaction itself: nothing of the call commits'
            USING ERRCODE = 'OBX01';
    END IF;
END $$;
