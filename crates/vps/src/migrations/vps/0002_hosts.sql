-- vps hosts: what each vps-host node's bootstrap found, and the host's state for instances.
CREATE TABLE vps_settings (
  singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  -- base images every host must have cached to be ready
  required_images text[] NOT NULL DEFAULT '{}'
);
INSERT INTO vps_settings DEFAULT VALUES;

CREATE TABLE vps_hosts (
  node_id text PRIMARY KEY REFERENCES nodes,
  -- new: vps.hosts has not looked at it yet; bootstrapping: its vps.bootstrap has not reported;
  -- ready: it can run instances; degraded: it cannot (reasons say why); draining: its node is
  -- cordoned or draining
  state text NOT NULL CHECK (state IN ('new', 'bootstrapping', 'ready', 'degraded', 'draining')),
  reasons text[] NOT NULL DEFAULT '{}',
  -- the last vps.bootstrap command and its report
  bootstrap_command_id text,
  bootstrap_attempts integer NOT NULL DEFAULT 0,
  report jsonb,
  -- what the node has left for new instances (capacity's free scalars and idle atoms)
  free jsonb NOT NULL DEFAULT '{}',
  version bigint NOT NULL DEFAULT 1,
  updated_at timestamptz NOT NULL DEFAULT compute_now()
);
