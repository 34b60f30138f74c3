-- Instance usage (the `vps.usage` job): when each instance's VM was up, and one row per instance and
-- closed usage window with the seconds it was up, under the billing key
-- `cmp:<instanceId>:<windowStart>`. The windows are capacity's (`usage_settings`).

-- What an instance is metered as: its reservation's flavour, fixed at create.
ALTER TABLE instances ADD COLUMN flavour text NOT NULL DEFAULT '';
-- Every window that ends by usage_closed_until is metered.
ALTER TABLE instances ADD COLUMN usage_closed_until timestamptz;

-- A stretch of time an instance's VM was up (running or stopping); open while it still is.
CREATE TABLE instance_runs (
  instance_id text NOT NULL REFERENCES instances,
  during tstzrange NOT NULL CHECK (NOT isempty(during) AND NOT lower_inf(during)),
  EXCLUDE USING gist (instance_id WITH =, during WITH &&)
);
CREATE INDEX instance_runs_open ON instance_runs (instance_id) WHERE upper_inf(during);

CREATE TABLE instance_usage_windows (
  id text PRIMARY KEY,
  instance_id text NOT NULL REFERENCES instances,
  tenant_id text NOT NULL,
  pool_id text NOT NULL,
  node_id text,
  flavour text NOT NULL,
  window_start timestamptz NOT NULL,
  window_end timestamptz NOT NULL CHECK (window_end > window_start),
  -- exact seconds (microsecond precision) the VM was up in the window
  instance_seconds numeric NOT NULL CHECK (instance_seconds > 0),
  closed_at timestamptz NOT NULL DEFAULT compute_now(),
  -- An instance's windows never overlap.
  EXCLUDE USING gist (instance_id WITH =, tstzrange(window_start, window_end) WITH &&)
);
CREATE INDEX instance_usage_windows_tenant ON instance_usage_windows (tenant_id, window_start);
