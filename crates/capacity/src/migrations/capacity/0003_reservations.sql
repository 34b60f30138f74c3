-- Reservations' writes run in the database too: create, release and each move through time are one
-- statement, so one round trip, with the plans kept by the backend. The Rust side checks the
-- request's shape, makes the ids, and maps the errors raised here onto API codes (SQLSTATE class
-- BC: better_compute_db::SQL_DOMAIN_ERRORS).
--
-- Lock order, as every transaction that takes several of these: the reservation's own row,
-- quota_usage, pools, nodes, devices, node_resources, device_bookings, node_atom_counts; then the
-- outbox and the work_queue rows.
--
-- enable_seqscan = off on the entry points, as on capacity_place: every statement has an index to
-- follow, and a plan kept from a nearly empty table must not stay a sequential scan.

-- reservationStateTable (better_compute_core::state::RESERVATION_STATE_TABLE) as the database
-- enforces it: no statement moves a reservation along a transition the table does not declare. A
-- test compares the two.
CREATE FUNCTION capacity_reservation_may_become(p_from text, p_to text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
  RETURN (p_from, p_to) IN (('pending', 'placed'), ('pending', 'released'), ('pending', 'expired'), ('pending', 'failed'),
                            ('placed', 'active'), ('placed', 'released'), ('placed', 'expired'), ('placed', 'failed'),
                            ('active', 'released'), ('active', 'expired'), ('active', 'failed'));
END $$;

CREATE FUNCTION capacity_reservation_state_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT capacity_reservation_may_become(OLD.state, NEW.state) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCFPC',
      MESSAGE = format('a reservation in state %s cannot become %s', OLD.state, NEW.state),
      DETAIL = jsonb_build_object('reason', 'ILLEGAL_TRANSITION', 'from', OLD.state, 'to', NEW.state)::text;
  END IF;
  RETURN NEW;
END $$;

CREATE TRIGGER reservations_state_guard BEFORE UPDATE OF state ON reservations
  FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION capacity_reservation_state_guard();

-- A reservation as its tenant sees it: reservations::ReservationView's JSON. PL/pgSQL, not SQL: a
-- SQL function with a subquery is never inlined, and is parsed and planned again at every call.
CREATE FUNCTION capacity_view(r reservations) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
BEGIN
  RETURN jsonb_build_object(
    'id', r.id, 'state', r.state, 'version', r.version, 'poolId', r.pool_id,
    'gpu', jsonb_build_object('kind', r.gpu_kind, 'model', r.gpu_model, 'profile', r.mig_profile, 'count', r.gpu_count),
    'vcpu', r.vcpu, 'memoryMib', r.memory_mib, 'diskGib', r.disk_gib,
    'startsAt', to_char(lower(r.during) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    'endsAt', to_char(upper(r.during) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    'nodeId', r.node_id,
    'atoms', (SELECT coalesce(jsonb_agg(a.device_id ORDER BY a.device_id), '[]')
                FROM (SELECT DISTINCT b.device_id FROM device_bookings b WHERE b.allocation_id = r.id) a),
    'conditions', CASE WHEN r.unschedulable IS NULL THEN '[]'::jsonb
                       ELSE jsonb_build_array(jsonb_build_object('type', 'Unschedulable') || r.unschedulable) END);
END $$;

-- What a reservation charges its tenant's quota: (resource, amount) in charge order, amounts above
-- zero only.
CREATE FUNCTION capacity_charge_of(p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint, p_disk_gib bigint)
RETURNS TABLE (resource text, amount bigint)
LANGUAGE sql IMMUTABLE AS $$
  SELECT c.resource, c.amount
    FROM (VALUES (1, CASE p_kind WHEN 'gpu' THEN 'gpus' WHEN 'mig' THEN 'mig_instances' ELSE 'gpu_slots' END, p_count),
                 (2, 'vcpu', p_vcpu), (3, 'memory_mib', p_memory_mib), (4, 'disk_gib', p_disk_gib)) c(o, resource, amount)
   WHERE c.amount > 0
   ORDER BY c.o
$$;

-- Charges the tenant in one guarded statement: the rows are locked in resource order (so two
-- charges never wait on each other in opposite orders), and each is updated only if its charge fits
-- under max. A resource that does not fit (or has no quota line) raises QUOTA_EXCEEDED, final for
-- the request. Returns how many resources were charged (a value, so callers assign instead of
-- PERFORM, which runs a query).
CREATE FUNCTION capacity_charge(p_tenant text, p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint,
                                p_disk_gib bigint) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  v_charged text[];
  v_short record;
  v_quota record;
BEGIN
  WITH c AS (SELECT * FROM capacity_charge_of(p_kind, p_count, p_vcpu, p_memory_mib, p_disk_gib)),
       locked AS (SELECT q.resource FROM quota_usage q
                   WHERE q.tenant_id = p_tenant AND q.resource IN (SELECT resource FROM c)
                   ORDER BY q.resource FOR UPDATE),
       charged AS (UPDATE quota_usage q SET used = q.used + c.amount
                     FROM c JOIN locked l ON l.resource = c.resource
                    WHERE q.tenant_id = p_tenant AND q.resource = c.resource AND q.used + c.amount <= q.max
                   RETURNING q.resource)
  SELECT coalesce(array_agg(resource), '{}') INTO v_charged FROM charged;
  -- Every amount above zero charged: done (capacity_charge_of's rule, without a query).
  IF cardinality(v_charged) = (p_count > 0)::int + (p_vcpu > 0)::int + (p_memory_mib > 0)::int + (p_disk_gib > 0)::int THEN
    RETURN cardinality(v_charged);
  END IF;
  SELECT c.resource, c.amount INTO v_short
    FROM capacity_charge_of(p_kind, p_count, p_vcpu, p_memory_mib, p_disk_gib) c
   WHERE NOT (c.resource = ANY(v_charged))
   LIMIT 1;
  SELECT used, max INTO v_quota FROM quota_usage WHERE tenant_id = p_tenant AND resource = v_short.resource;
  RAISE EXCEPTION USING ERRCODE = 'BCQUO',
    MESSAGE = CASE WHEN v_quota.max IS NULL
                   THEN format('the tenant has no quota for %s; ask an operator to set one', v_short.resource)
                   ELSE format('quota for %s exceeded: %s of %s used, %s more asked; release reservations or ask an operator for more',
                               v_short.resource, v_quota.used, v_quota.max, v_short.amount) END,
    DETAIL = jsonb_build_object('resource', v_short.resource, 'asked', v_short.amount)::text;
END $$;

-- Refunds a charge, locking the rows in the same resource order as capacity_charge; returns how
-- many resources were refunded.
CREATE FUNCTION capacity_refund(p_tenant text, p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint,
                                p_disk_gib bigint) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  v_refunded int;
BEGIN
  WITH c AS (SELECT * FROM capacity_charge_of(p_kind, p_count, p_vcpu, p_memory_mib, p_disk_gib)),
       locked AS (SELECT q.resource FROM quota_usage q
                   WHERE q.tenant_id = p_tenant AND q.resource IN (SELECT resource FROM c)
                   ORDER BY q.resource FOR UPDATE)
  UPDATE quota_usage q SET used = q.used - c.amount
    FROM c JOIN locked l ON l.resource = c.resource
   WHERE q.tenant_id = p_tenant AND q.resource = c.resource;
  GET DIAGNOSTICS v_refunded = ROW_COUNT;
  RETURN v_refunded;
END $$;

-- Why a demand could not be placed now, as the reservation's Unschedulable condition: a stable
-- reason (Conflicts when a concurrent change turned a node away, else NoCandidates) and a message
-- a tenant or operator can act on, naming what happened on each node tried.
CREATE FUNCTION capacity_unschedulable(p_kind text, p_model text, p_profile text, p_count int, p_tried text[],
                                       p_raced boolean, p_retry_s float8) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
  SELECT jsonb_build_object(
    'reason', CASE WHEN p_raced THEN 'Conflicts' ELSE 'NoCandidates' END,
    'message', format(CASE WHEN p_raced THEN 'concurrent placements took the nodes that fit %s%s; retrying every %s s'
                           ELSE 'no eligible node in the pool has %s and the vCPU, memory and disk free for the range%s; retrying every %s s' END,
                      format('%s %s%s atom%s of %s', p_count, p_kind, CASE WHEN p_profile = '' THEN '' ELSE ' ' || p_profile END,
                             CASE WHEN p_count = 1 THEN '' ELSE 's' END, p_model),
                      CASE WHEN cardinality(p_tried) = 0 THEN '' ELSE ' (tried ' || array_to_string(p_tried, '; ') || ')' END,
                      p_retry_s))
$$;

-- The shared tail of every change, given the reservation's row as the change left it: the outbox
-- event, and wake-ups of the node's desired state (its nodespec key, in the node's stored shard) and
-- of the reservation's own reconciler key (which arms its timers; p_shard, computed by the caller),
-- both in one statement. The kinds' names are desired::NODESPEC's and RESERVATIONS_KIND's. Returns
-- the view.
CREATE FUNCTION capacity_after_change(r reservations, p_event_type text, p_event_id text, p_shard int2) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v jsonb;
  v_event text;
  v_keys int;
BEGIN
  v := capacity_view(r);
  v_event := outbox_emit(p_event_id, p_event_type, r.tenant_id, r.id,
                         jsonb_build_object('state', v->'state', 'nodeId', v->'nodeId', 'atoms', v->'atoms', 'version', v->'version'));
  IF r.node_id IS NULL THEN
    v_keys := work_queue_enqueue(ARRAY['capacity.reservations'], ARRAY[r.id], ARRAY[p_shard], 0);
  ELSE
    v_keys := work_queue_enqueue(ARRAY['capacity.reservations', 'nodespec'], ARRAY[r.id, r.node_id],
                                 ARRAY[p_shard, (SELECT n.shard FROM nodes n WHERE n.id = r.node_id)], 0);
  END IF;
  RETURN v;
END $$;

-- reservations.create, after the request's shape was checked: the range (a past or absent start is
-- now), the quota charge (final if it does not fit), the pool, then the placer; the reservation is
-- placed, or pending with an Unschedulable condition and retried every p_retry_s. A class no node
-- of the pool has enough atoms of is refused, and the statement's writes with it; it is looked up
-- only when the placer found no room, since a placement proves the class fits.
CREATE FUNCTION capacity_reserve(
  p_id text, p_tenant text, p_identity text, p_pool text, p_kind text, p_model text, p_profile text, p_count int,
  p_vcpu int, p_memory_mib bigint, p_disk_gib bigint, p_starts_at timestamptz, p_ends_at timestamptz,
  p_duration_s float8, p_selector jsonb, p_tolerations jsonb, p_max_replans int, p_retry_s float8,
  p_max_duration_s float8, p_event_id text, p_shard int2) RETURNS jsonb
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
  v_start timestamptz := greatest(coalesce(p_starts_at, compute_now()), compute_now());
  v_stop timestamptz;
  v_most int;
  v_class text;
  v_place record;
  v_unschedulable jsonb;
  v_charged int;
  r reservations;
BEGIN
  v_stop := coalesce(p_ends_at, v_start + make_interval(secs => p_duration_s));
  IF NOT v_start < v_stop THEN
    RAISE EXCEPTION USING ERRCODE = 'BCINV', MESSAGE = 'endsAt must be after startsAt and in the future';
  END IF;
  IF v_stop - v_start > make_interval(secs => p_max_duration_s)
     OR v_start > compute_now() + make_interval(secs => p_max_duration_s) THEN
    RAISE EXCEPTION USING ERRCODE = 'BCINV', MESSAGE = 'a reservation may last at most 366 days and start within 366 days';
  END IF;
  -- Quota first: the lock order's first table.
  v_charged := capacity_charge(p_tenant, p_kind, p_count, p_vcpu, p_memory_mib, p_disk_gib);
  -- The pool FOR SHARE: it cannot go away under us.
  PERFORM 1 FROM pools WHERE id = p_pool FOR SHARE;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'BCNFD', MESSAGE = format('pool %s not found', p_pool);
  END IF;
  SELECT * INTO v_place
    FROM capacity_place(p_pool, p_kind, p_model, p_profile, p_count, p_vcpu, p_memory_mib, p_disk_gib, p_selector,
                        p_tolerations, p_id, tstzrange(v_start, v_stop, '[)'), p_max_replans);
  IF v_place.placed_node IS NULL THEN
    v_class := concat_ws(' ', p_kind, p_model, nullif(p_profile, ''));
    IF p_count > 0 THEN
      SELECT max(total) INTO v_most FROM node_atom_counts
       WHERE pool_id = p_pool AND kind = p_kind AND model = p_model AND profile = p_profile AND total > 0;
      IF v_most IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'BCINV',
          MESSAGE = format('pool %s has no %s atoms; check gpu.model, gpu.kind and gpu.profile', p_pool, v_class);
      ELSIF v_most < p_count THEN
        RAISE EXCEPTION USING ERRCODE = 'BCFPC',
          MESSAGE = format('no node in pool %s has %s %s atoms (the most on one node is %s); ask for fewer', p_pool, p_count, v_class, v_most);
      END IF;
    END IF;
    v_unschedulable := capacity_unschedulable(p_kind, p_model, p_profile, p_count, v_place.tried, v_place.raced, p_retry_s)
                       || jsonb_build_object('since', compute_now());
  END IF;
  INSERT INTO reservations (id, tenant_id, pool_id, state, gpu_kind, gpu_model, mig_profile, gpu_count, vcpu, memory_mib,
                            disk_gib, during, node_selector, tolerations, node_id, unschedulable, next_attempt_at, created_by)
  VALUES (p_id, p_tenant, p_pool, CASE WHEN v_place.placed_node IS NULL THEN 'pending' ELSE 'placed' END, p_kind, p_model,
          nullif(p_profile, ''), p_count, p_vcpu, p_memory_mib, p_disk_gib, tstzrange(v_start, v_stop, '[)'), p_selector,
          p_tolerations, v_place.placed_node, v_unschedulable,
          CASE WHEN v_place.placed_node IS NULL THEN compute_now() + make_interval(secs => p_retry_s) END, p_identity)
  RETURNING * INTO r;
  RETURN capacity_after_change(r, 'reservation.' || r.state, p_event_id, p_shard);
END $$;

-- Ends a reservation at compute_now() as p_to (released or expired) and gives back what it holds
-- from then on: quota first, then the scalars it took on its node, the future part of its bookings
-- (deleted) and the current one (cut), and the atoms that now have nothing booked ahead.
-- A reservation already ended is returned unchanged. p_tenant, when given, must own it.
CREATE FUNCTION capacity_end(p_id text, p_tenant text, p_to text, p_event_id text, p_shard int2) RETURNS jsonb
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
  r reservations;
  v_refunded int;
  v_on_node boolean;
BEGIN
  -- The reservation's row first, before quota and the rest of the lock order.
  SELECT * INTO r FROM reservations WHERE id = p_id AND (p_tenant IS NULL OR tenant_id = p_tenant) FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'BCNFD', MESSAGE = format('reservation %s not found', p_id);
  END IF;
  IF r.state IN ('released', 'expired', 'failed') THEN
    RETURN capacity_view(r);
  END IF;
  -- Placed or active: it holds scalars and idle-atom counts on its node.
  v_on_node := r.node_id IS NOT NULL AND r.state IN ('placed', 'active');
  v_refunded := capacity_refund(r.tenant_id, r.gpu_kind, r.gpu_count, r.vcpu, r.memory_mib, r.disk_gib);
  -- The node's scalars before the bookings, in the placer's order (node_resources, then
  -- device_bookings, then node_atom_counts). The other way round, a placement holding this node's
  -- row and inserting a booking that overlaps ours would wait for our uncommitted cut while we wait
  -- for its row: the capacity bench met that deadlock.
  IF v_on_node THEN
    UPDATE node_resources
       SET vcpu_allocated = vcpu_allocated - r.vcpu, memory_mib_allocated = memory_mib_allocated - r.memory_mib,
           disk_gib_allocated = disk_gib_allocated - r.disk_gib
     WHERE node_id = r.node_id;
  END IF;
  -- The two touch disjoint rows: those starting from now on, and those started before and not yet
  -- ended (bookings are '[)' ranges). Bounds, not `during @> compute_now()`: that one matches the
  -- exclusion index, and the planner ANDed a scan of every current booking with this allocation's.
  WITH future AS (DELETE FROM device_bookings WHERE allocation_id = p_id AND lower(during) >= compute_now())
  UPDATE device_bookings SET during = tstzrange(lower(during), compute_now(), '[)')
   WHERE allocation_id = p_id AND lower(during) < compute_now() AND upper(during) > compute_now();
  -- The atoms that now have nothing booked from now on are idle again.
  IF v_on_node THEN
    UPDATE node_atom_counts c SET idle = LEAST(c.total, c.idle + (
        SELECT count(DISTINCT b.device_id) FROM device_bookings b
         WHERE b.allocation_id = p_id
           AND NOT EXISTS (SELECT 1 FROM device_bookings o WHERE o.device_id = b.device_id AND upper(o.during) > compute_now())))
     WHERE c.node_id = r.node_id AND c.kind = r.gpu_kind AND c.model = r.gpu_model AND c.profile = coalesce(r.mig_profile, '');
  END IF;
  UPDATE reservations SET state = p_to, version = version + 1, updated_at = compute_now(), unschedulable = NULL,
                          next_attempt_at = NULL
   WHERE id = p_id
  RETURNING * INTO r;
  RETURN capacity_after_change(r, 'reservation.' || p_to, p_event_id, p_shard);
END $$;

-- Moves one reservation through time, in the caller's (fenced) transaction: one whose end has
-- passed expires and gives back what it holds; a placed one whose start has come becomes active;
-- a pending one due for a retry is placed again (from now at the earliest) or waits p_retry_s
-- more. Returns what it did: nothing, expired, activated, placed or still_pending.
CREATE FUNCTION capacity_step(p_id text, p_max_replans int, p_retry_s float8, p_event_id text, p_shard int2) RETURNS text
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
  r reservations;
  v_during tstzrange;
  v_place record;
  v jsonb;
BEGIN
  SELECT * INTO r FROM reservations WHERE id = p_id FOR UPDATE;
  IF NOT FOUND OR r.state IN ('released', 'expired', 'failed') THEN
    RETURN 'nothing';
  END IF;
  IF upper(r.during) <= compute_now() THEN
    v := capacity_end(p_id, NULL, 'expired', p_event_id, p_shard);
    RETURN 'expired';
  END IF;
  IF r.state = 'placed' AND lower(r.during) <= compute_now() THEN
    UPDATE reservations SET state = 'active', version = version + 1, updated_at = compute_now() WHERE id = p_id
    RETURNING * INTO r;
    v := capacity_after_change(r, 'reservation.active', p_event_id, p_shard);
    RETURN 'activated';
  END IF;
  IF r.state <> 'pending' OR NOT coalesce(r.next_attempt_at <= compute_now(), false) THEN
    RETURN 'nothing';
  END IF;
  -- Quota was charged at create and stays charged while pending; only the booking is retried.
  v_during := tstzrange(greatest(lower(r.during), compute_now()), upper(r.during), '[)');
  SELECT * INTO v_place
    FROM capacity_place(r.pool_id, r.gpu_kind, r.gpu_model, coalesce(r.mig_profile, ''), r.gpu_count, r.vcpu, r.memory_mib,
                        r.disk_gib, r.node_selector, r.tolerations, p_id, v_during, p_max_replans);
  IF v_place.placed_node IS NULL THEN
    UPDATE reservations
       SET unschedulable = capacity_unschedulable(r.gpu_kind, r.gpu_model, coalesce(r.mig_profile, ''), r.gpu_count,
                                                  v_place.tried, v_place.raced, p_retry_s)
                           || jsonb_build_object('since', r.unschedulable->'since'),
           next_attempt_at = compute_now() + make_interval(secs => p_retry_s)
     WHERE id = p_id;
    RETURN 'still_pending';
  END IF;
  UPDATE reservations SET state = 'placed', node_id = v_place.placed_node, during = v_during, unschedulable = NULL,
                          next_attempt_at = NULL, version = version + 1, updated_at = compute_now()
   WHERE id = p_id
  RETURNING * INTO r;
  v := capacity_after_change(r, 'reservation.placed', p_event_id, p_shard);
  RETURN 'placed';
END $$;

-- The bookings of one device that end after a given time, in a few btree pages: "is this atom
-- booked in this range" (the placer) and "has it anything booked from now on" (release, expiry,
-- the idle counts). The exclusion constraint's GiST answers both too, but for an equality on text
-- it is barely selective (btree_gist keeps a range of keys per page, and the ranges overlap): the
-- capacity bench measured a millisecond per lookup once a device had fifty past bookings, and past
-- bookings stay.
CREATE INDEX device_bookings_device_end ON device_bookings (device_id, upper(during));

-- capacity_place as in 0002_placer, but for the atoms' bookings check, written so that the btree
-- index above serves it.
CREATE OR REPLACE FUNCTION capacity_place(
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
                 -- The overlap written with bounds (bookings are '[)' ranges), so that the btree
                 -- index serves it: `&&` makes the planner pick the exclusion constraint's GiST.
                 -- Only a hint either way: the constraint decides at the insert below.
                 AND NOT EXISTS (SELECT 1 FROM device_bookings b
                                  WHERE b.device_id = a.id AND upper(b.during) > lower(p_during)
                                    AND lower(b.during) < upper(p_during))
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
