//! `site-boot`: one pass over every site every 5 s, starting a site's boot after a site-wide
//! outage and ending it when enough of its nodes converged ([`crate::sessions::site_boot`]).

use std::time::Duration;

use better_compute_runtime::{Kind, Outcome, Periodic, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::sessions::site_boot::evaluate;

/// The job's kind: one singleton key, `all`.
pub const SITE_BOOT: Kind = Kind { name: "site-boot", shard_by: ShardBy::None };

const PERIODIC: &[Periodic] = &[Periodic { key: "all", every: Duration::from_secs(5) }];

/// The `site-boot` job.
pub struct SiteBootJob;

#[async_trait::async_trait]
impl Reconciler for SiteBootJob {
    fn kind(&self) -> Kind {
        SITE_BOOT
    }

    fn periodic(&self) -> &[Periodic] {
        PERIODIC
    }

    async fn run(&self, ctx: &ReconcileContext, _key: &str) -> Result<Outcome, RunError> {
        let r = ctx.in_fenced_tx(async |tx| Ok(evaluate(tx).await?)).await?;
        ctx.count("site boots started", r.started);
        ctx.count("site boots ended", r.ended);
        Ok(Outcome::Done)
    }

    async fn keys(&self, _ctx: &ReconcileContext, _shards: &[i16]) -> Result<Vec<String>, RunError> {
        Ok(vec!["all".into()])
    }
}
