-- A node's vCPU, memory and disk ledger (node_resources) is capacity's: nodes owns the hardware
-- (nodes.vcpu, memory_mib, disk_gib) and the pool's overcommit ratios; the row capacity books
-- against is made in the registering transaction, so a node never exists without it.

CREATE OR REPLACE FUNCTION capacity_node_registered() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO node_resources (node_id, vcpu_allocatable, vcpu_ratio, memory_mib_allocatable, memory_ratio,
                              disk_gib_allocatable, disk_ratio)
  SELECT NEW.id, NEW.vcpu, p.vcpu_ratio, NEW.memory_mib, p.memory_ratio, NEW.disk_gib, p.disk_ratio
    FROM pools p WHERE p.id = NEW.pool_id;
  RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER nodes_resources AFTER INSERT ON nodes
  FOR EACH ROW EXECUTE FUNCTION capacity_node_registered();
