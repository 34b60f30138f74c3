//! The HTTP layer: its own refusals as JSON, slow and idle connections, rate limits, HTTPS with a renewed certificate.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_layer_answers_its_own_refusals_as_json_and_drops_slow_and_idle_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = better_compute_api::http::HttpSettings { header_read_timeout: Duration::from_millis(300), ..Default::default() };
    let api = Api::start_serving(|s| s.body_read_timeout = Duration::from_millis(300), limits).await;
    // Refusals hyper makes before the router sees the request: JSON with a request id.
    let many: String = (0..150).map(|i| format!("X-H{i}: v\r\n")).collect();
    let huge = format!("X-Big: {}\r\n", "v".repeat(70_000));
    let mut refused = 0;
    for (what, request, want) in [
        ("a bad request line", b"GARBAGE\r\n\r\n".to_vec(), 400),
        ("a bad header", b"POST /v1/roles.list HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n".to_vec(), 400),
        ("150 headers", format!("POST /v1/roles.list HTTP/1.1\r\nHost: x\r\n{many}\r\n").into_bytes(), 431),
        ("a 70 kB header", format!("POST /v1/roles.list HTTP/1.1\r\nHost: x\r\n{huge}\r\n").into_bytes(), 431),
    ] {
        let (s, v) = api.raw_exchange(&request).await;
        assert_eq!((s, v["code"].as_str()), (want, Some("INVALID_ARGUMENT")), "{what}: {v}");
        assert!(!v["message"].as_str().unwrap_or_default().is_empty(), "{what}");
        refused += 1;
    }
    assert_eq!(refused, 4);
    let addr = api.url.trim_start_matches("http://").to_owned();
    // The server closes within its 300 ms; the 60 s guard only turns "held forever" into a failure.
    let closed = async |c: &mut tokio::net::TcpStream| {
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut buf)).await.expect("the server held the connection").ok();
        String::from_utf8_lossy(&buf).into_owned()
    };
    // A head that never finishes: the connection is dropped.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"POST /v1/roles.list HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    closed(&mut slow).await;
    // A body that never finishes: refused as JSON.
    let mut stalled = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!("POST /v1/roles.list HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n{{", api.op);
    stalled.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(60), stalled.read(&mut answer)).await.expect("no answer to a stalled body").unwrap();
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 400") && text.contains("did not arrive"), "{text}");
    // A body shorter than its Content-Length (the client stops sending): said so, not "too large".
    let mut short = tokio::net::TcpStream::connect(&addr).await.unwrap();
    short.write_all(head.as_bytes()).await.unwrap();
    short.shutdown().await.unwrap();
    let text = closed(&mut short).await;
    assert!(text.starts_with("HTTP/1.1 400") && text.contains("ended before its Content-Length"), "{text}");
    // An idle keep-alive connection after an answer: closed too.
    let mut idle = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let request = format!("POST /v1/roles.list HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}", api.op);
    idle.write_all(request.as_bytes()).await.unwrap();
    let text = closed(&mut idle).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_or_tenant_over_its_rate_is_answered_429_with_retry_after_and_others_are_not_held_back() {
    use better_compute_api::rate_limit::{RateLimiter, RateLimits};
    let now_ms = Arc::new(AtomicU64::new(0));
    let clock = now_ms.clone();
    let limits = RateLimits { per_token_per_s: 6, per_tenant_per_s: 10, burst_s: 1 };
    let api = Api::start_with(move |s| s.set_rate_limiter(RateLimiter::with_clock(limits, Arc::new(move || clock.load(Ordering::SeqCst))))).await;
    // Each setup step in a second of its own, so the setup itself stays under the rates.
    let next_second = || now_ms.fetch_add(1000, Ordering::SeqCst);
    let b = api.tenant("tenant-b").await;
    next_second();
    let c = api.tenant("tenant-c").await;
    next_second();
    let idn = api.ok(&c.token, "identities.create", json!({"name": "second", "kind": "service"})).await;
    api.ok(&c.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "member", "scopeKind": "tenant"})).await;
    let second = api.ok(&c.token, "tokens.create", json!({"identityId": idn["id"]})).await["secret"].as_str().unwrap().to_owned();
    next_second();
    let get = async |token: &str| {
        let r = api.http.post(format!("{}/v1/roles.list", api.url)).bearer_auth(token).header("content-type", "application/json").body("{}").send().await.unwrap();
        let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
        (r.status().as_u16(), retry, r.json::<Value>().await.unwrap())
    };
    let mut served = 0;
    for _ in 0..6 {
        assert_eq!(get(&b.token).await.0, 200);
        served += 1;
    }
    assert_eq!(served, 6);
    let (s, retry, v) = get(&b.token).await;
    assert_eq!((s, v["code"].as_str(), retry.as_deref()), (429, Some("RATE_LIMITED"), Some("1")), "{v}");
    assert!(v["message"].as_str().unwrap().contains("token"), "{v}");
    // A watch stream opened counts as a request too.
    assert_eq!(api.http.get(format!("{}/v1/watch", api.url)).bearer_auth(&b.token).send().await.unwrap().status().as_u16(), 429);
    // Another tenant is not held back; its two tokens share its 10 a second.
    for token in [&c.token, &second] {
        for _ in 0..5 {
            assert_eq!(get(token).await.0, 200);
        }
    }
    let (s, _, v) = get(&second).await;
    assert_eq!((s, v["message"].as_str().is_some_and(|m| m.contains("tenant"))), (429, true), "{v}");
    // A second later, both are served again.
    next_second();
    assert_eq!(get(&b.token).await.0, 200);
    assert_eq!(get(&second).await.0, 200);
}

/// A CA and a certificate from it for 127.0.0.1: (CA PEM, certificate PEM, key PEM).
fn tls_identity() -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap().signed_by(&key, &issuer).unwrap();
    (ca_pem, cert.pem(), key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_serves_https_and_a_renewed_certificate_reaches_new_connections_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (cert_file, key_file) = (dir.path().join("api.pem"), dir.path().join("api.key"));
    let (ca1, cert1, key1) = tls_identity();
    std::fs::write(&cert_file, &cert1).unwrap();
    std::fs::write(&key_file, &key1).unwrap();
    let tls = better_compute_api::tls::server_config(cert_file.clone(), key_file.clone()).unwrap();
    let api = Api::start_serving(|_| {}, better_compute_api::http::HttpSettings { tls: Some(tls), ..Default::default() }).await;
    let url = api.url.replace("http://", "https://");
    // A new client per call: a new connection, so a new handshake.
    let get = |ca: &str| {
        let client = better_compute_client::http_trusting(Some(ca.as_bytes())).unwrap().build().unwrap();
        let u = format!("{url}/v1/openapi.json");
        async move { client.get(u).send().await.map(|r| r.status().as_u16()).map_err(|e| format!("{e:?}")) }
    };
    assert_eq!(get(&ca1).await, Ok(200));
    assert_eq!(api.http.get(format!("{}/healthz", api.url)).send().await.ok().map(|r| r.status().as_u16()), None, "plain HTTP to the HTTPS port gets no answer");
    // Renewed by another CA on disk: the next connection gets the new certificate.
    let (ca2, cert2, key2) = tls_identity();
    std::fs::write(&key_file, &key2).unwrap();
    std::fs::write(&cert_file, &cert2).unwrap();
    assert_eq!(get(&ca2).await, Ok(200));
    assert!(get(&ca1).await.is_err(), "the old CA no longer vouches for what is served");
    // A broken renewal keeps the last good certificate.
    std::fs::write(&cert_file, "half-written").unwrap();
    assert_eq!(get(&ca2).await, Ok(200));
    // A certificate that does not load is refused at start, naming the files.
    let e = better_compute_api::tls::server_config(cert_file.clone(), key_file.clone()).unwrap_err().to_string();
    assert!(e.contains("api.pem") && e.contains("api.key"), "{e}");
}
