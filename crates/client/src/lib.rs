//! A typed Rust client for Better Compute's HTTP API, generated at build time from the API's
//! OpenAPI document by Oxide's progenitor.
//!
//! Every method is `POST /v1/<method>`; the client has one builder per method, named after it
//! with `_` for `.` (`reservations.create` is `reservations_create`), taking the
//! method's request type from [`types`] and answering its response type:
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use better_compute_client::{types, Client};
//! let client = Client::with_token("http://127.0.0.1:8080", "bct_…")?;
//! let node = client.nodes_get(&types::NodeRef { node_id: "node_1".into() }).await?;
//! println!("{} is {}", node.id, node.liveness);
//! # Ok(()) }
//! ```
//!
//! A refusal is `Error::ErrorResponse` carrying the API's stable error body (`code`, `message`,
//! `details`, `requestId`).

#![allow(missing_docs, clippy::all)]
include!(concat!(env!("OUT_DIR"), "/client.rs"));

/// Why a client could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The token holds characters an HTTP header cannot carry.
    #[error("the token is not a valid HTTP header value: {0}")]
    Token(#[from] reqwest::header::InvalidHeaderValue),
    /// The HTTP client could not be built.
    #[error("the HTTP client could not be built: {0}")]
    Http(#[from] reqwest::Error),
}

impl Client {
    /// A client that sends `token` (`bct_…`) as its bearer token on every request.
    pub fn with_token(base_url: &str, token: &str) -> Result<Self, SetupError> {
        Self::with_token_on(base_url, token, http())
    }

    /// [`Client::with_token`] on an HTTP client built from `http` (start from [`http`], then set
    /// timeouts or pool sizes); the token is marked sensitive, so it never shows in debug output.
    pub fn with_token_on(base_url: &str, token: &str, http: reqwest::ClientBuilder) -> Result<Self, SetupError> {
        let mut auth = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))?;
        auth.set_sensitive(true);
        let headers = reqwest::header::HeaderMap::from_iter([(reqwest::header::AUTHORIZATION, auth)]);
        Ok(Self::new_with_client(base_url, http.default_headers(headers).build()?))
    }
}

/// An HTTP client builder with TLS set up: rustls with the ring provider, trusting the Mozilla
/// roots. Every HTTP client of Better Compute starts here: reqwest's rustls without a provider
/// panics on `build` unless one is given, and the default provider (aws-lc) is not built.
pub fn http() -> reqwest::ClientBuilder {
    let roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring supports TLS 1.2 and 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    reqwest::Client::builder().tls_backend_preconfigured(tls)
}

/// [`http`] for a command-line client: trusting the system's certificate store (falling back to
/// the Mozilla roots where it has none) and the PEM certificates in `extra_pem` (a private CA in
/// front of the API, `--ca-cert`).
pub fn http_trusting(extra_pem: Option<&[u8]>) -> Result<reqwest::ClientBuilder, String> {
    use rustls::pki_types::pem::PemObject;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let extra: Vec<rustls::pki_types::CertificateDer<'static>> = match extra_pem {
        Some(pem) => rustls::pki_types::CertificateDer::pem_slice_iter(pem).collect::<Result<_, _>>().map_err(|e| format!("the CA certificate file: {e:?}"))?,
        None => Vec::new(),
    };
    if extra_pem.is_some() && extra.is_empty() {
        return Err("the CA certificate file holds no PEM certificate".into());
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions().expect("ring supports TLS 1.2 and 1.3");
    let tls = match rustls_platform_verifier::Verifier::new_with_extra_roots(extra.clone(), provider) {
        Ok(v) => builder.dangerous().with_custom_certificate_verifier(std::sync::Arc::new(v)).with_no_client_auth(),
        Err(_) => {
            let mut roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
            roots.add_parsable_certificates(extra);
            builder.with_root_certificates(roots).with_no_client_auth()
        }
    };
    Ok(reqwest::Client::builder().tls_backend_preconfigured(tls))
}
