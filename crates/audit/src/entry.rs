//! Audit entries: who did what to what, when, with which token, and how it ended. An entry is
//! written with [`record`] in the transaction that makes the change, so a change that commits has
//! its entry and one that rolls back has none; a refusal is recorded in a transaction of its own.
//! Its place in the log and its chain hash come later (`checkpoint.rs`).

use better_compute_core::id::AuditEntryId;
use better_compute_db::DbError;
use serde::Serialize;
use sha2::Digest;
use tokio_postgres::GenericClient;

/// Who acted, as an entry holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryActor<'a> {
    /// A person or service through the API, with the token it used.
    Identity {
        /// `idn_…`.
        identity_id: &'a str,
        /// `tok_…`.
        token_id: &'a str,
    },
    /// A job of the control plane acting on its own (its kind, e.g. `health`).
    Job(&'a str),
}

/// How it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The change was made (the entry commits with it).
    Ok,
    /// The caller was not allowed: nothing changed.
    Denied,
}

/// An entry to record.
#[derive(Debug, Clone)]
pub struct NewEntry<'a> {
    /// Who.
    pub actor: EntryActor<'a>,
    /// The tenant acted in (none: the fleet).
    pub tenant_id: Option<&'a str>,
    /// What: an API method (`nodes.cordon`) or a job's decision (`health.quarantine`).
    pub action: &'a str,
    /// On what: an id, or what the request named.
    pub target: &'a str,
    /// The API request's id.
    pub request_id: Option<&'a str>,
    /// Where the request came from (the client's address).
    pub source: Option<&'a str>,
    /// How it ended.
    pub outcome: Outcome,
    /// The sha256 of the request's body, hex ([`digest`]).
    pub request_digest: Option<&'a str>,
}

/// The sha256 of a request's body, hex, as an entry holds it.
pub fn digest(body: &[u8]) -> String {
    format!("{:x}", sha2::Sha256::digest(body))
}

/// An API request: who makes the changes it commits, and how it asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `idn_…`.
    pub identity_id: String,
    /// `tok_…`.
    pub token_id: String,
    /// The caller's tenant.
    pub tenant_id: String,
    /// The method.
    pub action: String,
    /// What the request names.
    pub target: String,
    /// `req_…`.
    pub request_id: String,
    /// The client's address.
    pub source: Option<String>,
    /// [`digest`] of the body.
    pub request_digest: String,
}

impl Request {
    /// The entry of this request with `outcome`.
    pub fn entry(&self, outcome: Outcome) -> NewEntry<'_> {
        NewEntry {
            actor: EntryActor::Identity { identity_id: &self.identity_id, token_id: &self.token_id },
            tenant_id: Some(&self.tenant_id),
            action: &self.action,
            target: &self.target,
            request_id: Some(&self.request_id),
            source: self.source.as_deref(),
            outcome,
            request_digest: Some(&self.request_digest),
        }
    }
}

/// Who makes a change: passed explicitly to every module function that records one, and recorded
/// with [`Actor::record`] in the change's transaction (a batch's with [`with_batch_entries`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Actor {
    /// A person or service through the API: the request it made.
    Request(std::sync::Arc<Request>),
    /// A job of the control plane acting on its own: its kind (`health`) or what acts for it
    /// (`workflow`).
    Job(std::borrow::Cow<'static, str>),
}

impl Actor {
    /// A job acting on its own, by its kind.
    pub const fn job(kind: &'static str) -> Actor {
        Actor::Job(std::borrow::Cow::Borrowed(kind))
    }

    /// The API request this actor makes, if it is one.
    pub fn request(&self) -> Option<&Request> {
        match self {
            Actor::Request(r) => Some(r),
            Actor::Job(_) => None,
        }
    }

    /// Records, in `tx` (the transaction that makes the change), that this actor changed `target`:
    /// a request's entry names the method its caller called, in the caller's tenant unless
    /// `tenant_id` names another (a fleet operator's change to what one tenant owns is that
    /// tenant's to read); a job's names `action`, in `tenant_id` (none: the fleet). Call it once
    /// per committed change, not on a replayed answer.
    pub async fn record(&self, tx: &impl GenericClient, action: &str, target: &str, tenant_id: Option<&str>) -> Result<(), DbError> {
        let e = match self {
            Actor::Request(r) => NewEntry { target, tenant_id: Some(tenant_id.unwrap_or(&r.tenant_id)), ..r.entry(Outcome::Ok) },
            Actor::Job(job) => NewEntry { actor: EntryActor::Job(job), tenant_id, action, target, request_id: None, source: None, outcome: Outcome::Ok, request_digest: None },
        };
        record(tx, &e).await.map(|_| ())
    }
}

fn clip(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Appends `e` in the caller's transaction; returns its id.
pub async fn record(tx: &impl GenericClient, e: &NewEntry<'_>) -> Result<String, DbError> {
    let id = AuditEntryId::generate().to_string();
    let (kind, actor_id, token_id) = match e.actor {
        EntryActor::Identity { identity_id, token_id } => ("identity", identity_id, Some(token_id)),
        EntryActor::Job(job) => ("job", job, None),
    };
    let outcome = match e.outcome {
        Outcome::Ok => "ok",
        Outcome::Denied => "denied",
    };
    tx.execute(
        "INSERT INTO audit_entries (id, actor_kind, actor_id, token_id, tenant_id, action, target, request_id, source, outcome, request_digest)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        &[
            &id,
            &kind,
            &clip(actor_id, 200),
            &token_id.map(|t| clip(t, 64)),
            &e.tenant_id.map(|t| clip(t, 64)),
            &clip(e.action, 100),
            &clip(e.target, 500),
            &e.request_id.map(|r| clip(r, 64)),
            &e.source.map(|s| clip(s, 100)),
            &outcome,
            &e.request_digest,
        ],
    )
    .await?;
    Ok(id)
}

/// An entry as the API shows it and the export carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    /// `aud_…`.
    pub id: String,
    /// Its place in the log; none until `audit.checkpoint` placed it.
    pub log_index: Option<i64>,
    /// RFC 3339, microseconds.
    pub at: String,
    /// identity or job.
    pub actor_kind: String,
    /// The identity, or the job's kind.
    pub actor_id: String,
    /// The token used.
    pub token_id: Option<String>,
    /// The tenant acted in.
    pub tenant_id: Option<String>,
    /// The method or decision.
    pub action: String,
    /// What it was about.
    pub target: String,
    /// The API request's id.
    pub request_id: Option<String>,
    /// The client's address.
    pub source: Option<String>,
    /// ok or denied.
    pub outcome: String,
    /// sha256 of the request's body.
    pub request_digest: Option<String>,
    /// `sha256(previous chain hash || canonical entry)`, hex; none until placed.
    pub chain_hash: Option<String>,
}

/// The bytes an entry is hashed as: its fields but the chain hash, as JSON in a fixed order.
pub fn canonical(e: &Entry) -> Vec<u8> {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Canonical<'a> {
        log_index: Option<i64>,
        id: &'a str,
        at: &'a str,
        actor_kind: &'a str,
        actor_id: &'a str,
        token_id: Option<&'a str>,
        tenant_id: Option<&'a str>,
        action: &'a str,
        target: &'a str,
        request_id: Option<&'a str>,
        source: Option<&'a str>,
        outcome: &'a str,
        request_digest: Option<&'a str>,
    }
    serde_json::to_vec(&Canonical {
        log_index: e.log_index,
        id: &e.id,
        at: &e.at,
        actor_kind: &e.actor_kind,
        actor_id: &e.actor_id,
        token_id: e.token_id.as_deref(),
        tenant_id: e.tenant_id.as_deref(),
        action: &e.action,
        target: &e.target,
        request_id: e.request_id.as_deref(),
        source: e.source.as_deref(),
        outcome: &e.outcome,
        request_digest: e.request_digest.as_deref(),
    })
    .expect("an entry serialises")
}

/// The chain hash after `prev` of entry `e`.
pub fn chain_hash(prev: &[u8; 32], e: &Entry) -> [u8; 32] {
    let mut h = sha2::Sha256::new();
    h.update(prev);
    h.update(canonical(e));
    h.finalize().into()
}

/// The columns [`entry_of`] reads.
pub(crate) const COLUMNS: &str = "id, log_index, to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), actor_kind, actor_id, token_id,
     tenant_id, action, target, request_id, source, outcome, request_digest, encode(chain_hash, 'hex')";

pub(crate) fn entry_of(r: &tokio_postgres::Row) -> Entry {
    Entry {
        id: r.get(0),
        log_index: r.get(1),
        at: r.get(2),
        actor_kind: r.get(3),
        actor_id: r.get(4),
        token_id: r.get(5),
        tenant_id: r.get(6),
        action: r.get(7),
        target: r.get(8),
        request_id: r.get(9),
        source: r.get(10),
        outcome: r.get(11),
        request_digest: r.get(12),
        chain_hash: r.get(13),
    }
}

/// The audit entries of a batch's changes as columns, the parameters of [`with_batch_entries`]:
/// `(id, actor kind, actor, token, tenant, action, target, request id, source, digest)`.
pub type BatchColumns = [Vec<Option<String>>; 10];

/// [`BatchColumns`] of a batch's changes: each its action (a job's; a request's entry names its
/// method), its target, its tenant and who made it.
pub fn batch_columns<'a>(changes: impl Iterator<Item = (&'a str, &'a str, &'a str, &'a Actor)>) -> BatchColumns {
    let mut c: BatchColumns = Default::default();
    for (action, target, tenant, actor) in changes {
        let id = Some(AuditEntryId::generate().to_string());
        let f: [Option<String>; 10] = match actor {
            Actor::Request(r) => [
                id,
                Some("identity".into()),
                Some(r.identity_id.clone()),
                Some(r.token_id.clone()),
                Some(r.tenant_id.clone()),
                Some(r.action.clone()),
                Some(target.to_owned()),
                Some(r.request_id.clone()),
                r.source.clone(),
                Some(r.request_digest.clone()),
            ],
            Actor::Job(job) => [id, Some("job".into()), Some(job.to_string()), None, Some(tenant.to_owned()), Some(action.to_owned()), Some(target.to_owned()), None, None, None],
        };
        for (col, v) in c.iter_mut().zip(f) {
            col.push(v);
        }
    }
    c
}

/// Wraps a batch statement whose one column `v` holds a view per request (NULL where the request
/// was not done) so that each done request's audit entry is written by the same statement; the
/// entries' columns ([`BatchColumns`]) are parameters `$first` to `$first + 9`.
pub fn with_batch_entries(statement: &str, first: usize) -> String {
    let p: Vec<String> = (first..first + 10).map(|i| format!("${i}::text[]")).collect();
    format!(
        "WITH r AS ({statement}),
              a AS (INSERT INTO audit_entries (id, actor_kind, actor_id, token_id, tenant_id, action, target, request_id, source, outcome, request_digest)
                    SELECT u.aid, u.kind, u.who, u.tok, u.ten, u.act, u.tgt, u.req, u.src, 'ok', u.dig
                      FROM r, unnest({}) WITH ORDINALITY AS u(aid, kind, who, tok, ten, act, tgt, req, src, dig, n)
                     WHERE r.v[u.n::int] IS NOT NULL)
         SELECT v FROM r",
        p.join(", ")
    )
}
