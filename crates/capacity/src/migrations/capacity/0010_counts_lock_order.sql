-- A node's count rows are locked in key order (kind, model, profile) by everything that locks
-- several of them, as the refresh's upsert already did (0009_refresh_lock_order):
--
-- 1. the trigger that keeps their open flag (0007_open_counts), fired by a taint, cordon or
--    liveness change, updated them in its plan's order, which for a sequential or bitmap scan is
--    the heap's. Against a refresh of the same node (the inventory subscriber's, a mode change's)
--    that deadlocked on a node with two classes: the torture test met it about once per 400 seeds;
-- 2. the refresh itself zeroed the rows of classes the node no longer has in the same statement
--    as its upsert, so in no set order against it. It now locks the node's existing rows first,
--    in key order, then upserts (new rows are inserted in key order too).
-- Callers that refresh several nodes take them in id order (reconcilers::refresh_nodes), as the
-- rollup's repair of open flags does.

CREATE OR REPLACE FUNCTION capacity_node_open_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  -- the node's row is held (this is its update's trigger); its count rows next, in key order
  PERFORM 1 FROM node_atom_counts WHERE node_id = NEW.id ORDER BY kind, model, profile FOR UPDATE;
  UPDATE node_atom_counts SET open = capacity_node_open(NEW.observed_generation, NEW.no_schedule_reasons, NEW.taints)
   WHERE node_id = NEW.id;
  RETURN NULL;
END $$;

-- capacity_refresh_node_counts: 0009_refresh_lock_order's upsert, kept whole under a new name, after
-- the lock on the node's existing rows. The lock is its own statement, so it comes first.
ALTER FUNCTION capacity_refresh_node_counts(text) RENAME TO capacity_upsert_node_counts;
CREATE FUNCTION capacity_refresh_node_counts(p_node text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  -- the node's existing count rows, in key order, before any of them is written
  PERFORM 1 FROM node_atom_counts WHERE node_id = p_node ORDER BY kind, model, profile FOR UPDATE;
  PERFORM capacity_upsert_node_counts(p_node);
END $$;
