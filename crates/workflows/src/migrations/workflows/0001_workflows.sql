-- Workflows: multi-step operations the `workflow` job advances, one key per workflow. A step's
-- command carries the idempotency key `wf:<workflowId>:<step>.<attempt>`, so a step never sends it
-- twice (UNIQUE (node_id, idempotency_key) on commands).
CREATE TABLE workflows (
  id text PRIMARY KEY,
  -- a definition a module registered, e.g. node.maintenance
  definition text NOT NULL,
  -- what it runs on: {"nodeId"} for one node; {"poolId"} or {"selector"} for a fleet-wide run,
  -- which runs one child per node
  target jsonb NOT NULL,
  -- the node of a one-node workflow (NULL for a fleet-wide one)
  node_id text,
  -- the pool its authorization is checked at (the node's, or the target's)
  pool_id text,
  params jsonb NOT NULL DEFAULT '{}',
  -- a fleet-wide run's child
  parent_id text REFERENCES workflows (id),
  state text NOT NULL CHECK (state IN ('running', 'held', 'cancelling', 'succeeded', 'failed', 'cancelled')),
  -- the index of the step it is on (= the number of steps once it ended well)
  current_step integer NOT NULL DEFAULT 0 CHECK (current_step >= 0),
  reason text,
  message text,
  -- the failure a compensating step runs for ({step, reason, message}): once the steps end, the
  -- workflow fails with it instead of succeeding
  failure jsonb,
  requested_by text NOT NULL,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  updated_at timestamptz NOT NULL DEFAULT compute_now(),
  ended_at timestamptz,
  version bigint NOT NULL DEFAULT 1,
  CHECK ((ended_at IS NULL) = (state IN ('running', 'held', 'cancelling'))),
  CHECK ((node_id IS NULL) <> (target ? 'nodeId'))
);
-- One child per node of a fleet-wide run: starting a child twice finds the first.
CREATE UNIQUE INDEX workflows_child ON workflows (parent_id, node_id) WHERE parent_id IS NOT NULL;
CREATE INDEX workflows_node ON workflows (node_id, created_at) WHERE node_id IS NOT NULL;
CREATE INDEX workflows_open ON workflows (state) WHERE ended_at IS NULL;

CREATE TABLE workflow_steps (
  workflow_id text NOT NULL REFERENCES workflows (id),
  idx integer NOT NULL CHECK (idx >= 0),
  name text NOT NULL,
  state text NOT NULL CHECK (state IN ('pending', 'running', 'retrying', 'succeeded', 'failed', 'skipped', 'cancelled')),
  -- attempts ever started (never reset, so each attempt's command key is new)
  attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
  -- attempts started since the step was (re)started: what the retry policy counts
  attempts_this_run integer NOT NULL DEFAULT 0 CHECK (attempts_this_run >= 0 AND attempts_this_run <= attempts),
  -- when the current attempt started (its timeout counts from here), and when a retry may start
  attempt_started_at timestamptz,
  retry_at timestamptz,
  -- what the step remembers between runs of one attempt (a command id, the boot id before a reboot)
  memory jsonb NOT NULL DEFAULT '{}',
  -- what it is waiting on, or why it failed
  message text,
  reason text,
  started_at timestamptz,
  ended_at timestamptz,
  PRIMARY KEY (workflow_id, idx),
  UNIQUE (workflow_id, name),
  CHECK ((retry_at IS NOT NULL) = (state = 'retrying'))
);
