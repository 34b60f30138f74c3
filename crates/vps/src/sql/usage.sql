-- Instance usage (the `vps.usage` job, one key per pool): closes each instance's usage windows from
-- the stretches its VM was up (`instance_runs`). A closed window never changes afterwards: a run
-- only ever ends at the moment it is closed, which is past every closed window, so no adjustments.

-- Meters up to p_limit instances of p_pool that were up in time not metered yet: writes a row for
-- each closed window they were up in, and marks them metered to the last closed window's end.
-- Returns the rows written with their events' data. Instances another transaction holds are left
-- to the next run (SKIP LOCKED).
CREATE OR REPLACE FUNCTION vps_usage_close(p_pool text, p_limit int)
RETURNS TABLE (id text, tenant_id text, data jsonb)
LANGUAGE plpgsql AS $$
DECLARE
  v_w float8;
  v_closed timestamptz;
BEGIN
  v_w := capacity_usage_window_s();
  v_closed := capacity_usage_closed_until();
  RETURN QUERY
  WITH due AS (
    SELECT i.id, i.tenant_id, i.pool_id, i.node_id, i.flavour, coalesce(i.usage_closed_until, '-infinity') AS since
      FROM instances i
     WHERE i.pool_id = p_pool
       AND EXISTS (SELECT 1 FROM instance_runs r WHERE r.instance_id = i.id
                    AND r.during && tstzrange(coalesce(i.usage_closed_until, '-infinity'), v_closed))
     ORDER BY i.id LIMIT p_limit
       FOR UPDATE OF i SKIP LOCKED),
  windows AS (
    SELECT d.id AS instance_id, ws AS window_start, ws + make_interval(secs => v_w) AS window_end
      FROM due d,
           generate_series(to_timestamp(floor(extract(epoch FROM greatest(
                             (SELECT min(lower(r.during)) FROM instance_runs r WHERE r.instance_id = d.id), d.since)) / v_w) * v_w),
                           v_closed - make_interval(secs => v_w), make_interval(secs => v_w)) AS ws),
  used AS (
    SELECT w.instance_id, w.window_start, w.window_end,
           sum(extract(epoch FROM upper(r.during * tstzrange(w.window_start, w.window_end)) - lower(r.during * tstzrange(w.window_start, w.window_end)))) AS up_s
      FROM windows w JOIN instance_runs r ON r.instance_id = w.instance_id AND r.during && tstzrange(w.window_start, w.window_end)
     GROUP BY w.instance_id, w.window_start, w.window_end),
  written AS (
    INSERT INTO instance_usage_windows (id, instance_id, tenant_id, pool_id, node_id, flavour, window_start, window_end, instance_seconds)
    SELECT 'cmp:' || u.instance_id || ':' || to_char(u.window_start AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
           u.instance_id, d.tenant_id, d.pool_id, d.node_id, d.flavour, u.window_start, u.window_end, u.up_s
      FROM used u JOIN due d ON d.id = u.instance_id
     WHERE u.up_s > 0 AND u.window_start >= d.since
     ORDER BY u.instance_id, u.window_start
    RETURNING *),
  -- (a data-modifying CTE runs to completion whether or not the query reads it)
  marked AS (
    UPDATE instances i SET usage_closed_until = v_closed FROM due d WHERE i.id = d.id RETURNING i.id)
  SELECT w.id, w.tenant_id,
         jsonb_build_object('key', w.id, 'instanceId', w.instance_id, 'poolId', w.pool_id, 'nodeId', w.node_id, 'flavour', w.flavour,
                            'windowStart', to_char(w.window_start AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
                            'windowEnd', to_char(w.window_end AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
                            'instanceSeconds', w.instance_seconds)
    FROM written w
   ORDER BY w.id;
END $$;
