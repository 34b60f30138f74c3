-- The inventory's findings (inventory/findings.rs): what is wrong now in a pool, or on one node of it (p_node
-- not NULL: only the kinds a daemon's inventory report can change). Read-only; the jobs open and
-- resolve findings from its answer.
CREATE OR REPLACE FUNCTION nodes_inventory_findings(p_pool text, p_node text)
RETURNS TABLE (kind text, node_id text, item text, message text)
LANGUAGE sql STABLE AS $$
  WITH n AS (SELECT * FROM nodes WHERE pool_id = p_pool AND retired_at IS NULL AND (p_node IS NULL OR id = p_node)),
       reported AS (SELECT n.id AS node_id, g->>'uuid' AS uuid, g->>'model' AS model
                      FROM n, jsonb_array_elements(coalesce(n.reported_inventory->'gpus', '[]')) g
                     WHERE n.reported_inventory IS NOT NULL)
  -- A registered GPU the daemon no longer reports: flagged, never deleted.
  SELECT 'gpu-missing', d.node_id, d.id, format('GPU %s (index %s, %s) is registered but the daemon no longer reports it', d.id, d.index, d.model)
    FROM devices d JOIN n ON n.id = d.node_id
   WHERE d.parent_id IS NULL AND n.reported_inventory IS NOT NULL
     AND NOT EXISTS (SELECT 1 FROM reported r WHERE r.node_id = d.node_id AND r.uuid = d.id)
  UNION ALL
  -- A GPU the daemon reports that is not registered on its node.
  SELECT 'gpu-unknown', r.node_id, r.uuid, format('the daemon reports GPU %s (%s), which is not registered on this node', r.uuid, r.model)
    FROM reported r WHERE NOT EXISTS (SELECT 1 FROM devices d WHERE d.node_id = r.node_id AND d.id = r.uuid AND d.parent_id IS NULL)
  UNION ALL
  -- A registered GPU reported as another model.
  SELECT 'gpu-changed', r.node_id, r.uuid, format('GPU %s is registered as %s but reports %s', r.uuid, d.model, r.model)
    FROM reported r JOIN devices d ON d.node_id = r.node_id AND d.id = r.uuid AND d.parent_id IS NULL
   WHERE r.model IS NOT NULL AND r.model <> d.model AND position(d.model IN r.model) = 0
  UNION ALL
  -- CPU, memory or disk reported below what the node was registered with.
  SELECT 'resources-changed', n.id, '', format('registered with %s vCPU, %s MiB, %s GiB; the daemon reports %s vCPU, %s MiB, %s GiB (placement uses what it reports, and keeps what reservations hold)',
                                                 n.vcpu, n.memory_mib, n.disk_gib, n.reported_inventory->>'vcpu',
                                                 n.reported_inventory->>'memoryMib', n.reported_inventory->>'diskGib')
    FROM n
   WHERE n.reported_inventory ? 'vcpu'
     AND ((n.reported_inventory->>'vcpu')::bigint < n.vcpu OR coalesce((n.reported_inventory->>'memoryMib')::bigint, n.memory_mib) < n.memory_mib
          OR coalesce((n.reported_inventory->>'diskGib')::bigint, n.disk_gib) < n.disk_gib)
  UNION ALL
  -- One GPU uuid reported by two nodes.
  SELECT 'duplicate-gpu', r.node_id, r.uuid, format('GPU %s is also reported by node %s', r.uuid, o.node_id)
    FROM reported r JOIN LATERAL (SELECT x.id AS node_id FROM nodes x, jsonb_array_elements(coalesce(x.reported_inventory->'gpus', '[]')) g
                                   WHERE x.id <> r.node_id AND x.retired_at IS NULL AND g->>'uuid' = r.uuid LIMIT 1) o ON true
   WHERE p_node IS NULL
  UNION ALL
  -- Join tokens of the pool past their expiry, never used.
  SELECT 'join-token-expired', NULL, t.id, format('join token %s expired at %s unused; it can be deleted', t.id, nodes_ts(t.expires_at))
    FROM join_tokens t WHERE p_node IS NULL AND t.pool_id = p_pool AND t.used_at IS NULL AND t.expires_at < compute_now()
  UNION ALL
  -- A node whose newest certificate ends within 7 days: its daemon's rotation is failing.
  SELECT 'certificate-expiring', c.node_id, c.serial, format('the certificate %s ends at %s and has not been rotated', c.serial, nodes_ts(c.not_after))
    FROM n JOIN LATERAL (SELECT * FROM node_certificates x WHERE x.node_id = n.id AND x.revoked_at IS NULL
                          ORDER BY x.created_at DESC LIMIT 1) c ON true
   WHERE p_node IS NULL AND c.not_after < compute_now() + interval '7 days'
  UNION ALL
  -- Joined more than 10 minutes ago and never converged.
  SELECT 'never-converged', n.id, '', format('joined at %s and has never applied its desired state (generation %s, applied %s)',
                                             nodes_ts(n.joined_at), n.generation, n.observed_generation)
    FROM n WHERE p_node IS NULL AND n.joined_at < compute_now() - interval '10 minutes' AND n.observed_generation = 0
$$;
