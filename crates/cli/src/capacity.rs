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

/// The query both views read: per pool, its name and id, its rollup, and reservations by state.
const POOLS: &str = "SELECT s.name || '/' || p.name, p.id, r.atoms, r.nodes, r.schedulable_nodes, r.vcpu_free, r.memory_mib_free,
                            (SELECT string_agg(state || ' ' || n, ', ' ORDER BY state) FROM
                               (SELECT state, count(*) n FROM reservations WHERE pool_id = p.id GROUP BY state) x),
                            (SELECT coalesce(jsonb_object_agg(state, n), '{}') FROM
                               (SELECT state, count(*) n FROM reservations WHERE pool_id = p.id GROUP BY state) y)
                       FROM pools p JOIN sites s ON s.id = p.site_id LEFT JOIN pool_capacity_rollup r ON r.pool_id = p.id
                      ORDER BY 1";

/// Prints, per pool, the atoms per class (total and idle), nodes, free scalars and reservations.
pub async fn run(args: CapacityArgs) -> anyhow::Result<()> {
    use crate::output::Output;
    let client = better_compute_db::pool::connect(&args.db.database_url).await?;
    if matches!(args.output, Output::Table | Output::Wide) {
        print!("{}", summary(&client).await?);
        return Ok(());
    }
    let items: Vec<serde_json::Value> = client
        .query(POOLS, &[])
        .await?
        .iter()
        .map(|r| {
            serde_json::json!({
                "pool": r.get::<_, String>(0), "poolId": r.get::<_, String>(1), "atoms": r.get::<_, Option<serde_json::Value>>(2),
                "nodes": r.get::<_, Option<i32>>(3), "schedulableNodes": r.get::<_, Option<i32>>(4),
                "vcpuFree": r.get::<_, Option<i64>>(5), "memoryMibFree": r.get::<_, Option<i64>>(6),
                "reservations": r.get::<_, serde_json::Value>(8),
            })
        })
        .collect();
    crate::ops::print_as(&serde_json::json!({"items": items}), &args.output)
}

/// The text of the capacity view (also printed by `dev`).
pub async fn summary(client: &tokio_postgres::Client) -> anyhow::Result<String> {
    use std::fmt::Write;
    let rows = client.query(POOLS, &[]).await?;
    let mut out = String::new();
    if rows.is_empty() {
        writeln!(out, "no pools yet")?;
    }
    for r in rows {
        let (name, id): (String, String) = (r.get(0), r.get(1));
        writeln!(out, "pool {name} ({id})")?;
        match r.get::<_, Option<serde_json::Value>>(2) {
            None => writeln!(out, "  (rollup not computed yet)")?,
            Some(atoms) => {
                writeln!(
                    out,
                    "  nodes {} ({} schedulable), free vCPU {}, free memory {} MiB",
                    r.get::<_, i32>(3),
                    r.get::<_, i32>(4),
                    r.get::<_, i64>(5),
                    r.get::<_, i64>(6)
                )?;
                for a in atoms.as_array().into_iter().flatten() {
                    let profile = a["profile"].as_str().filter(|p| !p.is_empty()).map(|p| format!(" {p}")).unwrap_or_default();
                    writeln!(out, "  {:<5} {}{profile}: {} of {} idle", a["kind"].as_str().unwrap_or(""), a["model"].as_str().unwrap_or(""), a["idle"], a["total"])?;
                }
            }
        }
        writeln!(out, "  reservations: {}", r.get::<_, Option<String>>(7).unwrap_or_else(|| "none".into()))?;
    }
    Ok(out)
}
