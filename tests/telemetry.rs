//! Traces exported over OTLP/HTTP: a worker process and a tool service process (`genfleet
//! tool-demo`) export to a collector this test runs (an axum server that decodes what it gets
//! as OTLP protobuf, the default protocol, or OTLP JSON). One request through a tool call and a decision is
//! one trace: the request's span, its wait for a slot, the slot, each model turn, the tool call
//! with the tool service's span under it, and the decision's wait; the continuation is a trace
//! of its own, linked to the decision.

mod common;

use std::collections::HashMap;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use common::fleet::{self, Fleet};
use common::wait;
use genfleet::protocol::{GenerationRequest, Reason};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use serde_json::json;

/// Calls the calculator, then asks for a decision, then (in the continuation) answers.
const SCRIPT: &str = r#"
[[rules]]
when_last_user_contains = "Decision chosen"
reply = "Going the fast way."
[[rules]]
when_last_role = "tool"
reply = "Two ways to go."
tool_calls = [{ name = "request_decision", arguments = { question = "Which path?", options = [{ id = "fast", label = "Fast" }, { id = "safe", label = "Safe" }] } }]
[[rules]]
reply = "Let me compute."
tool_calls = [{ name = "calculate", arguments = { operation = "mul", a = 17, b = 23 } }]
"#;

/// How long the spans may take to arrive (batches go out every 200 ms here; a busy machine is
/// slow).
const SPANS_WITHIN: Duration = Duration::from_secs(60);

/// One span as the collector got it.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    /// How it came: `http/protobuf` or `http/json`.
    protocol: &'static str,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    attributes: HashMap<String, String>,
    /// (trace id, span id) of each link.
    links: Vec<(String, String)>,
}

impl Span {
    fn attr(&self, key: &str) -> &str {
        self.attributes
            .get(key)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("{} has no attribute {key}: {self:#?}", self.name))
    }
}

type Received = Arc<Mutex<Vec<Span>>>;

/// An OTLP/HTTP trace receiver on a free port: its base URL and what it got.
async fn collector() -> (String, Received) {
    let received: Received = Arc::default();
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (base, received)
}

async fn receive(
    State(received): State<Received>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> impl axum::response::IntoResponse {
    let json = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let spans = if json {
        from_json(&serde_json::from_slice(&body).expect("an OTLP JSON export"))
    } else {
        from_protobuf(ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export"))
    };
    received.lock().unwrap().extend(spans);
    let content_type = if json {
        "application/json"
    } else {
        "application/x-protobuf"
    };
    let answer = if json { b"{}".to_vec() } else { Vec::new() };
    ([("content-type", content_type)], answer)
}

fn from_protobuf(request: ExportTraceServiceRequest) -> Vec<Span> {
    let mut spans = Vec::new();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(kv.value.as_ref().and_then(|v| v.value.as_ref())))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                spans.push(Span {
                    service: service.clone(),
                    protocol: "http/protobuf",
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent: hex(&span.parent_span_id),
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| {
                            let value = text(kv.value.as_ref().and_then(|v| v.value.as_ref()));
                            (kv.key.clone(), value)
                        })
                        .collect(),
                    links: span
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                });
            }
        }
    }
    spans
}

/// The same from OTLP/JSON (ids as hex strings, values as `{"stringValue": ...}` and such).
fn from_json(request: &serde_json::Value) -> Vec<Span> {
    let list = |v: &serde_json::Value, key: &str| v[key].as_array().cloned().unwrap_or_default();
    let attributes = |v: &serde_json::Value| -> HashMap<String, String> {
        list(v, "attributes")
            .iter()
            .map(|kv| {
                (
                    kv["key"].as_str().unwrap().to_string(),
                    json_text(&kv["value"]),
                )
            })
            .collect()
    };
    let id = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_lowercase();
    let mut spans = Vec::new();
    for resource in list(request, "resourceSpans") {
        let service = attributes(&resource["resource"])
            .remove("service.name")
            .unwrap_or_default();
        for scope in list(&resource, "scopeSpans") {
            for span in list(&scope, "spans") {
                spans.push(Span {
                    service: service.clone(),
                    protocol: "http/json",
                    name: span["name"].as_str().unwrap().to_string(),
                    trace_id: id(&span["traceId"]),
                    span_id: id(&span["spanId"]),
                    parent: id(&span["parentSpanId"]),
                    attributes: attributes(&span),
                    links: list(&span, "links")
                        .iter()
                        .map(|l| (id(&l["traceId"]), id(&l["spanId"])))
                        .collect(),
                });
            }
        }
    }
    spans
}

fn json_text(value: &serde_json::Value) -> String {
    let Some((kind, inner)) = value.as_object().and_then(|o| o.iter().next()) else {
        return String::new();
    };
    match (kind.as_str(), inner) {
        ("arrayValue", list) => list["values"]
            .as_array()
            .into_iter()
            .flatten()
            .map(json_text)
            .collect::<Vec<_>>()
            .join(","),
        (_, serde_json::Value::String(s)) => s.clone(),
        (_, other) => other.to_string(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An attribute's value as text (lists as their items joined by commas).
fn text(value: Option<&AnyValue>) -> String {
    match value {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::ArrayValue(list)) => list
            .values
            .iter()
            .map(|v| text(v.value.as_ref()))
            .collect::<Vec<_>>()
            .join(","),
        _ => String::new(),
    }
}

/// `genfleet tool-demo` exporting its spans; killed on drop.
struct ToolDemo(Child);

impl Drop for ToolDemo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until `found` finds what it looks for among the spans received.
async fn spans_where<T>(
    received: &Received,
    what: &str,
    found: impl Fn(&[Span]) -> Option<T>,
) -> T {
    wait::until(what, SPANS_WITHIN, || async {
        let spans = received.lock().unwrap();
        found(&spans).ok_or_else(|| format!("the collector got {:#?}", *spans))
    })
    .await
}

fn request_span<'a>(spans: &'a [Span], request_id: &str, reason: &str) -> Option<&'a Span> {
    spans.iter().find(|s| {
        s.name == "genfleet.request"
            && s.attributes.get("genfleet.request_id").map(String::as_str) == Some(request_id)
            && s.attributes.get("genfleet.reason").map(String::as_str) == Some(reason)
    })
}

fn children<'a>(spans: &'a [Span], parent: &Span, name: &str) -> Vec<&'a Span> {
    spans
        .iter()
        .filter(|s| s.parent == parent.span_id && s.trace_id == parent.trace_id && s.name == name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_through_a_tool_and_a_decision_is_one_trace_and_its_continuation_a_linked_one() {
    let (endpoint, received) = collector().await;
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.clone()),
        ("OTEL_BSP_SCHEDULE_DELAY", "200".to_string()),
    ];
    let mut builder = Fleet::builder()
        .script(SCRIPT)
        .default_settings()
        .worker_processes(["w-traced"]);
    for (key, value) in &otel {
        builder = builder.worker_env(key, value);
    }
    let f = builder.start().await;
    let _tools = ToolDemo(
        common::process::genfleet_command()
            .arg("tool-demo")
            .env("GENFLEET__NATS__URL", f.nats.url())
            .envs(otel.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("genfleet tool-demo starts"),
    );

    let request: GenerationRequest = serde_json::from_value(json!({
        "request_id": "traced-1",
        "messages": [{"role": "user", "content": "What is 17 times 23?"}],
        "tools": ["calculate"],
    }))
    .unwrap();
    let first = fleet::run_when_tools_known(&f.client, &request, Duration::from_secs(30)).await;
    assert_eq!(first.reason, Reason::DecisionRequested, "{first:?}");
    let decision_id = first
        .signals
        .iter()
        .find_map(|s| s.decision.as_ref())
        .expect("the result carries the decision")
        .decision_id
        .clone();
    let reply = f
        .client
        .nats()
        .request(
            format!("decisions.{decision_id}"),
            serde_json::to_vec(&json!({"option_id": "fast", "decided_by": "human:test"}))
                .unwrap()
                .into(),
        )
        .await
        .unwrap();
    let reply: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    let continuation_id = reply["continuation_request_id"]
        .as_str()
        .unwrap_or_else(|| panic!("a continuation: {reply}"))
        .to_string();
    let next = fleet::wait_result(
        &f.client,
        &continuation_id,
        Duration::from_secs(30),
        fleet::RUNNING_OR_UNCLAIMED,
    )
    .await;
    assert_eq!(next.reason, Reason::Stop, "{next:?}");

    // The first request's trace: everything arrives.
    let spans = spans_where(&received, "the first request's trace", |spans| {
        let root = request_span(spans, "traced-1", "decision_requested")?;
        let in_trace = |name: &str| {
            spans
                .iter()
                .any(|s| s.trace_id == root.trace_id && s.name == name)
        };
        let all = [
            "genfleet.queue_wait",
            "slot",
            "chat default",
            "execute_tool calculate",
            "tool calculate",
            "genfleet.decision_wait",
        ]
        .iter()
        .all(|name| in_trace(name));
        let continued = request_span(spans, &continuation_id, "stop").is_some();
        (all && continued).then(|| spans.to_vec())
    })
    .await;
    let root = request_span(&spans, "traced-1", "decision_requested").unwrap();
    assert_eq!(
        root.parent, "",
        "the caller sent no trace context: a root span"
    );
    assert_eq!(root.service, "genfleet-worker");
    assert_eq!(root.protocol, "http/protobuf", "the default protocol");
    assert_eq!(root.attr("genfleet.pool"), "default");
    assert_eq!(root.attr("genfleet.worker_id"), "w-traced");
    assert_eq!(
        root.attr("gen_ai.usage.input_tokens"),
        first.usage.prompt_tokens.to_string()
    );
    assert_eq!(
        root.attr("gen_ai.usage.output_tokens"),
        first.usage.completion_tokens.to_string()
    );

    // Under the request: its wait for a slot, the slot, and the decision's wait.
    let waits = children(&spans, root, "genfleet.queue_wait");
    assert_eq!(waits.len(), 1, "{spans:#?}");
    assert_eq!(waits[0].attr("genfleet.request_id"), "traced-1");
    let slots = children(&spans, root, "slot");
    assert_eq!(slots.len(), 1, "{spans:#?}");
    let slot = slots[0];
    assert_eq!(slot.attr("genfleet.worker_id"), "w-traced");
    let decision_waits = children(&spans, root, "genfleet.decision_wait");
    assert_eq!(decision_waits.len(), 1, "{spans:#?}");
    let decision_wait = decision_waits[0];
    assert_eq!(decision_wait.attr("genfleet.decision_id"), decision_id);
    assert_eq!(decision_wait.attr("genfleet.decision.option_id"), "fast");
    assert_eq!(
        decision_wait.attr("genfleet.decision.decided_by"),
        "human:test"
    );
    assert_eq!(
        decision_wait.attr("genfleet.continuation_request_id"),
        continuation_id
    );

    // In the slot: two model turns (the tool call, then the decision) and the tool call.
    let turns = children(&spans, slot, "chat default");
    assert_eq!(turns.len(), 2, "{spans:#?}");
    for turn in &turns {
        assert_eq!(turn.attr("gen_ai.operation.name"), "chat");
        assert_eq!(turn.attr("gen_ai.request.model"), "default");
        assert_eq!(turn.attr("gen_ai.response.finish_reasons"), "tool_calls");
        turn.attr("genfleet.time_to_first_token_ms");
        turn.attr("gen_ai.usage.input_tokens");
        turn.attr("gen_ai.usage.output_tokens");
    }
    let turn_tokens: u64 = turns
        .iter()
        .map(|t| t.attr("gen_ai.usage.output_tokens").parse::<u64>().unwrap())
        .sum();
    assert_eq!(turn_tokens, first.usage.completion_tokens);
    let calls = children(&spans, slot, "execute_tool calculate");
    assert_eq!(calls.len(), 1, "{spans:#?}");
    let call = calls[0];
    assert_eq!(call.attr("gen_ai.tool.name"), "calculate");
    // The tool service, another process, made its span a child of the call's.
    let served = children(&spans, call, "tool calculate");
    assert_eq!(served.len(), 1, "{spans:#?}");
    assert_eq!(served[0].service, "genfleet-tool-demo");
    assert_eq!(served[0].attr("genfleet.request_id"), "traced-1");
    assert_eq!(served[0].attr("gen_ai.tool.name"), "calculate");

    // The continuation: a trace of its own, linked to the decision's wait.
    let continued = request_span(&spans, &continuation_id, "stop").unwrap();
    assert_ne!(continued.trace_id, root.trace_id);
    assert_eq!(continued.parent, "");
    assert_eq!(
        continued.links,
        vec![(
            decision_wait.trace_id.clone(),
            decision_wait.span_id.clone()
        )]
    );
    assert_eq!(continued.attr("genfleet.chain_position"), "2");
    let slots = children(&spans, continued, "slot");
    assert_eq!(slots.len(), 1, "{spans:#?}");
    let turns = children(&spans, slots[0], "chat default");
    assert_eq!(turns.len(), 1, "{spans:#?}");
    assert_eq!(turns[0].attr("gen_ai.response.finish_reasons"), "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn genfleet_submit_starts_the_trace_and_the_workers_span_joins_it() {
    let (endpoint, received) = collector().await;
    let f = Fleet::builder()
        .default_settings()
        .worker_processes(["w-joined"])
        .worker_env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .worker_env("OTEL_BSP_SCHEDULE_DELAY", 200)
        .start()
        .await;
    let submitted = common::process::genfleet_command()
        .args(["submit", "--follow", "--json", "Say hello."])
        .env("GENFLEET__NATS__URL", f.nats.url())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("OTEL_SERVICE_NAME", "checkout")
        .stdin(Stdio::null())
        .output()
        .expect("genfleet submit runs");
    assert!(
        submitted.status.success(),
        "{}",
        String::from_utf8_lossy(&submitted.stderr)
    );
    let (submit, request) = spans_where(&received, "the submit and the request", |spans| {
        let submit = spans.iter().find(|s| s.name == "genfleet.submit")?;
        let request = spans.iter().find(|s| s.name == "genfleet.request")?;
        Some((submit.clone(), request.clone()))
    })
    .await;
    assert_eq!(submit.service, "checkout", "OTEL_SERVICE_NAME names it");
    assert_eq!(submit.parent, "");
    assert_eq!(request.service, "genfleet-worker");
    assert_eq!(
        (request.trace_id.as_str(), request.parent.as_str()),
        (submit.trace_id.as_str(), submit.span_id.as_str()),
        "the worker's span is a child of the caller's"
    );
    assert_eq!(request.attr("genfleet.worker_id"), "w-joined");
    assert_eq!(request.attr("genfleet.reason"), "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_that_expires_unanswered_ends_its_wait_in_the_trace_sent_as_otlp_json() {
    let (endpoint, received) = collector().await;
    let f = Fleet::builder()
        .default_settings()
        .worker_processes(["w-expiring"])
        .worker_env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .worker_env("OTEL_BSP_SCHEDULE_DELAY", 200)
        .worker_env("GENFLEET__DECISIONS__TTL_MS", 500)
        .worker_env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        .start()
        .await;
    let guarded: GenerationRequest = serde_json::from_value(json!({
        "request_id": "guarded-1",
        "messages": [{"role": "user", "content": "Deploy to production."}],
        "checkpoints": [{"name": "prod", "prompt_contains": ["production"], "message": "Deploy to production?"}]
    }))
    .unwrap();
    let asked = f
        .client
        .run("default", guarded, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(asked.reason, Reason::DecisionRequested, "{asked:?}");
    let (root, wait) = spans_where(&received, "the expired decision's wait", |spans| {
        let root = request_span(spans, "guarded-1", "decision_requested")?;
        let wait = children(spans, root, "genfleet.decision_wait")
            .first()
            .map(|s| (*s).clone())?;
        Some((root.clone(), wait))
    })
    .await;
    assert_eq!(
        wait.protocol, "http/json",
        "OTEL_EXPORTER_OTLP_PROTOCOL is honoured"
    );
    assert_eq!(wait.attr("genfleet.decision.outcome"), "expired");
    assert_eq!(wait.attr("genfleet.request_id"), "guarded-1");
    assert!(
        !wait
            .attributes
            .contains_key("genfleet.continuation_request_id")
    );
    assert_eq!(root.attr("genfleet.worker_id"), "w-expiring");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_through_the_gateway_is_one_trace_under_the_callers_span() {
    let (endpoint, received) = collector().await;
    let f = Fleet::builder()
        .default_settings()
        .worker_processes(["w-gateway"])
        .worker_env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .worker_env("OTEL_BSP_SCHEDULE_DELAY", 200)
        .start()
        .await;
    let port = common::nats::free_port();
    let env: Vec<(String, String)> = vec![
        ("GENFLEET__NATS__URL".into(), f.nats.url()),
        (
            "GENFLEET__GATEWAY__LISTEN".into(),
            format!("127.0.0.1:{port}"),
        ),
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint.clone()),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into()),
    ];
    let gateway = tokio::task::spawn_blocking(move || {
        let mut gateway = common::process::Running::start("gateway", &["gateway"], &env);
        gateway.wait_for("gateway listening on");
        gateway
    })
    .await
    .unwrap();
    // The caller's own span, as an instrumented HTTP client sends it.
    let (caller_trace, caller_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let response = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .header("traceparent", format!("00-{caller_trace}-{caller_span}-01"))
        .json(&serde_json::json!({
            "model": "default",
            "messages": [{"role": "user", "content": "Say hello."}],
            "genfleet": {"request_id": "gw-traced"}
        }))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(response.status(), 200);
    let (completion, request) = spans_where(&received, "the completion and the request", |spans| {
        let completion = spans
            .iter()
            .find(|s| s.name == "POST /v1/chat/completions")?;
        let request = spans.iter().find(|s| {
            s.name == "genfleet.request" && s.attr("genfleet.request_id") == "gw-traced"
        })?;
        Some((completion.clone(), request.clone()))
    })
    .await;
    assert_eq!(completion.service, "genfleet-gateway");
    assert_eq!(
        (completion.trace_id.as_str(), completion.parent.as_str()),
        (caller_trace, caller_span),
        "the gateway's span is a child of the caller's"
    );
    assert_eq!(completion.attr("genfleet.request_id"), "gw-traced");
    assert_eq!(completion.attr("genfleet.pool"), "default");
    assert_eq!(
        (request.trace_id.as_str(), request.parent.as_str()),
        (caller_trace, completion.span_id.as_str()),
        "the worker's span is a child of the gateway's"
    );
    assert_eq!(request.attr("genfleet.worker_id"), "w-gateway");
    drop(gateway);
}
