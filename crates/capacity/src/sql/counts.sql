-- node_atom_counts: per node and atom class, the atoms that could be booked (bookable, healthy, not
-- quarantined) and how many have no current or future booking, and whether the node is open (takes a
-- request that tolerates nothing). A hint that lets the placer find candidates by index instead of
-- scanning the pool; bookings and the node's row stay the truth. The placer still locks the node
-- FOR SHARE and rechecks every rule under the lock (capacity_place), so a stale count or flag costs
-- a replan, never a placement on an ineligible node or a booked atom.
--
-- A request without tolerations takes open nodes only, and any open node, so its candidate search
-- reads the class's open counts in index order and stops, with no join to nodes (35 buffers a
-- search instead of 225 with the join, on the capacity bench's 1,000 nodes).
--
-- A node's count rows are locked in key order (kind, model, profile) by everything that locks several
-- of them: the refresh (its existing rows first, then the upsert, whose new rows come in key order
-- too) and the trigger that keeps the open flag. Callers that refresh several nodes take them in id
-- order (reconcilers::refresh_nodes). In any other order, two refreshes of one node with two classes
-- (a mode change's and the rollup's), or a refresh and a taint change, deadlock.

-- Upserts the node's count rows in key order: the rows would otherwise come in the GROUP BY's output
-- order, which is the plan's (hash and sorted aggregates differ, and two backends can hold different
-- plans). Index-only scans are off: on a nearly empty device_bookings the planner takes the exclusion
-- constraint's GiST for an atom's latest end and reads every live booking per lookup; the btree
-- device_bookings_atom_end serves it by index scan.
CREATE OR REPLACE FUNCTION capacity_upsert_node_counts(p_node text) RETURNS void LANGUAGE sql SET enable_indexonlyscan = off AS $$
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
$$;

-- Refreshes a node's counts: its existing rows locked in key order before any is written, then the
-- upsert.
CREATE OR REPLACE FUNCTION capacity_refresh_node_counts(p_node text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  -- the node's existing count rows, in key order, before any of them is written
  PERFORM 1 FROM node_atom_counts WHERE node_id = p_node ORDER BY kind, model, profile FOR UPDATE;
  PERFORM capacity_upsert_node_counts(p_node);
END $$;

-- Keeps the open flag, in the transaction that changes the node (the node's row, then its counts:
-- the lock order). A refresh that inserts a class's first count row computes the flag from the node
-- as its snapshot saw it and may miss a change committing at the same moment; the pool's rollup,
-- which runs after every inventory change and at every resync, puts such a row right under the
-- node's lock (reconcilers::Rollup).
CREATE OR REPLACE FUNCTION capacity_node_open_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  -- the node's row is held (this is its update's trigger); its count rows next, in key order
  PERFORM 1 FROM node_atom_counts WHERE node_id = NEW.id ORDER BY kind, model, profile FOR UPDATE;
  UPDATE node_atom_counts SET open = capacity_node_open(NEW.observed_generation, NEW.no_schedule_reasons, NEW.taints)
   WHERE node_id = NEW.id;
  RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER nodes_open_counts AFTER UPDATE OF observed_generation, no_schedule_reasons, taints ON nodes
  FOR EACH ROW
  WHEN (capacity_node_open(OLD.observed_generation, OLD.no_schedule_reasons, OLD.taints)
        IS DISTINCT FROM capacity_node_open(NEW.observed_generation, NEW.no_schedule_reasons, NEW.taints))
  EXECUTE FUNCTION capacity_node_open_changed();
