-- Drains (drain.rs).

-- DRAIN_STATE_TABLE (better_compute_core::state) as the database enforces it: no statement moves a
-- drain along a transition the table does not declare. A test compares the two.
CREATE OR REPLACE FUNCTION nodes_drain_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT (p_from, p_to) IN (('queued', 'draining'), ('queued', 'cancelled'), ('draining', 'drained'),
                            ('draining', 'cancelled'), ('drained', 'cancelled'), ('drained', 'retired'))
$$;

CREATE OR REPLACE FUNCTION nodes_drain_state_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT nodes_drain_may_become(OLD.state, NEW.state) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a drain in state %s cannot become %s', OLD.state, NEW.state),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.state, 'to', NEW.state)::text;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER node_drains_state_guard BEFORE UPDATE OF state ON node_drains
  FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION nodes_drain_state_guard();

-- How many of a pool's nodes its disruption budget lets be unavailable at once (NULL: no limit).
-- A share is of the pool's nodes that are not retired, rounded up.
CREATE OR REPLACE FUNCTION nodes_pool_budget(p_pool text) RETURNS integer
LANGUAGE sql STABLE AS $$
  SELECT CASE WHEN p.max_unavailable IS NOT NULL THEN p.max_unavailable
              WHEN p.max_unavailable_percent IS NOT NULL THEN
                ceil(p.max_unavailable_percent * (SELECT count(*) FROM nodes n WHERE n.pool_id = p.id AND n.retired_at IS NULL) / 100.0)::int
         END
    FROM pools p WHERE p.id = p_pool
$$;
