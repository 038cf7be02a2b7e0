//! End-to-end tests: a real server on 127.0.0.1:0 driven with reqwest.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{Value, json};

use super::{Chunking, MockServer, Rule, Script, ToolCallSpec, serve};

/// One client for all tests: building one loads the system's root certificates, which is slow.
/// No idle connections are kept: each test has its own runtime, and a pooled connection must
/// not outlive the runtime that opened it.
/// A GET through the shared client.
async fn get(url: impl reqwest::IntoUrl) -> reqwest::Response {
    client().get(url).send().await.unwrap()
}

fn client() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            crate::llm::openai::install_crypto_provider();
            reqwest::Client::builder()
                .no_proxy()
                .pool_max_idle_per_host(0)
                .timeout(Duration::from_secs(30))
                .build()
                .expect("client")
        })
        .clone()
}

async fn start(script: Script) -> MockServer {
    MockServer::start(script).await.expect("mock server starts")
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

async fn post(server: &MockServer, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}/chat/completions", server.base_url()))
        .json(body)
        .send()
        .await
        .expect("request sent")
}

async fn complete(server: &MockServer, body: Value) -> Value {
    let resp = post(server, &body).await;
    assert_eq!(resp.status(), 200);
    resp.json().await.expect("json body")
}

/// A parsed SSE response: the JSON chunks, whether `[DONE]` came, and whether the body
/// ended with a transport error.
struct Streamed {
    chunks: Vec<Value>,
    done: bool,
    transport_error: bool,
}

impl Streamed {
    fn content(&self) -> String {
        self.deltas("content")
    }

    /// The content of each chunk that carries some, as streamed.
    fn pieces(&self) -> Vec<&str> {
        self.chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .filter(|t| !t.is_empty())
            .collect()
    }

    fn deltas(&self, field: &str) -> String {
        self.chunks
            .iter()
            .filter_map(|c| c.pointer(&format!("/choices/0/delta/{field}")))
            .filter_map(Value::as_str)
            .collect()
    }

    fn finish_reasons(&self) -> Vec<String> {
        self.chunks
            .iter()
            .filter_map(|c| c.pointer("/choices/0/finish_reason"))
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect()
    }

    fn usage(&self) -> Option<&Value> {
        self.chunks
            .iter()
            .find_map(|c| c.get("usage").filter(|u| !u.is_null()))
    }

    /// Reassembles streamed tool calls into (id, name, arguments) by index.
    fn tool_calls(&self) -> Vec<(String, String, String)> {
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for chunk in &self.chunks {
            let Some(deltas) = chunk
                .pointer("/choices/0/delta/tool_calls")
                .and_then(Value::as_array)
            else {
                continue;
            };
            for d in deltas {
                let index = d["index"].as_u64().expect("index") as usize;
                if index == calls.len() {
                    assert_eq!(d["type"], "function", "head delta of call {index}");
                    calls.push((
                        d["id"].as_str().expect("id").to_string(),
                        d["function"]["name"].as_str().expect("name").to_string(),
                        String::new(),
                    ));
                }
                let args = d["function"]["arguments"].as_str().unwrap_or_default();
                calls[index].2.push_str(args);
            }
        }
        calls
    }
}

async fn stream(server: &MockServer, mut body: Value) -> Streamed {
    body["stream"] = json!(true);
    let resp = post(server, &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut text = Vec::new();
    let mut transport_error = false;
    let mut bytes = resp.bytes_stream();
    while let Some(part) = bytes.next().await {
        match part {
            Ok(b) => text.extend_from_slice(&b),
            Err(_) => {
                transport_error = true;
                break;
            }
        }
    }
    let text = String::from_utf8(text).expect("utf-8 body");
    let mut chunks = Vec::new();
    let mut done = false;
    for event in text.split_terminator("\n\n") {
        let data = event.strip_prefix("data: ").expect("data: framing");
        assert!(!done, "nothing may follow [DONE]");
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str(data).expect("chunk is JSON"));
        }
    }
    assert!(
        text.is_empty() || text.ends_with("\n\n"),
        "frames end in a blank line"
    );
    Streamed {
        chunks,
        done,
        transport_error,
    }
}

#[tokio::test]
async fn streams_text_with_role_chunk_finish_usage_and_done() {
    let server = start(Script::new(vec![Rule::reply("hello big  world")])).await;
    let s = stream(
        &server,
        json!({"model": "m-1", "messages": [user("hi there")],
               "stream_options": {"include_usage": true}}),
    )
    .await;
    assert!(s.done && !s.transport_error);
    let first = &s.chunks[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert!(first["id"].as_str().unwrap().starts_with("chatcmpl-"));
    for c in &s.chunks {
        assert_eq!(c["model"], "m-1");
        assert_eq!(c["id"], first["id"]);
        assert!(c["created"].is_u64());
    }
    assert_eq!(s.content(), "hello big  world");
    assert_eq!(s.pieces(), ["hello ", "big  ", "world"]);
    assert_eq!(s.finish_reasons(), ["stop"]);
    let last = s.chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 3);
    assert_eq!(last["usage"]["prompt_tokens"], 2);
    assert_eq!(last["usage"]["total_tokens"], 5);
    // The finish chunk's delta is empty, as OpenAI sends it.
    let finish = &s.chunks[s.chunks.len() - 2];
    assert_eq!(finish["choices"][0]["delta"], json!({}));

    // Without include_usage there is no usage chunk at all.
    let s = stream(&server, json!({"messages": [user("x")]})).await;
    assert!(s.usage().is_none());
    assert!(s.chunks.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(s.chunks[0]["model"], "mock");
}

#[tokio::test]
async fn non_streaming_completion() {
    let server = start(Script::new(vec![Rule::reply("four words are here")])).await;
    let v = complete(&server, json!({"model": "gpt-x", "messages": [user("q")]})).await;
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "gpt-x");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], "four words are here");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["usage"]["prompt_tokens"], 1);
}

#[tokio::test]
async fn echo_is_the_default_and_reads_text_parts() {
    let server = start(Script::echo()).await;
    let v = complete(
        &server,
        json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "Exactly this"}]},
        ]}),
    )
    .await;
    assert_eq!(v["choices"][0]["message"]["content"], "Exactly this");
    let s = stream(&server, json!({"messages": [user("echo me  please")]})).await;
    assert_eq!(s.content(), "echo me  please");
}

#[tokio::test]
async fn streams_native_tool_calls_like_openai() {
    let args = json!({"city": "Paris", "days": 3, "units": {"temp": "C"}});
    let script = Script::new(vec![
        Rule::tool_call("get_weather", args.clone())
            .with_tool_call("get_time", json!({"tz": "Europe/Paris"})),
    ]);
    let server = start(script).await;
    let body = json!({
        "messages": [user("weather?")],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        "stream_options": {"include_usage": true},
    });
    let s = stream(&server, body.clone()).await;
    assert!(s.done);
    let calls = s.tool_calls();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].1, "get_weather");
    assert_eq!(serde_json::from_str::<Value>(&calls[0].2).unwrap(), args);
    assert_eq!(calls[1].1, "get_time");
    assert_eq!(
        serde_json::from_str::<Value>(&calls[1].2).unwrap(),
        json!({"tz": "Europe/Paris"})
    );
    assert_ne!(calls[0].0, calls[1].0);
    assert_eq!(s.content(), "");
    assert_eq!(s.finish_reasons(), ["tool_calls"]);
    // Arguments came in several fragments, and the head delta had empty arguments.
    let fragments = s
        .chunks
        .iter()
        .filter(|c| c.pointer("/choices/0/delta/tool_calls/0/id").is_none())
        .filter(|c| c.pointer("/choices/0/delta/tool_calls").is_some())
        .count();
    assert!(fragments > 2, "{fragments} fragments");
    let head = s
        .chunks
        .iter()
        .find_map(|c| c.pointer("/choices/0/delta/tool_calls/0"))
        .unwrap();
    assert_eq!(head["function"]["arguments"], "");
    assert_eq!(s.usage().unwrap()["completion_tokens"], 2);

    // Non-streaming: content null, tool_calls in the message.
    let v = complete(&server, body).await;
    let msg = &v["choices"][0]["message"];
    assert!(msg["content"].is_null());
    assert_eq!(msg["tool_calls"][0]["type"], "function");
    assert_eq!(msg["tool_calls"][0]["function"]["name"], "get_weather");
    let sent: Value = serde_json::from_str(
        msg["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(sent, args);
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
}

#[tokio::test]
async fn raw_string_arguments_are_sent_verbatim() {
    let raw = r#"{"a": 1, "b": "unterminated"#;
    let mut call = ToolCallSpec::new("add", Value::String(raw.to_string()));
    call.id = Some("call_fixed".to_string());
    let script = Script::new(vec![
        Rule::reply("Let me add.")
            .with_tool_calls(vec![call])
            .chunk(Chunking::Char),
    ]);
    let server = start(script).await;
    let s = stream(&server, json!({"messages": [user("add")]})).await;
    assert_eq!(s.content(), "Let me add.");
    let calls = s.tool_calls();
    assert_eq!(
        calls,
        [("call_fixed".to_string(), "add".to_string(), raw.to_string())]
    );
    let v = complete(&server, json!({"messages": [user("add")]})).await;
    assert_eq!(v["choices"][0]["message"]["content"], "Let me add.");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        raw
    );
}

#[tokio::test]
async fn conditions_select_the_first_matching_rule() {
    let script = Script::new(vec![
        Rule::reply("tool result seen").when_last_role("tool"),
        Rule::reply("sunny")
            .when_last_user_contains("WEATHER")
            .when_turn(1),
        Rule::reply("pirate mode").when_any_message_contains("pirate"),
        Rule::reply("with tools").when_has_tools(true),
        Rule::reply("correction").when_last_message_contains("invalid json"),
        Rule::reply("second turn").when_turn(2),
    ]);
    let server = start(script).await;
    let reply = |v: Value| v["choices"][0]["message"]["content"].clone();
    let ask = |messages: Value| {
        let server = &server;
        async move { reply(complete(server, json!({"messages": messages})).await) }
    };
    assert_eq!(ask(json!([user("What's the Weather?")])).await, "sunny");
    let tool_turn = json!([
        user("weather?"),
        {"role": "assistant", "content": null, "tool_calls": []},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]);
    assert_eq!(ask(tool_turn).await, "tool result seen");
    assert_eq!(
        ask(json!([{"role": "system", "content": "Talk like a PIRATE"}, user("hello")])).await,
        "pirate mode"
    );
    let with_tools = complete(
        &server,
        json!({"messages": [user("hello")], "tools": [{"type": "function"}]}),
    )
    .await;
    assert_eq!(reply(with_tools), "with tools");
    // Turn 2 user message that mentions the weather does not match the turn-1 rule.
    let second = json!([
        user("hi"),
        {"role": "assistant", "content": "hello"},
        user("and the weather?"),
    ]);
    assert_eq!(ask(second).await, "second turn");
    assert_eq!(
        ask(json!([user("x"), {"role": "user", "content": "Invalid JSON, retry"}])).await,
        "correction"
    );
    // No rule matches: echo.
    assert_eq!(
        ask(json!([user("nothing special")])).await,
        "nothing special"
    );
}

#[tokio::test]
async fn templates_substitute_request_text() {
    let script = Script::new(vec![
        Rule::reply("You said: {{last_user}} | last: {{last_message}} | turn {{turn}}")
            .with_reasoning("thinking about {{last_user}}"),
    ]);
    let server = start(script).await;
    let messages = json!([
        user("first"),
        {"role": "assistant", "content": "ok"},
        user("second {{turn}}"),
    ]);
    let v = complete(&server, json!({"messages": messages})).await;
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "You said: second {{turn}} | last: second {{turn}} | turn 2"
    );
    assert_eq!(
        v["choices"][0]["message"]["reasoning_content"],
        "thinking about second {{turn}}"
    );
}

#[tokio::test]
async fn reasoning_streams_before_content() {
    let script = Script::new(vec![
        Rule::reply("answer").with_reasoning("step one, step two"),
    ]);
    let server = start(script).await;
    let s = stream(
        &server,
        json!({"messages": [user("q")], "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(s.deltas("reasoning_content"), "step one, step two");
    assert_eq!(s.content(), "answer");
    let first_content = s
        .chunks
        .iter()
        .position(|c| c.pointer("/choices/0/delta/content") == Some(&json!("answer")))
        .unwrap();
    let last_reasoning = s
        .chunks
        .iter()
        .rposition(|c| c.pointer("/choices/0/delta/reasoning_content").is_some())
        .unwrap();
    assert!(last_reasoning < first_content);
    assert_eq!(s.usage().unwrap()["completion_tokens"], 5);
}

#[tokio::test]
async fn max_tokens_truncates_with_length() {
    let script = Script::new(vec![Rule::reply("one two three four five")]);
    let server = start(script).await;
    let s = stream(
        &server,
        json!({"messages": [user("q")], "max_tokens": 2, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(s.content(), "one two ");
    assert_eq!(s.finish_reasons(), ["length"]);
    assert_eq!(s.usage().unwrap()["completion_tokens"], 2);
    assert!(s.done);

    let v = complete(
        &server,
        json!({"messages": [user("q")], "max_completion_tokens": 3, "max_tokens": 100}),
    )
    .await;
    assert_eq!(v["choices"][0]["message"]["content"], "one two three ");
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // A budget that fits is not a truncation.
    let v = complete(&server, json!({"messages": [user("q")], "max_tokens": 5})).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn repeat_and_char_chunks() {
    let script = Script::new(vec![Rule::reply("ab").repeat(3).chunk(Chunking::Chars(4))]);
    let server = start(script).await;
    let s = stream(&server, json!({"messages": [user("q")]})).await;
    assert_eq!(s.pieces(), ["abab", "ab"]);
}

#[tokio::test]
async fn break_after_drops_the_stream() {
    let script = Script::new(vec![
        Rule::reply("a b c d e f")
            .break_after(3)
            .when_last_user_contains("clean"),
        Rule::reply("a b c d e f").break_after(2).break_with_error(),
    ]);
    let server = start(script).await;
    let body = json!({"messages": [user("clean")], "stream_options": {"include_usage": true}});
    let s = stream(&server, body).await;
    assert!(!s.done && !s.transport_error);
    assert_eq!(s.content(), "a b c ");
    assert!(s.finish_reasons().is_empty());
    assert!(s.usage().is_none());

    let s = stream(&server, json!({"messages": [user("abort")]})).await;
    assert!(!s.done && s.transport_error);
    assert_eq!(s.content(), "a b ");
    assert!(s.finish_reasons().is_empty());

    // Non-streaming: the connection closes without a complete response.
    let sent = client()
        .post(format!("{}/chat/completions", server.base_url()))
        .json(&json!({"messages": [user("clean")]}))
        .send()
        .await;
    match sent {
        Ok(resp) => assert!(resp.bytes().await.is_err()),
        Err(e) => assert!(e.is_request(), "{e}"),
    }
}

#[tokio::test]
async fn break_after_zero_sends_only_the_role_chunk() {
    let server = start(Script::new(vec![Rule::reply("x y").break_after(0)])).await;
    let s = stream(&server, json!({"messages": [user("q")]})).await;
    assert_eq!(s.chunks.len(), 1);
    assert_eq!(s.chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(!s.done);
}

#[tokio::test]
async fn scripted_status_fails_then_recovers() {
    let script = Script::new(vec![
        Rule::reply("recovered").status(500).fail_times(1),
        Rule::reply("never"),
    ]);
    let server = start(script).await;
    let body = json!({"messages": [user("q")]});
    let resp = post(&server, &body).await;
    assert_eq!(resp.status(), 500);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["type"], "server_error");
    assert!(err["error"]["message"].as_str().unwrap().contains("500"));
    assert!(err["error"]["param"].is_null());
    let v = complete(&server, body.clone()).await;
    assert_eq!(v["choices"][0]["message"]["content"], "recovered");
    let s = stream(&server, body).await;
    assert_eq!(s.content(), "recovered");

    // Without fail_times the status is permanent.
    let server = start(Script::new(vec![
        Rule::error(429).error_message("slow down"),
    ]))
    .await;
    for _ in 0..2 {
        let resp = post(&server, &json!({"messages": [user("q")]})).await;
        assert_eq!(resp.status(), 429);
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"]["message"], "slow down");
        assert_eq!(err["error"]["code"], "rate_limit_exceeded");
    }
}

#[tokio::test]
async fn reject_tools_and_stream_options() {
    let mut script = Script::echo();
    script.reject_tools = true;
    script.reject_stream_options = true;
    let server = start(script).await;
    let resp = post(
        &server,
        &json!({"messages": [user("q")], "tools": [{"type": "function"}]}),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(
        err["error"]["message"],
        "tools are not supported by this server (no tool parser configured)"
    );
    assert_eq!(err["error"]["param"], "tools");
    assert_eq!(err["error"]["type"], "invalid_request_error");

    let resp = post(
        &server,
        &json!({"messages": [user("q")], "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["param"], "stream_options");

    // Plain requests still work.
    let v = complete(&server, json!({"messages": [user("fine")]})).await;
    assert_eq!(v["choices"][0]["message"]["content"], "fine");
}

#[tokio::test]
async fn api_key_is_enforced() {
    let server = start(Script::echo().with_api_key("secret")).await;
    let url = format!("{}/chat/completions", server.base_url());
    let body = json!({"messages": [user("q")]});
    for auth in [None, Some("Bearer wrong")] {
        let mut req = client().post(&url).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401);
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"]["type"], "invalid_request_error");
        assert_eq!(err["error"]["code"], "invalid_api_key");
        assert!(err["error"]["param"].is_null());
    }
    let resp = client()
        .post(&url)
        .bearer_auth("secret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let models = get(format!("{}/models", server.base_url())).await;
    assert_eq!(models.status(), 401);
    // Health and the request log stay open.
    let health = get(format!("http://{}/health", server.addr())).await;
    assert_eq!(health.status(), 200);
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let server = start(Script::echo()).await;
    let url = format!("{}/chat/completions", server.base_url());
    let cases = [
        ("{not json", None),
        ("[1, 2]", None),
        (r#"{"model": "m"}"#, Some("messages")),
        (r#"{"messages": "hi"}"#, Some("messages")),
    ];
    for (body, param) in cases {
        let resp = client()
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{body}");
        let err: Value = resp.json().await.unwrap();
        let e = &err["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["param"], param.map_or(Value::Null, |p| json!(p)));
        assert!(e["code"].is_null());
    }
}

#[tokio::test]
async fn models_and_health() {
    let server = start(Script::echo().with_model("tiny-llm")).await;
    let v: Value = get(format!("{}/models", server.base_url()))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny-llm");
    assert_eq!(v["data"][0]["object"], "model");
    let health = get(format!("http://{}/health", server.addr())).await;
    assert_eq!(health.text().await.unwrap(), "ok");
    // A request without a model gets the script's.
    let c = complete(&server, json!({"messages": [user("q")]})).await;
    assert_eq!(c["model"], "tiny-llm");
}

#[tokio::test]
async fn records_request_bodies() {
    let server = start(Script::echo()).await;
    let log_url = format!("http://{}/mock/requests", server.addr());
    let first = json!({"model": "a", "messages": [user("one")], "temperature": 0.5});
    let second = json!({"model": "b", "messages": [user("two")], "stream": true});
    complete(&server, first.clone()).await;
    post(&server, &second).await.bytes().await.unwrap();
    client()
        .post(format!("{}/chat/completions", server.base_url()))
        .body("garbage")
        .send()
        .await
        .unwrap();
    let logged: Value = get(&log_url).await.json().await.unwrap();
    assert_eq!(logged, json!([first, second, "garbage"]));
    assert_eq!(server.requests(), [first, second, json!("garbage")]);

    let resp = client().delete(&log_url).send().await.unwrap();
    assert!(resp.status().is_success());
    assert!(server.requests().is_empty());

    // Bounded: only the most recent bodies are kept.
    for i in 0..(super::REQUEST_LOG_CAPACITY + 4) {
        complete(&server, json!({"messages": [user(&i.to_string())]})).await;
    }
    let log = server.requests();
    assert_eq!(log.len(), super::REQUEST_LOG_CAPACITY);
    assert_eq!(log[0]["messages"][0]["content"], "4");
    assert_eq!(
        log.last().unwrap()["messages"][0]["content"],
        (super::REQUEST_LOG_CAPACITY + 3).to_string()
    );
}

#[tokio::test]
async fn delays_are_applied() {
    let script = Script::new(vec![
        Rule::reply("a b c").delay_ms(20).first_token_delay_ms(50),
    ]);
    let server = start(script).await;
    let started = Instant::now();
    let s = stream(&server, json!({"messages": [user("q")]})).await;
    assert_eq!(s.content(), "a b c");
    assert!(started.elapsed() >= Duration::from_millis(110));
    let started = Instant::now();
    complete(&server, json!({"messages": [user("q")]})).await;
    assert!(started.elapsed() >= Duration::from_millis(110));
}

#[tokio::test]
async fn streams_fast_and_concurrently() {
    let script = Script::new(vec![Rule::reply("tok ").repeat(2_000)]);
    let server = start(script).await;
    let started = Instant::now();
    let runs = (0..8).map(|_| stream(&server, json!({"messages": [user("q")]})));
    let results = futures_util::future::join_all(runs).await;
    for s in &results {
        assert!(s.done);
        // role + 2000 tokens + finish
        assert_eq!(s.chunks.len(), 2_002);
    }
    // 16,000 chunks (about 1 s in a debug build); the bound is generous so a loaded CI
    // machine passes, while a server that sleeps or serialises connections would not.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn open_streams_are_counted_from_the_request_to_the_last_frame() {
    let script = Script::new(vec![Rule::reply("tok ").repeat(20)]);
    let server = start(script).await;
    // One after another: the first closed before its end could be read, so never two at once.
    for _ in 0..3 {
        assert!(stream(&server, json!({"messages": [user("q")]})).await.done);
    }
    assert_eq!((server.open_streams(), server.most_open_streams()), (0, 1));
    // Side by side: as many as were open together, at most.
    let runs = (0..4).map(|_| stream(&server, json!({"messages": [user("q")]})));
    futures_util::future::join_all(runs).await;
    assert_eq!(server.open_streams(), 0);
    assert!((1..=4).contains(&server.most_open_streams()));
    server.reset_most_open_streams();
    assert_eq!(server.most_open_streams(), 0);
    // A client that hangs up closes its stream too.
    let slow = Script::new(vec![Rule::reply("tok ").repeat(50).delay_ms(100)]);
    let server = start(slow).await;
    let mut body = post(&server, &json!({"messages": [user("q")], "stream": true}))
        .await
        .bytes_stream();
    body.next().await.unwrap().unwrap();
    assert_eq!(server.open_streams(), 1);
    drop(body);
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.open_streams() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.open_streams(), 0);
}

#[tokio::test]
async fn serve_stops_on_shutdown() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, Script::echo(), async move {
        let _ = rx.await;
    }));
    let health = get(format!("http://{addr}/health")).await;
    assert_eq!(health.status(), 200);
    drop(health);
    tx.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("server stops")
        .unwrap();
    assert!(result.is_ok());
}

const FULL_TOML: &str = r#"
model = "mock-7b"
api_key = "secret"
reject_tools = false
reject_stream_options = true
token_delay_ms = 2

[[rules]]
when_last_user_contains = "weather"
when_last_role = "user"
when_turn = 1
when_has_tools = true
reasoning = "Need the tool."
tool_calls = [
  { name = "get_weather", arguments = { city = "Paris", days = 2 } },
  { id = "call_raw", name = "broken", arguments = "{\"a\": " },
]
chunk = 4
first_token_delay_ms = 10

[[rules]]
when_last_message_contains = "18C"
when_any_message_contains = "pirate"
reply = "Arr, {{last_message}}"
repeat = 2
chunk = "char"
delay_ms = 1
finish_reason = "stop"
usage = { prompt_tokens = 10, completion_tokens = 5 }

[[rules]]
when_last_user_contains = "flaky"
reply = "ok now"
status = 503
fail_times = 2
error_message = "overloaded"

[[rules]]
when_last_user_contains = "drop"
reply = "partial"
break_after = 3
break_with_error = true

[[rules]]
"#;

fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("genfleet-mock-{}-{name}", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn parses_toml_and_json_script_files() {
    let path = temp_file("script.toml", FULL_TOML);
    let script = Script::from_file(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(script.model_name(), "mock-7b");
    assert_eq!(script.api_key.as_deref(), Some("secret"));
    assert!(script.reject_stream_options && !script.reject_tools);
    assert_eq!(script.token_delay_ms, 2);
    assert_eq!(script.rules.len(), 5);
    let r = &script.rules[0];
    assert_eq!(r.when_last_user_contains.as_deref(), Some("weather"));
    assert_eq!(r.when_turn, Some(1));
    assert_eq!(r.when_has_tools, Some(true));
    assert_eq!(r.chunk, Chunking::Chars(4));
    assert_eq!(
        r.tool_calls[0].arguments,
        json!({"city": "Paris", "days": 2})
    );
    assert_eq!(r.tool_calls[1].arguments, json!("{\"a\": "));
    assert_eq!(r.tool_calls[1].id.as_deref(), Some("call_raw"));
    let r = &script.rules[1];
    assert_eq!(r.chunk, Chunking::Char);
    assert_eq!(r.usage.unwrap().completion_tokens, Some(5));
    assert_eq!(r.repeat, Some(2));
    assert_eq!(script.rules[2].status, Some(503));
    assert_eq!(script.rules[2].fail_times, Some(2));
    assert_eq!(script.rules[3].break_after, Some(3));
    assert_eq!(script.rules[4], Rule::default());

    // The same script as JSON (its Serialize form) loads back identical.
    let json_text = serde_json::to_string_pretty(&script).unwrap();
    let path = temp_file("script.json", &json_text);
    let from_json = Script::from_file(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(from_json, script);

    // A hand-written JSON file.
    let script = Script::from_json_str(
        r#"{"rules": [{"reply": "hi", "chunk": "word", "tool_calls": [{"name": "f"}]}]}"#,
    )
    .unwrap();
    assert_eq!(script.rules[0].tool_calls[0].arguments, json!({}));
    assert_eq!(script.model_name(), "mock");
}

#[test]
fn rejects_bad_scripts() {
    assert!(
        Script::from_toml_str("[[rules]]\nwhen_last_user_contain = \"x\"")
            .unwrap_err()
            .contains("when_last_user_contain")
    );
    assert!(Script::from_toml_str("[[rules]]\nstatus = 200").is_err());
    assert!(Script::from_toml_str("[[rules]]\nchunk = 0").is_err());
    assert!(Script::from_toml_str("[[rules]]\nchunk = \"line\"").is_err());
    assert!(Script::from_json_str(r#"{"rules": [{"tool_calls": [{}]}]}"#).is_err());
    assert!(Script::from_file("/nonexistent/script.toml").is_err());
    let path = temp_file("script.yaml", "rules: []");
    assert!(
        Script::from_file(&path)
            .unwrap_err()
            .contains(".toml or .json")
    );
    std::fs::remove_file(&path).unwrap();
}

#[tokio::test]
async fn file_script_drives_the_server() {
    let mut script = Script::from_toml_str(FULL_TOML).unwrap();
    script.api_key = None;
    script.reject_stream_options = false;
    let server = start(script).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather"}}]);
    let s = stream(
        &server,
        json!({"messages": [user("Weather in Paris?")], "tools": tools}),
    )
    .await;
    assert_eq!(s.deltas("reasoning_content"), "Need the tool.");
    let calls = s.tool_calls();
    assert_eq!(calls[0].1, "get_weather");
    assert_eq!(
        serde_json::from_str::<Value>(&calls[0].2).unwrap(),
        json!({"city": "Paris", "days": 2})
    );
    assert_eq!(
        calls[1],
        ("call_raw".into(), "broken".into(), "{\"a\": ".into())
    );

    let v = complete(
        &server,
        json!({"messages": [
            {"role": "system", "content": "You are a pirate."},
            user("weather"),
            {"role": "tool", "content": "18C"},
        ]}),
    )
    .await;
    assert_eq!(v["choices"][0]["message"]["content"], "Arr, 18CArr, 18C");
    assert_eq!(v["usage"]["prompt_tokens"], 10);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], 15);

    let body = json!({"messages": [user("flaky")]});
    for _ in 0..2 {
        assert_eq!(post(&server, &body).await.status(), 503);
    }
    let v = complete(&server, body).await;
    assert_eq!(v["choices"][0]["message"]["content"], "ok now");

    // The empty last rule matches everything else: echo.
    let v = complete(&server, json!({"messages": [user("plain")]})).await;
    assert_eq!(v["choices"][0]["message"]["content"], "plain");
}

#[tokio::test]
async fn the_prefix_cache_counts_conversations_that_go_on() {
    let script = Script::from_toml_str(
        "prefix_cache = { entries = 16, prefix_hit_ms = 0, prefill_ms_per_kb = 0 }",
    )
    .unwrap();
    let server = start(script).await;
    let stats = || async {
        let body: Value = get(format!("http://{}/mock/stats", server.addr()))
            .await
            .json()
            .await
            .unwrap();
        body["prefix_cache"].clone()
    };
    complete(&server, json!({"messages": [user("chain one")]})).await;
    complete(
        &server,
        json!({"messages": [user("chain one"), {"role": "assistant", "content": "chain one"}, user("next")]}),
    )
    .await;
    complete(&server, json!({"messages": [user("chain two")]})).await;
    let seen = stats().await;
    assert_eq!(seen["hits"], 1, "{seen}");
    assert_eq!(seen["misses"], 2, "{seen}");
    assert_eq!(seen["entries"], 3, "{seen}");
    assert_eq!(seen["capacity"], 16, "{seen}");
    assert_eq!(server.prefix_cache_stats().unwrap().hits, 1);

    // A reset forgets what was served: the first chain misses again.
    let reset = client()
        .delete(format!("http://{}/mock/stats", server.addr()))
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 204);
    complete(
        &server,
        json!({"messages": [user("chain one"), user("more")]}),
    )
    .await;
    let seen = stats().await;
    assert_eq!(
        (seen["hits"].as_u64(), seen["misses"].as_u64()),
        (Some(0), Some(1))
    );
}

#[tokio::test]
async fn without_a_prefix_cache_the_stats_say_so() {
    let server = start(Script::echo()).await;
    complete(&server, json!({"messages": [user("x")]})).await;
    let body: Value = get(format!("http://{}/mock/stats", server.addr()))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(body["prefix_cache"], Value::Null, "{body}");
    assert!(server.prefix_cache_stats().is_none());
    let err = Script::from_toml_str("prefix_cache = { entries = 0 }").unwrap_err();
    assert!(err.contains("prefix_cache.entries"), "{err}");
    let err = Script::from_toml_str("prefix_cache = { hit_ms = 1 }").unwrap_err();
    assert!(err.contains("hit_ms"), "{err}");
}

/// The reply of the continuation tests: words, a mid-word cut, punctuation.
const WHOLE: &str = "The quick brown fox jumps over the lazy dog, twice.";

fn assistant(text: &str) -> Value {
    json!({"role": "assistant", "content": text})
}

/// The request continuing `partial` in `form`: vLLM's flags, or the prefill alone.
fn continuing(partial: &str, form: &str) -> Value {
    let mut body = json!({
        "messages": [user("tell the fox story"), assistant(partial)],
        "stream_options": {"include_usage": true},
    });
    if form == "continue_final_message" {
        body["continue_final_message"] = json!(true);
        body["add_generation_prompt"] = json!(false);
    }
    body
}

fn fox_script() -> Script {
    Script::new(vec![
        Rule::reply(WHOLE)
            .when_last_user_contains("fox")
            .with_reasoning("A story."),
        Rule::reply("something else"),
    ])
}

#[tokio::test]
async fn a_reply_cut_anywhere_and_continued_is_the_reply_whole() {
    let server = start(fox_script()).await;
    let first = stream(&server, json!({"messages": [user("tell the fox story")]})).await;
    assert_eq!(first.content(), WHOLE);
    assert_eq!(first.deltas("reasoning_content"), "A story.");
    let cuts = [1, 6, 10, 23, WHOLE.len() - 1, WHOLE.len()];
    for form in ["continue_final_message", "prefill"] {
        for cut in cuts {
            let partial = &WHOLE[..cut];
            let rest = stream(&server, continuing(partial, form)).await;
            let said = format!("{form}, cut after {partial:?}");
            assert_eq!(format!("{partial}{}", rest.content()), WHOLE, "{said}");
            assert_eq!(rest.deltas("reasoning_content"), "", "{said}");
            assert_eq!(rest.finish_reasons(), ["stop"], "{said}");
            // Usage counts only what was sent.
            let usage = rest.usage().expect("usage");
            assert_eq!(
                usage["completion_tokens"].as_u64(),
                Some(rest.pieces().len() as u64),
                "{said}"
            );
        }
    }
    // Not streamed, the same.
    let mut body = continuing("The quick", "continue_final_message");
    body.as_object_mut().unwrap().remove("stream_options");
    let v = complete(&server, body).await;
    assert_eq!(
        v["choices"][0]["message"]["content"],
        " brown fox jumps over the lazy dog, twice."
    );
}

#[tokio::test]
async fn a_continuation_the_reply_does_not_start_with_gets_the_reply_whole() {
    let server = start(fox_script()).await;
    for form in ["continue_final_message", "prefill"] {
        let got = stream(&server, continuing("A slow green turtle", form)).await;
        assert_eq!(got.content(), WHOLE, "{form}");
        assert_eq!(got.deltas("reasoning_content"), "A story.", "{form}");
        // An empty text so far continues nothing: the reply whole, reasoning first.
        let got = stream(&server, continuing("", form)).await;
        assert_eq!(got.content(), WHOLE, "{form}");
        assert_eq!(got.deltas("reasoning_content"), "A story.", "{form}");
    }
}

#[tokio::test]
async fn continue_final_message_is_refused_as_vllm_refuses_it() {
    let server = start(fox_script()).await;
    let after_user = json!({
        "messages": [user("tell the fox story")],
        "continue_final_message": true,
        "add_generation_prompt": false,
    });
    let with_generation_prompt = json!({
        "messages": [user("tell the fox story"), assistant("The")],
        "continue_final_message": true,
    });
    for (body, says) in [
        (after_user, "not an assistant message"),
        (with_generation_prompt, "Cannot set both"),
    ] {
        let resp = post(&server, &body).await;
        assert_eq!(resp.status(), 400, "{body}");
        let error: Value = resp.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message}");
    }
    assert_eq!(server.generated_stats().continuations, 0);
}

#[tokio::test]
async fn the_stats_count_the_text_sent_and_the_continuations() {
    let server = start(fox_script()).await;
    let stats_url = format!("http://{}/mock/stats", server.addr());
    let stats = || async {
        let body: Value = get(&stats_url).await.json().await.unwrap();
        body["generated"].clone()
    };
    let first = stream(&server, json!({"messages": [user("tell the fox story")]})).await;
    let partial = "The quick brown";
    let rest = stream(&server, continuing(partial, "prefill")).await;
    let whole_chars = WHOLE.chars().count() as u64;
    let rest_chars = (WHOLE.len() - partial.len()) as u64;
    assert_eq!(
        stats().await,
        json!({
            "content_chars": whole_chars + rest_chars,
            "content_chunks": first.pieces().len() + rest.pieces().len(),
            "continuations": 1,
        })
    );
    assert_eq!(
        server.generated_stats().content_chars,
        whole_chars + rest_chars
    );
    // A stream broken off counts only the chunks sent before the break.
    let server_broken = start(Script::new(vec![
        Rule::reply("one two three four").break_after(2),
    ]))
    .await;
    stream(&server_broken, json!({"messages": [user("x")]})).await;
    assert_eq!(
        server_broken.generated_stats().content_chars,
        "one two ".len() as u64
    );

    let reset = client().delete(&stats_url).send().await.unwrap();
    assert_eq!(reset.status(), 204);
    assert_eq!(
        stats().await,
        json!({"content_chars": 0, "content_chunks": 0, "continuations": 0})
    );
}

#[tokio::test]
async fn the_mock_answers_version_as_vllm_does() {
    let server = start(Script::echo()).await;
    let body: Value = get(format!("http://{}/version", server.addr()))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(body, json!({"version": "genfleet-mock"}));
}
