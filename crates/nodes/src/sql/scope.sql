-- The inventory's scopes, for IAM.

-- The scopes a site, pool or node lies in, for role bindings: fleet, then its site, pool and node.
-- IAM joins its projection with this, so it never reads the inventory's tables itself. Unknown ids
-- yield only the fleet scope (a fleet operator then gets NOT_FOUND from the method itself).
CREATE OR REPLACE FUNCTION inventory_scope_path(kind text, id text) RETURNS TABLE (scope_kind text, scope_id text)
LANGUAGE sql STABLE AS $$
  SELECT 'fleet', ''
  UNION ALL
  SELECT s.k, s.v FROM (
    SELECT n.id AS node_id, p.id AS pool_id, p.site_id FROM nodes n JOIN pools p ON p.id = n.pool_id
     WHERE inventory_scope_path.kind = 'node' AND n.id = inventory_scope_path.id
    UNION ALL
    SELECT NULL, p.id, p.site_id FROM pools p WHERE inventory_scope_path.kind = 'pool' AND p.id = inventory_scope_path.id
    UNION ALL
    SELECT NULL, NULL, s.id FROM sites s WHERE inventory_scope_path.kind = 'site' AND s.id = inventory_scope_path.id
  ) x, LATERAL (VALUES ('site', x.site_id), ('pool', x.pool_id), ('node', x.node_id)) s(k, v)
  WHERE s.v IS NOT NULL
$$;
