//! Liveness as ages: every session heard from since the last flush has its `last seen` written in
//! batches, and sessions the database no longer gives this gateway are ended.

use super::*;

/// Sessions whose `last seen` one statement writes. Small: the statement holds each row it writes
/// until it commits, and every report and dispatch of those nodes waits for it (their fence shares
/// the same rows), so a short statement is a short wait. The flush itself never waits: a row that
/// a fence holds is skipped and flushed next time.
pub(crate) const FLUSH_BATCH: usize = 500;

impl Inner {
    /// Writes `last seen` as ages for every session heard from since the last flush: one
    /// transaction per [`FLUSH_BATCH`] sessions.
    pub(crate) async fn flush_loop(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(self.cfg.flush_interval) => {}
            }
            loop {
                let (nodes, epochs, ages) = self.hub.take_unflushed(FLUSH_BATCH);
                if nodes.is_empty() {
                    break;
                }
                let Ok(mut c) = self.pool.get().await else { break };
                let flushed = async {
                    let tx = c.transaction().await?;
                    let flushed = sessions::flush_last_seen(&*tx, &self.cfg.id, &nodes, &epochs, &ages).await?;
                    tx.commit().await?;
                    Ok::<_, DbError>(flushed)
                };
                match flushed.await {
                    Ok(flushed) => {
                        tracing::debug!(flushed = flushed.written.len(), busy = flushed.busy.len(), "liveness flushed");
                        for n in &flushed.busy {
                            self.hub.unflush(n);
                        }
                        self.end_lost_sessions(&nodes, &epochs, &flushed)
                    }
                    Err(e) => tracing::warn!(error = %e, "liveness flush failed"),
                }
                if nodes.len() < FLUSH_BATCH {
                    break;
                }
            }
        }
    }

    /// Ends the streams of sessions the database no longer gives this gateway (the liveness job
    /// closed them as silent, say after the clock jumped, or another gateway took them over), so
    /// their daemons reconnect instead of heartbeating into a closed session forever.
    pub(crate) fn end_lost_sessions(&self, nodes: &[String], epochs: &[i64], flushed: &sessions::Flushed) {
        let held: std::collections::HashSet<&str> = flushed.written.iter().chain(&flushed.busy).map(String::as_str).collect();
        for (node, epoch) in nodes.iter().zip(epochs) {
            if held.contains(node.as_str()) {
                continue;
            }
            if self.hub.remove(node, *epoch, "the control plane closed this session (silent too long, or its gateway's lease lapsed)") {
                tracing::info!(node = %node, epoch, "session closed by the control plane; its daemon will reconnect");
            }
        }
    }
}
