//! `better-compute audit`: export the audit log from the database, and verify an export offline.

use std::io::{BufRead, Write};

use anyhow::{bail, Context};
use better_compute_audit::verify::{verify, ExportLine};

/// Options of `better-compute audit`.
#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    #[command(subcommand)]
    command: AuditCommand,
}

#[derive(Debug, clap::Subcommand)]
enum AuditCommand {
    /// Write the placed entries and checkpoints as JSON lines (entries in log order, each checkpoint
    /// after the last entry it covers), from the database at DATABASE_URL, to stdout or --out.
    Export {
        #[command(flatten)]
        db: better_compute_server::DatabaseArgs,
        /// The file to write (default: stdout).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Check an export without the database: every entry's chain hash in log order, and every
    /// checkpoint's Merkle root, chain hash and Ed25519 signature. Names the first entry or
    /// checkpoint that does not fit; exits 1 then.
    Verify {
        /// The export (JSON lines).
        file: std::path::PathBuf,
        /// The control plane's public key (64 hex digits) the checkpoints must be signed with.
        /// Without it an export is only checked against itself: say so, and prefer passing it.
        #[arg(long)]
        public_key: Option<String>,
    },
}

/// Entries read per page of the export.
const PAGE: i64 = 10_000;

/// Runs `audit`.
pub async fn run(args: AuditArgs) -> anyhow::Result<()> {
    match args.command {
        AuditCommand::Export { db, out } => export(&db.database_url, out.as_deref()).await,
        AuditCommand::Verify { file, public_key } => verify_file(&file, public_key.as_deref()),
    }
}

async fn export(url: &str, out: Option<&std::path::Path>) -> anyhow::Result<()> {
    let mut client = better_compute_db::pool::connect(url).await?;
    let mut w: Box<dyn Write> = match out {
        Some(p) => Box::new(std::io::BufWriter::new(std::fs::File::create(p).with_context(|| format!("cannot write {}", p.display()))?)),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    let (mut from, mut entries) = (0i64, 0u64);
    // A pruned log starts at its anchor.
    if let Some(a) = better_compute_audit::prune::anchor(&client.build_transaction().read_only(true).start().await?).await? {
        from = a.checkpoint.tree_size;
        serde_json::to_writer(&mut w, &ExportLine::Anchor(a))?;
        w.write_all(b"\n")?;
    }
    loop {
        // One snapshot per page; the log only grows, so pages join up.
        let tx = client.build_transaction().read_only(true).start().await?;
        let page = better_compute_audit::log::export_page(&tx, from, PAGE).await?;
        tx.rollback().await?;
        let n = page.iter().filter(|l| matches!(l, ExportLine::Entry(_))).count() as i64;
        for line in &page {
            serde_json::to_writer(&mut w, line)?;
            w.write_all(b"\n")?;
        }
        entries += n as u64;
        from += n;
        eprint!("\rexported {entries} entries");
        if n < PAGE {
            break;
        }
    }
    // How far it reaches, so a file cut short is told apart from a complete one.
    serde_json::to_writer(&mut w, &ExportLine::End(better_compute_audit::verify::End { tree_size: from }))?;
    w.write_all(b"\n")?;
    w.flush()?;
    eprintln!("\rexported {entries} entries; check it with `better-compute audit verify FILE --public-key …`");
    Ok(())
}

fn verify_file(file: &std::path::Path, public_key: Option<&str>) -> anyhow::Result<()> {
    let key = public_key.map(|k| hex::decode(k).ok().filter(|b| b.len() == 32).context("--public-key takes 64 hex digits (the control plane's Ed25519 public key)")).transpose()?;
    let f = std::fs::File::open(file).with_context(|| format!("cannot read {}", file.display()))?;
    let mut lines = Vec::new();
    for (i, l) in std::io::BufReader::new(f).lines().enumerate() {
        let l = l?;
        if l.trim().is_empty() {
            continue;
        }
        lines.push(serde_json::from_str::<ExportLine>(&l).with_context(|| format!("line {} of {} is not an audit export line", i + 1, file.display()))?);
    }
    let v = verify(&lines, key.as_deref());
    if let Some(problem) = v.problem {
        bail!("{problem} ({} entries and {} checkpoints verified before it)", v.entries, v.checkpoints);
    }
    if key.is_none() {
        eprintln!("no --public-key: the checkpoints were checked against their own keys only");
    }
    println!(
        "ok: complete up to log index {}: {} entries chained, {} checkpoints signed and matching",
        v.reaches.unwrap_or_default(),
        v.entries,
        v.checkpoints
    );
    Ok(())
}
