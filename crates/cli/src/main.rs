//! `better-compute`: one binary for every process of Better Compute.

mod admin;
mod api;
mod audit;
mod capacity;
mod daemon;
mod dev;
mod exit;
mod jobs;
mod ops;
mod output;
mod profile;
mod shell;
mod sse;
mod telemetry;
mod up;
mod usage;

use better_compute_server::{registry, DatabaseArgs};
use clap::{Parser, Subcommand};

/// Better Compute: a control plane for GPU fleets.
#[derive(Debug, Parser)]
#[command(
    name = "better-compute",
    version,
    propagate_version = true,
    after_help = "Exit status: 0 done; 1 failed; 2 usage (a bad flag or argument, or INVALID_ARGUMENT); 3 not found; \
                  4 conflict or precondition (CONFLICT, FAILED_PRECONDITION, QUOTA_EXCEEDED); 5 --wait gave up; \
                  69 the server or database cannot be reached (or UNAVAILABLE)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines on stderr look: text (colours only on a terminal), or json (one object per
    /// line: timestamp, level, target, fields, span; for a log shipper).
    #[arg(long, global = true, value_enum, env = "BETTER_COMPUTE_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    /// Export OpenTelemetry traces (OTLP over HTTP, protobuf) to the collector at this base URL,
    /// e.g. http://localhost:4318: a span per API request, per reconcile, per command run on a
    /// node. Off when unset.
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    otlp_endpoint: Option<String>,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run everything on this machine: a private PostgreSQL under ./.better-compute/, migrated, and a
    /// worker running every job. Data survives restarts; Ctrl-C stops it cleanly.
    Dev(dev::DevArgs),
    /// Run the scale-out shape on this machine, each role its own process: PostgreSQL, PgBouncer,
    /// 2 API servers, 2 workers, 2 gateways and 4 daemons (fake GPUs). A process that exits is
    /// started again; Ctrl-C stops them all.
    Up(up::UpArgs),
    /// Run server roles against DATABASE_URL (`api`, `gateway`, `worker`). Run many for scale and failover.
    Server(better_compute_server::ServerArgs),
    /// The node agent: joins with a join token, then holds one mTLS session to a gateway, converges
    /// the node on its desired state and runs commands.
    Daemon(daemon::DaemonArgs),
    /// Apply every pending migration to the database at DATABASE_URL, then exit.
    Migrate(DatabaseArgs),
    /// Print the schema of the database at DATABASE_URL as the checked-in snapshot has it
    /// (`schema/snapshot.sql`): run it on a freshly migrated database after changing a migration.
    Schema(DatabaseArgs),
    /// Show the jobs: queue depth, oldest due key, last errors, last runs, and who holds which shard.
    Jobs(jobs::JobsArgs),
    /// Call the HTTP API: `better-compute api METHOD key=value key:=json …` (`--list` lists methods).
    Api(api::ApiArgs),
    /// Administration through the database: `admin bootstrap` makes the first tenant, admin and token.
    Admin(admin::AdminArgs),
    /// Read nodes straight from the database (an operator's view; tenants use `api nodes.list`).
    Nodes(ops::NodesArgs),
    /// Print reference pages generated from the registry.
    Docs(ops::DocsArgs),
    /// Show each pool's capacity: atoms total and idle per class, nodes, free scalars, reservations.
    Capacity(capacity::CapacityArgs),
    /// Export metered usage (usage windows) as CSV or JSON lines, through the API.
    Usage(usage::UsageArgs),
    /// The audit log: `audit export` (from the database, as JSON lines) and `audit verify` (an
    /// export, offline: the hash chain, each checkpoint's Merkle root and signature).
    Audit(audit::AuditArgs),
    /// Run a benchmark and print its figures beside a pgbench baseline from the same run.
    Bench(better_compute_bench::BenchArgs),
    /// Run a simulated fleet against real gateway and worker processes with a seeded workload and
    /// seeded faults (SIGKILLs, partitions, database crashes, clock jumps, zombie workers), checking
    /// every invariant; stops at the first violation with the seed and a replay command.
    Sim(better_compute_sim::SimArgs),
    /// Save an API server and token as a profile (and make it current), after checking the server
    /// takes the token: `api` and `usage` then need no variables.
    Login(profile::LoginArgs),
    /// Print shell completions (bash, zsh, fish, elvish, powershell), e.g.
    /// `better-compute completions bash > /etc/bash_completion.d/better-compute`.
    Completions(shell::CompletionsArgs),
    /// Write manual pages (roff) for the binary and each command into a folder.
    Man(shell::ManArgs),
}

async fn migrate(args: DatabaseArgs) -> anyhow::Result<()> {
    let mut client = better_compute_db::pool::connect(&args.database_url).await?;
    let report = better_compute_db::migrate(&mut client, &registry()?.migrations()).await?;
    for m in &report.applied {
        println!("applied {m}");
    }
    println!("{} applied, {} already applied", report.applied.len(), report.already_applied);
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Output piped into `head` and closed early ends a short command quietly, as with any CLI tool,
    // instead of panicking in println!. Not the long-running network roles: a peer closing a
    // socket must not kill them (Rust ignores SIGPIPE for that reason).
    if !matches!(cli.command, Command::Dev(_) | Command::Up(_) | Command::Server(_) | Command::Daemon(_) | Command::Bench(_) | Command::Sim(_)) {
        // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    // The process's TLS provider (ring, as every connection here uses): clients that do not bring
    // their own settings, such as the OTLP exporter's, take it.
    better_compute_tls::install_process_default();
    // The long-running commands name their traces' service; every other command is the CLI.
    let command = match cli.command {
        Command::Dev(_) => "dev",
        Command::Up(_) => "up",
        Command::Server(_) => "server",
        Command::Daemon(_) => "daemon",
        Command::Bench(_) => "bench",
        Command::Sim(_) => "sim",
        _ => "cli",
    };
    let telemetry = match telemetry::init(cli.log_format, cli.otlp_endpoint.as_deref(), command) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e:#}");
            return std::process::ExitCode::from(exit::USAGE);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = runtime.block_on(async {
        match cli.command {
            Command::Dev(args) => dev::run(args).await,
            Command::Up(args) => up::run(args).await,
            Command::Server(args) => better_compute_server::run(args).await,
            Command::Daemon(args) => daemon::run(args).await,
            Command::Migrate(args) => migrate(args).await,
            Command::Schema(args) => {
                let client = better_compute_db::pool::connect(&args.database_url).await?;
                print!("{}", better_compute_db::schema::snapshot(&client).await?);
                Ok(())
            }
            Command::Jobs(args) => jobs::run(args).await,
            Command::Capacity(args) => capacity::run(args).await,
            Command::Usage(args) => usage::run(args).await,
            Command::Audit(args) => audit::run(args).await,
            Command::Nodes(args) => ops::nodes(args).await,
            Command::Api(args) => api::run(args).await,
            Command::Admin(args) => admin::run(args).await,
            Command::Docs(args) => ops::docs(args),
            Command::Bench(args) => better_compute_bench::run(args).await,
            Command::Sim(args) => better_compute_sim::run(args).await,
            Command::Login(args) => profile::login(args).await,
            Command::Completions(args) => shell::completions(args),
            Command::Man(args) => shell::man(args),
        }
    });
    drop(runtime);
    telemetry.shutdown();
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(exit::status_of(&e))
        }
    }
}
