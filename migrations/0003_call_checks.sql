-- What the host reads from a plugin session at the start and at the end of each call, as
-- functions: PL/pgSQL keeps their plans for the session, where the same statements sent as
-- text were parsed, analysed and planned at every call (about a quarter of a native
-- command's database time). They run as the plugin (SECURITY INVOKER) and touch only the
-- session's own state (`call_check` releases its advisory locks); every name is qualified,
-- since the session's search path is the plugin's to change.

-- The session's backend, the start of its transaction (microseconds since the epoch), and
-- the prepared statements made with SQL since the session was last checked (at a previous
-- call's COMMIT, plugin code can still run: a deferred constraint trigger). Releases the
-- session's advisory locks.
CREATE FUNCTION obx_api.call_begin(OUT pid integer, OUT started bigint, OUT prepared bigint)
    LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    pid := pg_catalog.pg_backend_pid();
    started := pg_catalog.int8(pg_catalog.date_part('epoch', pg_catalog.now()) OPERATOR(pg_catalog.*) 1000000);
    SELECT pg_catalog.count(*) INTO prepared FROM pg_catalog.pg_prepared_statements AS s WHERE s.from_sql;
    PERFORM pg_catalog.pg_advisory_unlock_all();
END $$;

-- The start of the transaction, read before the commit: another one if the plugin ended the
-- host's transaction itself. Releases the session's advisory locks.
CREATE FUNCTION obx_api.call_check(OUT started bigint)
    LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    started := pg_catalog.int8(pg_catalog.date_part('epoch', pg_catalog.now()) OPERATOR(pg_catalog.*) 1000000);
    PERFORM pg_catalog.pg_advisory_unlock_all();
END $$;

REVOKE EXECUTE ON FUNCTION obx_api.call_begin(), obx_api.call_check() FROM PUBLIC;
