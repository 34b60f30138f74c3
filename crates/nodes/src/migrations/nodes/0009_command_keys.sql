-- The public halves of the control plane's command-signing keys since its first rotation (the
-- private halves live only in the CA's folder). The AgentPart announces those not retired to every
-- daemon; each but the first carries its predecessor's endorsement.
CREATE TABLE command_keys (
  public_key bytea PRIMARY KEY CHECK (octet_length(public_key) = 32),
  -- the order of rotations
  position bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
  endorsement bytea CHECK (endorsement IS NULL OR octet_length(endorsement) = 64),
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  retired_at timestamptz
);
