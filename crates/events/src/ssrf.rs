//! Where webhooks may go. URLs must be https (http only when the operator allows it, for
//! development); the address is checked on every connection, after resolution, so private,
//! loopback, link-local, unique-local and other non-public ranges are refused whatever the name
//! or encoding (`2130706433`, `0x7f.1` and `[::ffff:127.0.0.1]` are all 127.0.0.1 once parsed),
//! and a name that resolves to a public address once and a private one later (DNS rebinding) is
//! caught on the later connection. Redirects are never followed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use better_compute_core::Error;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;

/// The operator's settings for outbound webhooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EgressPolicy {
    /// Allow `http://` URLs (development only).
    pub allow_http: bool,
    /// Allow non-public addresses (development only: a receiver on this machine).
    pub allow_private: bool,
}

impl EgressPolicy {
    /// From `BETTER_COMPUTE_WEBHOOKS_ALLOW_HTTP` and `BETTER_COMPUTE_WEBHOOKS_ALLOW_PRIVATE` (`1` or `true`).
    pub fn from_env() -> EgressPolicy {
        let on = |k: &str| std::env::var(k).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        EgressPolicy { allow_http: on("BETTER_COMPUTE_WEBHOOKS_ALLOW_HTTP"), allow_private: on("BETTER_COMPUTE_WEBHOOKS_ALLOW_PRIVATE") }
    }
}

fn v4_is_public(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_private()
        || ip.is_loopback()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_documentation()
        || ip.is_unspecified()
        || ip.is_multicast()
        || a == 0
        || a >= 240
        || (a == 100 && (64..128).contains(&b))
        || (a == 192 && b == 0 && c == 0)
        || (a == 198 && (b == 18 || b == 19)))
}

fn v6_is_public(ip: Ipv6Addr) -> bool {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return v4_is_public(v4);
    }
    let s = ip.segments();
    !(ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || (s[0] & 0xfe00) == 0xfc00 // unique local
        || (s[0] & 0xffc0) == 0xfe80 // link local
        || (s[0] & 0xffc0) == 0xfec0 // site local (deprecated)
        || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
        || (s[0] == 0x0064 && s[1] == 0xff9b) // NAT64: an IPv4 address in disguise
        || (s[0] == 0 && s[1] == 0 && s[2] == 0 && s[3] == 0 && s[4] == 0 && s[5] == 0)) // IPv4-compatible
}

/// Whether an address is on the public internet.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4_is_public(v4),
        IpAddr::V6(v6) => v6_is_public(v6),
    }
}

/// Checks a webhook URL before it is stored or used: scheme, host, no credentials, and an IP
/// literal must be public. Names are checked when they resolve.
pub fn check_url(url: &str, policy: EgressPolicy) -> Result<Url, Error> {
    let bad = |why: &str| Error::invalid_argument(format!("url: {why}"));
    if url.len() > 2048 {
        return Err(bad("at most 2048 characters"));
    }
    let u = Url::parse(url).map_err(|e| bad(&format!("not a URL ({e})")))?;
    match u.scheme() {
        "https" => {}
        "http" if policy.allow_http => {}
        "http" => return Err(bad("must be https (http is allowed only when the operator enables it for development)")),
        _ => return Err(bad("must be https")),
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(bad("must not carry credentials"));
    }
    let ip = match u.host() {
        None => return Err(bad("has no host")),
        Some(url::Host::Domain(d)) if d.eq_ignore_ascii_case("localhost") || d.ends_with(".localhost") => {
            (!policy.allow_private).then_some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        }
        Some(url::Host::Domain(_)) => None,
        Some(url::Host::Ipv4(v4)) => Some(IpAddr::V4(v4)),
        Some(url::Host::Ipv6(v6)) => Some(IpAddr::V6(v6)),
    };
    if let Some(ip) = ip && !policy.allow_private && !is_public(ip) {
        return Err(bad(&format!("{ip} is not a public address")));
    }
    Ok(u)
}

/// A resolver that drops non-public addresses (unless allowed), so every connection, whatever the
/// name resolves to at that moment, goes only to public addresses.
#[derive(Debug, Clone, Copy)]
pub struct PublicOnly(pub EgressPolicy);

impl Resolve for PublicOnly {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.0;
        Box::pin(async move {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = found.iter().copied().filter(|a| policy.allow_private || is_public(a.ip())).collect();
            if allowed.is_empty() {
                return Err(format!("{} resolves only to non-public addresses ({found:?}); refused", name.as_str()).into());
            }
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

/// The HTTP client webhooks are sent with: the policy's resolver, no redirects, no proxy from the
/// environment, and `timeout` per request.
pub fn client(policy: EgressPolicy, timeout: std::time::Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .dns_resolver(Arc::new(PublicOnly(policy)))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(timeout)
        .user_agent(concat!("better-compute-webhooks/", env!("CARGO_PKG_VERSION")))
        .build()
        .expect("a client with a resolver and rustls builds")
}
