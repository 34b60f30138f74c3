//! Operator subcommands that act through the database until the HTTP API exists: `nodes get`,
//! `commands run|get|cancel`, and `docs command-kinds`.

use better_compute_core::Caller;
use better_compute_nodes::commands::{self, RunCommand};
use better_compute_runtime::authz::LocalOperator;

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
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
    /// Print a node as JSON: labels, taints, noScheduleReasons, liveness, generation and observedGeneration.
    Get {
        /// The node id (node_…).
        node_id: String,
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
}

/// `better-compute commands …`.
#[derive(Debug, clap::Args)]
pub struct CommandsArgs {
    /// The tenant acting (idempotency keys are scoped to tenant and identity).
    #[arg(long, env = "BETTER_COMPUTE_TENANT", default_value = "ten_operator")]
    tenant: String,
    /// The identity acting.
    #[arg(long, env = "BETTER_COMPUTE_IDENTITY", default_value = "idn_operator")]
    identity: String,
    #[command(subcommand)]
    cmd: CommandsCmd,
}

#[derive(Debug, clap::Subcommand)]
enum CommandsCmd {
    /// Queue one of diag.nvml, inventory.refresh, logs.collect, node.reboot on a node.
    Run {
        /// The node id (node_…).
        #[arg(long)]
        node: String,
        /// The command kind.
        #[arg(long)]
        kind: String,
        /// The payload, as the kind's proto3 JSON (see docs/command-kinds.md).
        #[arg(long, default_value = "{}")]
        payload: String,
        /// A key of your choosing: running again with it returns the same command.
        #[arg(long)]
        idempotency_key: String,
        /// How long the node may still accept it (10 to 3600 s).
        #[arg(long, default_value_t = 600)]
        not_after_seconds: i64,
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
    /// Print a command as JSON.
    Get {
        /// The node id.
        #[arg(long)]
        node: String,
        /// The command id (cmd_…).
        command_id: String,
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
    /// Cancel a command: pending ones are never sent; in-flight ones get a Cancel.
    Cancel {
        /// The node id.
        #[arg(long)]
        node: String,
        /// The command id (cmd_…).
        command_id: String,
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
}

/// `better-compute docs …`.
#[derive(Debug, clap::Args)]
pub struct DocsArgs {
    #[command(subcommand)]
    page: DocsPage,
}

#[derive(Debug, clap::Subcommand)]
enum DocsPage {
    /// Print the command kinds reference (docs/command-kinds.md) from the registry.
    CommandKinds,
}

fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// Runs `nodes …`.
pub async fn nodes(args: NodesArgs) -> anyhow::Result<()> {
    let db = match &args.cmd {
        NodesCmd::List { db } | NodesCmd::Get { db, .. } => db,
    };
    let client = better_compute_db::pool::connect(&db.database_url).await?;
    match args.cmd {
        NodesCmd::List { .. } => {
            print!("{}", nodes_table(&client).await?);
            Ok(())
        }
        NodesCmd::Get { node_id, .. } => {
            let v = better_compute_nodes::inventory::get_node(&client, &node_id).await.map_err(better_compute_core::Error::from)?;
            print_json(&v)
        }
    }
}

/// The nodes with their generation and observed generation, as a table (also printed by `dev`).
pub async fn nodes_table(client: &tokio_postgres::Client) -> anyhow::Result<String> {
    use std::fmt::Write;
    let rows = client
        .query(
            "SELECT n.id, n.name, p.name, n.liveness, n.generation, n.observed_generation,
                    array_to_string(n.no_schedule_reasons, ',')
               FROM nodes n JOIN pools p ON p.id = n.pool_id ORDER BY p.name, n.name",
            &[],
        )
        .await?;
    let mut out = String::new();
    writeln!(out, "{:<32} {:<16} {:<10} {:<13} {:>10} {:>8}  {}", "NODE", "NAME", "POOL", "LIVENESS", "GENERATION", "OBSERVED", "NO-SCHEDULE")?;
    for r in rows {
        let (generation, observed): (i64, i64) = (r.get(4), r.get(5));
        writeln!(
            out,
            "{:<32} {:<16} {:<10} {:<13} {:>10} {:>8}  {}{}",
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, String>(2),
            r.get::<_, String>(3),
            generation,
            observed,
            r.get::<_, String>(6),
            if generation > observed { " (converging)" } else { "" }
        )?;
    }
    Ok(out)
}

/// Runs `commands …`.
pub async fn commands(args: CommandsArgs) -> anyhow::Result<()> {
    let db = match &args.cmd {
        CommandsCmd::Run { db, .. } | CommandsCmd::Get { db, .. } | CommandsCmd::Cancel { db, .. } => db,
    };
    let mut client = better_compute_db::pool::connect(&db.database_url).await?;
    let registry = crate::registry()?;
    let caller = Caller { tenant_id: &args.tenant, identity_id: &args.identity };
    match args.cmd {
        CommandsCmd::Run { node, kind, payload, idempotency_key, not_after_seconds, .. } => {
            let payload: serde_json::Value =
                serde_json::from_str(&payload).map_err(|e| anyhow::anyhow!("--payload is not JSON: {e}"))?;
            let req = RunCommand { node_id: node, kind, payload, idempotency_key: Some(idempotency_key), not_after_seconds: Some(not_after_seconds) };
            print_json(&commands::run(&mut client, &registry, &LocalOperator, caller, &req).await?)
        }
        CommandsCmd::Get { node, command_id, .. } => {
            print_json(&commands::get_as(&client, &LocalOperator, caller, &node, &command_id).await?)
        }
        CommandsCmd::Cancel { node, command_id, .. } => {
            print_json(&commands::cancel_as(&mut client, &LocalOperator, caller, &node, &command_id).await?)
        }
    }
}

/// Runs `docs …`.
pub fn docs(args: DocsArgs) -> anyhow::Result<()> {
    match args.page {
        DocsPage::CommandKinds => {
            print!("{}", better_compute_runtime::commands::reference_page(crate::registry()?.command_kinds()));
            Ok(())
        }
    }
}

/// `better-compute reservations …`.
#[derive(Debug, clap::Args)]
pub struct ReservationsArgs {
    /// The tenant acting.
    #[arg(long, env = "BETTER_COMPUTE_TENANT", default_value = crate::dev::DEV_TENANT)]
    tenant: String,
    /// The identity acting.
    #[arg(long, env = "BETTER_COMPUTE_IDENTITY", default_value = "idn_dev")]
    identity: String,
    #[command(subcommand)]
    cmd: ReservationsCmd,
}

#[derive(Debug, clap::Subcommand)]
enum ReservationsCmd {
    /// Create a reservation from its JSON request, e.g.
    /// '{"poolId":"pool_…","gpu":{"kind":"gpu","model":"H100-80GB","count":2},"vcpu":16,"memoryMib":65536,"durationS":3600}'.
    Create {
        /// The request (reservations.create's JSON body; see docs/capacity.md).
        request: String,
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
    /// Print a reservation.
    Get {
        /// The reservation id (res_…).
        id: String,
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
    /// List the tenant's reservations, a page at a time.
    List {
        /// Only this state.
        #[arg(long)]
        state: Option<String>,
        /// The cursor from the previous page.
        #[arg(long)]
        cursor: Option<String>,
        /// Page size (1 to 500).
        #[arg(long, default_value_t = 50)]
        limit: i64,
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
    /// Move a reservation's end later.
    Extend {
        /// The reservation id.
        id: String,
        /// The new end (RFC 3339).
        #[arg(long)]
        ends_at: String,
        /// Makes a retry return the first result.
        #[arg(long)]
        idempotency_key: Option<String>,
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
    /// End a reservation now and give back its quota, devices and scalars.
    Release {
        /// The reservation id.
        id: String,
        #[command(flatten)]
        db: crate::DatabaseArgs,
    },
}

/// Runs `reservations …`.
pub async fn reservations(args: ReservationsArgs) -> anyhow::Result<()> {
    use better_compute_capacity::reservations as r;
    let db = match &args.cmd {
        ReservationsCmd::Create { db, .. }
        | ReservationsCmd::Get { db, .. }
        | ReservationsCmd::List { db, .. }
        | ReservationsCmd::Extend { db, .. }
        | ReservationsCmd::Release { db, .. } => db,
    };
    let mut client = better_compute_db::pool::connect(&db.database_url).await?;
    let caller = Caller { tenant_id: &args.tenant, identity_id: &args.identity };
    match &args.cmd {
        ReservationsCmd::Create { request, .. } => {
            let req: r::CreateReservation =
                serde_json::from_str(request).map_err(|e| anyhow::anyhow!("the request is not a reservations.create body: {e}"))?;
            print_json(&r::create(&mut client, caller, &req).await?)
        }
        ReservationsCmd::Get { id, .. } => print_json(&r::get(&client, caller, id).await?),
        ReservationsCmd::List { state, cursor, limit, .. } => {
            print_json(&r::list(&client, caller, state.as_deref(), cursor.as_deref(), *limit).await?)
        }
        ReservationsCmd::Extend { id, ends_at, idempotency_key, .. } => {
            print_json(&r::extend(&mut client, caller, id, ends_at, idempotency_key.as_deref()).await?)
        }
        ReservationsCmd::Release { id, .. } => print_json(&r::release(&mut client, caller, id).await?),
    }
}
