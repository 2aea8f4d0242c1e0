-- An Idempotency-Key whose row retention deletes between the claim's insert (which found it)
-- and its read (which then finds nothing) is claimed afresh. It read as a stored request of
-- no hash, and the retry of a command at its key's 24-hour boundary was answered 422
-- `idempotency_key_reused`. Otherwise as in 0002_plugin_sessions.sql.
CREATE OR REPLACE FUNCTION obx_api.claim_idempotency_key(p_key text, p_request_hash bytea,
    OUT fresh boolean, OUT stored_hash bytea, OUT status smallint, OUT response bytea)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_plugin text := (obx.session_plugin()).name;
BEGIN
    LOOP
        INSERT INTO obx.idempotency_key (plugin, key, request_hash)
        VALUES (v_plugin, p_key, p_request_hash)
        ON CONFLICT ON CONSTRAINT idempotency_key_pkey DO NOTHING;
        fresh := FOUND;
        EXIT WHEN fresh;
        SELECT k.request_hash, k.status, k.response INTO stored_hash, status, response
        FROM obx.idempotency_key k WHERE k.plugin = v_plugin AND k.key = p_key;
        EXIT WHEN FOUND;
    END LOOP;
END $$;
