-- The fleet's base image catalogue (images.rs): every vps host fetches each image into its cache
-- and uses it only if its bytes hash to the sha256 named here. A change of the catalogue moves
-- `vps_settings.catalogue_generation`, and every host is bootstrapped again against it.
CREATE TABLE vps_images (
  name text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,63}$'),
  url text NOT NULL CHECK (url ~ '^(https?|file)://' AND length(url) <= 2048),
  sha256 text NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
  version bigint NOT NULL DEFAULT 1,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  updated_at timestamptz NOT NULL DEFAULT compute_now()
);
-- Names without a source, which the catalogue replaces.
ALTER TABLE vps_settings DROP COLUMN required_images;
ALTER TABLE vps_settings ADD COLUMN catalogue_generation bigint NOT NULL DEFAULT 1;
-- The catalogue generation of the host's last bootstrap command, and of the report it keeps.
ALTER TABLE vps_hosts ADD COLUMN bootstrap_generation bigint NOT NULL DEFAULT 0;
ALTER TABLE vps_hosts ADD COLUMN report_generation bigint NOT NULL DEFAULT 0;
