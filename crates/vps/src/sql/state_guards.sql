-- Generated from better_compute_core::state (GUARDED_COLUMNS); do not edit. The state tables'
-- guards for this module's tables: the database refuses an illegal edge whoever writes it.
-- Rewrite with: UPDATE_STATE_GUARDS=1 cargo nextest run -p better-compute-core

-- instance: no statement moves instances.state along an edge the state table does not declare.
CREATE OR REPLACE FUNCTION instances_state_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT (p_from, p_to) IN (('requested', 'provisioning'), ('requested', 'deleting'), ('requested', 'deleted'), ('provisioning', 'running'), ('provisioning', 'stopping'), ('provisioning', 'deleting'), ('provisioning', 'failed'), ('running', 'stopping'), ('running', 'deleting'), ('running', 'failed'), ('stopping', 'stopped'), ('stopping', 'deleting'), ('stopped', 'provisioning'), ('stopped', 'deleting'), ('failed', 'deleting'), ('deleting', 'deleted'))
$$;

CREATE OR REPLACE FUNCTION instances_state_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT instances_state_may_become(OLD.state, NEW.state) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a instance in state %s cannot become %s', OLD.state, NEW.state),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.state, 'to', NEW.state)::text;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER instances_state_guard BEFORE UPDATE OF state ON instances
  FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION instances_state_guard();
