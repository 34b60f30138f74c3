-- What of a node's vCPU, memory and disk may be allocated now: its registration, or less where its
-- daemon reports less. Allocatable follows it, but never below what reservations hold (a node
-- that lost hardware keeps its bookings; nothing new fits until they end).
ALTER TABLE node_resources
  ADD COLUMN vcpu_usable integer,
  ADD COLUMN memory_mib_usable bigint,
  ADD COLUMN disk_gib_usable bigint;
UPDATE node_resources SET vcpu_usable = vcpu_allocatable, memory_mib_usable = memory_mib_allocatable, disk_gib_usable = disk_gib_allocatable;
ALTER TABLE node_resources
  ALTER COLUMN vcpu_usable SET NOT NULL,
  ALTER COLUMN memory_mib_usable SET NOT NULL,
  ALTER COLUMN disk_gib_usable SET NOT NULL,
  ADD CONSTRAINT node_resources_usable CHECK (vcpu_usable >= 0 AND memory_mib_usable >= 0 AND disk_gib_usable >= 0
    AND vcpu_allocatable >= vcpu_usable AND memory_mib_allocatable >= memory_mib_usable AND disk_gib_allocatable >= disk_gib_usable);
