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

#![allow(missing_docs, clippy::all, clippy::too_many_lines)]
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

/// The HTTP client builders every client starts from (the one TLS set-up).
pub use better_compute_tls::{http, http_trusting};
