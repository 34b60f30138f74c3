//! The one TLS set-up every part of Better Compute shares: rustls with the ring provider (the
//! default provider, aws-lc, is not built) and the Mozilla roots. The database connector takes
//! [`provider`] and [`mozilla_roots`]; HTTP clients (the API client, the daemon's image downloads,
//! webhook delivery) start from [`http`] or [`http_trusting`] (feature `http`).

use std::sync::Arc;

/// The crypto provider of every TLS connection: ring.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes [`provider`] the process's default, for clients that bring no settings of their own (the
/// OTLP exporter's). Call once at start; a second call changes nothing.
pub fn install_process_default() {
    let _ = Arc::unwrap_or_clone(provider()).install_default();
}

/// The Mozilla root certificates (webpki-roots).
pub fn mozilla_roots() -> rustls::RootCertStore {
    rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() }
}

/// A client configuration builder over [`provider`] with rustls' safe protocol versions.
pub fn client_builder() -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::WantsVerifier> {
    rustls::ClientConfig::builder_with_provider(provider()).with_safe_default_protocol_versions().expect("ring supports TLS 1.2 and 1.3")
}

/// An HTTP client builder with TLS set up, trusting the Mozilla roots. reqwest's rustls without a
/// provider panics on `build` unless one is given, so every HTTP client starts here.
#[cfg(feature = "http")]
pub fn http() -> reqwest::ClientBuilder {
    let tls = client_builder().with_root_certificates(mozilla_roots()).with_no_client_auth();
    reqwest::Client::builder().tls_backend_preconfigured(tls)
}

/// [`http`] for a command-line client: trusting the system's certificate store (falling back to
/// the Mozilla roots where it has none) and the PEM certificates in `extra_pem` (a private CA in
/// front of the API, `--ca-cert`).
#[cfg(feature = "http")]
pub fn http_trusting(extra_pem: Option<&[u8]>) -> Result<reqwest::ClientBuilder, String> {
    use rustls::pki_types::pem::PemObject;
    let extra: Vec<rustls::pki_types::CertificateDer<'static>> = match extra_pem {
        Some(pem) => rustls::pki_types::CertificateDer::pem_slice_iter(pem).collect::<Result<_, _>>().map_err(|e| format!("the CA certificate file: {e:?}"))?,
        None => Vec::new(),
    };
    if extra_pem.is_some() && extra.is_empty() {
        return Err("the CA certificate file holds no PEM certificate".into());
    }
    let tls = match rustls_platform_verifier::Verifier::new_with_extra_roots(extra.clone(), provider()) {
        Ok(v) => client_builder().dangerous().with_custom_certificate_verifier(Arc::new(v)).with_no_client_auth(),
        Err(_) => {
            let mut roots = mozilla_roots();
            roots.add_parsable_certificates(extra);
            client_builder().with_root_certificates(roots).with_no_client_auth()
        }
    };
    Ok(reqwest::Client::builder().tls_backend_preconfigured(tls))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_mozilla_roots_are_not_empty() {
        assert!(super::mozilla_roots().len() > 100, "{}", super::mozilla_roots().len());
    }

    #[cfg(feature = "http")]
    #[test]
    fn a_ca_file_without_a_certificate_is_refused() {
        let err = super::http_trusting(Some(b"not a certificate")).expect_err("refused");
        assert!(err.contains("no PEM certificate"), "{err}");
    }

    #[cfg(feature = "http")]
    #[test]
    fn http_clients_build_with_the_ring_provider() {
        super::http().build().expect("builds");
        super::http_trusting(None).expect("trusting").build().expect("builds");
    }
}
