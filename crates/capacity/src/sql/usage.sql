-- Usage metering (the `capacity.usage` job, one key per pool): closes the usage windows of a
-- pool's reservations from their bookings, live and ended. Reserved time, not utilisation: a
-- reservation on an unreachable node is billed; one released early stops at its release instant
-- (its bookings were cut there).

-- The end of the last closed usage window.
CREATE OR REPLACE FUNCTION capacity_usage_closed_until() RETURNS timestamptz
LANGUAGE sql STABLE AS $$
  SELECT to_timestamp(floor(extract(epoch FROM compute_now()) / s.window_s) * s.window_s) FROM usage_settings s
$$;

-- The fleet's usage window, in seconds (the vps module's instance usage uses the same windows).
CREATE OR REPLACE FUNCTION capacity_usage_window_s() RETURNS int
LANGUAGE sql STABLE AS $$ SELECT s.window_s FROM usage_settings s $$;

-- Whether a reservation has a closed window not looked at yet, or changed (extended, released)
-- since it was metered. An ended reservation is metered up to its end (a release cut its bookings
-- at the release instant, updated_at).
CREATE OR REPLACE FUNCTION capacity_usage_is_due(r reservations, p_closed timestamptz) RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT r.state <> 'pending'
     AND (r.usage_version IS DISTINCT FROM r.version
          OR coalesce(r.usage_closed_until, '-infinity') < least(p_closed,
               coalesce(capacity_ended_at(r), upper(r.during))))
$$;

-- The range a reservation held its node's scalars: from its start (a placement books from then
-- on) to its end, or, ended early, to the instant it ended (updated_at: a release, an eviction).
-- Empty for one never placed or ended before it started.
CREATE OR REPLACE FUNCTION capacity_usage_held(r reservations) RETURNS tstzrange
LANGUAGE sql STABLE AS $$
  SELECT CASE WHEN r.node_id IS NULL OR r.state = 'pending' THEN 'empty'::tstzrange
              WHEN capacity_ended_at(r) IS NOT NULL
                THEN tstzrange(lower(r.during), greatest(lower(r.during), capacity_ended_at(r)), '[)')
              ELSE r.during END
$$;

-- The seconds a set of ranges covers, exact to the microsecond.
CREATE OR REPLACE FUNCTION capacity_usage_seconds(m tstzmultirange) RETURNS numeric
LANGUAGE sql IMMUTABLE AS $$
  SELECT coalesce(sum(extract(epoch FROM upper(x) - lower(x))), 0) FROM unnest(m) x
$$;

-- Meters up to p_limit reservations of p_pool that have a closed window not yet looked at, or that
-- changed (extended, released) since they were: writes a row for each closed window with usage
-- and no row yet, and an adjustment for each closed window whose usage moved since it was billed.
-- Returns the rows written with their events' data. Reservations another transaction holds are
-- left to the next run (SKIP LOCKED): the reservation's row is the first of the lock order.
CREATE OR REPLACE FUNCTION capacity_usage_close(p_pool text, p_limit int)
RETURNS TABLE (id text, tenant_id text, data jsonb)
LANGUAGE plpgsql AS $$
DECLARE
  v_w float8;
  v_closed timestamptz;
BEGIN
  SELECT s.window_s INTO v_w FROM usage_settings s;
  v_closed := capacity_usage_closed_until();
  RETURN QUERY
  WITH due AS (
    SELECT r.id, r.tenant_id, r.pool_id, r.node_id, r.gpu_kind, r.gpu_model, r.mig_profile, r.vcpu, r.memory_mib, r.disk_gib,
           r.gpu_count, capacity_usage_held(r) AS held,
           -- a reservation unchanged since it was last metered is looked at from there on
           CASE WHEN r.usage_version = r.version THEN r.usage_closed_until END AS since
      FROM reservations r
     WHERE r.pool_id = p_pool AND capacity_usage_is_due(r, v_closed)
     ORDER BY r.id LIMIT p_limit
       FOR UPDATE OF r SKIP LOCKED),
  -- What each reservation held: its atoms' bookings (live and ended), or, with no GPUs, the range
  -- its scalars were held on its node (atom = false: it adds no atom-seconds).
  spans AS (
    SELECT d.id AS allocation_id, b.during, true AS atom FROM due d JOIN device_bookings b ON b.allocation_id = d.id
    UNION ALL
    SELECT d.id, h.during, true FROM due d JOIN device_booking_history h ON h.allocation_id = d.id
    UNION ALL
    SELECT d.id, d.held, false FROM due d WHERE d.gpu_count = 0 AND NOT isempty(d.held)),
  bounds AS (
    SELECT s.allocation_id, min(lower(s.during)) AS first, least(max(upper(s.during)), v_closed) AS last
      FROM spans s GROUP BY s.allocation_id),
  windows AS (
    SELECT b.allocation_id, ws AS window_start, ws + make_interval(secs => v_w) AS window_end
      FROM bounds b JOIN due d ON d.id = b.allocation_id,
           generate_series(to_timestamp(floor(extract(epoch FROM greatest(b.first, coalesce(d.since, b.first))) / v_w) * v_w),
                           b.last - interval '1 microsecond', make_interval(secs => v_w)) AS ws
     WHERE b.first < b.last AND ws + make_interval(secs => v_w) <= v_closed),
  used AS (
    SELECT w.allocation_id, w.window_start, w.window_end,
           coalesce(sum(extract(epoch FROM upper(s.during * tstzrange(w.window_start, w.window_end))
                                         - lower(s.during * tstzrange(w.window_start, w.window_end)))) FILTER (WHERE s.atom), 0) AS atom_s,
           -- its scalars were held whenever any of its spans was: the union of its spans in the
           -- window (an extended reservation has two segments per atom, one after the other)
           capacity_usage_seconds(range_agg(s.during) * tstzmultirange(tstzrange(w.window_start, w.window_end))) AS held_s
      FROM windows w JOIN spans s ON s.allocation_id = w.allocation_id AND s.during && tstzrange(w.window_start, w.window_end)
     GROUP BY w.allocation_id, w.window_start, w.window_end),
  billed AS (
    SELECT u.allocation_id, u.window_start, count(*)::int AS n, sum(u.atom_seconds) AS atom_s, sum(u.vcpu_seconds) AS vcpu_s,
           sum(u.memory_mib_seconds) AS memory_s, sum(u.disk_gib_seconds) AS disk_s
      FROM usage_windows u JOIN due d ON d.id = u.allocation_id GROUP BY u.allocation_id, u.window_start),
  owed AS (
    SELECT d.*, x.window_start, x.window_end, coalesce(b.n, 0) AS adjustment,
           x.atom_s - coalesce(b.atom_s, 0) AS atom_s, d.vcpu * x.held_s - coalesce(b.vcpu_s, 0) AS vcpu_s,
           d.memory_mib * x.held_s - coalesce(b.memory_s, 0) AS memory_s, d.disk_gib * x.held_s - coalesce(b.disk_s, 0) AS disk_s
      FROM used x JOIN due d ON d.id = x.allocation_id
      LEFT JOIN billed b ON b.allocation_id = x.allocation_id AND b.window_start = x.window_start),
  written AS (
    INSERT INTO usage_windows (id, allocation_id, tenant_id, pool_id, node_id, window_start, window_end, adjustment, gpu_kind,
                               gpu_model, mig_profile, atom_seconds, vcpu_seconds, memory_mib_seconds, disk_gib_seconds)
    SELECT 'cmp:' || o.id || ':' || to_char(o.window_start AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
             || CASE WHEN o.adjustment > 0 THEN ':' || o.adjustment ELSE '' END,
           o.id, o.tenant_id, o.pool_id, o.node_id, o.window_start, o.window_end, o.adjustment, o.gpu_kind, o.gpu_model,
           o.mig_profile, o.atom_s, o.vcpu_s, o.memory_s, o.disk_s
      FROM owed o
     WHERE o.adjustment = 0 OR o.atom_s <> 0 OR o.vcpu_s <> 0 OR o.memory_s <> 0 OR o.disk_s <> 0
     ORDER BY o.id, o.window_start
    RETURNING *),
  -- (a data-modifying CTE runs to completion whether or not the query reads it)
  marked AS (
    UPDATE reservations r SET usage_closed_until = v_closed, usage_version = r.version FROM due d WHERE r.id = d.id RETURNING r.id)
  SELECT w.id, w.tenant_id,
         jsonb_build_object('key', w.id, 'reservationId', w.allocation_id, 'poolId', w.pool_id, 'nodeId', w.node_id,
                            'windowStart', to_char(w.window_start AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
                            'windowEnd', to_char(w.window_end AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
                            'adjustment', w.adjustment,
                            'gpu', jsonb_build_object('kind', w.gpu_kind, 'model', w.gpu_model, 'profile', w.mig_profile),
                            'atomSeconds', w.atom_seconds, 'vcpuSeconds', w.vcpu_seconds,
                            'memoryMibSeconds', w.memory_mib_seconds, 'diskGibSeconds', w.disk_gib_seconds)
    FROM written w
   ORDER BY w.id;
END $$;
