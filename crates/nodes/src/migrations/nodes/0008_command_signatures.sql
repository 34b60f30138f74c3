-- A destructive command's Ed25519 signature by the control plane's command-signing key, made at
-- enqueue (commands.rs); NULL for other kinds.
ALTER TABLE commands ADD COLUMN signature bytea CHECK (signature IS NULL OR octet_length(signature) = 64);
