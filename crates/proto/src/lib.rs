//! `bettercompute.agent.v1`: the desired state of a node (`v1::NodeSpec`), the command bodies
//! (`v1::CommandBody`) and, with the `grpc` feature, the daemon<->gateway service
//! (`v1::gateway_server`, `v1::gateway_client`), generated from `proto/` by prost and tonic, with the
//! proto3 JSON mapping by pbjson. This crate stands alone: the daemon depends on it, never on the database.

#![allow(missing_docs, clippy::all, clippy::too_many_lines)]

/// The v1 package.
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/bettercompute.agent.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/bettercompute.agent.v1.serde.rs"));
}

/// The bytes a destructive command's Ed25519 signature covers: a domain tag, then the node, the
/// command's seq on it, its kind, the SHA-256 of its encoded `CommandBody`, its `notAfter` (Unix
/// milliseconds) and its `minGeneration`, each length-prefixed or fixed-width so no two commands
/// share them. The control plane signs them at enqueue; the daemon checks them against the key it
/// pinned at join, so a command replayed to another node or under another seq does not verify.
pub fn command_signing_message(node_id: &str, seq: i64, kind: &str, body: &[u8], not_after_unix_ms: i64, min_generation: i64) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut m = Vec::with_capacity(64 + node_id.len() + kind.len() + 32);
    m.extend_from_slice(b"bettercompute.command.v1\0");
    for part in [node_id.as_bytes(), kind.as_bytes()] {
        m.extend_from_slice(&(part.len() as u32).to_be_bytes());
        m.extend_from_slice(part);
    }
    m.extend_from_slice(&seq.to_be_bytes());
    m.extend_from_slice(&Sha256::digest(body));
    m.extend_from_slice(&not_after_unix_ms.to_be_bytes());
    m.extend_from_slice(&min_generation.to_be_bytes());
    m
}

/// The bytes a command-signing key's endorsement covers: a domain tag and the new public key. The
/// previous key signs them when the control plane rotates its key, so a daemon that pinned the
/// previous key can trust the new one without joining again.
pub fn command_key_endorsement_message(public_key: &[u8]) -> Vec<u8> {
    let mut m = b"bettercompute.command-key.v1\0".to_vec();
    m.extend_from_slice(public_key);
    m
}
