-- Generated from better_compute_core::state (GUARDED_COLUMNS); do not edit. The state tables'
-- guards for this module's tables: the database refuses an illegal edge whoever writes it.
-- Rewrite with: UPDATE_STATE_GUARDS=1 cargo nextest run -p better-compute-core

-- reservation: no statement moves reservations.state along an edge the state table does not declare.
CREATE OR REPLACE FUNCTION reservations_state_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT (p_from, p_to) IN (('pending', 'placed'), ('pending', 'released'), ('pending', 'expired'), ('pending', 'failed'), ('placed', 'active'), ('placed', 'released'), ('placed', 'expired'), ('placed', 'failed'), ('active', 'released'), ('active', 'expired'), ('active', 'failed'))
$$;

CREATE OR REPLACE FUNCTION reservations_state_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT reservations_state_may_become(OLD.state, NEW.state) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a reservation in state %s cannot become %s', OLD.state, NEW.state),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.state, 'to', NEW.state)::text;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER reservations_state_guard BEFORE UPDATE OF state ON reservations
  FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION reservations_state_guard();
