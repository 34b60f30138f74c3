-- defines compute_now()
CREATE EXTENSION IF NOT EXISTS btree_gist;
-- Tests only: the test support and the simulator point compute_now() here (use_sim_clock).
CREATE TABLE compute_sim_clock (id int PRIMARY KEY CHECK (id = 1), ts timestamptz NOT NULL);
CREATE FUNCTION compute_now() RETURNS timestamptz LANGUAGE sql STABLE AS $$ SELECT now() $$;
