//! The command-signing key: an Ed25519 key the control plane signs every destructive command with
//! at enqueue (see `better_compute_proto::command_signing_message`). It is created on first start
//! in the CA's folder (`command-signing.pk8`, mode 0600), kept with the CA and never in the
//! database; daemons learn its public half when they join. The roles that enqueue commands (api,
//! worker) and the gateway (which hands the public key out) load it from the same folder, and the
//! registry carries it to the enqueue path ([`crate::Registry::install_command_signer`]).

use std::path::Path;

use ring::rand::SystemRandom;
use ring::signature::{Ed25519KeyPair, KeyPair};

/// The file in the CA's folder.
pub const KEY_FILE: &str = "command-signing.pk8";
/// A rotation's new key, until it replaces [`KEY_FILE`].
pub const NEXT_KEY_FILE: &str = "command-signing.next.pk8";
/// The key a rotation replaced, until the rotation is finished.
pub const PREVIOUS_KEY_FILE: &str = "command-signing.previous.pk8";

/// Why the key could not be loaded or made.
#[derive(Debug, thiserror::Error)]
pub enum SigningError {
    /// Reading or writing the key file failed.
    #[error("command-signing key {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not an Ed25519 PKCS#8 key.
    #[error("command-signing key {path} is not an Ed25519 PKCS#8 key; restore it from the CA's backup (daemons pinned its public key)")]
    BadKey {
        /// The file.
        path: String,
    },
}

/// The control plane's command-signing key.
pub struct CommandSigner {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for CommandSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the private half.
        write!(f, "CommandSigner({})", hex_of(&self.public_key()))
    }
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl CommandSigner {
    /// Loads `dir/command-signing.pk8`, creating it (mode 0600, never overwriting one another
    /// process made first) when absent.
    pub fn load_or_create(dir: &Path) -> Result<CommandSigner, SigningError> {
        let io = |source| SigningError::Io { path: dir.display().to_string(), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        CommandSigner::load_or_create_file(&dir.join(KEY_FILE))
    }

    /// Loads the key in `path`, creating it (mode 0600, never overwriting one another process made
    /// first) when absent.
    pub fn load_or_create_file(path: &Path) -> Result<CommandSigner, SigningError> {
        let io = |source| SigningError::Io { path: path.display().to_string(), source };
        if !path.exists() {
            let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).expect("the system's randomness");
            let mut open = std::fs::OpenOptions::new();
            open.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
            match open.open(path) {
                Ok(mut f) => std::io::Write::write_all(&mut f, pkcs8.as_ref()).and_then(|()| f.sync_all()).map_err(io)?,
                // Another role of this fleet made it first: use theirs.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
        }
        let bytes = std::fs::read(path).map_err(io)?;
        CommandSigner::from_pkcs8(&bytes).ok_or_else(|| SigningError::BadKey { path: path.display().to_string() })
    }

    /// A key from PKCS#8 bytes; none if they are not an Ed25519 key.
    pub fn from_pkcs8(bytes: &[u8]) -> Option<CommandSigner> {
        Ed25519KeyPair::from_pkcs8(bytes).ok().map(|pair| CommandSigner { pair })
    }

    /// A fresh key held only in memory (tests).
    pub fn generate() -> CommandSigner {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).expect("the system's randomness");
        CommandSigner::from_pkcs8(pkcs8.as_ref()).expect("a key ring just made")
    }

    /// The public half, 32 bytes: what daemons pin.
    pub fn public_key(&self) -> Vec<u8> {
        self.pair.public_key().as_ref().to_vec()
    }

    /// Signs `message` (64 bytes).
    pub fn sign(&self, message: &[u8]) -> Vec<u8> {
        self.pair.sign(message).as_ref().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_made_once_with_mode_0600_and_loaded_again() {
        let dir = tempfile::tempdir().unwrap();
        let a = CommandSigner::load_or_create(dir.path()).unwrap();
        let b = CommandSigner::load_or_create(dir.path()).unwrap();
        assert_eq!(a.public_key(), b.public_key());
        assert_eq!(a.public_key().len(), 32);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(KEY_FILE)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        let sig = a.sign(b"m");
        let key = ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, b.public_key());
        assert!(key.verify(b"m", &sig).is_ok());
        assert!(key.verify(b"n", &sig).is_err());
        assert!(!format!("{a:?}").contains(&hex_of(&std::fs::read(dir.path().join(KEY_FILE)).unwrap())));
        std::fs::write(dir.path().join(KEY_FILE), b"nonsense").unwrap();
        assert!(matches!(CommandSigner::load_or_create(dir.path()), Err(SigningError::BadKey { .. })));
    }
}
