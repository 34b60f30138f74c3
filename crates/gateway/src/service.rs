//! The gRPC service: `Join`, `RotateCertificate` and `Session`.

use std::sync::Arc;

use better_compute_core::{Error, ErrorCode};
use better_compute_db::DbError;
use better_compute_nodes::commands::Rejection;
use better_compute_nodes::inventory::join::{self, IssuedCertificate};
use better_compute_nodes::inventory::reports::{Report, SessionReports};
use better_compute_nodes::sessions;
use better_compute_proto::v1::gateway_server::Gateway;
use better_compute_proto::v1::{
    daemon_message, gateway_message, CertificateGrant, DaemonMessage, GatewayMessage, JoinRequest, JoinResponse, RejectReason,
    RotateCertificateRequest, Welcome,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::hub::Session;
use crate::{ca, Inner};

pub(crate) struct GatewayService {
    pub(crate) inner: Arc<Inner>,
}

/// Longest free-text field a daemon may send (reasons, messages), and longest result.
const MAX_TEXT: usize = 4096;
const MAX_RESULT: usize = 1 << 20;

fn status(e: impl Into<Error>) -> Status {
    let e: Error = e.into();
    let msg = format!("{}: {}", e.code.as_str(), e.message);
    match e.code {
        ErrorCode::InvalidArgument => Status::invalid_argument(msg),
        ErrorCode::Unauthenticated => Status::unauthenticated(msg),
        ErrorCode::PermissionDenied => Status::permission_denied(msg),
        ErrorCode::NotFound => Status::not_found(msg),
        ErrorCode::Conflict => Status::already_exists(msg),
        ErrorCode::FailedPrecondition => Status::failed_precondition(msg),
        ErrorCode::Unavailable => Status::unavailable(msg),
        _ => Status::internal(msg),
    }
}

fn db(e: impl Into<DbError>) -> Status {
    let e = e.into();
    // The daemon hears only INTERNAL; the operator's log says what the database said.
    if !matches!(e, DbError::Domain(_)) {
        tracing::warn!(error = %e, "a gateway request failed on the database");
    }
    status(e)
}

fn ca_error(e: ca::CaError) -> Status {
    Status::invalid_argument(format!("INVALID_ARGUMENT: certificate signing request: {e}"))
}

fn grant(s: &ca::Signed, ca_pem: &str) -> CertificateGrant {
    CertificateGrant {
        certificate_pem: s.pem.clone(),
        ca_pem: ca_pem.to_owned(),
        not_before_unix_s: s.not_before_unix_s,
        not_after_unix_s: s.not_after_unix_s,
    }
}

fn issued(s: &ca::Signed) -> IssuedCertificate<'_> {
    IssuedCertificate { fingerprint: s.fingerprint, serial: &s.serial, not_before_unix_s: s.not_before_unix_s, not_after_unix_s: s.not_after_unix_s }
}

impl GatewayService {
    /// The node behind the client certificate of this connection.
    async fn peer_node(&self, certs: Option<Arc<Vec<tonic::transport::CertificateDer<'static>>>>) -> Result<String, Status> {
        let certs = certs.ok_or_else(|| Status::unauthenticated("UNAUTHENTICATED: a node certificate is required; join first"))?;
        let leaf = certs.first().ok_or_else(|| Status::unauthenticated("UNAUTHENTICATED: a node certificate is required; join first"))?;
        let fp = ca::fingerprint(leaf.as_ref());
        let mut c = self.inner.pool.get().await.map_err(db)?;
        let tx = c.transaction().await.map_err(db)?;
        let node = join::certificate_node(&*tx, &fp).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        node.ok_or_else(|| Status::unauthenticated("UNAUTHENTICATED: this certificate is unknown or revoked; join again"))
    }
}

#[tonic::async_trait]
impl Gateway for GatewayService {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinResponse>, Status> {
        let r = req.into_inner();
        if r.join_token.is_empty() || r.join_token.len() > 256 {
            return Err(Status::unauthenticated("UNAUTHENTICATED: a join token is required"));
        }
        if r.csr_pem.len() > 16 << 10 || r.labels.len() > 64 {
            return Err(Status::invalid_argument("INVALID_ARGUMENT: the CSR is at most 16 KiB and labels at most 64"));
        }
        let inv = r.inventory.ok_or_else(|| Status::invalid_argument("INVALID_ARGUMENT: the inventory is required"))?;
        if inv.gpus.len() > 64 {
            return Err(Status::invalid_argument("INVALID_ARGUMENT: at most 64 GPUs per node"));
        }
        let mut c = self.inner.pool.get().await.map_err(db)?;
        let tx = c.transaction().await.map_err(db)?;
        let joined = join::redeem(&*tx, &r.join_token, &r.node_name, &r.labels, &inv).await.map_err(db)?;
        let signed = self.inner.ca.sign_node(&r.csr_pem, &joined.node_id, self.inner.cfg.node_cert_lifetime).map_err(ca_error)?;
        join::record_certificate(&*tx, &joined.node_id, &issued(&signed)).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        better_compute_runtime::work_queue::poke(&c).await;
        tracing::info!(node = %joined.node_id, pool = %joined.pool_id, "node joined");
        Ok(Response::new(JoinResponse {
            node_id: joined.node_id,
            certificate: Some(grant(&signed, self.inner.ca.cert_pem())),
            command_key: self.inner.cfg.command_key.clone(),
        }))
    }

    async fn rotate_certificate(&self, req: Request<RotateCertificateRequest>) -> Result<Response<CertificateGrant>, Status> {
        let node = self.peer_node(req.peer_certs()).await?;
        let r = req.into_inner();
        if r.csr_pem.len() > 16 << 10 {
            return Err(Status::invalid_argument("INVALID_ARGUMENT: the CSR is at most 16 KiB"));
        }
        let signed = self.inner.ca.sign_node(&r.csr_pem, &node, self.inner.cfg.node_cert_lifetime).map_err(ca_error)?;
        let mut c = self.inner.pool.get().await.map_err(db)?;
        let tx = c.transaction().await.map_err(db)?;
        join::record_certificate(&*tx, &node, &issued(&signed)).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(Response::new(grant(&signed, self.inner.ca.cert_pem())))
    }

    type SessionStream = ReceiverStream<Result<GatewayMessage, Status>>;

    async fn session(&self, req: Request<Streaming<DaemonMessage>>) -> Result<Response<Self::SessionStream>, Status> {
        let node = self.peer_node(req.peer_certs()).await?;
        let mut inbound = req.into_inner();
        let first = tokio::time::timeout(self.inner.cfg.hello_timeout, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("DEADLINE_EXCEEDED: say Hello first"))??;
        let Some(DaemonMessage { msg: Some(daemon_message::Msg::Hello(hello)) }) = first else {
            return Err(Status::invalid_argument("INVALID_ARGUMENT: the first message of a session is Hello"));
        };
        if hello.node_id != node {
            return Err(Status::permission_denied("PERMISSION_DENIED: this certificate belongs to another node"));
        }
        for (field, v) in [("bootId", &hello.boot_id), ("journalId", &hello.journal_id), ("daemonVersion", &hello.daemon_version)] {
            if v.is_empty() || v.len() > 128 {
                return Err(Status::invalid_argument(format!("INVALID_ARGUMENT: {field} must be 1 to 128 characters")));
            }
        }
        let inner = &self.inner;
        if inner.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::unavailable("UNAVAILABLE: this gateway is stopping; connect to another"));
        }
        let (out, rx) = tokio::sync::mpsc::channel(inner.cfg.session_queue.max(8));
        // One transaction: open the session, read what the daemon needs, and dispatch.
        let mut c = inner.pool.get().await.map_err(db)?;
        let tx = c.transaction().await.map_err(db)?;
        let h = sessions::Hello {
            node_id: &node,
            gateway_id: &inner.cfg.id,
            boot_id: &hello.boot_id,
            journal_id: &hello.journal_id,
            daemon_version: &hello.daemon_version,
        };
        let opened = sessions::open(&*tx, &h).await.map_err(db)?;
        let s = Arc::new(Session::new(opened.session_epoch, out.clone(), hello.observed_generation, inner.hub.now_ms()));
        // The full desired state when the daemon is behind, and always while its site boots (a
        // node back from an outage may have lost what it had applied).
        let spec = if hello.observed_generation < opened.generation || opened.site_booting { sessions::desired_state(&*tx, &node).await.map_err(db)? } else { None };
        // At least once: what was in flight goes again; the daemon's journal makes that safe.
        let again = sessions::in_flight(&*tx, &node).await.map_err(db)?;
        let held = s.clone(); // the dispatch's reserved slots borrow the session until they are used
        let dispatched = inner.dispatch_in(&*tx, &[(node.as_str(), &*held)]).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        drop(c);
        inner.hub.insert(&node, s.clone());
        // A stop that began while this session opened may have missed it: close it as it would.
        if inner.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            if let Ok(mut c) = inner.pool.get().await
                && let Ok(tx) = c.transaction().await
                && sessions::close(&*tx, &node, opened.session_epoch, "the gateway stopped").await.is_ok()
            {
                let _ = tx.commit().await;
            }
            inner.hub.remove(&node, opened.session_epoch, "this gateway is stopping");
            return Err(Status::unavailable("UNAVAILABLE: this gateway is stopping; connect to another"));
        }
        let welcome = Welcome { session_epoch: opened.session_epoch, generation: opened.generation };
        let _ = out.try_send(Ok(GatewayMessage { msg: Some(gateway_message::Msg::Welcome(welcome)) }));
        if let Some((generation, json)) = spec && s.claim_generation(generation) {
            crate::dispatch::send_spec(&node, &s, generation, json);
        }
        for d in &again {
            let _ = out.try_send(Ok(crate::dispatch::command_message(&node, d)));
        }
        drop(out);
        for d in dispatched {
            inner.send_dispatched(d);
        }
        let r = opened.reconnect;
        if r.succeeded + r.journal_lost > 0 {
            tracing::info!(node = %node, reboots_done = r.succeeded, journal_lost = r.journal_lost, "reconnect settled in-flight commands");
        }
        tracing::debug!(node = %node, epoch = opened.session_epoch, "session opened");
        tokio::spawn(read_session(inner.clone(), node, s, inbound));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Messages of one daemon submitted together at most: what it sent back to back (an ack and a
/// result, say) is applied in one group.
const BATCH: usize = 64;

/// Applies the daemon's messages in order until the stream ends or the session is superseded;
/// then closes it (a superseded session closes nothing).
async fn read_session(inner: Arc<Inner>, node: String, s: Arc<Session>, mut inbound: Streaming<DaemonMessage>) {
    use futures_util::{FutureExt, StreamExt};
    let mut ended = s.ended();
    let reason = 'session: loop {
        let mut batch = Vec::new();
        tokio::select! {
            m = inbound.next() => match m {
                Some(Ok(m)) => batch.push(m),
                None => break "daemon-closed",
                Some(Err(_)) => break "transport-error",
            },
            // The hub let the session go: closed underneath, superseded, or the lease was lost.
            _ = ended.wait_for(|e| *e) => break "ended-by-gateway",
        }
        // Whatever else has already arrived joins the batch (without waiting for more).
        let mut ended = None;
        while batch.len() < BATCH {
            match inbound.next().now_or_never() {
                Some(Some(Ok(m))) => batch.push(m),
                Some(None) => {
                    ended = Some("daemon-closed");
                    break;
                }
                Some(Some(Err(_))) => {
                    ended = Some("transport-error");
                    break;
                }
                None => break,
            }
        }
        s.touch(inner.hub.now_ms());
        let applied = match reports_of(batch) {
            Ok(r) if r.is_empty() => Ok(true),
            Ok(reports) => inner.submit_reports(s.clone(), SessionReports { node_id: node.clone(), epoch: s.epoch, reports }).await,
            Err(e) => Err(e.into()),
        };
        match applied {
            Ok(true) => {}
            Ok(false) => break 'session "superseded",
            Err(e) => {
                // Bad input from the daemon, or a database hiccup: say why, and end the session.
                // The daemon reconnects and everything in flight goes again; nothing was applied.
                tracing::warn!(node = %node, error = %e, "session report failed; closing the session");
                let _ = s.out.try_send(Err(db(e)));
                break 'session "gateway-error";
            }
        }
        if let Some(r) = ended {
            break r;
        }
    };
    inner.hub.remove(&node, s.epoch, "the session ended");
    if let Ok(mut c) = inner.pool.get().await
        && let Ok(tx) = c.transaction().await
        && sessions::close(&*tx, &node, s.epoch, reason).await.is_ok()
    {
        let _ = tx.commit().await;
    }
    tracing::debug!(node = %node, epoch = s.epoch, reason, "session closed");
}

fn clip(s: &str) -> &str {
    if s.len() <= MAX_TEXT {
        return s;
    }
    let mut end = MAX_TEXT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The reports in a batch of a daemon's messages, checked and bounded; heartbeats say only that
/// the daemon is alive, which the reader has noted.
fn reports_of(batch: Vec<DaemonMessage>) -> Result<Vec<Report>, Error> {
    use daemon_message::Msg;
    let mut out = Vec::with_capacity(batch.len());
    for msg in batch.into_iter().filter_map(|m| m.msg) {
        out.push(match msg {
            Msg::Heartbeat(_) => continue,
            Msg::Hello(_) => return Err(Error::invalid_argument("Hello twice in one session")),
            Msg::CommandAck(a) => Report::Ack { command_id: a.command_id },
            Msg::CommandReject(r) => {
                let why = match RejectReason::try_from(r.reason) {
                    Ok(RejectReason::StaleGeneration) => Rejection::StaleGeneration,
                    Ok(RejectReason::Expired) => Rejection::Expired,
                    Ok(RejectReason::Busy) => Rejection::Busy,
                    Ok(RejectReason::BadSignature) => Rejection::BadSignature,
                    _ => Rejection::Unsupported,
                };
                Report::Reject { command_id: r.command_id, why }
            }
            Msg::CommandResult(r) => {
                let result = if r.result_json.len() > MAX_RESULT {
                    serde_json::json!({"truncated": true, "bytes": r.result_json.len()})
                } else {
                    serde_json::from_str(&r.result_json).unwrap_or(serde_json::Value::String(r.result_json.clone()))
                };
                Report::Result { command_id: r.command_id, succeeded: r.succeeded, reason: Some(clip(&r.reason).to_owned()), result }
            }
            Msg::SpecStatus(st) => Report::SpecStatus(st),
            Msg::Inventory(inv) => Report::Inventory(inv),
            Msg::Health(h) => Report::Health(h),
            Msg::ConsoleOutput(c) => Report::Console { instance_id: c.instance_id, offset: c.offset, data: c.data },
        });
    }
    Ok(out)
}
