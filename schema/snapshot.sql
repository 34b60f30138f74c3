-- The schema of a freshly migrated database, written by `better-compute schema`; do not edit.
-- The test the_migrated_schema_matches_the_checked_in_snapshot compares it with a migrated database.

CREATE EXTENSION btree_gist;

CREATE TABLE audit_checkpoints (
  tree_size bigint NOT NULL,
  root bytea NOT NULL,
  chain_hash bytea NOT NULL,
  frontier bytea[] NOT NULL,
  public_key bytea,
  signature bytea,
  at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT audit_checkpoints_chain_hash_check CHECK ((octet_length(chain_hash) = 32)),
  CONSTRAINT audit_checkpoints_pkey PRIMARY KEY (tree_size),
  CONSTRAINT audit_checkpoints_public_key_check CHECK ((octet_length(public_key) = 32)),
  CONSTRAINT audit_checkpoints_root_check CHECK ((octet_length(root) = 32)),
  CONSTRAINT audit_checkpoints_signature_check CHECK ((octet_length(signature) = 64)),
  CONSTRAINT audit_checkpoints_tree_size_check CHECK ((tree_size > 0))
);

CREATE TABLE audit_entries (
  id text NOT NULL,
  txid xid8 DEFAULT pg_current_xact_id() NOT NULL,
  position bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
  at timestamp with time zone DEFAULT compute_now() NOT NULL,
  actor_kind text NOT NULL,
  actor_id text NOT NULL,
  token_id text,
  tenant_id text,
  action text NOT NULL,
  target text NOT NULL,
  request_id text,
  source text,
  outcome text NOT NULL,
  request_digest text,
  log_index bigint,
  chain_hash bytea,
  CONSTRAINT audit_entries_action_check CHECK (((length(action) >= 1) AND (length(action) <= 100))),
  CONSTRAINT audit_entries_actor_id_check CHECK (((length(actor_id) >= 1) AND (length(actor_id) <= 200))),
  CONSTRAINT audit_entries_actor_kind_check CHECK ((actor_kind = ANY (ARRAY['identity'::text, 'job'::text, 'system'::text]))),
  CONSTRAINT audit_entries_chain_hash_check CHECK ((octet_length(chain_hash) = 32)),
  CONSTRAINT audit_entries_check CHECK (((log_index IS NULL) = (chain_hash IS NULL))),
  CONSTRAINT audit_entries_log_index_check CHECK ((log_index >= 0)),
  CONSTRAINT audit_entries_log_index_key UNIQUE (log_index),
  CONSTRAINT audit_entries_outcome_check CHECK ((outcome = ANY (ARRAY['ok'::text, 'denied'::text]))),
  CONSTRAINT audit_entries_pkey PRIMARY KEY (id),
  CONSTRAINT audit_entries_request_digest_check CHECK ((request_digest ~ '^[0-9a-f]{64}$'::text)),
  CONSTRAINT audit_entries_request_id_check CHECK ((length(request_id) <= 64)),
  CONSTRAINT audit_entries_source_check CHECK ((length(source) <= 100)),
  CONSTRAINT audit_entries_target_check CHECK ((length(target) <= 500)),
  CONSTRAINT audit_entries_tenant_id_check CHECK ((length(tenant_id) <= 64)),
  CONSTRAINT audit_entries_token_id_check CHECK ((length(token_id) <= 64))
);

CREATE TABLE audit_settings (
  singleton boolean DEFAULT true NOT NULL,
  retention_s integer,
  pruned_below bigint DEFAULT 0 NOT NULL,
  CONSTRAINT audit_settings_pkey PRIMARY KEY (singleton),
  CONSTRAINT audit_settings_pruned_below_check CHECK ((pruned_below >= 0)),
  CONSTRAINT audit_settings_retention_s_check CHECK ((retention_s >= 3600)),
  CONSTRAINT audit_settings_singleton_check CHECK (singleton)
);

CREATE TABLE authz_changes (
  seq bigint DEFAULT nextval('authz_changes_seq_seq'::regclass) NOT NULL,
  txid xid8 DEFAULT pg_current_xact_id() NOT NULL,
  identity_id text NOT NULL,
  token_id text,
  at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT authz_changes_pkey PRIMARY KEY (seq)
);

CREATE TABLE authz_projection (
  identity_id text NOT NULL,
  permission text NOT NULL,
  scope_kind text NOT NULL,
  scope_id text NOT NULL,
  CONSTRAINT authz_projection_pkey PRIMARY KEY (identity_id, permission, scope_kind, scope_id)
);

CREATE TABLE command_keys (
  public_key bytea NOT NULL,
  position bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
  endorsement bytea,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  retired_at timestamp with time zone,
  CONSTRAINT command_keys_endorsement_check CHECK (((endorsement IS NULL) OR (octet_length(endorsement) = 64))),
  CONSTRAINT command_keys_pkey PRIMARY KEY (public_key),
  CONSTRAINT command_keys_position_key UNIQUE ("position"),
  CONSTRAINT command_keys_public_key_check CHECK ((octet_length(public_key) = 32))
);

CREATE TABLE commands (
  id text NOT NULL,
  node_id text NOT NULL,
  seq bigint NOT NULL,
  kind text NOT NULL,
  lane text NOT NULL,
  body bytea NOT NULL,
  payload jsonb NOT NULL,
  idempotency_key text NOT NULL,
  min_generation bigint DEFAULT 0 NOT NULL,
  not_after timestamp with time zone NOT NULL,
  timeout_s integer NOT NULL,
  retry_safe boolean NOT NULL,
  self_terminating boolean NOT NULL,
  state text NOT NULL,
  reason text,
  result jsonb,
  busy_count integer DEFAULT 0 NOT NULL,
  not_before timestamp with time zone DEFAULT compute_now() NOT NULL,
  cancel_requested boolean DEFAULT false NOT NULL,
  owner_kind text,
  owner_key text,
  owner_shard smallint,
  requested_by text,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  sent_at timestamp with time zone,
  finished_at timestamp with time zone,
  version bigint DEFAULT 1 NOT NULL,
  signature bytea,
  trace_parent text,
  CONSTRAINT commands_check CHECK ((((owner_kind IS NULL) = (owner_key IS NULL)) AND ((owner_key IS NULL) = (owner_shard IS NULL)))),
  CONSTRAINT commands_check1 CHECK (((state <> ALL (ARRAY['failed'::text, 'expired'::text])) OR (reason IS NOT NULL))),
  CONSTRAINT commands_idempotency_key_check CHECK ((idempotency_key <> ''::text)),
  CONSTRAINT commands_min_generation_check CHECK ((min_generation >= 0)),
  CONSTRAINT commands_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT commands_node_id_idempotency_key_key UNIQUE (node_id, idempotency_key),
  CONSTRAINT commands_node_id_seq_key UNIQUE (node_id, seq),
  CONSTRAINT commands_pkey PRIMARY KEY (id),
  CONSTRAINT commands_seq_check CHECK ((seq >= 1)),
  CONSTRAINT commands_signature_check CHECK (((signature IS NULL) OR (octet_length(signature) = 64))),
  CONSTRAINT commands_state_check CHECK ((state = ANY (ARRAY['pending'::text, 'sent'::text, 'running'::text, 'succeeded'::text, 'failed'::text, 'expired'::text, 'cancelled'::text]))),
  CONSTRAINT commands_timeout_s_check CHECK ((timeout_s > 0)),
  CONSTRAINT commands_trace_parent_check CHECK ((length(trace_parent) <= 256))
);

CREATE TABLE compute_sim_clock (
  id integer NOT NULL,
  ts timestamp with time zone NOT NULL,
  CONSTRAINT compute_sim_clock_id_check CHECK ((id = 1)),
  CONSTRAINT compute_sim_clock_pkey PRIMARY KEY (id)
);

CREATE TABLE device_booking_history (
  device_id text NOT NULL,
  allocation_id text NOT NULL,
  during tstzrange NOT NULL,
  CONSTRAINT device_booking_history_during_check CHECK ((NOT isempty(during)))
);

CREATE TABLE device_bookings (
  device_id text NOT NULL,
  allocation_id text NOT NULL,
  during tstzrange NOT NULL,
  CONSTRAINT device_bookings_device_id_during_excl EXCLUDE USING gist (device_id WITH =, during WITH &&),
  CONSTRAINT device_bookings_device_id_fkey FOREIGN KEY (device_id) REFERENCES devices(id),
  CONSTRAINT device_bookings_during_check CHECK ((NOT isempty(during)))
) WITH (autovacuum_vacuum_scale_factor=0.02, autovacuum_vacuum_threshold=200, autovacuum_vacuum_cost_delay=0, autovacuum_analyze_scale_factor=0.05);

CREATE TABLE devices (
  id text NOT NULL,
  node_id text NOT NULL,
  parent_id text,
  kind text NOT NULL,
  index smallint NOT NULL,
  model text NOT NULL,
  profile text,
  memory_mib integer NOT NULL,
  healthy boolean DEFAULT true NOT NULL,
  quarantined boolean DEFAULT false NOT NULL,
  quarantine_reason text,
  mode text,
  mig_layout text[] DEFAULT '{}'::text[] NOT NULL,
  slots smallint DEFAULT 0 NOT NULL,
  active boolean DEFAULT true NOT NULL,
  bookable boolean GENERATED ALWAYS AS ((active AND ((parent_id IS NOT NULL) OR (mode = 'exclusive'::text)))) STORED,
  version bigint DEFAULT 1 NOT NULL,
  health_state text DEFAULT 'healthy'::text NOT NULL,
  health_since timestamp with time zone,
  health_reason text,
  clean_checks integer DEFAULT 0 NOT NULL,
  next_check_at timestamp with time zone,
  check_command_id text,
  health_counters jsonb,
  CONSTRAINT devices_check CHECK (((kind = 'gpu'::text) = (parent_id IS NULL))),
  CONSTRAINT devices_check1 CHECK (((kind = 'gpu'::text) = (mode IS NOT NULL))),
  CONSTRAINT devices_check2 CHECK (((kind = 'mig'::text) = (profile IS NOT NULL))),
  CONSTRAINT devices_check3 CHECK (((kind <> 'gpu'::text) OR ((mode = 'mig'::text) = (cardinality(mig_layout) > 0)))),
  CONSTRAINT devices_check4 CHECK (((kind <> 'gpu'::text) OR ((mode = ANY (ARRAY['time-slice'::text, 'mps'::text])) = (slots > 0)))),
  CONSTRAINT devices_clean_checks_check CHECK ((clean_checks >= 0)),
  CONSTRAINT devices_health_state_check CHECK ((health_state = ANY (ARRAY['healthy'::text, 'suspect'::text, 'unhealthy'::text, 'recovering'::text]))),
  CONSTRAINT devices_healthy_is_the_health_state CHECK (((parent_id IS NOT NULL) OR (healthy = (health_state = 'healthy'::text)))),
  CONSTRAINT devices_index_check CHECK ((index >= 0)),
  CONSTRAINT devices_kind_check CHECK ((kind = ANY (ARRAY['gpu'::text, 'mig'::text, 'slot'::text]))),
  CONSTRAINT devices_memory_mib_check CHECK ((memory_mib > 0)),
  CONSTRAINT devices_mode_check CHECK ((mode = ANY (ARRAY['exclusive'::text, 'mig'::text, 'time-slice'::text, 'mps'::text]))),
  CONSTRAINT devices_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT devices_parent_id_fkey FOREIGN KEY (parent_id) REFERENCES devices(id),
  CONSTRAINT devices_pkey PRIMARY KEY (id),
  CONSTRAINT devices_slots_check CHECK ((slots >= 0))
);

CREATE TABLE gpu_health_history (
  id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
  device_id text NOT NULL,
  pool_id text NOT NULL,
  from_state text NOT NULL,
  to_state text NOT NULL,
  reason text NOT NULL,
  at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT gpu_health_history_device_id_fkey FOREIGN KEY (device_id) REFERENCES devices(id),
  CONSTRAINT gpu_health_history_pkey PRIMARY KEY (id),
  CONSTRAINT gpu_health_history_pool_id_fkey FOREIGN KEY (pool_id) REFERENCES pools(id)
);

CREATE TABLE gpu_health_signals (
  id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
  node_id text NOT NULL,
  device_id text NOT NULL,
  kind text NOT NULL,
  class text NOT NULL,
  detail text NOT NULL,
  observed_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  processed_at timestamp with time zone,
  outcome text,
  CONSTRAINT gpu_health_signals_class_check CHECK ((class = ANY (ARRAY['informational'::text, 'transient'::text, 'fatal'::text]))),
  CONSTRAINT gpu_health_signals_kind_check CHECK ((kind = ANY (ARRAY['xid'::text, 'unhealthy'::text, 'pcie'::text, 'throttle'::text, 'counter'::text]))),
  CONSTRAINT gpu_health_signals_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT gpu_health_signals_pkey PRIMARY KEY (id)
);

CREATE TABLE idempotency_keys (
  tenant_id text NOT NULL,
  identity_id text NOT NULL,
  key text NOT NULL,
  method text NOT NULL,
  request_sha256 bytea NOT NULL,
  response jsonb,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  expires_at timestamp with time zone NOT NULL,
  CONSTRAINT idempotency_keys_key_check CHECK (((length(key) >= 1) AND (length(key) <= 255))),
  CONSTRAINT idempotency_keys_pkey PRIMARY KEY (tenant_id, identity_id, key),
  CONSTRAINT idempotency_keys_request_sha256_check CHECK ((length(request_sha256) = 32))
);

CREATE TABLE identities (
  id text NOT NULL,
  tenant_id text NOT NULL,
  name text NOT NULL,
  kind text NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT identities_kind_check CHECK ((kind = ANY (ARRAY['person'::text, 'service'::text]))),
  CONSTRAINT identities_name_check CHECK ((name ~ '^[a-z0-9][a-z0-9._@-]{0,127}$'::text)),
  CONSTRAINT identities_pkey PRIMARY KEY (id),
  CONSTRAINT identities_tenant_id_fkey FOREIGN KEY (tenant_id) REFERENCES tenants(id),
  CONSTRAINT identities_tenant_id_name_key UNIQUE (tenant_id, name)
);

CREATE TABLE instance_runs (
  instance_id text NOT NULL,
  during tstzrange NOT NULL,
  CONSTRAINT instance_runs_during_check CHECK (((NOT isempty(during)) AND (NOT lower_inf(during)))),
  CONSTRAINT instance_runs_instance_id_during_excl EXCLUDE USING gist (instance_id WITH =, during WITH &&),
  CONSTRAINT instance_runs_instance_id_fkey FOREIGN KEY (instance_id) REFERENCES instances(id)
);

CREATE TABLE instance_usage_windows (
  id text NOT NULL,
  instance_id text NOT NULL,
  tenant_id text NOT NULL,
  pool_id text NOT NULL,
  node_id text,
  flavour text NOT NULL,
  window_start timestamp with time zone NOT NULL,
  window_end timestamp with time zone NOT NULL,
  instance_seconds numeric NOT NULL,
  closed_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT instance_usage_windows_check CHECK ((window_end > window_start)),
  CONSTRAINT instance_usage_windows_instance_id_fkey FOREIGN KEY (instance_id) REFERENCES instances(id),
  CONSTRAINT instance_usage_windows_instance_id_tstzrange_excl EXCLUDE USING gist (instance_id WITH =, tstzrange(window_start, window_end) WITH &&),
  CONSTRAINT instance_usage_windows_instance_seconds_check CHECK ((instance_seconds > (0)::numeric)),
  CONSTRAINT instance_usage_windows_pkey PRIMARY KEY (id)
);

CREATE TABLE instances (
  id text NOT NULL,
  tenant_id text NOT NULL,
  allocation_id text NOT NULL,
  pool_id text NOT NULL,
  node_id text,
  state text NOT NULL,
  version bigint DEFAULT 1 NOT NULL,
  image text NOT NULL,
  ssh_public_keys text[] NOT NULL,
  user_data text DEFAULT ''::text NOT NULL,
  reboot_count integer DEFAULT 0 NOT NULL,
  address text,
  host_key_fingerprint text,
  reason text,
  expiring_sent_at timestamp with time zone,
  created_by text NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  updated_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  flavour text DEFAULT ''::text NOT NULL,
  usage_closed_until timestamp with time zone,
  CONSTRAINT instances_allocation_id_fkey FOREIGN KEY (allocation_id) REFERENCES reservations(id),
  CONSTRAINT instances_check CHECK (((state = 'requested'::text) OR (state = 'deleted'::text) OR (node_id IS NOT NULL))),
  CONSTRAINT instances_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT instances_pkey PRIMARY KEY (id),
  CONSTRAINT instances_pool_id_fkey FOREIGN KEY (pool_id) REFERENCES pools(id),
  CONSTRAINT instances_reboot_count_check CHECK ((reboot_count >= 0)),
  CONSTRAINT instances_state_check CHECK ((state = ANY (ARRAY['requested'::text, 'provisioning'::text, 'running'::text, 'stopping'::text, 'stopped'::text, 'deleting'::text, 'deleted'::text, 'failed'::text])))
);

CREATE TABLE inventory_findings (
  id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
  pool_id text NOT NULL,
  node_id text,
  item text DEFAULT ''::text NOT NULL,
  kind text NOT NULL,
  message text NOT NULL,
  first_seen_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  last_seen_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  resolved_at timestamp with time zone,
  CONSTRAINT inventory_findings_kind_check CHECK ((kind = ANY (ARRAY['gpu-missing'::text, 'gpu-unknown'::text, 'gpu-changed'::text, 'resources-changed'::text, 'duplicate-gpu'::text, 'held-retired-node'::text, 'join-token-expired'::text, 'certificate-expiring'::text, 'never-converged'::text]))),
  CONSTRAINT inventory_findings_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT inventory_findings_pkey PRIMARY KEY (id),
  CONSTRAINT inventory_findings_pool_id_fkey FOREIGN KEY (pool_id) REFERENCES pools(id)
);

CREATE TABLE job_runs (
  job text NOT NULL,
  worker_id text NOT NULL,
  ticks bigint NOT NULL,
  last_tick_at timestamp with time zone NOT NULL,
  last_report jsonb NOT NULL,
  last_error text,
  last_error_at timestamp with time zone,
  CONSTRAINT job_runs_pkey PRIMARY KEY (job, worker_id)
);

CREATE TABLE join_tokens (
  id text NOT NULL,
  pool_id text NOT NULL,
  secret_sha256 bytea NOT NULL,
  expires_at timestamp with time zone NOT NULL,
  used_at timestamp with time zone,
  used_by_node text,
  created_by text NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT join_tokens_pkey PRIMARY KEY (id),
  CONSTRAINT join_tokens_pool_id_fkey FOREIGN KEY (pool_id) REFERENCES pools(id),
  CONSTRAINT join_tokens_secret_sha256_check CHECK ((length(secret_sha256) = 32)),
  CONSTRAINT join_tokens_secret_sha256_key UNIQUE (secret_sha256)
);

CREATE TABLE leases (
  name text NOT NULL,
  owner text NOT NULL,
  epoch bigint NOT NULL,
  expires_at timestamp with time zone NOT NULL,
  CONSTRAINT leases_epoch_check CHECK ((epoch >= 1)),
  CONSTRAINT leases_name_check CHECK ((name <> ''::text)),
  CONSTRAINT leases_owner_check CHECK ((owner <> ''::text)),
  CONSTRAINT leases_pkey PRIMARY KEY (name)
);

CREATE TABLE liveness_runs (
  singleton boolean DEFAULT true NOT NULL,
  last_run_at timestamp with time zone NOT NULL,
  outage_grace_until timestamp with time zone NOT NULL,
  CONSTRAINT liveness_runs_pkey PRIMARY KEY (singleton),
  CONSTRAINT liveness_runs_singleton_check CHECK (singleton)
);

CREATE TABLE node_atom_counts (
  node_id text NOT NULL,
  pool_id text NOT NULL,
  kind text NOT NULL,
  model text NOT NULL,
  profile text DEFAULT ''::text NOT NULL,
  total integer NOT NULL,
  idle integer NOT NULL,
  open boolean DEFAULT false NOT NULL,
  CONSTRAINT node_atom_counts_check CHECK (((idle >= 0) AND (idle <= total))),
  CONSTRAINT node_atom_counts_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT node_atom_counts_pkey PRIMARY KEY (node_id, kind, model, profile),
  CONSTRAINT node_atom_counts_total_check CHECK ((total >= 0))
) WITH (autovacuum_vacuum_scale_factor=0.02, autovacuum_vacuum_threshold=200, autovacuum_vacuum_cost_delay=0);

CREATE TABLE node_certificates (
  fingerprint_sha256 bytea NOT NULL,
  node_id text NOT NULL,
  serial text NOT NULL,
  not_before timestamp with time zone NOT NULL,
  not_after timestamp with time zone NOT NULL,
  revoked_at timestamp with time zone,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT node_certificates_fingerprint_sha256_check CHECK ((length(fingerprint_sha256) = 32)),
  CONSTRAINT node_certificates_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT node_certificates_pkey PRIMARY KEY (fingerprint_sha256)
);

CREATE TABLE node_conditions (
  node_id text NOT NULL,
  type text NOT NULL,
  reason text NOT NULL,
  message text NOT NULL,
  since timestamp with time zone NOT NULL,
  CONSTRAINT node_conditions_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id) ON DELETE CASCADE,
  CONSTRAINT node_conditions_pkey PRIMARY KEY (node_id, type)
);

CREATE TABLE node_drains (
  id text NOT NULL,
  node_id text NOT NULL,
  pool_id text NOT NULL,
  mode text NOT NULL,
  reason text NOT NULL,
  deadline timestamp with time zone,
  state text NOT NULL,
  requested_by text NOT NULL,
  requested_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  admitted_at timestamp with time zone,
  eviction_requested_at timestamp with time zone,
  drained_at timestamp with time zone,
  ended_at timestamp with time zone,
  condition_reason text NOT NULL,
  condition_message text NOT NULL,
  condition_since timestamp with time zone DEFAULT compute_now() NOT NULL,
  version bigint DEFAULT 1 NOT NULL,
  CONSTRAINT node_drains_check CHECK (((mode = 'evict'::text) = (deadline IS NOT NULL))),
  CONSTRAINT node_drains_check1 CHECK (((state <> ALL (ARRAY['draining'::text, 'drained'::text, 'retired'::text])) OR (admitted_at IS NOT NULL))),
  CONSTRAINT node_drains_check2 CHECK (((state <> ALL (ARRAY['drained'::text, 'retired'::text])) OR (drained_at IS NOT NULL))),
  CONSTRAINT node_drains_check3 CHECK (((state = ANY (ARRAY['cancelled'::text, 'retired'::text])) = (ended_at IS NOT NULL))),
  CONSTRAINT node_drains_mode_check CHECK ((mode = ANY (ARRAY['wait'::text, 'evict'::text]))),
  CONSTRAINT node_drains_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT node_drains_pkey PRIMARY KEY (id),
  CONSTRAINT node_drains_pool_id_fkey FOREIGN KEY (pool_id) REFERENCES pools(id),
  CONSTRAINT node_drains_reason_check CHECK ((reason <> ''::text)),
  CONSTRAINT node_drains_state_check CHECK ((state = ANY (ARRAY['queued'::text, 'draining'::text, 'drained'::text, 'cancelled'::text, 'retired'::text])))
);

CREATE TABLE node_resources (
  node_id text NOT NULL,
  vcpu_allocatable integer NOT NULL,
  vcpu_ratio double precision NOT NULL,
  vcpu_allocated integer DEFAULT 0 NOT NULL,
  memory_mib_allocatable bigint NOT NULL,
  memory_ratio double precision NOT NULL,
  memory_mib_allocated bigint DEFAULT 0 NOT NULL,
  disk_gib_allocatable bigint NOT NULL,
  disk_ratio double precision NOT NULL,
  disk_gib_allocated bigint DEFAULT 0 NOT NULL,
  vcpu_usable integer NOT NULL,
  memory_mib_usable bigint NOT NULL,
  disk_gib_usable bigint NOT NULL,
  CONSTRAINT node_resources_check CHECK (((vcpu_allocated >= 0) AND ((vcpu_allocated)::double precision <= floor(((vcpu_allocatable)::double precision * vcpu_ratio))))),
  CONSTRAINT node_resources_check1 CHECK (((memory_mib_allocated >= 0) AND ((memory_mib_allocated)::double precision <= floor(((memory_mib_allocatable)::double precision * memory_ratio))))),
  CONSTRAINT node_resources_check2 CHECK (((disk_gib_allocated >= 0) AND ((disk_gib_allocated)::double precision <= floor(((disk_gib_allocatable)::double precision * disk_ratio))))),
  CONSTRAINT node_resources_disk_gib_allocatable_check CHECK ((disk_gib_allocatable >= 0)),
  CONSTRAINT node_resources_disk_ratio_check CHECK ((disk_ratio >= (1)::double precision)),
  CONSTRAINT node_resources_memory_mib_allocatable_check CHECK ((memory_mib_allocatable >= 0)),
  CONSTRAINT node_resources_memory_ratio_check CHECK ((memory_ratio >= (1)::double precision)),
  CONSTRAINT node_resources_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT node_resources_pkey PRIMARY KEY (node_id),
  CONSTRAINT node_resources_usable CHECK (((vcpu_usable >= 0) AND (memory_mib_usable >= 0) AND (disk_gib_usable >= 0) AND (vcpu_allocatable >= vcpu_usable) AND (memory_mib_allocatable >= memory_mib_usable) AND (disk_gib_allocatable >= disk_gib_usable))),
  CONSTRAINT node_resources_vcpu_allocatable_check CHECK ((vcpu_allocatable >= 0)),
  CONSTRAINT node_resources_vcpu_ratio_check CHECK ((vcpu_ratio >= (1)::double precision))
) WITH (autovacuum_vacuum_scale_factor=0.02, autovacuum_vacuum_threshold=200, autovacuum_vacuum_cost_delay=0);

CREATE TABLE node_sessions (
  node_id text NOT NULL,
  session_epoch bigint NOT NULL,
  gateway_id text NOT NULL,
  boot_id text NOT NULL,
  journal_id text NOT NULL,
  daemon_version text NOT NULL,
  opened_at timestamp with time zone NOT NULL,
  last_seen_at timestamp with time zone NOT NULL,
  closed_at timestamp with time zone,
  close_reason text,
  CONSTRAINT node_sessions_check CHECK (((closed_at IS NULL) = (close_reason IS NULL))),
  CONSTRAINT node_sessions_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT node_sessions_pkey PRIMARY KEY (node_id),
  CONSTRAINT node_sessions_session_epoch_check CHECK ((session_epoch >= 1))
);

CREATE TABLE nodes (
  id text NOT NULL,
  pool_id text NOT NULL,
  name text NOT NULL,
  shard smallint NOT NULL,
  vcpu integer NOT NULL,
  memory_mib bigint NOT NULL,
  disk_gib bigint NOT NULL,
  labels jsonb DEFAULT '{}'::jsonb NOT NULL,
  taints jsonb DEFAULT '[]'::jsonb NOT NULL,
  no_schedule_reasons text[] DEFAULT '{}'::text[] NOT NULL,
  liveness text DEFAULT 'disconnected'::text NOT NULL,
  generation bigint DEFAULT 0 NOT NULL,
  observed_generation bigint DEFAULT 0 NOT NULL,
  spec jsonb,
  version bigint DEFAULT 1 NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  next_cmd_seq bigint DEFAULT 1 NOT NULL,
  joined_at timestamp with time zone,
  liveness_since timestamp with time zone DEFAULT compute_now() NOT NULL,
  disconnect_grace_s integer DEFAULT 0 NOT NULL,
  spec_status jsonb,
  reported_inventory jsonb,
  retired_at timestamp with time zone,
  convergence_since timestamp with time zone,
  CONSTRAINT nodes_disconnect_grace_s_check CHECK ((disconnect_grace_s >= 0)),
  CONSTRAINT nodes_disk_gib_check CHECK ((disk_gib >= 0)),
  CONSTRAINT nodes_generation_check CHECK ((generation >= 0)),
  CONSTRAINT nodes_labels_check CHECK ((jsonb_typeof(labels) = 'object'::text)),
  CONSTRAINT nodes_liveness_check CHECK ((liveness = ANY (ARRAY['connected'::text, 'disconnected'::text, 'unreachable'::text, 'lost'::text]))),
  CONSTRAINT nodes_memory_mib_check CHECK ((memory_mib >= 0)),
  CONSTRAINT nodes_next_cmd_seq_check CHECK ((next_cmd_seq >= 1)),
  CONSTRAINT nodes_observed_generation_check CHECK ((observed_generation >= 0)),
  CONSTRAINT nodes_pkey PRIMARY KEY (id),
  CONSTRAINT nodes_pool_id_fkey FOREIGN KEY (pool_id) REFERENCES pools(id),
  CONSTRAINT nodes_pool_id_name_key UNIQUE (pool_id, name),
  CONSTRAINT nodes_shard_check CHECK (((shard >= 0) AND (shard <= 255))),
  CONSTRAINT nodes_taints_check CHECK ((jsonb_typeof(taints) = 'array'::text)),
  CONSTRAINT nodes_vcpu_check CHECK ((vcpu >= 0))
);

CREATE TABLE outbox (
  txid xid8 DEFAULT pg_current_xact_id() NOT NULL,
  seq bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
  id text NOT NULL,
  type text NOT NULL,
  tenant_id text,
  subject text NOT NULL,
  data jsonb NOT NULL,
  time timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT outbox_id_key UNIQUE (id),
  CONSTRAINT outbox_pkey PRIMARY KEY (txid, seq)
);

CREATE TABLE outbox_cursors (
  sink text NOT NULL,
  txid xid8 NOT NULL,
  seq bigint NOT NULL,
  delivered bigint DEFAULT 0 NOT NULL,
  updated_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT outbox_cursors_pkey PRIMARY KEY (sink)
);

CREATE TABLE pool_capacity_rollup (
  pool_id text NOT NULL,
  atoms jsonb NOT NULL,
  nodes integer NOT NULL,
  schedulable_nodes integer NOT NULL,
  vcpu_free bigint NOT NULL,
  memory_mib_free bigint NOT NULL,
  disk_gib_free bigint NOT NULL,
  updated_at timestamp with time zone NOT NULL,
  CONSTRAINT pool_capacity_rollup_pkey PRIMARY KEY (pool_id),
  CONSTRAINT pool_capacity_rollup_pool_id_fkey FOREIGN KEY (pool_id) REFERENCES pools(id)
);

CREATE TABLE pool_health_circuits (
  pool_id text NOT NULL,
  open_since timestamp with time zone,
  CONSTRAINT pool_health_circuits_pkey PRIMARY KEY (pool_id),
  CONSTRAINT pool_health_circuits_pool_id_fkey FOREIGN KEY (pool_id) REFERENCES pools(id) ON DELETE CASCADE
);

CREATE TABLE pools (
  id text NOT NULL,
  site_id text NOT NULL,
  name text NOT NULL,
  kind text NOT NULL,
  vcpu_ratio double precision DEFAULT 1 NOT NULL,
  memory_ratio double precision DEFAULT 1 NOT NULL,
  disk_ratio double precision DEFAULT 1 NOT NULL,
  lost_after_s integer,
  version bigint DEFAULT 1 NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  max_unavailable integer,
  max_unavailable_percent integer,
  health_breaker_percent integer DEFAULT 10 NOT NULL,
  health_breaker_window_s integer DEFAULT 600 NOT NULL,
  CONSTRAINT pools_check CHECK (((lost_after_s IS NULL) OR ((lost_after_s > 0) AND (kind = ANY (ARRAY['provider'::text, 'vps-host'::text]))))),
  CONSTRAINT pools_disk_ratio_check CHECK (((disk_ratio >= (1)::double precision) AND (disk_ratio <= (4)::double precision))),
  CONSTRAINT pools_health_breaker_percent_check CHECK (((health_breaker_percent >= 1) AND (health_breaker_percent <= 100))),
  CONSTRAINT pools_health_breaker_window_s_check CHECK ((health_breaker_window_s > 0)),
  CONSTRAINT pools_kind_check CHECK ((kind = ANY (ARRAY['bare-metal'::text, 'provider'::text, 'vps-host'::text]))),
  CONSTRAINT pools_max_unavailable_check CHECK (((max_unavailable IS NULL) OR (max_unavailable >= 0))),
  CONSTRAINT pools_max_unavailable_percent_check CHECK (((max_unavailable_percent IS NULL) OR ((max_unavailable_percent >= 0) AND (max_unavailable_percent <= 100)))),
  CONSTRAINT pools_memory_ratio_check CHECK (((memory_ratio >= (1)::double precision) AND (memory_ratio <= (4)::double precision))),
  CONSTRAINT pools_name_check CHECK ((name ~ '^[a-z0-9][a-z0-9-]{0,62}$'::text)),
  CONSTRAINT pools_one_budget CHECK (((max_unavailable IS NULL) OR (max_unavailable_percent IS NULL))),
  CONSTRAINT pools_pkey PRIMARY KEY (id),
  CONSTRAINT pools_site_id_fkey FOREIGN KEY (site_id) REFERENCES sites(id),
  CONSTRAINT pools_site_id_name_key UNIQUE (site_id, name),
  CONSTRAINT pools_vcpu_ratio_check CHECK (((vcpu_ratio >= (1)::double precision) AND (vcpu_ratio <= (16)::double precision)))
);

CREATE TABLE quota_usage (
  tenant_id text NOT NULL,
  resource text NOT NULL,
  used bigint DEFAULT 0 NOT NULL,
  max bigint NOT NULL,
  CONSTRAINT quota_usage_check CHECK (((used >= 0) AND (used <= max))),
  CONSTRAINT quota_usage_max_check CHECK ((max >= 0)),
  CONSTRAINT quota_usage_pkey PRIMARY KEY (tenant_id, resource),
  CONSTRAINT quota_usage_resource_check CHECK ((resource = ANY (ARRAY['gpus'::text, 'mig_instances'::text, 'gpu_slots'::text, 'vcpu'::text, 'memory_mib'::text, 'disk_gib'::text])))
) WITH (autovacuum_vacuum_scale_factor=0.02, autovacuum_vacuum_threshold=200, autovacuum_vacuum_cost_delay=0);

CREATE TABLE reservations (
  id text NOT NULL,
  tenant_id text NOT NULL,
  pool_id text NOT NULL,
  state text NOT NULL,
  version bigint DEFAULT 1 NOT NULL,
  gpu_kind text NOT NULL,
  gpu_model text NOT NULL,
  mig_profile text,
  gpu_count integer NOT NULL,
  vcpu integer NOT NULL,
  memory_mib bigint NOT NULL,
  disk_gib bigint NOT NULL,
  during tstzrange NOT NULL,
  node_selector jsonb DEFAULT '{}'::jsonb NOT NULL,
  tolerations jsonb DEFAULT '[]'::jsonb NOT NULL,
  node_id text,
  unschedulable jsonb,
  next_attempt_at timestamp with time zone,
  created_by text NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  updated_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  end_reason text,
  usage_closed_until timestamp with time zone,
  usage_version bigint,
  CONSTRAINT reservations_check CHECK (((gpu_kind = 'mig'::text) = (mig_profile IS NOT NULL))),
  CONSTRAINT reservations_check1 CHECK (((state <> ALL (ARRAY['placed'::text, 'active'::text])) OR (node_id IS NOT NULL))),
  CONSTRAINT reservations_check2 CHECK (((state <> 'pending'::text) OR ((unschedulable IS NOT NULL) AND (next_attempt_at IS NOT NULL)))),
  CONSTRAINT reservations_disk_gib_check CHECK ((disk_gib >= 0)),
  CONSTRAINT reservations_during_check CHECK (((NOT isempty(during)) AND (NOT lower_inf(during)) AND (NOT upper_inf(during)))),
  CONSTRAINT reservations_end_reason_check CHECK (((end_reason IS NULL) OR (end_reason = 'drained'::text))),
  CONSTRAINT reservations_gpu_count_check CHECK ((gpu_count >= 0)),
  CONSTRAINT reservations_gpu_kind_check CHECK ((gpu_kind = ANY (ARRAY['gpu'::text, 'mig'::text, 'slot'::text]))),
  CONSTRAINT reservations_memory_mib_check CHECK ((memory_mib >= 0)),
  CONSTRAINT reservations_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT reservations_pkey PRIMARY KEY (id),
  CONSTRAINT reservations_pool_id_fkey FOREIGN KEY (pool_id) REFERENCES pools(id),
  CONSTRAINT reservations_state_check CHECK ((state = ANY (ARRAY['pending'::text, 'placed'::text, 'active'::text, 'released'::text, 'expired'::text, 'failed'::text]))),
  CONSTRAINT reservations_vcpu_check CHECK ((vcpu >= 0))
) WITH (autovacuum_vacuum_scale_factor=0.02, autovacuum_vacuum_threshold=200, autovacuum_vacuum_cost_delay=0);

CREATE TABLE role_bindings (
  id text NOT NULL,
  tenant_id text NOT NULL,
  identity_id text NOT NULL,
  role text NOT NULL,
  scope_kind text NOT NULL,
  scope_id text NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT role_bindings_check CHECK (((scope_kind = 'fleet'::text) = (scope_id = ''::text))),
  CONSTRAINT role_bindings_check1 CHECK (((scope_kind <> 'tenant'::text) OR (scope_id = tenant_id))),
  CONSTRAINT role_bindings_identity_id_fkey FOREIGN KEY (identity_id) REFERENCES identities(id),
  CONSTRAINT role_bindings_identity_id_role_scope_kind_scope_id_key UNIQUE (identity_id, role, scope_kind, scope_id),
  CONSTRAINT role_bindings_pkey PRIMARY KEY (id),
  CONSTRAINT role_bindings_role_fkey FOREIGN KEY (role) REFERENCES roles(name),
  CONSTRAINT role_bindings_scope_kind_check CHECK ((scope_kind = ANY (ARRAY['fleet'::text, 'tenant'::text, 'site'::text, 'pool'::text, 'node'::text]))),
  CONSTRAINT role_bindings_tenant_id_fkey FOREIGN KEY (tenant_id) REFERENCES tenants(id)
);

CREATE TABLE roles (
  name text NOT NULL,
  description text NOT NULL,
  permissions text[] NOT NULL,
  CONSTRAINT roles_name_check CHECK ((name ~ '^[a-z][a-z0-9-]{0,62}$'::text)),
  CONSTRAINT roles_pkey PRIMARY KEY (name)
);

CREATE TABLE schema_migrations (
  module text NOT NULL,
  name text NOT NULL,
  checksum text NOT NULL,
  applied_at timestamp with time zone DEFAULT now() NOT NULL,
  CONSTRAINT schema_migrations_pkey PRIMARY KEY (module, name)
);

CREATE TABLE sites (
  id text NOT NULL,
  name text NOT NULL,
  version bigint DEFAULT 1 NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  boot_state text DEFAULT 'normal'::text NOT NULL,
  boot_since timestamp with time zone,
  boot_admit_per_s integer DEFAULT 50 NOT NULL,
  boot_tokens double precision DEFAULT 0 NOT NULL,
  boot_tokens_at timestamp with time zone,
  boot_converged_percent integer DEFAULT 90 NOT NULL,
  boot_outage_percent integer DEFAULT 50 NOT NULL,
  CONSTRAINT sites_boot_admit_per_s_check CHECK (((boot_admit_per_s >= 1) AND (boot_admit_per_s <= 100000))),
  CONSTRAINT sites_boot_converged_percent_check CHECK (((boot_converged_percent >= 1) AND (boot_converged_percent <= 100))),
  CONSTRAINT sites_boot_outage_percent_check CHECK (((boot_outage_percent >= 1) AND (boot_outage_percent <= 100))),
  CONSTRAINT sites_boot_since CHECK (((boot_state = 'booting'::text) = (boot_since IS NOT NULL))),
  CONSTRAINT sites_boot_state_check CHECK ((boot_state = ANY (ARRAY['normal'::text, 'booting'::text]))),
  CONSTRAINT sites_name_check CHECK ((name ~ '^[a-z0-9][a-z0-9-]{0,62}$'::text)),
  CONSTRAINT sites_name_key UNIQUE (name),
  CONSTRAINT sites_pkey PRIMARY KEY (id)
);

CREATE TABLE tenants (
  id text NOT NULL,
  name text NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT tenants_name_check CHECK ((name ~ '^[a-z0-9][a-z0-9-]{0,62}$'::text)),
  CONSTRAINT tenants_name_key UNIQUE (name),
  CONSTRAINT tenants_pkey PRIMARY KEY (id)
);

CREATE TABLE tokens (
  id text NOT NULL,
  tenant_id text NOT NULL,
  identity_id text NOT NULL,
  name text DEFAULT ''::text NOT NULL,
  secret_sha256 bytea NOT NULL,
  expires_at timestamp with time zone NOT NULL,
  revoked_at timestamp with time zone,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT tokens_identity_id_fkey FOREIGN KEY (identity_id) REFERENCES identities(id),
  CONSTRAINT tokens_pkey PRIMARY KEY (id),
  CONSTRAINT tokens_secret_sha256_check CHECK ((length(secret_sha256) = 32)),
  CONSTRAINT tokens_secret_sha256_key UNIQUE (secret_sha256),
  CONSTRAINT tokens_tenant_id_fkey FOREIGN KEY (tenant_id) REFERENCES tenants(id)
);

CREATE TABLE usage_settings (
  singleton boolean DEFAULT true NOT NULL,
  window_s integer DEFAULT 3600 NOT NULL,
  CONSTRAINT usage_settings_pkey PRIMARY KEY (singleton),
  CONSTRAINT usage_settings_singleton_check CHECK (singleton),
  CONSTRAINT usage_settings_window_s_check CHECK (((window_s >= 60) AND ((86400 % window_s) = 0)))
);

CREATE TABLE usage_windows (
  id text NOT NULL,
  allocation_id text NOT NULL,
  tenant_id text NOT NULL,
  pool_id text NOT NULL,
  node_id text,
  window_start timestamp with time zone NOT NULL,
  window_end timestamp with time zone NOT NULL,
  adjustment integer NOT NULL,
  gpu_kind text NOT NULL,
  gpu_model text NOT NULL,
  mig_profile text,
  atom_seconds numeric NOT NULL,
  vcpu_seconds numeric NOT NULL,
  memory_mib_seconds numeric NOT NULL,
  disk_gib_seconds numeric NOT NULL,
  closed_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT usage_windows_adjustment_check CHECK ((adjustment >= 0)),
  CONSTRAINT usage_windows_allocation_id_tstzrange_excl EXCLUDE USING gist (allocation_id WITH =, tstzrange(window_start, window_end) WITH &&) WHERE ((adjustment = 0)),
  CONSTRAINT usage_windows_allocation_id_window_start_adjustment_key UNIQUE (allocation_id, window_start, adjustment),
  CONSTRAINT usage_windows_check CHECK ((window_end > window_start)),
  CONSTRAINT usage_windows_pkey PRIMARY KEY (id)
);

CREATE TABLE vm_consoles (
  node_id text NOT NULL,
  instance_id text NOT NULL,
  start_offset bigint NOT NULL,
  data bytea NOT NULL,
  updated_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT vm_consoles_data_check CHECK ((octet_length(data) <= 65536)),
  CONSTRAINT vm_consoles_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id) ON DELETE CASCADE,
  CONSTRAINT vm_consoles_pkey PRIMARY KEY (node_id, instance_id),
  CONSTRAINT vm_consoles_start_offset_check CHECK ((start_offset >= 0))
);

CREATE TABLE vps_hosts (
  node_id text NOT NULL,
  state text NOT NULL,
  reasons text[] DEFAULT '{}'::text[] NOT NULL,
  bootstrap_command_id text,
  bootstrap_attempts integer DEFAULT 0 NOT NULL,
  report jsonb,
  free jsonb DEFAULT '{}'::jsonb NOT NULL,
  version bigint DEFAULT 1 NOT NULL,
  updated_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  bootstrap_generation bigint DEFAULT 0 NOT NULL,
  report_generation bigint DEFAULT 0 NOT NULL,
  CONSTRAINT vps_hosts_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
  CONSTRAINT vps_hosts_pkey PRIMARY KEY (node_id),
  CONSTRAINT vps_hosts_state_check CHECK ((state = ANY (ARRAY['new'::text, 'bootstrapping'::text, 'ready'::text, 'degraded'::text, 'draining'::text])))
);

CREATE TABLE vps_images (
  name text NOT NULL,
  url text NOT NULL,
  sha256 text NOT NULL,
  version bigint DEFAULT 1 NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  updated_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT vps_images_name_check CHECK ((name ~ '^[a-z0-9][a-z0-9._-]{0,63}$'::text)),
  CONSTRAINT vps_images_pkey PRIMARY KEY (name),
  CONSTRAINT vps_images_sha256_check CHECK ((sha256 ~ '^[0-9a-f]{64}$'::text)),
  CONSTRAINT vps_images_url_check CHECK (((url ~ '^(https?|file)://'::text) AND (length(url) <= 2048)))
);

CREATE TABLE vps_settings (
  singleton boolean DEFAULT true NOT NULL,
  catalogue_generation bigint DEFAULT 1 NOT NULL,
  CONSTRAINT vps_settings_pkey PRIMARY KEY (singleton),
  CONSTRAINT vps_settings_singleton_check CHECK (singleton)
);

CREATE TABLE webhook_deliveries (
  id text NOT NULL,
  webhook_id text NOT NULL,
  tenant_id text NOT NULL,
  event_id text NOT NULL,
  event_type text NOT NULL,
  payload jsonb NOT NULL,
  state text DEFAULT 'pending'::text NOT NULL,
  attempts integer DEFAULT 0 NOT NULL,
  next_attempt_at timestamp with time zone,
  last_status integer,
  last_error text,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  finished_at timestamp with time zone,
  CONSTRAINT webhook_deliveries_attempts_check CHECK ((attempts >= 0)),
  CONSTRAINT webhook_deliveries_check CHECK (((state = 'pending'::text) = (next_attempt_at IS NOT NULL))),
  CONSTRAINT webhook_deliveries_pkey PRIMARY KEY (id),
  CONSTRAINT webhook_deliveries_state_check CHECK ((state = ANY (ARRAY['pending'::text, 'delivered'::text, 'dead'::text]))),
  CONSTRAINT webhook_deliveries_webhook_id_event_id_key UNIQUE (webhook_id, event_id),
  CONSTRAINT webhook_deliveries_webhook_id_fkey FOREIGN KEY (webhook_id) REFERENCES webhooks(id) ON DELETE CASCADE
);

CREATE TABLE webhooks (
  id text NOT NULL,
  tenant_id text NOT NULL,
  url text NOT NULL,
  event_types text[] DEFAULT '{}'::text[] NOT NULL,
  description text DEFAULT ''::text NOT NULL,
  secret text NOT NULL,
  previous_secret text,
  previous_valid_until timestamp with time zone,
  disabled_at timestamp with time zone,
  disabled_reason text,
  version bigint DEFAULT 1 NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT webhooks_pkey PRIMARY KEY (id)
);

CREATE TABLE work_queue (
  kind text NOT NULL,
  key text NOT NULL,
  shard smallint NOT NULL,
  gen bigint DEFAULT 1 NOT NULL,
  not_before timestamp with time zone NOT NULL,
  claimed_until timestamp with time zone,
  claimed_by text,
  dirty_not_before timestamp with time zone,
  attempts integer DEFAULT 0 NOT NULL,
  last_error text,
  last_error_at timestamp with time zone,
  enqueued_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  CONSTRAINT work_queue_attempts_check CHECK ((attempts >= 0)),
  CONSTRAINT work_queue_check CHECK (((claimed_until IS NULL) = (claimed_by IS NULL))),
  CONSTRAINT work_queue_gen_check CHECK ((gen >= 1)),
  CONSTRAINT work_queue_pkey PRIMARY KEY (kind, key),
  CONSTRAINT work_queue_shard_check CHECK (((shard >= '-1'::integer) AND (shard <= 255)))
) WITH (autovacuum_vacuum_scale_factor=0.02, autovacuum_vacuum_threshold=200, autovacuum_vacuum_cost_delay=0);

CREATE TABLE workers (
  id text NOT NULL,
  hostname text NOT NULL,
  pid integer NOT NULL,
  roles text[] NOT NULL,
  version text NOT NULL,
  started_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  heartbeat_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  checks jsonb DEFAULT '[]'::jsonb NOT NULL,
  CONSTRAINT workers_checks_check CHECK ((jsonb_typeof(checks) = 'array'::text)),
  CONSTRAINT workers_pkey PRIMARY KEY (id)
);

CREATE TABLE workflow_steps (
  workflow_id text NOT NULL,
  idx integer NOT NULL,
  name text NOT NULL,
  state text NOT NULL,
  attempts integer DEFAULT 0 NOT NULL,
  attempts_this_run integer DEFAULT 0 NOT NULL,
  attempt_started_at timestamp with time zone,
  retry_at timestamp with time zone,
  memory jsonb DEFAULT '{}'::jsonb NOT NULL,
  message text,
  reason text,
  started_at timestamp with time zone,
  ended_at timestamp with time zone,
  CONSTRAINT workflow_steps_attempts_check CHECK ((attempts >= 0)),
  CONSTRAINT workflow_steps_check CHECK (((attempts_this_run >= 0) AND (attempts_this_run <= attempts))),
  CONSTRAINT workflow_steps_check1 CHECK (((retry_at IS NOT NULL) = (state = 'retrying'::text))),
  CONSTRAINT workflow_steps_idx_check CHECK ((idx >= 0)),
  CONSTRAINT workflow_steps_pkey PRIMARY KEY (workflow_id, idx),
  CONSTRAINT workflow_steps_state_check CHECK ((state = ANY (ARRAY['pending'::text, 'running'::text, 'retrying'::text, 'succeeded'::text, 'failed'::text, 'skipped'::text, 'cancelled'::text]))),
  CONSTRAINT workflow_steps_workflow_id_fkey FOREIGN KEY (workflow_id) REFERENCES workflows(id),
  CONSTRAINT workflow_steps_workflow_id_name_key UNIQUE (workflow_id, name)
);

CREATE TABLE workflows (
  id text NOT NULL,
  definition text NOT NULL,
  target jsonb NOT NULL,
  node_id text,
  pool_id text,
  params jsonb DEFAULT '{}'::jsonb NOT NULL,
  parent_id text,
  state text NOT NULL,
  current_step integer DEFAULT 0 NOT NULL,
  reason text,
  message text,
  failure jsonb,
  requested_by text NOT NULL,
  created_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  updated_at timestamp with time zone DEFAULT compute_now() NOT NULL,
  ended_at timestamp with time zone,
  version bigint DEFAULT 1 NOT NULL,
  CONSTRAINT workflows_check CHECK (((ended_at IS NULL) = (state = ANY (ARRAY['running'::text, 'held'::text, 'cancelling'::text])))),
  CONSTRAINT workflows_check1 CHECK (((node_id IS NULL) <> (target ? 'nodeId'::text))),
  CONSTRAINT workflows_current_step_check CHECK ((current_step >= 0)),
  CONSTRAINT workflows_parent_id_fkey FOREIGN KEY (parent_id) REFERENCES workflows(id),
  CONSTRAINT workflows_pkey PRIMARY KEY (id),
  CONSTRAINT workflows_state_check CHECK ((state = ANY (ARRAY['running'::text, 'held'::text, 'cancelling'::text, 'succeeded'::text, 'failed'::text, 'cancelled'::text])))
);

CREATE INDEX audit_entries_tenant ON public.audit_entries USING btree (tenant_id, log_index);
CREATE INDEX audit_entries_unplaced ON public.audit_entries USING btree (txid, "position") WHERE (log_index IS NULL);
CREATE INDEX authz_changes_cursor ON public.authz_changes USING btree (txid, seq);
CREATE INDEX commands_node_pending ON public.commands USING btree (node_id, seq) WHERE (state = 'pending'::text);
CREATE INDEX commands_open ON public.commands USING btree (not_after) WHERE (state = ANY (ARRAY['pending'::text, 'sent'::text, 'running'::text]));
CREATE INDEX device_booking_history_allocation ON public.device_booking_history USING btree (allocation_id);
CREATE INDEX device_booking_history_atom_end ON public.device_booking_history USING btree (device_id COLLATE "C", upper(during));
CREATE INDEX device_bookings_allocation ON public.device_bookings USING btree (allocation_id);
CREATE INDEX device_bookings_atom_end ON public.device_bookings USING btree (device_id COLLATE "C", upper(during));
CREATE INDEX devices_bookable ON public.devices USING btree (node_id, kind) WHERE bookable;
CREATE INDEX devices_children ON public.devices USING btree (parent_id) WHERE (parent_id IS NOT NULL);
CREATE UNIQUE INDEX devices_gpu_index ON public.devices USING btree (node_id, index) WHERE (parent_id IS NULL);
CREATE INDEX gpu_health_history_device ON public.gpu_health_history USING btree (device_id, id);
CREATE INDEX gpu_health_history_pool ON public.gpu_health_history USING btree (pool_id, at);
CREATE INDEX gpu_health_signals_device ON public.gpu_health_signals USING btree (device_id, observed_at);
CREATE INDEX gpu_health_signals_pending ON public.gpu_health_signals USING btree (node_id, id) WHERE (processed_at IS NULL);
CREATE INDEX idempotency_keys_expires_at ON public.idempotency_keys USING btree (expires_at);
CREATE INDEX instance_runs_open ON public.instance_runs USING btree (instance_id) WHERE upper_inf(during);
CREATE INDEX instance_usage_windows_tenant ON public.instance_usage_windows USING btree (tenant_id, window_start);
CREATE INDEX instances_node ON public.instances USING btree (node_id) WHERE (state <> 'deleted'::text);
CREATE UNIQUE INDEX instances_one_per_allocation ON public.instances USING btree (allocation_id) WHERE (state <> 'deleted'::text);
CREATE INDEX instances_tenant ON public.instances USING btree (tenant_id, id);
CREATE INDEX inventory_findings_node ON public.inventory_findings USING btree (node_id) WHERE (resolved_at IS NULL);
CREATE UNIQUE INDEX inventory_findings_open ON public.inventory_findings USING btree (pool_id, kind, COALESCE(node_id, ''::text), item) WHERE (resolved_at IS NULL);
CREATE INDEX join_tokens_pool ON public.join_tokens USING btree (pool_id);
CREATE INDEX node_atom_counts_fit ON public.node_atom_counts USING btree (pool_id, kind, model, profile, open, idle, node_id);
CREATE INDEX node_atom_counts_total ON public.node_atom_counts USING btree (pool_id, kind, model, profile, total);
CREATE INDEX node_certificates_node ON public.node_certificates USING btree (node_id, created_at DESC);
CREATE UNIQUE INDEX node_drains_open ON public.node_drains USING btree (node_id) WHERE (state <> 'cancelled'::text);
CREATE INDEX node_drains_pool ON public.node_drains USING btree (pool_id, requested_at, id) WHERE (state = ANY (ARRAY['queued'::text, 'draining'::text, 'drained'::text]));
CREATE INDEX node_sessions_gateway ON public.node_sessions USING btree (gateway_id) WHERE (closed_at IS NULL);
CREATE INDEX nodes_labels ON public.nodes USING gin (labels jsonb_path_ops);
CREATE INDEX nodes_pool ON public.nodes USING btree (pool_id);
CREATE INDEX reservations_live ON public.reservations USING btree (pool_id) WHERE (state = ANY (ARRAY['pending'::text, 'placed'::text, 'active'::text]));
CREATE INDEX reservations_tenant ON public.reservations USING btree (tenant_id, id);
CREATE INDEX reservations_usage ON public.reservations USING btree (pool_id, usage_closed_until) WHERE (state <> 'pending'::text);
CREATE INDEX role_bindings_tenant ON public.role_bindings USING btree (tenant_id, id);
CREATE INDEX tokens_identity ON public.tokens USING btree (identity_id);
CREATE INDEX usage_windows_tenant ON public.usage_windows USING btree (tenant_id, window_start);
CREATE INDEX webhook_deliveries_dead ON public.webhook_deliveries USING btree (tenant_id, id) WHERE (state = 'dead'::text);
CREATE INDEX webhook_deliveries_due ON public.webhook_deliveries USING btree (next_attempt_at) WHERE (state = 'pending'::text);
CREATE INDEX webhook_deliveries_endpoint_due ON public.webhook_deliveries USING btree (webhook_id, next_attempt_at, id) WHERE (state = 'pending'::text);
CREATE INDEX webhook_deliveries_finished ON public.webhook_deliveries USING btree (finished_at) WHERE (state <> 'pending'::text);
CREATE INDEX webhooks_tenant ON public.webhooks USING btree (tenant_id, id);
CREATE INDEX work_queue_due ON public.work_queue USING btree (kind, shard, not_before);
CREATE INDEX workers_heartbeat_at ON public.workers USING btree (heartbeat_at);
CREATE UNIQUE INDEX workflows_child ON public.workflows USING btree (parent_id, node_id) WHERE (parent_id IS NOT NULL);
CREATE INDEX workflows_node ON public.workflows USING btree (node_id, created_at) WHERE (node_id IS NOT NULL);
CREATE INDEX workflows_open ON public.workflows USING btree (state) WHERE (ended_at IS NULL);

CREATE TRIGGER audit_entries_append_only BEFORE DELETE OR UPDATE ON public.audit_entries FOR EACH ROW EXECUTE FUNCTION audit_entries_append_only();
CREATE TRIGGER commands_state_guard BEFORE UPDATE OF state ON public.commands FOR EACH ROW WHEN ((old.state IS DISTINCT FROM new.state)) EXECUTE FUNCTION commands_state_guard();
CREATE TRIGGER devices_health_state_guard BEFORE UPDATE OF health_state ON public.devices FOR EACH ROW WHEN ((old.health_state IS DISTINCT FROM new.health_state)) EXECUTE FUNCTION devices_health_state_guard();
CREATE TRIGGER instances_state_guard BEFORE UPDATE OF state ON public.instances FOR EACH ROW WHEN ((old.state IS DISTINCT FROM new.state)) EXECUTE FUNCTION instances_state_guard();
CREATE TRIGGER node_drains_state_guard BEFORE UPDATE OF state ON public.node_drains FOR EACH ROW WHEN ((old.state IS DISTINCT FROM new.state)) EXECUTE FUNCTION node_drains_state_guard();
CREATE TRIGGER nodes_convergence_since BEFORE UPDATE OF generation, observed_generation ON public.nodes FOR EACH ROW WHEN (((old.observed_generation >= old.generation) IS DISTINCT FROM (new.observed_generation >= new.generation))) EXECUTE FUNCTION nodes_convergence_flipped();
CREATE TRIGGER nodes_open_counts AFTER UPDATE OF observed_generation, no_schedule_reasons, taints ON public.nodes FOR EACH ROW WHEN ((capacity_node_open(old.observed_generation, old.no_schedule_reasons, old.taints) IS DISTINCT FROM capacity_node_open(new.observed_generation, new.no_schedule_reasons, new.taints))) EXECUTE FUNCTION capacity_node_open_changed();
CREATE TRIGGER nodes_resources AFTER INSERT ON public.nodes FOR EACH ROW EXECUTE FUNCTION capacity_node_registered();
CREATE TRIGGER nodes_usable_resources AFTER UPDATE OF reported_inventory, vcpu, memory_mib, disk_gib ON public.nodes FOR EACH ROW WHEN ((((old.reported_inventory -> 'vcpu'::text) IS DISTINCT FROM (new.reported_inventory -> 'vcpu'::text)) OR ((old.reported_inventory -> 'memoryMib'::text) IS DISTINCT FROM (new.reported_inventory -> 'memoryMib'::text)) OR ((old.reported_inventory -> 'diskGib'::text) IS DISTINCT FROM (new.reported_inventory -> 'diskGib'::text)) OR (((old.vcpu IS DISTINCT FROM new.vcpu) OR (old.memory_mib IS DISTINCT FROM new.memory_mib)) OR (old.disk_gib IS DISTINCT FROM new.disk_gib)))) EXECUTE FUNCTION capacity_node_inventory_changed();
CREATE TRIGGER pools_health_circuit AFTER INSERT ON public.pools FOR EACH ROW EXECUTE FUNCTION nodes_pool_health_circuit();
CREATE TRIGGER reservations_state_guard BEFORE UPDATE OF state ON public.reservations FOR EACH ROW WHEN ((old.state IS DISTINCT FROM new.state)) EXECUTE FUNCTION reservations_state_guard();
CREATE TRIGGER workflow_steps_state_guard BEFORE UPDATE OF state ON public.workflow_steps FOR EACH ROW WHEN ((old.state IS DISTINCT FROM new.state)) EXECUTE FUNCTION workflow_steps_state_guard();
CREATE TRIGGER workflows_state_guard BEFORE UPDATE OF state ON public.workflows FOR EACH ROW WHEN ((old.state IS DISTINCT FROM new.state)) EXECUTE FUNCTION workflows_state_guard();

FUNCTION audit_entries_append_only() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_after_change(r reservations, p_event_type text, p_event_id text, p_shard smallint) RETURNS jsonb LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_allocatable_floor(allocated numeric, ratio double precision) RETURNS bigint LANGUAGE sql IMMUTABLE;
FUNCTION capacity_candidates(p_pool text, p_kind text, p_model text, p_profile text, p_count integer, p_selector jsonb, p_tolerations jsonb, p_excluded text[], p_best_fit boolean, OUT nodes text[], OUT idles integer[]) RETURNS record LANGUAGE plpgsql STABLE SET plan_cache_mode=force_generic_plan SET enable_indexonlyscan=on;
FUNCTION capacity_charge(p_tenant text, p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint, p_disk_gib bigint) RETURNS integer LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_charge_many(p_tenants text[], p_kinds text[], p_counts bigint[], p_vcpus bigint[], p_memory_mibs bigint[], p_disk_gibs bigint[]) RETURNS text[] LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_charge_of(p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint, p_disk_gib bigint) RETURNS TABLE(resource text, amount bigint) LANGUAGE sql IMMUTABLE;
FUNCTION capacity_end(p_id text, p_tenant text, p_to text, p_event_id text, p_shard smallint) RETURNS jsonb LANGUAGE plpgsql VOLATILE SET enable_seqscan=off SET enable_indexonlyscan=off;
FUNCTION capacity_ended_at(r reservations) RETURNS timestamp with time zone LANGUAGE sql STABLE;
FUNCTION capacity_lock_refunds_of(p_ids text[]) RETURNS void LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_node_inventory_changed() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_node_open(p_observed_generation bigint, p_no_schedule_reasons text[], p_taints jsonb) RETURNS boolean LANGUAGE sql IMMUTABLE;
FUNCTION capacity_node_open_changed() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_node_registered() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_node_takes(p_observed_generation bigint, p_no_schedule_reasons text[], p_taints jsonb, p_tolerations jsonb) RETURNS boolean LANGUAGE sql IMMUTABLE;
FUNCTION capacity_place(p_pool text, p_kind text, p_model text, p_profile text, p_count integer, p_vcpu integer, p_memory_mib bigint, p_disk_gib bigint, p_selector jsonb, p_tolerations jsonb, p_allocation text, p_during tstzrange, p_max_replans integer, OUT placed_node text, OUT placed_atoms text[], OUT tried text[], OUT raced boolean, OUT conflicts integer, OUT placed_from timestamp with time zone) RETURNS record LANGUAGE plpgsql VOLATILE SET enable_seqscan=off SET enable_indexonlyscan=off;
FUNCTION capacity_refresh_node_counts(p_node text) RETURNS void LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_refund(p_tenant text, p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint, p_disk_gib bigint) RETURNS integer LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_refund_many(p_tenants text[], p_kinds text[], p_counts bigint[], p_vcpus bigint[], p_memory_mibs bigint[], p_disk_gibs bigint[]) RETURNS integer LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_release_batch(p_ids text[], p_tenants text[], p_event_ids text[], p_shards smallint[]) RETURNS jsonb[] LANGUAGE plpgsql VOLATILE SET enable_seqscan=off SET enable_indexonlyscan=off SET plan_cache_mode=force_generic_plan SET enable_hashjoin=off SET enable_mergejoin=off;
FUNCTION capacity_reserve(p_id text, p_tenant text, p_identity text, p_pool text, p_kind text, p_model text, p_profile text, p_count integer, p_vcpu integer, p_memory_mib bigint, p_disk_gib bigint, p_starts_at timestamp with time zone, p_ends_at timestamp with time zone, p_duration_s double precision, p_selector jsonb, p_tolerations jsonb, p_max_replans integer, p_retry_s double precision, p_max_duration_s double precision, p_event_id text, p_shard smallint) RETURNS jsonb LANGUAGE plpgsql VOLATILE SET enable_seqscan=off;
FUNCTION capacity_reserve_batch(p_ids text[], p_tenants text[], p_identities text[], p_pools text[], p_models text[], p_selectors jsonb[], p_counts integer[], p_vcpus integer[], p_memory_mibs bigint[], p_disk_gibs bigint[], p_ends_at timestamp with time zone[], p_durations_s double precision[], p_keys text[], p_key_hashes bytea[], p_key_ttl_s double precision, p_event_ids text[], p_shards smallint[], p_share integer, p_shares integer, p_max_duration_s double precision) RETURNS jsonb[] LANGUAGE plpgsql VOLATILE SET enable_seqscan=off SET enable_indexonlyscan=off SET plan_cache_mode=force_generic_plan SET enable_hashjoin=off SET enable_mergejoin=off;
FUNCTION capacity_step(p_id text, p_max_replans integer, p_retry_s double precision, p_event_id text, p_shard smallint) RETURNS text LANGUAGE plpgsql VOLATILE SET enable_seqscan=off;
FUNCTION capacity_tolerates(p_taints jsonb, p_tolerations jsonb) RETURNS boolean LANGUAGE sql IMMUTABLE;
FUNCTION capacity_unschedulable(p_kind text, p_model text, p_profile text, p_count integer, p_tried text[], p_raced boolean, p_retry_s double precision) RETURNS jsonb LANGUAGE sql IMMUTABLE;
FUNCTION capacity_upsert_node_counts(p_node text) RETURNS void LANGUAGE sql VOLATILE SET enable_indexonlyscan=off;
FUNCTION capacity_usable(registered bigint, reported jsonb) RETURNS bigint LANGUAGE sql IMMUTABLE;
FUNCTION capacity_usage_close(p_pool text, p_limit integer) RETURNS TABLE(id text, tenant_id text, data jsonb) LANGUAGE plpgsql VOLATILE;
FUNCTION capacity_usage_closed_until() RETURNS timestamp with time zone LANGUAGE sql STABLE;
FUNCTION capacity_usage_held(r reservations) RETURNS tstzrange LANGUAGE sql STABLE;
FUNCTION capacity_usage_is_due(r reservations, p_closed timestamp with time zone) RETURNS boolean LANGUAGE sql STABLE;
FUNCTION capacity_usage_seconds(m tstzmultirange) RETURNS numeric LANGUAGE sql IMMUTABLE;
FUNCTION capacity_usage_window_s() RETURNS integer LANGUAGE sql STABLE;
FUNCTION capacity_view(r reservations) RETURNS jsonb LANGUAGE plpgsql STABLE;
FUNCTION capacity_view_of(r reservations, p_atoms jsonb) RETURNS jsonb LANGUAGE sql STABLE;
FUNCTION commands_state_guard() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION commands_state_may_become(p_from text, p_to text) RETURNS boolean LANGUAGE sql IMMUTABLE;
FUNCTION compute_now() RETURNS timestamp with time zone LANGUAGE sql STABLE;
FUNCTION desired_invalidate(p_nodes text[], p_shards smallint[]) RETURNS integer LANGUAGE sql VOLATILE;
FUNCTION devices_health_state_guard() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION devices_health_state_may_become(p_from text, p_to text) RETURNS boolean LANGUAGE sql IMMUTABLE;
FUNCTION idempotency_answer(p_tenants text[], p_identities text[], p_keys text[], p_responses jsonb[]) RETURNS integer LANGUAGE plpgsql VOLATILE;
FUNCTION idempotency_claim(p_tenants text[], p_identities text[], p_keys text[], p_method text, p_hashes bytea[], p_ttl_s double precision) RETURNS TABLE(tenant_id text, identity_id text, key text) LANGUAGE sql VOLATILE;
FUNCTION idempotency_forget(p_tenants text[], p_identities text[], p_keys text[]) RETURNS integer LANGUAGE plpgsql VOLATILE;
FUNCTION instances_state_guard() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION instances_state_may_become(p_from text, p_to text) RETURNS boolean LANGUAGE sql IMMUTABLE;
FUNCTION inventory_scope_path(kind text, id text) RETURNS TABLE(scope_kind text, scope_id text) LANGUAGE sql STABLE;
FUNCTION node_drains_state_guard() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION node_drains_state_may_become(p_from text, p_to text) RETURNS boolean LANGUAGE sql IMMUTABLE;
FUNCTION nodes_conditions(n nodes) RETURNS jsonb LANGUAGE sql STABLE;
FUNCTION nodes_conditions_record(p_nodes text[]) RETURNS TABLE(node_id text, type text, reason text, message text, change text) LANGUAGE sql VOLATILE;
FUNCTION nodes_conditions_seen(n nodes) RETURNS jsonb LANGUAGE sql STABLE;
FUNCTION nodes_convergence_flipped() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION nodes_inventory_findings(p_pool text, p_node text) RETURNS TABLE(kind text, node_id text, item text, message text) LANGUAGE sql STABLE;
FUNCTION nodes_pool_budget(p_pool text) RETURNS integer LANGUAGE sql STABLE;
FUNCTION nodes_pool_health_circuit() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION nodes_ts(t timestamp with time zone) RETURNS text LANGUAGE sql STABLE;
FUNCTION outbox_emit(p_id text, p_type text, p_tenant_id text, p_subject text, p_data jsonb) RETURNS text LANGUAGE plpgsql VOLATILE;
FUNCTION outbox_emit_many(p_ids text[], p_types text[], p_tenant_ids text[], p_subjects text[], p_data jsonb[]) RETURNS integer LANGUAGE plpgsql VOLATILE;
FUNCTION outbox_withdraw(p_ids text[]) RETURNS integer LANGUAGE plpgsql VOLATILE;
FUNCTION reservations_state_guard() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION reservations_state_may_become(p_from text, p_to text) RETURNS boolean LANGUAGE sql IMMUTABLE;
FUNCTION vm_console_append(p_node text, p_instance text, p_offset bigint, p_data bytea, p_keep integer) RETURNS void LANGUAGE plpgsql VOLATILE;
FUNCTION vps_usage_close(p_pool text, p_limit integer) RETURNS TABLE(id text, tenant_id text, data jsonb) LANGUAGE plpgsql VOLATILE;
FUNCTION work_queue_enqueue(p_kinds text[], p_keys text[], p_shards smallint[], p_after_s double precision) RETURNS integer LANGUAGE plpgsql VOLATILE;
FUNCTION workflow_steps_state_guard() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION workflow_steps_state_may_become(p_from text, p_to text) RETURNS boolean LANGUAGE sql IMMUTABLE;
FUNCTION workflows_state_guard() RETURNS trigger LANGUAGE plpgsql VOLATILE;
FUNCTION workflows_state_may_become(p_from text, p_to text) RETURNS boolean LANGUAGE sql IMMUTABLE;
