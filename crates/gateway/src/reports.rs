//! Group commit of the daemons' reports. Each session's reader hands what its daemon said to a few
//! appliers and waits for the answer before it reads on, so a session's reports stay in order.
//! An applier takes every session's reports that are waiting (up to [`REPORT_GROUP`]) and applies
//! them in one transaction, one statement per kind ([`reports::apply`]), then dispatches the
//! commands whose lane credits came free in the same transaction. Under load the groups grow by
//! themselves: while one commits, the next gathers. A group that fails is applied again session by
//! session, so one daemon's bad report or a deadlock costs only a retry, never another's report. A
//! group never waits for a node's row that another transaction holds (a session opening, a liveness
//! pass): that session is left out and applied alone, so one busy node holds up only itself.

use std::sync::Arc;

use better_compute_db::DbError;
use better_compute_nodes::inventory::reports::{self, Applied, NodeLocks, SessionReports};
use tokio::sync::{mpsc, oneshot, watch, Mutex};

use crate::hub::Session;
use crate::Inner;

/// Sessions whose reports one transaction applies at most.
pub(crate) const REPORT_GROUP: usize = 256;
/// Group transactions in flight at once.
pub(crate) const REPORT_APPLIERS: usize = 4;
/// Sessions waiting for an applier at most; a reader waits for room (and so reads its daemon no
/// faster than reports are applied).
pub(crate) const REPORT_QUEUE: usize = 4096;

/// One session's reports, waiting to be applied.
pub(crate) struct Submitted {
    reports: SessionReports,
    session: Arc<Session>,
    /// `Ok(false)`: the session was superseded or closed, and nothing was written.
    done: oneshot::Sender<Result<bool, DbError>>,
}

/// The queue the readers submit to.
pub(crate) type Queue = mpsc::Sender<Submitted>;

impl Inner {
    /// Applies one session's reports in the next group; `Ok(false)` when the session no longer
    /// holds (nothing was written).
    pub(crate) async fn submit_reports(&self, session: Arc<Session>, reports: SessionReports) -> Result<bool, DbError> {
        let (done, answer) = oneshot::channel();
        let stopped = || DbError::from(better_compute_core::Error::new(better_compute_core::ErrorCode::Unavailable, "this gateway is stopping"));
        self.reports.send(Submitted { reports, session, done }).await.map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    /// One applier: gathers the waiting sessions' reports into a group and applies it, until
    /// shutdown.
    pub(crate) async fn report_loop(self: Arc<Self>, queue: Arc<Mutex<mpsc::Receiver<Submitted>>>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let group = {
                let mut queue = queue.lock().await;
                let first = tokio::select! {
                    _ = shutdown.wait_for(|s| *s) => return,
                    s = queue.recv() => match s { Some(s) => s, None => return },
                };
                let mut group = vec![first];
                while group.len() < REPORT_GROUP {
                    match queue.try_recv() {
                        Ok(s) => group.push(s),
                        Err(_) => break,
                    }
                }
                group
            };
            self.apply_group(group).await;
        }
    }

    async fn apply_group(&self, group: Vec<Submitted>) {
        metrics::histogram!("better_compute_gateway_report_flush_sessions").record(group.len() as f64);
        let locks = if group.len() > 1 { NodeLocks::SkipBusy } else { NodeLocks::Wait };
        match self.apply_together(&group, locks).await {
            Ok(applied) => {
                for s in group {
                    if applied.deferred.contains(&s.reports.node_id) {
                        // Its node's row was busy: alone, waiting for the row, after the group.
                        self.apply_alone(s).await;
                    } else {
                        let _ = s.done.send(Ok(applied.held.contains(&s.reports.node_id)));
                    }
                }
            }
            Err(e) if group.len() > 1 => {
                tracing::debug!(sessions = group.len(), error = %e, "a report group failed; applying it session by session");
                for s in group {
                    self.apply_alone(s).await;
                }
            }
            Err(e) => {
                if let Some(s) = group.into_iter().next() {
                    let _ = s.done.send(Err(e));
                }
            }
        }
    }

    /// Applies one session's reports in a transaction of their own, waiting for its node's row.
    async fn apply_alone(&self, s: Submitted) {
        let r = self.apply_together(std::slice::from_ref(&s), NodeLocks::Wait).await.map(|a| a.held.contains(&s.reports.node_id));
        let _ = s.done.send(r);
    }

    /// Applies a group in one transaction, dispatching to the nodes where a credit came free.
    async fn apply_together(&self, group: &[Submitted], locks: NodeLocks) -> Result<Applied, DbError> {
        let batch: Vec<&SessionReports> = group.iter().map(|s| &s.reports).collect();
        let mut c = self.pool.get().await?;
        let tx = c.transaction().await?;
        let applied = reports::apply(&*tx, &self.cfg.id, &batch, locks, &self.cfg.status_watches).await?;
        let freed: Vec<(&str, &Session)> =
            group.iter().filter(|s| applied.freed.contains(&s.reports.node_id)).map(|s| (s.reports.node_id.as_str(), &*s.session)).collect();
        let sent = self.dispatch_in(&*tx, &freed).await?;
        tx.commit().await?;
        for d in sent {
            self.send_dispatched(d);
        }
        metrics::counter!("better_compute_gateway_commands_settled_total").increment(applied.settled);
        Ok(applied)
    }
}
