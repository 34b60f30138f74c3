//! `better-compute usage export`: every usage window of a period through the API, a page at a time,
//! written as CSV or JSON lines to standard output, with progress on standard error.

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
        /// The server.
        #[arg(long, env = "BETTER_COMPUTE_URL", default_value = "http://127.0.0.1:8080")]
        url: String,
        /// A bearer token (`bct_…`) with compute:usage:read.
        #[arg(long, env = "BETTER_COMPUTE_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Your tenant.
        #[arg(long, env = "BETTER_COMPUTE_TENANT")]
        tenant: Option<String>,
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

const COLUMNS: &[&str] = &[
    "key", "reservationId", "tenantId", "poolId", "nodeId", "windowStart", "windowEnd", "adjustment", "gpuKind", "gpuModel", "migProfile",
    "atomSeconds", "vcpuSeconds", "memoryMibSeconds", "diskGibSeconds",
];

fn csv_field(v: &Value) -> String {
    let s = match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if s.contains([',', '"', '\n']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s }
}

/// Runs `usage …`.
pub async fn run(args: UsageArgs) -> anyhow::Result<()> {
    let UsageCmd::Export { url, token, tenant, from, to, all_tenants, format } = args.cmd;
    let token = token.context("no token: set BETTER_COMPUTE_TOKEN (dev prints one)")?;
    let http = better_compute_client::http().build()?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if format == "csv" {
        writeln!(out, "{}", COLUMNS.join(","))?;
    }
    let (mut page_token, mut n) = (None::<String>, 0u64);
    let started = std::time::Instant::now();
    loop {
        let mut body = serde_json::json!({"from": from, "to": to, "allTenants": all_tenants, "pageSize": 500});
        if let Some(t) = &tenant {
            body["tenantId"] = t.clone().into();
        }
        if let Some(t) = &page_token {
            body["pageToken"] = t.clone().into();
        }
        let r = http
            .post(format!("{url}/v1/usage.export"))
            .bearer_auth(&token)
            .json(&body)
            .send()
            .await
            .with_context(|| format!("cannot reach the API at {url}; is `better-compute dev` running? (set BETTER_COMPUTE_URL)"))?;
        let ok = r.status().is_success();
        let v: Value = r.json().await.context("usage.export answered without JSON")?;
        if !ok {
            bail!("{}: {}", v["code"].as_str().unwrap_or("ERROR"), v["message"].as_str().unwrap_or(""));
        }
        for w in v["items"].as_array().into_iter().flatten() {
            if format == "csv" {
                writeln!(out, "{}", COLUMNS.iter().map(|c| csv_field(&w[*c])).collect::<Vec<_>>().join(","))?;
            } else {
                writeln!(out, "{w}")?;
            }
            n += 1;
        }
        eprint!("\rexported {n} usage windows ({} s)   ", started.elapsed().as_secs());
        match v["nextPageToken"].as_str() {
            Some(t) => page_token = Some(t.to_owned()),
            None => break,
        }
    }
    out.flush()?;
    eprintln!("\rexported {n} usage windows in {} s   ", started.elapsed().as_secs());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_csv_field_is_quoted_only_when_it_must_be() {
        assert_eq!(csv_field(&Value::Null), "");
        assert_eq!(csv_field(&serde_json::json!(7200.5)), "7200.5");
        assert_eq!(csv_field(&serde_json::json!("cmp:res_1:2030-01-01T00:00:00Z")), "cmp:res_1:2030-01-01T00:00:00Z");
        assert_eq!(csv_field(&serde_json::json!("a,\"b\"")), "\"a,\"\"b\"\"\"");
    }
}
