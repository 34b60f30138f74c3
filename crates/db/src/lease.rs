//! Leases with fencing: rows in `leases` with an owner, an epoch and an expiry.
//!
//! A takeover bumps the epoch. Every fenced transaction starts with `SELECT … FOR SHARE` on the
//! lease row; a takeover's `UPDATE` must wait for that row lock, so a zombie holder either still
//! sees its lease valid (and the takeover waits for it to finish) or sees it gone and aborts. A plain
//! `EXISTS` would not fence under READ COMMITTED; the row lock does.

use std::time::{Duration, Instant, SystemTime};

use better_compute_core::lease::{GATEWAY_LEASE_TTL_S, WORKER_LEASE_TTL_S};
use tokio_postgres::{Client, GenericClient, Transaction};

use crate::{Clock, DbError};

/// The time to live of shard, pool, site and singleton leases.
pub const WORKER_LEASE_TTL: Duration = Duration::from_secs(WORKER_LEASE_TTL_S);
/// The time to live of gateway leases.
pub const GATEWAY_LEASE_TTL: Duration = Duration::from_secs(GATEWAY_LEASE_TTL_S);

/// Takes a free or expired lease, or extends our own. The epoch stays only when we extend our own
/// live lease: a new owner, or our own lease taken back after it expired, gets a new epoch, so
/// nothing fenced under the lapsed epoch can commit.
const ACQUIRE_SQL: &str = "
INSERT INTO leases AS l (name, owner, epoch, expires_at)
VALUES ($1, $2, 1, compute_now() + make_interval(secs => $3))
ON CONFLICT (name) DO UPDATE
   SET owner = EXCLUDED.owner,
       epoch = CASE WHEN l.owner = EXCLUDED.owner AND l.expires_at > compute_now() THEN l.epoch ELSE l.epoch + 1 END,
       expires_at = EXCLUDED.expires_at
 -- only our own lease, or one whose holder let it expire; waits for a fenced transaction's FOR SHARE
 WHERE l.owner = EXCLUDED.owner OR l.expires_at < compute_now()
RETURNING epoch, compute_now()";

/// Extends the lease only if we still hold it at the same epoch and it has not expired: a lapsed
/// lease is taken again with [`Lease::acquire`], under a new epoch.
const RENEW_SQL: &str = "
UPDATE leases SET expires_at = compute_now() + make_interval(secs => $4)
 WHERE name = $1 AND owner = $2 AND epoch = $3 AND expires_at > compute_now()
RETURNING compute_now()";

/// The fence: the first statement of every fenced transaction. The row lock is what fences. It
/// also names the lease and epoch (`<name>@<epoch>`) in the transaction-local setting
/// `better_compute.fence`, so an audit (the simulator's stale-epoch check) can tell which epoch
/// each write was made under.
///
/// It also bounds every later statement of the transaction by [`FENCED_STATEMENT_TIMEOUT`]
/// (`SET LOCAL statement_timeout`), so no job's statement runs past its lease: a statement that
/// would is cancelled, the transaction fails, and the job runs again in smaller steps.
const FENCE_SQL: &str = "
SELECT set_config('better_compute.fence', name || '@' || epoch, true), set_config('statement_timeout', $4::text, true) FROM leases
 WHERE name = $1 AND owner = $2 AND epoch = $3 AND expires_at > compute_now()
   FOR SHARE";

/// The longest any statement of a fenced transaction may run: well inside a worker lease's 15 s
/// (renewed every 5 s), so a job cannot outlive the lease it runs under by one statement.
pub const FENCED_STATEMENT_TIMEOUT: &str = "10s";

/// A deliberately broken fence, for the test that proves the simulator's stale-epoch check can
/// fail: it names the lease and epoch but checks and locks nothing.
#[cfg(feature = "fault-injection")]
const BROKEN_FENCE_SQL: &str = "SELECT set_config('better_compute.fence', $1::text || '@' || $2::bigint::text, true)";

#[cfg(feature = "fault-injection")]
static BROKEN_FENCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Test builds only (feature `fault-injection`): makes every fenced transaction of this process
/// skip the fence (a zombie's writes then go through). Only the simulator's checker test turns it
/// on, through `BETTER_COMPUTE_TEST_BROKEN_FENCE=1` on a server process. Returns whether it took
/// effect: a build without the feature has no broken fence to turn on.
pub fn break_the_fence_for_tests() -> bool {
    #[cfg(feature = "fault-injection")]
    BROKEN_FENCE.store(true, std::sync::atomic::Ordering::SeqCst);
    cfg!(feature = "fault-injection")
}

/// Lets the lease go at once, so the next holder need not wait for it to expire.
const RELEASE_SQL: &str = "
UPDATE leases SET expires_at = '-infinity'
 WHERE name = $1 AND owner = $2 AND epoch = $3";

/// A lease this process holds (or held: renewal tells).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    name: String,
    owner: String,
    epoch: i64,
    ttl: Duration,
}

impl Lease {
    /// Tries to take `name` for `owner`. `None` when someone else holds it unexpired.
    pub async fn acquire(
        db: &impl GenericClient,
        name: &str,
        owner: &str,
        ttl: Duration,
        clock: Option<&Clock>,
    ) -> Result<Option<Lease>, DbError> {
        let sent = Instant::now();
        let row = db.query_opt(ACQUIRE_SQL, &[&name, &owner, &ttl.as_secs_f64()]).await?;
        Ok(row.map(|r| {
            observe(clock, r.get(1), sent);
            Lease { name: name.to_owned(), owner: owner.to_owned(), epoch: r.get(0), ttl }
        }))
    }

    /// The lease's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Who holds it.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The epoch this holder got.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// Extends the lease by its time to live. `false` means it was lost, or lapsed (even if nobody
    /// took it): stop acting under it, and [`Lease::acquire`] it again for a new epoch.
    pub async fn renew(&self, db: &impl GenericClient, clock: Option<&Clock>) -> Result<bool, DbError> {
        let sent = Instant::now();
        let row = db.query_opt(RENEW_SQL, &[&self.name, &self.owner, &self.epoch, &self.ttl.as_secs_f64()]).await?;
        Ok(match row {
            Some(r) => {
                observe(clock, r.get(0), sent);
                true
            }
            None => false,
        })
    }

    /// Gives the lease up at once.
    pub async fn release(self, db: &impl GenericClient) -> Result<(), DbError> {
        db.execute(RELEASE_SQL, &[&self.name, &self.owner, &self.epoch]).await?;
        Ok(())
    }

    /// Opens a transaction whose first statement is the fence. Fails with `LeaseLost` (and rolls
    /// back) when the lease is no longer ours.
    pub async fn begin_fenced<'a>(&self, client: &'a mut Client) -> Result<FencedTransaction<'a>, DbError> {
        let tx = client.transaction().await?;
        #[cfg(feature = "fault-injection")]
        let fenced = if BROKEN_FENCE.load(std::sync::atomic::Ordering::Relaxed) {
            tx.query_opt(BROKEN_FENCE_SQL, &[&self.name, &self.epoch]).await?
        } else {
            tx.query_opt(FENCE_SQL, &[&self.name, &self.owner, &self.epoch, &FENCED_STATEMENT_TIMEOUT]).await?
        };
        #[cfg(not(feature = "fault-injection"))]
        let fenced = tx.query_opt(FENCE_SQL, &[&self.name, &self.owner, &self.epoch, &FENCED_STATEMENT_TIMEOUT]).await?;
        if fenced.is_none() {
            tx.rollback().await?;
            return Err(DbError::LeaseLost { name: self.name.clone(), epoch: self.epoch });
        }
        Ok(FencedTransaction { tx, epoch: self.epoch })
    }
}

/// What [`acquire_many`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Acquired {
    /// Leases taken or extended: held until their new expiry.
    pub held: Vec<Lease>,
    /// Names this owner holds (the epoch with each) that a fenced transaction holds still, so they
    /// were neither extended nor touched: the owner keeps acting under them, and the next call
    /// extends them once that transaction has ended.
    pub busy: Vec<(String, i64)>,
}

/// Takes or extends many leases for `owner` in one statement, without ever waiting on a lease row
/// a fenced transaction holds: a long job under one lease (this owner's, or a zombie's under an
/// expired one) cannot hold up the renewal of every other lease. A free or expired row a fenced
/// transaction holds is left for a later call, as [`ACQUIRE_SQL`] would wait for it; our own such
/// rows come back in [`Acquired::busy`].
pub async fn acquire_many(
    db: &impl GenericClient,
    names: &[String],
    owner: &str,
    ttl: Duration,
    clock: Option<&Clock>,
) -> Result<Acquired, DbError> {
    if names.is_empty() {
        return Ok(Acquired::default());
    }
    let sent = Instant::now();
    let rows = db
        .query(
            "WITH lockable AS (
               SELECT l.name FROM leases l
                WHERE l.name = ANY($1) AND (l.owner = $2 OR l.expires_at < compute_now())
                  FOR NO KEY UPDATE SKIP LOCKED
             ), taken AS (
               UPDATE leases l
                  SET owner = $2,
                      epoch = CASE WHEN l.owner = $2 AND l.expires_at > compute_now() THEN l.epoch ELSE l.epoch + 1 END,
                      expires_at = compute_now() + make_interval(secs => $3)
                 FROM lockable k WHERE l.name = k.name
               RETURNING l.name, l.epoch
             ), fresh AS (
               INSERT INTO leases (name, owner, epoch, expires_at)
               SELECT n, $2, 1, compute_now() + make_interval(secs => $3) FROM unnest($1::text[]) AS n
               ON CONFLICT (name) DO NOTHING
               RETURNING name, epoch
             )
             SELECT name, epoch, true, compute_now() FROM taken
             UNION ALL SELECT name, epoch, true, compute_now() FROM fresh
             UNION ALL SELECT l.name, l.epoch, false, compute_now() FROM leases l
                        WHERE l.name = ANY($1) AND l.owner = $2 AND l.name NOT IN (SELECT name FROM lockable)",
            &[&names, &owner, &ttl.as_secs_f64()],
        )
        .await?;
    if let Some(r) = rows.first() {
        observe(clock, r.get(3), sent);
    }
    let mut out = Acquired::default();
    for r in &rows {
        if r.get(2) {
            out.held.push(Lease { name: r.get(0), owner: owner.to_owned(), epoch: r.get(1), ttl });
        } else {
            out.busy.push((r.get(0), r.get(1)));
        }
    }
    Ok(out)
}

/// Releases many leases at once, skipping those a fenced transaction holds.
pub async fn release_many(db: &impl GenericClient, leases: &[Lease]) -> Result<(), DbError> {
    let Some(first) = leases.first() else { return Ok(()) };
    let names: Vec<&str> = leases.iter().map(|l| l.name.as_str()).collect();
    let epochs: Vec<i64> = leases.iter().map(|l| l.epoch).collect();
    // A lease a fenced transaction still holds is skipped rather than waited for: it lapses on
    // its own (or the next release takes it), and nothing else waits behind it.
    db.execute(
        "UPDATE leases l SET expires_at = '-infinity'
           FROM (SELECT l2.name FROM leases l2 JOIN unnest($1::text[], $2::int8[]) AS h(name, epoch)
                                  ON l2.name = h.name AND l2.epoch = h.epoch
                  WHERE l2.owner = $3 FOR NO KEY UPDATE OF l2 SKIP LOCKED) k
          WHERE l.name = k.name",
        &[&names, &epochs, &first.owner],
    )
    .await?;
    Ok(())
}

fn observe(clock: Option<&Clock>, db_time: SystemTime, sent: Instant) {
    if let Some(c) = clock {
        c.observe(db_time, sent, Instant::now());
    }
}

/// A transaction that began with the lease fence. It can only be made by
/// [`Lease::begin_fenced`], so holding one proves the fence ran first.
pub struct FencedTransaction<'a> {
    tx: Transaction<'a>,
    epoch: i64,
}

impl<'a> FencedTransaction<'a> {
    /// The epoch the fence checked.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), DbError> {
        Ok(self.tx.commit().await?)
    }

    /// Rolls back.
    pub async fn rollback(self) -> Result<(), DbError> {
        Ok(self.tx.rollback().await?)
    }
}

impl<'a> std::ops::Deref for FencedTransaction<'a> {
    type Target = Transaction<'a>;
    fn deref(&self) -> &Transaction<'a> {
        &self.tx
    }
}

impl<'a> std::ops::DerefMut for FencedTransaction<'a> {
    fn deref_mut(&mut self) -> &mut Transaction<'a> {
        &mut self.tx
    }
}
