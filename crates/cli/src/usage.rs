//! `better-compute usage export`: every usage window of a period, streamed by the API
//! (`GET /v1/usage.export`) as CSV or JSON lines to standard output, with progress on standard error.

use std::io::Write;

use anyhow::{bail, Context};
use serde_json::Value;

/// `better-compute usage …`.
#[derive(Debug, clap::Args)]
pub struct UsageArgs {
    #[command(subcommand)]
    cmd: UsageCmd,
}

#[derive(Debug, clap::Subcommand)]
enum UsageCmd {
    /// Export usage windows (and adjustments) whose window starts in [--from, --to): one row each,
    /// keyed `cmp:<reservationId>:<windowStart>[:<adjustment>]`, for a billing system to load.
    Export {
        /// The server, a token with compute:usage:read, your tenant.
        #[command(flatten)]
        server: crate::api::ServerArgs,
        /// RFC 3339: windows starting at or after it.
        #[arg(long)]
        from: String,
        /// RFC 3339: windows starting before it.
        #[arg(long)]
        to: String,
        /// Every tenant's usage (compute:usage:read at fleet scope).
        #[arg(long)]
        all_tenants: bool,
        /// `csv` or `jsonl` (one JSON object per line).
        #[arg(long, default_value = "csv", value_parser = ["csv", "jsonl"])]
        format: String,
    },
}

/// Runs `usage …`.
pub async fn run(args: UsageArgs) -> anyhow::Result<()> {
    let UsageCmd::Export { server, from, to, all_tenants, format } = args.cmd;
    let server = server.resolve()?;
    let http = server.http()?.build()?;
    let url = server.url().to_owned();
    let crate::api::ServerArgs { token, tenant, .. } = server;
    let token = token.context("no token: set BETTER_COMPUTE_TOKEN (dev prints one)")?;
    let mut query = vec![("from", from), ("to", to), ("format", format.clone()), ("allTenants", all_tenants.to_string())];
    if let Some(t) = tenant {
        query.push(("tenantId", t));
    }
    let mut r = http
        .get(format!("{url}/v1/usage.export"))
        .bearer_auth(&token)
        .query(&query)
        .send()
        .await
        .with_context(|| crate::api::unreachable_hint(&url))?;
    if !r.status().is_success() {
        let v: Value = r.json().await.context("usage.export answered an error without JSON")?;
        bail!("{}: {}", v["code"].as_str().unwrap_or("ERROR"), v["message"].as_str().unwrap_or(""));
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let started = std::time::Instant::now();
    let mut lines = 0u64;
    let header_lines = u64::from(format == "csv");
    let mut shown = std::time::Instant::now();
    // A stream cut by the server or the network is an error here, never a shorter export.
    while let Some(chunk) = r.chunk().await.context("the export was cut off; run it again (a billing system dedupes rows by their key)")? {
        out.write_all(&chunk)?;
        lines += chunk.iter().filter(|b| **b == b'\n').count() as u64;
        if shown.elapsed().as_millis() >= 200 {
            eprint!("\rexported {} usage windows ({} s)   ", lines.saturating_sub(header_lines), started.elapsed().as_secs());
            shown = std::time::Instant::now();
        }
    }
    out.flush()?;
    eprintln!("\rexported {} usage windows in {} s   ", lines.saturating_sub(header_lines), started.elapsed().as_secs());
    Ok(())
}
