-- Audit entries are append-only: once `audit.checkpoint` placed an entry in the log, it never
-- changes, and it goes only when pruned below the anchor checkpoint (prune.rs, which says so for
-- its transaction). An owner of the database can bypass this; the hash chain and the signed
-- checkpoints then show what was changed.
CREATE OR REPLACE FUNCTION audit_entries_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' AND OLD.log_index IS NOT NULL AND current_setting('better_compute.audit_prune', true) = 'on'
     AND OLD.log_index < (SELECT pruned_below FROM audit_settings) THEN
    RETURN OLD;
  END IF;
  IF OLD.log_index IS NOT NULL THEN
    RAISE EXCEPTION 'audit entry % is in the log and cannot change', OLD.id USING ERRCODE = 'restrict_violation';
  END IF;
  IF TG_OP = 'DELETE' THEN
    RAISE EXCEPTION 'audit entry % cannot be deleted', OLD.id USING ERRCODE = 'restrict_violation';
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER audit_entries_append_only BEFORE UPDATE OR DELETE ON audit_entries
  FOR EACH ROW EXECUTE FUNCTION audit_entries_append_only();
