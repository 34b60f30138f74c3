-- The work queue is a queue: every change upserts a key and every run updates or deletes it. Vacuum
-- it after 2% of it is dead instead of the default 20%, unthrottled, so claims do not walk dead keys
-- (see capacity's 0008_autovacuum for the measurement on the tables the placer churns).
ALTER TABLE work_queue SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                            autovacuum_vacuum_cost_delay = 0);
