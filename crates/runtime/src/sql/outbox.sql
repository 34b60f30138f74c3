-- The outbox's emit as a SQL function, so that writes that run in the database emit events through
-- the statement outbox::emit runs. It returns the id, so callers assign instead of PERFORM.

-- Writes an event in the caller's transaction; returns its id.
CREATE OR REPLACE FUNCTION outbox_emit(p_id text, p_type text, p_tenant_id text, p_subject text, p_data jsonb) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO outbox (id, type, tenant_id, subject, data) VALUES (p_id, p_type, p_tenant_id, p_subject, p_data);
  RETURN p_id;
END $$;
