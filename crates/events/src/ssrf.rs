//! Where webhooks may go. URLs must be https (http only when the operator allows it, for
//! development); the address is checked on every connection, after resolution, so private,
//! loopback, link-local, unique-local and other non-public ranges are refused whatever the name
//! or encoding (`2130706433`, `0x7f.1` and `[::ffff:127.0.0.1]` are all 127.0.0.1 once parsed;
//! an IPv6 address that carries an IPv4 one, mapped, SIIT, 6to4 or Teredo, is as public as that
//! one), `localhost.` included,
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
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast
        || (a == 198 && (b == 18 || b == 19)))
}

fn v4_of(hi: u16, lo: u16) -> Ipv4Addr {
    Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo))
}

fn v6_is_public(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    // Addresses that carry an IPv4 address are as public as it is.
    if let Some(v4) = ip.to_ipv4_mapped() {
        return v4_is_public(v4);
    }
    if s[..4] == [0, 0, 0, 0] && s[4] == 0xffff && s[5] == 0 {
        return v4_is_public(v4_of(s[6], s[7])); // SIIT ::ffff:0:0/96
    }
    if s[0] == 0x2002 {
        return v4_is_public(v4_of(s[1], s[2])); // 6to4 2002::/16
    }
    if s[0] == 0x2001 && s[1] == 0 {
        // Teredo 2001::/32: the server's address, and the client's inverted.
        return v4_is_public(v4_of(s[2], s[3])) && v4_is_public(v4_of(!s[6], !s[7]));
    }
    !(ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || (s[0] & 0xfe00) == 0xfc00 // unique local
        || (s[0] & 0xffc0) == 0xfe80 // link local
        || (s[0] & 0xffc0) == 0xfec0 // site local (deprecated)
        || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
        || (s[0] == 0x2001 && s[1] < 0x0200) // IETF protocol assignments 2001::/23 (benchmarking 2001:2::/48, ORCHID 2001:10::/28 and 2001:20::/28, …)
        || (s[0] == 0x0100 && s[1] == 0 && s[2] == 0 && s[3] == 0) // discard-only 100::/64
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
        Some(url::Host::Domain(d)) if is_localhost(d) => (!policy.allow_private).then_some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        Some(url::Host::Domain(_)) => None,
        Some(url::Host::Ipv4(v4)) => Some(IpAddr::V4(v4)),
        Some(url::Host::Ipv6(v6)) => Some(IpAddr::V6(v6)),
    };
    if let Some(ip) = ip && !policy.allow_private && !is_public(ip) {
        return Err(bad(&format!("{ip} is not a public address")));
    }
    Ok(u)
}

/// `localhost` and its subdomains, with or without the root's trailing dot, in any case.
fn is_localhost(name: &str) -> bool {
    let d = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    d == "localhost" || d.ends_with(".localhost")
}

/// How long a create waits for its URL's name to resolve before it stops looking.
pub const CREATE_RESOLVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// What a caller should know about a URL's name now, at create time: a warning when it resolves
/// only to non-public addresses (deliveries are refused at every connection until it resolves
/// publicly) or does not resolve at all. Nothing for an IP literal, a URL [`check_url`] refuses,
/// or when the policy allows private addresses.
pub async fn resolution_warnings(url: &str, policy: EgressPolicy) -> Vec<String> {
    let Ok(u) = check_url(url, policy) else { return Vec::new() };
    let (Some(url::Host::Domain(name)), false) = (u.host(), policy.allow_private) else { return Vec::new() };
    let port = u.port_or_known_default().unwrap_or(443);
    match tokio::time::timeout(CREATE_RESOLVE_TIMEOUT, tokio::net::lookup_host((name, port))).await {
        Ok(Ok(found)) => {
            let found: Vec<IpAddr> = found.map(|a| a.ip()).collect();
            if found.iter().any(|ip| is_public(*ip)) {
                Vec::new()
            } else {
                vec![format!("{name} resolves only to non-public addresses at present ({found:?}): deliveries are refused until it resolves to a public one")]
            }
        }
        Ok(Err(e)) => vec![format!("{name} does not resolve at present ({e}): deliveries fail until it does")],
        Err(_) => vec![format!("{name} did not resolve within {} s: deliveries fail until it does", CREATE_RESOLVE_TIMEOUT.as_secs())],
    }
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
/// environment, `timeout` per request, and TLS as every
/// Better Compute client has it ([`better_compute_tls::http`]).
pub fn client(policy: EgressPolicy, timeout: std::time::Duration) -> reqwest::Client {
    better_compute_tls::http()
        .dns_resolver(Arc::new(PublicOnly(policy)))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(timeout)
        .user_agent(concat!("better-compute-webhooks/", env!("CARGO_PKG_VERSION")))
        .build()
        .expect("a client with a resolver and rustls builds")
}

#[cfg(test)]
mod tests {
    use super::*;

    const STRICT: EgressPolicy = EgressPolicy { allow_http: true, allow_private: false };

    /// The SSRF corpus: every URL with whether a webhook may be created for it.
    const CORPUS: &[(&str, bool)] = &[
        ("https://8.8.8.8/", true),
        ("https://example.com/hook", true),
        ("https://[2606:4700::1111]/", true),
        ("https://127.0.0.1/", false),
        ("https://2130706433/", false),
        ("https://0x7f.0.0.1/", false),
        ("https://0177.0.0.1/", false),
        ("https://127.1/", false),
        ("https://10.0.0.1/", false),
        ("https://172.16.5.4/", false),
        ("https://192.168.1.1/", false),
        ("https://169.254.169.254/latest/meta-data/", false),
        ("https://100.64.0.1/", false),
        ("https://0.0.0.0/", false),
        ("https://192.0.0.1/", false),
        ("https://192.88.99.1/", false),
        ("https://198.18.0.1/", false),
        ("https://240.0.0.1/", false),
        ("https://255.255.255.255/", false),
        ("https://[::1]/", false),
        ("https://[::]/", false),
        ("https://[::ffff:127.0.0.1]/", false),
        ("https://[::ffff:8.8.8.8]/", true),
        ("https://[::ffff:0:127.0.0.1]/", false),
        ("https://[::ffff:0:10.1.2.3]/", false),
        ("https://[::ffff:0:8.8.8.8]/", true),
        ("https://[::127.0.0.1]/", false),
        ("https://[2002:7f00:1::]/", false),
        ("https://[2002:a00:1::1]/", false),
        ("https://[2002:c0a8:101::]/", false),
        ("https://[2002:808:808::1]/", true),
        ("https://[2001:0:7f00:1::]/", false),
        ("https://[2001:0:808:808::80f7:f7f7]/", false),
        ("https://[2001:0:808:808::f7f7:f7f7]/", true),
        ("https://[2001:0:808:808::]/", false),
        ("https://[64:ff9b::7f00:1]/", false),
        ("https://[64:ff9b::808:808]/", false),
        ("https://[100::1]/", false),
        ("https://[2001:2::1]/", false),
        ("https://[2001:10::1]/", false),
        ("https://[2001:20::1]/", false),
        ("https://[2001:db8::1]/", false),
        ("https://[fd00::1]/", false),
        ("https://[fe80::1]/", false),
        ("https://[fec0::1]/", false),
        ("https://[ff02::1]/", false),
        ("https://localhost/", false),
        ("https://localhost./", false),
        ("https://LocalHost./", false),
        ("https://api.localhost/", false),
        ("https://api.localhost./", false),
        ("https://user:secret@example.com/", false),
        ("ftp://example.com/", false),
        ("not a url", false),
    ];

    #[test]
    fn every_url_of_the_ssrf_corpus_is_refused_or_allowed_as_listed() {
        let mut checked = 0;
        for (url, allowed) in CORPUS {
            assert_eq!(check_url(url, STRICT).is_ok(), *allowed, "{url}");
            checked += 1;
        }
        assert_eq!(checked, CORPUS.len());
        assert!(CORPUS.iter().filter(|(_, a)| *a).count() >= 6 && CORPUS.iter().filter(|(_, a)| !*a).count() >= 40);
        // The development policy lets private targets through, never another scheme.
        let dev = EgressPolicy { allow_http: true, allow_private: true };
        assert!(check_url("http://localhost./", dev).is_ok());
        assert!(check_url("ftp://localhost/", dev).is_err());
    }

    #[tokio::test]
    async fn a_name_that_resolves_only_to_private_addresses_is_warned_of_at_create() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "unresolvable.invalid".into());
        let w = resolution_warnings(&format!("https://{}/hook", host.trim()), STRICT).await;
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains(host.trim()) && (w[0].contains("non-public") || w[0].contains("resolve")), "{w:?}");
        assert!(resolution_warnings("https://8.8.8.8/", STRICT).await.is_empty(), "an IP literal is checked, not resolved");
        assert!(resolution_warnings("https://anything.example/", EgressPolicy { allow_http: false, allow_private: true }).await.is_empty());
    }
}
