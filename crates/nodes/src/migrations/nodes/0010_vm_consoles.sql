-- The tail of each VM's serial console, as its vps host sent it (consoles.rs): the bytes from
-- start_offset on, at most 64 KiB. A row lives while its host reports the VM.
CREATE TABLE vm_consoles (
  node_id text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
  instance_id text NOT NULL,
  start_offset bigint NOT NULL CHECK (start_offset >= 0),
  data bytea NOT NULL CHECK (octet_length(data) <= 65536),
  updated_at timestamptz NOT NULL DEFAULT compute_now(),
  PRIMARY KEY (node_id, instance_id)
);
