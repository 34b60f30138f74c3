-- The batch placer: many reservations.create (and release) requests done by one statement per step
-- instead of one placer run each (batch.rs). Statements shared by a batch cost a fraction of a
-- placement each; what limits concurrent batches is whether they collide, so each batcher plans only
-- on its own share of the nodes (abs(hashtext(node_id)) % p_shares = p_share), and a node takes
-- requests while it has room: its atoms are shared out among them, and its scalars and idle count
-- change by their sums.
--
-- It places only what it can on the first try, and only the common case: whole GPUs starting now,
-- with or without a node selector, no tolerations. Every request it does not place (an invalid
-- range, a key already used, a tenant over quota, a pool gone, no room in the share, an atom or
-- counter taken by a concurrent placement) gets NULL back and nothing of it stays: the caller then
-- runs it alone through capacity_reserve, which replans, leaves it pending or gives the error. So
-- the batch is an attempt under the spec's rules, and what it cannot do is done by the one-request
-- path. The rules both paths share are the same functions, called with a batch's arrays or with one
-- request's: idempotency keys (idempotency_claim, idempotency_answer), quota (capacity_charge_many,
-- capacity_refund_many), events (outbox_emit_many) and views (capacity_view_of). A release batch gives a request the view (and the event) of its own tenant's reservation
-- only; a request for another tenant's reservation runs alone and is told it is not found.
--
-- Both functions run their statements on generic plans, with hash and merge joins off: with the
-- arrays as parameters the plan cache would plan each statement again at every call (a quarter of
-- a batch), and a generic plan guesses a thousand rows for generate_subscripts, so it would join the
-- batch to nodes and node_resources by scanning them whole. Every statement joins a batch (at most a
-- few dozen rows) to tables by key, the ids as the index condition and the tenant as a check, so
-- they run as nested loops over the indexes whatever the fleet's size.
--
-- Locks follow the lock order (docs/architecture.md): idempotency keys, quota_usage, pools, nodes,
-- devices, then the batch's own new rows, then node_resources, node_atom_counts and the wake-ups
-- last. Within each table the batch takes its rows in key order, so a batch is ordered with single
-- placements, releases and other batches as they are with each other. Its atoms are taken
-- FOR NO KEY UPDATE SKIP LOCKED, like the placer's, so it never waits on an atom. node_resources is
-- taken as late as the order allows, because with best-fit packing both batchers hit the same few
-- nodes' rows and would otherwise hold them through most of their work: a create batch inserts its
-- bookings, reservations and events (rows of its own) first, and turns away a request its node's
-- scalars do not fit by deleting them again; a release batch reads its bookings and writes its views
-- and events first, and deletes the bookings after it takes the rows, as capacity_end does. A
-- request that loses anything after its quota was charged is undone in the same transaction, on rows
-- the batch already holds, so the undo takes no new lock.

CREATE OR REPLACE FUNCTION capacity_reserve_batch(
  p_ids text[], p_tenants text[], p_identities text[], p_pools text[], p_models text[], p_selectors jsonb[], p_counts int[],
  p_vcpus int[], p_memory_mibs bigint[], p_disk_gibs bigint[], p_ends_at timestamptz[], p_durations_s float8[],
  p_keys text[], p_key_hashes bytea[], p_key_ttl_s float8, p_event_ids text[], p_shards int2[],
  p_share int, p_shares int, p_max_duration_s float8) RETURNS jsonb[]
LANGUAGE plpgsql SET enable_seqscan = off SET enable_indexonlyscan = off SET plan_cache_mode = force_generic_plan
  SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE
  v_n int := cardinality(p_ids);
  v_now timestamptz := compute_now();
  v_stops timestamptz[];
  -- per request: still in the batch; its quota charged; its key claimed here; its node
  v_ok boolean[];
  v_charged boolean[] := array_fill(false, ARRAY[v_n]);
  v_claimed boolean[] := array_fill(false, ARRAY[v_n]);
  v_nodes text[] := array_fill(NULL::text, ARRAY[v_n]);
  v_class record;
  v_cand text[];
  v_idle int[];
  v_order int[];
  v_before text[];
  v_j int;
  v_i int;
  v_tried boolean[];
  v_atoms text[];
  v_atom_of int[];
  v_were_idle int[];
  v_views jsonb[] := array_fill(NULL::jsonb, ARRAY[v_n]);
  v_first int[];
  v_tenants text[];
  v_done int;
BEGIN
  IF v_n = 0 THEN
    RETURN '{}';
  END IF;
  -- The ranges; one out of bounds is left to capacity_reserve, which says why.
  SELECT array_agg(s ORDER BY i), array_agg(v_now < s AND s - v_now <= make_interval(secs => p_max_duration_s) ORDER BY i)
    INTO v_stops, v_ok
    FROM (SELECT i, coalesce(p_ends_at[i], v_now + make_interval(secs => p_durations_s[i])) AS s
            FROM generate_subscripts(p_ids, 1) i) x;

  -- 1. Idempotency keys (idempotency_claim, as a lone request claims its key), the first request
  --    of each key in the batch; one in use (a replay, a reuse, a later duplicate in the batch) is
  --    left to capacity_reserve.
  SELECT coalesce(array_agg(k.i), '{}') INTO v_first
    FROM (SELECT DISTINCT ON (p_tenants[i], p_identities[i], p_keys[i]) i
            FROM generate_subscripts(p_ids, 1) i
           WHERE v_ok[i] AND p_keys[i] IS NOT NULL
           ORDER BY p_tenants[i], p_identities[i], p_keys[i], i) k;
  WITH claimed AS (
         SELECT c.tenant_id, c.identity_id, c.key
           FROM idempotency_claim(ARRAY(SELECT p_tenants[f] FROM unnest(v_first) f), ARRAY(SELECT p_identities[f] FROM unnest(v_first) f),
                                  ARRAY(SELECT p_keys[f] FROM unnest(v_first) f), 'reservations.create',
                                  ARRAY(SELECT p_key_hashes[f] FROM unnest(v_first) f), p_key_ttl_s) c)
  SELECT array_agg(g.j = ANY(v_first) AND EXISTS (
                     SELECT 1 FROM claimed c
                      WHERE c.tenant_id = p_tenants[g.j] AND c.identity_id = p_identities[g.j] AND c.key = p_keys[g.j])
                   ORDER BY g.j)
    INTO v_claimed FROM generate_subscripts(p_ids, 1) g(j);
  SELECT array_agg(v_ok[i] AND (p_keys[i] IS NULL OR v_claimed[i]) ORDER BY i) INTO v_ok FROM generate_subscripts(p_ids, 1) i;

  -- 2. Quota (capacity_charge_many, as a lone request is charged): each tenant's sum, all of it or
  --    none. A tenant that does not fit is left whole to capacity_reserve, which charges request by
  --    request and says which one is over.
  v_tenants := capacity_charge_many(ARRAY(SELECT p_tenants[i] FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i]),
                                    ARRAY(SELECT 'gpu'::text FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i]),
                                    ARRAY(SELECT p_counts[i]::bigint FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i]),
                                    ARRAY(SELECT p_vcpus[i]::bigint FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i]),
                                    ARRAY(SELECT p_memory_mibs[i] FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i]),
                                    ARRAY(SELECT p_disk_gibs[i] FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i]));
  SELECT array_agg(v_ok[i] AND p_tenants[i] = ANY(v_tenants) ORDER BY i) INTO v_charged FROM generate_subscripts(p_ids, 1) i;
  v_ok := v_charged;

  -- 3. The pools FOR SHARE, in id order: they cannot go away under us.
  WITH p AS (SELECT id FROM pools WHERE id IN (SELECT p_pools[i] FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i])
              ORDER BY id FOR SHARE)
  SELECT array_agg(v_ok[i] AND p_pools[i] IN (SELECT id FROM p) ORDER BY i) INTO v_ok FROM generate_subscripts(p_ids, 1) i;

  -- 4. The plan, without locks: per class (pool, model, node selector), a window of this share's
  --    nodes that have idle GPUs, fullest first (a selector's through the labels' GIN index, as
  --    capacity_candidates); requests from the smallest up take the fullest node with room left,
  --    several to a node while it has room, so they pack as one placement after another would.
  --    Classes with a selector plan first: they have fewer nodes to choose from; a node one class
  --    took is not offered to the next.
  FOR v_class IN SELECT d.pool, d.model, d.selector
                   FROM (SELECT DISTINCT p_pools[i] AS pool, p_models[i] AS model, p_selectors[i] AS selector
                           FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i]) d
                  ORDER BY d.selector = '{}'::jsonb, d.pool, d.model LOOP
    SELECT array_agg(i ORDER BY p_counts[i], i) INTO v_order
      FROM generate_subscripts(p_ids, 1) i
     WHERE v_ok[i] AND p_pools[i] = v_class.pool AND p_models[i] = v_class.model AND p_selectors[i] = v_class.selector;
    IF v_class.selector = '{}'::jsonb THEN
      SELECT array_agg(w.node_id ORDER BY w.idle, w.node_id), array_agg(w.idle ORDER BY w.idle, w.node_id) INTO v_cand, v_idle
        FROM (SELECT a.node_id, a.idle FROM node_atom_counts a
               WHERE a.pool_id = v_class.pool AND a.kind = 'gpu' AND a.model = v_class.model AND a.profile = ''
                 AND a.open AND a.idle >= 1 AND abs(hashtext(a.node_id)) % p_shares = p_share
               ORDER BY a.idle, a.node_id LIMIT 2 * cardinality(v_order) + 8) w;
    ELSE
      SELECT array_agg(w.node_id ORDER BY w.idle, w.node_id), array_agg(w.idle ORDER BY w.idle, w.node_id) INTO v_cand, v_idle
        FROM (SELECT a.node_id, a.idle FROM nodes n JOIN node_atom_counts a ON a.node_id = n.id
               WHERE n.pool_id = v_class.pool AND n.labels @> v_class.selector
                 AND a.kind = 'gpu' AND a.model = v_class.model AND a.profile = ''
                 AND a.open AND a.idle >= 1 AND abs(hashtext(a.node_id)) % p_shares = p_share
               ORDER BY a.idle, a.node_id LIMIT 2 * cardinality(v_order) + 8) w;
    END IF;
    v_cand := coalesce(v_cand, '{}');
    v_before := v_nodes;
    v_j := 1;
    FOREACH v_i IN ARRAY v_order LOOP
      -- v_idle[v_j] counts down as requests take the node; a node another class took is skipped
      WHILE v_j <= cardinality(v_cand) AND (v_idle[v_j] < p_counts[v_i] OR v_cand[v_j] = ANY(v_before)) LOOP
        v_j := v_j + 1;
      END LOOP;
      EXIT WHEN v_j > cardinality(v_cand);
      v_nodes[v_i] := v_cand[v_j];
      v_idle[v_j] := v_idle[v_j] - p_counts[v_i];
    END LOOP;
  END LOOP;
  SELECT array_agg(v_ok[i] AND v_nodes[i] IS NOT NULL ORDER BY i) INTO v_ok FROM generate_subscripts(p_ids, 1) i;

  -- 5. The nodes FOR SHARE in id order, the eligibility rules and the request's selector rechecked
  --    under the lock (no tolerations: an untainted node). The ids are the index condition: joined
  --    only through the batch, the generic plan scanned every node.
  WITH n AS (SELECT n.id FROM nodes n JOIN generate_subscripts(p_ids, 1) r(i) ON n.id = v_nodes[r.i]
              WHERE n.id = ANY(v_nodes) AND v_ok[r.i] AND n.labels @> p_selectors[r.i]
                AND capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, '[]'::jsonb)
              ORDER BY n.id FOR SHARE OF n)
  SELECT array_agg(v_ok[i] AND v_nodes[i] IN (SELECT id FROM n) ORDER BY i) INTO v_ok FROM generate_subscripts(p_ids, 1) i;

  -- 6. The atoms, node by node in id order, as capacity_place takes them (FOR NO KEY UPDATE SKIP
  --    LOCKED, healthy, not quarantined, free over the range: the longest of the node's requests),
  --    each with whether it was idle; the node's requests take them in turn, each its count. An
  --    atom is not taken if its ended bookings end after v_now, because its release read a later
  --    clock: booked from v_now it would overlap them. capacity_place, which books it from their
  --    end, places a request left short of atoms.
  WITH r AS (SELECT i, v_nodes[i] AS node, sum(p_counts[i]) OVER (PARTITION BY v_nodes[i] ORDER BY i) AS upto
               FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i])
  SELECT array_agg(x.id ORDER BY x.id), array_agg(q.i ORDER BY x.id), array_agg(x.idle::int ORDER BY x.id)
    INTO v_atoms, v_atom_of, v_were_idle
    FROM (SELECT v_nodes[i] AS node, max(p_models[i]) AS model, max(v_stops[i]) AS stop, sum(p_counts[i]) AS need
            FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i] GROUP BY v_nodes[i] ORDER BY v_nodes[i]) d,
         LATERAL (SELECT y.id, y.idle, row_number() OVER (ORDER BY y.index) AS k
                    FROM (SELECT a.id, a.index,
                                 coalesce((SELECT max(upper(o.during)) FROM device_bookings o WHERE o.device_id COLLATE "C" = a.id),
                                          '-infinity') <= v_now AS idle
                            FROM devices a
                           WHERE a.node_id = d.node AND a.parent_id IS NULL AND a.bookable AND a.kind = 'gpu'
                             AND a.model = d.model AND a.healthy AND NOT a.quarantined
                             AND coalesce((SELECT max(upper(b.during)) FROM device_bookings b
                                            WHERE b.device_id COLLATE "C" = a.id AND lower(b.during) < d.stop),
                                          '-infinity') <= v_now
                             AND coalesce((SELECT max(upper(h.during)) FROM device_booking_history h
                                            WHERE h.device_id COLLATE "C" = a.id), '-infinity') <= v_now
                           ORDER BY a.index LIMIT d.need
                           FOR NO KEY UPDATE OF a SKIP LOCKED) y) x,
         LATERAL (SELECT r.i FROM r WHERE r.node = d.node AND x.k <= r.upto AND x.k > r.upto - p_counts[r.i]) q;
  SELECT array_agg(v_ok[i] AND p_counts[i] = (SELECT count(*) FROM unnest(v_atom_of) o WHERE o = i) ORDER BY i) INTO v_ok
    FROM generate_subscripts(p_ids, 1) i;

  -- 7. The bookings, in atom order; the constraint decides (a request short of any has what it got
  --    deleted in 9). The bookings, reservations and events go in before the scalars (9): the
  --    node_resources rows, which the release batches take too, are then held only from 9 to the
  --    commit.
  v_tried := v_ok;
  WITH booked AS (
    INSERT INTO device_bookings (device_id, allocation_id, during)
    SELECT v_atoms[k], p_ids[v_atom_of[k]], tstzrange(v_now, v_stops[v_atom_of[k]], '[)')
      FROM generate_subscripts(v_atoms, 1) k WHERE v_ok[v_atom_of[k]] ORDER BY v_atoms[k]
    ON CONFLICT DO NOTHING
    RETURNING allocation_id)
  SELECT array_agg(v_ok[i] AND p_counts[i] = (SELECT count(*) FROM booked b WHERE b.allocation_id = p_ids[i]) ORDER BY i)
    INTO v_ok FROM generate_subscripts(p_ids, 1) i;

  -- 8. The reservations of the requests booked, their views and events (deleted again in 9 for a
  --    node their scalars do not fit).
  IF true = ANY(v_ok) THEN
    INSERT INTO reservations (id, tenant_id, pool_id, state, gpu_kind, gpu_model, mig_profile, gpu_count, vcpu, memory_mib,
                              disk_gib, during, node_selector, tolerations, node_id, created_by)
    SELECT p_ids[i], p_tenants[i], p_pools[i], 'placed', 'gpu', p_models[i], NULL, p_counts[i], p_vcpus[i], p_memory_mibs[i],
           p_disk_gibs[i], tstzrange(v_now, v_stops[i], '[)'), p_selectors[i], '[]', v_nodes[i], p_identities[i]
      FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i] ORDER BY p_ids[i];
    SELECT array_agg(CASE WHEN v_ok[g.j] THEN capacity_view_of(r, (SELECT jsonb_agg(v_atoms[k] ORDER BY v_atoms[k])
                                                                     FROM generate_subscripts(v_atoms, 1) k WHERE v_atom_of[k] = g.j)) END
                     ORDER BY g.j)
      INTO v_views FROM generate_subscripts(p_ids, 1) g(j) LEFT JOIN reservations r ON v_ok[g.j] AND r.id = p_ids[g.j];
    SELECT outbox_emit_many(array_agg(p_event_ids[i] ORDER BY i), array_agg('reservation.placed'::text ORDER BY i),
                            array_agg(p_tenants[i] ORDER BY i), array_agg(p_ids[i] ORDER BY i),
                            array_agg(jsonb_build_object('state', v_views[i]->'state', 'nodeId', v_views[i]->'nodeId',
                                                         'atoms', v_views[i]->'atoms', 'version', v_views[i]->'version') ORDER BY i))
      INTO v_done FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i];
  END IF;

  -- 9. The scalars: the rows in node order, then the guarded update of each node by the sum of its
  --    requests (an update takes one row per node). A node they do not fit is left unchanged and
  --    turns all of them away. Then every request that got atoms in 6 but is not placed has its
  --    bookings, reservation and event deleted.
  PERFORM 1 FROM node_resources
    WHERE node_id IN (SELECT v_nodes[i] FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i]) ORDER BY node_id FOR UPDATE;
  WITH fit AS (
    UPDATE node_resources nr
       SET vcpu_allocated = vcpu_allocated + d.vcpu, memory_mib_allocated = memory_mib_allocated + d.memory_mib,
           disk_gib_allocated = disk_gib_allocated + d.disk_gib
      FROM (SELECT v_nodes[i] AS node, sum(p_vcpus[i]) AS vcpu, sum(p_memory_mibs[i]) AS memory_mib, sum(p_disk_gibs[i]) AS disk_gib
              FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i] GROUP BY v_nodes[i]) d
     WHERE nr.node_id = d.node
       AND vcpu_allocated + d.vcpu <= floor(vcpu_allocatable * vcpu_ratio)
       AND memory_mib_allocated + d.memory_mib <= floor(memory_mib_allocatable * memory_ratio)
       AND disk_gib_allocated + d.disk_gib <= floor(disk_gib_allocatable * disk_ratio)
    RETURNING nr.node_id)
  SELECT array_agg(v_ok[g.j] AND v_nodes[g.j] IN (SELECT fit.node_id FROM fit) ORDER BY g.j) INTO v_ok
    FROM generate_subscripts(p_ids, 1) g(j);
  IF v_tried IS DISTINCT FROM v_ok THEN
    DELETE FROM device_bookings
     WHERE allocation_id IN (SELECT p_ids[i] FROM generate_subscripts(p_ids, 1) i WHERE v_tried[i] AND NOT v_ok[i]);
    DELETE FROM reservations WHERE id IN (SELECT p_ids[i] FROM generate_subscripts(p_ids, 1) i WHERE v_tried[i] AND NOT v_ok[i]);
    v_done := outbox_withdraw(ARRAY(SELECT p_event_ids[i] FROM generate_subscripts(p_ids, 1) i WHERE v_tried[i] AND NOT v_ok[i]));
    SELECT array_agg(CASE WHEN v_ok[i] THEN v_views[i] END ORDER BY i) INTO v_views FROM generate_subscripts(p_ids, 1) i;
  END IF;

  -- 10. The idle counts of the placed nodes, rows in key order (a hint, floored at 0 as the placer's).
  PERFORM 1 FROM node_atom_counts c
    WHERE c.node_id IN (SELECT v_nodes[i] FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i])
    ORDER BY c.node_id, c.kind, c.model, c.profile FOR UPDATE;
  UPDATE node_atom_counts c SET idle = greatest(0, c.idle - w.n)
    FROM (SELECT v_nodes[v_atom_of[k]] AS node, p_models[v_atom_of[k]] AS model, sum(v_were_idle[k]) AS n
            FROM generate_subscripts(v_atoms, 1) k WHERE v_ok[v_atom_of[k]] GROUP BY 1, 2) w
   WHERE c.node_id = w.node AND c.kind = 'gpu' AND c.model = w.model AND c.profile = '' AND w.n > 0;

  -- 11. Undo what stays charged or claimed for requests not placed: their quota (rows held since
  --     2) and their keys (claimed here, so capacity_reserve claims them again).
  IF EXISTS (SELECT 1 FROM generate_subscripts(p_ids, 1) i WHERE v_charged[i] AND NOT v_ok[i]) THEN
    v_done := capacity_refund_many(ARRAY(SELECT p_tenants[i] FROM generate_subscripts(p_ids, 1) i WHERE v_charged[i] AND NOT v_ok[i]),
                                   ARRAY(SELECT 'gpu'::text FROM generate_subscripts(p_ids, 1) i WHERE v_charged[i] AND NOT v_ok[i]),
                                   ARRAY(SELECT p_counts[i]::bigint FROM generate_subscripts(p_ids, 1) i WHERE v_charged[i] AND NOT v_ok[i]),
                                   ARRAY(SELECT p_vcpus[i]::bigint FROM generate_subscripts(p_ids, 1) i WHERE v_charged[i] AND NOT v_ok[i]),
                                   ARRAY(SELECT p_memory_mibs[i] FROM generate_subscripts(p_ids, 1) i WHERE v_charged[i] AND NOT v_ok[i]),
                                   ARRAY(SELECT p_disk_gibs[i] FROM generate_subscripts(p_ids, 1) i WHERE v_charged[i] AND NOT v_ok[i]));
  END IF;
  IF EXISTS (SELECT 1 FROM generate_subscripts(p_ids, 1) i WHERE v_claimed[i] AND NOT v_ok[i]) THEN
    v_done := idempotency_forget(ARRAY(SELECT p_tenants[i] FROM generate_subscripts(p_ids, 1) i WHERE v_claimed[i] AND NOT v_ok[i]),
                                 ARRAY(SELECT p_identities[i] FROM generate_subscripts(p_ids, 1) i WHERE v_claimed[i] AND NOT v_ok[i]),
                                 ARRAY(SELECT p_keys[i] FROM generate_subscripts(p_ids, 1) i WHERE v_claimed[i] AND NOT v_ok[i]));
  END IF;

  IF NOT (true = ANY(v_ok)) THEN
    RETURN v_views;
  END IF;
  -- 12. The wake-ups (capacity_after_change's, for all at once) and the keys' stored responses.
  PERFORM work_queue_enqueue(array_agg('capacity.reservations'::text), array_agg(p_ids[i]), array_agg(p_shards[i]), 0)
     FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i];
  PERFORM desired_invalidate(array_agg(n.id), array_agg(n.shard)) FROM nodes n
    WHERE n.id IN (SELECT v_nodes[i] FROM generate_subscripts(p_ids, 1) i WHERE v_ok[i]);
  IF true = ANY(v_claimed) THEN
    v_done := idempotency_answer(ARRAY(SELECT p_tenants[i] FROM generate_subscripts(p_ids, 1) i WHERE v_claimed[i] AND v_ok[i]),
                                 ARRAY(SELECT p_identities[i] FROM generate_subscripts(p_ids, 1) i WHERE v_claimed[i] AND v_ok[i]),
                                 ARRAY(SELECT p_keys[i] FROM generate_subscripts(p_ids, 1) i WHERE v_claimed[i] AND v_ok[i]),
                                 ARRAY(SELECT v_views[i] FROM generate_subscripts(p_ids, 1) i WHERE v_claimed[i] AND v_ok[i]));
  END IF;
  RETURN v_views;
END $$;

CREATE OR REPLACE FUNCTION capacity_release_batch(p_ids text[], p_tenants text[], p_event_ids text[], p_shards int2[]) RETURNS jsonb[]
LANGUAGE plpgsql SET enable_seqscan = off SET enable_indexonlyscan = off SET plan_cache_mode = force_generic_plan
  SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE
  v_now timestamptz := compute_now();
  v_ended text[];
  v_atoms text[];
  v_of text[];
  v_held boolean[];
  v_views jsonb[];
  v_done int;
BEGIN
  IF cardinality(p_ids) = 0 THEN
    RETURN '{}';
  END IF;
  -- 1. The reservations' rows, in id order, then the transition (the state guard checks it). The ids
  --    are the index condition, the tenant a check (see the header).
  PERFORM 1 FROM reservations r WHERE r.id IN (SELECT unnest(p_ids)) ORDER BY r.id FOR UPDATE;
  WITH e AS (
    UPDATE reservations r SET state = 'released', version = version + 1, updated_at = v_now, unschedulable = NULL,
                              next_attempt_at = NULL
     WHERE r.id = ANY(p_ids) AND r.state NOT IN ('released', 'expired', 'failed')
       AND EXISTS (SELECT 1 FROM generate_subscripts(p_ids, 1) i WHERE p_ids[i] = r.id AND p_tenants[i] = r.tenant_id)
    RETURNING r.id)
  SELECT coalesce(array_agg(e.id ORDER BY e.id), '{}') INTO v_ended FROM e;
  IF cardinality(v_ended) = 0 THEN
    RETURN array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)]);
  END IF;

  -- 2. Quota first (capacity_refund_many, as a lone release refunds), rows in (tenant, resource) order.
  SELECT capacity_refund_many(array_agg(r.tenant_id), array_agg(r.gpu_kind), array_agg(r.gpu_count::bigint),
                              array_agg(r.vcpu::bigint), array_agg(r.memory_mib), array_agg(r.disk_gib))
    INTO v_done FROM reservations r WHERE r.id = ANY(v_ended);

  -- 3. Their atoms (read here, deleted in 5: the reservations' rows, held since 1, keep them as
  --    they are), the views and the events, before the scalars (4): the node_resources rows, which
  --    the create batches take too, are then held only from 4 to the commit. A view lists the atoms
  --    held before now, as capacity_view reads them from the history.
  SELECT array_agg(a.device_id), array_agg(a.allocation_id), array_agg(a.held) INTO v_atoms, v_of, v_held
    FROM (SELECT b.device_id, b.allocation_id, bool_or(lower(b.during) < v_now) AS held
            FROM device_bookings b WHERE b.allocation_id = ANY(v_ended) GROUP BY 1, 2) a;
  SELECT array_agg(CASE WHEN r.id IS NOT NULL
                        THEN capacity_view_of(r, coalesce((SELECT jsonb_agg(v_atoms[k] ORDER BY v_atoms[k]) FROM generate_subscripts(v_atoms, 1) k
                                                            WHERE v_of[k] = r.id AND v_held[k]), '[]')) END
                   ORDER BY g.j)
    INTO v_views FROM generate_subscripts(p_ids, 1) g(j) LEFT JOIN reservations r
                      ON p_ids[g.j] = ANY(v_ended) AND r.id = p_ids[g.j] AND r.tenant_id = p_tenants[g.j];
  SELECT outbox_emit_many(array_agg(e.event_id ORDER BY e.id), array_agg('reservation.released'::text ORDER BY e.id),
                          array_agg(e.tenant_id ORDER BY e.id), array_agg(e.id ORDER BY e.id), array_agg(e.data ORDER BY e.id))
    INTO v_done
    FROM (SELECT DISTINCT ON (p_ids[i]) p_event_ids[i] AS event_id, p_tenants[i] AS tenant_id, p_ids[i] AS id,
                 jsonb_build_object('state', v_views[i]->'state', 'nodeId', v_views[i]->'nodeId', 'atoms', v_views[i]->'atoms',
                                    'version', v_views[i]->'version') AS data
            FROM generate_subscripts(p_ids, 1) i WHERE v_views[i] IS NOT NULL ORDER BY p_ids[i], i) e;

  -- 4. The scalars of the nodes they were placed on, rows in node order.
  PERFORM 1 FROM node_resources
    WHERE node_id IN (SELECT r.node_id FROM reservations r WHERE r.id = ANY(v_ended)) ORDER BY node_id FOR UPDATE;
  UPDATE node_resources nr
     SET vcpu_allocated = vcpu_allocated - s.vcpu, memory_mib_allocated = memory_mib_allocated - s.memory_mib,
         disk_gib_allocated = disk_gib_allocated - s.disk_gib,
         -- as capacity_release does: allocatable held up by bookings comes down to usable
         vcpu_allocatable = greatest(vcpu_usable, capacity_allocatable_floor(vcpu_allocated - s.vcpu, vcpu_ratio)),
         memory_mib_allocatable = greatest(memory_mib_usable, capacity_allocatable_floor(memory_mib_allocated - s.memory_mib, memory_ratio)),
         disk_gib_allocatable = greatest(disk_gib_usable, capacity_allocatable_floor(disk_gib_allocated - s.disk_gib, disk_ratio))
    FROM (SELECT r.node_id, sum(r.vcpu) AS vcpu, sum(r.memory_mib) AS memory_mib, sum(r.disk_gib) AS disk_gib
            FROM reservations r WHERE r.id = ANY(v_ended) AND r.node_id IS NOT NULL GROUP BY r.node_id) s
   WHERE nr.node_id = s.node_id;

  -- 5. Every booking leaves the live table; what was held before now goes to the history. After the
  --    scalars, as capacity_end: deleted before them, a booking could hold up a placement that holds
  --    the node's row (its snapshot missed the booking, so it chose the atom) while we wait for
  --    that row.
  WITH gone AS (DELETE FROM device_bookings WHERE allocation_id = ANY(v_ended) RETURNING device_id, allocation_id, during)
  INSERT INTO device_booking_history (device_id, allocation_id, during)
  SELECT g.device_id, g.allocation_id, tstzrange(lower(g.during), least(upper(g.during), v_now), '[)')
    FROM gone g WHERE lower(g.during) < v_now;

  -- 6. The atoms with nothing booked from now on are idle again, per node and class, rows in key
  --    order.
  PERFORM 1 FROM node_atom_counts c
    WHERE c.node_id IN (SELECT r.node_id FROM reservations r WHERE r.id = ANY(v_ended))
    ORDER BY c.node_id, c.kind, c.model, c.profile FOR UPDATE;
  UPDATE node_atom_counts c SET idle = LEAST(c.total, c.idle + w.n)
    FROM (SELECT r.node_id, r.gpu_kind, r.gpu_model, coalesce(r.mig_profile, '') AS profile, count(*) AS n
            FROM unnest(v_atoms, v_of) a(device_id, allocation_id) JOIN reservations r ON r.id = a.allocation_id
           WHERE r.node_id IS NOT NULL
             AND coalesce((SELECT max(upper(o.during)) FROM device_bookings o WHERE o.device_id COLLATE "C" = a.device_id),
                          '-infinity') <= v_now
           GROUP BY 1, 2, 3, 4) w
   WHERE c.node_id = w.node_id AND c.kind = w.gpu_kind AND c.model = w.gpu_model AND c.profile = w.profile;

  -- 7. The wake-ups (capacity_after_change's, for all at once).
  PERFORM work_queue_enqueue(array_agg(w.kind), array_agg(w.key), array_agg(w.shard), 0)
     FROM (SELECT DISTINCT ON (p_ids[i]) 'capacity.reservations' AS kind, p_ids[i] AS key, p_shards[i] AS shard
             FROM generate_subscripts(p_ids, 1) i WHERE v_views[i] IS NOT NULL) w;
  PERFORM desired_invalidate(array_agg(n.id), array_agg(n.shard)) FROM nodes n
    WHERE n.id IN (SELECT r.node_id FROM reservations r WHERE r.id = ANY(v_ended));
  RETURN v_views;
END $$;
