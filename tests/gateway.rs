//! `genfleet gateway` as a caller meets it: a real gateway process in front of a real
//! nats-server, a worker and the mock backend (tests/data/gateway.toml). The official openai
//! Python SDK drives most of it (tests/python/gateway_client.py); what needs the bus beside
//! the HTTP side (a manager's answer, a caller that hangs up at a known point, a gateway
//! killed) is driven from here.

mod common;

use common::fleet::Fleet;
use common::gateway::{
    Gateway, KEY, TENANT, WITHIN, answer_next_decision, fleet, python_part, root,
};
use common::nats::free_port;
use common::wait;
use futures_util::StreamExt;
use genfleet::protocol::RequestState;
use serde_json::{Value, json};

/// Runs one part of tests/python/gateway_client.py and returns what it printed.
async fn sdk(gateway: &Gateway, part: &str) -> String {
    python_part(gateway, "gateway_client.py", "gateway client", part, &[]).await
}

fn printed(stdout: &str, key: &str) -> String {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("{key} in {stdout}"))
        .to_string()
}

/// Waits until the request is terminal and returns its state.
async fn terminal(fleet: &Fleet, id: &str) -> RequestState {
    wait::until(&format!("request {id} to end"), WITHIN, || async {
        match fleet.client.status(id).await {
            Ok(status) if status.state.is_terminal() => Ok(status.state),
            Ok(status) => Err(format!("{:?}", status.state)),
            Err(error) => Err(error.to_string()),
        }
    })
    .await
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().build().unwrap()
}

fn chat(gateway: &Gateway, body: Value) -> reqwest::RequestBuilder {
    http()
        .post(format!("{}/chat/completions", gateway.base_url()))
        .bearer_auth(KEY)
        .json(&body)
}

/// The `data:` payloads of an SSE response, as they come.
fn sse_data(response: reqwest::Response) -> impl futures_util::Stream<Item = String> {
    let mut buffer = String::new();
    response
        .bytes_stream()
        .take_while(|chunk| std::future::ready(chunk.is_ok()))
        .filter_map(|chunk| std::future::ready(chunk.ok()))
        .flat_map(move |bytes: bytes::Bytes| {
            buffer.push_str(&String::from_utf8_lossy(&bytes));
            let mut out = Vec::new();
            while let Some(end) = buffer.find("\n\n") {
                let frame: String = buffer.drain(..end + 2).collect();
                for line in frame.lines() {
                    if let Some(data) = line.strip_prefix("data: ") {
                        out.push(data.to_string());
                    }
                }
            }
            futures_util::stream::iter(out)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_runs_text_tools_genfleet_fields_errors_and_cancellation() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let abandoned = f.mock().abandoned_streams();
    let stdout = sdk(&gateway, "basics").await;

    // extra_body reached the request: its job name, its metadata and the key's tenant.
    let extra = printed(&stdout, "EXTRA_ID");
    let status = f.client.status(&extra).await.unwrap();
    let finished = status.finished.expect("a finished summary");
    let summary = serde_json::to_value(&finished).unwrap();
    assert_eq!(summary["job_name"], "py-gateway", "{summary}");

    // The stream the SDK closed: its request is cancelled, and the worker closed its backend
    // connection.
    let cancelled = printed(&stdout, "CANCELLED_ID");
    assert_eq!(terminal(&f, &cancelled).await, RequestState::Cancelled);
    let mock = f.mock();
    wait::until("the backend to see its stream closed", WITHIN, || async {
        mock.abandoned_streams() > abandoned
    })
    .await;

    // The metrics count by tenant.
    let metrics = http()
        .get(format!("http://127.0.0.1:{}/metrics", gateway.port))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(&format!("tenant=\"{TENANT}\"")) && metrics.contains("client_gone"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_runs_a_caller_tool_round_trip() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    sdk(&gateway, "caller-tools").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_and_extra_body_fields_reach_the_request_and_a_body_too_large_is_refused() {
    let f = fleet(1).await;
    let gateway = Gateway::start(
        &f,
        free_port(),
        &[("GENFLEET__GATEWAY__MAX_BODY_BYTES", "32768")],
    )
    .await;
    let mut events = Box::pin(f.client.follow("gw-meta-1").await.unwrap());
    let response = http()
        .post(format!("{}/chat/completions", gateway.base_url()))
        .bearer_auth(KEY)
        .body(vec![b' '; 64 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "payload_too_large", "{body}");
    let response = chat(
        &gateway,
        json!({"model": "default", "messages": [{"role": "user", "content": "Cy"}],
               "genfleet": {"request_id": "gw-meta-1", "metadata": {"tenant": "forged", "k": 1},
                            "job_name": "meta", "priority": "high", "session": "chat-7"}}),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-genfleet-request-id"], "gw-meta-1");
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "Hello from the mock, Cy!"
    );
    // The gateway released the result once delivered; the mock saw the request.
    let sent = f.mock().requests();
    assert!(
        sent.iter().any(|r| r.to_string().contains("Cy")),
        "{sent:?}"
    );
    // The finished event carries the result as stored: the key's tenant over the forged one.
    let result = wait::next_matching(
        "the finished event",
        WITHIN,
        &mut events,
        |event| match event.body {
            genfleet::protocol::EventBody::Finished { result } => Some(result),
            _ => None,
        },
    )
    .await;
    assert_eq!(result.metadata["tenant"], TENANT);
    assert_eq!(result.metadata["k"], 1);
    assert_eq!(
        result.tenant.as_deref(),
        Some(TENANT),
        "it ran as the key's tenant"
    );
    // genfleet.session is the affinity key (the first of its session: no worker preferred).
    let affinity = result
        .affinity
        .expect("a request with a key has an affinity record");
    assert_eq!(affinity.key, "chat-7");
    let status = f.client.status("gw-meta-1").await.unwrap();
    let summary = serde_json::to_value(status.finished.unwrap()).unwrap();
    assert_eq!(summary["job_name"], "meta", "{summary}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_hangs_up_cancels_its_request_running_or_queued() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let abandoned = f.mock().abandoned_streams();
    let mut running_events = Box::pin(f.client.follow("gw-hangup-run").await.unwrap());
    // Not streamed: the caller hangs up once the generation runs.
    let whole = tokio::spawn(
        chat(
            &gateway,
            json!({"model": "default", "messages": [{"role": "user", "content": "gw-slow"}],
                   "genfleet": {"request_id": "gw-hangup-run"}}),
        )
        .send(),
    );
    wait::within("the request runs", WITHIN, async {
        while let Some(event) = running_events.next().await {
            if event.body.name() == "delta" {
                return;
            }
        }
    })
    .await;
    // It runs as the key's tenant: the tenant token of the subject it was submitted on.
    let running = f.client.status("gw-hangup-run").await.unwrap();
    assert_eq!(running.tenant.as_deref(), Some(TENANT), "{running:?}");
    // The one slot is taken: this one waits in the durable queue.
    let queued = tokio::spawn(
        chat(
            &gateway,
            json!({"model": "default", "messages": [{"role": "user", "content": "queued"}],
                   "stream": true, "genfleet": {"request_id": "gw-hangup-queued"}}),
        )
        .send(),
    );
    let status = wait::until("gw-hangup-queued to be queued", WITHIN, || async {
        match f.client.status("gw-hangup-queued").await {
            Ok(status) if status.state == RequestState::Queued => Ok(status),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(status.tenant.as_deref(), Some(TENANT), "{status:?}");
    queued.abort();
    assert_eq!(
        terminal(&f, "gw-hangup-queued").await,
        RequestState::Cancelled
    );
    whole.abort();
    assert_eq!(terminal(&f, "gw-hangup-run").await, RequestState::Cancelled);
    // Its result says who cancelled it and why.
    let cancelled = f.client.result("gw-hangup-run", false).await.unwrap();
    assert_eq!(
        cancelled.detail.as_deref(),
        Some(
            "cancelled by its caller: the caller went away (its HTTP connection to the gateway closed)"
        ),
        "{cancelled:?}"
    );
    let mock = f.mock();
    wait::until("the backend to see its stream closed", WITHIN, || async {
        mock.abandoned_streams() > abandoned
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waits_too_long_for_a_slot_is_cancelled_with_a_clear_error() {
    let f = fleet(1).await;
    let gateway = Gateway::start(
        &f,
        free_port(),
        &[("GENFLEET__GATEWAY__QUEUE_WAIT_MS", "1000")],
    )
    .await;
    let mut events = Box::pin(f.client.follow("gw-busy").await.unwrap());
    // The response arrives once the request started; dropping it is hanging up.
    let busy = chat(
        &gateway,
        json!({"model": "default", "messages": [{"role": "user", "content": "gw-slow"}],
               "stream": true, "genfleet": {"request_id": "gw-busy"}}),
    )
    .send()
    .await
    .unwrap();
    wait::within("the slow request runs", WITHIN, async {
        while let Some(event) = events.next().await {
            if event.body.name() == "started" {
                return;
            }
        }
    })
    .await;
    // The open response counts in the replica's scaling signal.
    let scaling = || async {
        let url = format!("http://127.0.0.1:{}/scaling", gateway.port);
        let body: Value = http().get(url).send().await.unwrap().json().await.unwrap();
        body["open_responses"].as_i64().expect("a count")
    };
    assert_eq!(scaling().await, 1);
    let response = chat(
        &gateway,
        json!({"model": "default", "messages": [{"role": "user", "content": "late"}],
               "genfleet": {"request_id": "gw-late"}}),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(response.headers()["x-genfleet-request-id"], "gw-late");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "queue_timeout", "{body}");
    assert_eq!(terminal(&f, "gw-late").await, RequestState::Cancelled);
    drop(busy);
    let state = terminal(&f, "gw-busy").await;
    let status = f.client.status("gw-busy").await.unwrap();
    assert_eq!(state, RequestState::Cancelled, "{status:?}");
    wait::until("no response open", WITHIN, || async {
        match scaling().await {
            0 => Ok(()),
            open => Err(format!("{open} open")),
        }
    })
    .await;
}

/// A request that raised a decision and its continuation are one completion, their parts set
/// apart by a blank line (not glued into one sentence).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_chain_is_one_completion_with_its_parts_set_apart() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let mut asks = f
        .client
        .nats()
        .subscribe("signals.decision_request.>")
        .await
        .unwrap();
    f.client.nats().flush().await.unwrap();
    let response = tokio::spawn(
        chat(
            &gateway,
            json!({"model": "default",
                   "messages": [{"role": "user", "content": "gw-ask where the report goes"}]}),
        )
        .send(),
    );
    answer_next_decision(&f.client, &mut asks).await;
    let response = wait::within("the completion", WITHIN, response)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"], "Two places fit.\n\nFiled as chosen.",
        "{body}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_keeps_the_stream_open_and_its_continuation_streams_through_it() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let mut asks = f
        .client
        .nats()
        .subscribe("signals.decision_request.>")
        .await
        .unwrap();
    f.client.nats().flush().await.unwrap();
    let response = chat(
        &gateway,
        json!({"model": "default", "stream": true,
               "messages": [{"role": "user", "content": "gw-deploy build 7 to production"}],
               "genfleet": {"checkpoints": [{"name": "prod", "prompt_contains": ["production"],
                                             "message": "Deploy to production?"}]}}),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    let mut data = Box::pin(sse_data(response));
    // A manager answers the checkpoint while the response stays open.
    let signal = wait::within("the checkpoint asks", WITHIN, asks.next())
        .await
        .unwrap();
    let signal: Value = serde_json::from_slice(&signal.payload).unwrap();
    let decision_id = signal["decision"]["decision_id"]
        .as_str()
        .unwrap()
        .to_string();
    let answer = genfleet::protocol::DecisionAnswer {
        option_id: "proceed".into(),
        rationale: None,
        decided_by: Some("test".into()),
        modified_prompt: None,
        guidance: Some("go slowly".into()),
        confidence_boost: None,
    };
    f.client.decide(&decision_id, &answer).await.unwrap();
    let (mut text, mut finish, mut done) = (String::new(), None, false);
    wait::within("the stream ends", WITHIN, async {
        while let Some(frame) = data.next().await {
            if frame == "[DONE]" {
                done = true;
                break;
            }
            let chunk: Value = serde_json::from_str(&frame).unwrap();
            assert!(chunk.get("error").is_none(), "{chunk}");
            let choice = &chunk["choices"][0];
            text.push_str(choice["delta"]["content"].as_str().unwrap_or_default());
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = Some(reason.to_string());
            }
        }
    })
    .await;
    assert!(done, "no [DONE]");
    assert_eq!(finish.as_deref(), Some("stop"));
    assert!(
        text.contains("deployed: ") && text.contains("go slowly"),
        "{text:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_stopped_or_killed_leaves_no_request_running_and_comes_back() {
    let f = fleet(2).await;
    let port = free_port();
    let slow = |id: &str| {
        json!({"model": "default", "stream": true,
               "messages": [{"role": "user", "content": "gw-slow"}],
               "genfleet": {"request_id": id}})
    };
    // SIGTERM: the open stream may go on for gateway.drain_ms, then its request is cancelled
    // and the caller told so.
    let mut gateway = Gateway::start(&f, port, &[("GENFLEET__GATEWAY__DRAIN_MS", "500")]).await;
    let response = chat(&gateway, slow("gw-drained")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let mut data = Box::pin(sse_data(response));
    let first = wait::within("the first chunk", WITHIN, data.next()).await;
    assert!(first.is_some());
    gateway.stop("TERM").await;
    let rest: Vec<String> = wait::within("the end of the stream", WITHIN, data.collect()).await;
    let last = rest.last().cloned().unwrap_or_default();
    assert!(last.contains("gateway_shutdown"), "{rest:?}");
    assert_eq!(terminal(&f, "gw-drained").await, RequestState::Cancelled);

    // SIGKILL: nothing cancels, but the request carries the gateway's deadline
    // (gateway.max_request_ms), so it ends instead of running on.
    let mut gateway =
        Gateway::start(&f, port, &[("GENFLEET__GATEWAY__MAX_REQUEST_MS", "3000")]).await;
    let response = chat(&gateway, slow("gw-killed")).send().await.unwrap();
    let mut data = Box::pin(sse_data(response));
    assert!(
        wait::within("the first chunk", WITHIN, data.next())
            .await
            .is_some()
    );
    gateway.stop("KILL").await;
    // The caller gets a clean end of its stream (the connection closed), not a hang.
    let rest: Vec<String> = wait::within("the end of the stream", WITHIN, data.collect()).await;
    assert!(!rest.iter().any(|d| d == "[DONE]"), "{rest:?}");
    let state = terminal(&f, "gw-killed").await;
    assert_eq!(state, RequestState::Failed, "the deadline ends it");

    // Started again on the same address: it serves.
    let gateway = Gateway::start(&f, port, &[]).await;
    let response = chat(
        &gateway,
        json!({"model": "default", "messages": [{"role": "user", "content": "again"}]}),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "Hello from the mock, again!"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_left_unanswered_ends_the_completion_with_decision_timeout() {
    let f = fleet(1).await;
    let gateway = Gateway::start(
        &f,
        free_port(),
        &[("GENFLEET__GATEWAY__DECISION_WAIT_MS", "1500")],
    )
    .await;
    let response = chat(
        &gateway,
        json!({"model": "default",
               "messages": [{"role": "user", "content": "gw-deploy to production"}],
               "genfleet": {"request_id": "gw-unanswered",
                            "checkpoints": [{"name": "prod", "prompt_contains": ["production"]}]}}),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["finish_reason"], "decision_timeout",
        "{body}"
    );
    // The gateway's cancel expired the decision: nothing waits on it any more.
    wait::until(
        "the decision of gw-unanswered to expire",
        WITHIN,
        || async {
            let status = f.client.status("gw-unanswered").await.unwrap();
            if status.decision_outcome == Some(genfleet::protocol::DecisionOutcome::Expired) {
                Ok(())
            } else {
                Err(format!("{status:?}"))
            }
        },
    )
    .await;
}

#[test]
fn the_example_configuration_is_valid() {
    let settings =
        genfleet::settings::Settings::load(Some(&root().join("config/gateway.toml"))).unwrap();
    settings.gateway.validate().unwrap();
    assert_eq!(settings.gateway.models["gpt-4o-mini"].pool, "default");
    assert_eq!(
        settings.gateway.api_keys[0].sha256,
        genfleet::gateway::keys::hash_hex("demo-key-0123456789")
    );
}

#[tokio::test]
async fn with_no_api_key_the_gateway_refuses_to_listen_beyond_loopback() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["gateway", "--listen", &format!("0.0.0.0:{}", free_port())])
        .env("GENFLEET__NATS__URL", "nats://127.0.0.1:1")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no API key is configured") && stderr.contains("allow_unauthenticated"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_answered_abort_ends_the_completion_with_decision_aborted() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let mut asks = f
        .client
        .nats()
        .subscribe("signals.decision_request.>")
        .await
        .unwrap();
    f.client.nats().flush().await.unwrap();
    let pending = tokio::spawn(
        chat(
            &gateway,
            json!({"model": "default",
                   "messages": [{"role": "user", "content": "gw-deploy to production"}],
                   "genfleet": {"checkpoints": [{"name": "prod", "prompt_contains": ["production"]}]}}),
        )
        .send(),
    );
    let signal = wait::within("the checkpoint asks", WITHIN, asks.next())
        .await
        .unwrap();
    let signal: Value = serde_json::from_slice(&signal.payload).unwrap();
    let decision_id = signal["decision"]["decision_id"]
        .as_str()
        .unwrap()
        .to_string();
    let answer = genfleet::protocol::DecisionAnswer {
        option_id: "abort".into(),
        rationale: Some("not today".into()),
        decided_by: Some("test".into()),
        modified_prompt: None,
        guidance: None,
        confidence_boost: None,
    };
    f.client.decide(&decision_id, &answer).await.unwrap();
    let response = wait::within("the completion", WITHIN, pending)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["finish_reason"], "decision_aborted",
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_generation_is_an_openai_error_whole_or_streamed() {
    let f = fleet(2).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let slow = |stream: bool, id: &str| {
        json!({"model": "default", "stream": stream,
               "messages": [{"role": "user", "content": "gw-slow"}],
               "genfleet": {"request_id": id, "deadline_ms": 800}})
    };
    // Whole: the status and body of the reason (deadline_ms ran out: timeout).
    let response = chat(&gateway, slow(false, "gw-fail-whole"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 504);
    assert_eq!(response.headers()["x-genfleet-request-id"], "gw-fail-whole");
    // A timeout may pass on another try: the SDKs may retry it.
    assert_eq!(response.headers()["x-should-retry"], "true");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "timeout", "{body}");
    assert_eq!(body["error"]["type"], "timeout_error", "{body}");
    // The model's own failure would fail again: 422, and the SDKs are told not to retry.
    let response = chat(
        &gateway,
        json!({"model": "default", "messages": [{"role": "user", "content": "gw-badtool"}]}),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(response.status(), 422);
    assert_eq!(response.headers()["x-should-retry"], "false");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "tool_parse_error", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("`launch_rockets`, a tool this request does not offer")),
        "{body}"
    );
    // Streamed: the chunks so far, then an error frame in place of [DONE].
    let response = chat(&gateway, slow(true, "gw-fail-stream"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let frames: Vec<String> = wait::within(
        "the end of the stream",
        WITHIN,
        sse_data(response).collect(),
    )
    .await;
    let last: Value = serde_json::from_str(frames.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "timeout", "{frames:?}");
    assert!(!frames.iter().any(|f| f == "[DONE]"), "{frames:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_request_streams_as_it_is_generated() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let response = chat(
        &gateway,
        json!({"model": "default", "stream": true,
               "messages": [{"role": "user", "content": "Dee"}],
               "genfleet": {"durable": true}}),
    )
    .send()
    .await
    .unwrap();
    let frames: Vec<String> = wait::within(
        "the end of the stream",
        WITHIN,
        sse_data(response).collect(),
    )
    .await;
    let contents: Vec<String> = frames
        .iter()
        .filter_map(|f| serde_json::from_str::<Value>(f).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(contents.concat(), "Hello from the mock, Dee!");
    // The mock sends a word a chunk, and every delta is its own event: streamed, not sent
    // whole at the end.
    assert!(contents.len() > 1, "{frames:?}");
}

/// With two keys configured (two tenants), the API refuses a caller without a key or with a
/// wrong one (401 `invalid_api_key`, nothing sent to the fleet) and lets each key in as its own
/// tenant; `/metrics` answers without a key, and a wrong one changes nothing there: Prometheus
/// scrapes it holding no caller's key (docs/gateway.md, "API keys and tenants").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_keys_a_missing_or_wrong_key_is_refused_and_metrics_need_none() {
    const OTHER_KEY: &str = "sk-gateway-other-9876543210";
    const OTHER_TENANT: &str = "team-other";
    let f = fleet(1).await;
    let gateway = Gateway::start_with_keys(
        &f,
        free_port(),
        &[(KEY, TENANT), (OTHER_KEY, OTHER_TENANT)],
        &[],
    )
    .await;
    let completions = format!("{}/chat/completions", gateway.base_url());
    let body = |id: &str| {
        json!({"model": "default", "messages": [{"role": "user", "content": id}],
               "genfleet": {"request_id": id}})
    };
    let missing = "You didn't provide an API key";
    let wrong = "Incorrect API key provided";
    for (case, authorization, message) in [
        ("no key", None, missing),
        ("another scheme", Some(format!("Basic {KEY}")), missing),
        ("a wrong key", Some("Bearer sk-wrong".to_string()), wrong),
        (
            "a key one character off",
            Some(format!("Bearer {KEY}x")),
            wrong,
        ),
        (
            "the other key cut short",
            Some(format!("Bearer {}", &OTHER_KEY[..20])),
            wrong,
        ),
    ] {
        let id = format!("gw-refused-{}", case.replace(' ', "-"));
        for (route, request) in [
            (
                "chat completions",
                http().post(&completions).json(&body(&id)),
            ),
            (
                "models",
                http().get(format!("{}/models", gateway.base_url())),
            ),
        ] {
            let request = match &authorization {
                Some(value) => request.header("authorization", value),
                None => request,
            };
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 401, "{case} on {route}");
            let error: Value = response.json().await.unwrap();
            assert_eq!(
                (&error["error"]["type"], &error["error"]["code"]),
                (&json!("invalid_request_error"), &json!("invalid_api_key")),
                "{case} on {route}: {error}"
            );
            let said = error["error"]["message"].as_str().unwrap_or_default();
            assert!(said.starts_with(message), "{case} on {route}: {error}");
        }
        // Refused before anything reached the fleet.
        for tenant in [TENANT, OTHER_TENANT] {
            let client = f.client.clone().with_tenant(tenant).unwrap();
            let unknown = client.status(&id).await.unwrap_err();
            assert_eq!(
                unknown.code(),
                Some(genfleet::protocol::ErrorCode::NotFound),
                "{case}: {unknown}"
            );
        }
    }
    let prompts = serde_json::to_string(&f.mock().requests()).unwrap();
    assert!(!prompts.contains("gw-refused"), "{prompts}");

    // Each key is let in, as its own tenant.
    for (key, tenant, id) in [
        (KEY, TENANT, "gw-key-one"),
        (OTHER_KEY, OTHER_TENANT, "gw-key-two"),
    ] {
        let response = http()
            .post(&completions)
            .bearer_auth(key)
            .json(&body(id))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{tenant}");
        let answer: Value = response.json().await.unwrap();
        assert_eq!(
            answer["choices"][0]["message"]["content"],
            format!("Hello from the mock, {id}!"),
            "{answer}"
        );
        let client = f.client.clone().with_tenant(tenant).unwrap();
        let status = client.status(id).await.unwrap();
        assert_eq!(status.state, RequestState::Completed, "{status:?}");
        let summary = serde_json::to_value(status.finished.unwrap()).unwrap();
        assert_eq!(summary["request_id"], format!("{tenant}.{id}"), "{summary}");
    }

    // /metrics: no key needed, and a wrong one is not read. It counts both tenants' answers
    // and shows neither key.
    for (case, authorization) in [("no key", None), ("a wrong key", Some("Bearer sk-wrong"))] {
        let mut request = http().get(format!("http://127.0.0.1:{}/metrics", gateway.port));
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 200, "{case}");
        let kind = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(
            kind.starts_with("application/openmetrics-text"),
            "{case}: {kind}"
        );
        let text = response.text().await.unwrap();
        for tenant in [TENANT, OTHER_TENANT] {
            let counted = text.lines().find(|line| {
                line.starts_with("genfleet_gateway_requests_total{")
                    && line.contains(&format!("tenant=\"{tenant}\""))
                    && line.contains("outcome=\"stop\"")
            });
            assert_eq!(
                counted.and_then(|line| line.split_whitespace().last()),
                Some("1"),
                "{case}: {tenant}'s completion in\n{text}"
            );
        }
        assert!(
            !text.contains(KEY) && !text.contains(OTHER_KEY),
            "{case}: a key in the metrics:\n{text}"
        );
    }
}
