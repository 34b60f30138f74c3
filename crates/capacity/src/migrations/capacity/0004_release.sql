-- capacity_end as in 0003_reservations, with two changes found by the capacity bench.
--
-- 1. The reservation's row is ended by the first statement, which also takes its lock (the first in
--    the lock order, as before), instead of a SELECT … FOR UPDATE and a closing UPDATE: one statement
--    fewer. A reservation already ended matches nothing, and is then read and returned unchanged. A
--    concurrent release that commits first is waited for, and the row is then re-read and matches
--    nothing, so a reservation is ended once.
-- 2. "Has this atom anything booked from now on" reads the latest end of the atom's bookings,
--    max(upper(during)), through the btree below, one index entry. Through the exclusion
--    constraint's GiST, as the planner chose for NOT EXISTS (… upper(during) > now), it read every
--    booking the atom ever had: a millisecond per release at fifty past bookings of an atom, most of
--    a release's time.

-- One atom's bookings by end, for "is this atom booked in this range" (the placer) and "has it
-- anything booked from now on" (release, expiry, the idle counts), replacing 0003's
-- device_bookings_device_end. Its device_id is in the "C" collation, and so are the lookups that
-- should use it: the exclusion constraint's GiST indexes device_id in the default collation, so it
-- cannot serve them. The planner kept choosing it: btree_gist keeps a range of text keys per page,
-- the ranges overlap, and an equality reads most of the index (a millisecond per lookup once
-- bookings pile up), which its estimates do not show. Plans made from statistics of a nearly empty
-- table went the other way, reading every live booking of the table for each atom (2,200 buffers per
-- placement in the capacity bench). With one index to choose, and the lookups written as scalar
-- subqueries (run per atom, the atom's id in the index condition), neither can happen. Equality on text
-- is byte equality in every deterministic collation, so the answers are the same.
CREATE INDEX device_bookings_atom_end ON device_bookings (device_id COLLATE "C", upper(during));
DROP INDEX device_bookings_device_end;

-- capacity_refresh_node_counts as in 0001_capacity, its idle check (nothing booked from now on) read
-- from the latest end of the atom's bookings in the index above.
CREATE OR REPLACE FUNCTION capacity_refresh_node_counts(p_node text) RETURNS void LANGUAGE sql AS $$
  WITH fresh AS (
    SELECT a.node_id, n.pool_id, a.kind, a.model, coalesce(a.profile, '') AS profile, count(*)::int AS total,
           (count(*) FILTER (WHERE coalesce((SELECT max(upper(b.during)) FROM device_bookings b
                                              WHERE b.device_id COLLATE "C" = a.id), '-infinity') <= compute_now()))::int AS idle
      FROM devices a
      JOIN devices g ON g.id = coalesce(a.parent_id, a.id)
      JOIN nodes n ON n.id = a.node_id
     WHERE a.node_id = p_node AND a.bookable AND g.healthy AND NOT g.quarantined
     GROUP BY a.node_id, n.pool_id, a.kind, a.model, coalesce(a.profile, '')),
  up AS (
    INSERT INTO node_atom_counts (node_id, pool_id, kind, model, profile, total, idle)
    SELECT * FROM fresh
    ON CONFLICT (node_id, kind, model, profile)
      DO UPDATE SET pool_id = EXCLUDED.pool_id, total = EXCLUDED.total, idle = EXCLUDED.idle)
  UPDATE node_atom_counts c SET total = 0, idle = 0
   WHERE c.node_id = p_node AND c.total > 0
     AND NOT EXISTS (SELECT 1 FROM fresh f WHERE f.kind = c.kind AND f.model = c.model AND f.profile = c.profile);
$$;

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
         WHERE coalesce((SELECT max(upper(o.during)) FROM device_bookings o WHERE o.device_id COLLATE "C" = a.device_id),
                        '-infinity') <= compute_now()))
     WHERE c.node_id = r.node_id AND c.kind = r.gpu_kind AND c.model = r.gpu_model AND c.profile = coalesce(r.mig_profile, '');
  END IF;
  RETURN capacity_after_change(r, 'reservation.' || p_to, p_event_id, p_shard);
END $$;
