//! jobs.list: the jobs as `better-compute jobs` shows them (each queue's depth, due and failing
//! keys, the newest error; who holds which shard and singleton; each job's last tick per worker),
//! for operators and the console.

use better_compute_runtime::authz::Resource;
use better_compute_runtime::status::{self, Holder, JobRun, QueueStatus};
use serde::Serialize;

use super::Empty;
use crate::method::{read, Ctx};
use crate::Method;

/// The jobs' state.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
struct JobsView {
    /// Every job's queue (those with nothing queued too).
    queues: Vec<QueueStatus>,
    /// The leases each worker holds.
    holders: Vec<Holder>,
    /// Each job's last tick on each worker.
    runs: Vec<JobRun>,
}

pub(crate) fn methods() -> Vec<Method> {
    vec![read(
        "jobs.list",
        "The jobs: each queue's depth, due, claimed and failing keys and newest error; the shards and singletons each worker holds; each job's last tick per worker.",
        "compute:jobs:read at fleet scope",
        |ctx: Ctx, _: Empty| async move {
            ctx.check(status::JOBS_READ, Resource::Fleet).await?;
            let db = ctx.read().await?;
            let jobs = ctx.state.registry.job_names();
            Ok(JobsView { queues: status::queues(&*db, &jobs).await?, holders: status::holders(&*db).await?, runs: status::job_runs(&*db).await? })
        },
    )]
}
