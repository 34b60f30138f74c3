-- Each worker's self-checks (clock.skew), written at every heartbeat, so `jobs` shows them.
ALTER TABLE workers ADD COLUMN checks jsonb NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(checks) = 'array');
