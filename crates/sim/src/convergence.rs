//! After the faults: the fleet must converge (every node at its generation, no work left, every
//! sink caught up, every workflow ended) and the instances settle on what the hosts have.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use better_compute_audit::Actor;
use better_compute_capacity::Caller;
use better_compute_nodes::drain;
use better_compute_workflows as workflow;
use better_compute_vps::instances::{self, Action};

use crate::checks::instance_differences;
use crate::Sim;

impl Sim {
    /// Deletes every running instance, as its tenant would (`--broken keep-deleted-vms`).
    pub(crate) async fn delete_running_instances(&self, db: &mut tokio_postgres::Client) -> anyhow::Result<()> {
        let running: Vec<(String, String)> = {
            let tx = db.transaction().await?;
            let rows = tx.query("SELECT id, tenant_id FROM instances WHERE state = 'running' ORDER BY id", &[]).await?;
            tx.commit().await?;
            rows.iter().map(|r| (r.get(0), r.get(1))).collect()
        };
        for (id, tenant) in &running {
            instances::act(db, &Actor::job("sim"), Caller { tenant_id: tenant, identity_id: "idn_sim" }, id, Action::Delete).await?;
        }
        println!("  [{:>5.1} s] {} running instances deleted at the heal", self.started.elapsed().as_secs_f64(), running.len());
        Ok(())
    }

    /// After the faults: waits (advancing nothing but real time) until every node's
    /// observedGeneration reaches its generation, no work is due, and every outbox sink has caught
    /// up; what is still wrong at the deadline is a violation.
    #[allow(clippy::too_many_lines, reason = "one check after another of what must hold after the heal, each with its message")]
    pub(crate) async fn converge(&self, db: &mut tokio_postgres::Client, nodes: &[String]) -> anyhow::Result<Vec<String>> {
        let deadline = Instant::now() + Duration::from_secs(self.args.heal_timeout_s);
        // The workload's own drains end, as an operator's would: a waiting one may hold the pool's
        // budget for the length of a reservation, and the maintenance workflows wait for it.
        {
            let tx = db.transaction().await?;
            for r in tx.query("SELECT node_id FROM node_drains WHERE requested_by = 'sim/op' AND state IN ('queued', 'draining', 'drained') ORDER BY node_id", &[]).await? {
                drain::undrain(&tx, &r.get::<_, String>(0)).await?;
            }
            tx.commit().await?;
        }
        loop {
            let mut wrong = Vec::new();
            self.reconnect(db).await?;
            for r in db
                .query(
                    "SELECT n.id, n.generation, n.observed_generation, n.liveness,
                            coalesce(format('epoch %s on %s, %s', s.session_epoch, s.gateway_id,
                                            coalesce('closed (' || s.close_reason || ')', 'open, last seen ' || (compute_now() - s.last_seen_at) || ' ago')),
                                     'none')
                       FROM nodes n LEFT JOIN node_sessions s ON s.node_id = n.id
                      WHERE n.id = ANY($1) AND (n.observed_generation IS DISTINCT FROM n.generation OR n.liveness <> 'connected')",
                    &[&nodes],
                )
                .await?
            {
                wrong.push(format!(
                    "node {} has not converged after the faults stopped: generation {}, observedGeneration {:?}, liveness {}, session {}",
                    r.get::<_, String>(0),
                    r.get::<_, i64>(1),
                    r.get::<_, Option<i64>>(2),
                    r.get::<_, String>(3),
                    r.get::<_, String>(4)
                ));
            }
            // Every site boot ended once its nodes converged.
            for r in db.query("SELECT name FROM sites WHERE boot_state = 'booting'", &[]).await? {
                wrong.push(format!("site {} is still booting after its nodes came back", r.get::<_, String>(0)));
            }
            // Every reboot the workload asked for was signed with the key each daemon pinned at
            // join, through crashes, wiped journals and restarts: none was refused for it.
            for r in db.query("SELECT id, node_id FROM commands WHERE reason = 'BAD_SIGNATURE'", &[]).await? {
                wrong.push(format!("command {} on node {} was refused as not signed", r.get::<_, String>(0), r.get::<_, String>(1)));
            }
            // The operator's part: a held maintenance keeps its node drained, and so its place in
            // the pool's budget, which the others' drains wait for. Cancel it and undrain its node.
            {
                let tx = db.transaction().await?;
                let held: Vec<(String, Option<String>)> =
                    tx.query("SELECT id, node_id FROM workflows WHERE state = 'held' ORDER BY id", &[]).await?.iter().map(|r| (r.get(0), r.get(1))).collect();
                for (id, node) in &held {
                    workflow::cancel(&tx, id, "sim/operator").await?;
                    if let Some(node) = node
                        && drain::open_drain(&tx, node).await?.is_some_and(|d| d.requested_by == format!("workflow:{id}"))
                    {
                        drain::undrain(&tx, node).await?;
                    }
                }
                tx.commit().await?;
                self.tally.workflows_held.fetch_add(held.len() as u64, Ordering::Relaxed);
            }
            // Every workflow ended (succeeded, failed, cancelled) or holds for an operator; a
            // node.recover may still wait for its GPU to be free while a reservation holds it (a
            // suspect GPU takes no new reservations, and the ones it has run to their end).
            for r in db
                .query(
                    "SELECT w.id, w.node_id, w.state, s.name, s.message FROM workflows w
                       LEFT JOIN workflow_steps s ON s.workflow_id = w.id AND s.idx = w.current_step
                      WHERE w.state IN ('running', 'cancelling')
                        AND NOT (w.definition = 'node.recover' AND w.state = 'running' AND s.name = 'wait-free'
                                 AND EXISTS (SELECT 1 FROM devices a JOIN device_bookings b ON b.device_id = a.id
                                              WHERE (a.id = w.params->>'gpuUuid' OR a.parent_id = w.params->>'gpuUuid')
                                                AND b.during @> compute_now()))",
                    &[],
                )
                .await?
            {
                wrong.push(format!(
                    "workflow {} on node {:?} is still {} at step {:?} ({:?}) after the faults stopped",
                    r.get::<_, String>(0),
                    r.get::<_, Option<String>>(1),
                    r.get::<_, String>(2),
                    r.get::<_, Option<String>>(3),
                    r.get::<_, Option<String>>(4)
                ));
            }
            // A key due for a minute and still not run: left unprocessed.
            for r in db
                .query(
                    "SELECT kind, key FROM work_queue
                      WHERE not_before < compute_now() - interval '60 seconds'
                        AND (claimed_until IS NULL OR claimed_until < compute_now())",
                    &[],
                )
                .await?
            {
                wrong.push(format!("work key {}/{} left unprocessed", r.get::<_, String>(0), r.get::<_, String>(1)));
            }
            // Every committed event reached every outbox sink (subscriber) at least once.
            let registry = better_compute_server::registry()?;
            for sink in registry.outbox_sinks() {
                let behind: i64 = db
                    .query_one(
                        "SELECT count(*) FROM outbox o
                          WHERE NOT EXISTS (SELECT 1 FROM outbox_cursors c WHERE c.sink = $1 AND (c.txid, c.seq) >= (o.txid, o.seq))",
                        &[&sink.name()],
                    )
                    .await?
                    .get(0);
                if behind > 0 {
                    wrong.push(format!("outbox sink {} has not received {behind} committed event(s)", sink.name()));
                }
            }
            if wrong.is_empty() {
                return Ok(wrong);
            }
            if Instant::now() > deadline {
                return Ok(wrong);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Liveness: every node is back within two fault intervals of losing its session, and commands
    /// keep finishing (some command reaches an end in every interval).
    pub(crate) async fn liveness(
        &self,
        db: &tokio_postgres::Client,
        nodes: &[String],
        away: &mut HashMap<String, u32>,
        finished_before: &mut i64,
    ) -> anyhow::Result<Vec<String>> {
        let mut v = Vec::new();
        let rows = db.query("SELECT id, liveness FROM nodes WHERE id = ANY($1)", &[&nodes]).await?;
        for r in rows {
            let (id, liveness): (String, String) = (r.get(0), r.get(1));
            if liveness == "connected" {
                away.remove(&id);
                continue;
            }
            let n = away.entry(id.clone()).or_default();
            *n += 1;
            if *n > 2 {
                v.push(format!("liveness: node {id} has been {liveness} for {n} fault intervals"));
            }
        }
        let finished: i64 = db
            .query_one("SELECT count(*) FROM commands WHERE state IN ('succeeded', 'failed', 'expired', 'cancelled')", &[])
            .await?
            .get(0);
        if finished == *finished_before && self.tally.commands.load(Ordering::SeqCst) > 0 {
            v.push("liveness: no command reached an end during a fault interval".into());
        }
        *finished_before = finished;
        Ok(v)
    }

    /// After the heal: the instances settle on what the hosts have (nothing leaked, nothing
    /// missing, none outliving its reservation), within the heal timeout.
    pub(crate) async fn settle_instances(&self, db: &mut tokio_postgres::Client) -> anyhow::Result<Vec<String>> {
        let deadline = Instant::now() + Duration::from_secs(self.args.heal_timeout_s);
        loop {
            self.reconnect(db).await?;
            let found = instance_differences(db).await?;
            if found.is_empty() {
                return Ok(found);
            }
            if Instant::now() > deadline {
                return Ok(found.into_iter().map(|d| format!("after the heal, {d}")).collect());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
