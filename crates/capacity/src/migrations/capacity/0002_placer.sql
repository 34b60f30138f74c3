-- The placer runs in the database: one round trip per placement instead of four or five statements
-- per attempt, and the backend keeps the plans of its statements. The rules are placer.rs's; each
-- attempt is a PL/pgSQL block, which is a savepoint: a conflict raises, rolls back to it, and the
-- loop replans without that node.
--
-- Lock order: nodes (FOR SHARE), devices (the GPUs FOR SHARE, then the atoms), node_resources,
-- node_atom_counts, as every other transaction that takes several of them.

-- Whether every taint is tolerated: a toleration with the taint's key and no value, or its value.
CREATE FUNCTION capacity_tolerates(p_taints jsonb, p_tolerations jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_taints) t
                      WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_tolerations) o
                                         WHERE o->>'key' = t->>'key'
                                           AND (o->>'value' IS NULL OR o->>'value' = t->>'value')))
$$;

-- The node eligibility rules, in one place: converged at least once, nothing in noScheduleReasons
-- (cordoned, unreachable, lost, …), every taint tolerated. A single expression, so the planner
-- inlines it into each query that calls it. Labels are matched by the callers that have a selector.
CREATE FUNCTION capacity_node_takes(p_observed_generation bigint, p_no_schedule_reasons text[], p_taints jsonb,
                                    p_tolerations jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT p_observed_generation >= 1 AND cardinality(p_no_schedule_reasons) = 0
     AND (jsonb_array_length(p_taints) = 0 OR capacity_tolerates(p_taints, p_tolerations))
$$;

-- Up to 8 candidate nodes for a demand, best first. Best fit: nodes with enough idle atoms, fewest
-- first, to pack; otherwise nodes with enough atoms at all, most idle first (room under contention,
-- and ranges in the future). Ties are broken by chance, so concurrent placers spread over the nodes
-- that fit equally well. Without a node selector the class's counts are walked in index order a
-- bounded window at a time, widening only when too few in the window are eligible: a plan costs
-- the window, not the pool.
CREATE FUNCTION capacity_candidates(
  p_pool text, p_kind text, p_model text, p_profile text, p_count int, p_selector jsonb,
  p_tolerations jsonb, p_excluded text[], p_best_fit boolean,
  OUT nodes text[], OUT idles int[])
LANGUAGE plpgsql STABLE AS $$
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
     WHERE s.o <= 8;
    RETURN;
  END IF;
  -- No selector, so no labels to match (and none in the plan: its generic plan would guess the
  -- empty containment selective and walk the labels index).
  FOREACH v_window IN ARRAY ARRAY[64, 1024, 9223372036854775806]::bigint[] LOOP
    IF p_best_fit THEN
      SELECT array_agg(s.node_id ORDER BY s.idle, s.r), array_agg(s.idle ORDER BY s.idle, s.r) INTO nodes, idles
        FROM (SELECT c.node_id, c.idle, random() AS r
                FROM (SELECT a.node_id, a.idle FROM node_atom_counts a
                       WHERE a.pool_id = p_pool AND a.kind = p_kind AND a.model = p_model AND a.profile = p_profile
                         AND a.idle >= p_count
                       ORDER BY a.idle, a.node_id LIMIT v_window) c
                JOIN nodes n ON n.id = c.node_id
               WHERE NOT (c.node_id = ANY(p_excluded))
                 AND capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, p_tolerations)
               ORDER BY c.idle, r LIMIT 8) s;
    ELSE
      SELECT array_agg(s.node_id ORDER BY s.idle DESC, s.r), array_agg(s.idle ORDER BY s.idle DESC, s.r) INTO nodes, idles
        FROM (SELECT c.node_id, c.idle, random() AS r
                FROM (SELECT a.node_id, a.idle FROM node_atom_counts a
                       WHERE a.pool_id = p_pool AND a.kind = p_kind AND a.model = p_model AND a.profile = p_profile
                         AND a.total >= p_count
                       ORDER BY a.idle DESC, a.node_id DESC LIMIT v_window) c
                JOIN nodes n ON n.id = c.node_id
               WHERE NOT (c.node_id = ANY(p_excluded))
                 AND capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, p_tolerations)
               ORDER BY c.idle DESC, r LIMIT 8) s;
    END IF;
    EXIT WHEN coalesce(cardinality(nodes), 0) = 8;
    -- Too few eligible in the window: are there more rows to look at?
    SELECT count(*) INTO v_more
      FROM (SELECT 1 FROM node_atom_counts a
             WHERE a.pool_id = p_pool AND a.kind = p_kind AND a.model = p_model AND a.profile = p_profile
               AND CASE WHEN p_best_fit THEN a.idle ELSE a.total END >= p_count
             LIMIT v_window + 1) x;
    EXIT WHEN v_more <= v_window;
  END LOOP;
END $$;

-- Places a demand for p_allocation over p_during: a first plan and at most p_max_replans replans.
-- Returns the node and atoms booked, or no node; `tried` says what happened on each node tried, and
-- `raced` whether a concurrent change (not a lack of room) turned any of them away.
-- enable_seqscan = off: every statement here has an index to follow, and a backend keeps its plans
-- for as long as it lives. Planned while device_bookings was nearly empty (a fresh system, or the
-- bench), the bookings check became a sequential scan that stayed while the table grew, until the
-- next ANALYZE: 39 million rows read in one 30 s bench run. Without sequential scans to choose, the
-- kept plans stay index plans.
CREATE FUNCTION capacity_place(
  p_pool text, p_kind text, p_model text, p_profile text, p_count int,
  p_vcpu int, p_memory_mib bigint, p_disk_gib bigint, p_selector jsonb, p_tolerations jsonb,
  p_allocation text, p_during tstzrange, p_max_replans int,
  OUT placed_node text, OUT placed_atoms text[], OUT tried text[], OUT raced boolean)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
  v_excluded text[] := '{}';
  v_nodes text[];
  v_idles int[];
  v_near int;
  v_node text;
  v_parents text[];
  v_atoms text[];
  v_fits bigint;
  v_booked bigint;
BEGIN
  tried := '{}';
  raced := false;
  FOR v_attempt IN 0..p_max_replans LOOP
    -- The first plans pack (best fit). A replan means others are working the full nodes right
    -- now, so the last replans spread to the emptiest nodes, where there is room.
    SELECT c.nodes, c.idles INTO v_nodes, v_idles
      FROM capacity_candidates(p_pool, p_kind, p_model, p_profile, p_count, p_selector, p_tolerations, v_excluded, v_attempt < 2) c;
    IF v_nodes IS NULL THEN
      SELECT c.nodes, c.idles INTO v_nodes, v_idles
        FROM capacity_candidates(p_pool, p_kind, p_model, p_profile, p_count, p_selector, p_tolerations, v_excluded, v_attempt >= 2) c;
    END IF;
    EXIT WHEN v_nodes IS NULL;
    -- Among the nodes nearly as good as the best (within the request's size), chance spreads
    -- concurrent placements instead of queueing them all on one node's counters; the first replan
    -- picks among all candidates.
    v_near := 1;
    WHILE v_near < cardinality(v_nodes) AND abs(v_idles[v_near + 1] - v_idles[1]) <= greatest(p_count, 1) LOOP
      v_near := v_near + 1;
    END LOOP;
    IF v_attempt = 1 THEN
      v_near := cardinality(v_nodes);
    END IF;
    v_node := v_nodes[1 + floor(random() * v_near)::int];
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
      -- order, to fill one GPU before the next.
      SELECT coalesce(array_agg(s.id), '{}') INTO v_atoms
        FROM (SELECT a.id FROM devices a JOIN devices g ON g.id = coalesce(a.parent_id, a.id)
               WHERE a.node_id = v_node AND a.bookable AND a.kind = p_kind AND a.model = p_model
                 AND coalesce(a.profile, '') = p_profile
                 AND g.healthy AND NOT g.quarantined AND (a.parent_id IS NULL OR a.parent_id = ANY(v_parents))
                 -- Rechecked on the locked row itself: when a concurrent update commits while we
                 -- wait, PostgreSQL re-evaluates the conditions on the new version of the locked row
                 -- (a), not on the other side of the join (g), which for a whole GPU is the same row.
                 AND (a.parent_id IS NOT NULL OR (a.healthy AND NOT a.quarantined))
                 AND NOT EXISTS (SELECT 1 FROM device_bookings b WHERE b.device_id = a.id AND b.during && p_during)
               ORDER BY CASE WHEN p_kind = 'gpu' THEN random() ELSE 0 END, g.index, a.index
               LIMIT p_count
               FOR NO KEY UPDATE OF a SKIP LOCKED) s;
      IF cardinality(v_atoms) < p_count THEN
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
        SELECT a, p_allocation, p_during FROM unnest(v_atoms) a ORDER BY a
        ON CONFLICT DO NOTHING;
      GET DIAGNOSTICS v_booked = ROW_COUNT;
      IF v_booked < cardinality(v_atoms) THEN
        RAISE EXCEPTION USING ERRCODE = 'BCRAC', MESSAGE = 'atoms taken by a concurrent placement';
      END IF;
      -- The atoms that had nothing else booked from now on are no longer idle. A hint: concurrent
      -- bookings of one atom's different futures can both count it, so it is floored at 0, and a
      -- full refresh (inventory changes) makes it exact again.
      UPDATE node_atom_counts c SET idle = greatest(0, c.idle - (
          SELECT count(*) FROM unnest(v_atoms) a
           WHERE NOT EXISTS (SELECT 1 FROM device_bookings b
                              WHERE b.device_id = a AND b.allocation_id <> p_allocation AND upper(b.during) > compute_now())))
       WHERE c.node_id = v_node AND c.kind = p_kind AND c.model = p_model AND c.profile = p_profile;
      placed_node := v_node;
      placed_atoms := v_atoms;
      RETURN;
    EXCEPTION
      WHEN SQLSTATE 'BCRAC' THEN
        raced := true;
        tried := tried || (v_node || ': ' || SQLERRM);
        v_excluded := v_excluded || v_node;
      WHEN SQLSTATE 'BCFIT' THEN
        tried := tried || (v_node || ': ' || SQLERRM);
        v_excluded := v_excluded || v_node;
    END;
  END LOOP;
END $$;
