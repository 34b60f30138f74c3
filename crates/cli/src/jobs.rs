//! `better-compute jobs`: the operator's view of the runtime.

/// Options of `better-compute jobs`.
#[derive(Debug, clap::Args)]
pub struct JobsArgs {
    #[command(flatten)]
    db: better_compute_server::DatabaseArgs,
    /// table (default), json, yaml or jsonpath=EXPR (`jsonpath=.queues[*].job`).
    #[arg(short = 'o', long, default_value = "table")]
    output: crate::output::Output,
    /// The same as `-o json`.
    #[arg(long, hide = true)]
    json: bool,
}

/// Prints the jobs' queues, their last runs, the workers' leases, and the live gateways with
/// their sessions.
pub async fn run(args: JobsArgs) -> anyhow::Result<()> {
    use better_compute_runtime::status;
    let client = better_compute_db::pool::connect(&args.db.database_url).await?;
    let registry = better_compute_server::registry()?;
    let queues = status::queues(&client, &registry.job_names()).await?;
    let runs = status::job_runs(&client).await?;
    let holders = status::holders(&client).await?;
    let gateways = better_compute_nodes::sessions::live_gateways(&client).await?;
    let output = if args.json { crate::output::Output::Json } else { args.output };
    if !matches!(output, crate::output::Output::Table | crate::output::Output::Wide) {
        return crate::ops::print_as(&serde_json::json!({ "queues": queues, "runs": runs, "holders": holders, "gateways": gateways }), &output);
    }
    println!("{:<24} {:>7} {:>6} {:>8} {:>8} {:>12}  LAST ERROR", "JOB", "QUEUED", "DUE", "CLAIMED", "FAILING", "OLDEST DUE");
    for q in &queues {
        let oldest = match (&q.oldest_due_s, &q.oldest_due_key) {
            (Some(s), Some(k)) => format!("{s:.1}s {k}"),
            _ => "-".to_owned(),
        };
        println!(
            "{:<24} {:>7} {:>6} {:>8} {:>8} {:>12}  {}",
            q.job,
            q.depth,
            q.due,
            q.claimed,
            q.failing,
            oldest,
            q.last_error.as_deref().unwrap_or("-")
        );
    }
    println!();
    println!("{:<24} {:<32} {:>8}  LAST TICK", "JOB", "WORKER", "TICKS");
    for r in &runs {
        println!("{:<24} {:<32} {:>8}  {}", r.job, r.worker_id, r.ticks, r.last_report);
    }
    println!();
    println!("{:<32} {:>5} {:>7} {:<12}  SINGLETONS", "WORKER", "LIVE", "SHARDS", "CHECKS");
    for h in &holders {
        let failing: Vec<&str> = h.checks.as_array().into_iter().flatten().filter(|c| c["ok"] == false).filter_map(|c| c["name"].as_str()).collect();
        let checks = if failing.is_empty() { "ok".to_owned() } else { failing.join(",") };
        println!("{:<32} {:>5} {:>7} {:<12}  {}", h.worker_id, h.live, h.shards.len(), checks, h.singletons.join(", "));
    }
    println!();
    println!("{:<32} {:>8} {:>12}", "GATEWAY", "SESSIONS", "LEASE LEFT");
    for g in &gateways {
        println!("{:<32} {:>8} {:>11.1}s", g.id, g.sessions, g.lease_left_s);
    }
    Ok(())
}
