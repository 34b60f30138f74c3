//! `better-compute admin …`: administration through the database itself.

use anyhow::Context;

/// Options of `better-compute admin`.
#[derive(Debug, clap::Args)]
pub struct AdminArgs {
    #[command(subcommand)]
    cmd: AdminCmd,
}

#[derive(Debug, clap::Subcommand)]
enum AdminCmd {
    /// Create the first tenant, its admin (fleet-admin at fleet scope, admin of the tenant) and a
    /// token, printed once. Refused once done: then admins use `api tokens.create`.
    Bootstrap {
        #[command(flatten)]
        db: better_compute_server::DatabaseArgs,
        /// The first tenant's name.
        #[arg(long, default_value = "operators")]
        tenant: String,
        /// The admin identity's name.
        #[arg(long, default_value = "admin")]
        admin: String,
    },
    /// The command-signing key destructive commands are signed with (in the CA's folder).
    #[command(subcommand)]
    CommandKey(CommandKeyCmd),
    /// Show or set the fleet's usage window (metering): windows are aligned to it in UTC. Change
    /// it between billing periods: windows already closed keep their size.
    UsageWindow {
        #[command(flatten)]
        db: better_compute_server::DatabaseArgs,
        /// The new size in seconds: 60 to 86400, a divisor of a day (default: show it).
        #[arg(long)]
        set_s: Option<i32>,
    },
    /// Show or set how long the audit log keeps placed entries: they are pruned only below a
    /// checkpoint older than this, which exports then start from (docs/audit.md).
    AuditRetention {
        #[command(flatten)]
        db: better_compute_server::DatabaseArgs,
        /// Keep entries this many seconds (at least 3600).
        #[arg(long, conflicts_with = "forever")]
        set_s: Option<i32>,
        /// Keep every entry (the default).
        #[arg(long)]
        forever: bool,
    },
}

/// `admin command-key`.
#[derive(Debug, clap::Subcommand)]
enum CommandKeyCmd {
    /// Start a rotation: make a new key, endorse it with the current one and announce both to every
    /// daemon (they pin the new one without joining again), then make it the folder's key. Restart
    /// the api and worker roles to sign with it. Running it again after a crash finishes it.
    Rotate {
        #[command(flatten)]
        db: better_compute_server::DatabaseArgs,
        /// The CA's folder (as the server's --ca-dir).
        #[arg(long, env = "BETTER_COMPUTE_CA_DIR", default_value = "./better-compute-ca")]
        ca_dir: std::path::PathBuf,
    },
    /// Finish a rotation: daemons forget every key but the newest. Run it once every node has
    /// converged and every api and worker role was restarted with the new key.
    RetirePrevious {
        #[command(flatten)]
        db: better_compute_server::DatabaseArgs,
        /// The CA's folder (as the server's --ca-dir).
        #[arg(long, env = "BETTER_COMPUTE_CA_DIR", default_value = "./better-compute-ca")]
        ca_dir: std::path::PathBuf,
    },
}

/// Runs `admin`.
pub async fn run(args: AdminArgs) -> anyhow::Result<()> {
    match args.cmd {
        AdminCmd::Bootstrap { db, tenant, admin } => {
            let mut client = better_compute_db::pool::connect(&db.database_url).await?;
            let done = better_compute_server::bootstrap_db(&mut client, &tenant, &admin).await?;
            println!("tenant    {} ({})", done.tenant.name, done.tenant.id);
            println!("admin     {} ({}): fleet-admin at fleet scope, admin of the tenant", done.identity.name, done.identity.id);
            println!("token     {} (expires {}); shown once, store it now", done.token.token.id, done.token.token.expires_at);
            println!();
            println!("export BETTER_COMPUTE_TENANT={}", done.tenant.id);
            println!("export BETTER_COMPUTE_TOKEN={}", done.token.secret);
            Ok(())
        }
        AdminCmd::CommandKey(CommandKeyCmd::Rotate { db, ca_dir }) => rotate_command_key(&db, &ca_dir).await,
        AdminCmd::UsageWindow { db, set_s } => {
            let client = better_compute_db::pool::connect(&db.database_url).await?;
            if let Some(s) = set_s {
                better_compute_capacity::usage::set_window_s(&client, s).await?;
            }
            println!("usage window: {} s", better_compute_capacity::usage::window_s(&client).await?);
            Ok(())
        }
        AdminCmd::AuditRetention { db, set_s, forever } => {
            let client = better_compute_db::pool::connect(&db.database_url).await?;
            if set_s.is_some() || forever {
                better_compute_audit::prune::set_retention_s(&client, set_s).await?;
            }
            match better_compute_audit::prune::retention(&client).await? {
                (Some(s), below) => println!("audit retention: {s} s; entries below log index {below} pruned"),
                (None, _) => println!("audit retention: for ever"),
            }
            Ok(())
        }
        AdminCmd::CommandKey(CommandKeyCmd::RetirePrevious { db, ca_dir }) => {
            let mut client = better_compute_db::pool::connect(&db.database_url).await?;
            let tx = client.transaction().await?;
            let nodes = better_compute_nodes::commands::keys::retire_previous(&tx).await?;
            tx.commit().await?;
            let previous = ca_dir.join(better_compute_runtime::signing::PREVIOUS_KEY_FILE);
            if previous.exists() {
                std::fs::remove_file(&previous).with_context(|| format!("removing {}", previous.display()))?;
            }
            if nodes == 0 {
                println!("no rotation under way: nothing to retire");
            } else {
                println!("retired the previous command-signing key; {nodes} nodes' desired state changed (daemons forget it as they converge)");
            }
            Ok(())
        }
    }
}

/// `admin command-key rotate`: the new key is written beside the current one first, announced in
/// the database second, and swapped in last, so a crash at any step leaves a state a second run
/// finishes (and daemons accept both keys all along).
async fn rotate_command_key(db: &better_compute_server::DatabaseArgs, ca_dir: &std::path::Path) -> anyhow::Result<()> {
    use better_compute_runtime::signing::{CommandSigner, KEY_FILE, NEXT_KEY_FILE, PREVIOUS_KEY_FILE};
    if !ca_dir.join(KEY_FILE).exists() {
        anyhow::bail!("{} holds no command-signing key: pass the fleet's --ca-dir (its servers made the key on first start)", ca_dir.display());
    }
    let current = CommandSigner::load_or_create(ca_dir)?;
    let next = CommandSigner::load_or_create_file(&ca_dir.join(NEXT_KEY_FILE))?;
    println!("1/3 new key written: {}", ca_dir.join(NEXT_KEY_FILE).display());
    let mut client = better_compute_db::pool::connect(&db.database_url).await?;
    let tx = client.transaction().await?;
    let announced = better_compute_nodes::commands::keys::announced(&tx).await?;
    let nodes = if announced.iter().any(|k| k.public_key == next.public_key()) {
        0 // a run that stopped after this step
    } else {
        better_compute_nodes::commands::keys::rotate(&tx, &current, &next).await?
    };
    tx.commit().await?;
    println!("2/3 announced to every daemon, endorsed by the current key ({nodes} nodes' desired state changed)");
    std::fs::rename(ca_dir.join(KEY_FILE), ca_dir.join(PREVIOUS_KEY_FILE)).context("keeping the current key aside")?;
    std::fs::rename(ca_dir.join(NEXT_KEY_FILE), ca_dir.join(KEY_FILE)).context("swapping in the new key")?;
    println!("3/3 the new key is the folder's key; the previous one is kept as {PREVIOUS_KEY_FILE}");
    println!();
    println!("Next: copy the folder to every server, restart the api and worker roles, wait until every node converged");
    println!("(`better-compute api nodes.list`), then run `better-compute admin command-key retire-previous`.");
    Ok(())
}
