//! `better-compute admin …`: administration through the database itself.

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
    }
}
