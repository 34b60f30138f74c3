//! What every command tells about itself: log lines on stderr (text, or JSON for a log shipper),
//! and, with `--otlp-endpoint`, OpenTelemetry traces: the spans of API requests, reconciles and
//! commands, exported over OTLP/HTTP (protobuf) in bounded batches from a thread of their own, so
//! a slow or absent collector never holds up the work it describes.

use std::time::Duration;

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

use crate::LogFormat;

/// How long one export may take before the batch is dropped.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The installed logging and tracing; [`Telemetry::shutdown`] sends the spans still queued.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports what is queued and stops the exporter's thread. Call it outside the runtime, at exit.
    pub fn shutdown(self) {
        if let Some(p) = self.provider
            && let Err(e) = p.shutdown()
        {
            eprintln!("warning: the last traces were not exported: {e}");
        }
    }
}

/// Installs the process's subscriber: `BETTER_COMPUTE_LOG` filters (default `info`; `bench` mutes
/// the access log), `format`
/// shapes log lines, and `otlp_endpoint` (the collector's base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT`
/// has it: spans go to its `/v1/traces`) turns traces on. The service is `OTEL_SERVICE_NAME`, else
/// `better-compute-<command>`; `OTEL_TRACES_SAMPLER` and `OTEL_RESOURCE_ATTRIBUTES` apply. Call it
/// before the runtime starts (the exporter's HTTP client is a blocking one).
pub fn init(format: LogFormat, otlp_endpoint: Option<&str>, command: &str) -> anyhow::Result<Telemetry> {
    // A benchmark's API servers would write an access line per request it times.
    let default_filter = if command == "bench" { "info,tokio_postgres=warn,access=off" } else { "info,tokio_postgres=warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("BETTER_COMPUTE_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> = vec![match format {
        LogFormat::Json => logs.json().with_current_span(true).boxed(),
        // Colour codes only where a person reads them.
        LogFormat::Text => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).boxed(),
    }];
    let mut provider = None;
    if let Some(base) = otlp_endpoint.filter(|e| !e.is_empty()) {
        let endpoint = format!("{}/v1/traces", base.trim_end_matches('/'));
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(&endpoint)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .with_context(|| format!("the OTLP exporter for {endpoint}; check --otlp-endpoint"))?;
        let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| format!("better-compute-{command}"));
        let resource = opentelemetry_sdk::Resource::builder().with_service_name(service).build();
        let p = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
        layers.push(tracing_opentelemetry::layer().with_tracer(p.tracer("better-compute")).boxed());
        provider = Some(p);
    }
    tracing_subscriber::registry().with(layers).with(filter).init();
    Ok(Telemetry { provider })
}
