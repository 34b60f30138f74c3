-- Eligibility on the counts: each node_atom_counts row says whether its node is open, that is
-- converged at least once, with nothing in noScheduleReasons and no taint (capacity_node_open).
-- A request without tolerations takes open nodes only, and any open node, so its candidate search
-- reads the class's open counts in index order and stops: no join to nodes.
--
-- Before, the search joined each of the 64 counts of its window to its node for the eligibility
-- rules, three buffers a node: it read 225 buffers a call, and 35 without the join
-- (pg_stat_statements, the capacity bench with one client on 1,000 nodes). The flag is a hint, as the
-- counts are: the placer still locks the node FOR SHARE and rechecks every rule under the lock
-- (capacity_place), so a stale flag costs a replan, never a placement on an ineligible node.
--
-- Kept by a trigger on nodes, in the transaction that changes the node (the node's row, then its
-- counts: the lock order). A refresh that inserts a class's first count row computes the flag from
-- the node as its snapshot saw it, and may miss a change committing at the same moment; the pool's
-- rollup, which runs after every inventory change and at every resync, puts such a row right, under
-- the node's lock (reconcilers::Rollup).

-- Whether a node takes a request that tolerates nothing: the eligibility rules stay in one place,
-- capacity_node_takes (0002_placer), and both inline into the queries that call them.
CREATE FUNCTION capacity_node_open(p_observed_generation bigint, p_no_schedule_reasons text[], p_taints jsonb)
RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
  SELECT capacity_node_takes(p_observed_generation, p_no_schedule_reasons, p_taints, '[]'::jsonb)
$$;

ALTER TABLE node_atom_counts ADD COLUMN open boolean NOT NULL DEFAULT false;
UPDATE node_atom_counts c SET open = capacity_node_open(n.observed_generation, n.no_schedule_reasons, n.taints)
  FROM nodes n WHERE n.id = c.node_id;

-- The class, then open or not, then the fit order: a request without tolerations walks one range.
DROP INDEX node_atom_counts_fit;
CREATE INDEX node_atom_counts_fit ON node_atom_counts (pool_id, kind, model, profile, open, idle, node_id);

CREATE FUNCTION capacity_node_open_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  UPDATE node_atom_counts SET open = capacity_node_open(NEW.observed_generation, NEW.no_schedule_reasons, NEW.taints)
   WHERE node_id = NEW.id;
  RETURN NULL;
END $$;

CREATE TRIGGER nodes_open_counts AFTER UPDATE OF observed_generation, no_schedule_reasons, taints ON nodes
  FOR EACH ROW
  WHEN (capacity_node_open(OLD.observed_generation, OLD.no_schedule_reasons, OLD.taints)
        IS DISTINCT FROM capacity_node_open(NEW.observed_generation, NEW.no_schedule_reasons, NEW.taints))
  EXECUTE FUNCTION capacity_node_open_changed();

-- capacity_refresh_node_counts as in 0004_release, with the flag set on the rows it inserts. On the
-- rows it updates the flag is left to the trigger: the refresh's snapshot may predate the node's
-- last change, the trigger's never does.
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
    SELECT * FROM fresh
    ON CONFLICT (node_id, kind, model, profile)
      DO UPDATE SET pool_id = EXCLUDED.pool_id, total = EXCLUDED.total, idle = EXCLUDED.idle)
  UPDATE node_atom_counts c SET total = 0, idle = 0
   WHERE c.node_id = p_node AND c.total > 0
     AND NOT EXISTS (SELECT 1 FROM fresh f WHERE f.kind = c.kind AND f.model = c.model AND f.profile = c.profile);
$$;

-- capacity_candidates as in 0005_placer, its searches without a selector split by the flag: the
-- open counts of the window, as they come; and, only for a request with tolerations, the closed
-- counts of the window joined to their nodes, for the taints it tolerates. The generic plans
-- (0006_generic_candidates) walk each part in index order, and skip the second part by a one-time
-- filter when the request tolerates nothing. (CREATE OR REPLACE resets a function's settings, so
-- the generic plans are asked for again here.)
CREATE OR REPLACE FUNCTION capacity_candidates(
  p_pool text, p_kind text, p_model text, p_profile text, p_count int, p_selector jsonb,
  p_tolerations jsonb, p_excluded text[], p_best_fit boolean,
  OUT nodes text[], OUT idles int[])
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan AS $$
DECLARE
  v_window bigint;
  v_more bigint;
BEGIN
  IF p_selector <> '{}'::jsonb THEN
    -- A node selector: start from the nodes that carry the labels (GIN index), then their counts.
    SELECT array_agg(s.node_id ORDER BY s.o), array_agg(s.idle ORDER BY s.o) INTO nodes, idles
      FROM (SELECT c.node_id, c.idle, row_number() OVER (ORDER BY CASE WHEN p_best_fit THEN c.idle ELSE -c.idle END, random()) AS o
              FROM nodes n JOIN node_atom_counts c ON c.node_id = n.id
             WHERE n.pool_id = p_pool AND c.kind = p_kind AND c.model = p_model AND c.profile = p_profile
               AND CASE WHEN p_best_fit THEN c.idle ELSE c.total END >= p_count
               AND NOT (n.id = ANY(p_excluded))
               AND n.labels @> p_selector
               AND capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, p_tolerations)) s
     WHERE s.o <= 32;
    RETURN;
  END IF;
  FOREACH v_window IN ARRAY ARRAY[64, 1024, 9223372036854775806]::bigint[] LOOP
    IF p_best_fit THEN
      SELECT array_agg(s.node_id ORDER BY s.idle, s.r), array_agg(s.idle ORDER BY s.idle, s.r) INTO nodes, idles
        FROM (SELECT c.node_id, c.idle, random() AS r
                FROM ((SELECT a.node_id, a.idle FROM node_atom_counts a
                        WHERE a.pool_id = p_pool AND a.kind = p_kind AND a.model = p_model AND a.profile = p_profile
                          AND a.open AND a.idle >= p_count
                        ORDER BY a.idle, a.node_id LIMIT v_window)
                      UNION ALL
                      (SELECT t.node_id, t.idle
                         FROM (SELECT a.node_id, a.idle FROM node_atom_counts a
                                WHERE p_tolerations <> '[]'::jsonb
                                  AND a.pool_id = p_pool AND a.kind = p_kind AND a.model = p_model AND a.profile = p_profile
                                  AND NOT a.open AND a.idle >= p_count
                                ORDER BY a.idle, a.node_id LIMIT v_window) t
                         JOIN nodes n ON n.id = t.node_id
                        WHERE capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, p_tolerations))) c
               WHERE NOT (c.node_id = ANY(p_excluded))
               ORDER BY c.idle, r LIMIT 32) s;
    ELSE
      SELECT array_agg(s.node_id ORDER BY s.idle DESC, s.r), array_agg(s.idle ORDER BY s.idle DESC, s.r) INTO nodes, idles
        FROM (SELECT c.node_id, c.idle, random() AS r
                FROM ((SELECT a.node_id, a.idle FROM node_atom_counts a
                        WHERE a.pool_id = p_pool AND a.kind = p_kind AND a.model = p_model AND a.profile = p_profile
                          AND a.open AND a.total >= p_count
                        ORDER BY a.idle DESC, a.node_id DESC LIMIT v_window)
                      UNION ALL
                      (SELECT t.node_id, t.idle
                         FROM (SELECT a.node_id, a.idle FROM node_atom_counts a
                                WHERE p_tolerations <> '[]'::jsonb
                                  AND a.pool_id = p_pool AND a.kind = p_kind AND a.model = p_model AND a.profile = p_profile
                                  AND NOT a.open AND a.total >= p_count
                                ORDER BY a.idle DESC, a.node_id DESC LIMIT v_window) t
                         JOIN nodes n ON n.id = t.node_id
                        WHERE capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, p_tolerations))) c
               WHERE NOT (c.node_id = ANY(p_excluded))
               ORDER BY c.idle DESC, r LIMIT 32) s;
    END IF;
    EXIT WHEN coalesce(cardinality(nodes), 0) = 32;
    -- Too few in the windows: has either part more rows to look at?
    SELECT greatest(
             (SELECT count(*) FROM (SELECT 1 FROM node_atom_counts a
                                     WHERE a.pool_id = p_pool AND a.kind = p_kind AND a.model = p_model AND a.profile = p_profile
                                       AND a.open AND CASE WHEN p_best_fit THEN a.idle ELSE a.total END >= p_count
                                     LIMIT v_window + 1) x),
             (SELECT count(*) FROM (SELECT 1 FROM node_atom_counts a
                                     WHERE p_tolerations <> '[]'::jsonb
                                       AND a.pool_id = p_pool AND a.kind = p_kind AND a.model = p_model AND a.profile = p_profile
                                       AND NOT a.open AND CASE WHEN p_best_fit THEN a.idle ELSE a.total END >= p_count
                                     LIMIT v_window + 1) y))
      INTO v_more;
    EXIT WHEN v_more <= v_window;
  END LOOP;
END $$;
