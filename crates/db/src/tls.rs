//! TLS to PostgreSQL, as libpq's `sslmode` asks for it, over rustls (ring), so a managed database
//! that requires TLS works:
//!
//! | `sslmode` | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (the default) | when the server offers it | not checked |
//! | `require` | always | not checked; checked as `verify-ca` when `sslrootcert` is given |
//! | `verify-ca` | always | signed by `sslrootcert` (else the Mozilla roots) |
//! | `verify-full` | always | as `verify-ca`, and names the host connected to |
//!
//! `sslmode` and `sslrootcert` are read from the connection string (URL query or `key=value`)
//! and the rest goes to tokio-postgres, which knows only `disable`, `prefer` and `require`.
//! Connections over a Unix socket never use TLS.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

use crate::DbError;

/// `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// TLS when offered, unchecked.
    Prefer,
    /// TLS, unchecked (checked against `sslrootcert` when given).
    Require,
    /// TLS, the chain checked.
    VerifyCa,
    /// TLS, the chain and the host name checked.
    VerifyFull,
}

/// A connection string read: what tokio-postgres takes, and the TLS connector it asks for.
pub fn parse(conn: &str) -> Result<(tokio_postgres::Config, MakeRustls), DbError> {
    let (rest, mode, root) = split_tls(conn)?;
    let mut config: tokio_postgres::Config = rest.parse()?;
    let (pg_mode, verify) = match mode.unwrap_or(SslMode::Prefer) {
        SslMode::Disable => (tokio_postgres::config::SslMode::Disable, Verify::Nothing),
        SslMode::Prefer => (tokio_postgres::config::SslMode::Prefer, Verify::Nothing),
        SslMode::Require if root.is_some() => (tokio_postgres::config::SslMode::Require, Verify::Chain),
        SslMode::Require => (tokio_postgres::config::SslMode::Require, Verify::Nothing),
        SslMode::VerifyCa => (tokio_postgres::config::SslMode::Require, Verify::Chain),
        SslMode::VerifyFull => (tokio_postgres::config::SslMode::Require, Verify::ChainAndName),
    };
    config.ssl_mode(pg_mode);
    Ok((config, MakeRustls { config: Arc::new(client_config(verify, root.as_deref())?) }))
}

/// `conn` without `sslmode` and `sslrootcert`, and their values.
fn split_tls(conn: &str) -> Result<(String, Option<SslMode>, Option<String>), DbError> {
    let bad = |what: &str| DbError::Config(format!("{what} in the connection string; sslmode takes disable, prefer, require, verify-ca or verify-full"));
    let mode_of = |v: &str| match v {
        "disable" => Ok(SslMode::Disable),
        "allow" | "prefer" => Ok(SslMode::Prefer),
        "require" => Ok(SslMode::Require),
        "verify-ca" => Ok(SslMode::VerifyCa),
        "verify-full" => Ok(SslMode::VerifyFull),
        other => Err(bad(&format!("sslmode={other}"))),
    };
    let (mut mode, mut root) = (None, None);
    if let Some((head, query)) = conn.split_once('?').filter(|_| conn.starts_with("postgres://") || conn.starts_with("postgresql://")) {
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_encoding::percent_decode_str(v).decode_utf8_lossy().into_owned();
            match k {
                "sslmode" => mode = Some(mode_of(&v)?),
                "sslrootcert" => root = Some(v),
                _ => kept.push(pair),
            }
        }
        let rest = if kept.is_empty() { head.to_owned() } else { format!("{head}?{}", kept.join("&")) };
        return Ok((rest, mode, root));
    }
    if !conn.contains("sslmode") && !conn.contains("sslrootcert") {
        return Ok((conn.to_owned(), None, None));
    }
    let mut kept = Vec::new();
    for word in conn.split_whitespace() {
        match word.split_once('=') {
            Some(("sslmode", v)) => mode = Some(mode_of(v.trim_matches('\''))?),
            Some(("sslrootcert", v)) => root = Some(v.trim_matches('\'').to_owned()),
            _ => kept.push(word),
        }
    }
    Ok((kept.join(" "), mode, root))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    Nothing,
    Chain,
    ChainAndName,
}

fn client_config(verify: Verify, root: Option<&str>) -> Result<rustls::ClientConfig, DbError> {
    let builder = better_compute_tls::client_builder();
    let roots = match root {
        Some(path) => {
            let pem = std::fs::read(path).map_err(|e| DbError::Config(format!("sslrootcert {path}: {e}")))?;
            let certs: Vec<CertificateDer<'static>> = rustls::pki_types::pem::PemObject::pem_slice_iter(&pem)
                .collect::<Result<_, _>>()
                .map_err(|e| DbError::Config(format!("sslrootcert {path}: {e:?}")))?;
            let mut roots = rustls::RootCertStore::empty();
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(DbError::Config(format!("sslrootcert {path} holds no certificate")));
            }
            roots
        }
        None => better_compute_tls::mozilla_roots(),
    };
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), better_compute_tls::provider())
        .build()
        .map_err(|e| DbError::Config(format!("TLS roots: {e}")))?;
    let verifier: Arc<dyn ServerCertVerifier> = match verify {
        Verify::ChainAndName => webpki,
        Verify::Chain => Arc::new(ChainOnly(webpki)),
        Verify::Nothing => Arc::new(Unchecked(better_compute_tls::provider())),
    };
    Ok(builder.dangerous().with_custom_certificate_verifier(verifier).with_no_client_auth())
}

/// `verify-ca`: the chain, whatever name the certificate carries.
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(&self, end: &CertificateDer<'_>, inter: &[CertificateDer<'_>], name: &ServerName<'_>, ocsp: &[u8], now: UnixTime) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end, inter, name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. })) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(m, c, d)
    }
    fn verify_tls13_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(m, c, d)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require`: encrypted, the certificate not checked (as libpq does); the handshake's
/// signatures still are.
#[derive(Debug)]
struct Unchecked(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(&self, _: &CertificateDer<'_>, _: &[CertificateDer<'_>], _: &ServerName<'_>, _: &[u8], _: UnixTime) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The connector tokio-postgres and the pool are given.
#[derive(Clone)]
pub struct MakeRustls {
    config: Arc<rustls::ClientConfig>,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> MakeTlsConnect<S> for MakeRustls {
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> io::Result<RustlsConnect> {
        // Asked for every host, a Unix socket's path too, which is no server name: that fails only
        // if TLS is then attempted (it never is over a socket).
        Ok(RustlsConnect { config: self.config.clone(), name: ServerName::try_from(domain.to_owned()).ok() })
    }
}

/// One connection's handshake.
pub struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
    name: Option<ServerName<'static>>,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> TlsConnect<S> for RustlsConnect {
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let name = self.name.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "TLS needs a host name or address to check the certificate against"))?;
            Ok(RustlsStream(tokio_rustls::TlsConnector::from(self.config).connect(name, stream).await?))
        })
    }
}

/// An encrypted connection.
pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_and_sslrootcert_are_taken_out_of_urls_and_key_value_strings() {
        let (rest, mode, root) = split_tls("postgresql://u@db.example:5432/bc?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x").unwrap();
        assert_eq!((rest.as_str(), mode, root.as_deref()), ("postgresql://u@db.example:5432/bc?application_name=x", Some(SslMode::VerifyFull), Some("/etc/ca.pem")));
        let (rest, mode, root) = split_tls("host=db.example user=u sslmode=verify-ca sslrootcert=/ca.pem dbname=bc").unwrap();
        assert_eq!((rest.as_str(), mode, root.as_deref()), ("host=db.example user=u dbname=bc", Some(SslMode::VerifyCa), Some("/ca.pem")));
        assert_eq!(split_tls("host=/run/pg user=p dbname=x").unwrap(), ("host=/run/pg user=p dbname=x".into(), None, None));
        assert!(split_tls("postgresql://u@h/db?sslmode=sometimes").is_err());
        assert!(parse("host=h sslmode=verify-full sslrootcert=/no/such/file").is_err());
        assert!(parse("postgresql://u@h/db?sslmode=verify-full").is_ok(), "no root file: the Mozilla roots");
    }
}
