//! `better-compute`: one binary for every process of Better Compute.

mod dev;

use clap::{Parser, Subcommand};

/// Better Compute: a control plane for GPU fleets.
#[derive(Debug, Parser)]
#[command(name = "better-compute", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run everything on this machine: a private PostgreSQL under ./.better-compute/, migrated and
    /// ready. Data survives restarts; Ctrl-C stops it cleanly.
    Dev(dev::DevArgs),
    /// Apply every pending migration to the database at DATABASE_URL, then exit.
    Migrate(MigrateArgs),
}

#[derive(Debug, clap::Args)]
struct MigrateArgs {
    /// The database, as a URL (postgresql://user@host/db) or libpq key=value string.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
}

/// Every module's migrations, core first; registration order is merge order.
pub(crate) fn all_migrations() -> Vec<&'static [better_compute_db::Migration]> {
    vec![better_compute_db::CORE_MIGRATIONS]
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let mut client = better_compute_db::pool::connect(&args.database_url).await?;
    let report = better_compute_db::migrate(&mut client, &all_migrations()).await?;
    for m in &report.applied {
        println!("applied {m}");
    }
    println!("{} applied, {} already applied", report.applied.len(), report.already_applied);
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BETTER_COMPUTE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = runtime.block_on(async {
        match cli.command {
            Command::Dev(args) => dev::run(args).await,
            Command::Migrate(args) => migrate(args).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
