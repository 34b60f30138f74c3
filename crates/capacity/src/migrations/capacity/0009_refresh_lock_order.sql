-- capacity_refresh_node_counts as in 0007_open_counts, upserting the node's count rows in key order.
-- The rows came in the GROUP BY's output order, which is the plan's: a hash aggregate and a sorted
-- one give different orders, and two backends can hold different plans of it (one planned before an
-- auto-analyze, one after). Two refreshes of one node's counts (a mode change's and the rollup's)
-- could then lock its rows in opposite orders and deadlock. In key order they queue instead.
CREATE OR REPLACE FUNCTION capacity_refresh_node_counts(p_node text) RETURNS void LANGUAGE sql AS $$
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
