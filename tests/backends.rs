//! Recorded streams of real model servers, run through genfleet's HTTP client and engine.
//!
//! `tests/data/backends/<server>/` holds each server's responses in its exact shape (`.sse`
//! transcripts, `.json` error bodies) with a `cases.toml` saying what a correct client makes of
//! each: the output, the reasoning, the tool calls, the finish reason, the usage, or the error.
//! `genfleet mock-llm` replays each file byte for byte; the table below runs every case through
//! [`OpenAiBackend`] (the events it yields) and through the engine (the request's result).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::Harness;
use futures_util::StreamExt;
use genfleet::engine::DefaultBios;
use genfleet::llm::mock::{MockServer, Rule, Script};
use genfleet::llm::{ChatRequest, FinishReason, LlmBackend, OpenAiBackend, StreamEvent, ToolSpec};
use genfleet::protocol::{GenerationRequest, Message, Reason, RequestState, Role};
use genfleet::settings::Settings;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CaseFile {
    server: String,
    version: String,
    how: String,
    #[serde(rename = "case")]
    cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    /// The recorded file when it is not `<name>.sse` (`<name>.json` for an error status).
    file: Option<String>,
    what: String,
    #[serde(default = "ok")]
    status: u16,
    expect: Expect,
}

fn ok() -> u16 {
    200
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    #[serde(default)]
    output: String,
    #[serde(default)]
    reasoning: String,
    finish: Option<String>,
    error: Option<String>,
    usage: Option<ExpectedUsage>,
    #[serde(default)]
    tool_calls: Vec<ExpectedCall>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct ExpectedUsage {
    prompt_tokens: u64,
    completion_tokens: u64,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct ExpectedCall {
    name: String,
    arguments: Value,
}

/// A case with its file, named for failure messages.
struct Transcript {
    label: String,
    file: PathBuf,
    case: Case,
}

fn transcripts() -> Vec<Transcript> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/backends");
    let mut servers: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("tests/data/backends exists")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_dir())
        .collect();
    servers.sort();
    let mut all = Vec::new();
    for dir in servers {
        let cases_file = dir.join("cases.toml");
        let text = std::fs::read_to_string(&cases_file)
            .unwrap_or_else(|e| panic!("{}: {e}", cases_file.display()));
        let file: CaseFile =
            toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", cases_file.display()));
        assert!(
            !file.server.is_empty() && !file.version.is_empty() && !file.how.is_empty(),
            "{} names its server, version and source",
            cases_file.display()
        );
        let dir_name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let mut named: Vec<String> = Vec::new();
        for case in file.cases {
            assert!(!case.what.is_empty(), "{dir_name}/{}: what", case.name);
            assert!(
                case.expect.finish.is_some() != case.expect.error.is_some(),
                "{dir_name}/{}: exactly one of finish and error",
                case.name
            );
            let ext = if case.status == 200 { "sse" } else { "json" };
            let path = dir.join(
                case.file
                    .clone()
                    .unwrap_or_else(|| format!("{}.{ext}", case.name)),
            );
            assert!(path.is_file(), "{} is missing", path.display());
            named.push(path.file_name().unwrap().to_string_lossy().into_owned());
            all.push(Transcript {
                label: format!("{} ({}) {}", dir_name, file.version, case.name),
                file: path,
                case,
            });
        }
        // Every recorded file is a case: none sits there untested.
        for entry in std::fs::read_dir(&dir).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if name != "cases.toml" && (name.ends_with(".sse") || name.ends_with(".json")) {
                assert!(
                    named.contains(&name),
                    "{dir_name}/{name} has no case in cases.toml"
                );
            }
        }
    }
    assert!(
        all.len() >= 60,
        "the transcripts cover every server ({} cases)",
        all.len()
    );
    all
}

fn replay_rule(t: &Transcript) -> Rule {
    Rule {
        replay: Some(t.file.clone()),
        status: (t.case.status != 200).then_some(t.case.status),
        ..Rule::default()
    }
}

fn weather_tool() -> ToolSpec {
    ToolSpec {
        name: "get_weather".into(),
        description: "The weather in a city".into(),
        parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        strict: None,
    }
}

/// What the client made of one stream.
#[derive(Debug, Default)]
struct Heard {
    output: String,
    reasoning: String,
    calls: BTreeMap<usize, (Option<String>, String, String)>,
    usage: Option<ExpectedUsage>,
    finish: Option<FinishReason>,
    error: Option<String>,
}

async fn listen(backend: &OpenAiBackend, tools: Vec<ToolSpec>) -> Heard {
    let mut stream = backend.chat_stream(ChatRequest {
        messages: vec![Message::user("What is the weather in Paris?")],
        tools,
        ..ChatRequest::default()
    });
    let mut heard = Heard::default();
    while let Some(item) = stream.next().await {
        match item {
            Ok(StreamEvent::Text(text)) => heard.output.push_str(&text),
            Ok(StreamEvent::Reasoning(text)) => heard.reasoning.push_str(&text),
            Ok(StreamEvent::ToolCall(delta)) => {
                let call = heard.calls.entry(delta.index).or_default();
                if delta.id.is_some() {
                    call.0 = delta.id;
                }
                call.1.push_str(delta.name.as_deref().unwrap_or_default());
                call.2.push_str(&delta.arguments);
            }
            Ok(StreamEvent::Usage(usage)) => {
                let sum = heard.usage.get_or_insert(ExpectedUsage {
                    prompt_tokens: 0,
                    completion_tokens: 0,
                });
                sum.prompt_tokens += usage.prompt_tokens;
                sum.completion_tokens += usage.completion_tokens;
            }
            Ok(StreamEvent::Finish(reason)) => {
                assert!(heard.finish.is_none(), "one finish reason per stream");
                heard.finish = Some(reason);
            }
            Err(error) => {
                assert!(heard.error.is_none(), "one error per stream");
                heard.error = Some(error.to_string());
            }
        }
    }
    heard
}

fn finish_of(name: &str) -> FinishReason {
    match name {
        "stop" => FinishReason::Stop,
        "length" => FinishReason::Length,
        "tool_calls" => FinishReason::ToolCalls,
        "content_filter" => FinishReason::ContentFilter,
        other => panic!("unknown finish {other:?} in a cases.toml"),
    }
}

#[tokio::test]
async fn every_recorded_stream_reads_as_its_server_meant_it() {
    let mut settings = Settings::defaults();
    settings.llm.retries = 0;
    settings.llm.idle_timeout_ms = 5_000;
    let mut failures = Vec::new();
    for t in transcripts() {
        let server = MockServer::start(Script::new(vec![replay_rule(&t)]))
            .await
            .unwrap();
        settings.llm.base_url = server.base_url();
        let backend = OpenAiBackend::new(&settings.llm).unwrap();
        let tools = if t.case.expect.tool_calls.is_empty() {
            Vec::new()
        } else {
            vec![weather_tool()]
        };
        let heard = listen(&backend, tools).await;
        let expect = &t.case.expect;
        let calls: Vec<ExpectedCall> = heard
            .calls
            .values()
            .map(|(_, name, arguments)| ExpectedCall {
                name: name.clone(),
                arguments: serde_json::from_str(arguments)
                    .unwrap_or_else(|_| Value::String(arguments.clone())),
            })
            .collect();
        let mut wrong = Vec::new();
        if heard.output != expect.output {
            wrong.push(format!(
                "output {:?} (expected {:?})",
                heard.output, expect.output
            ));
        }
        if heard.reasoning != expect.reasoning {
            wrong.push(format!(
                "reasoning {:?} (expected {:?})",
                heard.reasoning, expect.reasoning
            ));
        }
        if calls != expect.tool_calls {
            wrong.push(format!(
                "tool calls {calls:?} (expected {:?})",
                expect.tool_calls
            ));
        }
        if heard.calls.values().any(|(_, name, _)| name.is_empty()) {
            wrong.push("a tool call without a name".into());
        }
        match (&expect.error, &heard.error) {
            (Some(want), Some(got)) if got.contains(want.as_str()) => {}
            (None, None) => {}
            (want, got) => wrong.push(format!("error {got:?} (expected one with {want:?})")),
        }
        if expect.error.is_none() {
            if heard.usage != expect.usage {
                wrong.push(format!(
                    "usage {:?} (expected {:?})",
                    heard.usage, expect.usage
                ));
            }
            let want = expect.finish.as_deref().map(finish_of);
            if heard.finish != want {
                wrong.push(format!("finish {:?} (expected {want:?})", heard.finish));
            }
        }
        if !wrong.is_empty() {
            failures.push(format!("{}: {}", t.label, wrong.join("; ")));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[tokio::test]
async fn every_recorded_stream_ends_its_request_as_it_should() {
    let mut failures = Vec::new();
    for t in transcripts() {
        let script = Script::new(vec![
            Rule {
                when_turn: Some(1),
                ..replay_rule(&t)
            },
            Rule::reply("done"),
        ]);
        let h = Harness::with_script(
            script,
            |s| {
                s.llm.retries = 0;
            },
            Arc::new(DefaultBios),
        )
        .await;
        let expect = &t.case.expect;
        let with_tools = !expect.tool_calls.is_empty();
        let mut request: GenerationRequest = serde_json::from_value(json!({
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        }))
        .unwrap();
        if with_tools {
            request.tools = vec!["get_weather".into()];
        }
        let (result, _) = h.run(request).await;
        let mut wrong = Vec::new();
        let outcome = (result.state, result.reason);
        if let Some(error) = &expect.error {
            if outcome != (RequestState::Failed, Reason::BackendError) {
                wrong.push(format!("ended {outcome:?}, not FAILED backend_error"));
            }
            let detail = result.detail.clone().unwrap_or_default();
            if !detail.contains(error.as_str()) {
                wrong.push(format!("detail {detail:?} lacks {error:?}"));
            }
            if result.output.trim() != expect.output.trim() {
                wrong.push(format!(
                    "partial output {:?} (expected {:?})",
                    result.output, expect.output
                ));
            }
        } else if expect.finish.as_deref() == Some("tool_calls") {
            let ran: Vec<ExpectedCall> = h
                .tools
                .calls()
                .into_iter()
                .map(|call| ExpectedCall {
                    name: call.name,
                    arguments: Value::Object(call.arguments),
                })
                .collect();
            if ran != expect.tool_calls {
                wrong.push(format!("ran {ran:?} (expected {:?})", expect.tool_calls));
            }
            if outcome != (RequestState::Completed, Reason::Stop)
                || !result.output.ends_with("done")
            {
                wrong.push(format!(
                    "ended {outcome:?} with {:?}, not COMPLETED stop after the tool",
                    result.output
                ));
            }
            let answered = result
                .messages
                .iter()
                .filter(|m| m.role == Role::Tool)
                .count();
            if answered != expect.tool_calls.len() {
                wrong.push(format!("{answered} tool answers in the conversation"));
            }
        } else {
            // A turn cut at max_tokens runs none of its calls: the model did not finish it.
            if !h.tools.calls().is_empty() {
                wrong.push(format!(
                    "ran {:?} from a turn that did not end in calls",
                    h.tools.calls()
                ));
            }
            let want = match expect.finish.as_deref() {
                Some("length") => Reason::Length,
                _ => Reason::Stop,
            };
            if outcome != (RequestState::Completed, want) {
                wrong.push(format!("ended {outcome:?}: {:?}", result.detail));
            }
            if result.output.trim() != expect.output.trim() {
                wrong.push(format!(
                    "output {:?} (expected {:?})",
                    result.output, expect.output
                ));
            }
            if result.reasoning != expect.reasoning {
                wrong.push(format!("reasoning {:?}", result.reasoning));
            }
            let usage = expect
                .usage
                .as_ref()
                .map_or((0, 0), |u| (u.prompt_tokens, u.completion_tokens));
            if (result.usage.prompt_tokens, result.usage.completion_tokens) != usage {
                wrong.push(format!("usage {:?} (expected {usage:?})", result.usage));
            }
            if expect.finish.as_deref() == Some("content_filter")
                && !result
                    .detail
                    .as_deref()
                    .unwrap_or_default()
                    .contains("content filter")
            {
                wrong.push("a content filter's end is not named".into());
            }
        }
        if !wrong.is_empty() {
            failures.push(format!("{}: {}", t.label, wrong.join("; ")));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}
