//! HTTPS for the API itself (`server --api-tls-cert FILE --api-tls-key FILE`): rustls (ring),
//! with the certificate and key read again when either file changes, so a renewed certificate
//! (certbot, cert-manager) is served to new connections without a restart. Each handshake looks at
//! the files' modification times and sizes (two `stat`s, nothing beside a handshake's cost); a pair
//! that does not load (half-written, mismatched) is logged and the last good one kept.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// Why the certificate and key cannot be served.
#[derive(Debug, thiserror::Error)]
#[error("the API's TLS certificate {cert} and key {key}: {why}")]
pub struct TlsError {
    cert: String,
    key: String,
    why: String,
}

/// The server's TLS settings over a reloading certificate.
pub fn server_config(cert: PathBuf, key: PathBuf) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = better_compute_tls::provider();
    let first = load(&cert, &key, &provider)?;
    let stamp = stamps(&cert, &key);
    let resolver = Reloading { cert, key, provider: provider.clone(), state: Mutex::new(State { current: Arc::new(first), stamp }) };
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError { cert: String::new(), key: String::new(), why: e.to_string() })?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn load(cert: &std::path::Path, key: &std::path::Path, provider: &rustls::crypto::CryptoProvider) -> Result<CertifiedKey, TlsError> {
    let err = |why: String| TlsError { cert: cert.display().to_string(), key: key.display().to_string(), why };
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(cert).map_err(|e| err(format!("{e:?}")))?.collect::<Result<_, _>>().map_err(|e| err(format!("{e:?}")))?;
    if chain.is_empty() {
        return Err(err("the certificate file holds no PEM certificate".into()));
    }
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| err(format!("{e:?}")))?;
    let signing = provider.key_provider.load_private_key(private).map_err(|e| err(e.to_string()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|e| err(format!("the key does not match the certificate ({e})")))?;
    Ok(certified)
}

/// What says a file changed: its modification time and size.
type Stamp = Option<(SystemTime, u64)>;

fn stamps(cert: &std::path::Path, key: &std::path::Path) -> (Stamp, Stamp) {
    let at = |p: &std::path::Path| std::fs::metadata(p).ok().and_then(|m| Some((m.modified().ok()?, m.len())));
    (at(cert), at(key))
}

struct State {
    current: Arc<CertifiedKey>,
    stamp: (Stamp, Stamp),
}

struct Reloading {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<rustls::crypto::CryptoProvider>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Reloading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading").field("cert", &self.cert).field("key", &self.key).finish()
    }
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let mut st = self.state.lock().expect("certificate state");
        let stamp = stamps(&self.cert, &self.key);
        if stamp != st.stamp {
            match load(&self.cert, &self.key, &self.provider) {
                Ok(k) => {
                    tracing::info!(cert = %self.cert.display(), "the API's TLS certificate changed on disk; serving the new one");
                    st.current = Arc::new(k);
                    st.stamp = stamp;
                }
                // Half-written, or the key not yet replaced: the next handshake tries again.
                Err(e) => tracing::warn!(error = %e, "the API's new TLS certificate does not load; serving the last good one"),
            }
        }
        Some(st.current.clone())
    }
}
