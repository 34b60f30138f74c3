-- The latest end of each atom's ended bookings, read by a placement before it books the atom: it
-- books from no earlier than that end (capacity_place), so a booking never overlaps the history of
-- the reservation that held the atom before. A placement's clock may read an earlier instant than
-- the release that freed the atom (its transaction began first and waited for a lock, or the
-- simulated clock moved while it waited); booking from its own instant put two tenants on one
-- atom for as long as it had waited. This supersedes 0001's note that such an overlap may happen.
-- In the "C" collation like device_bookings_atom_end, so one index entry answers the lookup.
CREATE INDEX device_booking_history_atom_end ON device_booking_history (device_id COLLATE "C", upper(during));
