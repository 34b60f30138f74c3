-- How long placed entries are kept (prune.rs): entries are pruned only below a checkpoint older
-- than the retention, which stays as the anchor an export starts from (its chain hash and frontier).
CREATE TABLE audit_settings (
  singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  -- NULL: keep every entry
  retention_s integer CHECK (retention_s >= 3600),
  -- every entry below this log index is pruned; it is a checkpoint's size, or 0
  pruned_below bigint NOT NULL DEFAULT 0 CHECK (pruned_below >= 0)
);
INSERT INTO audit_settings DEFAULT VALUES;
