-- RFC 3339 in UTC, as every time leaves the database (better_compute_db::clock::rfc3339_sql).
CREATE OR REPLACE FUNCTION nodes_ts(t timestamptz) RETURNS text
LANGUAGE sql STABLE AS $$ SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') $$;

-- A node's conditions (conditions.rs): each that holds, with a stable reason, a message and since
-- when the rows know it, computed in one place from the rows that own them: liveness and
-- generations (nodes), the open drain (node_drains), the GPUs' health and quarantine (devices), the
-- findings, the pool's health circuit and the site's boot.
CREATE OR REPLACE FUNCTION nodes_conditions(n nodes) RETURNS jsonb
LANGUAGE sql STABLE AS $$
  SELECT coalesce(jsonb_agg(c ORDER BY o), '[]'::jsonb) FROM (
    SELECT 1 AS o, jsonb_build_object('type', 'Ready', 'reason', 'Converged', 'since', nodes_ts(greatest(n.liveness_since, n.convergence_since)),
             'message', format('connected and running generation %s', n.observed_generation)) AS c
     WHERE n.liveness = 'connected' AND n.generation >= 1 AND n.observed_generation >= n.generation
    UNION ALL
    SELECT 2, jsonb_build_object('type', 'Converging', 'reason', 'Applying', 'since', nodes_ts(n.convergence_since),
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
    SELECT 6, jsonb_build_object('type', 'HealthCircuitOpen', 'reason', 'CircuitOpen', 'since', nodes_ts(p.open_since),
             'message', 'too many of the pool''s GPUs left placement for health at once: automatic health actions wait for an operator (pools.closeHealthCircuit)')
      FROM pool_health_circuits p WHERE p.pool_id = n.pool_id AND p.open_since IS NOT NULL
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
    SELECT 7, jsonb_build_object('type', 'CertificateExpiring', 'reason', 'RotationFailing', 'since', NULL,
             'message', format('the daemon''s certificate %s ends at %s and has not been rotated (is the daemon running and connected?)',
                               c.serial, nodes_ts(c.not_after)))
      FROM (SELECT x.serial, x.not_after FROM node_certificates x WHERE x.node_id = n.id AND x.revoked_at IS NULL
             ORDER BY x.created_at DESC LIMIT 1) c
     WHERE n.retired_at IS NULL AND c.not_after < compute_now() + interval '7 days'
    UNION ALL
    SELECT 8, jsonb_build_object('type', 'Retired', 'reason', 'Retired', 'since', nodes_ts(n.retired_at),
             'message', 'out of placement for ever; its history is kept')
     WHERE n.retired_at IS NOT NULL
  ) x
$$;

-- Since when a node has been converged or converging: moved only when it flips, so the trigger's
-- function runs on those updates alone, not on every generation the nodespec writer bumps.
CREATE OR REPLACE FUNCTION nodes_convergence_flipped() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  NEW.convergence_since := compute_now();
  RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER nodes_convergence_since BEFORE UPDATE OF generation, observed_generation ON nodes
  FOR EACH ROW WHEN ((OLD.observed_generation >= OLD.generation) IS DISTINCT FROM (NEW.observed_generation >= NEW.generation))
  EXECUTE FUNCTION nodes_convergence_flipped();

-- A node's conditions as the API shows them: each condition's since from its rows, else from the
-- node job's record of when it began to hold with that reason.
CREATE OR REPLACE FUNCTION nodes_conditions_seen(n nodes) RETURNS jsonb
LANGUAGE sql STABLE AS $$
  SELECT coalesce(jsonb_agg(CASE WHEN x.c->>'since' IS NULL AND o.since IS NOT NULL
                                 THEN x.c || jsonb_build_object('since', nodes_ts(o.since)) ELSE x.c END ORDER BY x.i), '[]'::jsonb)
    FROM jsonb_array_elements(nodes_conditions(n)) WITH ORDINALITY x(c, i)
    LEFT JOIN node_conditions o ON o.node_id = n.id AND o.type = x.c->>'type' AND o.reason = x.c->>'reason'
$$;

-- The node job's pass over some nodes (conditions.rs): records each condition that holds now,
-- since when (its rows' since where they know it; else, for a new type or reason, now), forgets
-- those that no longer hold, and returns each that began, changed its reason, or ended.
CREATE OR REPLACE FUNCTION nodes_conditions_record(p_nodes text[])
RETURNS TABLE (node_id text, type text, reason text, message text, change text)
LANGUAGE sql VOLATILE AS $$
  WITH now_ AS (
    SELECT n.id AS node_id, x.c->>'type' AS type, x.c->>'reason' AS reason, x.c->>'message' AS message,
           (x.c->>'since')::timestamptz AS since
      FROM nodes n, jsonb_array_elements(nodes_conditions(n)) x(c)
     WHERE n.id = ANY(p_nodes)),
  gone AS (
    DELETE FROM node_conditions o
     WHERE o.node_id = ANY(p_nodes)
       AND NOT EXISTS (SELECT 1 FROM now_ WHERE now_.node_id = o.node_id AND now_.type = o.type)
    RETURNING o.node_id, o.type, o.reason, o.message, 'ended'::text AS change),
  want AS (
    SELECT now_.node_id, now_.type, now_.reason, now_.message,
           CASE WHEN now_.since IS NOT NULL THEN now_.since WHEN cur.reason = now_.reason THEN cur.since ELSE compute_now() END AS since,
           cur.reason AS old_reason, cur.message AS old_message, cur.since AS old_since
      FROM now_ LEFT JOIN node_conditions cur ON cur.node_id = now_.node_id AND cur.type = now_.type),
  kept AS (
    INSERT INTO node_conditions AS o (node_id, type, reason, message, since)
    SELECT node_id, type, reason, message, since FROM want
     WHERE (old_reason, old_message, old_since) IS DISTINCT FROM (reason, message, since) ORDER BY node_id, type
    ON CONFLICT (node_id, type) DO UPDATE SET reason = EXCLUDED.reason, message = EXCLUDED.message, since = EXCLUDED.since)
  -- (kept runs to completion unread, as every data-modifying WITH does)
  SELECT node_id, type, reason, message, change FROM gone
  UNION ALL
  SELECT node_id, type, reason, message, CASE WHEN old_reason IS NULL THEN 'began' ELSE 'changed' END
    FROM want WHERE old_reason IS DISTINCT FROM reason
$$;
