-- GPU health: each GPU's place in the health job's state machine, the signals daemons report, the
-- history of transitions, and each pool's circuit breaker.

ALTER TABLE devices
  ADD COLUMN health_state text NOT NULL DEFAULT 'healthy' CHECK (health_state IN ('healthy', 'suspect', 'unhealthy', 'recovering')),
  ADD COLUMN health_since timestamptz,
  ADD COLUMN health_reason text,
  -- clean diag.nvml checks in a row while suspect or recovering
  ADD COLUMN clean_checks integer NOT NULL DEFAULT 0 CHECK (clean_checks >= 0),
  -- when the next check is due, and the check in flight
  ADD COLUMN next_check_at timestamptz,
  ADD COLUMN check_command_id text,
  -- healthy is the health state's shadow, which the placer and counts read
  ADD CONSTRAINT devices_healthy_is_the_health_state CHECK (parent_id IS NOT NULL OR healthy = (health_state = 'healthy'));

-- The circuit breaker: when more than this share of a pool's GPUs (at least one) leave placement
-- for health within the window, automatic health actions stop for the pool until an operator
-- closes the circuit.
ALTER TABLE pools
  ADD COLUMN health_breaker_percent integer NOT NULL DEFAULT 10 CHECK (health_breaker_percent BETWEEN 1 AND 100),
  ADD COLUMN health_breaker_window_s integer NOT NULL DEFAULT 600 CHECK (health_breaker_window_s > 0),
  ADD COLUMN health_circuit_open_since timestamptz;

-- What daemons reported, classified, until the health job has acted on it.
CREATE TABLE gpu_health_signals (
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  node_id text NOT NULL REFERENCES nodes,
  -- the GPU's uuid as reported (a GPU the inventory does not know is kept, and ignored)
  device_id text NOT NULL,
  kind text NOT NULL CHECK (kind IN ('xid', 'unhealthy', 'pcie', 'throttle')),
  class text NOT NULL CHECK (class IN ('informational', 'transient', 'fatal')),
  detail text NOT NULL,
  observed_at timestamptz NOT NULL DEFAULT compute_now(),
  processed_at timestamptz,
  -- what the job did with it
  outcome text
);
CREATE INDEX gpu_health_signals_pending ON gpu_health_signals (node_id, id) WHERE processed_at IS NULL;
CREATE INDEX gpu_health_signals_device ON gpu_health_signals (device_id, observed_at);

-- Every health transition of a GPU.
CREATE TABLE gpu_health_history (
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  device_id text NOT NULL REFERENCES devices,
  pool_id text NOT NULL REFERENCES pools,
  from_state text NOT NULL,
  to_state text NOT NULL,
  reason text NOT NULL,
  at timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX gpu_health_history_device ON gpu_health_history (device_id, id);
CREATE INDEX gpu_health_history_pool ON gpu_health_history (pool_id, at);
