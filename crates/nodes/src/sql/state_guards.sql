-- Generated from better_compute_core::state (GUARDED_COLUMNS); do not edit. The state tables'
-- guards for this module's tables: the database refuses an illegal edge whoever writes it.
-- Rewrite with: UPDATE_STATE_GUARDS=1 cargo nextest run -p better-compute-core

-- command: no statement moves commands.state along an edge the state table does not declare.
CREATE OR REPLACE FUNCTION commands_state_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT (p_from, p_to) IN (('pending', 'sent'), ('pending', 'expired'), ('pending', 'cancelled'), ('sent', 'pending'), ('sent', 'running'), ('sent', 'succeeded'), ('sent', 'failed'), ('sent', 'expired'), ('sent', 'cancelled'), ('running', 'succeeded'), ('running', 'failed'), ('running', 'cancelled'))
$$;

CREATE OR REPLACE FUNCTION commands_state_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT commands_state_may_become(OLD.state, NEW.state) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a command in state %s cannot become %s', OLD.state, NEW.state),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.state, 'to', NEW.state)::text;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER commands_state_guard BEFORE UPDATE OF state ON commands
  FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION commands_state_guard();

-- GPU health: no statement moves devices.health_state along an edge the state table does not declare.
CREATE OR REPLACE FUNCTION devices_health_state_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT (p_from, p_to) IN (('healthy', 'suspect'), ('healthy', 'unhealthy'), ('suspect', 'recovering'), ('suspect', 'unhealthy'), ('recovering', 'healthy'), ('recovering', 'suspect'), ('recovering', 'unhealthy'), ('unhealthy', 'recovering'))
$$;

CREATE OR REPLACE FUNCTION devices_health_state_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT devices_health_state_may_become(OLD.health_state, NEW.health_state) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a GPU health in state %s cannot become %s', OLD.health_state, NEW.health_state),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.health_state, 'to', NEW.health_state)::text;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER devices_health_state_guard BEFORE UPDATE OF health_state ON devices
  FOR EACH ROW WHEN (OLD.health_state IS DISTINCT FROM NEW.health_state) EXECUTE FUNCTION devices_health_state_guard();

-- drain: no statement moves node_drains.state along an edge the state table does not declare.
CREATE OR REPLACE FUNCTION node_drains_state_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT (p_from, p_to) IN (('queued', 'draining'), ('queued', 'cancelled'), ('draining', 'drained'), ('draining', 'cancelled'), ('drained', 'cancelled'), ('drained', 'retired'))
$$;

CREATE OR REPLACE FUNCTION node_drains_state_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT node_drains_state_may_become(OLD.state, NEW.state) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a drain in state %s cannot become %s', OLD.state, NEW.state),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.state, 'to', NEW.state)::text;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER node_drains_state_guard BEFORE UPDATE OF state ON node_drains
  FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION node_drains_state_guard();
