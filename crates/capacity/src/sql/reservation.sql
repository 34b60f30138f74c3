-- Reservations' writes run in the database: create, release and each move through time are one
-- statement, so one round trip, with the plans kept by the backend. The Rust side (reservations.rs)
-- checks the request's shape, makes the ids, and maps the errors raised here onto API codes (SQLSTATE
-- class BC: better_compute_db::SQL_DOMAIN_ERRORS). Every entry point takes the reservation's own row
-- first, then the rest of the lock order (docs/architecture.md), and runs with enable_seqscan = off,
-- as capacity_place does.

-- The reservation state table's guard is generated (state_guards.sql); these were its hand-written
-- copy.
DROP FUNCTION IF EXISTS capacity_reservation_state_guard();
DROP FUNCTION IF EXISTS capacity_reservation_may_become(text, text);

-- The view of a reservation given its atoms: an expression without subqueries, so the planner
-- inlines it into the statement that calls it, and a batch builds its views from the atoms it has in
-- hand instead of running capacity_view's lookups once per request.
-- When an ended reservation actually ended: its end, or, ended early (a release, an eviction), the
-- instant it ended (its last change, updated_at). NULL while it has not ended. Metering bills up to
-- here (usage.sql), and the view shows it, so a tenant can check a bill against it.
CREATE OR REPLACE FUNCTION capacity_ended_at(r reservations) RETURNS timestamptz
LANGUAGE sql STABLE AS $$
  SELECT CASE WHEN r.state IN ('released', 'expired', 'failed') THEN least(upper(r.during), r.updated_at) END
$$;

CREATE OR REPLACE FUNCTION capacity_view_of(r reservations, p_atoms jsonb) RETURNS jsonb
LANGUAGE sql STABLE AS $$
  SELECT jsonb_build_object(
    'id', r.id, 'state', r.state, 'version', r.version, 'poolId', r.pool_id,
    'gpu', jsonb_build_object('kind', r.gpu_kind, 'model', r.gpu_model, 'profile', r.mig_profile, 'count', r.gpu_count),
    'vcpu', r.vcpu, 'memoryMib', r.memory_mib, 'diskGib', r.disk_gib,
    'startsAt', to_char(lower(r.during) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    'endsAt', to_char(upper(r.during) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    'endedAt', to_char(capacity_ended_at(r) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    'nodeId', r.node_id,
    'atoms', p_atoms,
    'endReason', r.end_reason,
    'conditions', CASE WHEN r.unschedulable IS NULL THEN '[]'::jsonb
                       ELSE jsonb_build_array(jsonb_build_object('type', 'Unschedulable') || r.unschedulable) END)
$$;

-- The view of a reservation: its atoms from its live bookings, or from the history once it has
-- ended.
CREATE OR REPLACE FUNCTION capacity_view(r reservations) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
BEGIN
  RETURN capacity_view_of(r,
    CASE WHEN r.state IN ('released', 'expired', 'failed')
         THEN (SELECT coalesce(jsonb_agg(a.device_id ORDER BY a.device_id), '[]')
                 FROM (SELECT DISTINCT h.device_id FROM device_booking_history h WHERE h.allocation_id = r.id) a)
         ELSE (SELECT coalesce(jsonb_agg(a.device_id ORDER BY a.device_id), '[]')
                 FROM (SELECT DISTINCT b.device_id FROM device_bookings b WHERE b.allocation_id = r.id) a) END);
END $$;

-- Why a demand could not be placed now, as the reservation's Unschedulable condition: a stable
-- reason (Conflicts when a concurrent change turned a node away, else NoCandidates) and a message a
-- tenant or operator can act on, naming what happened on each node tried.
CREATE OR REPLACE FUNCTION capacity_unschedulable(p_kind text, p_model text, p_profile text, p_count int, p_tried text[],
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
-- the reservation's first ('capacity.reservations' is RESERVATIONS_KIND's name), so that keys are
-- always taken in kind order. Returns the view.
CREATE OR REPLACE FUNCTION capacity_after_change(r reservations, p_event_type text, p_event_id text, p_shard int2) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  v jsonb;
  v_event text;
  v_keys int;
BEGIN
  v := capacity_view(r);
  v_event := outbox_emit(p_event_id, p_event_type, r.tenant_id, r.id,
                         jsonb_build_object('state', v->'state', 'nodeId', v->'nodeId', 'atoms', v->'atoms', 'version', v->'version')
                         || CASE WHEN r.end_reason IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('endReason', r.end_reason) END);
  v_keys := work_queue_enqueue(ARRAY['capacity.reservations'], ARRAY[r.id], ARRAY[p_shard], 0);
  IF r.node_id IS NOT NULL THEN
    v_keys := desired_invalidate(ARRAY[r.node_id], ARRAY[(SELECT n.shard FROM nodes n WHERE n.id = r.node_id)]);
  END IF;
  RETURN v;
END $$;

-- reservations.create: charges quota, then places (capacity_place) or leaves the reservation pending
-- with its Unschedulable condition. It refuses at once, as final, only what the pool's hardware can
-- never hold, even empty: a class the pool lacks, more atoms than any node has, a CPU-only request
-- for a class the pool lacks (it lands only on nodes that carry its class), or more vCPU, memory or
-- disk than any node with enough atoms of the class has. A transient state (a quarantined GPU, an
-- unhealthy node, a full pool) leaves it pending instead.
CREATE OR REPLACE FUNCTION capacity_reserve(
  p_id text, p_tenant text, p_identity text, p_pool text, p_kind text, p_model text, p_profile text, p_count int,
  p_vcpu int, p_memory_mib bigint, p_disk_gib bigint, p_starts_at timestamptz, p_ends_at timestamptz,
  p_duration_s float8, p_selector jsonb, p_tolerations jsonb, p_max_replans int, p_retry_s float8,
  p_max_duration_s float8, p_event_id text, p_shard int2) RETURNS jsonb
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
  v_start timestamptz := greatest(coalesce(p_starts_at, compute_now()), compute_now());
  v_stop timestamptz;
  v_most int;
  v_fits boolean;
  v_vcpu float8;
  v_memory_mib float8;
  v_disk_gib float8;
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
    -- The hardware: every atom of the class on each node of the pool, healthy or not, quarantined
    -- or not (node_atom_counts counts only what is placeable now), and each node's scalars when
    -- empty. A CPU-only request names its class too: it lands only on nodes that carry it.
    SELECT max(x.c), bool_or(x.c >= p_count AND x.vcpu >= p_vcpu AND x.memory_mib >= p_memory_mib AND x.disk_gib >= p_disk_gib),
           max(x.vcpu) FILTER (WHERE x.c >= p_count), max(x.memory_mib) FILTER (WHERE x.c >= p_count),
           max(x.disk_gib) FILTER (WHERE x.c >= p_count)
      INTO v_most, v_fits, v_vcpu, v_memory_mib, v_disk_gib
      FROM (SELECT d.node_id, count(*) AS c, floor(nr.vcpu_allocatable * nr.vcpu_ratio) AS vcpu,
                   floor(nr.memory_mib_allocatable * nr.memory_ratio) AS memory_mib, floor(nr.disk_gib_allocatable * nr.disk_ratio) AS disk_gib
              FROM devices d JOIN nodes n ON n.id = d.node_id JOIN node_resources nr ON nr.node_id = d.node_id
             WHERE n.pool_id = p_pool AND d.bookable AND d.kind = p_kind AND d.model = p_model AND coalesce(d.profile, '') = p_profile
             GROUP BY d.node_id, nr.node_id) x;
    IF v_most IS NULL THEN
      RAISE EXCEPTION USING ERRCODE = 'BCINV',
        MESSAGE = format('pool %s has no %s atoms; check gpu.model, gpu.kind and gpu.profile', p_pool, v_class);
    ELSIF v_most < p_count THEN
      RAISE EXCEPTION USING ERRCODE = 'BCFPC',
        MESSAGE = format('no node in pool %s has %s %s atoms (the most on one node is %s); ask for fewer', p_pool, p_count, v_class, v_most);
    ELSIF NOT v_fits THEN
      RAISE EXCEPTION USING ERRCODE = 'BCFPC',
        MESSAGE = format('no node in pool %s with %s %s atoms holds %s vCPU, %s MiB memory and %s GiB disk even when empty '
                         '(the most such a node holds: %s vCPU, %s MiB memory and %s GiB disk); ask for less',
                         p_pool, p_count, v_class, p_vcpu, p_memory_mib, p_disk_gib, v_vcpu, v_memory_mib, v_disk_gib);
    END IF;
    v_unschedulable := capacity_unschedulable(p_kind, p_model, p_profile, p_count, v_place.tried, v_place.raced, p_retry_s)
                       || jsonb_build_object('since', compute_now());
  END IF;
  INSERT INTO reservations (id, tenant_id, pool_id, state, gpu_kind, gpu_model, mig_profile, gpu_count, vcpu, memory_mib,
                            disk_gib, during, node_selector, tolerations, node_id, unschedulable, next_attempt_at, created_by)
  VALUES (p_id, p_tenant, p_pool, CASE WHEN v_place.placed_node IS NULL THEN 'pending' ELSE 'placed' END, p_kind, p_model,
          nullif(p_profile, ''), p_count, p_vcpu, p_memory_mib, p_disk_gib,
          tstzrange(coalesce(v_place.placed_from, v_start), v_stop, '[)'), p_selector,
          p_tolerations, v_place.placed_node, v_unschedulable,
          CASE WHEN v_place.placed_node IS NULL THEN compute_now() + make_interval(secs => p_retry_s) END, p_identity)
  RETURNING * INTO r;
  -- The attempts the placer saw turned away ride along for the caller's metrics (reservations.rs
  -- takes them out of the view).
  RETURN capacity_after_change(r, 'reservation.' || r.state, p_event_id, p_shard)
         || jsonb_build_object('placerReplans', jsonb_build_object(
              'conflict', v_place.conflicts,
              'stale', cardinality(v_place.tried) - v_place.conflicts));
END $$;

-- Moves one reservation through time, in the caller's (fenced) transaction: one whose end has
-- passed expires and gives back what it holds; a placed one whose start has come becomes active; a
-- pending one due for a retry is placed again (from now at the earliest) or waits p_retry_s more.
-- Returns what it did: nothing, expired, activated, placed or still_pending.
CREATE OR REPLACE FUNCTION capacity_step(p_id text, p_max_replans int, p_retry_s float8, p_event_id text, p_shard int2) RETURNS text
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
  UPDATE reservations SET state = 'placed', node_id = v_place.placed_node,
                          during = tstzrange(v_place.placed_from, upper(v_during), '[)'), unschedulable = NULL,
                          next_attempt_at = NULL, version = version + 1, updated_at = compute_now()
   WHERE id = p_id
  RETURNING * INTO r;
  v := capacity_after_change(r, 'reservation.placed', p_event_id, p_shard);
  RETURN 'placed';
END $$;
