-- Generated from better_compute_core::state (GUARDED_COLUMNS); do not edit. The state tables'
-- guards for this module's tables: the database refuses an illegal edge whoever writes it.
-- Rewrite with: UPDATE_STATE_GUARDS=1 cargo nextest run -p better-compute-core

-- workflow: no statement moves workflows.state along an edge the state table does not declare.
CREATE OR REPLACE FUNCTION workflows_state_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT (p_from, p_to) IN (('running', 'held'), ('running', 'cancelling'), ('running', 'succeeded'), ('running', 'failed'), ('held', 'running'), ('held', 'cancelling'), ('cancelling', 'cancelled'))
$$;

CREATE OR REPLACE FUNCTION workflows_state_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT workflows_state_may_become(OLD.state, NEW.state) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a workflow in state %s cannot become %s', OLD.state, NEW.state),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.state, 'to', NEW.state)::text;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER workflows_state_guard BEFORE UPDATE OF state ON workflows
  FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION workflows_state_guard();

-- workflow step: no statement moves workflow_steps.state along an edge the state table does not declare.
CREATE OR REPLACE FUNCTION workflow_steps_state_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT (p_from, p_to) IN (('pending', 'running'), ('pending', 'skipped'), ('pending', 'cancelled'), ('running', 'retrying'), ('running', 'succeeded'), ('running', 'failed'), ('running', 'cancelled'), ('retrying', 'running'), ('retrying', 'cancelled'), ('failed', 'pending'), ('failed', 'skipped'), ('failed', 'cancelled'), ('succeeded', 'pending'), ('skipped', 'pending'))
$$;

CREATE OR REPLACE FUNCTION workflow_steps_state_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT workflow_steps_state_may_become(OLD.state, NEW.state) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a workflow step in state %s cannot become %s', OLD.state, NEW.state),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.state, 'to', NEW.state)::text;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER workflow_steps_state_guard BEFORE UPDATE OF state ON workflow_steps
  FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION workflow_steps_state_guard();
