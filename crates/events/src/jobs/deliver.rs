//! `events.deliver`: sends due deliveries, signed, and records what happened.
//!
//! Each endpoint (webhook) is a key of its own, spread over the shards, so endpoints are delivered
//! side by side, by every worker, and a slow or hanging receiver holds up only its own deliveries.
//! An endpoint's run claims up to [`BATCH`] of its due rows, oldest first (pushing their
//! `next_attempt_at` past [`CLAIM_S`], so a crashed sender's rows come back), sends at most
//! [`PER_ENDPOINT`] at once without holding a connection, starts none after its budget ([`ENDPOINT_BUDGET`])
//! (those go back to due), and records each outcome the moment it arrives, in a transaction of its
//! own guarded by its claim: 2xx delivered; 410 Gone disables the endpoint; anything else (an
//! error status, a timeout, a refused address) is retried on [`SCHEDULE_S`] with ±10% jitter, later
//! if the receiver's `Retry-After` (seconds or an HTTP-date) asks, and after the last retry the
//! delivery is a dead letter. Then the run arms its endpoint's next wake-up at its earliest
//! pending attempt. The key [`SWEEP_KEY`], every minute, enqueues every endpoint with a due
//! delivery, in case a wake-up was lost.

use std::time::Duration;

use better_compute_runtime::{work_queue, Kind, Outcome, Periodic, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::signing;
use crate::ssrf::{check_url, client, EgressPolicy};

/// The deliverer's kind: a key per endpoint (its webhook id), and the sweep key `all`.
pub const DELIVER: Kind = Kind { name: "events.deliver", shard_by: ShardBy::Key };

/// Delays before each retry, in seconds: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 14 h, 20 h, 24 h:
/// ten attempts over about three days and four hours.
pub const SCHEDULE_S: [u64; 9] = [5, 300, 1800, 7200, 18_000, 36_000, 50_400, 72_000, 86_400];
/// One endpoint's deliveries claimed per run.
pub const BATCH: i64 = 32;
/// One endpoint's deliveries in flight at once.
pub const PER_ENDPOINT: usize = 4;
/// How long one endpoint's run starts new sends, by default; the rest of its claim goes back to
/// due. With the request timeout (10 s) a run ends within 30 s, inside its claim.
pub const ENDPOINT_BUDGET: Duration = Duration::from_secs(20);
/// The key that enqueues every endpoint with a due delivery.
pub const SWEEP_KEY: &str = "all";
/// Endpoints one sweep enqueues at most.
const SWEEP_MAX: i64 = 10_000;
/// How long a claim holds a delivery away from other senders.
pub const CLAIM_S: f64 = 60.0;
/// The longest `Retry-After` honoured.
pub const MAX_RETRY_AFTER_S: u64 = 86_400;

/// The delay before the retry after `attempts` failed attempts, with jitter from `seed`, at least
/// `retry_after_s`. `None` once the schedule is exhausted.
pub fn retry_delay_s(attempts: usize, seed: &str, retry_after_s: Option<u64>) -> Option<f64> {
    let base = *SCHEDULE_S.get(attempts.checked_sub(1)?)? as f64;
    // Deterministic jitter in [-10%, +10%]: spreads retries of many deliveries, replays exactly.
    let h = better_compute_core::shard::stable_hash(format!("{seed}/{attempts}").as_bytes());
    let jitter = ((h % 2001) as f64 / 1000.0 - 1.0) * 0.1;
    let delay = base * (1.0 + jitter);
    Some(delay.max(retry_after_s.unwrap_or(0).min(MAX_RETRY_AFTER_S) as f64))
}

/// A `Retry-After` value in seconds: delta-seconds, or an HTTP-date (RFC 9110) measured from `now`.
pub fn retry_after_s(value: &str, now: std::time::SystemTime) -> Option<u64> {
    let value = value.trim();
    if let Ok(s) = value.parse::<u64>() {
        return Some(s);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).map(|d| d.as_secs_f64().ceil() as u64).unwrap_or(0))
}

enum Sent {
    Delivered(u16),
    Gone,
    Failed { status: Option<u16>, retry_after_s: Option<u64>, error: String },
    /// Not sent: the endpoint's budget ran out first. Due again at once.
    Unsent,
}

/// The deliverer.
pub struct Deliverer {
    /// Where deliveries may go.
    pub policy: EgressPolicy,
    /// Per request.
    pub timeout: Duration,
    /// How long one endpoint's run starts new sends ([`ENDPOINT_BUDGET`] by default).
    pub budget: Duration,
}

const PERIODIC: &[Periodic] = &[Periodic { key: SWEEP_KEY, every: Duration::from_secs(60) }];

struct Claimed {
    id: String,
    event_id: String,
    payload: String,
    url: String,
    secrets: Vec<String>,
    timestamp: i64,
    webhook_id: String,
    stamp: ClaimStamp,
}

impl Deliverer {
    async fn send(&self, http: &reqwest::Client, d: &Claimed) -> Sent {
        // Checked again at every attempt: the policy may have changed, and an IP literal never
        // reaches the resolver.
        if let Err(e) = check_url(&d.url, self.policy) {
            return Sent::Failed { status: None, retry_after_s: None, error: e.message };
        }
        let secrets: Vec<&str> = d.secrets.iter().map(String::as_str).collect();
        let r = http
            .post(&d.url)
            .header("content-type", "application/json")
            .header("webhook-id", &d.event_id)
            .header("webhook-timestamp", d.timestamp.to_string())
            .header("webhook-signature", signing::header(&secrets, &d.event_id, d.timestamp, d.payload.as_bytes()))
            .body(d.payload.clone())
            .send()
            .await;
        match r {
            Ok(r) if r.status().is_success() => Sent::Delivered(r.status().as_u16()),
            Ok(r) if r.status().as_u16() == 410 => Sent::Gone,
            Ok(r) => Sent::Failed {
                status: Some(r.status().as_u16()),
                retry_after_s: r.headers().get("retry-after").and_then(|v| retry_after_s(v.to_str().ok()?, std::time::SystemTime::now())),
                error: format!("the endpoint answered {}", r.status()),
            },
            Err(e) if e.is_timeout() => Sent::Failed { status: None, retry_after_s: None, error: format!("no answer within {:?}", self.timeout) },
            Err(e) => {
                // The whole chain: the resolver's refusal sits a few sources down.
                let mut error = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(s) = source {
                    error.push_str(&format!(": {s}"));
                    source = s.source();
                }
                Sent::Failed { status: None, retry_after_s: None, error }
            }
        }
    }
}

impl Deliverer {
    /// Sends `d` unless the endpoint's budget, counted from `started`, ran out first.
    async fn send_within_budget<'a>(&self, http: &reqwest::Client, d: &'a Claimed, started: std::time::Instant) -> (&'a Claimed, Sent) {
        if started.elapsed() >= self.budget {
            return (d, Sent::Unsent);
        }
        (d, self.send(http, d).await)
    }
}

/// The database's "now" as a claim stamp: a delivery's outcome is recorded only while its
/// `next_attempt_at` is still the stamp this run's claim set, so a later sender that claimed it
/// again (after [`CLAIM_S`]) is never overwritten by a stale outcome.
type ClaimStamp = std::time::SystemTime;

impl Deliverer {
    /// Records one attempt's outcome in a transaction of its own, the moment it is known, so a slow
    /// receiver elsewhere in the batch can neither delay it nor make it lost. A delivery whose
    /// webhook was deleted meanwhile (its row gone), or that another sender claimed again, records
    /// nothing.
    async fn record(&self, ctx: &ReconcileContext, d: &Claimed, sent: Sent) -> Result<(), RunError> {
        let mut c = ctx.client().await?;
        let tx = c.transaction().await.map_err(better_compute_db::DbError::from)?;
        let mine = "id = $1 AND state = 'pending' AND next_attempt_at = $2";
        match sent {
            Sent::Unsent => {
                tx.execute(&format!("UPDATE webhook_deliveries SET next_attempt_at = compute_now() WHERE {mine}"), &[&d.id, &d.stamp])
                    .await
                    .map_err(better_compute_db::DbError::from)?;
            }
            Sent::Delivered(status) => {
                tx.execute(
                    &format!(
                        "UPDATE webhook_deliveries SET state = 'delivered', attempts = attempts + 1, next_attempt_at = NULL,
                                finished_at = compute_now(), last_status = $3, last_error = NULL WHERE {mine}"
                    ),
                    &[&d.id, &d.stamp, &(status as i32)],
                )
                .await
                .map_err(better_compute_db::DbError::from)?;
            }
            Sent::Gone => {
                let n = tx
                    .execute(
                        &format!(
                            "UPDATE webhook_deliveries SET state = 'dead', attempts = attempts + 1, next_attempt_at = NULL,
                                    finished_at = compute_now(), last_status = 410,
                                    last_error = 'the endpoint answered 410 Gone; it is disabled' WHERE {mine}"
                        ),
                        &[&d.id, &d.stamp],
                    )
                    .await
                    .map_err(better_compute_db::DbError::from)?;
                if n == 1 {
                    tx.execute(
                        "UPDATE webhooks SET disabled_at = coalesce(disabled_at, compute_now()), version = version + 1,
                                disabled_reason = 'the endpoint answered 410 Gone'
                          WHERE id = $1",
                        &[&d.webhook_id],
                    )
                    .await
                    .map_err(better_compute_db::DbError::from)?;
                }
            }
            Sent::Failed { status, retry_after_s, error } => {
                let Some(attempts) = tx
                    .query_opt(&format!("SELECT attempts + 1 FROM webhook_deliveries WHERE {mine} FOR UPDATE"), &[&d.id, &d.stamp])
                    .await
                    .map_err(better_compute_db::DbError::from)?
                    .map(|r| r.get::<_, i32>(0))
                else {
                    return Ok(());
                };
                let delay = retry_delay_s(attempts as usize, &d.id, retry_after_s);
                tx.execute(
                    "UPDATE webhook_deliveries
                        SET attempts = $2, last_status = $3, last_error = $4,
                            state = CASE WHEN $5::float8 IS NULL THEN 'dead' ELSE 'pending' END,
                            next_attempt_at = compute_now() + make_interval(secs => $5),
                            finished_at = CASE WHEN $5::float8 IS NULL THEN compute_now() END
                      WHERE id = $1",
                    &[&d.id, &attempts, &status.map(i32::from), &error, &delay],
                )
                .await
                .map_err(better_compute_db::DbError::from)?;
            }
        }
        tx.commit().await.map_err(better_compute_db::DbError::from)?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl Reconciler for Deliverer {
    fn kind(&self) -> Kind {
        DELIVER
    }

    fn periodic(&self) -> &[Periodic] {
        PERIODIC
    }

    async fn run(&self, ctx: &ReconcileContext, key: &str) -> Result<Outcome, RunError> {
        if key == SWEEP_KEY {
            return sweep(ctx).await;
        }
        let (claimed, disabled) = claim(ctx, key).await?;
        // Sent at most PER_ENDPOINT at once, each outcome recorded as it arrives, no connection
        // held meanwhile; after the budget, the rest goes back unsent.
        let http = &client(self.policy, self.timeout);
        let started = std::time::Instant::now();
        let sends: Vec<_> = claimed.iter().map(|d| self.send_within_budget(http, d, started)).collect();
        let mut sends = futures_util::StreamExt::buffer_unordered(futures_util::stream::iter(sends), PER_ENDPOINT);
        let mut failed_records = 0;
        while let Some((d, sent)) = futures_util::StreamExt::next(&mut sends).await {
            let what = match &sent {
                Sent::Unsent => "deferred",
                Sent::Delivered(_) => "delivered",
                Sent::Gone => "gone",
                Sent::Failed { .. } => "failed",
            };
            match self.record(ctx, d, sent).await {
                Ok(()) => {
                    ctx.count(what, 1);
                    metrics::counter!("better_compute_webhook_deliveries_total", "outcome" => what).increment(1);
                }
                Err(e) => {
                    // The claim lapses and the delivery is sent again: at least once.
                    tracing::warn!(delivery = %d.id, error = %e, "a delivery's outcome could not be recorded");
                    failed_records += 1;
                }
            }
        }
        drop(sends);
        // Arm the endpoint's next wake-up at its earliest pending attempt.
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        let next: Option<f64> = tx
            .query_one(
                "SELECT extract(epoch FROM min(next_attempt_at) - compute_now())::float8 FROM webhook_deliveries
                  WHERE webhook_id = $1 AND state = 'pending'",
                &[&key],
            )
            .await?
            .get(0);
        if let Some(s) = next {
            work_queue::enqueue_after(&*tx, &DELIVER, key, Duration::from_secs_f64(s.max(0.0))).await?;
        }
        tx.commit().await?;
        if failed_records > 0 {
            return Err(format!("{failed_records} outcomes could not be recorded; their deliveries go again after the claim").into());
        }
        tracing::debug!(webhook = key, claimed = claimed.len(), disabled, "deliveries sent");
        Ok(Outcome::Done)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        let rows = ctx.read().await?.query("SELECT DISTINCT webhook_id FROM webhook_deliveries WHERE state = 'pending'", &[]).await?;
        Ok(rows
            .iter()
            .map(|r| r.get::<_, String>(0))
            .chain([SWEEP_KEY.to_owned()])
            .filter(|k| shards.contains(&DELIVER.shard_of(k)))
            .collect())
    }
}

/// Claims up to [`BATCH`] of endpoint `webhook`'s due deliveries, oldest first; those of a disabled
/// endpoint become dead letters at once. Returns the claimed ones to send and how many died.
async fn claim(ctx: &ReconcileContext, webhook: &str) -> Result<(Vec<Claimed>, usize), RunError> {
    let mut c = ctx.client().await?;
    let tx = ctx.begin_fenced(&mut c).await?;
    let rows = tx
        .query(
            "WITH due AS (SELECT id FROM webhook_deliveries
                           WHERE webhook_id = $3 AND state = 'pending' AND next_attempt_at <= compute_now()
                           ORDER BY next_attempt_at, id LIMIT $1
                           FOR UPDATE SKIP LOCKED)
             UPDATE webhook_deliveries d SET next_attempt_at = compute_now() + make_interval(secs => $2)
               FROM due, webhooks w
              WHERE d.id = due.id AND w.id = d.webhook_id
             RETURNING d.id, d.event_id, d.payload::text, w.url, w.secret,
                       CASE WHEN w.previous_valid_until > compute_now() THEN w.previous_secret END,
                       extract(epoch FROM compute_now())::int8, w.disabled_at IS NOT NULL, w.id, d.next_attempt_at",
            &[&BATCH, &CLAIM_S, &webhook],
        )
        .await?;
    let mut claimed = Vec::new();
    let mut disabled = Vec::new();
    for r in &rows {
        if r.get::<_, bool>(7) {
            disabled.push(r.get::<_, String>(0));
            continue;
        }
        let mut secrets = vec![r.get::<_, String>(4)];
        secrets.extend(r.get::<_, Option<String>>(5));
        claimed.push(Claimed {
            id: r.get(0),
            event_id: r.get(1),
            payload: r.get(2),
            url: r.get(3),
            secrets,
            timestamp: r.get(6),
            webhook_id: r.get(8),
            stamp: r.get(9),
        });
    }
    if !disabled.is_empty() {
        tx.execute(
            "UPDATE webhook_deliveries SET state = 'dead', next_attempt_at = NULL, finished_at = compute_now(),
                    last_error = 'the endpoint is disabled; enable it, then replay' WHERE id = ANY($1)",
            &[&disabled],
        )
        .await?;
    }
    tx.commit().await?;
    Ok((claimed, disabled.len()))
}

/// Enqueues every endpoint with a due delivery (at most [`SWEEP_MAX`]; more makes it run again).
async fn sweep(ctx: &ReconcileContext) -> Result<Outcome, RunError> {
    let mut c = ctx.client().await?;
    let tx = ctx.begin_fenced(&mut c).await?;
    let due: Vec<String> = tx
        .query(
            "SELECT DISTINCT webhook_id FROM webhook_deliveries WHERE state = 'pending' AND next_attempt_at <= compute_now() LIMIT $1",
            &[&SWEEP_MAX],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for chunk in due.chunks(1_000) {
        work_queue::enqueue_many(&*tx, &DELIVER, chunk).await?;
    }
    tx.commit().await?;
    Ok(if due.len() as i64 == SWEEP_MAX { Outcome::SyncAgain } else { Outcome::Done })
}
