//! The control plane's certificate authority: an ECDSA P-256 key and a self-signed CA certificate,
//! created on first start in a folder on disk (`ca.pem`, mode 0644; `ca.key`, mode 0600, created
//! exclusively so two starting servers cannot both write one). Every gateway of a fleet must be
//! given the same folder (a shared volume or a copy). It signs node certificates from a daemon's
//! certificate signing request, and the gateways' own server certificates.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};
use sha2::{Digest, Sha256};

/// How long a node certificate is valid; the daemon rotates it at about 80% of that.
pub const NODE_CERT_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);
/// How long the CA certificate is valid.
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How far back a new certificate's validity starts, for clocks a little behind.
const BACKDATE: Duration = Duration::from_secs(300);

/// Why the CA could not do something.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// Reading or writing the CA's files.
    #[error("certificate authority in {dir}: {source}")]
    Io {
        /// The folder.
        dir: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// A malformed CSR, or a key or certificate rcgen refused.
    #[error("{0}")]
    Certificate(#[from] rcgen::Error),
}

/// A certificate the CA signed.
#[derive(Debug, Clone)]
pub struct Signed {
    /// PEM.
    pub pem: String,
    /// SHA-256 of the DER: how the gateway finds the node.
    pub fingerprint: [u8; 32],
    /// Hex serial.
    pub serial: String,
    /// Validity start, Unix seconds.
    pub not_before_unix_s: i64,
    /// Validity end, Unix seconds.
    pub not_after_unix_s: i64,
}

/// The certificate authority.
pub struct Ca {
    /// The CA's subject and key, which sign.
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

fn unix_s(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

fn offset(t: SystemTime) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(unix_s(t)).unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

fn random_serial() -> SerialNumber {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("the operating system's random source works");
    b[0] &= 0x7f; // positive
    SerialNumber::from_slice(&b)
}

/// SHA-256 of a certificate's DER.
pub fn fingerprint(der: &[u8]) -> [u8; 32] {
    Sha256::digest(der).into()
}

impl Ca {
    /// Loads the CA from `dir`, creating it there on first use.
    pub fn load_or_create(dir: &Path) -> Result<Ca, CaError> {
        let io = |source| CaError::Io { dir: dir.to_owned(), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
        if !key_path.exists() {
            let ca = Ca::generate()?;
            match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&key_path) {
                Ok(mut f) => {
                    f.write_all(ca.issuer.key().serialize_pem().as_bytes()).map_err(io)?;
                    f.sync_all().map_err(io)?;
                    let tmp = dir.join("ca.pem.tmp");
                    std::fs::write(&tmp, &ca.pem).map_err(io)?;
                    std::fs::rename(&tmp, &cert_path).map_err(io)?;
                    return Ok(ca);
                }
                // Another process created it first: use theirs.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
        }
        // The key is written before the certificate; wait briefly for a concurrent creator.
        for _ in 0..50 {
            if cert_path.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let key = KeyPair::from_pem(&std::fs::read_to_string(&key_path).map_err(io)?)?;
        let pem = std::fs::read_to_string(&cert_path).map_err(io)?;
        // The issuer is the stored certificate's subject and key usages with its key, so what it
        // signs verifies against the stored ca.pem.
        let issuer = Issuer::from_ca_cert_pem(&pem, key)?;
        Ok(Ca { issuer, pem })
    }

    /// A new CA in memory (tests use it for "a certificate from another CA").
    pub fn generate() -> Result<Ca, CaError> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name.push(DnType::CommonName, "Better Compute node CA");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let now = SystemTime::now();
        p.not_before = offset(now - BACKDATE);
        p.not_after = offset(now + CA_LIFETIME);
        p.serial_number = Some(random_serial());
        let pem = p.self_signed(&key)?.pem();
        Ok(Ca { issuer: Issuer::new(p, key), pem })
    }

    /// The CA certificate, PEM: what daemons trust and gateways check client certificates against.
    pub fn cert_pem(&self) -> &str {
        &self.pem
    }

    /// Signs a node's CSR. The CSR only contributes its public key: the subject is the node id
    /// and the certificate is good for client authentication only.
    pub fn sign_node(&self, csr_pem: &str, node_id: &str, lifetime: Duration) -> Result<Signed, CaError> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)?;
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name.push(DnType::CommonName, node_id);
        p.subject_alt_names = vec![SanType::URI(format!("urn:better-compute:node:{node_id}").try_into()?)];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let now = SystemTime::now();
        let (nb, na) = (now - BACKDATE, now + lifetime);
        p.not_before = offset(nb);
        p.not_after = offset(na);
        p.serial_number = Some(random_serial());
        let serial = hex::encode(p.serial_number.as_ref().map(|s| s.as_ref().to_vec()).unwrap_or_default());
        csr.params = p;
        let cert = csr.signed_by(&self.issuer)?;
        Ok(Signed { pem: cert.pem(), fingerprint: fingerprint(cert.der()), serial, not_before_unix_s: unix_s(nb), not_after_unix_s: unix_s(na) })
    }

    /// A server certificate and key (PEM) for a gateway answering to `hostnames` (names or IPs).
    pub fn server_identity(&self, hostnames: &[String]) -> Result<(String, String), CaError> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(hostnames.to_vec())?;
        p.distinguished_name.push(DnType::CommonName, "Better Compute gateway");
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let now = SystemTime::now();
        p.not_before = offset(now - BACKDATE);
        p.not_after = offset(now + CA_LIFETIME.min(Duration::from_secs(365 * 24 * 3600)));
        p.serial_number = Some(random_serial());
        let cert = p.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_is_created_once_with_a_private_key_only_its_owner_reads_and_reloads_the_same() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let a = Ca::load_or_create(dir.path()).unwrap();
        let mode = std::fs::metadata(dir.path().join("ca.key")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let b = Ca::load_or_create(dir.path()).unwrap();
        assert_eq!(a.cert_pem(), b.cert_pem());
    }

    #[test]
    fn a_node_certificate_names_the_node_and_a_garbled_csr_is_refused() {
        let ca = Ca::generate().unwrap();
        let key = KeyPair::generate().unwrap();
        let csr = CertificateParams::new(Vec::<String>::new()).unwrap().serialize_request(&key).unwrap().pem().unwrap();
        let s = ca.sign_node(&csr, "node_abc", NODE_CERT_LIFETIME).unwrap();
        assert!(s.pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(s.not_after_unix_s - s.not_before_unix_s >= NODE_CERT_LIFETIME.as_secs() as i64);
        assert!(ca.sign_node("not a csr", "node_abc", NODE_CERT_LIFETIME).is_err());
    }
}
