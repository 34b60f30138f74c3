//! Prefixed ids: `node_01jd…`, `cmd_01jd…`, `res_01jd…`.
//!
//! An id is a kind prefix, an underscore and 26 characters of lowercase Crockford base32 encoding
//! 48 bits of milliseconds and 80 random bits (a ULID), so ids sort roughly by creation and never
//! collide in practice. Parsing checks the prefix and the alphabet, so an id of the wrong kind is
//! refused at the edge with `INVALID_ARGUMENT`.

use crate::error::Error;

const ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";
const BODY_LEN: usize = 26;

/// The kinds of ids and their prefixes.
pub trait IdKind {
    /// The prefix without the underscore, e.g. `node`.
    const PREFIX: &'static str;
    /// What the thing is called in messages, e.g. `node`.
    const NOUN: &'static str;
}

/// Encodes a 128-bit value as 26 Crockford base32 characters (the first carries 3 bits).
fn encode(value: u128) -> String {
    let mut out = [0u8; BODY_LEN];
    for (i, slot) in out.iter_mut().enumerate() {
        let shift = 5 * (BODY_LEN - 1 - i);
        *slot = ALPHABET[((value >> shift) & 0x1f) as usize];
    }
    String::from_utf8(out.to_vec()).expect("alphabet is ASCII")
}

/// A ULID-shaped body: 48 bits of milliseconds, then 80 random bits.
fn body_at(ms: u64, random: [u8; 10]) -> String {
    let ms = (ms as u128) & ((1u128 << 48) - 1);
    let r = random.iter().fold(0u128, |acc, b| (acc << 8) | *b as u128);
    encode((ms << 80) | r)
}

fn new_body() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let mut random = [0u8; 10];
    getrandom::fill(&mut random).expect("the operating system's random source works");
    body_at(ms, random)
}

fn body_is_valid(body: &str) -> bool {
    body.len() == BODY_LEN
        && body.bytes().all(|b| ALPHABET.contains(&b))
        // 26 base32 characters hold 130 bits; a ULID uses 128, so the first is at most '7'.
        && body.as_bytes()[0] <= b'7'
}

/// Parses `<prefix>_<body>` for the given prefix.
pub fn parse_prefixed<'a>(prefix: &str, noun: &str, s: &'a str) -> Result<&'a str, Error> {
    match s.strip_prefix(prefix).and_then(|rest| rest.strip_prefix('_')) {
        Some(body) if body_is_valid(body) => Ok(s),
        _ => Err(Error::invalid_argument(format!(
            "{s:?} is not a {noun} id: expected {prefix}_ followed by 26 lowercase base32 characters"
        ))),
    }
}

/// A typed, prefixed id.
pub struct Id<K: IdKind> {
    text: String,
    kind: std::marker::PhantomData<fn() -> K>,
}

impl<K: IdKind> Id<K> {
    /// A fresh id.
    pub fn generate() -> Self {
        Id { text: format!("{}_{}", K::PREFIX, new_body()), kind: std::marker::PhantomData }
    }

    /// Parses and validates an id of this kind.
    pub fn parse(s: &str) -> Result<Self, Error> {
        parse_prefixed(K::PREFIX, K::NOUN, s)?;
        Ok(Id { text: s.to_owned(), kind: std::marker::PhantomData })
    }

    /// The id's text.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl<K: IdKind> Clone for Id<K> {
    fn clone(&self) -> Self {
        Id { text: self.text.clone(), kind: std::marker::PhantomData }
    }
}
impl<K: IdKind> PartialEq for Id<K> {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}
impl<K: IdKind> Eq for Id<K> {}
impl<K: IdKind> std::hash::Hash for Id<K> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.text.hash(state)
    }
}
impl<K: IdKind> PartialOrd for Id<K> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<K: IdKind> Ord for Id<K> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.text.cmp(&other.text)
    }
}
impl<K: IdKind> std::fmt::Debug for Id<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}
impl<K: IdKind> std::fmt::Display for Id<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}
impl<K: IdKind> std::str::FromStr for Id<K> {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Self::parse(s)
    }
}
impl<K: IdKind> serde::Serialize for Id<K> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}
impl<'de, K: IdKind> serde::Deserialize<'de> for Id<K> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(|e| serde::de::Error::custom(e.message))
    }
}

macro_rules! id_kinds {
    ($($(#[$doc:meta])* $alias:ident, $kind:ident, $prefix:literal, $noun:literal;)*) => {$(
        #[doc = concat!("Marker for ", $noun, " ids (`", $prefix, "_…`).")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $kind {}
        impl IdKind for $kind {
            const PREFIX: &'static str = $prefix;
            const NOUN: &'static str = $noun;
        }
        $(#[$doc])*
        pub type $alias = Id<$kind>;
    )*};
}

id_kinds! {
    /// A tenant.
    TenantId, TenantKind, "ten", "tenant";
    /// An identity: a person or a service account.
    IdentityId, IdentityKind, "idn", "identity";
    /// A site.
    SiteId, SiteKind, "site", "site";
    /// A pool of nodes within a site.
    PoolId, PoolKind, "pool", "pool";
    /// A node (one GPU server).
    NodeId, NodeKind, "node", "node";
    /// A reservation.
    ReservationId, ReservationKind, "res", "reservation";
    /// A command to a node.
    CommandId, CommandKind, "cmd", "command";
    /// An outbox event.
    EventId, EventKind, "evt", "event";
    /// A worker process.
    WorkerId, WorkerKind, "wrk", "worker";
    /// A gateway process (its lease is `gateway:<id>`).
    GatewayId, GatewayKind, "gw", "gateway";
    /// A bearer token (its id; the secret is never stored).
    TokenId, TokenKind, "tok", "token";
    /// A role binding.
    RoleBindingId, RoleBindingKind, "rb", "role binding";
    /// A node join token (its id; the secret is never stored).
    JoinTokenId, JoinTokenKind, "jt", "join token";
    /// A webhook endpoint.
    WebhookId, WebhookKind, "wh", "webhook";
    /// One delivery of one event to one webhook.
    DeliveryId, DeliveryKind, "dlv", "delivery";
    /// A node's drain.
    DrainId, DrainKind, "drn", "drain";
    /// A workflow: a multi-step operation the `workflow` job advances.
    WorkflowId, WorkflowKind, "wf", "workflow";
    /// An instance: a VM on a reservation's atoms on a vps-host node.
    InstanceId, InstanceKind, "ins", "instance";
    /// An entry of the audit log.
    AuditEntryId, AuditEntryKind, "aud", "audit entry";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_id_carries_its_prefix_and_parses_back() {
        let id = NodeId::generate();
        assert!(id.as_str().starts_with("node_"), "{id}");
        assert_eq!(id.as_str().len(), "node_".len() + BODY_LEN);
        assert_eq!(NodeId::parse(id.as_str()).unwrap(), id);
    }

    #[test]
    fn ids_of_one_kind_do_not_parse_as_another() {
        let id = CommandId::generate();
        let err = NodeId::parse(id.as_str()).unwrap_err();
        assert_eq!(err.code, crate::ErrorCode::InvalidArgument);
        assert!(err.message.contains("node id"), "{}", err.message);
    }

    #[test]
    fn malformed_bodies_are_refused() {
        for bad in ["node_", "node", "node_01JDXXXXXXXXXXXXXXXXXXXXXX", "node_0123456789abcdefghjkmnpqri",
                    "node_81jd0000000000000000000000", "node_01jd00000000000000000000000", "nodes_01jd0000000000000000000000"] {
            assert!(NodeId::parse(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn a_later_millisecond_sorts_later_whatever_the_random_bits() {
        let a = body_at(1_700_000_000_000, [0xff; 10]);
        let b = body_at(1_700_000_000_001, [0x00; 10]);
        assert!(a < b, "{a} < {b}");
        assert!(body_is_valid(&a) && body_is_valid(&b));
    }

    #[test]
    fn ids_round_trip_through_json() {
        let id = TenantId::generate();
        let json = serde_json::to_string(&id).unwrap();
        let back: TenantId = serde_json::from_str(&json).unwrap();
        assert_eq!(back, id);
        assert!(serde_json::from_str::<TenantId>("\"node_01jd0000000000000000000000\"").is_err());
    }
}
