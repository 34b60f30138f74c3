-- Ending a reservation (release, expiry, failure): one statement that ends its row, refunds its
-- quota, gives back its node's scalars, and moves its bookings to device_booking_history (what it
-- held up to now, cut there; what it had booked from now on is deleted).

-- Ends one reservation. Its row is ended by the first statement, which also takes its lock (the
-- first of the lock order); a reservation already ended matches nothing and is returned unchanged,
-- so a concurrent release that commits first makes this one a no-op. It takes the node's
-- node_resources row before it moves its bookings, as the placer does: the other way round, a
-- placement holding that row and booking a released atom over an overlapping range would wait for
-- the release's uncommitted delete while the release waits for the row.
--
-- "Has this atom anything booked from now on" reads the latest end of the atom's bookings through
-- device_bookings_atom_end, one index entry; index-only scans are off so that the exclusion
-- constraint's GiST, which would read every live booking of the table, is never chosen.
CREATE OR REPLACE FUNCTION capacity_end(p_id text, p_tenant text, p_to text, p_event_id text, p_shard int2) RETURNS jsonb
LANGUAGE plpgsql SET enable_seqscan = off SET enable_indexonlyscan = off AS $$
DECLARE
  r reservations;
  v_refunded int;
  v_atoms text[];
BEGIN
  -- The reservation's row first, before quota and the rest of the lock order. The state guard
  -- (reservations_state_guard) checks the transition.
  UPDATE reservations SET state = p_to, version = version + 1, updated_at = compute_now(), unschedulable = NULL,
                          next_attempt_at = NULL
   WHERE id = p_id AND (p_tenant IS NULL OR tenant_id = p_tenant) AND state NOT IN ('released', 'expired', 'failed')
  RETURNING * INTO r;
  IF NOT FOUND THEN
    SELECT * INTO r FROM reservations WHERE id = p_id AND (p_tenant IS NULL OR tenant_id = p_tenant);
    IF NOT FOUND THEN
      RAISE EXCEPTION USING ERRCODE = 'BCNFD', MESSAGE = format('reservation %s not found', p_id);
    END IF;
    RETURN capacity_view(r);
  END IF;
  v_refunded := capacity_refund(r.tenant_id, r.gpu_kind, r.gpu_count, r.vcpu, r.memory_mib, r.disk_gib);
  -- Placed or active, it held scalars and idle-atom counts on its node; pending, it has no node.
  -- The node's scalars before the bookings, in the placer's order (node_resources, then
  -- device_bookings, then node_atom_counts): the other way round deadlocked with a placement
  -- booking over our bookings while holding this row (capacity bench).
  IF r.node_id IS NOT NULL THEN
    UPDATE node_resources
       SET vcpu_allocated = vcpu_allocated - r.vcpu, memory_mib_allocated = memory_mib_allocated - r.memory_mib,
           disk_gib_allocated = disk_gib_allocated - r.disk_gib,
           -- allocatable held up above usable by bookings (the node lost hardware) comes down
           vcpu_allocatable = greatest(vcpu_usable, capacity_allocatable_floor(vcpu_allocated - r.vcpu, vcpu_ratio)),
           memory_mib_allocatable = greatest(memory_mib_usable, capacity_allocatable_floor(memory_mib_allocated - r.memory_mib, memory_ratio)),
           disk_gib_allocatable = greatest(disk_gib_usable, capacity_allocatable_floor(disk_gib_allocated - r.disk_gib, disk_ratio))
     WHERE node_id = r.node_id;
  END IF;
  -- Every booking leaves the live table; what was held before now is kept in the history, cut at
  -- now. The history takes no locks anyone waits for, so it sits anywhere in the lock order.
  WITH gone AS (DELETE FROM device_bookings WHERE allocation_id = p_id RETURNING device_id, during),
       held AS (INSERT INTO device_booking_history (device_id, allocation_id, during)
                SELECT g.device_id, p_id, tstzrange(lower(g.during), least(upper(g.during), compute_now()), '[)')
                  FROM gone g WHERE lower(g.during) < compute_now())
  SELECT array_agg(DISTINCT g.device_id) INTO v_atoms FROM gone g;
  -- Its atoms that now have nothing booked from now on are idle again (those of a reservation
  -- that had not started too: its bookings were all ahead).
  IF r.node_id IS NOT NULL AND v_atoms IS NOT NULL THEN
    UPDATE node_atom_counts c SET idle = LEAST(c.total, c.idle + (
        SELECT count(*) FROM unnest(v_atoms) a(device_id)
         WHERE coalesce((SELECT max(upper(o.during)) FROM device_bookings o WHERE o.device_id COLLATE "C" = a.device_id),
                        '-infinity') <= compute_now()))
     WHERE c.node_id = r.node_id AND c.kind = r.gpu_kind AND c.model = r.gpu_model AND c.profile = coalesce(r.mig_profile, '');
  END IF;
  RETURN capacity_after_change(r, 'reservation.' || p_to, p_event_id, p_shard);
END $$;
