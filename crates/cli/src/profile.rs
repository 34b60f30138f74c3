//! Profiles: `$XDG_CONFIG_HOME/better-compute/config.toml` (else `~/.config/…`), mode 0600,
//! holds named API servers with their tokens, and which one is current, so `api` and `usage` need
//! no variables. A flag or variable given wins over the profile; `--profile NAME`
//! (`BETTER_COMPUTE_PROFILE`) picks another than the current. `login` writes one.
//!
//! ```toml
//! current = "prod"
//!
//! [profiles.prod]
//! url = "https://api.example.net"
//! token = "bct_…"
//! ca_cert = "/etc/better-compute/api-ca.pem"   # optional
//! tenant = "ten_…"                             # optional: the token's tenant otherwise
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::exit;

/// The file.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Config {
    /// The profile used when none is named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<String>,
    /// The profiles, by name.
    #[serde(default)]
    pub profiles: BTreeMap<String, Profile>,
}

/// One server and how to talk to it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Profile {
    /// The API's URL.
    pub url: String,
    /// A bearer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// The tenant sent as `tenantId` (the token's otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// A CA certificate to trust besides the system's store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_cert: Option<PathBuf>,
}

/// Where the file is.
pub fn path() -> anyhow::Result<PathBuf> {
    let base = match std::env::var_os("XDG_CONFIG_HOME").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => PathBuf::from(std::env::var_os("HOME").context("neither XDG_CONFIG_HOME nor HOME is set: nowhere to keep profiles")?).join(".config"),
    };
    Ok(base.join("better-compute").join("config.toml"))
}

/// The file's profiles; none when it does not exist.
pub fn load() -> anyhow::Result<Config> {
    let p = path()?;
    match std::fs::read_to_string(&p) {
        Ok(text) => toml::from_str(&text).map_err(|e| exit::fail(exit::USAGE, format!("{}: {e}", p.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Config::default()),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", p.display())),
    }
}

/// Writes the file (mode 0600: it holds tokens), replacing it whole.
pub fn save(config: &Config) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let p = path()?;
    let dir = p.parent().expect("the file is in a folder");
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tmp = p.with_extension("toml.new");
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    f.write_all(toml::to_string_pretty(config)?.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &p).with_context(|| format!("cannot write {}", p.display()))?;
    Ok(p)
}

/// The profile to use: `named`, else the current one; none when there is neither. Naming one
/// that does not exist is a usage error.
pub fn pick(named: Option<&str>) -> anyhow::Result<Option<(String, Profile)>> {
    let config = load()?;
    let Some(name) = named.map(str::to_owned).or(config.current.clone()) else { return Ok(None) };
    match config.profiles.get(&name) {
        Some(p) => Ok(Some((name, p.clone()))),
        None if named.is_some() => Err(exit::fail(exit::USAGE, format!("no profile {name:?} in {}; `better-compute login --profile {name} --url URL` makes one", path()?.display()))),
        None => Ok(None),
    }
}

/// Options of `better-compute login`.
#[derive(Debug, clap::Args)]
pub struct LoginArgs {
    /// The API's URL.
    #[arg(long, env = "BETTER_COMPUTE_URL")]
    url: String,
    /// The profile to write (and make current).
    #[arg(long, default_value = "default")]
    profile: String,
    /// A bearer token (`bct_…`); read from standard input when not given.
    #[arg(long, env = "BETTER_COMPUTE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Your tenant, when not the token's.
    #[arg(long, env = "BETTER_COMPUTE_TENANT")]
    tenant: Option<String>,
    /// A CA certificate (PEM) to trust besides the system's store.
    #[arg(long, env = "BETTER_COMPUTE_CA_CERT")]
    ca_cert: Option<PathBuf>,
}

/// Checks that the server takes the token, then saves the profile and makes it current.
pub async fn login(args: LoginArgs) -> anyhow::Result<()> {
    let token = match args.token {
        Some(t) => t,
        None => {
            eprint!("token for {}: ", args.url);
            let mut line = String::new();
            std::io::stdin().read_line(&mut line)?;
            line.trim().to_owned()
        }
    };
    if token.is_empty() {
        return Err(exit::fail(exit::USAGE, "no token: pass --token, set BETTER_COMPUTE_TOKEN or type it"));
    }
    let server = crate::api::ServerArgs { url: Some(args.url.clone()), token: Some(token.clone()), tenant: args.tenant.clone(), ca_cert: args.ca_cert.clone(), profile: None };
    let url = args.url.trim_end_matches('/').to_owned();
    // Any method tells a token the server knows (an answer, or a refusal of permission) from one
    // it does not (401).
    let r = server
        .http()?
        .build()?
        .post(format!("{url}/v1/tenants.get"))
        .bearer_auth(&token)
        .json(&serde_json::json!({}))
        .send()
        .await
        .with_context(|| crate::api::unreachable_hint(&url))?;
    if r.status() == reqwest::StatusCode::UNAUTHORIZED {
        return Err(exit::fail(1, format!("{url} does not take this token (UNAUTHENTICATED): check it, or make a new one with `api tokens.create`")));
    }
    let mut config = load()?;
    config.profiles.insert(args.profile.clone(), Profile { url, token: Some(token), tenant: args.tenant, ca_cert: args.ca_cert });
    config.current = Some(args.profile.clone());
    let p = save(&config)?;
    println!("logged in: profile {} (current), saved in {}", args.profile, p.display());
    Ok(())
}
