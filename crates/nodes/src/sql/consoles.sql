-- Appends what a vps host's VM wrote to its console (sessions/consoles.rs), keeping the last p_keep bytes.
-- Each byte is kept once whatever the daemon repeats: bytes before the kept end are skipped, and a
-- chunk that starts past it (bytes that never came) starts the tail again there. Only a VM the
-- node reports in its spec status has a console here, so a host writes no one else's.
CREATE OR REPLACE FUNCTION vm_console_append(p_node text, p_instance text, p_offset bigint, p_data bytea, p_keep int)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  v_start bigint;
  v_data bytea;
  v_end bigint;
BEGIN
  IF octet_length(p_data) = 0 OR NOT EXISTS (
       SELECT 1 FROM nodes WHERE id = p_node AND spec_status->'instances' @> jsonb_build_array(jsonb_build_object('instanceId', p_instance))) THEN
    RETURN;
  END IF;
  SELECT start_offset, data INTO v_start, v_data FROM vm_consoles WHERE node_id = p_node AND instance_id = p_instance FOR UPDATE;
  IF NOT FOUND OR p_offset > v_start + octet_length(v_data) OR p_offset + octet_length(p_data) < v_start THEN
    v_start := p_offset;
    v_data := p_data;
  ELSE
    v_end := v_start + octet_length(v_data);
    IF p_offset + octet_length(p_data) <= v_end THEN
      RETURN; -- a repeat
    END IF;
    v_data := v_data || substring(p_data FROM (v_end - p_offset + 1)::int);
  END IF;
  IF octet_length(v_data) > p_keep THEN
    v_start := v_start + octet_length(v_data) - p_keep;
    v_data := substring(v_data FROM octet_length(v_data) - p_keep + 1);
  END IF;
  INSERT INTO vm_consoles (node_id, instance_id, start_offset, data) VALUES (p_node, p_instance, v_start, v_data)
  ON CONFLICT (node_id, instance_id) DO UPDATE SET start_offset = excluded.start_offset, data = excluded.data, updated_at = compute_now();
END $$;
