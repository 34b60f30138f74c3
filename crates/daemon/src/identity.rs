//! The node's identity on disk: its private key (`node.key`, mode 0600, never sent anywhere), its
//! certificate (`node.pem`), the CA it trusts (`ca.pem`), the control plane's command-signing keys
//! it pinned (`command-key.pub`, one hex key a line: destructive commands must verify against one
//! of them; the first comes with the join, later ones only endorsed by a pinned key, see
//! [`follow_command_keys`]) and `node.json` (node id and validity).
//! Joining sends a CSR with a join token; rotating sends a fresh CSR over the current mTLS session
//! once 80% of the certificate's lifetime has passed.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use better_compute_proto::v1::CertificateGrant;
use rcgen::{CertificateParams, DnType, KeyPair};
use serde::{Deserialize, Serialize};

/// The pinned command-signing key, hex.
pub const COMMAND_KEY_FILE: &str = "command-key.pub";

/// The share of a certificate's lifetime after which the daemon rotates it.
pub const ROTATE_AT: f64 = 0.8;

/// Why the identity could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// Files.
    #[error("node identity in {dir}: {source}")]
    Io {
        /// The state folder.
        dir: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// Keys and CSRs.
    #[error("node identity: {0}")]
    Crypto(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NodeFile {
    node_id: String,
    not_before_unix_s: i64,
    not_after_unix_s: i64,
}

/// A joined node's identity.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The node id the certificate names.
    pub node_id: String,
    /// Certificate, PEM.
    pub cert_pem: String,
    /// Private key, PEM.
    pub key_pem: String,
    /// The CA, PEM.
    pub ca_pem: String,
    /// Validity, Unix seconds.
    pub not_before_unix_s: i64,
    /// Validity, Unix seconds.
    pub not_after_unix_s: i64,
    /// The control plane's Ed25519 command-signing keys it accepts: the one pinned at join, and
    /// during a rotation its endorsed successor (empty: none was given, or the file was lost;
    /// every destructive command is then refused).
    pub command_keys: Vec<Vec<u8>>,
}

/// A key and its CSR, before the CA signed it.
pub struct Request {
    /// The CSR, PEM.
    pub csr_pem: String,
    key_pem: String,
}

/// A new key and a CSR for it.
pub fn request(node_name: &str) -> Result<Request, IdentityError> {
    let crypto = |e: rcgen::Error| IdentityError::Crypto(e.to_string());
    let key = KeyPair::generate().map_err(crypto)?;
    let mut p = CertificateParams::new(Vec::<String>::new()).map_err(crypto)?;
    p.distinguished_name.push(DnType::CommonName, node_name);
    let csr = p.serialize_request(&key).map_err(crypto)?.pem().map_err(crypto)?;
    Ok(Request { csr_pem: csr, key_pem: key.serialize_pem() })
}

impl Request {
    /// The private key, PEM.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }
}

impl Identity {
    /// The identity a signed CSR makes, with the command-signing keys to pin (the join's; a
    /// certificate rotation keeps those pinned).
    pub fn from_grant(node_id: &str, req: Request, g: CertificateGrant, command_keys: Vec<Vec<u8>>) -> Identity {
        Identity {
            node_id: node_id.to_owned(),
            cert_pem: g.certificate_pem,
            key_pem: req.key_pem,
            ca_pem: g.ca_pem,
            not_before_unix_s: g.not_before_unix_s,
            not_after_unix_s: g.not_after_unix_s,
            command_keys,
        }
    }

    /// Whether it is time to rotate at `now` (Unix seconds): 80% of the lifetime has passed.
    pub fn rotation_due(&self, now_unix_s: i64) -> bool {
        let life = (self.not_after_unix_s - self.not_before_unix_s).max(1) as f64;
        now_unix_s as f64 >= self.not_before_unix_s as f64 + life * ROTATE_AT
    }

    /// Reads the identity from `dir`, if the node has joined.
    pub fn load(dir: &Path) -> Result<Option<Identity>, IdentityError> {
        let io = |source| IdentityError::Io { dir: dir.to_owned(), source };
        let meta = dir.join("node.json");
        if !meta.exists() {
            return Ok(None);
        }
        let f: NodeFile = serde_json::from_slice(&std::fs::read(&meta).map_err(io)?).map_err(|e| IdentityError::Crypto(e.to_string()))?;
        Ok(Some(Identity {
            node_id: f.node_id,
            cert_pem: std::fs::read_to_string(dir.join("node.pem")).map_err(io)?,
            key_pem: std::fs::read_to_string(dir.join("node.key")).map_err(io)?,
            ca_pem: std::fs::read_to_string(dir.join("ca.pem")).map_err(io)?,
            not_before_unix_s: f.not_before_unix_s,
            not_after_unix_s: f.not_after_unix_s,
            command_keys: match std::fs::read_to_string(dir.join(COMMAND_KEY_FILE)) {
                Ok(text) => text.lines().filter_map(|l| hex::decode(l.trim()).ok()).filter(|k| k.len() == 32).collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(io(e)),
            },
        }))
    }

    /// Writes it to `dir`: the key with mode 0600; `node.json` last, so a half-written identity is
    /// never taken for a whole one.
    pub fn save(&self, dir: &Path) -> Result<(), IdentityError> {
        let io = |source| IdentityError::Io { dir: dir.to_owned(), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        let write = |name: &str, body: &str, mode: u32| -> std::io::Result<()> {
            let tmp = dir.join(format!("{name}.tmp"));
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
            f.write_all(body.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, dir.join(name))
        };
        write("node.key", &self.key_pem, 0o600).map_err(io)?;
        write("node.pem", &self.cert_pem, 0o644).map_err(io)?;
        write("ca.pem", &self.ca_pem, 0o644).map_err(io)?;
        if !self.command_keys.is_empty() {
            write(COMMAND_KEY_FILE, &keys_text(&self.command_keys), 0o644).map_err(io)?;
        }
        let meta = NodeFile { node_id: self.node_id.clone(), not_before_unix_s: self.not_before_unix_s, not_after_unix_s: self.not_after_unix_s };
        write("node.json", &serde_json::to_string_pretty(&meta).expect("serializes"), 0o644).map_err(io)
    }
}

fn keys_text(keys: &[Vec<u8>]) -> String {
    keys.iter().map(|k| hex::encode(k) + "\n").collect()
}

/// Writes the pinned command-signing keys alone (after a rotation moved them), atomically.
pub fn save_command_keys(dir: &Path, keys: &[Vec<u8>]) -> Result<(), IdentityError> {
    let io = |source| IdentityError::Io { dir: dir.to_owned(), source };
    let tmp = dir.join(format!("{COMMAND_KEY_FILE}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(&tmp).map_err(io)?;
    f.write_all(keys_text(keys).as_bytes()).and_then(|()| f.sync_all()).map_err(io)?;
    std::fs::rename(&tmp, dir.join(COMMAND_KEY_FILE)).map_err(io)
}

/// The keys to accept after the desired state announced `announced` (oldest first): an announced
/// key is pinned when a key already pinned endorsed it (so a chain of rotations is followed in
/// order), and a pinned key no longer announced is forgotten, but never the last one. Nothing
/// announced changes nothing: no rotation has happened.
pub fn follow_command_keys(pinned: &[Vec<u8>], announced: &[better_compute_proto::v1::CommandKey]) -> Vec<Vec<u8>> {
    if announced.is_empty() {
        return pinned.to_vec();
    }
    let mut trusted = pinned.to_vec();
    for k in announced {
        let message = better_compute_proto::command_key_endorsement_message(&k.public_key);
        let endorsed = trusted.iter().any(|t| ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, t).verify(&message, &k.endorsement).is_ok());
        if !trusted.contains(&k.public_key) && endorsed {
            trusted.push(k.public_key.clone());
        }
    }
    let kept: Vec<Vec<u8>> = trusted.into_iter().filter(|t| announced.iter().any(|a| &a.public_key == t)).collect();
    if kept.is_empty() { pinned.to_vec() } else { kept }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_is_due_at_eighty_percent_of_the_lifetime() {
        let id = Identity {
            node_id: "node_x".into(),
            cert_pem: String::new(),
            key_pem: String::new(),
            ca_pem: String::new(),
            not_before_unix_s: 1_000,
            not_after_unix_s: 2_000,
            command_keys: Vec::new(),
        };
        assert!(!id.rotation_due(1_799));
        assert!(id.rotation_due(1_800));
        assert!(id.rotation_due(5_000));
    }

    #[test]
    fn a_saved_identity_loads_back_and_its_key_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        assert!(Identity::load(dir.path()).unwrap().is_none());
        let r = request("n1").unwrap();
        assert!(r.csr_pem.contains("CERTIFICATE REQUEST"));
        let g = CertificateGrant { certificate_pem: "C".into(), ca_pem: "A".into(), not_before_unix_s: 1, not_after_unix_s: 2 };
        let id = Identity::from_grant("node_1", r, g, vec![vec![7; 32]]);
        id.save(dir.path()).unwrap();
        let back = Identity::load(dir.path()).unwrap().unwrap();
        assert_eq!((back.node_id.as_str(), back.cert_pem.as_str(), back.key_pem.as_str()), ("node_1", "C", id.key_pem.as_str()));
        assert_eq!(back.command_keys, vec![vec![7; 32]], "the pinned command-signing key");
        assert_eq!(std::fs::metadata(dir.path().join("node.key")).unwrap().permissions().mode() & 0o777, 0o600);
        // A lost key file is no key: destructive commands are refused until a fresh join.
        std::fs::remove_file(dir.path().join(COMMAND_KEY_FILE)).unwrap();
        assert_eq!(Identity::load(dir.path()).unwrap().unwrap().command_keys, Vec::<Vec<u8>>::new());
        save_command_keys(dir.path(), &[vec![1; 32], vec![2; 32]]).unwrap();
        assert_eq!(Identity::load(dir.path()).unwrap().unwrap().command_keys, vec![vec![1; 32], vec![2; 32]]);
    }

    fn key() -> ring::signature::Ed25519KeyPair {
        let pkcs8 = ring::signature::Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new()).unwrap();
        ring::signature::Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap()
    }

    fn announce(k: &ring::signature::Ed25519KeyPair, by: Option<&ring::signature::Ed25519KeyPair>) -> better_compute_proto::v1::CommandKey {
        use ring::signature::KeyPair;
        let public_key = k.public_key().as_ref().to_vec();
        let endorsement = by.map(|b| b.sign(&better_compute_proto::command_key_endorsement_message(&public_key)).as_ref().to_vec()).unwrap_or_default();
        better_compute_proto::v1::CommandKey { public_key, endorsement }
    }

    #[test]
    fn a_rotation_is_followed_only_through_endorsements_and_the_last_key_is_never_dropped() {
        use ring::signature::KeyPair;
        let (k0, k1, k2, stranger) = (key(), key(), key(), key());
        let pub_of = |k: &ring::signature::Ed25519KeyPair| k.public_key().as_ref().to_vec();
        let pinned = vec![pub_of(&k0)];
        assert_eq!(follow_command_keys(&pinned, &[]), pinned, "no rotation yet");
        // Rotating: both, the new one endorsed by the old.
        let both = follow_command_keys(&pinned, &[announce(&k0, None), announce(&k1, Some(&k0))]);
        assert_eq!(both, vec![pub_of(&k0), pub_of(&k1)]);
        // Retired: only the new one.
        assert_eq!(follow_command_keys(&both, &[announce(&k1, Some(&k0))]), vec![pub_of(&k1)]);
        // A chain seen at once (a node away through a whole rotation and into the next).
        assert_eq!(follow_command_keys(&pinned, &[announce(&k0, None), announce(&k1, Some(&k0)), announce(&k2, Some(&k1))]).len(), 3);
        // A key nobody pinned endorsed is not taken, and the pinned one is not dropped for it.
        assert_eq!(follow_command_keys(&pinned, &[announce(&k2, Some(&stranger))]), pinned);
        assert_eq!(follow_command_keys(&pinned, &[announce(&stranger, None)]), pinned);
        // A daemon that lost its key store learns nothing from the desired state: only a join.
        assert_eq!(follow_command_keys(&[], &[announce(&k0, None), announce(&k1, Some(&k0))]), Vec::<Vec<u8>>::new());
        // Too late for the chain: the node cannot follow and keeps its key (it must join again).
        assert_eq!(follow_command_keys(&pinned, &[announce(&k2, Some(&k1))]), pinned);
    }
}
