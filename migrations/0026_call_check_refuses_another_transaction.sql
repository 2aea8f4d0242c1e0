-- The check before a call's commit now refuses to go on in a transaction that is not the
-- call's own. It was a reading only: a plugin that ended the host's transaction itself (a
-- `ROLLBACK` or `COMMIT` that got past the SQL policy) left the rest of the commit's round
-- trip (its outbox rows, its Idempotency-Key answer, the `COMMIT`) to run in whatever
-- transaction was open then, or in the round trip's implicit one, and so to commit events of
-- writes that had been rolled back, without the key's claim. The host saw the change only
-- after that commit. Raised here, the error ends the round trip before any of it runs, and
-- the call fails. SQLSTATE OBX01 tells the host what happened.
--
-- `p_started` is the start of the call's transaction as `obx_api.call_begin` read it. Hosts
-- of the previous version, during a rolling deploy, keep calling `obx_api.call_check()`.
CREATE FUNCTION obx_api.call_check(p_started bigint, OUT started bigint)
    LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    started := pg_catalog.int8(pg_catalog.date_part('epoch', pg_catalog.now()) OPERATOR(pg_catalog.*) 1000000);
    PERFORM pg_catalog.pg_advisory_unlock_all();
    IF started IS DISTINCT FROM p_started THEN
        RAISE EXCEPTION 'the plugin ended the host''s transaction itself: nothing of the call commits'
            USING ERRCODE = 'OBX01';
    END IF;
END $$;

REVOKE EXECUTE ON FUNCTION obx_api.call_check(bigint) FROM PUBLIC;
