-- RFC 3339 in UTC, as every time leaves the database (better_compute_db::clock::rfc3339_sql).
CREATE OR REPLACE FUNCTION nodes_ts(t timestamptz) RETURNS text
LANGUAGE sql STABLE AS $$ SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') $$;

-- A node's conditions (conditions.rs): each that holds, with a stable reason, a message and since
-- when, computed in one place from the rows that own them: liveness and generations (nodes), the
-- open drain (node_drains), the GPUs' health and quarantine (devices).
CREATE OR REPLACE FUNCTION nodes_conditions(n nodes) RETURNS jsonb
LANGUAGE sql STABLE AS $$
  SELECT coalesce(jsonb_agg(c ORDER BY o), '[]'::jsonb) FROM (
    SELECT 1 AS o, jsonb_build_object('type', 'Ready', 'reason', 'Converged', 'since', nodes_ts(n.liveness_since),
             'message', format('connected and running generation %s', n.observed_generation)) AS c
     WHERE n.liveness = 'connected' AND n.generation >= 1 AND n.observed_generation >= n.generation
    UNION ALL
    SELECT 2, jsonb_build_object('type', 'Converging', 'reason', 'Applying', 'since', NULL,
             'message', format('the daemon has applied generation %s of %s', n.observed_generation, n.generation))
     WHERE n.observed_generation < n.generation
    UNION ALL
    SELECT 3, jsonb_build_object('type', initcap(n.liveness),
             'reason', CASE n.liveness WHEN 'disconnected' THEN 'SessionClosed' WHEN 'unreachable' THEN 'NodeUnreachable' ELSE 'NodeLost' END,
             'since', nodes_ts(n.liveness_since),
             'message', CASE n.liveness WHEN 'disconnected' THEN 'no daemon session; nothing is released while it is away'
                                        WHEN 'unreachable' THEN 'no daemon session for longer than its grace: nothing new is placed here; nothing is released'
                                        ELSE 'unreachable past the pool''s lostAfter' END)
     WHERE n.liveness <> 'connected'
    UNION ALL
    SELECT 4, jsonb_build_object('type', 'Cordoned', 'reason', 'Cordoned', 'since', NULL, 'message', 'an operator cordoned the node')
     WHERE 'cordoned' = ANY(n.no_schedule_reasons)
    UNION ALL
    SELECT 5, jsonb_build_object('type', 'Draining', 'reason', d.condition_reason, 'since', nodes_ts(d.condition_since),
             'message', format('%s drain (%s), %s: %s', d.mode, d.reason, d.state, d.condition_message))
      FROM node_drains d WHERE d.node_id = n.id AND d.state IN ('queued', 'draining', 'drained')
    UNION ALL
    SELECT 6, jsonb_build_object('type', 'Unhealthy', 'reason', 'UnhealthyGpus', 'since', nodes_ts(min(g.health_since)),
             'message', format('%s GPU(s) out of placement for health: %s', count(*),
                               string_agg(g.id || ' (' || g.health_state || ': ' || coalesce(g.health_reason, '') || ')', ', ' ORDER BY g.index)))
      FROM devices g WHERE g.node_id = n.id AND g.parent_id IS NULL AND NOT g.healthy HAVING count(*) > 0
    UNION ALL
    SELECT 6, jsonb_build_object('type', 'HealthCircuitOpen', 'reason', 'CircuitOpen', 'since', nodes_ts(p.health_circuit_open_since),
             'message', 'too many of the pool''s GPUs left placement for health at once: automatic health actions wait for an operator (pools.closeHealthCircuit)')
      FROM pools p WHERE p.id = n.pool_id AND p.health_circuit_open_since IS NOT NULL
    UNION ALL
    SELECT 7, jsonb_build_object('type', 'QuarantinedGpus', 'reason', 'Quarantined', 'since', NULL,
             'message', format('%s GPU(s) quarantined: %s', count(*), string_agg(g.id || ' (' || coalesce(g.quarantine_reason, '') || ')', ', ' ORDER BY g.index)))
      FROM devices g WHERE g.node_id = n.id AND g.parent_id IS NULL AND g.quarantined HAVING count(*) > 0
    UNION ALL
    SELECT 7, jsonb_build_object('type', 'InventoryFindings', 'reason', 'Findings', 'since', nodes_ts(min(f.first_seen_at)),
             'message', format('%s open finding(s): %s (inventory.findings)', count(*), string_agg(DISTINCT f.kind, ', ')))
      FROM inventory_findings f WHERE f.node_id = n.id AND f.resolved_at IS NULL HAVING count(*) > 0
    UNION ALL
    SELECT 7, jsonb_build_object('type', 'SiteBooting', 'reason', 'SiteBoot', 'since', nodes_ts(s.boot_since),
             'message', format('site %s is booting: sessions are admitted %s a second and placement waits until %s%% of its nodes converged',
                               s.name, s.boot_admit_per_s, s.boot_converged_percent))
      FROM pools p JOIN sites s ON s.id = p.site_id WHERE p.id = n.pool_id AND s.boot_state = 'booting'
    UNION ALL
    SELECT 8, jsonb_build_object('type', 'Retired', 'reason', 'Retired', 'since', nodes_ts(n.retired_at),
             'message', 'out of placement for ever; its history is kept')
     WHERE n.retired_at IS NOT NULL
  ) x
$$;
