-- The placer runs in the database: one round trip per placement instead of four or five statements
-- per attempt, and the backend keeps the plans of its statements. The rules are placer.rs's; each
-- attempt is a PL/pgSQL block, which is a savepoint: a conflict raises, rolls back to it, and the
-- loop replans without that node. It takes nodes (FOR SHARE), devices (the GPUs FOR SHARE, then the
-- atoms), node_resources, device_bookings and node_atom_counts, in the lock order
-- (docs/architecture.md).

-- The candidate nodes of a class, in fit order (best fit: fewest idle atoms that still fit; worst
-- fit: most). Without a selector the search is split by the open flag: the open counts of the
-- window, as they come; and, only for a request with tolerations, the closed counts of the window
-- joined to their nodes, for the taints it tolerates. With a selector it starts from the nodes that
-- carry the labels (GIN), then their counts by key.
--
-- Its statements run on generic plans (plan_cache_mode): planning one costs more than running it
-- (0.6 ms against 0.36 ms), and the custom plans the plan cache chose under load, set by a short
-- excluded list or a wide window, were no better. The generic plans are the plans the queries are
-- written for, whatever the parameters: each part walked in index order within the window, the
-- second skipped by a one-time filter when the request tolerates nothing. Index-only scans stay on
-- here: the counts' indexes serve the searches whole.
CREATE OR REPLACE FUNCTION capacity_candidates(
  p_pool text, p_kind text, p_model text, p_profile text, p_count int, p_selector jsonb,
  p_tolerations jsonb, p_excluded text[], p_best_fit boolean,
  OUT nodes text[], OUT idles int[])
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan SET enable_indexonlyscan = on AS $$
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

-- Places one demand: picks a candidate, locks it, rechecks every rule under the lock, books its
-- atoms and charges its scalars, or replans. A replan picks again from the candidates of the plan
-- before, without the node that failed, and asks for candidates again only when none are left or
-- when it turns to the emptiest nodes (the third attempt); it never tries a node twice. The atoms
-- that had nothing booked from now on are counted by the statement that picks them, and
-- node_atom_counts changes by that count (a separate count over the unnested atoms would be
-- re-planned at every call: a generic plan cannot size the array).
--
-- enable_seqscan is off: every statement has an index to follow, and a plan kept from a nearly empty
-- table must not stay a sequential scan. Index-only scans are off for the atoms' latest-end lookups
-- (see capacity_upsert_node_counts).
--
-- It reports, beside where it placed, each node that turned it away (tried, with why), and how many
-- of those a concurrent change turned away (conflicts) rather than a stale candidate hint:
-- better_compute_placer_replans_total counts both, and the instant its bookings start
-- (placed_from: the range's start, or later, see below). Its result columns have changed, and a
-- function's result type cannot change in place, hence the drop.
DROP FUNCTION IF EXISTS capacity_place(text, text, text, text, int, int, bigint, bigint, jsonb, jsonb, text, tstzrange, int);
CREATE OR REPLACE FUNCTION capacity_place(
  p_pool text, p_kind text, p_model text, p_profile text, p_count int,
  p_vcpu int, p_memory_mib bigint, p_disk_gib bigint, p_selector jsonb, p_tolerations jsonb,
  p_allocation text, p_during tstzrange, p_max_replans int,
  OUT placed_node text, OUT placed_atoms text[], OUT tried text[], OUT raced boolean, OUT conflicts int,
  OUT placed_from timestamptz)
LANGUAGE plpgsql SET enable_seqscan = off SET enable_indexonlyscan = off AS $$
DECLARE
  v_excluded text[] := '{}';
  v_nodes text[];
  v_idles int[];
  v_best_fit boolean;
  v_near int;
  v_pick int;
  v_node text;
  v_parents text[];
  v_atoms text[];
  v_were_idle bigint;
  v_fits bigint;
  v_booked bigint;
  v_from timestamptz;
BEGIN
  tried := '{}';
  raced := false;
  conflicts := 0;
  FOR v_attempt IN 0..p_max_replans LOOP
    -- The first plans pack (best fit). Two failures mean others are working the full nodes right
    -- now, so the last replans spread to the emptiest nodes, where there is room.
    IF v_attempt = 2 OR coalesce(cardinality(v_nodes), 0) = 0 THEN
      v_best_fit := v_attempt < 2;
      SELECT c.nodes, c.idles INTO v_nodes, v_idles
        FROM capacity_candidates(p_pool, p_kind, p_model, p_profile, p_count, p_selector, p_tolerations, v_excluded, v_best_fit) c;
      IF v_nodes IS NULL THEN
        v_best_fit := NOT v_best_fit;
        SELECT c.nodes, c.idles INTO v_nodes, v_idles
          FROM capacity_candidates(p_pool, p_kind, p_model, p_profile, p_count, p_selector, p_tolerations, v_excluded, v_best_fit) c;
      END IF;
    END IF;
    EXIT WHEN coalesce(cardinality(v_nodes), 0) = 0;
    -- Among the nodes nearly as good as the best (within the request's size), chance spreads
    -- concurrent placements instead of queueing them all on one node's counters; a replan picks
    -- among all candidates left.
    v_near := 1;
    WHILE v_near < cardinality(v_nodes) AND abs(v_idles[v_near + 1] - v_idles[1]) <= greatest(p_count, 1) LOOP
      v_near := v_near + 1;
    END LOOP;
    IF v_attempt > 0 THEN
      v_near := cardinality(v_nodes);
    END IF;
    v_pick := 1 + floor(random() * v_near)::int;
    v_node := v_nodes[v_pick];
    -- Whatever happens on it, this node is not a candidate again.
    v_nodes := v_nodes[:v_pick - 1] || v_nodes[v_pick + 1:];
    v_idles := v_idles[:v_pick - 1] || v_idles[v_pick + 1:];
    v_excluded := v_excluded || v_node;
    BEGIN
      -- The node, FOR SHARE, with the eligibility rules rechecked under the lock: a cordon or taint
      -- that committed first is seen; one that comes later waits for us.
      PERFORM 1 FROM nodes n
        WHERE n.id = v_node AND n.labels @> p_selector
          AND capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, p_tolerations)
        FOR SHARE;
      IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'BCRAC', MESSAGE = 'became ineligible';
      END IF;
      -- For MIG instances and slots, first their GPUs, FOR SHARE and in id order (placements on
      -- sibling atoms share them; a mode change locks a GPU and then its atoms, so we take them in
      -- that order too), and only those still healthy and not quarantined under the lock.
      v_parents := '{}';
      IF p_kind <> 'gpu' THEN
        SELECT coalesce(array_agg(s.id), '{}') INTO v_parents
          FROM (SELECT g.id FROM devices g
                 WHERE g.node_id = v_node AND g.parent_id IS NULL AND g.model = p_model AND g.healthy AND NOT g.quarantined
                   AND EXISTS (SELECT 1 FROM devices a WHERE a.parent_id = g.id AND a.bookable AND a.kind = p_kind)
                 ORDER BY g.id FOR SHARE) s;
      END IF;
      -- Then the atoms, FOR NO KEY UPDATE SKIP LOCKED: a stronger lock than FOR SHARE, so
      -- quarantine, health and mode changes (updates of these rows) are ordered with us as with FOR
      -- SHARE, and concurrent placements on the node skip each other's atoms instead of colliding.
      -- Whole GPUs are taken in random order to spread placements; MIG instances and slots in
      -- order, to fill one GPU before the next. Each comes with whether it had nothing booked from
      -- now on (it was idle), read from the latest end of its bookings in the same btree.
      SELECT coalesce(array_agg(s.id), '{}'), count(*) FILTER (WHERE s.idle) INTO v_atoms, v_were_idle
        FROM (SELECT a.id,
                     coalesce((SELECT max(upper(o.during)) FROM device_bookings o WHERE o.device_id COLLATE "C" = a.id),
                              '-infinity') <= compute_now() AS idle
                FROM devices a JOIN devices g ON g.id = coalesce(a.parent_id, a.id)
               WHERE a.node_id = v_node AND a.bookable AND a.kind = p_kind AND a.model = p_model
                 AND coalesce(a.profile, '') = p_profile
                 AND g.healthy AND NOT g.quarantined AND (a.parent_id IS NULL OR a.parent_id = ANY(v_parents))
                 -- Rechecked on the locked row itself: when a concurrent update commits while we
                 -- wait, PostgreSQL re-evaluates the conditions on the new version of the locked row
                 -- (a), not on the other side of the join (g), which for a whole GPU is the same row.
                 AND (a.parent_id IS NOT NULL OR (a.healthy AND NOT a.quarantined))
                 -- Free over the range: of its bookings that start before the range ends, the
                 -- latest ends by the range's start (bookings are '[)' ranges). A scalar subquery,
                 -- so it runs per atom with the atom's id in the index condition; device_id in the
                 -- "C" collation, so only the btree device_bookings_atom_end serves it. As NOT
                 -- EXISTS it would be an anti-join, which a plan made from a nearly empty table's
                 -- statistics runs as a scan of every live booking per atom.
                 -- Only a hint: the constraint decides at the insert below.
                 AND coalesce((SELECT max(upper(b.during)) FROM device_bookings b
                                WHERE b.device_id COLLATE "C" = a.id AND lower(b.during) < upper(p_during)),
                              '-infinity') <= lower(p_during)
               ORDER BY CASE WHEN p_kind = 'gpu' THEN random() ELSE 0 END, g.index, a.index
               LIMIT p_count
               FOR NO KEY UPDATE OF a SKIP LOCKED) s;
      IF cardinality(v_atoms) < p_count THEN
        RAISE EXCEPTION USING ERRCODE = 'BCFIT', MESSAGE = 'atoms booked in that range';
      END IF;
      -- The bookings start no earlier than the atoms' ended bookings end. Our clock may read an
      -- instant before the release that freed an atom (our transaction began first and waited
      -- for a lock): booked from it, two tenants would hold the atom for that long. An atom free
      -- in the statement above was released before its snapshot, so that history is seen here.
      SELECT greatest(lower(p_during), max(e.at)) INTO v_from
        FROM unnest(v_atoms) a(id),
             LATERAL (SELECT max(upper(h.during)) AS at FROM device_booking_history h
                       WHERE h.device_id COLLATE "C" = a.id) e;
      IF NOT v_from < upper(p_during) THEN
        RAISE EXCEPTION USING ERRCODE = 'BCFIT', MESSAGE = 'atoms booked in that range';
      END IF;
      -- The scalars, guarded: only if they fit under floor(allocatable * ratio). A placement or
      -- release holding the row is waited for, not skipped: skipping turned measured waits into
      -- more replans, each dearer than the wait (the capacity bench, 64 clients).
      UPDATE node_resources
         SET vcpu_allocated = vcpu_allocated + p_vcpu, memory_mib_allocated = memory_mib_allocated + p_memory_mib,
             disk_gib_allocated = disk_gib_allocated + p_disk_gib
       WHERE node_id = v_node
         AND vcpu_allocated + p_vcpu <= floor(vcpu_allocatable * vcpu_ratio)
         AND memory_mib_allocated + p_memory_mib <= floor(memory_mib_allocatable * memory_ratio)
         AND disk_gib_allocated + p_disk_gib <= floor(disk_gib_allocatable * disk_ratio);
      GET DIAGNOSTICS v_fits = ROW_COUNT;
      IF v_fits = 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'BCFIT', MESSAGE = 'not enough vCPU, memory or disk';
      END IF;
      -- The exclusion constraint is the truth: a concurrent booking of the same atom makes this
      -- insert wait for it and then skip the row, which shows as fewer rows than atoms. In atom
      -- order, so two placements can never wait on each other's bookings in a cycle.
      INSERT INTO device_bookings (device_id, allocation_id, during)
        SELECT a, p_allocation, tstzrange(v_from, upper(p_during), '[)') FROM unnest(v_atoms) a ORDER BY a
        ON CONFLICT DO NOTHING;
      GET DIAGNOSTICS v_booked = ROW_COUNT;
      IF v_booked < cardinality(v_atoms) THEN
        RAISE EXCEPTION USING ERRCODE = 'BCRAC', MESSAGE = 'atoms taken by a concurrent placement';
      END IF;
      -- The atoms that were idle are no longer. A hint: concurrent bookings of one atom's
      -- different futures can both count it, so it is floored at 0, and a full refresh (inventory
      -- changes) makes it exact again.
      IF v_were_idle > 0 THEN
        UPDATE node_atom_counts c SET idle = greatest(0, c.idle - v_were_idle)
         WHERE c.node_id = v_node AND c.kind = p_kind AND c.model = p_model AND c.profile = p_profile;
      END IF;
      placed_node := v_node;
      placed_atoms := v_atoms;
      placed_from := v_from;
      RETURN;
    EXCEPTION
      WHEN SQLSTATE 'BCRAC' THEN
        raced := true;
        conflicts := conflicts + 1;
        tried := tried || (v_node || ': ' || SQLERRM);
      WHEN SQLSTATE 'BCFIT' THEN
        tried := tried || (v_node || ': ' || SQLERRM);
    END;
  END LOOP;
END $$;
