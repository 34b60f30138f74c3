-- Instances: a VM per reservation on a vps-host node. The row is the instance's desired state (its
-- power, its reboot count, whether it should exist) and what its host last reported; the node's
-- desired state carries it to the host (the `instances` section).
CREATE TABLE instances (
  id text PRIMARY KEY,
  tenant_id text NOT NULL,
  allocation_id text NOT NULL REFERENCES reservations,
  pool_id text NOT NULL REFERENCES pools,
  -- the reservation's node, once it is placed
  node_id text REFERENCES nodes,
  state text NOT NULL CHECK (state IN ('requested', 'provisioning', 'running', 'stopping', 'stopped', 'deleting', 'deleted', 'failed')),
  version bigint NOT NULL DEFAULT 1,
  image text NOT NULL,
  ssh_public_keys text[] NOT NULL,
  user_data text NOT NULL DEFAULT '',
  reboot_count integer NOT NULL DEFAULT 0 CHECK (reboot_count >= 0),
  -- what the host last reported
  address text,
  host_key_fingerprint text,
  reason text,
  -- when the tenant was told that its reservation ends soon (instance.expiring), once
  expiring_sent_at timestamptz,
  created_by text NOT NULL,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  updated_at timestamptz NOT NULL DEFAULT compute_now(),
  CHECK (state = 'requested' OR state = 'deleted' OR node_id IS NOT NULL)
);
-- One live instance per reservation: no reservation's atoms are passed to two VMs.
CREATE UNIQUE INDEX instances_one_per_allocation ON instances (allocation_id) WHERE state <> 'deleted';
CREATE INDEX instances_tenant ON instances (tenant_id, id);
CREATE INDEX instances_node ON instances (node_id) WHERE state <> 'deleted';
