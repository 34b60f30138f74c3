-- What the inventory and inventory.hygiene jobs found wrong with the inventory: each finding is open
-- from when it was first seen until a later pass no longer sees it.
CREATE TABLE inventory_findings (
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  pool_id text NOT NULL REFERENCES pools,
  node_id text REFERENCES nodes,
  -- a GPU uuid, a join token or a certificate serial: what the finding is about below the node
  item text NOT NULL DEFAULT '',
  kind text NOT NULL CHECK (kind IN ('gpu-missing', 'gpu-unknown', 'gpu-changed', 'resources-changed', 'duplicate-gpu',
                                     'held-retired-node', 'join-token-expired', 'certificate-expiring', 'never-converged')),
  message text NOT NULL,
  first_seen_at timestamptz NOT NULL DEFAULT compute_now(),
  last_seen_at timestamptz NOT NULL DEFAULT compute_now(),
  resolved_at timestamptz
);
CREATE UNIQUE INDEX inventory_findings_open ON inventory_findings (pool_id, kind, coalesce(node_id, ''), item) WHERE resolved_at IS NULL;
CREATE INDEX inventory_findings_node ON inventory_findings (node_id) WHERE resolved_at IS NULL;
