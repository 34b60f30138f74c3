//! Trace context across processes (W3C `traceparent`): a span follows the remote span that started
//! its work (an API caller's header, a command's stored context), and a span's own context is
//! written where its work goes on elsewhere (a command's row, which its daemon follows). Without an
//! OpenTelemetry layer (`--otlp-endpoint` unset) spans carry no context: nothing is written, and
//! following is a no-op.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The longest `traceparent` followed (version 00 is 55 characters; later versions may append).
pub const MAX_TRACEPARENT_LEN: usize = 256;

/// Makes `span` a child of the remote span `traceparent` names. An absent, malformed or oversized
/// value leaves it where it was: a caller's header is its word, never a reason to refuse.
pub fn follow(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(value) = traceparent.filter(|t| !t.is_empty() && t.len() <= MAX_TRACEPARENT_LEN) else { return };
    let carrier = HashMap::from([("traceparent".to_owned(), value.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    if cx.span().span_context().is_valid() {
        // Fails only for a span already started with another parent; it then keeps that one.
        let _ = span.set_parent(cx);
    }
}

/// `span`'s context as a `traceparent`, when it has one (an OpenTelemetry layer records it).
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// The current span's context as a `traceparent` (see [`traceparent_of`]).
pub fn current_traceparent() -> Option<String> {
    traceparent_of(&tracing::Span::current())
}
