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

-- capacity_refresh_node_counts as in 0009_refresh_lock_order, in PL/pgSQL so that the lock comes
-- first, in its own statement.
CREATE OR REPLACE FUNCTION capacity_refresh_node_counts(p_node text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  -- the node's existing count rows, in key order, before any of them is written
  PERFORM 1 FROM node_atom_counts WHERE node_id = p_node ORDER BY kind, model, profile FOR UPDATE;
  WITH fresh AS (
    SELECT a.node_id, n.pool_id, a.kind, a.model, coalesce(a.profile, '') AS profile, count(*)::int AS total,
           (count(*) FILTER (WHERE coalesce((SELECT max(upper(b.during)) FROM device_bookings b
                                              WHERE b.device_id COLLATE "C" = a.id), '-infinity') <= compute_now()))::int AS idle,
           capacity_node_open(n.observed_generation, n.no_schedule_reasons, n.taints) AS open
      FROM devices a
      JOIN devices g ON g.id = coalesce(a.parent_id, a.id)
      JOIN nodes n ON n.id = a.node_id
     WHERE a.node_id = p_node AND a.bookable AND g.healthy AND NOT g.quarantined
     GROUP BY a.node_id, n.id, a.kind, a.model, coalesce(a.profile, '')),
  up AS (
    INSERT INTO node_atom_counts (node_id, pool_id, kind, model, profile, total, idle, open)
    SELECT * FROM fresh ORDER BY kind, model, profile
    ON CONFLICT (node_id, kind, model, profile)
      DO UPDATE SET pool_id = EXCLUDED.pool_id, total = EXCLUDED.total, idle = EXCLUDED.idle)
  -- The rows of classes the node no longer has (after a mode or layout change): rare, and disjoint
  -- from the upserted ones.
  UPDATE node_atom_counts c SET total = 0, idle = 0
   WHERE c.node_id = p_node AND c.total > 0
     AND NOT EXISTS (SELECT 1 FROM fresh f WHERE f.kind = c.kind AND f.model = c.model AND f.profile = c.profile);
END $$;
