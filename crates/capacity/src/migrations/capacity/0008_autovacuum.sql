-- Autovacuum for the tables every placement and release churns. A release cuts its bookings (an
-- update: the old version stays behind as a dead tuple) or deletes them, and each placement and
-- release updates a node's scalars and atom counts and the tenant's quota. With the default
-- thresholds (20% of the table dead) the dead versions pile up at the top of each atom's range in
-- device_bookings_atom_end, which the placer's atom lookup walks backwards: measured with a
-- create-and-release loop at one client (pgbench on the capacity bench's database), the lookup went
-- from 0.14 to 0.36 ms and a pair from 317 to 244 a second over 15,000 bookings; with these
-- settings (and autovacuum_naptime = 5s, see docs/capacity.md) it stayed at 290 to 310 a second.
-- node_resources is the nodes module's table, but its churn is the placer's.
ALTER TABLE device_bookings SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                                 autovacuum_vacuum_cost_delay = 0, autovacuum_analyze_scale_factor = 0.05);
ALTER TABLE reservations SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                              autovacuum_vacuum_cost_delay = 0);
ALTER TABLE quota_usage SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                             autovacuum_vacuum_cost_delay = 0);
ALTER TABLE node_atom_counts SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                                  autovacuum_vacuum_cost_delay = 0);
ALTER TABLE node_resources SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                                autovacuum_vacuum_cost_delay = 0);
