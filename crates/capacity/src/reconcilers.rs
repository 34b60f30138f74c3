//! The capacity jobs: `capacity.reservations` moves a pool's reservations through time and retries
//! pending ones; `capacity.rollup` keeps `pool_capacity_rollup` true; and an in-process subscriber
//! refreshes a node's atom counts and wakes the rollup when the inventory changes.

use better_compute_db::DbError;
use better_compute_runtime::outbox::Event;
use better_compute_runtime::{work_queue, Kind, Outcome, ReconcileContext, Reconciler, RunError, Sink};
use tokio_postgres::Transaction;

use crate::reservations;
use crate::{RESERVATIONS_KIND, ROLLUP_KIND};

async fn pools_in(ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
    let mut c = ctx.client().await?;
    // In a transaction, as every statement of the runtime: safe behind PgBouncer.
    let tx = c.transaction().await?;
    let rows = tx.query("SELECT id FROM pools", &[]).await?;
    tx.commit().await?;
    Ok(rows
        .iter()
        .map(|r| r.get::<_, String>(0))
        .filter(|id| shards.contains(&better_compute_core::shard::shard_of(id)))
        .collect())
}

/// The most steps one run takes a reservation through (placed, active, expired, and one spare); what
/// is still due after them is due at once, so the timer armed last runs it again.
const MAX_STEPS_PER_RUN: usize = 4;

/// `capacity.reservations`, keyed by reservation.
pub struct Reservations;

#[async_trait::async_trait]
impl Reconciler for Reservations {
    fn kind(&self) -> Kind {
        RESERVATIONS_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, id: &str) -> Result<Outcome, RunError> {
        let mut c = ctx.client().await?;
        // Everything due now (a reservation may be both started and ended by a clock jump), one
        // step per transaction: a step ends by queueing wake-ups, the last table of the lock
        // order, and the next one may begin with quota, the first. In one transaction, a release
        // holding quota and queueing the same node's wake-up deadlocked with the run.
        let mut tx = ctx.begin_fenced(&mut c).await?;
        for _ in 0..MAX_STEPS_PER_RUN {
            if reservations::step(&mut tx, id).await? == reservations::Step::Nothing {
                break;
            }
            tx.commit().await?;
            tx = ctx.begin_fenced(&mut c).await?;
        }
        // Arm the timer for what is due next: its start, its end, or its next retry.
        let next: Option<f64> = tx
            .query_opt(
                "SELECT extract(epoch FROM (CASE state WHEN 'pending' THEN LEAST(next_attempt_at, upper(during))
                                                     WHEN 'placed' THEN lower(during)
                                                     ELSE upper(during) END) - compute_now())::float8
                   FROM reservations WHERE id = $1 AND state IN ('pending', 'placed', 'active')",
                &[&id],
            )
            .await?
            .map(|r| r.get(0));
        if let Some(secs) = next {
            work_queue::enqueue_after(&*tx, &RESERVATIONS_KIND, id, std::time::Duration::from_secs_f64(secs.max(0.0))).await?;
        }
        tx.commit().await?;
        Ok(Outcome::Done)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        let mut c = ctx.client().await?;
        let tx = c.transaction().await?;
        let rows = tx.query("SELECT id FROM reservations WHERE state IN ('pending', 'placed', 'active')", &[]).await?;
        tx.commit().await?;
        Ok(rows
            .iter()
            .map(|r| r.get::<_, String>(0))
            .filter(|id| shards.contains(&RESERVATIONS_KIND.shard_of(id)))
            .collect())
    }
}

/// `capacity.rollup`, keyed by pool.
pub struct Rollup;

#[async_trait::async_trait]
impl Reconciler for Rollup {
    fn kind(&self) -> Kind {
        ROLLUP_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, pool: &str) -> Result<Outcome, RunError> {
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        // The counts' open flags (src/sql/counts.sql), put right where a refresh raced a change of
        // its node: the stale nodes FOR SHARE (nodes before their counts, the lock order), so the
        // flag is set from a version of the node that cannot change before commit. SKIP LOCKED: a
        // node being changed right now is left to that change's trigger and to the next run, and
        // this never waits on a node, so it cannot deadlock with a statement changing many.
        let repaired = tx
            .execute(
                "WITH stale AS (
                   SELECT n.id, capacity_node_open(n.observed_generation, n.no_schedule_reasons, n.taints) AS open
                     FROM nodes n
                    WHERE n.pool_id = $1
                      AND EXISTS (SELECT 1 FROM node_atom_counts c WHERE c.node_id = n.id
                                     AND c.open IS DISTINCT FROM capacity_node_open(n.observed_generation, n.no_schedule_reasons, n.taints))
                    FOR SHARE OF n SKIP LOCKED),
                   -- their count rows in key order, as every statement that locks several
                   locked AS (
                   SELECT c.node_id, c.kind, c.model, c.profile, s.open FROM node_atom_counts c JOIN stale s ON s.id = c.node_id
                    WHERE c.open IS DISTINCT FROM s.open
                    ORDER BY c.node_id COLLATE \"C\", c.kind, c.model, c.profile
                      FOR UPDATE OF c)
                 UPDATE node_atom_counts c SET open = l.open FROM locked l
                  WHERE c.node_id = l.node_id AND c.kind = l.kind AND c.model = l.model AND c.profile = l.profile",
                &[&pool],
            )
            .await?;
        if repaired > 0 {
            tracing::info!(pool, repaired, "capacity.rollup: open flags of node counts put right");
        }
        // Recomputed from the truth each time: counts of bookable, healthy atoms and their idle
        // share, schedulable nodes, and free scalars.
        tx.execute(
            "INSERT INTO pool_capacity_rollup AS r (pool_id, atoms, nodes, schedulable_nodes, vcpu_free, memory_mib_free,
                                                    disk_gib_free, updated_at)
             SELECT p.id,
                    coalesce((SELECT jsonb_agg(jsonb_build_object('kind', kind, 'model', model, 'profile', profile,
                                                                  'total', total, 'idle', idle) ORDER BY kind, model, profile)
                                FROM (SELECT kind, model, profile, sum(total)::int AS total, sum(idle)::int AS idle
                                        FROM node_atom_counts WHERE pool_id = p.id GROUP BY kind, model, profile) a
                               WHERE total > 0), '[]'),
                    (SELECT count(*) FROM nodes WHERE pool_id = p.id),
                    (SELECT count(*) FROM nodes WHERE pool_id = p.id AND observed_generation >= 1
                                                  AND cardinality(no_schedule_reasons) = 0),
                    coalesce((SELECT sum(floor(vcpu_allocatable * vcpu_ratio) - vcpu_allocated) FROM node_resources nr
                                JOIN nodes n ON n.id = nr.node_id WHERE n.pool_id = p.id), 0)::bigint,
                    coalesce((SELECT sum(floor(memory_mib_allocatable * memory_ratio) - memory_mib_allocated) FROM node_resources nr
                                JOIN nodes n ON n.id = nr.node_id WHERE n.pool_id = p.id), 0)::bigint,
                    coalesce((SELECT sum(floor(disk_gib_allocatable * disk_ratio) - disk_gib_allocated) FROM node_resources nr
                                JOIN nodes n ON n.id = nr.node_id WHERE n.pool_id = p.id), 0)::bigint,
                    compute_now()
               FROM pools p WHERE p.id = $1
             ON CONFLICT (pool_id) DO UPDATE SET atoms = EXCLUDED.atoms, nodes = EXCLUDED.nodes,
               schedulable_nodes = EXCLUDED.schedulable_nodes, vcpu_free = EXCLUDED.vcpu_free,
               memory_mib_free = EXCLUDED.memory_mib_free, disk_gib_free = EXCLUDED.disk_gib_free,
               updated_at = EXCLUDED.updated_at",
            &[&pool],
        )
        .await?;
        tx.commit().await?;
        Ok(Outcome::Done)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        pools_in(ctx, shards).await
    }
}

/// Watches inventory events: refreshes the node's atom counts and wakes its pool's rollup.
pub struct InventoryWatcher;

#[async_trait::async_trait]
impl Sink for InventoryWatcher {
    fn name(&self) -> &str {
        "capacity.inventory"
    }

    async fn deliver(&self, tx: &Transaction<'_>, events: &[Event]) -> Result<(), RunError> {
        let mut nodes: Vec<String> = Vec::new();
        for e in events {
            let node = match e.event_type.as_str() {
                t if t.starts_with("node.") => Some(e.subject.clone()),
                t if t.starts_with("device.") => e.data.get("nodeId").and_then(|v| v.as_str()).map(String::from),
                _ => None,
            };
            if let Some(n) = node && !nodes.contains(&n) {
                nodes.push(n);
            }
        }
        refresh_nodes(tx, &nodes).await?;
        Ok(())
    }
}

/// Refreshes the atom counts of `nodes` and wakes their pools' rollups.
pub async fn refresh_nodes(tx: &impl tokio_postgres::GenericClient, nodes: &[String]) -> Result<(), DbError> {
    // In id order (bytes, as the rollup's repair of open flags orders them, in the "C" collation):
    // each refresh locks its node's count rows.
    let mut nodes = nodes.to_vec();
    nodes.sort();
    for n in &nodes {
        tx.execute("SELECT capacity_refresh_node_counts($1)", &[n]).await?;
    }
    let pools: Vec<String> = tx
        .query("SELECT DISTINCT pool_id FROM nodes WHERE id = ANY($1)", &[&nodes])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    work_queue::enqueue_many(tx, &ROLLUP_KIND, &pools).await?;
    Ok(())
}
