//! `GET /v1/audit.export`: the audit log as JSON lines, for `better-compute audit verify` (the
//! anchor first when the log was pruned, then the placed entries in log order, each checkpoint
//! after the last entry it covers). The whole log's chain is needed to verify it, so only a caller
//! with `compute:audit:read` at fleet scope exports it (a tenant proves its entries with
//! `audit.proof`). Read a page at a time, each on a connection of its own; a client that takes
//! nothing for [`crate::watch::SLOW_CLIENT_TIMEOUT`] is dropped, and a failure mid-stream aborts the
//! response (no last chunk), so a cut export is never mistaken for a whole one.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use better_compute_audit::verify::ExportLine;
use better_compute_core::Error;
use better_compute_runtime::authz::{Authorizer, Resource};
use serde::Deserialize;

use crate::ApiState;

/// Entries read per page.
pub const PAGE_ENTRIES: i64 = 5000;

/// The query of `GET /v1/audit.export`: none.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ExportQuery {}

pub(crate) async fn export(State(state): State<Arc<ApiState>>, headers: HeaderMap, query: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>) -> Response {
    let request_id = crate::new_request_id();
    match open(&state, &headers, query).await {
        Ok(r) => r,
        Err(e) => crate::error_response(&e, &request_id),
    }
}

fn entries(page: &[ExportLine]) -> i64 {
    page.iter().filter(|l| matches!(l, ExportLine::Entry(_))).count() as i64
}

fn lines(page: &[ExportLine]) -> Result<String, Error> {
    let mut out = String::new();
    for l in page {
        out.push_str(&serde_json::to_string(l).map_err(|e| Error::internal(e.to_string()))?);
        out.push('\n');
    }
    Ok(out)
}

/// A page's lines, and after the last page (a short one) the export's end line: how far it
/// reaches, so a stream cut short does not verify as complete. `to` is the log index after it.
fn page_lines(page: &[ExportLine], n: i64, to: i64) -> Result<String, Error> {
    let mut text = lines(page)?;
    if n < PAGE_ENTRIES {
        text.push_str(&lines(&[ExportLine::End(better_compute_audit::verify::End { tree_size: to })])?);
    }
    Ok(text)
}

async fn open(state: &Arc<ApiState>, headers: &HeaderMap, query: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>) -> Result<Response, Error> {
    let principal = state.iam.authenticate(crate::bearer(headers)?).await?;
    state.rate_limiter.take(&principal.token_id, &principal.tenant_id)?;
    query.map_err(|e| Error::invalid_argument(format!("bad audit.export query: {e}")))?;
    state.iam.check(principal.caller(), "compute:audit:read", Resource::Fleet).await?;
    // The anchor and the first page before the answer starts: an unreachable database is an error
    // answer, not a cut stream.
    let (first, first_n, from) = {
        let db = better_compute_db::pool::read_tx(&state.pool).await?;
        let mut from = 0;
        let mut first = String::new();
        if let Some(a) = better_compute_audit::prune::anchor(&*db).await? {
            from = a.checkpoint.tree_size;
            first = lines(&[ExportLine::Anchor(a)])?;
        }
        let page = better_compute_audit::log::export_page(&*db, from, PAGE_ENTRIES).await?;
        let n = entries(&page);
        first.push_str(&page_lines(&page, n, from + n)?);
        (first, n, from + n)
    };
    // The next page starts where the last left off; a short page was the last.
    let more = (first_n == PAGE_ENTRIES).then_some(from);
    let pool = state.pool.clone();
    let body = crate::http::paged_body("audit.export", first, more, 2, state.watch_slow_client_timeout, move |from| {
        let pool = pool.clone();
        async move {
            let db = better_compute_db::pool::read_tx(&pool).await?;
            let page = better_compute_audit::log::export_page(&*db, from, PAGE_ENTRIES).await?;
            let n = entries(&page);
            Ok((page_lines(&page, n, from + n)?, (n == PAGE_ENTRIES).then_some(from + n)))
        }
    });
    let mut r = (StatusCode::OK, body).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    Ok(r)
}
