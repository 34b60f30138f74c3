-- Each pool's health circuit in a row of its own. A health run takes its pool's circuit row for
-- the run (the breaker counts the pool's GPUs, so the pool's runs go one at a time); placements
-- take the pool's row FOR SHARE, and while the circuit sat on that row every health run held up
-- every placement in its pool until it committed. The row is made with its pool (a trigger,
-- sql/health.sql).
CREATE TABLE pool_health_circuits (
  pool_id text PRIMARY KEY REFERENCES pools ON DELETE CASCADE,
  -- open: automatic health actions wait for an operator (pools.closeHealthCircuit)
  open_since timestamptz
);
INSERT INTO pool_health_circuits (pool_id, open_since) SELECT id, health_circuit_open_since FROM pools;
ALTER TABLE pools DROP COLUMN health_circuit_open_since;
