//! The gateway: a tonic gRPC server daemons hold their sessions with, over mTLS. It is a thin skin
//! over the nodes module's session, join and command functions: it holds sessions in memory
//! ([`hub`]), supersedes older ones by session epoch, sends desired state and commands, applies the
//! daemons' reports, flushes liveness as ages in batches, holds a 20 s gateway lease, and wakes on
//! pokes (LISTEN/NOTIFY on a direct connection) as well as polling.

pub mod ca;
pub mod hub;
mod service;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use better_compute_core::lease::GATEWAY_LEASE_RENEW_EVERY_S;
use better_compute_db::{DbError, Lease, Pool};
use better_compute_nodes::session;
use better_compute_proto::v1::{gateway_message, Cancel, Command, CommandBody, DesiredState, GatewayMessage, NodeSpec};
use prost::Message;
use tokio::sync::{watch, Semaphore};

pub use ca::Ca;

/// How a gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Its id (`gw_…`): its lease is `gateway:<id>`.
    pub id: String,
    /// Where it listens (port 0 picks one).
    pub listen: String,
    /// The names and addresses daemons reach it by: its server certificate's subject names.
    pub hostnames: Vec<String>,
    /// A direct (not pooled) connection string for LISTEN; `None` polls only.
    pub listen_url: Option<String>,
    /// How often it polls for commands and desired state that a lost poke did not announce.
    pub poll_interval: Duration,
    /// How often it writes `last seen` for its sessions.
    pub flush_interval: Duration,
    /// Messages queued per session before the gateway stops dispatching to it.
    pub session_queue: usize,
    /// Dispatches and pushes in flight at once.
    pub dispatch_concurrency: usize,
    /// How long a node certificate is valid.
    pub node_cert_lifetime: Duration,
    /// How long a daemon has to say Hello.
    pub hello_timeout: Duration,
}

impl GatewayConfig {
    /// Defaults for a gateway with this id listening on `listen`.
    pub fn new(id: impl Into<String>, listen: impl Into<String>) -> GatewayConfig {
        GatewayConfig {
            id: id.into(),
            listen: listen.into(),
            hostnames: vec!["localhost".into(), "127.0.0.1".into()],
            listen_url: None,
            poll_interval: Duration::from_secs(1),
            flush_interval: Duration::from_secs(2),
            session_queue: 256,
            dispatch_concurrency: 32,
            node_cert_lifetime: ca::NODE_CERT_LIFETIME,
            hello_timeout: Duration::from_secs(10),
        }
    }
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The database.
    #[error(transparent)]
    Db(#[from] DbError),
    /// The CA.
    #[error(transparent)]
    Ca(#[from] ca::CaError),
    /// Listening or TLS.
    #[error("gateway transport: {0}")]
    Transport(String),
    /// Another process holds this gateway id's lease.
    #[error("another process holds the lease of gateway {0}")]
    LeaseHeld(String),
}

pub(crate) struct Inner {
    pub(crate) cfg: GatewayConfig,
    pub(crate) pool: Pool,
    pub(crate) ca: Arc<Ca>,
    pub(crate) hub: hub::Hub,
    dispatching: Arc<Semaphore>,
    /// Business time, sampled at start and at every lease renewal (`clock.skew`).
    clock: better_compute_db::Clock,
    /// Set once a clean stop began: new sessions are refused.
    pub(crate) stopping: std::sync::atomic::AtomicBool,
}

/// A running gateway.
pub struct Gateway {
    inner: Arc<Inner>,
    addr: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Gateway {
    /// Takes the gateway lease, binds, and serves until `shutdown` turns true.
    pub async fn start(pool: Pool, ca: Arc<Ca>, cfg: GatewayConfig, shutdown: watch::Receiver<bool>) -> Result<Gateway, GatewayError> {
        let lease_name = session::gateway_lease_name(&cfg.id);
        let lease = {
            // Every statement in a transaction: safe behind PgBouncer in transaction pooling.
            let mut c = pool.get().await.map_err(DbError::from)?;
            let tx = c.transaction().await.map_err(DbError::from)?;
            let clock = better_compute_db::Clock::start(&*tx).await?;
            let lease = Lease::acquire(&*tx, &lease_name, &cfg.id, better_compute_db::lease::GATEWAY_LEASE_TTL, Some(&clock)).await?;
            tx.commit().await.map_err(DbError::from)?;
            (lease.ok_or_else(|| GatewayError::LeaseHeld(cfg.id.clone()))?, clock)
        };
        let (lease, clock) = lease;
        let (cert, key) = ca.server_identity(&cfg.hostnames)?;
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(cert, key))
            .client_ca_root(tonic::transport::Certificate::from_pem(ca.cert_pem()))
            // Join comes without a client certificate; Session and RotateCertificate demand one.
            .client_auth_optional(true);
        let listener = tokio::net::TcpListener::bind(&cfg.listen).await.map_err(|e| GatewayError::Transport(format!("listen on {}: {e}", cfg.listen)))?;
        let addr = listener.local_addr().map_err(|e| GatewayError::Transport(e.to_string()))?;
        let inner = Arc::new(Inner { dispatching: Arc::new(Semaphore::new(cfg.dispatch_concurrency.max(1))), cfg, pool, ca, hub: hub::Hub::new(), clock, stopping: Default::default() });
        let server = tonic::transport::Server::builder()
            .tls_config(tls)
            .map_err(|e| GatewayError::Transport(e.to_string()))?
            // A dead peer is noticed within 20 s: well inside the 40 s before a node is unreachable.
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .tcp_nodelay(true)
            .add_service(better_compute_proto::v1::gateway_server::GatewayServer::new(service::GatewayService { inner: inner.clone() }));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let mut stop = shutdown.clone();
        let mut tasks = vec![tokio::spawn({
            let inner = inner.clone();
            async move {
                let stopping = inner.clone();
                let r = server
                    .serve_with_incoming_shutdown(incoming, async move {
                        let _ = stop.wait_for(|s| *s).await;
                        // Closes every session and ends every stream, so the graceful shutdown has
                        // nothing to wait for.
                        stopping.close_all().await;
                    })
                    .await;
                if let Err(e) = r {
                    tracing::error!(error = %e, "gateway server stopped");
                }
                inner.hub.clear("this gateway stopped");
            }
        })];
        tasks.push(tokio::spawn(inner.clone().keep_lease(lease, shutdown.clone())));
        tasks.push(tokio::spawn(inner.clone().flush_loop(shutdown.clone())));
        let (poke_tx, poke_rx) = tokio::sync::mpsc::channel::<Poke>(4096);
        tasks.push(tokio::spawn(inner.clone().poke_loop(poke_rx, shutdown.clone())));
        if let Some(url) = inner.cfg.listen_url.clone() {
            tasks.push(tokio::spawn(listen_for_pokes(url, poke_tx.clone(), shutdown.clone())));
        }
        tasks.push(tokio::spawn(inner.clone().poll_loop(shutdown)));
        Ok(Gateway { inner, addr, tasks })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its id.
    pub fn id(&self) -> &str {
        &self.inner.cfg.id
    }

    /// Sessions held now.
    pub fn sessions(&self) -> usize {
        self.inner.hub.len()
    }

    /// Its self-checks: `clock.skew`, from the samples its lease renewals take.
    pub fn self_check(&self) -> Vec<better_compute_db::clock::SelfCheck> {
        self.inner.clock.self_check()
    }

    /// Waits for its tasks after shutdown turned true.
    pub async fn join(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Slots reserved in a session's queue for the commands of one dispatch.
pub(crate) type Reserved<'s> = tokio::sync::mpsc::PermitIterator<'s, Result<GatewayMessage, tonic::Status>>;

/// A wake-up for one node.
#[derive(Debug, Clone)]
pub(crate) enum Poke {
    Commands(String),
    Spec(String),
}

impl Inner {
    /// Renews the lease every 5 s; when it is lost, every session is dropped (their daemons
    /// reconnect, perhaps elsewhere) and the lease is taken again.
    async fn keep_lease(self: Arc<Self>, mut lease: Lease, mut shutdown: watch::Receiver<bool>) {
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
                    let dropped = self.hub.clear("this gateway lost its lease");
                    tracing::warn!(gateway = %self.cfg.id, dropped, "gateway lease lost; sessions dropped");
                    if let Ok(tx) = c.transaction().await
                        && let Ok(Some(l)) = Lease::acquire(&*tx, lease.name(), &self.cfg.id, better_compute_db::lease::GATEWAY_LEASE_TTL, Some(&self.clock)).await
                        && tx.commit().await.is_ok()
                    {
                        lease = l;
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
    async fn close_all(&self) {
        self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        let held = self.hub.held();
        if let Ok(mut c) = self.pool.get().await
            && let Ok(tx) = c.transaction().await
        {
            let mut closed = 0;
            for (node, epoch) in &held {
                match session::close(&*tx, node, *epoch, "the gateway stopped").await {
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

    /// Ends the streams of sessions the database no longer gives this gateway (the liveness job
    /// closed them as silent, say after the clock jumped, or another gateway took them over), so
    /// their daemons reconnect instead of heartbeating into a closed session forever.
    fn end_lost_sessions(&self, nodes: &[String], epochs: &[i64], held: &[String]) {
        let held: std::collections::HashSet<&str> = held.iter().map(String::as_str).collect();
        for (node, epoch) in nodes.iter().zip(epochs) {
            if held.contains(node.as_str()) {
                continue;
            }
            if self.hub.remove(node, *epoch, "the control plane closed this session (silent too long, or its gateway's lease lapsed)") {
                tracing::info!(node = %node, epoch, "session closed by the control plane; its daemon will reconnect");
            }
        }
    }

    /// Writes `last seen` as ages for every session heard from since the last flush: one
    /// statement per batch of 5,000.
    async fn flush_loop(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(self.cfg.flush_interval) => {}
            }
            loop {
                let (nodes, epochs, ages) = self.hub.take_unflushed(5_000);
                if nodes.is_empty() {
                    break;
                }
                let Ok(mut c) = self.pool.get().await else { break };
                let flushed = async {
                    let tx = c.transaction().await?;
                    let held = session::flush_last_seen(&*tx, &self.cfg.id, &nodes, &epochs, &ages).await?;
                    tx.commit().await?;
                    Ok::<_, DbError>(held)
                };
                match flushed.await {
                    Ok(held) => {
                        tracing::debug!(flushed = nodes.len(), held = held.len(), "liveness flushed");
                        self.end_lost_sessions(&nodes, &epochs, &held)
                    }
                    Err(e) => tracing::warn!(error = %e, "liveness flush failed"),
                }
                if nodes.len() < 5_000 {
                    break;
                }
            }
        }
    }

    /// Runs pokes with bounded concurrency.
    async fn poke_loop(self: Arc<Self>, mut pokes: tokio::sync::mpsc::Receiver<Poke>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let poke = tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                p = pokes.recv() => match p { Some(p) => p, None => return },
            };
            self.clone().spawn_poke(poke).await;
        }
    }

    async fn spawn_poke(self: Arc<Self>, poke: Poke) {
        let node = match &poke {
            Poke::Commands(n) | Poke::Spec(n) => n.clone(),
        };
        if self.hub.get(&node).is_none() {
            return;
        }
        let Ok(permit) = self.dispatching.clone().acquire_owned().await else { return };
        tokio::spawn(async move {
            let r = match poke {
                Poke::Commands(n) => self.dispatch(&n).await,
                Poke::Spec(n) => self.push_spec(&n).await,
            };
            if let Err(e) = r {
                tracing::warn!(node = %node, error = %e, "dispatch failed; the poll retries");
            }
            drop(permit);
        });
    }

    /// Every poll: the nodes of our sessions with due commands or cancels, and those behind on
    /// desired state. This is what makes a lost poke only a delay.
    async fn poll_loop(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(self.cfg.poll_interval) => {}
            }
            if let Err(e) = self.clone().poll_once().await {
                tracing::warn!(error = %e, "gateway poll failed");
            }
        }
    }

    pub(crate) async fn poll_once(self: Arc<Self>) -> Result<(), DbError> {
        if self.hub.is_empty() {
            return Ok(());
        }
        let (work, behind) = {
            let mut c = self.pool.get().await?;
            let tx = c.transaction().await?;
            let found = (session::nodes_with_work(&*tx, &self.cfg.id).await?, session::nodes_behind(&*tx, &self.cfg.id).await?);
            tx.commit().await?;
            found
        };
        for n in work {
            self.clone().spawn_poke(Poke::Commands(n)).await;
        }
        for (n, generation) in behind {
            if self.hub.get(&n).is_some_and(|s| s.sent_generation() < generation) {
                self.clone().spawn_poke(Poke::Spec(n)).await;
            }
        }
        Ok(())
    }

    /// Sends the node its due pending commands (as many as its queue has room for) and Cancel for
    /// in-flight ones someone cancelled. A superseded session is dropped.
    pub(crate) async fn dispatch(&self, node_id: &str) -> Result<(), DbError> {
        let Some(s) = self.hub.get(node_id) else { return Ok(()) };
        let mut c = self.pool.get().await?;
        let tx = c.transaction().await?;
        let d = self.dispatch_in(&*tx, node_id, &s).await?;
        tx.commit().await?;
        if let Some(d) = d {
            self.send_dispatched(node_id, &s, d);
        }
        Ok(())
    }

    /// The database side of a dispatch, in the caller's transaction: `None` when there is no room
    /// in the session's queue, or the session was superseded (then it is dropped here). Room is
    /// reserved before any command is claimed, so a command moved to `sent` always has its slot,
    /// however many dispatches for the node run at once.
    pub(crate) async fn dispatch_in<'s>(
        &self,
        tx: &impl tokio_postgres::GenericClient,
        node_id: &str,
        s: &'s hub::Session,
    ) -> Result<Option<(session::Dispatched, Reserved<'s>)>, DbError> {
        let room = s.out.capacity().min(64);
        // Nothing reserved: a slow daemon's queue is full, and the poll comes back to it.
        let Ok(slots) = s.out.try_reserve_many(room.max(1)) else { return Ok(None) };
        let d = session::dispatch(tx, node_id, &self.cfg.id, s.epoch, room.max(1) as i64).await?;
        match d {
            Some(d) => Ok(Some((d, slots))),
            None => {
                self.hub.remove(node_id, s.epoch, "this session was closed or superseded");
                Ok(None)
            }
        }
    }

    /// Sends what a committed dispatch moved to `sent`, into the slots reserved for it.
    pub(crate) fn send_dispatched(&self, node_id: &str, s: &hub::Session, (d, mut slots): (session::Dispatched, Reserved<'_>)) {
        for cmd in d.commands {
            match slots.next() {
                Some(slot) => slot.send(Ok(command_message(node_id, &cmd))),
                // Cannot happen: at most as many commands were claimed as slots were reserved.
                None => tracing::error!(node = %node_id, command = %cmd.id, "no reserved slot; the command goes again on reconnect"),
            }
            metrics::counter!("gateway_commands_sent_total").increment(1);
        }
        drop(slots);
        for id in d.cancels {
            let _ = s.out.try_send(Ok(GatewayMessage { msg: Some(gateway_message::Msg::Cancel(Cancel { command_id: id })) }));
        }
    }

    /// Sends the node its desired state if it is newer than what this session has seen.
    pub(crate) async fn push_spec(&self, node_id: &str) -> Result<(), DbError> {
        let Some(s) = self.hub.get(node_id) else { return Ok(()) };
        let Some((generation, json)) = ({
            let mut c = self.pool.get().await?;
            let tx = c.transaction().await?;
            let d = session::desired_state(&*tx, node_id).await?;
            tx.commit().await?;
            d
        }) else {
            return Ok(());
        };
        if !s.claim_generation(generation) {
            return Ok(());
        }
        send_spec(node_id, &s, generation, json);
        Ok(())
    }
}

/// Sends a stored desired state down a session; a full queue forgets the send, so the next poll
/// sends it again.
pub(crate) fn send_spec(node_id: &str, s: &hub::Session, generation: i64, json: serde_json::Value) {
    let spec: NodeSpec = match serde_json::from_value(json) {
        Ok(spec) => spec,
        Err(e) => {
            tracing::error!(node = %node_id, error = %e, "stored spec does not parse as NodeSpec");
            return;
        }
    };
    let msg = GatewayMessage { msg: Some(gateway_message::Msg::DesiredState(DesiredState { generation, spec: Some(spec) })) };
    if s.out.try_send(Ok(msg)).is_err() {
        tracing::warn!(node = %node_id, "session queue full; desired state goes again on the next poll");
        s.reset_generation(generation - 1);
    }
}

pub(crate) fn command_message(node_id: &str, c: &session::Dispatch) -> GatewayMessage {
    let body = CommandBody::decode(c.body.as_slice()).unwrap_or_default();
    GatewayMessage {
        msg: Some(gateway_message::Msg::Command(Command {
            command_id: c.id.clone(),
            node_id: node_id.to_owned(),
            seq: c.seq,
            kind: c.kind.clone(),
            lane: c.lane.clone(),
            body: Some(body),
            min_generation: c.min_generation,
            expires_in_ms: c.expires_in_ms,
            retry_safe: c.retry_safe,
        })),
    }
}

/// Turns command and desired-state notifications into pokes until shutdown. A full poke queue
/// drops the poke: the poll covers it.
async fn listen_for_pokes(url: String, pokes: tokio::sync::mpsc::Sender<Poke>, mut shutdown: watch::Receiver<bool>) {
    use better_compute_nodes::commands::COMMANDS_CHANNEL;
    use better_compute_runtime::nodespec::NODESPEC_CHANNEL;
    let listen = better_compute_runtime::work_queue::listen(url, &[COMMANDS_CHANNEL, NODESPEC_CHANNEL], move |channel, node| {
        let poke = if channel == NODESPEC_CHANNEL { Poke::Spec(node.to_owned()) } else { Poke::Commands(node.to_owned()) };
        let _ = pokes.try_send(poke);
    });
    tokio::select! {
        _ = shutdown.wait_for(|s| *s) => {}
        _ = listen => {}
    }
}

/// Where the CA lives when nothing else is said: `<data>/ca`.
pub fn default_ca_dir(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("ca")
}
