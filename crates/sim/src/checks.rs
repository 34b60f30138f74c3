//! The invariants checked while the run goes and after the heal: capacity's, no stale-epoch write
//! accepted, drains within the budget, no workflow rebooting twice, instances, and the audit log
//! against the requests the workload made.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use better_compute_capacity::invariants;
use better_compute_core::gpu_mode::GpuMode;

use crate::workload::OpEnd;
use crate::{Sim, SIM_DRAIN_BUDGET};

/// The stale-epoch audit, installed in the simulator's throwaway database only: every row a
/// fenced transaction writes is checked against the lease it was fenced by (the fence names it in
/// `better_compute.fence`); a write made after the lease moved to a newer epoch is recorded, and
/// recorded only if it commits, which is exactly a stale-epoch write accepted.
pub(crate) const STALE_EPOCH_AUDIT: &str = "
CREATE TABLE sim_stale_writes (tbl text NOT NULL, op text NOT NULL, fence text NOT NULL, epoch_now bigint);
CREATE FUNCTION sim_audit_fence() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  f text := current_setting('better_compute.fence', true);
  held bigint;
BEGIN
  IF coalesce(f, '') <> '' THEN
    SELECT epoch INTO held FROM leases WHERE name = split_part(f, '@', 1);
    IF held IS DISTINCT FROM split_part(f, '@', 2)::bigint THEN
      INSERT INTO sim_stale_writes (tbl, op, fence, epoch_now) VALUES (TG_TABLE_NAME, TG_OP, f, held);
    END IF;
  END IF;
  RETURN NULL;
END $$;
DO $$
DECLARE t text;
BEGIN
  FOR t IN SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename NOT IN ('sim_stale_writes', 'compute_sim_clock') LOOP
    EXECUTE format('CREATE TRIGGER sim_audit_fence AFTER INSERT OR UPDATE OR DELETE ON %I FOR EACH ROW EXECUTE FUNCTION sim_audit_fence()', t);
  END LOOP;
END $$;";

impl Sim {
    /// The invariants, at any moment: the capacity invariants (in one snapshot) and no command
    /// that is not retry-safe run twice.
    pub(crate) async fn check(&self, db: &mut tokio_postgres::Client, initial_modes: &HashMap<String, GpuMode>) -> anyhow::Result<Vec<String>> {
        // The operations that ended before the snapshot below: their commits are in it.
        let asked: Vec<(String, &'static str, bool, OpEnd)> =
            self.tally.asked.lock().expect("asked").iter().map(|o| (o.request_id.clone(), o.action, o.exact, o.ended)).collect();
        let tx = db.build_transaction().isolation_level(tokio_postgres::IsolationLevel::RepeatableRead).read_only(true).start().await?;
        let mut v = invariants::check(&tx, initial_modes).await?.violations;
        // No stale-epoch write was accepted (see STALE_EPOCH_AUDIT).
        for r in tx
            .query("SELECT tbl, op, fence, epoch_now, count(*) FROM sim_stale_writes GROUP BY 1, 2, 3, 4 ORDER BY 5 DESC LIMIT 5", &[])
            .await?
        {
            v.push(format!(
                "stale-epoch write accepted: {} row(s) of {} ({}) written under lease {} after the lease moved to epoch {:?}",
                r.get::<_, i64>(4),
                r.get::<_, String>(0),
                r.get::<_, String>(1),
                r.get::<_, String>(2),
                r.get::<_, Option<i64>>(3)
            ));
        }
        // Admitted drains never outnumber the pool's disruption budget.
        for r in tx
            .query(
                "SELECT pool_id, count(*) FROM node_drains WHERE state IN ('draining', 'drained') GROUP BY pool_id HAVING count(*) > $1",
                &[&i64::from(SIM_DRAIN_BUDGET)],
            )
            .await?
        {
            v.push(format!("pool {} has {} drains admitted, over its budget of {SIM_DRAIN_BUDGET}", r.get::<_, String>(0), r.get::<_, i64>(1)));
        }
        // No workflow rebooted its node twice: at most one of its reboots succeeded, and a second
        // attempt only followed a failed first.
        for r in tx
            .query(
                "SELECT w.id, count(*) FILTER (WHERE c.state = 'succeeded'), count(*) FROM workflows w
                   JOIN commands c ON c.node_id = w.node_id AND c.idempotency_key LIKE 'wf:' || w.id || ':reboot.%'
                  GROUP BY w.id HAVING count(*) FILTER (WHERE c.state = 'succeeded') > 1",
                &[],
            )
            .await?
        {
            v.push(format!("workflow {} rebooted its node {} times ({} reboots sent)", r.get::<_, String>(0), r.get::<_, i64>(1), r.get::<_, i64>(2)));
        }
        v.extend(instance_violations(&tx).await?);
        v.extend(audit_violations(&tx).await?);
        v.extend(asked_violations(&tx, &asked).await?);
        tx.commit().await?;
        // Checked: gone from the queue (those it dropped meanwhile went unchecked).
        let mut q = self.tally.asked.lock().expect("asked");
        let n = asked.len().min(q.len());
        q.drain(..n);
        self.tally.asked_checked.fetch_add(asked.len() as u64, Ordering::Relaxed);
        // No command that is not retry-safe ran twice.
        for (reason, runs) in self.reboots.lock().expect("reboots").iter() {
            if *runs > 1 {
                v.push(format!("node.reboot ({reason}) is not retry-safe but ran {runs} times"));
            }
        }
        Ok(v)
    }
}

/// What must hold of the audit log at every moment: its placed entries chain and match every
/// checkpoint (as `better-compute audit verify` checks an export); a reservation the workload
/// created has exactly one `reservations.create` entry, written with it (one made by
/// `instances.create` has none of its own), and no such entry names a reservation that does not
/// exist (its create rolled back).
pub(crate) async fn audit_violations(tx: &impl tokio_postgres::GenericClient) -> anyhow::Result<Vec<String>> {
    let mut v = Vec::new();
    let lines = better_compute_audit::log::export_all(tx).await?;
    if let Some(problem) = better_compute_audit::verify::verify(&lines, None).problem {
        v.push(format!("the audit log does not verify: {problem}"));
    }
    for r in tx
        .query(
            "SELECT r.id, (SELECT count(*) FROM audit_entries a WHERE a.action = 'reservations.create' AND a.target = r.id) AS n
               FROM reservations r
              WHERE NOT EXISTS (SELECT 1 FROM instances i WHERE i.allocation_id = r.id)
                AND (SELECT count(*) FROM audit_entries a WHERE a.action = 'reservations.create' AND a.target = r.id) <> 1
             UNION ALL
             SELECT a.target, 0 FROM audit_entries a WHERE a.action = 'reservations.create' AND NOT EXISTS (SELECT 1 FROM reservations r WHERE r.id = a.target)
             LIMIT 10",
            &[],
        )
        .await?
    {
        v.push(format!("reservation {} has {} reservations.create audit entries (one is written with it)", r.get::<_, String>(0), r.get::<_, i64>(1)));
    }
    Ok(v)
}

/// Each operation of the workload, made as an API request, has its entries in the audit log: one
/// if it committed (at most one where a commit may change nothing), none if it was refused, at most
/// one if the database went away mid-request.
pub(crate) async fn asked_violations(tx: &impl tokio_postgres::GenericClient, asked: &[(String, &'static str, bool, OpEnd)]) -> anyhow::Result<Vec<String>> {
    let ids: Vec<&str> = asked.iter().map(|(id, ..)| id.as_str()).collect();
    let counts: HashMap<String, i64> = tx
        .query("SELECT request_id, count(*) FROM audit_entries WHERE request_id = ANY($1) GROUP BY 1", &[&ids])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut v = Vec::new();
    for (id, action, exact, ended) in asked {
        let n = counts.get(id).copied().unwrap_or(0);
        let allowed = match ended {
            OpEnd::Committed if *exact => n == 1,
            OpEnd::Committed | OpEnd::InDoubt => n <= 1,
            OpEnd::Refused => n == 0,
        };
        if !allowed && v.len() < 10 {
            v.push(format!("{action} request {id} ({ended:?}) has {n} audit entries"));
        }
    }
    Ok(v)
}

/// What must hold of instances at every moment: one live instance per reservation; an instance
/// on a host is on its reservation's node; no reservation runs in two VMs, whatever the hosts say.
pub(crate) async fn instance_violations(tx: &impl tokio_postgres::GenericClient) -> anyhow::Result<Vec<String>> {
    let mut v = Vec::new();
    for r in tx.query("SELECT allocation_id, count(*) FROM instances WHERE state <> 'deleted' GROUP BY 1 HAVING count(*) > 1", &[]).await? {
        v.push(format!("reservation {} has {} live instances", r.get::<_, String>(0), r.get::<_, i64>(1)));
    }
    for r in tx
        .query(
            "SELECT i.id, i.node_id, r.node_id FROM instances i JOIN reservations r ON r.id = i.allocation_id
              WHERE i.state NOT IN ('requested', 'deleted') AND i.node_id IS DISTINCT FROM r.node_id",
            &[],
        )
        .await?
    {
        v.push(format!("instance {} is on node {:?}, its reservation on {:?}", r.get::<_, String>(0), r.get::<_, Option<String>>(1), r.get::<_, Option<String>>(2)));
    }
    for r in tx
        .query(
            "SELECT i.allocation_id, count(*) FROM nodes n, jsonb_array_elements(coalesce(n.spec_status->'instances', '[]')) o
               JOIN instances i ON i.id = o->>'instanceId' WHERE o->>'state' = 'running' GROUP BY 1 HAVING count(*) > 1",
            &[],
        )
        .await?
    {
        v.push(format!("reservation {} runs in {} VMs", r.get::<_, String>(0), r.get::<_, i64>(1)));
    }
    v.extend(better_compute_vps::invariants::violations(tx).await?);
    Ok(v)
}

/// Ways the instances differ from what the hosts have, once everything healed (empty: settled).
pub(crate) async fn instance_differences(db: &tokio_postgres::Client) -> anyhow::Result<Vec<String>> {
    let rows = db
        .query(
            "WITH vms AS (SELECT n.id AS node_id, o->>'instanceId' AS id, o->>'state' AS state FROM nodes n,
                            jsonb_array_elements(coalesce(n.spec_status->'instances', '[]')) o WHERE o->>'state' IN ('running', 'stopped'))
             SELECT format('VM %s on %s leaked: its instance is %s', v.id, v.node_id, coalesce(i.state, 'unknown'))
               FROM vms v LEFT JOIN instances i ON i.id = v.id WHERE i.id IS NULL OR i.state IN ('deleted', 'requested') OR i.node_id <> v.node_id
             UNION ALL
             SELECT format('instance %s is %s but its host %s has no VM for it', i.id, i.state, i.node_id)
               FROM instances i WHERE i.state IN ('running', 'stopping', 'stopped') AND NOT EXISTS (SELECT 1 FROM vms v WHERE v.id = i.id AND v.node_id = i.node_id)
             UNION ALL
             SELECT format('instance %s is still %s although its host reports it %s', i.id, i.state, v.state)
               FROM instances i JOIN vms v ON v.id = i.id
              WHERE (i.state = 'provisioning' AND v.state = 'running') OR (i.state = 'stopping' AND v.state = 'stopped')
             UNION ALL
             SELECT CASE WHEN EXISTS (SELECT 1 FROM vms v WHERE v.id = i.id)
                         THEN format('VM %s on %s leaked: its instance is still deleting', i.id, i.node_id)
                         ELSE format('instance %s is still deleting although its host %s has no VM for it', i.id, i.node_id) END
               FROM instances i WHERE i.state = 'deleting'
             UNION ALL
             SELECT format('instance %s is %s although its reservation %s is %s', i.id, i.state, r.id, r.state)
               FROM instances i JOIN reservations r ON r.id = i.allocation_id
              WHERE (i.state <> 'deleted' AND r.state NOT IN ('pending', 'placed', 'active')) OR (i.state = 'requested' AND r.state IN ('placed', 'active'))
             ORDER BY 1 LIMIT 10",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}
