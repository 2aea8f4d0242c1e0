//! OpenTelemetry: the host's spans, exported over OTLP/HTTP when an endpoint is configured
//! (`[telemetry] otlp_endpoint`, or the standard `OTEL_EXPORTER_OTLP_*` variables).
//!
//! One order's trace is one tree, across hosts and Kafka:
//!
//! ```text
//! POST /v1/commands/{plugin}/{command}      server, from the caller's traceparent if any
//! └─ command orders.CreateOrder             the transaction
//!    ├─ call orders handle-command          the guest
//!    └─ outbox insert                       producer: the rows carry this span's traceparent
//!       ├─ publish orders                   producer: the relay, from send to broker ack
//!       └─ process OrderCreated             consumer: a handler of the event, on any host
//!          ├─ call inventory handle-event
//!          └─ outbox insert                 ... and so on down the chain
//! ```
//!
//! A timer's firing is a trace of its own (a timer that schedules itself again would
//! otherwise grow one trace for ever): `timer <name>`, with `call <plugin> handle-timer`
//! under it, and a link to the span of the command, event or timer that scheduled it.
//!
//! Span ids come from the SDK when exporting is on (so that its sampler decides, and the
//! ids the logs and the outbox rows carry are those of exported spans), and from
//! [`TraceContext`] otherwise. With exporting off, the spans that the log shows too (a
//! command, an event's processing) are fresh trace contexts and nothing more, and the
//! others ([`Span::export_only`]) are not made at all.

use std::borrow::Cow;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Context as _;
use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanId, Status, TraceContextExt as _, TraceFlags, TraceId, TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider, Tracer};
use opentelemetry_sdk::Resource;

pub use opentelemetry::trace::SpanKind as Kind;

use crate::config::TelemetryConfig;
use crate::trace::TraceContext;

struct Exporting {
    provider: SdkTracerProvider,
    tracer: Tracer,
}

static EXPORTING: OnceLock<Exporting> = OnceLock::new();

/// Starts exporting spans if an endpoint is configured: `Ok(true)` when spans go out. The
/// first host of a process sets it up; later ones share it.
pub fn init(config: &TelemetryConfig, service: &str) -> anyhow::Result<bool> {
    let Some(endpoint) = endpoint(config) else {
        return Ok(false);
    };
    if EXPORTING.get().is_some() {
        return Ok(true);
    }
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(BlockingHttp::default());
    if let Endpoint::Config(url) = &endpoint {
        exporter = exporter.with_endpoint(url.clone());
    }
    if env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").is_none() && env("OTEL_EXPORTER_OTLP_PROTOCOL").is_none() {
        // The standard default; with JSON built in too, the exporter's own is JSON.
        exporter = exporter.with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
    }
    let exporter = exporter.build().context("setting up the OTLP exporter")?;
    let mut resource =
        Resource::builder().with_attribute(KeyValue::new("service.instance.id", uuid::Uuid::new_v4().to_string()));
    if env("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service.to_string());
    }
    let provider = SdkTracerProvider::builder()
        .with_resource(resource.build())
        .with_span_processor(BatchSpanProcessor::builder(exporter).build())
        .build();
    let tracer = opentelemetry::trace::TracerProvider::tracer_with_scope(
        &provider,
        opentelemetry::InstrumentationScope::builder("obx")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build(),
    );
    let _ = EXPORTING.set(Exporting { provider, tracer });
    tracing::info!(endpoint = %endpoint, "exporting traces over OTLP");
    Ok(true)
}

/// Sends the spans not yet exported; for a host that is stopping.
pub fn flush() {
    if let Some(e) = EXPORTING.get() {
        if let Err(err) = e.provider.force_flush() {
            tracing::warn!(error = %err, "could not export the last spans");
        }
    }
}

/// Whether spans are exported at all.
pub fn enabled() -> bool {
    EXPORTING.get().is_some()
}

#[derive(Debug)]
enum Endpoint {
    /// The standard variables name it; the exporter reads them itself.
    Environment(String),
    /// `telemetry.otlp_endpoint`: the traces URL under it.
    Config(String),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Environment(u) | Endpoint::Config(u) => f.write_str(u),
        }
    }
}

fn endpoint(config: &TelemetryConfig) -> Option<Endpoint> {
    let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
    if disabled {
        return None;
    }
    if let Some(url) = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT")) {
        return Some(Endpoint::Environment(url));
    }
    config
        .otlp_endpoint
        .as_deref()
        .map(|base| Endpoint::Config(traces_url(base)))
}

/// The traces URL of a collector's base address (as `OTEL_EXPORTER_OTLP_ENDPOINT` is read).
fn traces_url(base: &str) -> String {
    let base = base.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_string()
    } else {
        format!("{base}/v1/traces")
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// A span of the host's work. It ends when dropped.
pub struct Span {
    inner: Option<opentelemetry_sdk::trace::Span>,
    context: TraceContext,
}

impl Span {
    /// A span that only the export has, with no span in the log (the HTTP request, a guest
    /// call, an outbox insert, a publish): `None` when exporting is off, and the work goes
    /// on in its parent's context. So every parent that a log line names is in the log.
    pub fn export_only(name: impl Into<Cow<'static, str>>, kind: Kind, parent: Option<&TraceContext>) -> Option<Span> {
        enabled().then(|| Span::start(name, kind, parent))
    }

    /// Starts a span under `parent` (a new trace when there is none).
    pub fn start(name: impl Into<Cow<'static, str>>, kind: Kind, parent: Option<&TraceContext>) -> Span {
        Span::start_with(name, kind, parent, None)
    }

    /// Starts a span in a new trace, linked to `cause` (the work that led to it, done
    /// earlier in a trace of its own) if there is one.
    pub fn start_linked(name: impl Into<Cow<'static, str>>, kind: Kind, cause: Option<&TraceContext>) -> Span {
        Span::start_with(name, kind, None, cause)
    }

    fn start_with(
        name: impl Into<Cow<'static, str>>,
        kind: Kind,
        parent: Option<&TraceContext>,
        cause: Option<&TraceContext>,
    ) -> Span {
        let Some(exporting) = EXPORTING.get() else {
            return Span {
                inner: None,
                context: TraceContext::child_of(parent),
            };
        };
        let cx = parent.map(remote).unwrap_or_default();
        let links = cause
            .map(|c| vec![Link::with_context(remote_span_context(c))])
            .unwrap_or_default();
        let span = exporting
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_links(links)
            .start_with_context(&exporting.tracer, &cx);
        let sc = span.span_context();
        if !sc.is_valid() {
            // The provider is shutting down: the work still needs a context to pass on.
            return Span {
                inner: None,
                context: TraceContext::child_of(parent),
            };
        }
        let context = TraceContext {
            trace_id: sc.trace_id().to_bytes(),
            span_id: sc.span_id().to_bytes(),
            sampled: sc.is_sampled(),
        };
        Span {
            inner: Some(span),
            context,
        }
    }

    /// The trace context this span's children and messages carry.
    pub fn context(&self) -> &TraceContext {
        &self.context
    }

    /// Whether the span is recorded (exporting is on and the trace is sampled): attributes
    /// that cost something to compute are worth it only then.
    pub fn recording(&self) -> bool {
        self.inner.as_ref().is_some_and(|s| s.is_recording())
    }

    pub fn set(&mut self, key: &'static str, value: impl Into<Value>) {
        if let Some(span) = self.inner.as_mut().filter(|s| s.is_recording()) {
            span.set_attribute(KeyValue::new(key, value));
        }
    }

    /// Marks the span failed, with a message for the operator.
    pub fn fail(&mut self, message: impl Into<Cow<'static, str>>) {
        if let Some(span) = self.inner.as_mut().filter(|s| s.is_recording()) {
            span.set_status(Status::error(message));
        }
    }
}

fn remote(parent: &TraceContext) -> Context {
    Context::new().with_remote_span_context(remote_span_context(parent))
}

/// `context`, as a span of another process (or of an earlier time) to link or descend from.
fn remote_span_context(context: &TraceContext) -> SpanContext {
    let flags = if context.sampled {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    SpanContext::new(
        TraceId::from_bytes(context.trace_id),
        SpanId::from_bytes(context.span_id),
        flags,
        true,
        TraceState::default(),
    )
}

/// The exporter's HTTP client: reqwest's blocking client (the batch processor exports from
/// a thread of its own), made on first use there. It honours `OTEL_EXPORTER_OTLP_TIMEOUT`
/// (and its traces variant), in milliseconds, 10 s by default.
#[derive(Debug, Default)]
struct BlockingHttp(OnceLock<Result<reqwest::blocking::Client, String>>);

/// A collector's answer is a small status message; more than this is not read.
const MAX_RESPONSE_BYTES: u64 = 4 << 20;

impl BlockingHttp {
    fn client(&self) -> Result<&reqwest::blocking::Client, opentelemetry_http::HttpError> {
        let client = self.0.get_or_init(|| {
            let timeout = env("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
                .or_else(|| env("OTEL_EXPORTER_OTLP_TIMEOUT"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_millis)
                .unwrap_or(Duration::from_secs(10));
            reqwest::blocking::Client::builder()
                .timeout(timeout)
                .build()
                .map_err(|e| e.to_string())
        });
        client.as_ref().map_err(|e| e.clone().into())
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for BlockingHttp {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        use std::io::Read as _;
        let (parts, body) = request.into_parts();
        let response = self
            .client()?
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body.to_vec())
            .send()?;
        let status = response.status();
        let headers = response.headers().clone();
        let mut body = Vec::new();
        response.take(MAX_RESPONSE_BYTES).read_to_end(&mut body)?;
        let mut answer = http::Response::builder()
            .status(status)
            .body(bytes::Bytes::from(body))?;
        *answer.headers_mut() = headers;
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_address_gets_the_traces_path_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
    }

    #[test]
    fn with_exporting_off_a_span_is_a_child_context_and_an_export_only_span_is_none() {
        let parent = TraceContext::root();
        let mut span = Span::start("x", Kind::Internal, Some(&parent));
        span.set("k", "v");
        assert!(!span.recording());
        assert_eq!(span.context().trace_id, parent.trace_id);
        assert_ne!(span.context().span_id, parent.span_id);
        assert!(Span::export_only("y", Kind::Internal, Some(&parent)).is_none());
    }
}
