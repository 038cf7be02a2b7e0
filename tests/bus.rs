//! The worker on a real nats-server with the mock backend: the subjects of the wire contract
//! that this worker serves, in both encodings.

mod common;

use std::cell::Cell;
use std::time::Duration;

use common::fleet::{self, Fleet, request as req};
use common::wait;
use futures_util::StreamExt;
use genfleet::client::Client;
use genfleet::protocol::{Encoding, ErrorCode, EventBody, GenerationRequest, Reason, RequestState};
use serde_json::json;

/// How long anything here may take: generous, a busy machine is slow, never wrong.
const WITHIN: Duration = Duration::from_secs(20);

async fn fleet(script: &str, workers: usize, slots: u32) -> Fleet {
    Fleet::builder()
        .script(script)
        .workers(workers)
        .slots(slots)
        .start()
        .await
}

async fn wait_terminal(client: &Client, id: &str) -> genfleet::protocol::GenerationResult {
    fleet::wait_result(client, id, Duration::from_secs(10), fleet::RUNNING).await
}

#[tokio::test]
async fn submit_streams_events_and_stores_the_result_for_any_worker() {
    let f = fleet("[[rules]]\nreply = \"Hello from the fleet.\"\n", 1, 2).await;
    let mut events = Box::pin(f.client.follow("r1").await.unwrap());
    let accepted = f.client.submit("default", &req("r1", "hi")).await.unwrap();
    assert_eq!(
        (accepted.request_id.as_str(), accepted.state),
        ("r1", RequestState::Running)
    );
    assert_eq!(accepted.worker_id, f.workers[0].worker_id);
    let seen = wait::collect_until("the finished event", WITHIN, &mut events, |event| {
        matches!(event.body, EventBody::Finished { .. })
    })
    .await;
    let names: Vec<&str> = seen.iter().map(|e| e.body.name()).collect();
    assert_eq!(names.first(), Some(&"started"));
    assert_eq!(names.last(), Some(&"finished"));
    assert_eq!(
        seen.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (0..seen.len() as u64).collect::<Vec<_>>()
    );
    // `finished` goes out after the result is stored.
    let status = f.client.status("r1").await.unwrap();
    assert_eq!(status.state, RequestState::Completed);
    let peek = f.client.result("r1", false).await.unwrap();
    assert_eq!(peek.output, "Hello from the fleet.");
    let read = f.client.result("r1", true).await.unwrap();
    assert_eq!(read, peek);
    assert_eq!(
        f.client.result("r1", true).await.unwrap_err().code(),
        Some(ErrorCode::NotFound)
    );
    // The tombstone keeps the state.
    assert_eq!(
        f.client.status("r1").await.unwrap().state,
        RequestState::Completed
    );
    assert_eq!(
        f.client.status("nope").await.unwrap_err().code(),
        Some(ErrorCode::NotFound)
    );
    // The worker keeps no copy of results the shared store holds.
    let stats = f
        .client
        .nats()
        .request(
            format!("gen.worker.{}.capacity", f.workers[0].worker_id),
            "".into(),
        )
        .await
        .unwrap();
    let stats: serde_json::Value = serde_json::from_slice(&stats.payload).unwrap();
    assert_eq!(
        (
            stats["running"].as_u64(),
            stats["retained_results"].as_u64()
        ),
        (Some(0), Some(0)),
        "{stats}"
    );
}

#[tokio::test]
async fn messagepack_requests_get_messagepack_replies() {
    let f = fleet("[[rules]]\nreply = \"packed\"\n", 1, 1).await;
    let client = f.client.clone().with_encoding(Encoding::MsgPack);
    let result = client
        .run("default", req("m1", "x"), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(result.output, "packed");
    // A raw MessagePack request, checked byte for byte.
    let body = rmp_serde::to_vec_named(
        &json!({"messages": [{"role": "user", "content": "y"}], "request_id": "m2"}),
    )
    .unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Content-Type", "application/msgpack");
    let reply = common::fleet::submit_raw(f.client.nats(), "default", headers, body)
        .await
        .unwrap();
    assert_eq!(
        reply
            .headers
            .as_ref()
            .and_then(|h| h.get("Content-Type"))
            .map(|v| v.as_str()),
        Some("application/msgpack")
    );
    let accepted: serde_json::Value = rmp_serde::from_slice(&reply.payload).unwrap();
    assert_eq!(accepted["request_id"], "m2");
    wait_terminal(&f.client, "m2").await;
}

#[tokio::test]
async fn bad_input_gets_clear_error_replies_and_the_worker_goes_on() {
    let f = Fleet::builder()
        .script("[[rules]]\nreply = \"fine\"\n")
        .slots(1)
        .settings(|s| s.limits.max_request_bytes = 4096)
        .start()
        .await;
    let nats = f.client.nats();
    let cases: Vec<(bytes::Bytes, ErrorCode, &str)> = vec![
        (
            b"not json".to_vec().into(),
            ErrorCode::InvalidRequest,
            "JSON",
        ),
        (
            br#"{"messages": [{"role": "user", "content": "x"}], "bogus": 1}"#
                .to_vec()
                .into(),
            ErrorCode::InvalidRequest,
            "bogus",
        ),
        (
            br#"{"messages": []}"#.to_vec().into(),
            ErrorCode::InvalidRequest,
            "messages",
        ),
        (
            br#"{"messages": [{"role": "user", "content": "x"}], "tools": ["nope"]}"#
                .to_vec()
                .into(),
            ErrorCode::InvalidRequest,
            "nope",
        ),
        (vec![b' '; 5000].into(), ErrorCode::PayloadTooLarge, "bytes"),
    ];
    for (body, code, needle) in cases {
        let reply = common::fleet::submit_raw(nats, "default", Default::default(), body)
            .await
            .unwrap();
        let error: genfleet::protocol::ErrorReply = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(error.error.code, code, "{}", error.error.message);
        assert!(
            error.error.message.contains(needle),
            "{}",
            error.error.message
        );
        let headers = reply.headers.unwrap();
        assert!(headers.get("Nats-Service-Error-Code").is_some());
    }
    let reply = nats.request("gen.result.a.b", "".into()).await;
    assert!(reply.is_err() || !reply.unwrap().payload.is_empty());
    let result = f
        .client
        .run("default", req("after", "x"), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(result.output, "fine");
}

#[tokio::test]
async fn a_full_worker_answers_no_slot_and_a_pool_without_workers_is_no_slot_too() {
    let f = fleet(
        "[[rules]]\nreply = \"a b c d e f g h\"\ndelay_ms = 100\n",
        1,
        1,
    )
    .await;
    f.client.submit("default", &req("busy", "x")).await.unwrap();
    let err = f
        .client
        .submit("default", &req("second", "x"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NoSlotAvailable), "{err}");
    // The worker's own answer (it stays in the queue group while full), not "no responders".
    assert!(err.to_string().contains("is full"), "{err}");
    let done = wait_terminal(&f.client, "busy").await;
    assert_eq!(done.reason, Reason::Stop);
    // The slot is free again.
    fleet::submit_until_accepted(
        &f.client,
        "default",
        &req("third", "x"),
        Duration::from_secs(10),
    )
    .await;
    wait_terminal(&f.client, "third").await;
    let none = f
        .client
        .submit("other-pool", &req("x1", "x"))
        .await
        .unwrap_err();
    assert_eq!(none.code(), Some(ErrorCode::NoSlotAvailable), "{none}");
    assert!(
        none.to_string().contains(
            "no worker of pool other-pool is connected (pools with workers now: default)"
        ),
        "{none}"
    );
}

#[tokio::test]
async fn two_workers_share_a_pool_and_cancel_reaches_the_one_running_the_request() {
    let f = fleet(
        "[[rules]]\nreply = \"a b c d e f g h i j k l m n o p q r s t\"\ndelay_ms = 100\n",
        2,
        1,
    )
    .await;
    let mut c1_events = Box::pin(f.client.follow("c1").await.unwrap());
    let mut c2_events = Box::pin(f.client.follow("c2").await.unwrap());
    f.client.submit("default", &req("c1", "x")).await.unwrap();
    f.client.submit("default", &req("c2", "x")).await.unwrap();
    let owners: Vec<String> = vec![
        f.client.status("c1").await.unwrap().worker_id.unwrap(),
        f.client.status("c2").await.unwrap().worker_id.unwrap(),
    ];
    assert_ne!(owners[0], owners[1], "one request per worker");
    // Both are under way: each has streamed its first word.
    for (id, events) in [("c1", &mut c1_events), ("c2", &mut c2_events)] {
        wait::next_matching(&format!("the first delta of {id}"), WITHIN, events, |e| {
            matches!(e.body, EventBody::Delta { .. }).then_some(())
        })
        .await;
    }
    // Whichever worker receives the cancel, the owner cancels.
    for id in ["c1", "c2"] {
        let reply = f.client.cancel(id).await.unwrap();
        assert_eq!(reply.state, RequestState::Cancelled, "{id}");
        let result = f.client.result(id, true).await.unwrap();
        assert_eq!(result.reason, Reason::Cancelled);
        assert!(
            !result.output.is_empty() && result.output.len() < 40,
            "partial: {:?}",
            result.output
        );
    }
    let err = f.client.cancel("c1").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::AlreadyFinished));
    assert_eq!(
        f.client.cancel("ghost").await.unwrap_err().code(),
        Some(ErrorCode::NotFound)
    );
    let status = f.client.status("c2").await.unwrap();
    assert_eq!(status.state, RequestState::Cancelled);
}

#[tokio::test]
async fn signals_are_published_and_captured_by_the_signals_stream() {
    let script = r#"
[[rules]]
reply = "Need a call."
tool_calls = [{ name = "request_decision", arguments = { question = "Which?", options = [{ id = "a", label = "A" }, { id = "b", label = "B" }] } }]
"#;
    let f = fleet(script, 1, 1).await;
    let mut signals = f.client.nats().subscribe("signals.>").await.unwrap();
    let result = f
        .client
        .run("default", req("s1", "x"), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(result.reason, Reason::DecisionRequested);
    let message = wait::within("the decision request's signal", WITHIN, signals.next())
        .await
        .unwrap();
    assert_eq!(
        message.subject.as_str(),
        "signals.decision_request.NEEDS_MANAGER_DECISION"
    );
    let signal: genfleet::protocol::Signal = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(signal.request_id, "s1");
    assert!(signal.decision.is_some());
    let js = async_nats::jetstream::new(f.client.nats().clone());
    let mut stream = js.get_stream("GENFLEET_SIGNALS").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
}

#[tokio::test]
async fn the_service_api_finds_every_worker_with_its_slots() {
    let f = fleet("[[rules]]\nreply = \"x\"\n", 2, 3).await;
    let nats = f.client.nats();
    let inbox = nats.new_inbox();
    let mut replies = nats.subscribe(inbox.clone()).await.unwrap();
    nats.publish_with_reply("$SRV.INFO.genfleet", inbox, "".into())
        .await
        .unwrap();
    // Both workers answer.
    let mut answered = 0;
    let infos: Vec<serde_json::Value> =
        wait::collect_until("the INFO of both workers", WITHIN, &mut replies, |_| {
            answered += 1;
            answered == 2
        })
        .await
        .iter()
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
        .collect();
    assert!(
        infos
            .iter()
            .all(|i| i["metadata"]["pool"] == "default" && i["metadata"]["slots"] == "3")
    );
    let stats = nats
        .request(
            format!("$SRV.STATS.genfleet.{}", infos[0]["id"].as_str().unwrap()),
            "".into(),
        )
        .await
        .unwrap();
    let stats: serde_json::Value = serde_json::from_slice(&stats.payload).unwrap();
    assert_eq!(stats["endpoints"][0]["data"]["slots"], 3);
    assert_eq!(stats["endpoints"][0]["data"]["free"], 3);
}

#[tokio::test]
async fn shutdown_drains_running_requests_and_another_worker_serves_the_result() {
    let mut f = fleet("[[rules]]\nreply = \"a b c d e\"\ndelay_ms = 60\n", 2, 1).await;
    f.client.submit("default", &req("d1", "x")).await.unwrap();
    let owner = f.client.status("d1").await.unwrap().worker_id.unwrap();
    let index = f.workers.iter().position(|w| w.worker_id == owner).unwrap();
    let worker = f.workers.remove(index);
    tokio::task::spawn_blocking(move || worker.stop())
        .await
        .unwrap()
        .unwrap();
    // The drain let the request finish; its result is in the shared store.
    let result = f.client.result("d1", true).await.unwrap();
    assert_eq!(
        (result.reason, result.output.as_str()),
        (Reason::Stop, "a b c d e")
    );
    assert_eq!(result.worker_id, owner);
}

const DECIDE: &str = r#"
[[rules]]
when_last_user_contains = "Decision chosen"
reply = "Proceeding: {{last_user}}"
[[rules]]
reply = "Two ways to go."
tool_calls = [{ name = "request_decision", arguments = { question = "Which path?", options = [{ id = "fast", label = "Fast" }, { id = "safe", label = "Safe" }], default_option = "safe" } }]
"#;

#[tokio::test]
async fn a_decision_answer_starts_a_continuation_with_the_choice_injected() {
    let f = fleet(DECIDE, 1, 2).await;
    let mut signals = f.client.nats().subscribe("signals.>").await.unwrap();
    let mut events = Box::pin(f.client.follow("orig").await.unwrap());
    let mut original = req("orig", "Plan the migration.");
    original.system = Some("Be careful.".into());
    original.job_name = Some("migrate".into());
    let first = f
        .client
        .run("default", original, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(first.reason, Reason::DecisionRequested);
    let decision = first.signals[0].decision.clone().unwrap();
    assert!(decision.expires_at.is_some());
    let request_signal = wait::within("the decision request's signal", WITHIN, signals.next())
        .await
        .unwrap();
    assert_eq!(
        request_signal.subject.as_str(),
        "signals.decision_request.NEEDS_MANAGER_DECISION"
    );
    let nats = f.client.nats();
    let ask = |body: serde_json::Value| {
        let nats = nats.clone();
        let subject = format!("decisions.{}", decision.decision_id);
        async move {
            let reply = nats
                .request(subject, serde_json::to_vec(&body).unwrap().into())
                .await
                .unwrap();
            serde_json::from_slice::<serde_json::Value>(&reply.payload).unwrap()
        }
    };
    let bad = ask(json!({"option_id": "warp"})).await;
    assert_eq!(bad["error"]["code"], "INVALID_OPTION");
    assert_eq!(
        bad["error"]["detail"]["valid_options"],
        json!(["fast", "safe"])
    );
    let reply =
        ask(json!({"option_id": "fast", "rationale": "deadline", "decided_by": "ops"})).await;
    assert_eq!(reply["outcome"], "continued", "{reply}");
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    // The same answer again: the same continuation (and no second run).
    let again = ask(json!({"option_id": "fast"})).await;
    assert_eq!(again["continuation_request_id"], continuation.as_str());
    let other = ask(json!({"option_id": "safe"})).await;
    assert_eq!(other["error"]["code"], "ALREADY_DECIDED");
    assert_eq!(other["error"]["detail"]["decided_by"], "ops");
    assert_eq!(
        ask(json!({"option_id": "fast", "x": 1})).await["error"]["code"],
        "INVALID_REQUEST"
    );
    let unknown = nats
        .request("decisions.nosuch", b"{\"option_id\":\"a\"}".to_vec().into())
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&unknown.payload).contains("NOT_FOUND"));

    let next = wait_terminal(&f.client, &continuation).await;
    assert_eq!(
        (next.state, next.chain_position, next.tool_iterations_used),
        (RequestState::Completed, 2, 0)
    );
    assert_eq!(next.parent_request_id.as_deref(), Some("orig"));
    assert_eq!(next.root_request_id, "orig");
    assert_eq!(next.job_name.as_deref(), Some("migrate"));
    assert!(
        next.output.contains("Decision chosen: Fast (fast)") && next.output.contains("deadline"),
        "{}",
        next.output
    );
    let asked = f.mock().requests().last().unwrap().clone();
    assert_eq!(
        asked["messages"][1]["content"], "Be careful.",
        "the caller system is restated"
    );
    let status = f.client.status("orig").await.unwrap();
    assert_eq!(
        status.continuation_request_id.as_deref(),
        Some(continuation.as_str())
    );
    // `continued` on the original's subject, after `finished`, numbered on.
    let seen = wait::collect_until("the continued event", WITHIN, &mut events, |event| {
        matches!(event.body, EventBody::Continued { .. })
    })
    .await;
    let names: Vec<&str> = seen.iter().map(|e| e.body.name()).collect();
    assert_eq!(
        &names[names.len() - 2..],
        ["finished", "continued"],
        "{names:?}"
    );
    assert_eq!(
        seen.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (0..seen.len() as u64).collect::<Vec<_>>()
    );
    // The outcome signal says who chose what.
    let decided = wait::next_matching("signals.outcome.DECIDED", WITHIN, &mut signals, |m| {
        (m.subject.as_str() == "signals.outcome.DECIDED")
            .then(|| serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap())
    })
    .await;
    assert_eq!(
        (
            decided["meta"]["option_id"].as_str(),
            decided["meta"]["decided_by"].as_str()
        ),
        (Some("fast"), Some("ops"))
    );
}

#[tokio::test]
async fn a_nats_restart_under_a_running_worker_loses_nothing_and_leaks_no_slot() {
    let mut f = fleet(
        "[[rules]]\nreply = \"one two three four five six seven eight\"\ndelay_ms = 100\n",
        1,
        2,
    )
    .await;
    let mut events = Box::pin(f.client.follow("across").await.unwrap());
    f.client
        .submit("default", &req("across", "x"))
        .await
        .unwrap();
    // The generation is under way (its first word out, seven to come) when NATS goes.
    wait::next_matching("the first delta", WITHIN, &mut events, |e| {
        matches!(e.body, EventBody::Delta { .. }).then_some(())
    })
    .await;
    f.nats.kill().await;
    f.nats.restart().await;
    // The request that ran across the restart is stored once the worker is back.
    let result = wait::until(
        "the result to reach the store after the restart",
        WITHIN,
        || async { f.client.result("across", false).await },
    )
    .await;
    assert_eq!(
        (result.reason, result.output.as_str()),
        (Reason::Stop, "one two three four five six seven eight")
    );
    // The worker serves submits again and its slots are all free.
    let after = f
        .client
        .run(
            "default",
            req("after-restart", "x"),
            Duration::from_secs(15),
        )
        .await
        .unwrap();
    assert_eq!(after.reason, Reason::Stop);
    let stats = f
        .client
        .nats()
        .request("$SRV.STATS.genfleet", "".into())
        .await
        .unwrap();
    let stats: serde_json::Value = serde_json::from_slice(&stats.payload).unwrap();
    assert_eq!(stats["endpoints"][0]["data"]["free"], 2, "{stats}");
}

#[tokio::test]
async fn genfleet_fleet_lists_the_workers() {
    let f = fleet("[[rules]]\nreply = \"x\"\n", 2, 3).await;
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["fleet", "--json"])
        .env("GENFLEET__NATS__URL", f.nats.url())
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    let mut ids: Vec<&str> = rows
        .iter()
        .map(|r| r["worker_id"].as_str().unwrap())
        .collect();
    ids.sort();
    let mut expected: Vec<&str> = f.workers.iter().map(|w| w.worker_id.as_str()).collect();
    expected.sort();
    assert_eq!(ids, expected);
    assert!(
        rows.iter()
            .all(|r| r["pool"] == "default" && r["slots"] == 3 && r["free"] == 3)
    );

    // The table for people: one aligned row per worker, then the totals.
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .arg("fleet")
        .env("GENFLEET__NATS__URL", f.nats.url())
        .output()
        .await
        .unwrap();
    let table = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "{table}");
    let free_column = lines[0].find("FREE").unwrap();
    for row in &lines[1..3] {
        assert!(expected.iter().any(|id| row.starts_with(id)), "{table}");
        // Numbers are right-aligned under their headings.
        assert_eq!(&row[free_column..free_column + 4], "   3", "{table}");
        assert!(row.contains("default"), "{table}");
    }
    assert_eq!(lines[3], "2 workers, 0/6 slots busy", "{table}");
}

const CALLS_ADD: &str = r#"
[[rules]]
when_last_role = "tool"
reply = "The tool said {{last_message}}"
[[rules]]
tool_calls = [{ name = "add", arguments = { a = 2, b = 3 } }]
"#;

#[tokio::test]
async fn tools_registered_in_kv_become_callable_and_withdrawn_ones_unknown() {
    let f = fleet(CALLS_ADD, 1, 1).await;
    let nats = f.client.nats().clone();
    // A tool service on tools.add that checks the correlation headers.
    let mut service = nats.subscribe("tools.add").await.unwrap();
    let responder = nats.clone();
    tokio::spawn(async move {
        while let Some(m) = service.next().await {
            let headers = m.headers.clone().unwrap_or_default();
            let args: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
            let sum = args["a"].as_f64().unwrap() + args["b"].as_f64().unwrap();
            let reply = json!({"result": {"sum": sum, "request_id": headers.get("Genfleet-Request-Id").map(|v| v.as_str()), "call_id": headers.get("Genfleet-Call-Id").is_some()}});
            responder
                .publish(m.reply.unwrap(), serde_json::to_vec(&reply).unwrap().into())
                .await
                .unwrap();
        }
    });
    let mut with_tool = req("t1", "add");
    with_tool.tools = vec!["add".into()];
    let err = f.client.submit("default", &with_tool).await.unwrap_err();
    assert_eq!(
        err.code(),
        Some(ErrorCode::InvalidRequest),
        "not registered yet"
    );
    let js = async_nats::jetstream::new(nats.clone());
    let bucket = js.get_key_value("GENFLEET_TOOLS").await.unwrap();
    let definition = json!({"name": "add", "brief": "Add two numbers", "schema": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}});
    bucket
        .put("add", serde_json::to_vec(&definition).unwrap().into())
        .await
        .unwrap();
    // The registered tool becomes callable.
    let result = fleet::run_when_tools_known(&f.client, &with_tool, Duration::from_secs(10)).await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    assert!(
        result.output.contains("\"sum\":5.0") && result.output.contains("\"request_id\":\"t1\""),
        "{}",
        result.output
    );
    // An update (a new brief) reaches the prompts of later requests.
    let mut updated = definition.clone();
    updated["brief"] = json!("Add up two numbers exactly");
    bucket
        .put("add", serde_json::to_vec(&updated).unwrap().into())
        .await
        .unwrap();
    let sent = Cell::new(0);
    wait::until(
        "an updated registration to replace the old one in the prompts",
        WITHIN,
        || async {
            let mut again = with_tool.clone();
            again.request_id = Some(format!("upd{}", sent.get()));
            sent.set(sent.get() + 1);
            f.client
                .run("default", again, Duration::from_secs(10))
                .await
                .unwrap();
            let offered = f.mock().requests().last().unwrap()["tools"].to_string();
            offered.contains("Add up two numbers exactly")
        },
    )
    .await;
    bucket.delete("add").await.unwrap();
    wait::until("a withdrawn tool to be unknown again", WITHIN, || async {
        let mut again = with_tool.clone();
        again.request_id = Some(format!("t-{}", ulid::Ulid::generate()));
        match f.client.submit("default", &again).await {
            Err(e) if e.code() == Some(ErrorCode::InvalidRequest) => true,
            _ => {
                wait_terminal(&f.client, again.request_id.as_deref().unwrap()).await;
                false
            }
        }
    })
    .await;
}

#[tokio::test]
async fn configured_tools_without_a_service_fail_with_tool_execution_error() {
    let f = Fleet::builder()
        .script(CALLS_ADD)
        .slots(1)
        .settings(|s| {
            s.tools.definitions = vec![
                serde_json::from_value(
                    json!({"name": "add", "brief": "Add two numbers", "schema": {"type": "object"}}),
                )
                .unwrap(),
            ];
        })
        .start()
        .await;
    let mut with_tool = req("nosvc", "add");
    with_tool.tools = vec!["add".into()];
    let result = f
        .client
        .run("default", with_tool, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(result.reason, Reason::ToolExecutionError, "{result:?}");
    assert!(result.detail.unwrap().contains("no tool service"));
}

#[tokio::test]
async fn a_request_is_one_record_from_its_claim_to_its_result() {
    // One key per request: the claim creates it (naming the worker), the end replaces it by the
    // result, so an ended request leaves nothing else behind. The fleet's index of who runs what
    // travels in the heartbeats. `slow` runs until it is cancelled (60 s of tokens).
    let f = fleet(
        "[[rules]]\nwhen_last_user_contains = \"slow\"\nreply = \"a b c d e f g h i j k l m n o p q r s t\"\ndelay_ms = 3000\n\n[[rules]]\nreply = \"done\"\n",
        2,
        2,
    )
    .await;
    f.client
        .submit("default", &req("i1", "quick"))
        .await
        .unwrap();
    let accepted = f
        .client
        .submit("default", &req("s1", "slow"))
        .await
        .unwrap();
    f.client
        .enqueue("default", &req("d1", "quick"))
        .await
        .unwrap();
    // Refused claims: the id is running.
    for _ in 0..2 {
        let e = f
            .client
            .submit("default", &req("s1", "x"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::DuplicateRequestId), "{e}");
    }
    // While s1 runs, its record names its worker, and that worker's heartbeat lists it.
    let live = common::fleet::record(f.client.nats(), "s1").await.unwrap();
    assert_eq!(live["live"]["worker_id"], accepted.worker_id, "{live}");
    assert_eq!(live["live"]["state"], "RUNNING", "{live}");
    wait::until("a heartbeat to list s1", WITHIN, || async {
        common::fleet::heartbeats(f.client.nats())
            .await
            .get(&accepted.worker_id)
            .is_some_and(|running| running.iter().any(|id| id == "s1"))
    })
    .await;
    f.client.cancel("s1").await.unwrap();
    for id in ["i1", "s1", "d1"] {
        wait_terminal(&f.client, id).await;
        let record = common::fleet::record(f.client.nats(), id).await.unwrap();
        assert!(record.get("live").is_none(), "{id}: {record}");
        assert_eq!(record["request_id"], id, "{record}");
    }
    common::fleet::wait_only_results_left(f.client.nats(), Duration::from_secs(10)).await;
    // The heartbeats stop listing what ended.
    wait::until("the heartbeats to list nothing running", WITHIN, || async {
        let beats = common::fleet::heartbeats(f.client.nats()).await;
        if beats.values().all(|running| running.is_empty()) {
            Ok(())
        } else {
            Err(format!("{beats:?}"))
        }
    })
    .await;
}

#[tokio::test]
async fn a_request_id_in_use_anywhere_in_the_fleet_is_refused() {
    let f = fleet("[[rules]]\nreply = \"a b c d e f\"\ndelay_ms = 100\n", 2, 2).await;
    f.client.submit("default", &req("dup", "x")).await.unwrap();
    // Whichever worker the second submit reaches, the id is taken.
    for _ in 0..4 {
        let err = f
            .client
            .submit("default", &req("dup", "x"))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::DuplicateRequestId), "{err}");
    }
    wait_terminal(&f.client, "dup").await;
    // A stored result (or its tombstone) keeps the id taken too.
    assert_eq!(
        f.client
            .submit("default", &req("dup", "x"))
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::DuplicateRequestId)
    );
    f.client.result("dup", true).await.unwrap();
    assert_eq!(
        f.client
            .submit("default", &req("dup", "x"))
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::DuplicateRequestId)
    );
}

#[tokio::test]
async fn of_concurrent_readers_exactly_one_gets_the_result() {
    let f = fleet("[[rules]]\nreply = \"once\"\n", 2, 2).await;
    f.client.submit("default", &req("once", "x")).await.unwrap();
    wait_terminal(&f.client, "once").await;
    let reads =
        futures_util::future::join_all((0..12).map(|_| f.client.result("once", true))).await;
    let got: Vec<_> = reads.iter().filter(|r| r.is_ok()).collect();
    assert_eq!(got.len(), 1, "{reads:?}");
    assert!(
        reads
            .iter()
            .filter(|r| r.is_err())
            .all(|r| r.as_ref().unwrap_err().code() == Some(ErrorCode::NotFound))
    );
}

#[tokio::test]
async fn every_request_reply_subject_answers_messagepack_in_messagepack() {
    let f = fleet(DECIDE, 1, 2).await;
    let first = f
        .client
        .run("default", req("mp", "x"), Duration::from_secs(10))
        .await
        .unwrap();
    let decision = first.signals[0].decision.clone().unwrap();
    let nats = f.client.nats();
    let ask = |subject: String, body: serde_json::Value| {
        let nats = nats.clone();
        async move {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Content-Type", "application/msgpack");
            let reply = nats
                .request_with_headers(
                    subject,
                    headers,
                    rmp_serde::to_vec_named(&body).unwrap().into(),
                )
                .await
                .unwrap();
            let content_type = reply
                .headers
                .as_ref()
                .and_then(|h| h.get("Content-Type"))
                .map(|v| v.as_str().to_string());
            assert_eq!(content_type.as_deref(), Some("application/msgpack"));
            rmp_serde::from_slice::<serde_json::Value>(&reply.payload).unwrap()
        }
    };
    assert_eq!(
        ask("gen.status.mp".into(), json!({})).await["state"],
        "COMPLETED"
    );
    assert_eq!(
        ask("gen.result.mp".into(), json!({"release": false})).await["error"]["code"],
        "NOT_FOUND",
        "`run` read and released the result; the answer comes in MessagePack all the same"
    );
    let reply = ask(
        format!("decisions.{}", decision.decision_id),
        json!({"option_id": "safe", "decided_by": "mp"}),
    )
    .await;
    assert_eq!(reply["outcome"], "continued");
    // Answered, so no longer waiting on its decision: nothing left to cancel.
    assert_eq!(
        ask("gen.cancel.mp".into(), json!({})).await["error"]["code"],
        "ALREADY_FINISHED"
    );
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    wait_terminal(&f.client, &continuation).await;
    assert_eq!(
        ask("gen.status.nope".into(), json!({})).await["error"]["code"],
        "NOT_FOUND"
    );
}

#[tokio::test]
async fn genfleet_decide_answers_from_the_command_line() {
    let f = fleet(DECIDE, 1, 1).await;
    let first = f
        .client
        .run("default", req("cli", "x"), Duration::from_secs(10))
        .await
        .unwrap();
    let decision = first.signals[0].decision.clone().unwrap();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args([
            "decide",
            &decision.decision_id,
            "fast",
            "--rationale",
            "why not",
            "--decided-by",
            "cli-test",
            "--json",
        ])
        .env("GENFLEET__NATS__URL", f.nats.url())
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let reply: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let next = wait_terminal(
        &f.client,
        reply["continuation_request_id"].as_str().unwrap(),
    )
    .await;
    assert!(next.output.contains("Decision chosen: Fast (fast)"));
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["decide", &decision.decision_id, "safe"])
        .env("GENFLEET__NATS__URL", f.nats.url())
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("ALREADY_DECIDED") && stderr.lines().count() == 1,
        "{stderr}"
    );
    // It says by whom, when and with which option.
    assert!(
        stderr.contains("already answered by cli-test at 20")
            && stderr.contains("with option fast"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_store_failure_is_an_internal_error_reply_not_a_crash() {
    let f = fleet("[[rules]]\nreply = \"x\"\n", 1, 1).await;
    let js = async_nats::jetstream::new(f.client.nats().clone());
    js.delete_stream("KV_GENFLEET_RESULTS").await.unwrap();
    let err = f.client.status("gone").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Internal), "{err}");
    // The worker is still there and says so for every request.
    let err = f.client.result("gone", true).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Internal), "{err}");
}

#[tokio::test]
async fn a_result_larger_than_the_servers_max_payload_is_stored_with_its_messages_trimmed() {
    const MAX_PAYLOAD: usize = 64 * 1024;
    // Text that does not repeat, or the loop detector would stop it.
    let mut seed = 7u64;
    let answer: String = (0..20 * 1024)
        .map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            b"abcdefghijklmnopqrstuvwxyz     "[(seed >> 33) as usize % 31] as char
        })
        .collect();
    let f = Fleet::builder()
        .nats_config(format!("max_payload: {MAX_PAYLOAD}"))
        .script(&format!("[[rules]]\nreply = \"{answer}\"\n"))
        .slots(1)
        .start()
        .await;
    let client = &f.client;
    // 36 KiB of request and 20 KiB of answer, twice over in output and messages: 76 KiB.
    let mut request: GenerationRequest = serde_json::from_value(json!({
        "request_id": "big",
        "messages": [
            {"role": "user", "content": "a".repeat(12 * 1024)},
            {"role": "assistant", "content": "b".repeat(12 * 1024)},
            {"role": "user", "content": "c".repeat(12 * 1024)},
        ],
    }))
    .unwrap();
    request.max_tokens = Some(100_000);
    let mut events = Box::pin(client.follow("big").await.unwrap());
    client.submit("default", &request).await.unwrap();
    let finished =
        wait::next_matching(
            "the finished event",
            WITHIN,
            &mut events,
            |event| match event.body {
                EventBody::Finished { result } => Some(result),
                _ => None,
            },
        )
        .await;
    let stored = wait_terminal(client, "big").await;
    assert_eq!(*finished, stored);
    assert_eq!(
        (stored.state, stored.reason, stored.truncated),
        (RequestState::Completed, Reason::Stop, true)
    );
    // The output is whole; the oldest messages went, the latest turns stayed.
    assert_eq!(stored.output, answer);
    let kept: Vec<String> = stored
        .messages
        .iter()
        .map(|m| m.text().into_owned())
        .collect();
    assert_eq!(kept, vec!["c".repeat(12 * 1024), answer.clone()]);
    assert!(serde_json::to_vec(&stored).unwrap().len() <= MAX_PAYLOAD);
}

/// Runs a `genfleet` command against the fleet's NATS: (success, stdout, stderr).
async fn genfleet(f: &Fleet, args: &[&str]) -> (bool, String, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(args)
        .env("GENFLEET__NATS__URL", f.nats.url())
        .output()
        .await
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn a_failed_request_raises_failed_and_its_summary_outlives_the_read_result() {
    let f = fleet(
        "[[rules]]\nwhen_last_user_contains = \"boom\"\nstatus = 500\n\
         error_message = \"the model ran out of memory\"\n\
         [[rules]]\nreply = \"fine\"\n",
        1,
        1,
    )
    .await;
    let mut failures = f
        .client
        .nats()
        .subscribe("signals.outcome.FAILED")
        .await
        .unwrap();
    f.client.nats().flush().await.unwrap();
    let failed = f
        .client
        .run(
            "default",
            req("doomed", "boom, please"),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(
        (failed.state, failed.reason),
        (RequestState::Failed, Reason::BackendError)
    );
    // Managers and the console hear of it, with why.
    let signal = wait::within("a FAILED signal", WITHIN, failures.next())
        .await
        .unwrap();
    let signal: genfleet::protocol::Signal = serde_json::from_slice(&signal.payload).unwrap();
    assert_eq!(
        (signal.request_id.as_str(), signal.code.as_str()),
        ("doomed", "FAILED")
    );
    assert_eq!(signal.meta["reason"], "backend_error");
    let detail = signal.meta["detail"].as_str().unwrap();
    assert!(detail.contains("the model ran out of memory"), "{detail}");
    assert!(
        signal.summary.contains("backend_error"),
        "{}",
        signal.summary
    );
    // A completed request raises none.
    f.client
        .run("default", req("fine", "hello"), Duration::from_secs(30))
        .await
        .unwrap();
    // `run` read (and so released) the result; the summary stays for people.
    let gone = f.client.result("doomed", true).await.unwrap_err();
    assert_eq!(gone.code(), Some(ErrorCode::NotFound), "{gone}");
    let summary = wait::until("the summary to be kept", WITHIN, || async {
        let summary = f.client.status("doomed").await.unwrap().finished;
        match summary {
            Some(s) if s.finished_at.is_some() => Ok(s),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        (summary.state, summary.reason, summary.prompt_start.as_str()),
        (RequestState::Failed, Reason::BackendError, "boom, please")
    );
    assert_eq!(summary.detail, failed.detail);
    let (ok, stdout, stderr) = genfleet(&f, &["status", "doomed"]).await;
    assert!(ok, "{stderr}");
    assert!(
        stdout.starts_with("doomed FAILED backend_error\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("  why:      ") && stdout.contains("the model ran out of memory"),
        "{stdout}"
    );
    assert!(stdout.contains("  prompt:   boom, please"), "{stdout}");
    let (ok, stdout, _) = genfleet(&f, &["status", "doomed", "--json"]).await;
    assert!(ok);
    let status: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (&status["state"], &status["finished"]["reason"]),
        (&json!("FAILED"), &json!("backend_error"))
    );
    // Only the failure raised a signal: the next one is that of a second failure, which the
    // one worker ran after the completed request (its messages arrive in the order it sent
    // them), not one of the completed request.
    f.client
        .run("default", req("doomed-again", "boom again"), WITHIN)
        .await
        .unwrap();
    let next = wait::within("the second FAILED signal", WITHIN, failures.next())
        .await
        .unwrap();
    let next: genfleet::protocol::Signal = serde_json::from_slice(&next.payload).unwrap();
    assert_eq!(
        next.request_id, "doomed-again",
        "a signal for a completed request: {next:?}"
    );
}

#[tokio::test]
async fn the_request_commands_print_for_people_and_refuse_malformed_ids_as_such() {
    let f = fleet("[[rules]]\nreply = \"Hello from the fleet.\"\n", 1, 1).await;
    f.client
        .submit("default", &req("greeted", "hi"))
        .await
        .unwrap();
    wait_terminal(&f.client, "greeted").await;
    let (ok, stdout, stderr) = genfleet(&f, &["result", "greeted", "--peek"]).await;
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with("greeted COMPLETED stop\n"), "{stdout}");
    assert!(stdout.ends_with("\nHello from the fleet.\n"), "{stdout}");
    let (ok, stdout, _) = genfleet(&f, &["result", "greeted", "--json"]).await;
    assert!(ok);
    let result: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(result["output"], "Hello from the fleet.");
    // A malformed id is named as such, whatever the command; nothing is sent for it.
    for args in [
        &["result", "a.b.c"][..],
        &["status", "default.b"],
        &["status", "a*"],
        &["cancel", ""],
        &["decide", "x y", "fast"],
    ] {
        let (ok, _, stderr) = genfleet(&f, args).await;
        assert!(!ok, "{args:?}");
        assert!(
            stderr.contains("is not a valid") && !stderr.contains("no worker answers"),
            "{args:?}: {stderr}"
        );
    }
    let (ok, _, stderr) = genfleet(&f, &["cancel", ""]).await;
    assert!(!ok && stderr.contains("it is empty"), "{stderr}");
    let (ok, _, stderr) = genfleet(&f, &["status", "never-submitted"]).await;
    assert!(!ok && stderr.contains("is not known"), "{stderr}");
}

#[tokio::test]
async fn submit_sets_the_common_request_fields_from_flags() {
    let f = fleet("[[rules]]\nreply = \"Brief.\"\n", 1, 1).await;
    let (ok, stdout, stderr) = genfleet(
        &f,
        &[
            "submit",
            "--follow",
            "--json",
            "--request-id",
            "flagged",
            "--system",
            "Be brief.",
            "--max-tokens",
            "12",
            "--temperature",
            "0.2",
            "--job-name",
            "nightly",
            "--metadata",
            "team=ops",
            "--metadata",
            "priority=3",
            "--affinity",
            "chat-7",
            "hello",
        ],
    )
    .await;
    assert!(ok, "{stderr}");
    let result: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(result["request_id"], "flagged");
    // A single command follows no heartbeats: it went to the pool, whose worker placed it on
    // the key's worker (the only one here).
    assert_eq!(
        result["affinity"],
        json!({"key": "chat-7", "preferred_worker": result["worker_id"], "held": true}),
        "{result}"
    );
    assert_eq!(result["job_name"], "nightly");
    assert_eq!(result["metadata"], json!({"team": "ops", "priority": 3}));
    let asked = &f.mock().requests()[0];
    assert_eq!(asked["max_tokens"], 12);
    assert_eq!(asked["temperature"], 0.2);
    let prompt = asked["messages"].to_string();
    assert!(prompt.contains("Be brief."), "{prompt}");
    let (ok, _, stderr) = genfleet(&f, &["submit", "--metadata", "novalue", "hi"]).await;
    assert!(!ok && stderr.contains("is not KEY=VALUE"), "{stderr}");
}

/// A one-slot worker whose capacity flips between free and full with every request: each of
/// many concurrent submits is answered (accepted or NO_SLOT_AVAILABLE; the worker never leaves
/// the pool's queue group, so nothing is on its way to a subscription being left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_submit_is_answered_while_capacity_flips() {
    let f = fleet("[[rules]]\nreply = \"ok\"\ndelay_ms = 5\n", 1, 1).await;
    let nats = f.client.nats().clone();
    let (mut accepted, mut refused, mut unanswered) = (0, 0, Vec::new());
    for wave in 0..20 {
        let replies = futures_util::future::join_all((0..20).map(|i| {
            let nats = nats.clone();
            async move {
                let id = format!("flip-{wave}-{i}");
                let body = serde_json::to_vec(&req(&id, "x")).unwrap();
                let request = async_nats::Request::new()
                    .payload(body.into())
                    .timeout(Some(Duration::from_secs(20)));
                (id, nats.send_request("gen.submit.default", request).await)
            }
        }))
        .await;
        for (id, reply) in replies {
            match reply {
                Ok(reply) => {
                    let value: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
                    match value["error"]["code"].as_str() {
                        None => accepted += 1,
                        Some("NO_SLOT_AVAILABLE") => refused += 1,
                        Some(other) => panic!("{id}: {other}: {value}"),
                    }
                }
                // "No responders" too: the worker is in the queue group, full or not.
                Err(error) => unanswered.push(format!("{id}: {error}")),
            }
        }
    }
    eprintln!(
        "{accepted} accepted, {refused} refused, {} unanswered",
        unanswered.len()
    );
    assert!(accepted > 0, "{refused} refused");
    assert!(
        unanswered.is_empty(),
        "{} submits not answered by the worker ({accepted} accepted, {refused} refused): {unanswered:?}",
        unanswered.len()
    );
}

/// A pool submit that reaches a full worker goes on to a peer whose last heartbeat showed a free
/// slot, and that peer answers the caller: the full worker never starts it, and never leaves it
/// unanswered.
#[tokio::test]
async fn a_full_worker_sends_a_pool_submit_on_to_a_peer_with_a_free_slot() {
    let f = Fleet::builder()
        .script(
            "[[rules]]\nwhen_last_user_contains = \"slow\"\nreply = \"a b c d e f g h i j k l m n o p q r s t\"\ndelay_ms = 3000\n\n[[rules]]\nreply = \"done\"\n",
        )
        .workers(2)
        .slots(1)
        .settings(|s| s.http.listen = "127.0.0.1:0".into())
        .start()
        .await;
    let (full, free) = (&f.workers[0], &f.workers[1]);
    let nats = f.client.nats().clone();
    let body = |id: &str, text: &str| -> bytes::Bytes {
        serde_json::to_vec(&req(id, text)).unwrap().into()
    };
    // The first worker's one slot taken, through its own subject.
    let reply = nats
        .request(
            format!("gen.worker.{}.submit", full.worker_id),
            body("hold", "slow"),
        )
        .await
        .unwrap();
    let held: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(held["worker_id"], full.worker_id.as_str(), "{held}");
    genfleet::llm::openai::install_crypto_provider();
    let metrics = format!("http://{}/metrics", full.http_addr.unwrap());
    let forwarded = || async {
        let text = reqwest::get(&metrics).await.unwrap().text().await.unwrap();
        text.lines()
            .find(|line| line.starts_with("genfleet_submits_forwarded_total"))
            .and_then(|line| line.split_whitespace().last()?.parse::<u64>().ok())
            .expect("the counter is exposed")
    };
    // Pool submits, one at a time, until one reached the full worker (the queue group picks a
    // member at random) and went on.
    let sent = Cell::new(0);
    wait::until(
        "a pool submit to go on from the full worker",
        WITHIN,
        || async {
            if forwarded().await > 0 {
                return Ok(());
            }
            let id = format!("fwd-{}", sent.get());
            sent.set(sent.get() + 1);
            let reply = nats
                .request("gen.submit.default", body(&id, "quick"))
                .await
                .unwrap_or_else(|e| panic!("{id} unanswered: {e}"));
            let value: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
            match value["error"]["code"].as_str() {
                None => {
                    assert_eq!(value["worker_id"], free.worker_id.as_str(), "{id}: {value}");
                    wait_terminal(&f.client, &id).await;
                }
                // The full worker counted the peer's free slot as taken until its next heartbeat.
                Some("NO_SLOT_AVAILABLE") => {}
                Some(other) => panic!("{id}: {other}: {value}"),
            }
            Err(format!("none of {} pool submits went on", sent.get()))
        },
    )
    .await;
    f.client.cancel("hold").await.unwrap();
    wait_terminal(&f.client, "hold").await;
}
