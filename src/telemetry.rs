//! Logging and traces, set up once per process by [`init`]: logs as human-readable or JSON
//! lines, filtered by `RUST_LOG` (default `info` for services, `warn` for one-shot commands),
//! and, when asked, the process's spans exported over OTLP/HTTP to a collector (Jaeger, Tempo,
//! Honeycomb, the OpenTelemetry Collector).
//!
//! Export is off by default and then costs nothing: no exporter, no extra layer, and the
//! helpers below return at once. It is on with the `[telemetry]` section or the standard
//! variables (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_SERVICE_NAME`; `OTEL_SDK_DISABLED=true` turns it off
//! whatever else says). Spans go through a batch processor with a bounded queue on a thread of
//! its own, never on a request's path; [`Telemetry::shutdown`] flushes what is left.
//!
//! Trace context crosses process boundaries as a W3C `traceparent` string: a worker adopts the
//! caller's, and hands its own spans' to tool services and the backend. The helpers take and
//! give that string, and span attributes are genfleet's own [`KeyValue`], so no other layer
//! needs to know the OpenTelemetry types.

use std::borrow::Cow;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use clap::ValueEnum;
use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanKind, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, global};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

/// The instrumentation scope genfleet's spans are made under.
const SCOPE: &str = "genfleet";

/// Set once the exporter is installed: the helpers do nothing until then.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether this process exports its spans.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// The `[telemetry]` section as the process was configured; the standard `OTEL_*` variables
/// are read over it by [`init`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Traces {
    /// Export even when no `OTEL_EXPORTER_OTLP_*ENDPOINT` variable is set.
    pub enabled: bool,
    /// The collector's base URL (`/v1/traces` is added); empty: `http://localhost:4318`.
    pub endpoint: String,
    /// `http/protobuf` or `http/json`.
    pub protocol: String,
    /// The `service.name` of this process's spans.
    pub service_name: String,
    /// Spans held for export at most; past it new spans are dropped (and counted by the SDK).
    pub max_queue_size: usize,
}

/// Why the export could not be set up; each names the setting or variable at fault.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error(
        "{source_name}: {value:?} is not a protocol genfleet exports traces with (http/protobuf or http/json)"
    )]
    Protocol { source_name: String, value: String },
    #[error("telemetry.max_queue_size must be at least 1")]
    QueueSize,
    #[error("cannot set up the OTLP trace exporter: {0}")]
    Exporter(String),
}

/// What the configuration and the variables resolve to.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Export {
    /// From the `[telemetry]` section; `None` when a variable names it (the exporter reads the
    /// variables itself, as every OpenTelemetry SDK does) or nothing does (the default).
    endpoint: Option<String>,
    protocol: Protocol,
    service_name: String,
    max_queue_size: usize,
}

impl Traces {
    /// Applies the standard variables over the section: `None` when nothing asks for export.
    fn resolve(
        &self,
        var: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Export>, TelemetryError> {
        let var = |name: &str| var(name).filter(|value| !value.trim().is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let endpoint_var = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"));
        if !self.enabled && endpoint_var.is_none() {
            return Ok(None);
        }
        if self.max_queue_size == 0 {
            return Err(TelemetryError::QueueSize);
        }
        let endpoint = match endpoint_var {
            Some(_) => None,
            None if self.endpoint.trim().is_empty() => None,
            None => Some(format!(
                "{}/v1/traces",
                self.endpoint.trim().trim_end_matches('/')
            )),
        };
        let (source_name, value) = [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ]
        .into_iter()
        .find_map(|name| var(name).map(|value| (name.to_string(), value)))
        .unwrap_or_else(|| ("telemetry.protocol".to_string(), self.protocol.clone()));
        let protocol = match value.trim() {
            "http/protobuf" | "" => Protocol::HttpBinary,
            "http/json" => Protocol::HttpJson,
            _ => return Err(TelemetryError::Protocol { source_name, value }),
        };
        let service_name = var("OTEL_SERVICE_NAME").unwrap_or_else(|| self.service_name.clone());
        Ok(Some(Export {
            endpoint,
            protocol,
            service_name,
            max_queue_size: self.max_queue_size,
        }))
    }
}

/// The process's telemetry: keep it until the process ends, then [`Telemetry::shutdown`] it
/// (dropping it does the same) so that the spans still queued are sent.
#[must_use = "dropping it stops the trace export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends the spans still queued (waiting at most the exporter's timeout) and stops
    /// exporting. Call it outside any async runtime, after the process's work is done.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(provider) = self.provider.take() {
            EXPORTING.store(false, Ordering::Relaxed);
            if let Err(error) = provider.shutdown() {
                eprintln!("genfleet: the last spans could not be exported: {error}");
            }
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Installs the global subscriber at `default_level` unless `RUST_LOG` says otherwise, and the
/// OTLP exporter when `traces` or the `OTEL_*` variables ask for it. Every genfleet process
/// calls this once, first. Logs go to stderr so stdout stays for command output; colours only
/// when stderr is a terminal and `NO_COLOR` is unset, so files and log collectors get plain
/// text.
pub fn init(
    format: LogFormat,
    default_level: &str,
    traces: Option<&Traces>,
) -> Result<Telemetry, TelemetryError> {
    let export = match traces {
        Some(traces) => traces.resolve(&|name| std::env::var(name).ok())?,
        None => None,
    };
    let Some(export) = export else {
        init_logs(format, default_level);
        return Ok(Telemetry { provider: None });
    };
    let provider = provider(&export)?;
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(SCOPE))
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_filter(spans_exported());
    let installed = tracing_subscriber::registry()
        .with(log_layer(format, default_level))
        .with(otel)
        .try_init()
        .is_ok();
    if installed {
        global::set_tracer_provider(provider.clone());
        EXPORTING.store(true, Ordering::Relaxed);
    }
    Ok(Telemetry {
        provider: Some(provider),
    })
}

/// The logs alone: exactly the subscriber a process without export has always had.
fn init_logs(format: LogFormat, default_level: &str) {
    use std::io::IsTerminal;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// The logs as a layer beside the exporter, filtered on their own so that `RUST_LOG=warn`
/// quiets the logs without emptying the traces.
fn log_layer(
    format: LogFormat,
    default_level: &str,
) -> Box<dyn Layer<Registry> + Send + Sync + 'static> {
    use std::io::IsTerminal;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => layer.with_filter(filter).boxed(),
        LogFormat::Json => layer.json().flatten_event(true).with_filter(filter).boxed(),
    }
}

/// genfleet's own spans (info and above); the libraries' stay out of the traces.
fn spans_exported() -> Targets {
    Targets::new().with_target(SCOPE, tracing::Level::INFO)
}

fn provider(export: &Export) -> Result<SdkTracerProvider, TelemetryError> {
    // An https collector needs the TLS provider the rest of genfleet uses.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(export.protocol);
    if let Some(endpoint) = &export.endpoint {
        exporter = exporter.with_endpoint(endpoint.clone());
    }
    let exporter = exporter
        .build()
        .map_err(|error| TelemetryError::Exporter(error.to_string()))?;
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(export.max_queue_size)
        .build();
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch)
        .build();
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(export.service_name.clone())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource)
        .build())
}

/// Whether `traceparent` is a well-formed, valid W3C `traceparent`: the one reading of the
/// header in genfleet, used both where a span is parented and where the bus takes a caller's
/// header to hand on.
pub fn valid_traceparent(traceparent: &str) -> bool {
    parse_traceparent(traceparent).is_some()
}

/// The span context a W3C `traceparent` names, when it is well formed and valid: `-`-separated
/// fields of exactly 2, 32, 16 and 2 hex digits, as written (no space around them); version
/// `ff` refused, and `00` with nothing after its flags (a later version may add fields); trace
/// and span ids not all zeros.
fn parse_traceparent(traceparent: &str) -> Option<SpanContext> {
    use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};
    let mut parts = traceparent.split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |field: &str, len: usize| {
        field.len() == len && field.bytes().all(|byte| byte.is_ascii_hexdigit())
    };
    if !(hex(version, 2) && hex(trace, 32) && hex(span, 16) && hex(flags, 2)) || version == "ff" {
        return None;
    }
    if version == "00" && parts.next().is_some() {
        return None;
    }
    let context = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()? & 1),
        true,
        TraceState::default(),
    );
    context.is_valid().then_some(context)
}

/// The W3C `traceparent` of a span context.
fn format_traceparent(context: &SpanContext) -> Option<String> {
    context.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            context.trace_id(),
            context.span_id(),
            context.trace_flags().to_u8()
        )
    })
}

fn remote(traceparent: Option<&str>) -> Context {
    match traceparent.and_then(parse_traceparent) {
        Some(parent) => Context::new().with_remote_span_context(parent),
        None => Context::new(),
    }
}

/// The `traceparent` to hand on for `span` (a tool service or the backend makes its spans its
/// children); `None` when the process does not export.
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    if !exporting() {
        return None;
    }
    format_traceparent(span.context().span().span_context())
}

/// [`traceparent_of`] the current span.
pub fn current_traceparent() -> Option<String> {
    traceparent_of(&tracing::Span::current())
}

/// Makes `span` a child of the remote span `traceparent` names (before it is first entered).
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if !exporting() {
        return;
    }
    if let Some(parent) = traceparent.and_then(parse_traceparent) {
        let _ = span.set_parent(Context::new().with_remote_span_context(parent));
    }
}

/// An attribute of a span: a dotted name (genfleet's own, or one of OpenTelemetry's semantic
/// conventions) and its value. It is turned into the exporter's type only here, so callers
/// build attributes without naming an OpenTelemetry crate.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyValue {
    key: &'static str,
    value: AttributeValue,
}

/// What an attribute holds.
#[derive(Debug, Clone, PartialEq)]
pub enum AttributeValue {
    Bool(bool),
    I64(i64),
    F64(f64),
    String(Cow<'static, str>),
    /// A list of strings (`gen_ai.response.finish_reasons`).
    Strings(Vec<String>),
}

impl KeyValue {
    pub fn new(key: &'static str, value: impl Into<AttributeValue>) -> KeyValue {
        KeyValue {
            key,
            value: value.into(),
        }
    }

    /// The attribute as the exporter takes it.
    fn exported(self) -> opentelemetry::KeyValue {
        use opentelemetry::{Array, StringValue, Value};
        let string = |text: Cow<'static, str>| match text {
            Cow::Borrowed(text) => StringValue::from(text),
            Cow::Owned(text) => StringValue::from(text),
        };
        let value = match self.value {
            AttributeValue::Bool(value) => Value::Bool(value),
            AttributeValue::I64(value) => Value::I64(value),
            AttributeValue::F64(value) => Value::F64(value),
            AttributeValue::String(text) => Value::String(string(text)),
            AttributeValue::Strings(texts) => Value::Array(Array::String(
                texts.into_iter().map(StringValue::from).collect(),
            )),
        };
        opentelemetry::KeyValue::new(self.key, value)
    }
}

impl From<bool> for AttributeValue {
    fn from(value: bool) -> Self {
        AttributeValue::Bool(value)
    }
}

impl From<i64> for AttributeValue {
    fn from(value: i64) -> Self {
        AttributeValue::I64(value)
    }
}

impl From<f64> for AttributeValue {
    fn from(value: f64) -> Self {
        AttributeValue::F64(value)
    }
}

impl From<&'static str> for AttributeValue {
    fn from(text: &'static str) -> Self {
        AttributeValue::String(Cow::Borrowed(text))
    }
}

impl From<String> for AttributeValue {
    fn from(text: String) -> Self {
        AttributeValue::String(Cow::Owned(text))
    }
}

fn exported(attributes: Vec<KeyValue>) -> Vec<opentelemetry::KeyValue> {
    attributes.into_iter().map(KeyValue::exported).collect()
}

/// Adds attributes to `span` (genfleet's and OpenTelemetry's dotted names, which `tracing`
/// fields would print in every log line).
pub fn annotate(span: &tracing::Span, attributes: Vec<KeyValue>) {
    if !exporting() {
        return;
    }
    for attribute in exported(attributes) {
        span.set_attribute(attribute.key, attribute.value);
    }
}

/// An attribute holding a list of strings (`gen_ai.response.finish_reasons`).
pub fn string_list(key: &'static str, values: Vec<String>) -> KeyValue {
    KeyValue::new(key, AttributeValue::Strings(values))
}

/// A span whose times are known only once it is over (a wait measured from a timestamp on
/// record): exported as one piece, child of `parent`. Returns its `traceparent`.
pub fn record_interval(
    name: &'static str,
    parent: Option<&str>,
    started: SystemTime,
    ended: SystemTime,
    attributes: Vec<KeyValue>,
) -> Option<String> {
    if !exporting() {
        return None;
    }
    let tracer = global::tracer(SCOPE);
    let mut span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .with_start_time(started)
        .with_attributes(exported(attributes))
        .start_with_context(&tracer, &remote(parent));
    let traceparent = format_traceparent(span.span_context());
    span.end_with_timestamp(ended.max(started));
    traceparent
}

/// The moment `elapsed` ago, on the wall clock (spans are stamped with it).
pub fn wall_clock_ago(elapsed: Duration) -> SystemTime {
    SystemTime::now()
        .checked_sub(elapsed)
        .unwrap_or_else(SystemTime::now)
}

/// One request's span on a worker, from its acceptance to its stored result: a child of the
/// caller's span when it sent one, or the root of a trace linked to `link` (the decision a
/// continuation answers). Its end is explicit ([`RequestTrace::end`]) or when it is dropped.
pub struct RequestTrace {
    span: Mutex<Option<global::BoxedSpan>>,
    traceparent: Option<String>,
}

impl RequestTrace {
    /// No span: the process does not export.
    pub fn off() -> RequestTrace {
        RequestTrace {
            span: Mutex::new(None),
            traceparent: None,
        }
    }

    /// Starts the span (nothing when the process does not export).
    pub fn start(
        caller: Option<&str>,
        link: Option<&str>,
        started: SystemTime,
        attributes: Vec<KeyValue>,
    ) -> RequestTrace {
        if !exporting() {
            return RequestTrace::off();
        }
        let tracer = global::tracer(SCOPE);
        let links = link
            .and_then(parse_traceparent)
            .map(|context| vec![Link::with_context(context)])
            .unwrap_or_default();
        let span = tracer
            .span_builder("genfleet.request")
            .with_kind(SpanKind::Server)
            .with_start_time(started)
            .with_attributes(exported(attributes))
            .with_links(links)
            .start_with_context(&tracer, &remote(caller));
        RequestTrace {
            traceparent: format_traceparent(span.span_context()),
            span: Mutex::new(Some(span)),
        }
    }

    /// What its children (the slot, tool services, the backend) take as their parent.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    /// Ends the span with what came of the request; only the first call counts.
    pub fn end(&self, attributes: Vec<KeyValue>, error: Option<String>) {
        let Some(mut span) = self.span.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        span.set_attributes(exported(attributes));
        if let Some(error) = error {
            span.set_status(opentelemetry::trace::Status::error(error));
        }
        span.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traces(enabled: bool, endpoint: &str, protocol: &str) -> Traces {
        Traces {
            enabled,
            endpoint: endpoint.into(),
            protocol: protocol.into(),
            service_name: "genfleet-worker".into(),
            max_queue_size: 2048,
        }
    }

    fn resolve(traces: &Traces, vars: &[(&str, &str)]) -> Result<Option<Export>, TelemetryError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        traces.resolve(&move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn export_is_off_unless_asked() {
        let off = traces(false, "http://collector:4318", "http/protobuf");
        assert_eq!(resolve(&off, &[]).unwrap(), None);
        assert_eq!(
            resolve(&off, &[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")]).unwrap(),
            None
        );
        let on = traces(true, "", "http/protobuf");
        assert_eq!(
            resolve(&on, &[("OTEL_SDK_DISABLED", "TRUE")]).unwrap(),
            None,
            "OTEL_SDK_DISABLED wins"
        );
    }

    #[test]
    fn the_standard_variables_turn_it_on_and_win_over_the_section() {
        let section = traces(false, "http://from-file:4318/", "http/json");
        /// The variables set, and the endpoint, protocol and service name they give.
        type Case<'a> = (&'a [(&'a str, &'a str)], Option<&'a str>, Protocol, &'a str);
        let cases: &[Case] = &[
            (
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318")],
                None,
                Protocol::HttpJson,
                "genfleet-worker",
            ),
            (
                &[
                    (
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                        "http://env:4318/v1/traces",
                    ),
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                    ("OTEL_SERVICE_NAME", "checkout-workers"),
                ],
                None,
                Protocol::HttpBinary,
                "checkout-workers",
            ),
        ];
        for (vars, endpoint, protocol, service) in cases {
            let export = resolve(&section, vars).unwrap().expect("on");
            assert_eq!(export.endpoint.as_deref(), *endpoint, "{vars:?}");
            assert_eq!(export.protocol, *protocol, "{vars:?}");
            assert_eq!(export.service_name, *service, "{vars:?}");
        }
        let on = traces(true, "http://from-file:4318/", "");
        let export = resolve(&on, &[]).unwrap().expect("on");
        assert_eq!(
            export.endpoint.as_deref(),
            Some("http://from-file:4318/v1/traces")
        );
        assert_eq!(export.protocol, Protocol::HttpBinary, "protobuf by default");
        let default = resolve(&traces(true, "", "http/protobuf"), &[])
            .unwrap()
            .unwrap();
        assert_eq!(
            default.endpoint, None,
            "the exporter's default, localhost:4318"
        );
    }

    #[test]
    fn an_unknown_protocol_is_refused_naming_where_it_came_from() {
        let on = traces(true, "", "grpc");
        let error = resolve(&on, &[]).unwrap_err().to_string();
        assert!(
            error.contains("telemetry.protocol") && error.contains("grpc"),
            "{error}"
        );
        let error = resolve(&on, &[("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/xml")])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
            "{error}"
        );
        let mut empty = traces(true, "", "http/protobuf");
        empty.max_queue_size = 0;
        assert!(
            resolve(&empty, &[])
                .unwrap_err()
                .to_string()
                .contains("max_queue_size")
        );
    }

    #[test]
    fn traceparents_are_read_strictly_and_written_back_alike() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = parse_traceparent(good).expect("valid");
        assert_eq!(format_traceparent(&context).as_deref(), Some(good));
        for also_good in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later-fields",
        ] {
            assert!(valid_traceparent(also_good), "{also_good:?} refused");
        }
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-xyz92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-+1",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-701",
        ] {
            assert!(!valid_traceparent(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn attributes_reach_the_exporter_as_opentelemetry_builds_them() {
        use opentelemetry::{Array, StringValue, Value};
        let owned = String::from("req-1");
        let cases = [
            (
                KeyValue::new("genfleet.state", "completed"),
                opentelemetry::KeyValue::new("genfleet.state", "completed"),
            ),
            (
                KeyValue::new("genfleet.request_id", owned.clone()),
                opentelemetry::KeyValue::new("genfleet.request_id", owned),
            ),
            (
                KeyValue::new("genfleet.attempt", 2i64),
                opentelemetry::KeyValue::new("genfleet.attempt", 2i64),
            ),
            (
                KeyValue::new("genfleet.time_to_first_token_ms", 1.5),
                opentelemetry::KeyValue::new("genfleet.time_to_first_token_ms", 1.5),
            ),
            (
                KeyValue::new("genfleet.durable", true),
                opentelemetry::KeyValue::new("genfleet.durable", true),
            ),
            (
                string_list("gen_ai.response.finish_reasons", vec!["stop".into()]),
                opentelemetry::KeyValue::new(
                    "gen_ai.response.finish_reasons",
                    Value::Array(Array::String(vec![StringValue::from("stop")])),
                ),
            ),
        ];
        for (ours, theirs) in cases {
            assert_eq!(ours.exported(), theirs);
        }
    }
}
