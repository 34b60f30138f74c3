-- Ended bookings leave device_bookings for device_booking_history.
--
-- The exclusion constraint guards live bookings: every booking is inserted starting at or after
-- compute_now(), so one that has ended can never conflict again. Kept in device_bookings, every
-- reservation ever made stayed in the constraint's GiST and the bookings' btrees, which every
-- placement's insert and lookups walk: with 500,000 past bookings a create and its release ran 12%
-- slower (docs/capacity.md), and a server that places all day grows the table without bound.
--
-- So ending a reservation (release, expiry: capacity_end) moves its bookings, in the statement that
-- used to cut them at now: what it held up to now goes to the history, cut there; what it had
-- booked from now on is deleted. The history is what a tenant held, for usage; nothing reads it
-- to decide a placement, and it has no exclusion constraint. A mode change moves its GPU's ended
-- change windows the same way (mode.rs), so each GPU keeps at most its last one.
--
-- An atom is free for a placement from the moment its release commits. A placement whose clock
-- read an earlier time (a transaction that began before the release, or the simulated clock before
-- a jump) may book the atom from that earlier instant, so its booking can overlap the released
-- one's history record by that much. Before, the cut booking stayed live and turned that placement
-- away with a replan.

CREATE TABLE device_booking_history (
  device_id text NOT NULL,
  allocation_id text NOT NULL,
  during tstzrange NOT NULL CHECK (NOT isempty(during))
);
-- A reservation's atoms once it has ended (capacity_view).
CREATE INDEX device_booking_history_allocation ON device_booking_history (allocation_id);

-- With ended bookings gone, device_bookings can now be empty when it is analyzed (a new fleet, an
-- idle one, or every reservation released), and the planner then took the exclusion constraint's
-- GiST for an atom's latest end: an index-only scan of the whole index, with the atom's id as a
-- filter (device_id in the "C" collation keeps the GiST out of the index condition, not out of a
-- full scan), so each lookup read every live booking. The capacity bench's burst went from 2.2 to
-- 24 ms of CPU per create. Without index-only scans the GiST has no path for these lookups at
-- all; the btree device_bookings_atom_end serves them by index scan, as it did (an expression
-- index cannot serve an index-only scan of upper(during)). The candidate searches keep theirs.
ALTER FUNCTION capacity_place(text, text, text, text, int, int, bigint, bigint, jsonb, jsonb, text, tstzrange, int)
  SET enable_indexonlyscan = off;
ALTER FUNCTION capacity_upsert_node_counts(text) SET enable_indexonlyscan = off;
ALTER FUNCTION capacity_candidates(text, text, text, text, int, jsonb, jsonb, text[], boolean)
  SET enable_indexonlyscan = on;

-- What is in the table already: the bookings of ended reservations, and the ended change windows.
WITH gone AS (
  DELETE FROM device_bookings b
   WHERE b.allocation_id IN (SELECT id FROM reservations WHERE state IN ('released', 'expired', 'failed'))
      OR (b.allocation_id LIKE 'change:%' AND upper(b.during) <= compute_now())
  RETURNING b.device_id, b.allocation_id, b.during)
INSERT INTO device_booking_history (device_id, allocation_id, during) SELECT * FROM gone;

-- capacity_view as in 0003_reservations, with an ended reservation's atoms read from the history.
CREATE OR REPLACE FUNCTION capacity_view(r reservations) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
BEGIN
  RETURN jsonb_build_object(
    'id', r.id, 'state', r.state, 'version', r.version, 'poolId', r.pool_id,
    'gpu', jsonb_build_object('kind', r.gpu_kind, 'model', r.gpu_model, 'profile', r.mig_profile, 'count', r.gpu_count),
    'vcpu', r.vcpu, 'memoryMib', r.memory_mib, 'diskGib', r.disk_gib,
    'startsAt', to_char(lower(r.during) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    'endsAt', to_char(upper(r.during) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    'nodeId', r.node_id,
    'atoms', CASE WHEN r.state IN ('released', 'expired', 'failed')
                  THEN (SELECT coalesce(jsonb_agg(a.device_id ORDER BY a.device_id), '[]')
                          FROM (SELECT DISTINCT h.device_id FROM device_booking_history h WHERE h.allocation_id = r.id) a)
                  ELSE (SELECT coalesce(jsonb_agg(a.device_id ORDER BY a.device_id), '[]')
                          FROM (SELECT DISTINCT b.device_id FROM device_bookings b WHERE b.allocation_id = r.id) a) END,
    'conditions', CASE WHEN r.unschedulable IS NULL THEN '[]'::jsonb
                       ELSE jsonb_build_array(jsonb_build_object('type', 'Unschedulable') || r.unschedulable) END);
END $$;

-- capacity_end as in 0004_release, with its bookings moved (above) instead of cut in place.
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
           disk_gib_allocated = disk_gib_allocated - r.disk_gib
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
