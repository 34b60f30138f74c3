-- The business clock: every SQL time comparison reads compute_now(), never now() (a workspace test
-- enforces it). In production it is the transaction's now(); tests and the simulator replace it
-- with one that reads compute_sim_clock (clock::use_sim_clock).

CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz LANGUAGE sql STABLE AS $$ SELECT now() $$;
