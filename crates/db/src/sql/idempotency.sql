-- Idempotency keys: the statements that claim, answer and forget them, for one request
-- (idempotency.rs) and for many at once (the batch placer), so both run the same rules. Keys are
-- scoped to (tenant, identity, key). Each function returns a value, so PL/pgSQL callers assign
-- instead of PERFORM, which runs a query.

-- Claims keys for new requests: a key not in use is inserted, an expired one taken over as if it
-- were absent; a live one is left alone (and a live row of another transaction is waited for).
-- Rows in key order, so two claims of overlapping keys cannot deadlock. Returns the keys claimed.
CREATE OR REPLACE FUNCTION idempotency_claim(p_tenants text[], p_identities text[], p_keys text[], p_method text,
                                             p_hashes bytea[], p_ttl_s float8)
RETURNS TABLE (tenant_id text, identity_id text, key text)
LANGUAGE sql AS $$
  INSERT INTO idempotency_keys AS k (tenant_id, identity_id, key, method, request_sha256, expires_at)
  SELECT c.tenant_id, c.identity_id, c.key, p_method, c.hash, compute_now() + make_interval(secs => p_ttl_s)
    FROM unnest(p_tenants, p_identities, p_keys, p_hashes) AS c(tenant_id, identity_id, key, hash)
   ORDER BY c.tenant_id, c.identity_id, c.key
  ON CONFLICT (tenant_id, identity_id, key) DO UPDATE
     SET method = EXCLUDED.method, request_sha256 = EXCLUDED.request_sha256, response = NULL,
         created_at = compute_now(), expires_at = EXCLUDED.expires_at
   WHERE k.expires_at <= compute_now()
  RETURNING k.tenant_id, k.identity_id, k.key
$$;

-- Stores each claimed key's response, for replays; returns how many keys it found.
CREATE OR REPLACE FUNCTION idempotency_answer(p_tenants text[], p_identities text[], p_keys text[], p_responses jsonb[])
RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  v_n int;
BEGIN
  UPDATE idempotency_keys k SET response = a.response
    FROM unnest(p_tenants, p_identities, p_keys, p_responses) AS a(tenant_id, identity_id, key, response)
   WHERE k.tenant_id = a.tenant_id AND k.identity_id = a.identity_id AND k.key = a.key;
  GET DIAGNOSTICS v_n = ROW_COUNT;
  RETURN v_n;
END $$;

-- Gives back keys claimed earlier in the caller's transaction for requests it did not do; returns
-- how many.
CREATE OR REPLACE FUNCTION idempotency_forget(p_tenants text[], p_identities text[], p_keys text[]) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  v_n int;
BEGIN
  DELETE FROM idempotency_keys k
   USING unnest(p_tenants, p_identities, p_keys) AS f(tenant_id, identity_id, key)
   WHERE k.tenant_id = f.tenant_id AND k.identity_id = f.identity_id AND k.key = f.key;
  GET DIAGNOSTICS v_n = ROW_COUNT;
  RETURN v_n;
END $$;
