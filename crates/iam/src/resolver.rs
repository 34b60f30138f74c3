//! The resolver: authentication and decisions, with the spec's caches.
//!
//! - An authenticated token is cached for 30 s (never past its expiry).
//! - A read decision (a permission ending in `:read`) is cached for 10 s; writes always ask the
//!   projection.
//! - [`Iam::apply_changes`] tails `authz_changes` (the outbox's cursor rule, so none is skipped)
//!   and drops the cached entries of every identity and token changed. Run every second by
//!   [`Iam::run_tail`], a revocation takes effect within about a second; if the tail stalls, the
//!   TTLs bound the delay: 30 s for a revoked token, 10 s for a removed read permission.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use better_compute_core::{Caller, Error, ErrorCode};
use better_compute_db::pool::read_tx;
use better_compute_db::{DbError, Pool};
use better_compute_runtime::authz::{Authorizer, Resource};

use crate::bindings::scope_path_sql;
use crate::tokens;

/// How long an authenticated token is trusted without asking the database.
pub const AUTH_CACHE_TTL: Duration = Duration::from_secs(30);
/// How long a read decision is trusted without asking the database.
pub const READ_DECISION_CACHE_TTL: Duration = Duration::from_secs(10);
/// Entries per cache; a full cache is emptied (a cheap, bounded policy: misses just ask again).
pub const CACHE_ENTRIES_MAX: usize = 100_000;
/// Changes read per tail batch.
const TAIL_BATCH: i64 = 1000;
/// Changes the broadcast to long-lived streams holds; a stream further behind revalidates.
const CHANGES_CAPACITY: usize = 1024;

/// A change that can shrink what someone may do: a binding of the identity removed or changed, or
/// (with `token_id`) one of its tokens revoked. Long-lived streams ([`Iam::subscribe_changes`])
/// revalidate on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityChange {
    /// The identity changed.
    pub identity_id: String,
    /// The token revoked, if one was.
    pub token_id: Option<String>,
}

/// Who a request speaks for, once authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token used.
    pub token_id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// Its identity.
    pub identity_id: String,
}

impl Principal {
    /// As the modules' [`Caller`].
    pub fn caller(&self) -> Caller<'_> {
        Caller { tenant_id: &self.tenant_id, identity_id: &self.identity_id }
    }
}

/// A monotonic clock in milliseconds, for the caches' ages (tests drive their own).
pub type CacheClock = Arc<dyn Fn() -> u64 + Send + Sync>;

type DecisionKey = (String, String, String, String);

struct Caches {
    auth: HashMap<[u8; 32], (Principal, u64)>,
    decisions: HashMap<DecisionKey, ((bool, bool), u64)>,
    /// The `authz_changes` cursor: `(txid, seq)`.
    cursor: (i64, i64),
}

/// The IAM resolver: authenticates tokens and decides permissions, with caches.
pub struct Iam {
    pool: Pool,
    clock: CacheClock,
    caches: Mutex<Caches>,
    changes: tokio::sync::broadcast::Sender<IdentityChange>,
}

fn resource_scope<'a>(caller: Caller<'a>, r: Resource<'a>) -> (&'static str, &'a str) {
    match r {
        Resource::Fleet => ("fleet", ""),
        Resource::Tenant => ("tenant", caller.tenant_id),
        Resource::Site(s) => ("site", s),
        Resource::Pool(p) => ("pool", p),
        Resource::Node(n) => ("node", n),
    }
}

impl Iam {
    /// A resolver over `pool` with the process's monotonic clock. Call [`Iam::start_tail`] before
    /// serving, so changes committed from then on reach the caches.
    pub fn new(pool: Pool) -> Iam {
        let origin = Instant::now();
        Iam::with_clock(pool, Arc::new(move || origin.elapsed().as_millis() as u64))
    }

    /// A resolver with a given clock (tests).
    pub fn with_clock(pool: Pool, clock: CacheClock) -> Iam {
        let (changes, _) = tokio::sync::broadcast::channel(CHANGES_CAPACITY);
        Iam { pool, clock, caches: Mutex::new(Caches { auth: HashMap::new(), decisions: HashMap::new(), cursor: (0, 0) }), changes }
    }

    fn caches(&self) -> std::sync::MutexGuard<'_, Caches> {
        self.caches.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Authenticates a bearer secret: UNAUTHENTICATED unless it is a live token.
    pub async fn authenticate(&self, secret: &str) -> Result<Principal, Error> {
        let key = tokens::secret_sha256(secret);
        let now = (self.clock)();
        if let Some((p, until)) = self.caches().auth.get(&key) && now < *until {
            return Ok(p.clone());
        }
        let db = read_tx(&self.pool).await?;
        let owner = tokens::authenticate(&*db, secret).await?;
        let p = Principal { token_id: owner.token_id, tenant_id: owner.tenant_id, identity_id: owner.identity_id };
        let ttl_ms = (AUTH_CACHE_TTL.as_millis() as u64).min((owner.expires_in_s.max(0.0) * 1000.0) as u64);
        let mut c = self.caches();
        if c.auth.len() >= CACHE_ENTRIES_MAX {
            c.auth.clear();
        }
        c.auth.insert(key, (p.clone(), now + ttl_ms));
        Ok(p)
    }

    /// Whether `identity` holds `permission` on `(kind, id)`, and whether it holds anything there.
    async fn decide(&self, caller: Caller<'_>, permission: &str, kind: &str, id: &str) -> Result<(bool, bool), Error> {
        let db = read_tx(&self.pool).await?;
        let row = db
            .query_one(
                &format!(
                    "SELECT coalesce(bool_or(a.permission = $5), false), count(*) > 0
                       FROM authz_projection a JOIN {} s ON (s.scope_kind, s.scope_id) = (a.scope_kind, a.scope_id)
                      WHERE a.identity_id = $4",
                    scope_path_sql(1, 2, 3)
                ),
                &[&kind, &id, &caller.tenant_id, &caller.identity_id, &permission],
            )
            .await
            .map_err(DbError::from)?;
        Ok((row.get(0), row.get(1)))
    }

    /// Drops this process's cached entries of an identity (and of one of its tokens) at once: the
    /// process that committed a revocation or an unbinding calls it, so the change holds here
    /// before the answer leaves; other processes learn it from the tail.
    pub fn forget(&self, identity_id: &str, token_id: Option<&str>) {
        {
            let mut c = self.caches();
            c.auth.retain(|_, (p, _)| p.identity_id != identity_id && Some(p.token_id.as_str()) != token_id);
            c.decisions.retain(|k, _| k.0 != identity_id);
        }
        // After the caches: a stream that revalidates on this must not read a stale entry. No
        // subscriber is fine.
        let _ = self.changes.send(IdentityChange { identity_id: identity_id.to_owned(), token_id: token_id.map(str::to_owned) });
    }

    /// Every change this process learns of from now on (served here, or read by the tail), for
    /// streams that must end or narrow when their token is revoked or a binding removed.
    pub fn subscribe_changes(&self) -> tokio::sync::broadcast::Receiver<IdentityChange> {
        self.changes.subscribe()
    }

    /// Asks the database, uncached, whether a token is still live: how long it has left on the
    /// database's clock, or UNAUTHENTICATED once it is revoked or expired.
    pub async fn token_time_left(&self, token_id: &str) -> Result<Duration, Error> {
        let db = read_tx(&self.pool).await?;
        let left = tokens::time_left(&*db, token_id).await?;
        Ok(Duration::from_secs_f64(left.max(0.0)))
    }

    /// Whether an identity holds any permission at any scope (uncached).
    pub async fn holds_anything(&self, identity_id: &str) -> Result<bool, Error> {
        let db = read_tx(&self.pool).await?;
        let row = db
            .query_one("SELECT EXISTS (SELECT 1 FROM authz_projection WHERE identity_id = $1)", &[&identity_id])
            .await
            .map_err(DbError::from)?;
        Ok(row.get(0))
    }

    /// Reads `authz_changes` past the cursor and drops the cached entries they touch. Returns how
    /// many changes it applied.
    pub async fn apply_changes(&self) -> Result<usize, DbError> {
        let db = read_tx(&self.pool).await?;
        let mut applied = 0;
        loop {
            let cursor = self.caches().cursor;
            let rows = db
                .query(
                    "SELECT txid::text::int8, seq, identity_id, token_id FROM authz_changes
                      WHERE txid < pg_snapshot_xmin(pg_current_snapshot()) AND (txid::text::int8, seq) > ($1, $2)
                      ORDER BY txid, seq LIMIT $3",
                    &[&cursor.0, &cursor.1, &TAIL_BATCH],
                )
                .await?;
            for r in &rows {
                self.forget(r.get(2), r.get(3));
                self.caches().cursor = (r.get(0), r.get(1));
            }
            applied += rows.len();
            if (rows.len() as i64) < TAIL_BATCH {
                return Ok(applied);
            }
        }
    }

    /// Starts the tail at the present: every change committed from now on will be applied.
    pub async fn start_tail(&self) -> Result<(), DbError> {
        let db = read_tx(&self.pool).await?;
        let xmin: i64 = db.query_one("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::int8", &[]).await?.get(0);
        self.caches().cursor = (xmin - 1, i64::MAX);
        Ok(())
    }

    /// Applies changes every `interval` until `shutdown` resolves; prunes changes older than a day.
    pub async fn run_tail(self: Arc<Self>, interval: Duration, shutdown: impl std::future::Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut polls: u64 = 0;
        loop {
            if let Err(e) = self.apply_changes().await {
                tracing::warn!(error = %e, "authz_changes tail failed; cached decisions still expire on their TTLs");
            }
            polls += 1;
            if polls.is_multiple_of(600) && let Ok(mut db) = self.pool.get().await {
                // One clock: the prune compares with compute_now().
                let pruned = async {
                    let tx = db.transaction().await?;
                    tx.execute("DELETE FROM authz_changes WHERE at < compute_now() - interval '1 day'", &[]).await?;
                    tx.commit().await
                };
                if let Err(e) = pruned.await {
                    tracing::debug!(error = %e, "pruning authz_changes failed; the next prune takes what is left");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = &mut shutdown => return,
            }
        }
    }
}

#[async_trait::async_trait]
impl Authorizer for Iam {
    async fn check(&self, caller: Caller<'_>, permission: &str, resource: Resource<'_>) -> Result<(), Error> {
        let (kind, id) = resource_scope(caller, resource);
        let cacheable = permission.ends_with(":read");
        let key = (caller.identity_id.to_owned(), permission.to_owned(), kind.to_owned(), id.to_owned());
        let now = (self.clock)();
        let cached = if cacheable { self.caches().decisions.get(&key).filter(|(_, until)| now < *until).map(|(d, _)| *d) } else { None };
        let (allowed, sees) = match cached {
            Some(d) => d,
            None => {
                let d = self.decide(caller, permission, kind, id).await?;
                if cacheable {
                    let mut c = self.caches();
                    if c.decisions.len() >= CACHE_ENTRIES_MAX {
                        c.decisions.clear();
                    }
                    c.decisions.insert(key, (d, now + READ_DECISION_CACHE_TTL.as_millis() as u64));
                }
                d
            }
        };
        if allowed {
            return Ok(());
        }
        // Someone who can see the resource (or asks about their own tenant) learns they lack the
        // permission; anyone else cannot tell it from a resource that does not exist.
        match resource {
            Resource::Fleet | Resource::Tenant => Err(Error::new(ErrorCode::PermissionDenied, format!("you do not hold {permission} here"))),
            _ if sees => Err(Error::new(ErrorCode::PermissionDenied, format!("you do not hold {permission} on {kind} {id}"))),
            _ => Err(Error::not_found(kind, id)),
        }
    }
}
