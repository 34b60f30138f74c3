//! The work queue: how a state change wakes the reconciler that owns it, without ever losing a
//! wake-up.
//!
//! Lock order: a claim locks `work_queue` rows only (`FOR UPDATE SKIP LOCKED`), and outcome
//! statements touch only the rows this worker claimed, so the queue never takes part in a deadlock
//! with the tables a reconciler locks.

use std::time::Duration;

use tokio_postgres::GenericClient;

use better_compute_db::DbError;

use crate::reconciler::{Kind, Outcome};

/// Holds a LISTEN connection on `channels` and calls `on(channel, payload)` for each
/// notification; reconnects a second after any failure, for as long as it runs. `conn` must be a
/// direct connection (LISTEN is session state, which PgBouncer's transaction pooling does not
/// keep). Only ever an optimisation: every listener also polls.
pub async fn listen(conn: String, channels: &'static [&'static str], on: impl Fn(&str, &str) + Send + Sync + 'static) {
    use futures_util::StreamExt;
    let on = std::sync::Arc::new(on);
    loop {
        let connected = async {
            let (config, tls) = better_compute_db::tls::parse(&conn)?;
            Ok::<_, DbError>(config.connect(tls).await?)
        };
        match connected.await {
            Ok((client, mut connection)) => {
                // The connection must be polled for LISTEN to complete and for notifications to arrive.
                let forward = on.clone();
                let pump = tokio::spawn(async move {
                    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                    while let Some(Ok(m)) = messages.next().await {
                        if let tokio_postgres::AsyncMessage::Notification(n) = m {
                            forward(n.channel(), n.payload());
                        }
                    }
                });
                let listen: String = channels.iter().map(|c| format!("LISTEN {c};")).collect();
                match client.batch_execute(&listen).await {
                    Ok(()) => {
                        let _ = pump.await;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "LISTEN failed");
                        pump.abort();
                    }
                }
                drop(client);
            }
            Err(e) => tracing::debug!(error = %e, "poke listener cannot connect"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The channel that pokes workers.
pub const POKE_CHANNEL: &str = "better_compute_work";

/// Wakes the workers early; call after the transaction that enqueued has committed. The NOTIFY
/// runs in a transaction of its own: NOTIFY takes a database-wide lock from its statement to the
/// end of its transaction, so inside a business transaction it would serialise every commit
/// (fsync included) behind it. Best effort: a lost poke only delays, since workers also poll.
/// Where the process installed a [`Poker`], the poke is folded into its next NOTIFY instead.
pub async fn poke(db: &tokio_postgres::Client) {
    match POKER.get() {
        Some(p) => p.poke(),
        None => notify(db, POKE_CHANNEL, "").await,
    }
}

/// Runs `statement`, one statement outside a transaction (it commits on its own), then pokes.
/// Without a [`Poker`], the poke is pipelined behind it on the same connection: both go out in one
/// write, and the poke costs no round trip of its own. The statement's request is queued first
/// (`join!` polls in order, and a query queues its request at its first poll), and the connection
/// runs requests in order, so the NOTIFY runs after the statement has committed, as a poke must; a
/// statement that failed gets a harmless extra poke. Returns the statement's result.
pub async fn poke_after<T>(db: &tokio_postgres::Client, statement: impl std::future::Future<Output = T>) -> T {
    match POKER.get() {
        Some(p) => {
            let r = statement.await;
            p.poke();
            r
        }
        None => tokio::join!(statement, poke(db)).0,
    }
}

/// The process's poker, once [`Poker::install`]ed.
static POKER: std::sync::OnceLock<Poker> = std::sync::OnceLock::new();

/// The shortest time between two of a [`Poker`]'s NOTIFYs: caps them at 200 a second per process.
/// A worker woken by one runs every key due by then, so pokes closer together would only wake it
/// again for what it already took; and it costs a poked key at most this much delay.
pub const POKE_MIN_GAP: Duration = Duration::from_millis(5);

/// Folds a process's pokes together: a poke asks for one NOTIFY sent after it; pokes that come
/// while one is being sent, or within [`POKE_MIN_GAP`] of it, share the next. Without it, every
/// change made by a busy API server costs a transaction of its own for its NOTIFY (the capacity
/// bench, 64 clients: a release cost 1.37 ms of CPU with a NOTIFY each, 1.06 with them folded). No poke is lost: a
/// poke stores a permit in a [`tokio::sync::Notify`], and the sender starts a NOTIFY only after
/// taking the permit, so every poke is followed by a NOTIFY that began after it.
#[derive(Clone)]
pub struct Poker {
    wanted: std::sync::Arc<tokio::sync::Notify>,
}

impl Poker {
    /// Starts a poker sending its NOTIFYs on connections from `pool` (they go over the simple
    /// query protocol outside a transaction, so a PgBouncer in transaction pooling mode is fine),
    /// and makes it the process's: from then on [`poke`] and [`poke_after`] hand it their pokes.
    /// Returns the poker, or `None` if the process already has one (which stays).
    pub fn install(pool: better_compute_db::Pool) -> Option<Poker> {
        let mut fresh = false;
        let poker = POKER.get_or_init(|| {
            fresh = true;
            Poker::start(pool)
        });
        fresh.then(|| poker.clone())
    }

    /// Starts a poker without making it the process's (see [`Poker::install`]).
    pub fn start(pool: better_compute_db::Pool) -> Poker {
        let wanted = std::sync::Arc::new(tokio::sync::Notify::new());
        let w = wanted.clone();
        tokio::spawn(async move {
            loop {
                w.notified().await;
                match pool.get().await {
                    Ok(c) => notify(&c, POKE_CHANNEL, "").await,
                    Err(e) => tracing::debug!(error = %e, "no connection for a poke; listeners also poll"),
                }
                tokio::time::sleep(POKE_MIN_GAP).await;
            }
        });
        Poker { wanted }
    }

    /// Asks for a NOTIFY after this call; never waits.
    pub fn poke(&self) {
        self.wanted.notify_one();
    }
}

/// Sends one notification, best effort, over the simple query protocol: no prepared statement, so
/// it is safe outside a transaction behind PgBouncer in transaction pooling mode. A client, not a
/// transaction: pokes follow the commit (see [`AfterCommit`]).
pub async fn notify(db: &tokio_postgres::Client, channel: &str, payload: &str) {
    notify_many(db, channel, &[payload.to_owned()]).await;
}

/// Sends one notification per payload on `channel`, best effort, in one statement over the simple
/// query protocol (as [`notify`]).
pub async fn notify_many(db: &tokio_postgres::Client, channel: &str, payloads: &[String]) {
    if payloads.is_empty() {
        return;
    }
    let quote = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let list: Vec<String> = payloads.iter().map(|p| quote(p)).collect();
    let sql = format!("SELECT pg_notify({}, p) FROM unnest(ARRAY[{}]::text[]) AS p", quote(channel), list.join(","));
    if let Err(e) = db.batch_execute(&sql).await {
        tracing::debug!(error = %e, channel, "notify failed; listeners also poll");
    }
}

/// The most pokes one [`AfterCommit`] holds; beyond, they are dropped (listeners also poll).
pub const AFTER_COMMIT_POKES: usize = 1024;

/// Pokes a transaction asks for, sent once it has committed. Pokes follow the commit: a NOTIFY
/// inside a transaction takes the database's one notification lock at commit, so every committing
/// transaction that sent one waits for the others; and a listener woken by it must find the change.
#[derive(Debug, Default)]
pub struct AfterCommit {
    pokes: std::sync::Mutex<Vec<(&'static str, String)>>,
}

impl AfterCommit {
    /// Asks for a NOTIFY on `channel` with `payload` once the transaction has committed.
    pub fn poke(&self, channel: &'static str, payload: &str) {
        let mut p = self.pokes.lock().expect("pokes");
        if p.len() < AFTER_COMMIT_POKES && !p.iter().any(|(c, x)| *c == channel && x == payload) {
            p.push((channel, payload.to_owned()));
        }
    }

    /// Sends them (call after the commit, outside any transaction), best effort.
    pub async fn send(self, db: &tokio_postgres::Client) {
        let pokes = self.pokes.into_inner().expect("pokes");
        let mut channels: Vec<&'static str> = pokes.iter().map(|(c, _)| *c).collect();
        channels.sort_unstable();
        channels.dedup();
        for channel in channels {
            let payloads: Vec<String> = pokes.iter().filter(|(c, _)| *c == channel).map(|(_, p)| p.clone()).collect();
            notify_many(db, channel, &payloads).await;
        }
    }
}

/// How long after SyncAgain a key runs again.
pub const SYNC_AGAIN_AFTER: Duration = Duration::from_secs(1);
/// The first error back-off; it doubles with each consecutive error…
pub const ERROR_BACKOFF_FIRST: Duration = Duration::from_secs(1);
/// …up to this.
pub const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// Longest error text kept on a row.
const MAX_ERROR_LEN: usize = 2000;

/// The back-off after the `attempts`-th consecutive error (1-based): 1 s, 2 s, 4 s … 5 min.
pub fn error_backoff(attempts: u32) -> Duration {
    let secs = ERROR_BACKOFF_FIRST.as_secs().saturating_mul(1u64 << attempts.saturating_sub(1).min(20));
    Duration::from_secs(secs.min(ERROR_BACKOFF_MAX.as_secs()))
}

/// Enqueues `key` of `kind` in the caller's transaction. A key already queued gets its `gen`
/// bumped (and becomes due now if it was waiting) instead of a second row. After commit, the
/// caller may [`poke`] to wake the worker at once.
pub async fn enqueue(tx: &impl GenericClient, kind: &Kind, key: &str) -> Result<(), DbError> {
    enqueue_many(tx, kind, &[key.to_owned()]).await
}

/// Enqueues many keys of one kind in one statement, due now.
pub async fn enqueue_many(tx: &impl GenericClient, kind: &Kind, keys: &[String]) -> Result<(), DbError> {
    enqueue_keys(tx, kind, keys, Duration::ZERO).await
}

/// Enqueues `key` to run no later than `after` from now (a timer: a reservation's start, say). A
/// key already queued keeps the earlier of its times. While the key is claimed, the time is
/// remembered and applied when the run ends, so a run can schedule its own next pass. A run that
/// still needs a timer arms it again: a wake-up earlier than asked consumes it.
pub async fn enqueue_after(tx: &impl GenericClient, kind: &Kind, key: &str, after: Duration) -> Result<(), DbError> {
    enqueue_keys(tx, kind, &[key.to_owned()], after).await
}

async fn enqueue_keys(tx: &impl GenericClient, kind: &Kind, keys: &[String], after: Duration) -> Result<(), DbError> {
    let shards: Vec<i16> = keys.iter().map(|k| kind.shard_of(k)).collect();
    enqueue_stored(tx, kind.name, keys, &shards, after).await
}

/// Enqueues keys of a kind known only by name with their stored shards (a command's owner, say).
pub async fn enqueue_stored(
    tx: &impl GenericClient,
    kind: &str,
    keys: &[String],
    shards: &[i16],
    after: Duration,
) -> Result<(), DbError> {
    if keys.is_empty() {
        return Ok(());
    }
    // The statement lives in work_queue_enqueue (src/sql/work_queue.sql), which
    // the modules whose writes run in the database call as well.
    let kinds = vec![kind; keys.len()];
    tx.execute("SELECT work_queue_enqueue($1, $2, $3, $4)", &[&kinds, &keys, &shards, &after.as_secs_f64()]).await?;
    Ok(())
}

/// A claimed key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// The key.
    pub key: String,
    /// Its generation at the claim; the row is deleted after Done only if it is unchanged.
    pub generation: i64,
    /// Its shard (-1 for a singleton kind).
    pub shard: i16,
    /// Consecutive errors so far.
    pub attempts: i32,
}

/// A shard this worker may claim from, with the lease (name and epoch) that entitles it.
#[derive(Debug, Clone)]
pub struct ShardGrant {
    /// The shard (-1 for a singleton kind).
    pub shard: i16,
    /// The lease's name (`shard:<n>` or `singleton:<kind>`).
    pub lease: String,
    /// The epoch this worker holds.
    pub epoch: i64,
}

/// Claims up to `limit` due keys of `kind` from the granted shards for `worker`.
///
/// The claim is fenced by the database's view of the leases, not the worker's: only shards whose
/// lease `worker` still holds at that epoch, unexpired, are claimed from, and a claim never outlives
/// the lease (`claimed_until` is at most the lease's expiry). A worker that lost a shard cannot
/// claim from it, and by the time a new holder can take the shard, the old holder's claims have
/// expired. Rows locked by another claimer are skipped, not waited for; an expired claim (a crashed
/// worker) is claimable again.
pub async fn claim(
    db: &impl GenericClient,
    kind: &str,
    grants: &[ShardGrant],
    worker: &str,
    claim_ttl: Duration,
    limit: i64,
) -> Result<Vec<Claimed>, DbError> {
    if grants.is_empty() {
        return Ok(Vec::new());
    }
    let shards: Vec<i16> = grants.iter().map(|g| g.shard).collect();
    let leases: Vec<&str> = grants.iter().map(|g| g.lease.as_str()).collect();
    let epochs: Vec<i64> = grants.iter().map(|g| g.epoch).collect();
    let rows = db
        .query(
            "UPDATE work_queue w
                SET claimed_until = LEAST(compute_now() + make_interval(secs => $4), due.lease_expires_at),
                    claimed_by = $5
               FROM (SELECT q.kind, q.key, l.expires_at AS lease_expires_at
                       FROM work_queue q
                       JOIN unnest($2::int2[], $6::text[], $7::int8[]) AS g(shard, lease, epoch) ON q.shard = g.shard
                       -- the fence for claims: the lease is still ours at this epoch
                       JOIN leases l ON l.name = g.lease AND l.epoch = g.epoch AND l.owner = $5
                                    AND l.expires_at > compute_now()
                      WHERE q.kind = $1 AND q.not_before <= compute_now()
                        AND (q.claimed_until IS NULL OR q.claimed_until <= compute_now())
                      ORDER BY q.not_before
                      LIMIT $3
                        FOR UPDATE OF q SKIP LOCKED) due
              WHERE w.kind = due.kind AND w.key = due.key
             RETURNING w.key, w.gen, w.shard, w.attempts",
            &[&kind, &shards, &limit, &claim_ttl.as_secs_f64(), &worker, &leases, &epochs],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Claimed { key: r.get(0), generation: r.get(1), shard: r.get(2), attempts: r.get(3) })
        .collect())
}

/// The result of one run, to be applied to its row.
#[derive(Debug, Clone)]
pub enum RunResult {
    /// The reconciler answered.
    Ok(Outcome),
    /// It failed with this message.
    Err(String),
}

/// Applies the outcomes of a batch of runs, in four statements at most; call it in a transaction.
/// Only rows still claimed by `worker` change: a claim that expired and moved on is left to its new
/// claimer.
pub async fn apply_outcomes(
    db: &impl GenericClient,
    kind: &str,
    worker: &str,
    results: &[(Claimed, RunResult)],
) -> Result<(), DbError> {
    let mut done = (Vec::new(), Vec::new());
    let mut again = (Vec::new(), Vec::new());
    let mut failed = (Vec::new(), Vec::new(), Vec::new());
    for (c, r) in results {
        match r {
            RunResult::Ok(Outcome::Done) => {
                done.0.push(c.key.clone());
                done.1.push(c.generation);
            }
            RunResult::Ok(Outcome::SyncAgain) => {
                again.0.push(c.key.clone());
                again.1.push(c.generation);
            }
            RunResult::Err(e) => {
                failed.0.push(c.key.clone());
                failed.1.push(c.generation);
                failed.2.push(truncate(e));
            }
        }
    }
    // Every row first, in key order, as work_queue_enqueue takes them: the three statements below
    // each take a subset in no set order, and an enqueue of several of the same keys (a batch of
    // placements) waited on one of them while holding another: a deadlock, seen once in torture
    // seeds 46 to 90.
    let keys: Vec<&str> = results.iter().map(|(c, _)| c.key.as_str()).collect();
    if keys.len() > 1 {
        db.execute("SELECT 1 FROM work_queue WHERE kind = $1 AND key = ANY($2) ORDER BY key FOR UPDATE", &[&kind, &keys]).await?;
    }
    if !done.0.is_empty() {
        // Delete what did not move; release what was dirtied during the run so it runs again.
        db.execute(
            "WITH d AS (SELECT * FROM unnest($2::text[], $3::int8[]) AS d(key, gen)),
                  del AS (DELETE FROM work_queue w USING d
                           WHERE w.kind = $1 AND w.key = d.key AND w.gen = d.gen AND w.claimed_by = $4)
             UPDATE work_queue w SET claimed_until = NULL, claimed_by = NULL, attempts = 0,
                                     last_error = NULL, last_error_at = NULL,
                                     not_before = coalesce(w.dirty_not_before, compute_now()), dirty_not_before = NULL
               FROM d WHERE w.kind = $1 AND w.key = d.key AND w.gen <> d.gen AND w.claimed_by = $4",
            &[&kind, &done.0, &done.1, &worker],
        )
        .await?;
    }
    if !again.0.is_empty() {
        // After SYNC_AGAIN_AFTER, or sooner if an enqueue during the run asked for it.
        db.execute(
            "UPDATE work_queue w SET claimed_until = NULL, claimed_by = NULL, attempts = 0,
                    last_error = NULL, last_error_at = NULL, dirty_not_before = NULL,
                    not_before = LEAST(compute_now() + make_interval(secs => $5),
                                       CASE WHEN w.gen = d.gen THEN NULL ELSE coalesce(w.dirty_not_before, compute_now()) END)
               FROM unnest($2::text[], $3::int8[]) AS d(key, gen)
              WHERE w.kind = $1 AND w.key = d.key AND w.claimed_by = $4",
            &[&kind, &again.0, &again.1, &worker, &SYNC_AGAIN_AFTER.as_secs_f64()],
        )
        .await?;
    }
    if !failed.0.is_empty() {
        // Back off 1 s doubling to 5 min; keep the error for operators.
        db.execute(
            "UPDATE work_queue w SET claimed_until = NULL, claimed_by = NULL, attempts = w.attempts + 1,
                    last_error = d.err, last_error_at = compute_now(), dirty_not_before = NULL,
                    not_before = compute_now() + make_interval(secs => LEAST($5::float8, $6::float8 * power(2, LEAST(w.attempts, 20))))
               FROM unnest($2::text[], $3::int8[], $7::text[]) AS d(key, gen, err)
              WHERE w.kind = $1 AND w.key = d.key AND w.claimed_by = $4",
            &[
                &kind,
                &failed.0,
                &failed.1,
                &worker,
                &ERROR_BACKOFF_MAX.as_secs_f64(),
                &ERROR_BACKOFF_FIRST.as_secs_f64(),
                &failed.2,
            ],
        )
        .await?;
    }
    Ok(())
}

fn truncate(e: &str) -> String {
    if e.len() <= MAX_ERROR_LEN {
        return e.to_owned();
    }
    let mut end = MAX_ERROR_LEN;
    while !e.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &e[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_back_off_doubles_from_one_second_to_five_minutes() {
        let secs: Vec<u64> = (1..=11).map(|a| error_backoff(a).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(error_backoff(u32::MAX).as_secs(), 300);
    }

    #[test]
    fn long_errors_are_cut_on_a_character_boundary() {
        let e = "é".repeat(MAX_ERROR_LEN);
        let t = truncate(&e);
        assert!(t.len() <= MAX_ERROR_LEN + "…".len());
        assert!(t.ends_with('…'));
    }
}
