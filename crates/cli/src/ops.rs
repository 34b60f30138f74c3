//! Operator subcommands that read the database directly: `nodes list|get|describe`, and `docs command-kinds|api|events|openapi|workflows|metrics`.

use crate::output::Output;


/// `better-compute nodes …`.
#[derive(Debug, clap::Args)]
pub struct NodesArgs {
    #[command(subcommand)]
    cmd: NodesCmd,
}

#[derive(Debug, clap::Subcommand)]
enum NodesCmd {
    /// List nodes: name, pool, liveness, generation and observed generation (converging while they
    /// differ), and why the placer skips them.
    List {
        /// table (default), wide, json, yaml or jsonpath=EXPR.
        #[arg(short = 'o', long, default_value = "table")]
        output: Output,
        #[command(flatten)]
        db: better_compute_server::DatabaseArgs,
    },
    /// Describe a node for people: conditions, GPUs and atoms, reservations now and next, its
    /// drain, its daemon's session, its newest commands and fleet events (`-o json` for JSON; the
    /// API's `nodes.describe` answers the same).
    Describe {
        /// The node id (node_…).
        node_id: String,
        /// table (default: the description for people), json, yaml or jsonpath=EXPR.
        #[arg(short = 'o', long, default_value = "table")]
        output: Output,
        #[command(flatten)]
        db: better_compute_server::DatabaseArgs,
    },
    /// Print a node as JSON: labels, taints, noScheduleReasons, liveness, generation and observedGeneration.
    Get {
        /// The node id (node_…).
        node_id: String,
        /// json (default), yaml, table or jsonpath=EXPR.
        #[arg(short = 'o', long, default_value = "json")]
        output: Output,
        #[command(flatten)]
        db: better_compute_server::DatabaseArgs,
    },
}

/// `better-compute commands …`.
#[derive(Debug, clap::Args)]
pub struct DocsArgs {
    #[command(subcommand)]
    page: DocsPage,
}

#[derive(Debug, clap::Subcommand)]
enum DocsPage {
    /// Print the command kinds reference (docs/command-kinds.md) from the registry.
    CommandKinds,
    /// Print the API reference (docs/api.md) from the OpenAPI document.
    Api,
    /// Print the event catalogue (docs/events.md) from the registry.
    Events,
    /// Print the OpenAPI document (crates/client/openapi.json, which the typed client is generated from).
    Openapi,
    /// Print the workflow definitions reference (docs/workflow-definitions.md) from the registry.
    Workflows,
    /// Print the metrics reference (docs/metrics.md) from the catalogue.
    Metrics,
}

/// Prints `v` as `-o` asks.
pub fn print_as(v: &impl serde::Serialize, output: &Output) -> anyhow::Result<()> {
    print!("{}", crate::output::render(&serde_json::to_value(v)?, output)?);
    Ok(())
}

/// Runs `nodes …`.
pub async fn nodes(args: NodesArgs) -> anyhow::Result<()> {
    let db = match &args.cmd {
        NodesCmd::List { db, .. } | NodesCmd::Get { db, .. } | NodesCmd::Describe { db, .. } => db,
    };
    let client = better_compute_db::pool::connect(&db.database_url).await?;
    match args.cmd {
        NodesCmd::List { output: Output::Table, .. } => {
            print!("{}", nodes_table(&client).await?);
            Ok(())
        }
        NodesCmd::List { output, .. } => {
            print_as(&serde_json::json!({"items": better_compute_nodes::listing::node_summaries(&client).await?}), &output)
        }
        NodesCmd::Describe { node_id, output, .. } => {
            let d = better_compute_api::describe::node(&client, &node_id).await?;
            if matches!(output, Output::Table | Output::Wide) {
                print!("{}", better_compute_api::describe::text(&d));
                return Ok(());
            }
            print_as(&d, &output)
        }
        NodesCmd::Get { node_id, output, .. } => {
            let v = better_compute_nodes::inventory::get_node(&client, &node_id).await.map_err(better_compute_core::Error::from)?;
            print_as(&v, &output)
        }
    }
}

/// The nodes with their generation and observed generation, as a table (also printed by `dev`).
pub async fn nodes_table(client: &tokio_postgres::Client) -> anyhow::Result<String> {
    use std::fmt::Write;
    let mut out = String::new();
    writeln!(out, "{:<32} {:<16} {:<10} {:<13} {:>10} {:>8}  NO-SCHEDULE", "NODE", "NAME", "POOL", "LIVENESS", "GENERATION", "OBSERVED")?;
    for n in better_compute_nodes::listing::node_summaries(client).await? {
        writeln!(
            out,
            "{:<32} {:<16} {:<10} {:<13} {:>10} {:>8}  {}{}",
            n.id,
            n.name,
            n.pool,
            n.liveness,
            n.generation,
            n.observed_generation,
            n.no_schedule_reasons.join(","),
            if n.generation > n.observed_generation { " (converging)" } else { "" }
        )?;
    }
    Ok(out)
}

/// Runs `docs …`.
pub fn docs(args: DocsArgs) -> anyhow::Result<()> {
    match args.page {
        DocsPage::CommandKinds => {
            print!("{}", better_compute_runtime::commands::reference_page(better_compute_server::registry()?.command_kinds()));
            Ok(())
        }
        DocsPage::Events => {
            print!("{}", better_compute_runtime::events::reference_page(&better_compute_server::registry()?.event_types()));
            Ok(())
        }
        DocsPage::Api => {
            print!("{}", better_compute_api::openapi::reference_page(&better_compute_api::all_methods()));
            Ok(())
        }
        DocsPage::Metrics => {
            print!("{}", better_compute_runtime::metrics::reference_page(&better_compute_server::metric_catalogue(&*better_compute_server::registry()?)));
            Ok(())
        }
        DocsPage::Workflows => {
            print!("{}", better_compute_runtime::workflow::reference_page(better_compute_server::registry()?.workflows()));
            Ok(())
        }
        DocsPage::Openapi => print_as(&better_compute_api::openapi::document(&better_compute_api::all_methods()), &Output::Json),
    }
}
