-- A node's vCPU, memory and disk ledger (node_resources) is capacity's: nodes owns the hardware
-- (nodes.vcpu, memory_mib, disk_gib) and the pool's overcommit ratios; the row capacity books
-- against is made in the registering transaction, so a node never exists without it.

CREATE OR REPLACE FUNCTION capacity_node_registered() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO node_resources (node_id, vcpu_allocatable, vcpu_usable, vcpu_ratio, memory_mib_allocatable, memory_mib_usable,
                              memory_ratio, disk_gib_allocatable, disk_gib_usable, disk_ratio)
  SELECT NEW.id, NEW.vcpu, NEW.vcpu, p.vcpu_ratio, NEW.memory_mib, NEW.memory_mib, p.memory_ratio, NEW.disk_gib, NEW.disk_gib, p.disk_ratio
    FROM pools p WHERE p.id = NEW.pool_id;
  RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER nodes_resources AFTER INSERT ON nodes
  FOR EACH ROW EXECUTE FUNCTION capacity_node_registered();

-- The least allocatable that still holds `allocated` at `ratio` (the CHECK's floor(allocatable *
-- ratio) >= allocated), safe against float rounding.
-- (numeric, so that sums and bigints alike fit it)
CREATE OR REPLACE FUNCTION capacity_allocatable_floor(allocated numeric, ratio float8) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN floor(ceil(allocated::float8 / ratio) * ratio) >= allocated THEN ceil(allocated::float8 / ratio)
              ELSE ceil(allocated::float8 / ratio) + 1 END::bigint
$$;

-- A reported amount as the node's usable one: the registration is the ceiling (a joined node's is
-- what it reported when it joined), a report below it lowers it, and a report of nothing (0, or
-- absent: a daemon that could not read it) or nonsense leaves the registration.
CREATE OR REPLACE FUNCTION capacity_usable(registered bigint, reported jsonb) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN jsonb_typeof(reported) = 'number' AND reported::numeric >= 1
              THEN least(registered::numeric, floor(reported::numeric))::bigint ELSE registered END
$$;

-- The node's usable resources follow its registration and its daemon's reports; its allocatable
-- ones follow them, but never below what its reservations hold. Locks the node's row in
-- node_resources after the nodes row the report updated (architecture.md, the lock order).
CREATE OR REPLACE FUNCTION capacity_node_inventory_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  UPDATE node_resources r
     SET vcpu_usable = u.vcpu, memory_mib_usable = u.memory_mib, disk_gib_usable = u.disk_gib,
         vcpu_allocatable = greatest(u.vcpu, capacity_allocatable_floor(r.vcpu_allocated, r.vcpu_ratio)),
         memory_mib_allocatable = greatest(u.memory_mib, capacity_allocatable_floor(r.memory_mib_allocated, r.memory_ratio)),
         disk_gib_allocatable = greatest(u.disk_gib, capacity_allocatable_floor(r.disk_gib_allocated, r.disk_ratio))
    FROM (SELECT capacity_usable(NEW.vcpu, NEW.reported_inventory->'vcpu') AS vcpu,
                 capacity_usable(NEW.memory_mib, NEW.reported_inventory->'memoryMib') AS memory_mib,
                 capacity_usable(NEW.disk_gib, NEW.reported_inventory->'diskGib') AS disk_gib) u
   WHERE r.node_id = NEW.id AND (r.vcpu_usable, r.memory_mib_usable, r.disk_gib_usable) IS DISTINCT FROM (u.vcpu, u.memory_mib, u.disk_gib);
  RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER nodes_usable_resources AFTER UPDATE OF reported_inventory, vcpu, memory_mib, disk_gib ON nodes
  FOR EACH ROW WHEN (OLD.reported_inventory->'vcpu' IS DISTINCT FROM NEW.reported_inventory->'vcpu'
                  OR OLD.reported_inventory->'memoryMib' IS DISTINCT FROM NEW.reported_inventory->'memoryMib'
                  OR OLD.reported_inventory->'diskGib' IS DISTINCT FROM NEW.reported_inventory->'diskGib'
                  OR (OLD.vcpu, OLD.memory_mib, OLD.disk_gib) IS DISTINCT FROM (NEW.vcpu, NEW.memory_mib, NEW.disk_gib))
  EXECUTE FUNCTION capacity_node_inventory_changed();
