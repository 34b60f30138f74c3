//! `site-boot`: a site's nodes come back paced after a site-wide outage, and when a site is first
//! brought up (`sites.boot`).
//!
//! - The job (`jobs/site_boot.rs`, one pass over every site every 5 s) starts a boot when at least
//!   `boot_outage_percent` (default 50%) of a site's joined nodes are unreachable or lost, and at
//!   least [`MIN_NODES`] of them: `site.bootStarted`.
//! - While a site boots, each session open of one of its nodes takes a token from the site's
//!   bucket (`boot_admit_per_s`, default 50 a second); without one the daemon is told to retry
//!   later (`UNAVAILABLE`) and backs off. Each admitted session gets its full desired state,
//!   whatever generation the daemon says it has.
//! - Placement on the site waits: every node of it has `site-boot` among its `noScheduleReasons`
//!   until the boot ends.
//! - The boot ends when `boot_converged_percent` (default 90%) of the site's joined nodes are
//!   connected and converged: `site.bootEnded`, and placement resumes.
//!
//! Lock order: the site's row first (the row being changed), then its nodes in id order.

use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_runtime::outbox::{self, NewEvent};
use tokio_postgres::GenericClient;

use crate::jobs::site_boot::SITE_BOOT;

/// The reason a booting site's nodes have in `noScheduleReasons`.
pub const SITE_BOOT_REASON: &str = "site-boot";
/// A site with fewer joined nodes never counts as in an outage.
pub const MIN_NODES: i64 = 2;

/// Whether a session of `node_id` may open now. `Ok(false)`: its site is not booting (nothing to
/// pace); `Ok(true)`: booting, and this session took a token; `Err(UNAVAILABLE)`: booting and out
/// of tokens for now. Runs first in the session's transaction (the site's row before the node's).
pub async fn admit(tx: &impl GenericClient, node_id: &str) -> Result<bool, DbError> {
    let row = tx
        .query_opt(
            "UPDATE sites s SET
                boot_tokens = LEAST(s.boot_admit_per_s::float8,
                                    s.boot_tokens + s.boot_admit_per_s * extract(epoch FROM compute_now() - coalesce(s.boot_tokens_at, s.boot_since))) - 1,
                boot_tokens_at = compute_now()
               FROM pools p JOIN nodes n ON n.pool_id = p.id
              WHERE n.id = $1 AND s.id = p.site_id AND s.boot_state = 'booting'
             RETURNING s.boot_tokens >= 0, s.id, s.boot_admit_per_s",
            &[&node_id],
        )
        .await?;
    let Some(row) = row else { return Ok(false) };
    let (ok, site, rate): (bool, String, i32) = (row.get(0), row.get(1), row.get(2));
    if ok {
        return Ok(true);
    }
    Err(Error::new(
        better_compute_core::ErrorCode::Unavailable,
        format!("site {site} is booting after an outage and admits {rate} sessions a second; retry in a few seconds"),
    )
    .into())
}

/// Starts a paced boot of the site (`sites.boot`): when a site is first brought up, or when an
/// operator sees an outage coming. Returns whether it was not booting already.
pub async fn start(tx: &impl GenericClient, site_id: &str, why: &str) -> Result<bool, DbError> {
    let started = tx
        .execute(
            "UPDATE sites SET boot_state = 'booting', boot_since = compute_now(), boot_tokens = 0, boot_tokens_at = compute_now(),
                    version = version + 1
              WHERE id = $1 AND boot_state = 'normal'",
            &[&site_id],
        )
        .await?;
    if started == 0 {
        tx.query_opt("SELECT 1 FROM sites WHERE id = $1", &[&site_id]).await?.ok_or_else(|| Error::not_found("site", site_id))?;
        return Ok(false);
    }
    hold(tx, site_id, true).await?;
    outbox::emit(tx, NewEvent { event_type: "site.bootStarted", tenant_id: None, subject: site_id, data: serde_json::json!({"reason": why}) }).await?;
    Ok(true)
}

/// Adds or removes `site-boot` on every node of the site, in id order.
async fn hold(tx: &impl GenericClient, site_id: &str, on: bool) -> Result<u64, DbError> {
    Ok(tx
        .execute(
            "UPDATE nodes n SET no_schedule_reasons = CASE WHEN $2 THEN
                        (SELECT array_agg(DISTINCT x ORDER BY x) FROM unnest(n.no_schedule_reasons || $3::text) x)
                      ELSE array_remove(n.no_schedule_reasons, $3) END,
                    version = n.version + 1
              WHERE n.id IN (SELECT x.id FROM nodes x JOIN pools p ON p.id = x.pool_id WHERE p.site_id = $1
                                AND ($3 = ANY(x.no_schedule_reasons)) <> $2 ORDER BY x.id FOR UPDATE OF x)",
            &[&site_id, &on, &SITE_BOOT_REASON],
        )
        .await?)
}

/// A site's boot settings (`sites.update`); `None` leaves one as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct BootSettings {
    /// Sessions admitted per second while booting (1 to 100,000).
    pub admit_per_s: Option<i32>,
    /// The share of joined nodes connected and converged that ends a boot (1 to 100).
    pub converged_percent: Option<i32>,
    /// The share of joined nodes unreachable that starts one (1 to 100).
    pub outage_percent: Option<i32>,
}

/// `sites.update`: changes a site's boot settings.
pub async fn configure(tx: &impl GenericClient, site_id: &str, s: BootSettings) -> Result<(), DbError> {
    for (field, v, max) in [("bootAdmitPerS", s.admit_per_s, 100_000), ("bootConvergedPercent", s.converged_percent, 100), ("bootOutagePercent", s.outage_percent, 100)] {
        if let Some(v) = v && !(1..=max).contains(&v) {
            return Err(Error::invalid_argument(format!("{field} must be between 1 and {max}")).into());
        }
    }
    let n = tx
        .execute(
            "UPDATE sites SET boot_admit_per_s = coalesce($2, boot_admit_per_s), boot_converged_percent = coalesce($3, boot_converged_percent),
                    boot_outage_percent = coalesce($4, boot_outage_percent), version = version + 1
              WHERE id = $1",
            &[&site_id, &s.admit_per_s, &s.converged_percent, &s.outage_percent],
        )
        .await?;
    if n == 0 {
        return Err(Error::not_found("site", site_id).into());
    }
    Ok(())
}

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SiteBootReport {
    /// Boots started (outages seen).
    pub started: u64,
    /// Boots ended (enough nodes converged).
    pub ended: u64,
    /// Sites booting after the pass.
    pub booting: u64,
}

/// One pass over every site.
pub async fn evaluate(tx: &impl GenericClient) -> Result<SiteBootReport, DbError> {
    let mut report = SiteBootReport::default();
    let sites = tx
        .query(
            "SELECT s.id, s.boot_state,
                    count(n.id) FILTER (WHERE n.joined_at IS NOT NULL AND n.retired_at IS NULL),
                    count(n.id) FILTER (WHERE n.joined_at IS NOT NULL AND n.retired_at IS NULL AND n.liveness IN ('unreachable', 'lost')),
                    count(n.id) FILTER (WHERE n.joined_at IS NOT NULL AND n.retired_at IS NULL AND n.liveness = 'connected'
                                          AND n.generation >= 1 AND n.observed_generation >= n.generation),
                    s.boot_outage_percent, s.boot_converged_percent
               FROM sites s LEFT JOIN pools p ON p.site_id = s.id LEFT JOIN nodes n ON n.pool_id = p.id
              GROUP BY s.id ORDER BY s.id",
            &[],
        )
        .await?;
    for r in &sites {
        let (site, state, joined, down, converged, outage_pct, converged_pct): (String, String, i64, i64, i64, i32, i32) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5), r.get(6));
        match state.as_str() {
            "normal" if joined >= MIN_NODES && down * 100 >= joined * i64::from(outage_pct) => {
                let why = format!("{down} of {joined} joined nodes unreachable");
                if start(tx, &site, &why).await? {
                    better_compute_audit::Actor::job(SITE_BOOT.name).record(tx, "sites.bootStart", &site, None).await?;
                    report.started += 1;
                    report.booting += 1;
                }
            }
            "booting" if joined > 0 && converged * 100 >= joined * i64::from(converged_pct) => {
                let ended = tx
                    .execute("UPDATE sites SET boot_state = 'normal', boot_since = NULL, version = version + 1 WHERE id = $1 AND boot_state = 'booting'", &[&site])
                    .await?;
                if ended == 1 {
                    hold(tx, &site, false).await?;
                    better_compute_audit::Actor::job(SITE_BOOT.name).record(tx, "sites.bootEnd", &site, None).await?;
                    let data = serde_json::json!({"converged": converged, "joined": joined});
                    outbox::emit(tx, NewEvent { event_type: "site.bootEnded", tenant_id: None, subject: &site, data }).await?;
                    report.ended += 1;
                }
            }
            "booting" => report.booting += 1,
            _ => {}
        }
    }
    Ok(report)
}
