//! The gateway's lease: renewed every 5 s; when it is lost every session is dropped and the lease
//! taken again. A clean stop closes every session in the database first.

use super::*;

impl Inner {
    /// Renews the lease every 5 s; when it is lost, every session is dropped (their daemons
    /// reconnect, perhaps elsewhere) and the lease is taken again.
    pub(crate) async fn keep_lease(self: Arc<Self>, mut lease: Lease, mut shutdown: watch::Receiver<bool>) {
        let every = Duration::from_secs(GATEWAY_LEASE_RENEW_EVERY_S);
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => break,
                _ = tokio::time::sleep(every) => {}
            }
            let Ok(mut c) = self.pool.get().await else { continue };
            let renewed = match c.transaction().await {
                Ok(tx) => match lease.renew(&*tx, Some(&self.clock)).await {
                    Ok(r) => tx.commit().await.map(|_| r).map_err(DbError::from),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e.into()),
            };
            match renewed {
                Ok(true) => {}
                Ok(false) => {
                    self.health.set_not_serving::<crate::GatewayServer>().await;
                    let dropped = self.hub.clear("this gateway lost its lease");
                    tracing::warn!(gateway = %self.cfg.id, dropped, "gateway lease lost; sessions dropped");
                    if let Ok(tx) = c.transaction().await
                        && let Ok(Some(l)) = Lease::acquire(&*tx, lease.name(), &self.cfg.id, better_compute_db::lease::GATEWAY_LEASE_TTL, Some(&self.clock)).await
                        && tx.commit().await.is_ok()
                    {
                        lease = l;
                        self.health.set_serving::<crate::GatewayServer>().await;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "gateway lease renewal failed"),
            }
        }
        // A clean stop: the sessions were closed as the server stopped; the lease goes at once.
        if let Ok(mut c) = self.pool.get().await
            && let Ok(tx) = c.transaction().await
            && lease.release(&*tx).await.is_ok()
        {
            let _ = tx.commit().await;
        }
    }

    /// A clean stop: refuses new sessions from now on, closes every session it holds in the
    /// database (its node is disconnected at once, not after its silence), then ends their streams.
    pub(crate) async fn close_all(&self) {
        self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        self.health.set_not_serving::<crate::GatewayServer>().await;
        let held = self.hub.held();
        if let Ok(mut c) = self.pool.get().await
            && let Ok(tx) = c.transaction().await
        {
            let mut closed = 0;
            for (node, epoch) in &held {
                match sessions::close(&*tx, node, *epoch, "the gateway stopped").await {
                    Ok(true) => closed += 1,
                    Ok(false) => {}
                    Err(e) => tracing::warn!(node = %node, error = %e, "could not close a session on stop"),
                }
            }
            if tx.commit().await.is_ok() {
                tracing::info!(gateway = %self.cfg.id, closed, "gateway stopping; its sessions are closed");
            }
        }
        self.hub.clear("this gateway is stopping");
    }
}
