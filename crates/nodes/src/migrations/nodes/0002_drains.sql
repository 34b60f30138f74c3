-- Drains: an operator's request to empty a node, admitted per pool in request order within the
-- pool's disruption budget; and retired nodes, out of placement forever with their history kept.

-- The pool's disruption budget: at most this many of its nodes (or this share of them, rounded up)
-- unavailable at once through drains, counting the nodes that are unreachable or lost. Neither set:
-- no limit.
ALTER TABLE pools
  ADD COLUMN max_unavailable integer CHECK (max_unavailable IS NULL OR max_unavailable >= 0),
  ADD COLUMN max_unavailable_percent integer CHECK (max_unavailable_percent IS NULL OR max_unavailable_percent BETWEEN 0 AND 100),
  ADD CONSTRAINT pools_one_budget CHECK (max_unavailable IS NULL OR max_unavailable_percent IS NULL);

ALTER TABLE nodes ADD COLUMN retired_at timestamptz;

CREATE TABLE node_drains (
  id text PRIMARY KEY,
  node_id text NOT NULL REFERENCES nodes,
  pool_id text NOT NULL REFERENCES pools,
  -- wait: reservations end by themselves; evict: they end at the deadline with reason drained
  mode text NOT NULL CHECK (mode IN ('wait', 'evict')),
  reason text NOT NULL CHECK (reason <> ''),
  deadline timestamptz,
  state text NOT NULL CHECK (state IN ('queued', 'draining', 'drained', 'cancelled', 'retired')),
  requested_by text NOT NULL,
  requested_at timestamptz NOT NULL DEFAULT compute_now(),
  admitted_at timestamptz,
  eviction_requested_at timestamptz,
  drained_at timestamptz,
  ended_at timestamptz,
  -- the node's Draining condition: why the drain is where it is, and since when
  condition_reason text NOT NULL,
  condition_message text NOT NULL,
  condition_since timestamptz NOT NULL DEFAULT compute_now(),
  version bigint NOT NULL DEFAULT 1,
  CHECK ((mode = 'evict') = (deadline IS NOT NULL)),
  CHECK (state NOT IN ('draining', 'drained', 'retired') OR admitted_at IS NOT NULL),
  CHECK (state NOT IN ('drained', 'retired') OR drained_at IS NOT NULL),
  CHECK ((state IN ('cancelled', 'retired')) = (ended_at IS NOT NULL))
);
-- One open drain a node; a retired node's drain stays, so it is never drained again.
CREATE UNIQUE INDEX node_drains_open ON node_drains (node_id) WHERE state <> 'cancelled';
CREATE INDEX node_drains_pool ON node_drains (pool_id, requested_at, id) WHERE state IN ('queued', 'draining', 'drained');
