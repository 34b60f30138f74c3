//! `better-compute capacity`: each pool's capacity, as operators see it.

/// Options of `better-compute capacity`.
#[derive(Debug, clap::Args)]
pub struct CapacityArgs {
    #[command(flatten)]
    db: better_compute_server::DatabaseArgs,
    /// table (default: the summary for people), json, yaml or jsonpath=EXPR (`.items[*].pool`).
    #[arg(short = 'o', long, default_value = "table")]
    output: crate::output::Output,
}

/// Prints, per pool, the atoms per class (total and idle), nodes, free scalars and reservations.
pub async fn run(args: CapacityArgs) -> anyhow::Result<()> {
    use crate::output::Output;
    let client = better_compute_db::pool::connect(&args.db.database_url).await?;
    if matches!(args.output, Output::Table | Output::Wide) {
        print!("{}", summary(&client).await?);
        return Ok(());
    }
    let items = better_compute_capacity::pools::pool_capacities(&client).await?;
    crate::ops::print_as(&serde_json::json!({"items": items}), &args.output)
}

/// The text of the capacity view (also printed by `dev`).
pub async fn summary(client: &tokio_postgres::Client) -> anyhow::Result<String> {
    use std::fmt::Write;
    let pools = better_compute_capacity::pools::pool_capacities(client).await?;
    let mut out = String::new();
    if pools.is_empty() {
        writeln!(out, "no pools yet")?;
    }
    for p in pools {
        writeln!(out, "pool {} ({})", p.pool, p.pool_id)?;
        match (&p.atoms, p.nodes, p.schedulable_nodes, p.vcpu_free, p.memory_mib_free) {
            (Some(atoms), Some(nodes), Some(schedulable), Some(vcpu), Some(memory)) => {
                writeln!(out, "  nodes {nodes} ({schedulable} schedulable), free vCPU {vcpu}, free memory {memory} MiB")?;
                for a in atoms.as_array().into_iter().flatten() {
                    let profile = a["profile"].as_str().filter(|p| !p.is_empty()).map(|p| format!(" {p}")).unwrap_or_default();
                    writeln!(out, "  {:<5} {}{profile}: {} of {} idle", a["kind"].as_str().unwrap_or(""), a["model"].as_str().unwrap_or(""), a["idle"], a["total"])?;
                }
            }
            _ => writeln!(out, "  (rollup not computed yet)")?,
        }
        let by_state: Vec<String> = p.reservations.iter().map(|(state, n)| format!("{state} {n}")).collect();
        writeln!(out, "  reservations: {}", if by_state.is_empty() { "none".to_owned() } else { by_state.join(", ") })?;
    }
    Ok(out)
}
