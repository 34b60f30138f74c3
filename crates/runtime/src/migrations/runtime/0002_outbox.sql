-- Events leave through the outbox, written in the transaction of the change they describe.
-- Readers take only rows whose transaction is older than every running one (txid below the
-- snapshot's xmin), in (txid, seq) order, so a row that commits late is never skipped.
CREATE TABLE outbox (
  txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
  seq bigint GENERATED ALWAYS AS IDENTITY,
  id text NOT NULL UNIQUE,
  type text NOT NULL,
  tenant_id text,
  subject text NOT NULL,
  data jsonb NOT NULL,
  time timestamptz NOT NULL DEFAULT compute_now(),
  PRIMARY KEY (txid, seq)
);

-- Where each sink has got to; saved after every delivered batch by the sink's lease holder.
CREATE TABLE outbox_cursors (
  sink text PRIMARY KEY,
  txid xid8 NOT NULL,
  seq bigint NOT NULL,
  delivered bigint NOT NULL DEFAULT 0,
  updated_at timestamptz NOT NULL DEFAULT compute_now()
);
