-- Which nodes take a request: the eligibility rules, in one place. Each is a single SQL expression,
-- so the planner inlines it into every query that calls it (the placer's searches, the counts'
-- open flag, the trigger that keeps it).

-- Whether every taint is tolerated: a toleration with the taint's key and no value, or its value.
CREATE OR REPLACE FUNCTION capacity_tolerates(p_taints jsonb, p_tolerations jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_taints) t
                      WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_tolerations) o
                                         WHERE o->>'key' = t->>'key'
                                           AND (o->>'value' IS NULL OR o->>'value' = t->>'value')))
$$;

-- The node eligibility rules: converged at least once, nothing in noScheduleReasons (cordoned,
-- unreachable, lost, …), every taint tolerated. Labels are matched by the callers that have a
-- selector.
CREATE OR REPLACE FUNCTION capacity_node_takes(p_observed_generation bigint, p_no_schedule_reasons text[], p_taints jsonb,
                                    p_tolerations jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
  SELECT p_observed_generation >= 1 AND cardinality(p_no_schedule_reasons) = 0
     AND (jsonb_array_length(p_taints) = 0 OR capacity_tolerates(p_taints, p_tolerations))
$$;

-- Whether a node takes a request that tolerates nothing: node_atom_counts.open (counts.sql).
CREATE OR REPLACE FUNCTION capacity_node_open(p_observed_generation bigint, p_no_schedule_reasons text[], p_taints jsonb)
RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
  SELECT capacity_node_takes(p_observed_generation, p_no_schedule_reasons, p_taints, '[]'::jsonb)
$$;
