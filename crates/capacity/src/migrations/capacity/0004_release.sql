-- capacity_end as in 0003_reservations, with two changes found by the capacity bench.
--
-- 1. The reservation's row is ended by the first statement, which also takes its lock (the first in
--    the lock order, as before), instead of a SELECT … FOR UPDATE and a closing UPDATE: one statement
--    fewer. A reservation already ended matches nothing, and is then read and returned unchanged. A
--    concurrent release that commits first is waited for, and the row is then re-read and matches
--    nothing, so a reservation is ended once.
-- 2. "Has this atom anything booked from now on" reads the latest end of the atom's bookings,
--    max(upper(during)), which only the btree on (device_id, upper(during)) can answer in order, one
--    index entry. Written as NOT EXISTS (… upper(during) > now), the planner could pick the exclusion
--    constraint's GiST instead and read every booking the atom ever had: a millisecond per release
--    at fifty past bookings of an atom, most of a release's time.
CREATE OR REPLACE FUNCTION capacity_end(p_id text, p_tenant text, p_to text, p_event_id text, p_shard int2) RETURNS jsonb
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
  r reservations;
  v_refunded int;
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
  -- Placed or active, it held scalars and idle-atom counts on its node; pending, it has no node
  -- (nothing sets a node on a pending reservation, and nothing moves one back to pending).
  -- The node's scalars before the bookings, in the placer's order (node_resources, then
  -- device_bookings, then node_atom_counts). The other way round, a placement holding this node's
  -- row and inserting a booking that overlaps ours would wait for our uncommitted cut while we wait
  -- for its row: the capacity bench met that deadlock.
  IF r.node_id IS NOT NULL THEN
    UPDATE node_resources
       SET vcpu_allocated = vcpu_allocated - r.vcpu, memory_mib_allocated = memory_mib_allocated - r.memory_mib,
           disk_gib_allocated = disk_gib_allocated - r.disk_gib
     WHERE node_id = r.node_id;
  END IF;
  -- The two touch disjoint rows: those starting from now on, and those started before and not yet
  -- ended (bookings are '[)' ranges). Bounds, not `during @> compute_now()`: that one matches the
  -- exclusion index, and the planner ANDed a scan of every current booking with this allocation's.
  WITH future AS (DELETE FROM device_bookings WHERE allocation_id = p_id AND lower(during) >= compute_now())
  UPDATE device_bookings SET during = tstzrange(lower(during), compute_now(), '[)')
   WHERE allocation_id = p_id AND lower(during) < compute_now() AND upper(during) > compute_now();
  -- The atoms that now have nothing booked from now on are idle again.
  IF r.node_id IS NOT NULL THEN
    UPDATE node_atom_counts c SET idle = LEAST(c.total, c.idle + (
        SELECT count(*) FROM (SELECT DISTINCT b.device_id FROM device_bookings b WHERE b.allocation_id = p_id) a
         WHERE coalesce((SELECT max(upper(o.during)) FROM device_bookings o WHERE o.device_id = a.device_id),
                        '-infinity') <= compute_now()))
     WHERE c.node_id = r.node_id AND c.kind = r.gpu_kind AND c.model = r.gpu_model AND c.profile = coalesce(r.mig_profile, '');
  END IF;
  RETURN capacity_after_change(r, 'reservation.' || p_to, p_event_id, p_shard);
END $$;
