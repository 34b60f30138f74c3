//! The HTTP server under the API: our own accept loop on hyper, so a connection's limits are ours
//! to set.
//!
//! - A request's head must arrive within [`HttpSettings::header_read_timeout`], and an idle
//!   keep-alive connection is closed after the same time (hyper's header timer also runs while it
//!   waits for the next request), so slow or half-open connections are not held.
//! - A head is at most [`MAX_HEAD_BYTES`] and [`MAX_HEADERS`] headers.
//! - The refusals hyper answers itself, before a request reaches the router (400 for a bad request
//!   line or header, 414, 431), are rewritten on the way out into the API's JSON error
//!   `{code, message, details}` with an `x-request-id`, like every other answer
//!   ([`RefusalsAsJson`]).

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::Router;
use better_compute_core::Error;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The largest request head (request line and headers) read.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The most headers a request may carry.
pub const MAX_HEADERS: usize = 100;
/// How long a stopping server waits for its connections (a watch stream never ends by itself).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The connection limits, and TLS.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    /// How long a request's head may take to arrive (a TLS handshake too), and how long an idle
    /// keep-alive connection is kept.
    pub header_read_timeout: Duration,
    /// HTTPS (`crate::tls::server_config`); none: plain HTTP.
    pub tls: Option<std::sync::Arc<rustls::ServerConfig>>,
}

impl Default for HttpSettings {
    fn default() -> HttpSettings {
        HttpSettings { header_read_timeout: Duration::from_secs(10), tls: None }
    }
}

/// The address a request's connection came from.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub std::net::SocketAddr);

/// Serves `router` on `listener` until `shutdown` resolves, then lets the open connections finish
/// for up to [`SHUTDOWN_GRACE`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    settings: HttpSettings,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors or a connection reset before it was taken: keep serving.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        // The client's address, for the audit log.
        let service = TowerToHyperService::new(router.clone().layer(axum::Extension(ClientAddr(peer))));
        let mut stopping = stopping.clone();
        let settings = settings.clone();
        // Finished connections leave the set as new ones come, so it holds only live ones.
        while connections.try_join_next().is_some() {}
        connections.spawn(async move {
            let stream: Box<dyn Stream> = match &settings.tls {
                None => Box::new(stream),
                Some(tls) => match tokio::time::timeout(settings.header_read_timeout, tokio_rustls::TlsAcceptor::from(tls.clone()).accept(stream)).await {
                    Ok(Ok(s)) => Box::new(s),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "a TLS handshake failed");
                        return;
                    }
                    Err(_) => return,
                },
            };
            let mut builder = Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(settings.header_read_timeout)
                .max_buf_size(MAX_HEAD_BYTES)
                .max_headers(MAX_HEADERS);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(RefusalsAsJson::new(stream)), service);
            let mut conn = std::pin::pin!(conn);
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "connection ended with an error");
                        }
                        return;
                    }
                    _ = stopping.wait_for(|s| *s) => conn.as_mut().graceful_shutdown(),
                }
            }
        });
    }
    drop(listener);
    let _ = stop.send(true);
    if tokio::time::timeout(SHUTDOWN_GRACE, async { while connections.join_next().await.is_some() {} }).await.is_err() {
        tracing::info!(open = connections.len(), "connections still open after the shutdown grace; closing them");
        connections.abort_all();
    }
    Ok(())
}

/// A connection, plain or TLS.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<S: AsyncRead + AsyncWrite + Unpin + Send> Stream for S {}

/// A connection whose answers from hyper itself (a response head with a 4xx status and no
/// `x-request-id`, which every answer of the router carries) are replaced by the API's JSON error.
/// An answer starts with the first write after bytes were read; hyper writes a head in one
/// buffer since this IO takes no vectored writes.
pub struct RefusalsAsJson<S> {
    inner: S,
    /// Bytes arrived since the last write: the next write starts an answer.
    read_since_write: bool,
    /// A replacement answer not yet written through.
    pending: Vec<u8>,
    sent: usize,
}

impl<S> RefusalsAsJson<S> {
    /// Wraps a connection.
    pub fn new(inner: S) -> RefusalsAsJson<S> {
        RefusalsAsJson { inner, read_since_write: false, pending: Vec::new(), sent: 0 }
    }
}

/// The JSON answer that replaces hyper's own refusal in `head`, if `head` is one.
fn replacement(head: &[u8]) -> Option<Vec<u8>> {
    let rest = head.strip_prefix(b"HTTP/1.1 ").or_else(|| head.strip_prefix(b"HTTP/1.0 "))?;
    let status: u16 = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    let end = head.windows(4).position(|w| w == b"\r\n\r\n")?;
    let text = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
    if !(400..500).contains(&status) || text.contains("\r\nx-request-id:") {
        return None;
    }
    let message = match status {
        414 => "the request target is too long".to_owned(),
        431 => format!("the request's head is too large: at most {MAX_HEADERS} headers and {MAX_HEAD_BYTES} bytes"),
        _ => "the request is not valid HTTP/1.1: methods are POST /v1/<method> with a JSON body".to_owned(),
    };
    let request_id = crate::new_request_id();
    let body = serde_json::to_vec(&Error::invalid_argument(message)).ok()?;
    let reason = axum::http::StatusCode::from_u16(status).ok()?.canonical_reason().unwrap_or("");
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nx-request-id: {request_id}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    Some(out)
}

impl<S: AsyncWrite + Unpin> RefusalsAsJson<S> {
    /// Writes the pending replacement through.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.pending.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.pending.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for RefusalsAsJson<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            self.read_since_write = true;
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for RefusalsAsJson<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        ready!(self.drain(cx))?;
        if std::mem::take(&mut self.read_since_write)
            && let Some(answer) = replacement(buf)
        {
            self.pending = answer;
            // Hyper's bytes count as written; ours go out on this and the following polls.
            if let Poll::Ready(Err(e)) = self.drain(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        false
    }
}

/// A response body streamed a page at a time: `first`, then each chunk `next` makes from the
/// state the previous one left, until it says there is no more. At most `pages_ahead` chunks wait
/// in memory; a client that takes nothing for `patience` is dropped, and a failure aborts the body
/// (no last chunk), so a cut stream is never mistaken for a whole one. `what` names the stream in
/// the logs.
pub(crate) fn paged_body<S, F, Fut>(what: &'static str, first: String, state: Option<S>, pages_ahead: usize, patience: Duration, next: F) -> axum::body::Body
where
    S: Send + 'static,
    F: Fn(S) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(String, Option<S>), Error>> + Send,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, io::Error>>(pages_ahead.max(1));
    tokio::spawn(async move {
        let (mut chunk, mut state) = (first, state);
        loop {
            if tx.send_timeout(Ok(axum::body::Bytes::from(std::mem::take(&mut chunk))), patience).await.is_err() {
                tracing::info!(stream = what, "client gone or too slow; dropped");
                return;
            }
            let Some(s) = state.take() else { return };
            match next(s).await {
                Ok((c, more)) => (chunk, state) = (c, more),
                Err(e) => {
                    tracing::warn!(stream = what, error = %e, "failed mid-stream; the response is aborted");
                    let _ = tx.send(Err(io::Error::other(e.to_string()))).await;
                    return;
                }
            }
        }
    });
    axum::body::Body::from_stream(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hypers_own_refusals_are_replaced() {
        let hyper_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let out = String::from_utf8(replacement(hyper_431).unwrap()).unwrap();
        assert!(out.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"), "{out}");
        let body: serde_json::Value = serde_json::from_str(out.split_once("\r\n\r\n").unwrap().1).unwrap();
        assert_eq!(body["code"], "INVALID_ARGUMENT");
        assert!(out.contains("\r\nx-request-id: req_"));
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nx-request-id: req_1\r\n\r\n{}";
        assert!(replacement(ours).is_none(), "the router's own answers pass through");
        assert!(replacement(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(replacement(b"{\"code\":\"INTERNAL\"}").is_none());
    }
}
