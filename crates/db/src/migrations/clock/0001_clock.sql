-- The business clock's table. Tests and the simulator point compute_now() here (use_sim_clock);
-- in production it stays empty and compute_now() is the transaction's start time.
CREATE TABLE compute_sim_clock (id int PRIMARY KEY CHECK (id = 1), ts timestamptz NOT NULL);
