-- Quota: quota_usage rows change only by these guarded statements (used + n <= max); the table's
-- CHECK is the backstop. Rows are locked in (tenant, resource) order, so two charges never wait on
-- each other in opposite orders. Reserving charges quota first, releasing refunds it first (the lock
-- order). One request and a batch of them go through the same statements (the _many functions).

-- What a reservation charges its tenant's quota: (resource, amount) in charge order, amounts above
-- zero only.
CREATE OR REPLACE FUNCTION capacity_charge_of(p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint, p_disk_gib bigint)
RETURNS TABLE (resource text, amount bigint)
LANGUAGE sql IMMUTABLE AS $$
  SELECT c.resource, c.amount
    FROM (VALUES (1, CASE p_kind WHEN 'gpu' THEN 'gpus' WHEN 'mig' THEN 'mig_instances' ELSE 'gpu_slots' END, p_count),
                 (2, 'vcpu', p_vcpu), (3, 'memory_mib', p_memory_mib), (4, 'disk_gib', p_disk_gib)) c(o, resource, amount)
   WHERE c.amount > 0
   ORDER BY c.o
$$;

-- Charges many requests at once (the batch placer's, and capacity_charge's one): the rows of every
-- (tenant, resource) they charge, locked in that order, then each tenant's sum per resource, all of a
-- tenant's or none of it (a guarded update: used + sum <= max). Returns the tenants charged; one
-- with a resource that does not fit, or no quota line for one it asks, is charged nothing.
CREATE OR REPLACE FUNCTION capacity_charge_many(p_tenants text[], p_kinds text[], p_counts bigint[], p_vcpus bigint[],
                                                p_memory_mibs bigint[], p_disk_gibs bigint[]) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
  v_charged text[];
BEGIN
  PERFORM 1 FROM quota_usage q
    WHERE (q.tenant_id, q.resource) IN (SELECT p_tenants[i], x.resource FROM generate_subscripts(p_tenants, 1) i,
             LATERAL capacity_charge_of(p_kinds[i], p_counts[i], p_vcpus[i], p_memory_mibs[i], p_disk_gibs[i]) x)
    ORDER BY q.tenant_id, q.resource FOR UPDATE;
  WITH c AS (SELECT p_tenants[i] AS t, x.resource, sum(x.amount) AS amount
               FROM generate_subscripts(p_tenants, 1) i,
                    LATERAL capacity_charge_of(p_kinds[i], p_counts[i], p_vcpus[i], p_memory_mibs[i], p_disk_gibs[i]) x
              GROUP BY 1, 2),
       short AS (SELECT DISTINCT c.t FROM c LEFT JOIN quota_usage q ON q.tenant_id = c.t AND q.resource = c.resource
                  WHERE q.tenant_id IS NULL OR q.used + c.amount > q.max),
       charged AS (UPDATE quota_usage q SET used = q.used + c.amount FROM c
                    WHERE q.tenant_id = c.t AND q.resource = c.resource AND c.t NOT IN (SELECT t FROM short)
                   RETURNING q.tenant_id)
  SELECT coalesce(array_agg(DISTINCT tenant_id), '{}') INTO v_charged FROM charged;
  RETURN v_charged;
END $$;

-- Charges one request (capacity_charge_many's rule). A resource that does not fit (or has no quota
-- line) raises QUOTA_EXCEEDED, final for the request, naming the first such in charge order.
-- Returns how many resources were charged.
CREATE OR REPLACE FUNCTION capacity_charge(p_tenant text, p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint,
                                p_disk_gib bigint) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  -- capacity_charge_of's rule (amounts above zero), without a query.
  v_resources int := (p_count > 0)::int + (p_vcpu > 0)::int + (p_memory_mib > 0)::int + (p_disk_gib > 0)::int;
  v_short record;
BEGIN
  IF v_resources = 0
     OR p_tenant = ANY(capacity_charge_many(ARRAY[p_tenant], ARRAY[p_kind], ARRAY[p_count], ARRAY[p_vcpu], ARRAY[p_memory_mib],
                                            ARRAY[p_disk_gib])) THEN
    RETURN v_resources;
  END IF;
  -- Nothing was charged; the rows are locked, so this reads what the charge saw.
  SELECT c.resource, c.amount, q.used, q.max INTO v_short
    FROM capacity_charge_of(p_kind, p_count, p_vcpu, p_memory_mib, p_disk_gib) WITH ORDINALITY AS c(resource, amount, o)
    LEFT JOIN quota_usage q ON q.tenant_id = p_tenant AND q.resource = c.resource
   WHERE q.tenant_id IS NULL OR q.used + c.amount > q.max
   ORDER BY c.o
   LIMIT 1;
  RAISE EXCEPTION USING ERRCODE = 'BCQUO',
    MESSAGE = CASE WHEN v_short.max IS NULL
                   THEN format('the tenant has no quota for %s; ask an operator to set one', v_short.resource)
                   ELSE format('quota for %s exceeded: %s of %s used, %s more asked; release reservations or ask an operator for more',
                               v_short.resource, v_short.used, v_short.max, v_short.amount) END,
    DETAIL = jsonb_build_object('resource', v_short.resource, 'asked', v_short.amount)::text;
END $$;

-- Refunds many charges at once (the batch placer's, releases' and capacity_refund's one), rows in
-- (tenant, resource) order; returns how many rows it changed.
CREATE OR REPLACE FUNCTION capacity_refund_many(p_tenants text[], p_kinds text[], p_counts bigint[], p_vcpus bigint[],
                                                p_memory_mibs bigint[], p_disk_gibs bigint[]) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  v_refunded int;
BEGIN
  PERFORM 1 FROM quota_usage q
    WHERE (q.tenant_id, q.resource) IN (SELECT p_tenants[i], x.resource FROM generate_subscripts(p_tenants, 1) i,
             LATERAL capacity_charge_of(p_kinds[i], p_counts[i], p_vcpus[i], p_memory_mibs[i], p_disk_gibs[i]) x)
    ORDER BY q.tenant_id, q.resource FOR UPDATE;
  UPDATE quota_usage q SET used = q.used - c.amount
    FROM (SELECT p_tenants[i] AS t, x.resource, sum(x.amount) AS amount
            FROM generate_subscripts(p_tenants, 1) i,
                 LATERAL capacity_charge_of(p_kinds[i], p_counts[i], p_vcpus[i], p_memory_mibs[i], p_disk_gibs[i]) x
           GROUP BY 1, 2) c
   WHERE q.tenant_id = c.t AND q.resource = c.resource;
  GET DIAGNOSTICS v_refunded = ROW_COUNT;
  RETURN v_refunded;
END $$;

-- Locks, in (tenant, resource) order, the quota rows that ending these reservations refunds. A
-- transaction ending several (an eviction) takes them all before the first end takes its node's
-- rows: ended one after another, each end would take its tenant's quota after the previous end took
-- node_resources and wake-ups, against the lock order (a deadlock with a placement or release
-- holding that tenant's quota).
CREATE OR REPLACE FUNCTION capacity_lock_refunds_of(p_ids text[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM 1 FROM quota_usage q
    WHERE (q.tenant_id, q.resource) IN (SELECT r.tenant_id, x.resource FROM reservations r,
             LATERAL capacity_charge_of(r.gpu_kind, r.gpu_count, r.vcpu, r.memory_mib, r.disk_gib) x
             WHERE r.id = ANY(p_ids))
    ORDER BY q.tenant_id, q.resource FOR UPDATE;
END $$;

-- Refunds one charge; returns how many resources were refunded.
CREATE OR REPLACE FUNCTION capacity_refund(p_tenant text, p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint,
                                p_disk_gib bigint) RETURNS int
LANGUAGE plpgsql AS $$
BEGIN
  RETURN capacity_refund_many(ARRAY[p_tenant], ARRAY[p_kind], ARRAY[p_count], ARRAY[p_vcpu], ARRAY[p_memory_mib],
                              ARRAY[p_disk_gib]);
END $$;
