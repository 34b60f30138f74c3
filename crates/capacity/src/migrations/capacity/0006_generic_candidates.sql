-- capacity_candidates' statements run on generic plans, planned once per backend.
--
-- The plan cache chose custom plans for most of its calls under load: in the capacity bench (64
-- clients), the no-selector best-fit search was planned 4,742 times in 7,189 calls, and the
-- worst-fit one at every call. Its LIMIT is the window (a parameter), and the first custom plans of
-- a backend, made with a short excluded list or a wide window, set the average the generic plan is
-- compared with. Planning it costs more than running it (0.6 ms against 0.36 ms, EXPLAIN on the
-- bench's fleet), so a custom plan doubled the search's cost.
--
-- The generic plans are the plans the queries are written for, whatever the parameters: the class's
-- counts walked in index order within the window, then each node by its key; with a selector, the
-- nodes that carry the labels (GIN) first, then their counts by key. A selector is only ever
-- non-empty on that path, so its generic plan never meets the empty containment.
ALTER FUNCTION capacity_candidates(text, text, text, text, int, jsonb, jsonb, text[], boolean)
  SET plan_cache_mode = force_generic_plan;
