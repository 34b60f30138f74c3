//! Standard Webhooks signatures: `webhook-signature: v1,<base64 HMAC-SHA256>` over
//! `"{webhook-id}.{webhook-timestamp}.{body}"`, keyed by the base64 part of a `whsec_` secret.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Every secret starts with this.
pub const SECRET_PREFIX: &str = "whsec_";

/// A new secret: `whsec_` and 32 random bytes in base64.
pub fn new_secret() -> String {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).expect("the operating system's random source works");
    format!("{SECRET_PREFIX}{}", STANDARD.encode(key))
}

/// The `v1,…` signature of one message with one secret.
pub fn sign(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> String {
    let key = STANDARD.decode(secret.strip_prefix(SECRET_PREFIX).unwrap_or(secret)).unwrap_or_default();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes any key length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// The `webhook-signature` header: one signature per live secret, space-separated (the current
/// one first, then the previous one during a rotation's grace).
pub fn header(secrets: &[&str], id: &str, timestamp: i64, body: &[u8]) -> String {
    secrets.iter().map(|s| sign(s, id, timestamp, body)).collect::<Vec<_>>().join(" ")
}
