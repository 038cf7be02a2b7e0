//! Every field of a generation request, wrong in the ways callers get it wrong (wrong types,
//! out-of-range numbers, huge strings, deep nesting, oversize metadata, control characters,
//! invalid UTF-8, trailing bytes), in JSON and in MessagePack, on a real worker process.
//!
//! On `gen.submit.<pool>` each gets an error reply with the expected code and a message naming
//! what is wrong; on the durable queue each ends as a stored FAILED `invalid_request` result
//! with the same message. Afterwards the worker process is still running, serves a request,
//! and has every slot free.

mod common;

use std::time::Duration;

use common::fleet::{self, Fleet};
use genfleet::protocol::{
    Encoding, ErrorCode, ErrorReply, GenerationRequest, Reason, RequestState,
};
use serde_json::{Value, json};

/// The worker's `limits.max_request_bytes` in this test.
const MAX_REQUEST_BYTES: usize = 64 * 1024;

enum Body {
    /// A request given as JSON, sent in both encodings.
    Value(Value),
    /// Bytes for one encoding only (what the other cannot express).
    Raw(Encoding, Vec<u8>),
}

enum Expect {
    /// Refused with this code; the message holds the text (per encoding where the decoders
    /// word it differently).
    Refused(ErrorCode, &'static str, &'static str),
    /// Accepted and run to completion.
    Accepted,
}

struct Case {
    name: &'static str,
    body: Body,
    expect: Expect,
    /// The durable queue needs the body's request_id to equal the subject's, so cases about
    /// request_id itself (and bodies that are not a map) go to submit only.
    queue: bool,
}

fn user() -> Value {
    json!([{"role": "user", "content": "x"}])
}

/// A valid request with `field` set to `value` (or the messages replaced).
fn with(field: &str, value: Value) -> Value {
    let mut body = json!({"messages": user()});
    body[field] = value;
    body
}

fn nested(depth: usize) -> Value {
    let mut value = json!(1);
    for _ in 0..depth {
        value = json!([value]);
    }
    value
}

fn refused(name: &'static str, body: Value, needle: &'static str) -> Case {
    Case {
        name,
        body: Body::Value(body),
        expect: Expect::Refused(ErrorCode::InvalidRequest, needle, needle),
        queue: true,
    }
}

fn refused_as(
    name: &'static str,
    body: Value,
    code: ErrorCode,
    json_needle: &'static str,
    msgpack_needle: &'static str,
) -> Case {
    Case {
        name,
        body: Body::Value(body),
        expect: Expect::Refused(code, json_needle, msgpack_needle),
        queue: true,
    }
}

fn accepted(name: &'static str, body: Value) -> Case {
    Case {
        name,
        body: Body::Value(body),
        expect: Expect::Accepted,
        queue: true,
    }
}

fn raw(name: &'static str, encoding: Encoding, bytes: Vec<u8>, needle: &'static str) -> Case {
    Case {
        name,
        body: Body::Raw(encoding, bytes),
        expect: Expect::Refused(ErrorCode::InvalidRequest, needle, needle),
        queue: false,
    }
}

fn submit_only(mut case: Case) -> Case {
    case.queue = false;
    case
}

/// MessagePack of `{"messages": [{"role": "user", "content": <str of raw bytes>}]}`.
fn msgpack_with_content_bytes(content: &[u8]) -> Vec<u8> {
    let mut out = vec![0x81, 0xa8];
    out.extend_from_slice(b"messages");
    out.extend_from_slice(&[0x91, 0x82, 0xa4]);
    out.extend_from_slice(b"role");
    out.extend_from_slice(&[0xa4]);
    out.extend_from_slice(b"user");
    out.extend_from_slice(&[0xa7]);
    out.extend_from_slice(b"content");
    out.push(0xa0 | u8::try_from(content.len()).unwrap());
    out.extend_from_slice(content);
    out
}

fn cases() -> Vec<Case> {
    let long = |n: usize| "x".repeat(n);
    let mut cases = vec![
        // The body as a whole.
        refused(
            "unknown top-level field",
            with("bogus", json!(1)),
            "unknown field `bogus`",
        ),
        submit_only(refused("an array for the body", json!([1]), "invalid type")),
        submit_only(refused("a number for the body", json!(5), "invalid type")),
        refused(
            "messages missing",
            json!({"job_name": "j"}),
            "missing field `messages`",
        ),
        refused_as(
            "nested past the decoders' limit",
            with("metadata", json!({"k": nested(200)})),
            ErrorCode::InvalidRequest,
            "recursion limit exceeded",
            "depth limit exceeded",
        ),
        // On the queue too: a server allowing larger messages must not let it in that way.
        Case {
            name: "larger than limits.max_request_bytes",
            body: Body::Value(with("system", json!(long(MAX_REQUEST_BYTES)))),
            expect: Expect::Refused(ErrorCode::PayloadTooLarge, "at most 65536", "at most 65536"),
            queue: true,
        },
        raw(
            "empty JSON body",
            Encoding::Json,
            Vec::new(),
            "EOF while parsing",
        ),
        raw(
            "empty MessagePack body",
            Encoding::MsgPack,
            Vec::new(),
            "invalid MessagePack request",
        ),
        raw(
            "JSON after the JSON",
            Encoding::Json,
            br#"{"messages": [{"role": "user", "content": "x"}]} {}"#.to_vec(),
            "trailing characters",
        ),
        raw(
            "bytes after the MessagePack",
            Encoding::MsgPack,
            [
                Encoding::MsgPack.encode(&json!({"messages": user()})),
                vec![0xc0],
            ]
            .concat(),
            "1 bytes after the end",
        ),
        raw(
            "invalid UTF-8 in a JSON string",
            Encoding::Json,
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            "messages[0]",
        ),
        raw(
            "invalid UTF-8 in a MessagePack string",
            Encoding::MsgPack,
            msgpack_with_content_bytes(b"ok \xff\xfe"),
            "messages[0]",
        ),
        raw(
            "a MessagePack map with an integer key",
            Encoding::MsgPack,
            vec![0x81, 0x01, 0x02],
            "invalid MessagePack request",
        ),
        raw(
            "a truncated MessagePack request",
            Encoding::MsgPack,
            Encoding::MsgPack.encode(&json!({"messages": user()}))[..12].to_vec(),
            "invalid MessagePack request",
        ),
        // request_id
        submit_only(refused(
            "request_id a number",
            with("request_id", json!(5)),
            "request_id: invalid type: integer",
        )),
        submit_only(refused(
            "request_id with a space",
            with("request_id", json!("a b")),
            "request_id must be 1-128 characters",
        )),
        submit_only(refused(
            "request_id empty",
            with("request_id", json!("")),
            "request_id must be 1-128 characters",
        )),
        submit_only(refused(
            "request_id too long",
            with("request_id", json!(long(129))),
            "request_id must be 1-128 characters",
        )),
        submit_only(refused(
            "request_id with a control character",
            with("request_id", json!("a\u{0}b")),
            "request_id must be 1-128 characters",
        )),
        // job_name
        refused(
            "job_name an array",
            with("job_name", json!(["j"])),
            "job_name: invalid type: sequence",
        ),
        refused(
            "job_name too long",
            with("job_name", json!(long(257))),
            "job_name must be at most 256 bytes",
        ),
        refused(
            "job_name with a newline",
            with("job_name", json!("a\nb")),
            "without control characters",
        ),
        refused(
            "job_name with an escape",
            with("job_name", json!("a\u{1b}[31mb")),
            "without control characters",
        ),
        // system
        refused(
            "system a number",
            with("system", json!(7)),
            "system: invalid type: integer",
        ),
        accepted(
            "system with control characters",
            with("system", json!("tab\there\u{0}nul\u{7}bell")),
        ),
        accepted("system of 60 KiB", with("system", json!(long(60 * 1024)))),
        // messages
        refused(
            "messages a string",
            with("messages", json!("hi")),
            "messages: invalid type: string",
        ),
        refused(
            "messages empty",
            with("messages", json!([])),
            "messages must hold at least one message",
        ),
        refused(
            "a message that is a number",
            with("messages", json!([5])),
            "messages[0]: invalid type: integer",
        ),
        refused(
            "an unknown role",
            with("messages", json!([{"role": "robot", "content": "x"}])),
            "messages[0].role: unknown variant `robot`",
        ),
        refused(
            "a message without role",
            with("messages", json!([{"content": "x"}])),
            "messages[0]: missing field `role`",
        ),
        refused(
            "a user message without content",
            with("messages", json!([{"role": "user"}])),
            "messages[0]: a user message needs content",
        ),
        refused(
            "content a number",
            with("messages", json!([{"role": "user", "content": 5}])),
            "messages[0].content: data did not match any variant",
        ),
        refused(
            "an unknown message field",
            with(
                "messages",
                json!([{"role": "user", "content": "x", "extra": 1}]),
            ),
            "messages[0].extra: unknown field `extra`",
        ),
        refused(
            "a tool message without tool_call_id",
            with(
                "messages",
                json!([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]),
            ),
            "messages[1]: a tool message needs tool_call_id",
        ),
        refused(
            "tool_calls on a user message",
            with(
                "messages",
                json!([{"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]),
            ),
            "messages[0]: only assistant messages carry tool_calls",
        ),
        refused(
            "an empty assistant message",
            with(
                "messages",
                json!([{"role": "user", "content": "x"}, {"role": "assistant"}]),
            ),
            "messages[1]: an assistant message needs content or tool_calls",
        ),
        refused(
            "tool call arguments an object",
            with(
                "messages",
                json!([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]),
            ),
            "messages[1].tool_calls[0].function.arguments: invalid type: map",
        ),
        refused(
            "content parts nested too deep",
            with(
                "messages",
                json!([{"role": "user", "content": [nested(65)]}]),
            ),
            "messages[0].content[0] is nested 65 levels deep",
        ),
        accepted(
            "content with control characters",
            with(
                "messages",
                json!([{"role": "user", "content": "a\u{0}b\u{7}c\u{1b}[0m\r\n"}]),
            ),
        ),
        accepted(
            "content of unknown part types",
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "mystery", "x": {"y": [1]}}]}]),
            ),
        ),
        // tools
        refused(
            "tools a string",
            with("tools", json!("add")),
            "tools: invalid type: string",
        ),
        refused(
            "a tool name with a space",
            with("tools", json!(["bad name"])),
            "is not a tool name",
        ),
        refused(
            "a tool name too long",
            with("tools", json!([long(65)])),
            "is not a tool name",
        ),
        refused(
            "a tool listed twice",
            with("tools", json!(["t", "t"])),
            "\"t\" is listed twice",
        ),
        refused(
            "a tool no service offers",
            with("tools", json!(["nope"])),
            "nope",
        ),
        // tool_iterations
        refused(
            "tool_iterations negative",
            with("tool_iterations", json!(-1)),
            "tool_iterations: invalid value: integer `-1`",
        ),
        refused(
            "tool_iterations a string",
            with("tool_iterations", json!("3")),
            "tool_iterations: invalid type: string",
        ),
        refused(
            "tool_iterations a fraction",
            with("tool_iterations", json!(1.5)),
            "tool_iterations: invalid type: floating point",
        ),
        refused(
            "tool_iterations over the bound",
            with("tool_iterations", json!(33)),
            "tool_iterations must be at most 32",
        ),
        // max_tokens
        refused(
            "max_tokens zero",
            with("max_tokens", json!(0)),
            "max_tokens must be at least 1",
        ),
        refused(
            "max_tokens past u32",
            with("max_tokens", json!(4_294_967_296u64)),
            "max_tokens: invalid value",
        ),
        // temperature
        refused(
            "temperature above 2",
            with("temperature", json!(2.5)),
            "temperature must be between 0 and 2",
        ),
        refused(
            "temperature negative",
            with("temperature", json!(-0.1)),
            "temperature must be between 0 and 2",
        ),
        refused(
            "temperature a string",
            with("temperature", json!("warm")),
            "temperature: invalid type: string",
        ),
        // model
        refused(
            "model empty",
            with("model", json!("")),
            "model must be 1-256 bytes",
        ),
        refused(
            "model too long",
            with("model", json!(long(257))),
            "model must be 1-256 bytes",
        ),
        refused(
            "model a number",
            with("model", json!(5)),
            "model: invalid type: integer",
        ),
        // options
        refused(
            "options an array",
            with("options", json!([])),
            "options: invalid type: sequence",
        ),
        refused(
            "options setting the model",
            with("options", json!({"model": "x"})),
            "options may not set model",
        ),
        refused(
            "options setting stream and tools",
            with("options", json!({"stream": true, "tools": []})),
            "options may not set tools, stream",
        ),
        refused(
            "options nested too deep",
            with("options", json!({"logit_bias": nested(64)})),
            "options is nested 65 levels deep",
        ),
        // deadline_ms
        refused(
            "deadline_ms zero",
            with("deadline_ms", json!(0)),
            "deadline_ms must be at least 1",
        ),
        refused(
            "deadline_ms negative",
            with("deadline_ms", json!(-5)),
            "deadline_ms: invalid value: integer `-5`",
        ),
        refused(
            "deadline_ms a string",
            with("deadline_ms", json!("soon")),
            "deadline_ms: invalid type: string",
        ),
        // stop_on_decision_request
        refused(
            "stop_on_decision_request a string",
            with("stop_on_decision_request", json!("yes")),
            "stop_on_decision_request: invalid type: string",
        ),
        refused(
            "stop_on_decision_request a number",
            with("stop_on_decision_request", json!(1)),
            "stop_on_decision_request: invalid type: integer",
        ),
        // metadata
        refused(
            "metadata a string",
            with("metadata", json!("x")),
            "metadata: invalid type: string",
        ),
        refused(
            "metadata over 4 KiB",
            with("metadata", json!({"k": long(5000)})),
            "metadata is 5008 bytes as JSON; at most 4096",
        ),
        refused(
            "metadata nested too deep",
            with("metadata", json!({"k": nested(64)})),
            "metadata is nested 65 levels deep",
        ),
        accepted(
            "metadata with control characters",
            with("metadata", json!({"k\u{1}": "v\u{0}"})),
        ),
        // validation
        refused(
            "validation an object",
            with("validation", json!({})),
            "validation: invalid type: map",
        ),
        refused(
            "an unknown check kind",
            with("validation", json!([{"kind": "nope"}])),
            "validation[0].kind: unknown variant `nope`",
        ),
        refused(
            "a check with an unknown field",
            with(
                "validation",
                json!([{"kind": "contains", "text": "x", "extra": 1}]),
            ),
            "unknown field `extra`",
        ),
        refused(
            "a regex that does not compile",
            with("validation", json!([{"kind": "regex", "pattern": "("}])),
            "validation[0].pattern",
        ),
        refused(
            "a regex too large to compile",
            with(
                "validation",
                json!([{"kind": "regex", "pattern": "a{1000}{1000}"}]),
            ),
            "validation[0].pattern",
        ),
        refused(
            "a negative weight",
            with(
                "validation",
                json!([{"kind": "contains", "text": "x", "weight": -1}]),
            ),
            "validation[0].weight must be a positive number",
        ),
        refused(
            "contains of nothing",
            with("validation", json!([{"kind": "contains", "text": ""}])),
            "validation[0].text must not be empty",
        ),
        refused(
            "max_chars zero",
            with("validation", json!([{"kind": "max_chars", "max": 0}])),
            "validation[0].max must be at least 1",
        ),
        refused(
            "a schema that is not one",
            with(
                "validation",
                json!([{"kind": "json_schema", "schema": {"type": 5}}]),
            ),
            "validation[0].schema",
        ),
        refused(
            "a schema nested too deep",
            with(
                "validation",
                json!([{"kind": "json_schema", "schema": {"enum": [nested(64)]}}]),
            ),
            "validation[0].schema is nested",
        ),
        // escalation_threshold
        refused(
            "escalation_threshold above 1",
            with("escalation_threshold", json!(1.5)),
            "escalation_threshold must be between 0 and 1",
        ),
        refused(
            "escalation_threshold a string",
            with("escalation_threshold", json!("high")),
            "escalation_threshold: invalid type: string",
        ),
        // checkpoints
        refused(
            "checkpoints an object",
            with("checkpoints", json!({})),
            "checkpoints: invalid type: map",
        ),
        refused(
            "a checkpoint without name",
            with("checkpoints", json!([{}])),
            "checkpoints[0]: missing field `name`",
        ),
        refused(
            "a checkpoint name with a space",
            with("checkpoints", json!([{"name": "bad name"}])),
            "checkpoints[0].name must be 1-64 characters",
        ),
        refused(
            "a negative min_attempt",
            with("checkpoints", json!([{"name": "c", "min_attempt": -1}])),
            "checkpoints[0].min_attempt: invalid value",
        ),
    ];
    // Numbers JSON cannot write.
    for (name, field, value, needle) in [
        (
            "temperature NaN",
            "temperature",
            f64::NAN,
            "temperature must be between 0 and 2",
        ),
        (
            "escalation_threshold infinite",
            "escalation_threshold",
            f64::INFINITY,
            "escalation_threshold must be between 0 and 1",
        ),
    ] {
        let mut request = GenerationRequest::user("x");
        match field {
            "temperature" => request.temperature = Some(value),
            _ => request.escalation_threshold = Some(value),
        }
        cases.push(raw(
            name,
            Encoding::MsgPack,
            Encoding::MsgPack.encode(&request),
            needle,
        ));
    }
    cases
}

fn headers(encoding: Encoding, msg_id: Option<&str>) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    if encoding == Encoding::MsgPack {
        headers.insert("Content-Type", "application/msgpack");
    }
    if let Some(id) = msg_id {
        headers.insert("Nats-Msg-Id", id);
    }
    headers
}

/// The bodies of a case, by encoding.
fn bodies(case: &Case) -> Vec<(Encoding, Value, Vec<u8>)> {
    match &case.body {
        Body::Value(value) => [Encoding::Json, Encoding::MsgPack]
            .into_iter()
            .map(|e| (e, value.clone(), e.encode(value)))
            .collect(),
        Body::Raw(e, bytes) => vec![(*e, Value::Null, bytes.clone())],
    }
}

#[tokio::test]
async fn every_bad_field_gets_its_error_in_both_encodings_and_the_worker_goes_on() {
    let mut f = Fleet::builder()
        .script("[[rules]]\nreply = \"fine\"\n")
        .default_settings()
        .worker_processes(["w1"])
        .slots(2)
        .worker_env("GENFLEET__LIMITS__MAX_REQUEST_BYTES", MAX_REQUEST_BYTES)
        .start()
        .await;
    let logs = f.logs().to_path_buf();
    let worker_log = || std::fs::read_to_string(logs.join("w1.log")).unwrap_or_default();
    let client = f.client.clone();
    let nats_client = client.nats().clone();
    fleet::wait_all_slots_free(&nats_client, 1, Duration::from_secs(30)).await;

    let mut failures = Vec::new();
    let mut queued = Vec::new();
    let cases = cases();
    for (i, case) in cases.iter().enumerate() {
        for (encoding, value, body) in bodies(case) {
            let label = format!("{} ({encoding:?})", case.name);
            let reply = fleet::submit_raw(&nats_client, "default", headers(encoding, None), body)
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "{label}: no reply: {e}\n--- the worker's log:\n{}",
                        worker_log()
                    )
                });
            let reply_encoding = Encoding::from_content_type(
                reply
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Content-Type"))
                    .map(|v| v.as_str()),
            );
            assert_eq!(
                reply_encoding, encoding,
                "{label}: replied in another encoding"
            );
            match &case.expect {
                Expect::Refused(code, json_needle, msgpack_needle) => {
                    let needle = match encoding {
                        Encoding::Json => json_needle,
                        Encoding::MsgPack => msgpack_needle,
                    };
                    match encoding.decode::<ErrorReply>(&reply.payload) {
                        Ok(error)
                            if error.error.code == *code
                                && error.error.message.contains(needle) => {}
                        Ok(error) => failures.push(format!(
                            "{label}: {:?} {:?}, expected {code:?} with {needle:?}",
                            error.error.code, error.error.message
                        )),
                        Err(_) => failures.push(format!(
                            "{label}: not an error reply: {}",
                            String::from_utf8_lossy(&reply.payload)
                        )),
                    }
                }
                Expect::Accepted => {
                    let accepted: Value = encoding.decode(&reply.payload).unwrap();
                    match accepted["request_id"].as_str() {
                        Some(id) => {
                            let result =
                                fleet::terminal(&client, id, Duration::from_secs(20)).await;
                            if (result.state, result.output.as_str())
                                != (RequestState::Completed, "fine")
                            {
                                failures.push(format!("{label}: {result:?}"));
                            }
                        }
                        None => failures.push(format!("{label}: refused: {accepted}")),
                    }
                }
            }
            // The same body on the durable queue.
            if case.queue {
                let id = format!("bad-{i}-{encoding:?}");
                let mut value = value;
                value["request_id"] = json!(id);
                let body = encoding.encode(&value);
                let js = async_nats::jetstream::new(nats_client.clone());
                js.publish_with_headers(
                    format!("gen.queue.default.{id}"),
                    headers(encoding, Some(&id)),
                    body.into(),
                )
                .await
                .unwrap()
                .await
                .unwrap_or_else(|e| panic!("{label}: the queue did not take it: {e}"));
                queued.push((label, id, &case.expect, encoding));
            }
        }
    }
    for (label, id, expect, encoding) in queued {
        let result = fleet::terminal(&client, &id, Duration::from_secs(20)).await;
        let detail = result.detail.clone().unwrap_or_default();
        match expect {
            Expect::Refused(_, json_needle, msgpack_needle) => {
                let needle = match encoding {
                    Encoding::Json => json_needle,
                    Encoding::MsgPack => msgpack_needle,
                };
                if (result.state, result.reason) != (RequestState::Failed, Reason::InvalidRequest)
                    || !detail.contains(needle)
                {
                    failures.push(format!(
                        "{label} on the queue: {:?} {:?} {detail:?}, expected invalid_request with {needle:?}",
                        result.state, result.reason
                    ));
                }
            }
            Expect::Accepted => {
                if (result.state, result.output.as_str()) != (RequestState::Completed, "fine") {
                    failures.push(format!("{label} on the queue: {result:?}"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of the bad inputs were not answered as expected:\n{}\n--- the worker's log:\n{}",
        failures.len(),
        failures.join("\n"),
        worker_log()
    );

    // The worker is still there, serves, and every slot is free.
    assert!(f.processes[0].running(), "the worker process ended");
    let result = client
        .run(
            "default",
            GenerationRequest::user("after"),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(result.output, "fine");
    fleet::wait_all_slots_free(&nats_client, 1, Duration::from_secs(10)).await;
    fleet::wait_queue_empty(&nats_client, "default", Duration::from_secs(10)).await;
}
