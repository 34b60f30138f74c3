-- Drains (drain.rs).

-- The drain state table's guard is generated (state_guards.sql); these were its hand-written copy.
DROP FUNCTION IF EXISTS nodes_drain_state_guard();
DROP FUNCTION IF EXISTS nodes_drain_may_become(text, text);

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
