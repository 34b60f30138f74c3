//! `GET /v1/usage.export`: a period's usage windows streamed as CSV or JSON lines, for a billing
//! system to load in one request (`POST /v1/usage.export` answers the same rows as JSON pages).
//!
//! The answer is read from the database a page at a time, in billing-key order, on a pooled
//! connection taken per page and given back before the page is sent, so a slow reader holds no
//! connection. A client that takes nothing for [`crate::watch::SLOW_CLIENT_TIMEOUT`] is dropped.
//! A failure after the first byte aborts the response (the chunked body ends without its last
//! chunk), so a client never mistakes a cut export for a whole one; it resumes with `after=` the
//! last key it holds.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use better_compute_capacity::usage::{self, UsageWindowView};
use better_compute_core::Error;
use serde::Deserialize;
use serde_json::Value;

use crate::method::Ctx;
use crate::ApiState;

/// Windows read from the database per page.
pub const PAGE_ROWS: i64 = 1000;
/// Pages formatted ahead of the client at most.
pub const PAGES_AHEAD: usize = 2;

/// The columns of the CSV export, in order: the fields of [`UsageWindowView`].
pub const CSV_COLUMNS: &[&str] = &[
    "key", "reservationId", "tenantId", "poolId", "nodeId", "windowStart", "windowEnd", "adjustment", "gpuKind", "gpuModel", "migProfile",
    "atomSeconds", "vcpuSeconds", "memoryMibSeconds", "diskGibSeconds",
];

/// The query of `GET /v1/usage.export`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct ExportQuery {
    from: String,
    to: String,
    #[serde(default)]
    format: Format,
    #[serde(default)]
    tenant_id: Option<String>,
    #[serde(default)]
    all_tenants: bool,
    #[serde(default)]
    after: Option<String>,
}

/// How the rows are written.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Format {
    /// Comma-separated, a header row first (RFC 4180 quoting).
    #[default]
    Csv,
    /// One JSON object per line.
    Jsonl,
}

impl Format {
    fn content_type(self) -> &'static str {
        match self {
            Format::Csv => "text/csv; charset=utf-8",
            Format::Jsonl => "application/x-ndjson",
        }
    }

    fn write(self, out: &mut String, w: &UsageWindowView) {
        let v = serde_json::to_value(w).unwrap_or(Value::Null);
        match self {
            Format::Csv => {
                for (i, c) in CSV_COLUMNS.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&csv_field(&v[*c]));
                }
            }
            Format::Jsonl => out.push_str(&v.to_string()),
        }
        out.push('\n');
    }
}

/// A CSV field, quoted only when it holds a comma, a quote or a line break.
fn csv_field(v: &Value) -> String {
    let s = match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s }
}

pub(crate) async fn export(State(state): State<Arc<ApiState>>, headers: HeaderMap, query: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>) -> Response {
    let request_id = crate::new_request_id();
    let started = std::time::Instant::now();
    let r = open(&state, &headers, query, &request_id).await;
    crate::metrics::observe("usage.export", r.as_ref().map_or_else(|e| e.code.as_str(), |_| "OK"), started.elapsed());
    match r {
        Ok(r) => r,
        Err(e) => crate::error_response(&e, &request_id),
    }
}

async fn open(state: &Arc<ApiState>, headers: &HeaderMap, query: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>, request_id: &str) -> Result<Response, Error> {
    let principal = state.iam.authenticate(crate::bearer(headers)?).await?;
    state.rate_limiter.take(&principal.token_id, &principal.tenant_id)?;
    let Query(q) = query.map_err(|e| Error::invalid_argument(format!("bad usage.export query: {e}")))?;
    let request = crate::method::request_of(&principal, "usage.export", b"", request_id, None);
    let ctx = Ctx { state: state.clone(), principal, actor: better_compute_audit::Actor::Request(std::sync::Arc::new(request)), changes: false };
    let tenant = crate::methods::usage_scope(&ctx, q.tenant_id.as_deref(), q.all_tenants).await?;
    // The first page is read before the answer starts, so a bad period or an unreachable
    // database is an error answer, not a cut stream.
    let rows = state.usage_export_page_rows.max(1);
    let first = usage::export_page(&*ctx.read().await?, tenant.as_deref(), &q.from, &q.to, q.after.as_deref().unwrap_or_default(), rows).await?;
    let format = q.format;
    // A page of one row more than `rows` says another follows; it resumes after the last key shown.
    let chunk = move |mut page: Vec<UsageWindowView>, header: bool| {
        let more = page.len() as i64 > rows;
        page.truncate(rows as usize);
        let mut chunk = String::new();
        if header {
            chunk.push_str(&CSV_COLUMNS.join(","));
            chunk.push('\n');
        }
        for w in &page {
            format.write(&mut chunk, w);
        }
        (chunk, page.last().filter(|_| more).map(|w| w.key.clone()))
    };
    let (first, after) = chunk(first, matches!(format, Format::Csv));
    let pool = state.pool.clone();
    let body = crate::http::paged_body("usage.export", first, after, PAGES_AHEAD, state.watch_slow_client_timeout, move |after: String| {
        let (pool, tenant, from, to) = (pool.clone(), tenant.clone(), q.from.clone(), q.to.clone());
        async move {
            let db = better_compute_db::pool::read_tx(&pool).await?;
            let page = usage::export_page(&*db, tenant.as_deref(), &from, &to, &after, rows).await?;
            Ok(chunk(page, false))
        }
    });
    let mut r = (StatusCode::OK, body).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(format.content_type()));
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_csv_field_is_quoted_only_when_it_must_be() {
        assert_eq!(csv_field(&Value::Null), "");
        assert_eq!(csv_field(&serde_json::json!(7200.5)), "7200.5");
        assert_eq!(csv_field(&serde_json::json!("cmp:res_1:2030-01-01T00:00:00Z")), "cmp:res_1:2030-01-01T00:00:00Z");
        assert_eq!(csv_field(&serde_json::json!("a,\"b\"")), "\"a,\"\"b\"\"\"");
        assert_eq!(csv_field(&serde_json::json!("a\r\nb")), "\"a\r\nb\"");
    }

    #[test]
    fn the_csv_columns_are_every_field_of_a_window() {
        let w = UsageWindowView {
            key: "k".into(),
            reservation_id: "r".into(),
            tenant_id: "t".into(),
            pool_id: "p".into(),
            node_id: None,
            window_start: "s".into(),
            window_end: "e".into(),
            adjustment: 0,
            gpu_kind: "gpu".into(),
            gpu_model: "m".into(),
            mig_profile: None,
            atom_seconds: 1.0,
            vcpu_seconds: 2.0,
            memory_mib_seconds: 3.0,
            disk_gib_seconds: 4.5,
        };
        let v = serde_json::to_value(&w).unwrap();
        let fields: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(fields.len(), CSV_COLUMNS.len());
        for c in CSV_COLUMNS {
            assert!(fields.contains(c), "{c} is not a field of UsageWindowView");
        }
        let mut row = String::new();
        Format::Csv.write(&mut row, &w);
        assert_eq!(row, "k,r,t,p,,s,e,0,gpu,m,,1.0,2.0,3.0,4.5\n");
    }
}
