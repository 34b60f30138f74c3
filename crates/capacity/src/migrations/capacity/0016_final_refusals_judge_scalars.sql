-- reservations.create also refuses, at once, what no node of the pool could hold even when empty:
-- a CPU-only request for a GPU class the pool lacks (it lands only on nodes that carry its class),
-- or more vCPU, memory or disk than any node with enough atoms of the class has. Such a request
-- used to wait as pending forever, holding its tenant's quota.
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
          nullif(p_profile, ''), p_count, p_vcpu, p_memory_mib, p_disk_gib, tstzrange(v_start, v_stop, '[)'), p_selector,
          p_tolerations, v_place.placed_node, v_unschedulable,
          CASE WHEN v_place.placed_node IS NULL THEN compute_now() + make_interval(secs => p_retry_s) END, p_identity)
  RETURNING * INTO r;
  RETURN capacity_after_change(r, 'reservation.' || r.state, p_event_id, p_shard);
END $$;
