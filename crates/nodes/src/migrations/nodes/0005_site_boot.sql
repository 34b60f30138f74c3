-- Site boot: after a site-wide outage (or when a site is first brought up) its nodes come back
-- paced, and placement on the site waits until enough of them have converged.
ALTER TABLE sites
  ADD COLUMN boot_state text NOT NULL DEFAULT 'normal' CHECK (boot_state IN ('normal', 'booting')),
  ADD COLUMN boot_since timestamptz,
  -- sessions admitted per second while booting (a token bucket of one second's worth)
  ADD COLUMN boot_admit_per_s integer NOT NULL DEFAULT 50 CHECK (boot_admit_per_s BETWEEN 1 AND 100000),
  ADD COLUMN boot_tokens float8 NOT NULL DEFAULT 0,
  ADD COLUMN boot_tokens_at timestamptz,
  -- the share of the site's joined nodes connected and converged that ends a boot
  ADD COLUMN boot_converged_percent integer NOT NULL DEFAULT 90 CHECK (boot_converged_percent BETWEEN 1 AND 100),
  -- the share of the site's joined nodes unreachable that counts as a site-wide outage
  ADD COLUMN boot_outage_percent integer NOT NULL DEFAULT 50 CHECK (boot_outage_percent BETWEEN 1 AND 100),
  ADD CONSTRAINT sites_boot_since CHECK ((boot_state = 'booting') = (boot_since IS NOT NULL));
