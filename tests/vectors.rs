//! The shared test vectors (tests/data), end to end: each stream is what the mock backend sends,
//! one character per chunk, through the real HTTP client and the engine.

mod common;

use std::sync::Arc;

use common::*;
use genfleet::engine::DefaultBios;
use genfleet::llm::mock::{Chunking, Rule, Script};
use genfleet::protocol::{Reason, RequestState};
use genfleet::settings::ToolMode;
use serde_json::{Value, json};

fn vectors(file: &str) -> Vec<Value> {
    let path = format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    all["cases"].as_array().unwrap().clone()
}

fn collapse(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[tokio::test]
async fn loop_vectors_through_the_engine() {
    for case in vectors("loop_detection.json") {
        let name = case["name"].as_str().unwrap();
        let stream = case["stream"].as_str().unwrap();
        let fires = case["fires"].as_bool().unwrap();
        let script = Script::new(vec![Rule::reply(stream).chunk(Chunking::Chars(7))]);
        let h = Harness::with_script(script, |_| {}, Arc::new(DefaultBios)).await;
        let (result, _) = h
            .run(request(
                json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 100000}),
            ))
            .await;
        let expected = if fires {
            Reason::LoopDetected
        } else {
            Reason::Stop
        };
        assert_eq!(result.reason, expected, "{name}: {:?}", result.detail);
        if fires {
            assert!(
                result.signals.iter().any(|s| s.code == "LOOP_DETECTED"),
                "{name}"
            );
            assert!(!result.output.is_empty(), "{name}: partial output kept");
        } else {
            assert_eq!(result.output, stream.trim_start_matches('\n'), "{name}");
        }
    }
}

#[tokio::test]
async fn text_tool_call_vectors_through_the_engine() {
    let allowed = ["add", "mul", "clock", "shell", "note"];
    for mode in [ToolMode::Text, ToolMode::Native] {
        for case in vectors("text_tool_calls.json") {
            let name = case["name"].as_str().unwrap();
            let input = case["input"].as_str().unwrap();
            let expect = match (mode, case.get("native")) {
                (ToolMode::Native, Some(native)) => native.clone(),
                _ => case.clone(),
            };
            let calls = expect["calls"].as_array().unwrap();
            let script = Script::new(vec![
                Rule::reply("All done.").when_last_message_contains("tool_response"),
                Rule::reply("All done.").when_last_role("tool"),
                Rule::reply(input).chunk(Chunking::Char),
            ]);
            let h = Harness::with_script(
                script,
                |s| {
                    s.llm.tool_mode = mode;
                    s.tools.correction_attempts = 0;
                },
                Arc::new(DefaultBios),
            )
            .await;
            let (result, events) = h
                .run(request(
                    json!({"messages": [{"role": "user", "content": "go"}], "tools": allowed}),
                ))
                .await;
            let label = format!("{name} ({mode:?})");
            let first_turn = |text: &str| collapse(text.strip_suffix("All done.").unwrap_or(text));
            let streamed = first_turn(&streamed_text(&events));
            let first_turn = first_turn(&result.output);
            let expected_text = expect["text"].as_str().unwrap();
            if expect.get("error").is_some() {
                assert_eq!(result.reason, Reason::ToolParseError, "{label}: {result:?}");
                assert!(h.tools.calls().is_empty(), "{label}");
                continue;
            }
            let names: Vec<&str> = calls.iter().map(|c| c["name"].as_str().unwrap()).collect();
            if names.contains(&"request_decision") {
                assert_eq!(
                    result.reason,
                    Reason::DecisionRequested,
                    "{label}: {result:?}"
                );
                assert_eq!(
                    result.signals[0].decision.as_ref().unwrap().options.len(),
                    2
                );
            } else if names.iter().any(|n| !allowed.contains(n)) {
                assert_eq!(
                    result.reason,
                    Reason::ToolParseError,
                    "{label}: unknown tool"
                );
                assert!(
                    result
                        .detail
                        .as_deref()
                        .unwrap_or_default()
                        .contains("launch_rocket")
                );
            } else {
                assert_eq!(
                    (result.state, result.reason),
                    (RequestState::Completed, Reason::Stop),
                    "{label}: {result:?}"
                );
                let executed: Vec<(String, Value)> = h
                    .tools
                    .calls()
                    .into_iter()
                    .map(|c| (c.name, Value::Object(c.arguments)))
                    .collect();
                let wanted: Vec<(String, Value)> = calls
                    .iter()
                    .map(|c| {
                        (
                            c["name"].as_str().unwrap().to_string(),
                            c["arguments"].clone(),
                        )
                    })
                    .collect();
                assert_eq!(executed, wanted, "{label}");
                assert_eq!(
                    result.tool_iterations_used,
                    u32::from(!calls.is_empty()),
                    "{label}"
                );
            }
            assert_eq!(first_turn, expected_text, "{label}: output");
            assert_eq!(streamed, expected_text, "{label}: streamed deltas");
        }
    }
}
