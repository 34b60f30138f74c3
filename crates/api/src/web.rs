//! The web console at `/console`: one page and its script and style, compiled into the binary, so
//! it needs no build step, no files beside the binary and no request to any other origin. The page
//! is a client of the same API as everything else: it signs in with an API token (kept in the tab's
//! session storage), calls `POST /v1/<method>` with it, and follows `/v1/watch` to stay current, so
//! IAM decides what it shows and what its buttons may do; there is no second authorization path.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

const INDEX_HTML: &str = include_str!("../web/index.html");
const APP_JS: &str = include_str!("../web/app.js");
const APP_CSS: &str = include_str!("../web/app.css");

/// Everything comes from this origin; nothing may be framed or inlined (the script builds the page
/// from text nodes, never from HTML strings).
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; \
                   base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = (StatusCode::OK, body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // A new binary brings a new console; the browser asks again rather than keep an old script.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// `GET /console`: the page.
pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

/// `GET /console/app.js`.
pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

/// `GET /console/app.css`.
pub async fn style() -> Response {
    asset("text/css; charset=utf-8", APP_CSS)
}
