-- Quota: quota_usage rows change only by these guarded statements (used + n <= max); the table's
-- CHECK is the backstop. Rows are locked in resource order, so two charges never wait on each other
-- in opposite orders. Reserving charges quota first, releasing refunds it first (the lock order).

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

-- Charges the tenant in one guarded statement: each row is updated only if its charge fits under
-- max. A resource that does not fit (or has no quota line) raises QUOTA_EXCEEDED, final for the
-- request. Returns how many resources were charged (a value, so callers assign instead of PERFORM,
-- which runs a query).
CREATE OR REPLACE FUNCTION capacity_charge(p_tenant text, p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint,
                                p_disk_gib bigint) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  v_charged text[];
  v_short record;
  v_quota record;
BEGIN
  WITH c AS (SELECT * FROM capacity_charge_of(p_kind, p_count, p_vcpu, p_memory_mib, p_disk_gib)),
       locked AS (SELECT q.resource FROM quota_usage q
                   WHERE q.tenant_id = p_tenant AND q.resource IN (SELECT resource FROM c)
                   ORDER BY q.resource FOR UPDATE),
       charged AS (UPDATE quota_usage q SET used = q.used + c.amount
                     FROM c JOIN locked l ON l.resource = c.resource
                    WHERE q.tenant_id = p_tenant AND q.resource = c.resource AND q.used + c.amount <= q.max
                   RETURNING q.resource)
  SELECT coalesce(array_agg(resource), '{}') INTO v_charged FROM charged;
  -- Every amount above zero charged: done (capacity_charge_of's rule, without a query).
  IF cardinality(v_charged) = (p_count > 0)::int + (p_vcpu > 0)::int + (p_memory_mib > 0)::int + (p_disk_gib > 0)::int THEN
    RETURN cardinality(v_charged);
  END IF;
  SELECT c.resource, c.amount INTO v_short
    FROM capacity_charge_of(p_kind, p_count, p_vcpu, p_memory_mib, p_disk_gib) c
   WHERE NOT (c.resource = ANY(v_charged))
   LIMIT 1;
  SELECT used, max INTO v_quota FROM quota_usage WHERE tenant_id = p_tenant AND resource = v_short.resource;
  RAISE EXCEPTION USING ERRCODE = 'BCQUO',
    MESSAGE = CASE WHEN v_quota.max IS NULL
                   THEN format('the tenant has no quota for %s; ask an operator to set one', v_short.resource)
                   ELSE format('quota for %s exceeded: %s of %s used, %s more asked; release reservations or ask an operator for more',
                               v_short.resource, v_quota.used, v_quota.max, v_short.amount) END,
    DETAIL = jsonb_build_object('resource', v_short.resource, 'asked', v_short.amount)::text;
END $$;

-- Refunds a charge, in the same resource order; returns how many resources were refunded.
CREATE OR REPLACE FUNCTION capacity_refund(p_tenant text, p_kind text, p_count bigint, p_vcpu bigint, p_memory_mib bigint,
                                p_disk_gib bigint) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
  v_refunded int;
BEGIN
  WITH c AS (SELECT * FROM capacity_charge_of(p_kind, p_count, p_vcpu, p_memory_mib, p_disk_gib)),
       locked AS (SELECT q.resource FROM quota_usage q
                   WHERE q.tenant_id = p_tenant AND q.resource IN (SELECT resource FROM c)
                   ORDER BY q.resource FOR UPDATE)
  UPDATE quota_usage q SET used = q.used - c.amount
    FROM c JOIN locked l ON l.resource = c.resource
   WHERE q.tenant_id = p_tenant AND q.resource = c.resource;
  GET DIAGNOSTICS v_refunded = ROW_COUNT;
  RETURN v_refunded;
END $$;
