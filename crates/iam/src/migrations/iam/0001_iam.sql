-- Built-in IAM: tenants, identities, bearer tokens (only their SHA-256 is stored), roles as sets of
-- permissions, role bindings at fleet, tenant, site, pool or node scope, the effective-permission
-- projection, and the change feed API processes tail to drop cached decisions early.

CREATE TABLE tenants (
  id text PRIMARY KEY,
  name text NOT NULL UNIQUE CHECK (name ~ '^[a-z0-9][a-z0-9-]{0,62}$'),
  created_at timestamptz NOT NULL DEFAULT compute_now()
);

CREATE TABLE identities (
  id text PRIMARY KEY,
  tenant_id text NOT NULL REFERENCES tenants,
  name text NOT NULL CHECK (name ~ '^[a-z0-9][a-z0-9._@-]{0,127}$'),
  kind text NOT NULL CHECK (kind IN ('person', 'service')),
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  UNIQUE (tenant_id, name)
);

CREATE TABLE tokens (
  id text PRIMARY KEY,
  tenant_id text NOT NULL REFERENCES tenants,
  identity_id text NOT NULL REFERENCES identities,
  name text NOT NULL DEFAULT '',
  -- SHA-256 of the secret; the secret itself is shown once and never stored.
  secret_sha256 bytea NOT NULL UNIQUE CHECK (length(secret_sha256) = 32),
  expires_at timestamptz NOT NULL,
  revoked_at timestamptz,
  created_at timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX tokens_identity ON tokens (identity_id);

CREATE TABLE roles (
  name text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9-]{0,62}$'),
  description text NOT NULL,
  permissions text[] NOT NULL
);

CREATE TABLE role_bindings (
  id text PRIMARY KEY,
  tenant_id text NOT NULL REFERENCES tenants,
  identity_id text NOT NULL REFERENCES identities,
  role text NOT NULL REFERENCES roles,
  -- fleet: every site (operators); tenant: the binding's own tenant; site, pool, node: that one.
  scope_kind text NOT NULL CHECK (scope_kind IN ('fleet', 'tenant', 'site', 'pool', 'node')),
  scope_id text NOT NULL,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  CHECK ((scope_kind = 'fleet') = (scope_id = '')),
  CHECK (scope_kind <> 'tenant' OR scope_id = tenant_id),
  UNIQUE (identity_id, role, scope_kind, scope_id)
);
CREATE INDEX role_bindings_tenant ON role_bindings (tenant_id, id);

-- What each identity may do where, flattened from its bindings and their roles. Rewritten for an
-- identity in the transaction that changes its bindings (or a role's permissions).
CREATE TABLE authz_projection (
  identity_id text NOT NULL,
  permission text NOT NULL,
  scope_kind text NOT NULL,
  scope_id text NOT NULL,
  PRIMARY KEY (identity_id, permission, scope_kind, scope_id)
);

-- One row per change that can shrink what someone may do (a binding removed, a token revoked),
-- read with the outbox's cursor rule so none is skipped.
CREATE TABLE authz_changes (
  seq bigserial PRIMARY KEY,
  txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
  identity_id text NOT NULL,
  token_id text,
  at timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX authz_changes_cursor ON authz_changes (txid, seq);
