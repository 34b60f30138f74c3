-- A GPU's counters as its daemon last reported them (uncorrectable ECC errors, retired pages,
-- remapped rows, NVLink errors, and the pending and failed flags), so a report's increases become
-- health signals once, not at every report.
ALTER TABLE devices ADD COLUMN health_counters jsonb;

-- A signal from a counter that rose (health.rs).
ALTER TABLE gpu_health_signals DROP CONSTRAINT gpu_health_signals_kind_check,
  ADD CONSTRAINT gpu_health_signals_kind_check CHECK (kind IN ('xid', 'unhealthy', 'pcie', 'throttle', 'counter'));
