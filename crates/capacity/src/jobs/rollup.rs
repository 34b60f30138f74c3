//! `capacity.rollup`: one key per pool, keeping `pool_capacity_rollup` true and putting stale
//! open flags of the atom counts right.

use better_compute_runtime::{Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};


/// Keeps a pool's `pool_capacity_rollup` true; key: pool id.
pub const ROLLUP_KIND: Kind = Kind { name: "capacity.rollup", shard_by: ShardBy::Pool };

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

/// The pools in `shards`.
async fn pools_in(ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
    // In a read-only transaction, as every statement of the runtime: safe behind PgBouncer.
    let rows = ctx.read().await?.query("SELECT id FROM pools", &[]).await?;
    Ok(rows
        .iter()
        .map(|r| r.get::<_, String>(0))
        .filter(|id| shards.contains(&better_compute_core::shard::shard_of(id)))
        .collect())
}
