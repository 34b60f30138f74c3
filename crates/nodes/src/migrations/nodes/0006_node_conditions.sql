-- The node job's record of each node's conditions: since when each has held with its reason, for
-- the conditions whose owning rows do not say (cordoned, quarantined GPUs, …).
CREATE TABLE node_conditions (
  node_id text NOT NULL REFERENCES nodes ON DELETE CASCADE,
  type text NOT NULL,
  reason text NOT NULL,
  message text NOT NULL,
  since timestamptz NOT NULL,
  PRIMARY KEY (node_id, type)
);

-- Since when the node has been converged (observed_generation >= generation) or converging.
ALTER TABLE nodes ADD COLUMN convergence_since timestamptz;
