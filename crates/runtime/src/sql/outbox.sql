-- The outbox's writes as SQL functions, so that writes that run in the database emit events through
-- the statement outbox::emit runs, one event or a batch's. Each returns a value, so PL/pgSQL callers
-- assign instead of PERFORM, which runs a query.

-- Writes events in the caller's transaction, in array order; returns how many.
CREATE OR REPLACE FUNCTION outbox_emit_many(p_ids text[], p_types text[], p_tenant_ids text[], p_subjects text[],
                                            p_data jsonb[]) RETURNS int
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO outbox (id, type, tenant_id, subject, data)
  SELECT e.id, e.type, e.tenant_id, e.subject, e.data
    FROM unnest(p_ids, p_types, p_tenant_ids, p_subjects, p_data) WITH ORDINALITY AS e(id, type, tenant_id, subject, data, o)
   ORDER BY e.o;
  RETURN cardinality(p_ids);
END $$;

-- Writes one event in the caller's transaction; returns its id.
CREATE OR REPLACE FUNCTION outbox_emit(p_id text, p_type text, p_tenant_id text, p_subject text, p_data jsonb) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  v_n int;
BEGIN
  v_n := outbox_emit_many(ARRAY[p_id], ARRAY[p_type], ARRAY[p_tenant_id], ARRAY[p_subject], ARRAY[p_data]);
  RETURN p_id;
END $$;

-- Takes back events the caller's own transaction emitted (an undo before it commits); an event of
-- any other transaction is never touched. Returns how many.
CREATE OR REPLACE FUNCTION outbox_withdraw(p_ids text[]) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  v_n int;
BEGIN
  DELETE FROM outbox WHERE id = ANY(p_ids) AND txid = pg_current_xact_id();
  GET DIAGNOSTICS v_n = ROW_COUNT;
  RETURN v_n;
END $$;
