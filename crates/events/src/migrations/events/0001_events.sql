-- Webhook endpoints per tenant, and one delivery row per (endpoint, event): the fan-out inserts
-- them from the outbox (at least once, so UNIQUE makes a repeat a no-op), the deliverer claims due
-- ones, and exhausted ones stay as dead letters until replayed or pruned.
CREATE TABLE webhooks (
  id text PRIMARY KEY,
  tenant_id text NOT NULL,
  url text NOT NULL,
  event_types text[] NOT NULL DEFAULT '{}',
  description text NOT NULL DEFAULT '',
  -- The signing secret (whsec_…): needed to sign, so it is stored; it is shown only when made.
  secret text NOT NULL,
  -- After a rotation, the old secret still signs until previous_valid_until.
  previous_secret text,
  previous_valid_until timestamptz,
  disabled_at timestamptz,
  disabled_reason text,
  version bigint NOT NULL DEFAULT 1,
  created_at timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX webhooks_tenant ON webhooks (tenant_id, id);

CREATE TABLE webhook_deliveries (
  id text PRIMARY KEY,
  webhook_id text NOT NULL REFERENCES webhooks ON DELETE CASCADE,
  tenant_id text NOT NULL,
  event_id text NOT NULL,
  event_type text NOT NULL,
  payload jsonb NOT NULL,
  state text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'dead')),
  attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
  next_attempt_at timestamptz,
  last_status integer,
  last_error text,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  finished_at timestamptz,
  CHECK ((state = 'pending') = (next_attempt_at IS NOT NULL)),
  UNIQUE (webhook_id, event_id)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_dead ON webhook_deliveries (tenant_id, id) WHERE state = 'dead';
CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (finished_at) WHERE state <> 'pending';

-- Each endpoint's deliveries are claimed on their own (events.deliver runs a key per webhook):
-- its due ones, oldest first.
CREATE INDEX webhook_deliveries_endpoint_due ON webhook_deliveries (webhook_id, next_attempt_at, id) WHERE state = 'pending';
