//! One generation, end to end through the real OpenAI-compatible HTTP client against the mock
//! backend (the same server `genfleet mock-llm` runs). No NATS.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use genfleet::engine::{BiosContext, BiosProvider};
use genfleet::protocol::{EventBody, Reason, RequestState, Role, SignalSource, SignalType};
use genfleet::settings::{SystemMessages, ToolMode};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// How long a wait may take: generous, a busy machine is slow, never wrong.
const WITHIN: Duration = Duration::from_secs(20);

fn user(text: &str) -> serde_json::Value {
    json!([{"role": "user", "content": text}])
}

#[tokio::test]
async fn plain_answer_streams_and_completes() {
    let h = Harness::new("[[rules]]\nreply = \"Hello there, friend.\"\n").await;
    let (result, events) = h
        .run(request(
            json!({"messages": user("hi"), "metadata": {"k": 1}}),
        ))
        .await;
    assert_eq!(result.state, RequestState::Completed);
    assert_eq!(result.reason, Reason::Stop);
    assert_eq!(result.output, "Hello there, friend.");
    assert_eq!(streamed_text(&events), result.output);
    assert_eq!(event_names(&events)[0], "started");
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (0..events.len() as u64).collect::<Vec<_>>(),
        "gapless seq"
    );
    assert!(result.usage.completion_tokens > 0 && result.usage.prompt_tokens > 0);
    assert_eq!(result.messages.len(), 2);
    assert_eq!(result.messages[1].role, Role::Assistant);
    assert_eq!(result.metadata["k"], 1);
    assert_eq!((result.attempt, result.chain_position), (1, 1));
    assert!(result.timings_ms.first_token.is_some());
}

/// A BIOS provider of the test's own: the engine must place whatever it writes first.
struct CountingBios;

impl BiosProvider for CountingBios {
    fn bios(&self, cx: &BiosContext<'_>) -> String {
        format!(
            "TEST BIOS tools={}\nTool iterations remaining: {}",
            cx.tools.len(),
            cx.iterations_remaining
        )
    }
}

const ADD_THEN_ANSWER: &str = r#"
[[rules]]
when_last_role = "user"
reply = "Let me add."
tool_calls = [{ name = "add", arguments = { a = 1, b = 2 } }, { name = "mul", arguments = { a = 3, b = 4 } }]

[[rules]]
when_last_role = "tool"
reply = "The sum is 3."
"#;

#[tokio::test]
async fn bios_comes_from_its_provider_first_then_caller_system_then_conversation() {
    let h = Harness::build(ADD_THEN_ANSWER, |_| {}, Arc::new(CountingBios)).await;
    let (result, _) = h
        .run(request(json!({"system": "Caller rules.", "messages": user("add please"), "tools": ["add", "mul"], "tool_iterations": 3})))
        .await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    let calls = h.backend_requests();
    assert_eq!(calls.len(), 2);
    let roles = |i: usize| -> Vec<String> {
        calls[i]["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(roles(0), ["system", "system", "user"]);
    assert_eq!(
        calls[0]["messages"][0]["content"],
        "TEST BIOS tools=2\nTool iterations remaining: 3"
    );
    assert_eq!(calls[0]["messages"][1]["content"], "Caller rules.");
    assert_eq!(calls[0]["messages"][2]["content"], "add please");
    // The BIOS is regenerated when the budget changes.
    assert_eq!(
        calls[1]["messages"][0]["content"],
        "TEST BIOS tools=2\nTool iterations remaining: 2"
    );
    assert_eq!(
        roles(1),
        ["system", "system", "user", "assistant", "tool", "tool"]
    );
}

#[tokio::test]
async fn merged_system_messages_send_one_system_message_bios_first() {
    let h = Harness::build(
        ADD_THEN_ANSWER,
        |s| s.llm.system_messages = SystemMessages::Merged,
        Arc::new(CountingBios),
    )
    .await;
    h.run(request(
        json!({"system": "Caller rules.", "messages": user("x"), "tools": ["add", "mul"]}),
    ))
    .await;
    let first = &h.backend_requests()[0];
    assert_eq!(
        first["messages"][0]["content"],
        "TEST BIOS tools=2\nTool iterations remaining: 4\n\nCaller rules."
    );
    assert_eq!(first["messages"][1]["role"], "user");
}

#[tokio::test]
async fn a_template_that_refuses_a_second_system_message_gets_them_merged_from_then_on() {
    let script = "reject_system = \"after_first\"\n[[rules]]\nreply = \"fine\"\n";
    let h = Harness::new(script).await;
    let ask = || request(json!({"system": "Caller rules.", "messages": user("x")}));
    let (result, _) = h.run(ask()).await;
    assert_eq!(
        (result.state, result.reason, result.output.as_str()),
        (RequestState::Completed, Reason::Stop, "fine"),
        "{result:?}"
    );
    let sent = h.backend_requests();
    assert_eq!(sent.len(), 2, "refused once, then sent merged");
    let roles = |body: &serde_json::Value| -> Vec<String> {
        body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(roles(&sent[0]), ["system", "system", "user"]);
    assert_eq!(roles(&sent[1]), ["system", "user"]);
    let merged = sent[1]["messages"][0]["content"].as_str().unwrap();
    assert!(
        merged.contains("Tool iterations remaining") && merged.ends_with("\n\nCaller rules."),
        "the BIOS first, then the caller's system prompt: {merged}"
    );
    // Learnt once: the next request goes merged at once.
    let (result, _) = h.run(ask()).await;
    assert_eq!(result.state, RequestState::Completed);
    let sent = h.backend_requests();
    assert_eq!(sent.len(), 3);
    assert_eq!(roles(&sent[2]), ["system", "user"]);
}

#[tokio::test]
async fn a_template_that_refuses_every_system_message_gets_them_in_the_first_user_message() {
    let script = "reject_system = \"all\"\n[[rules]]\nreply = \"fine\"\n";
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(json!({"system": "Caller rules.", "messages": [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second question"},
        ]})))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop),
        "{result:?}"
    );
    let sent = h.backend_requests();
    assert_eq!(
        sent.len(),
        3,
        "separate, merged, then in the first user message"
    );
    let last = &sent[2]["messages"];
    assert_eq!(last[0]["role"], "user");
    let opening = last[0]["content"].as_str().unwrap();
    assert!(opening.starts_with("You are a worker"), "{opening}");
    assert!(
        opening.ends_with("Caller rules.\n\nfirst question"),
        "{opening}"
    );
    assert_eq!(last[2]["content"], "second question");
    // The result's conversation is the caller's, not the backend's layout.
    assert_eq!(result.messages[0].text(), "first question");
}

#[tokio::test]
async fn a_fixed_system_layout_is_not_changed_by_a_refusal() {
    let script = "reject_system = \"after_first\"\n[[rules]]\nreply = \"fine\"\n";
    let h = Harness::with(script, |s| {
        s.llm.system_messages = SystemMessages::Separate;
    })
    .await;
    let (result, _) = h
        .run(request(
            json!({"system": "Caller rules.", "messages": user("x")}),
        ))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::BackendError),
        "{result:?}"
    );
    let detail = result.detail.unwrap();
    assert!(
        detail.contains("refused the system messages") && detail.contains("roles must alternate"),
        "{detail}"
    );
    assert_eq!(h.backend_requests().len(), 1);
}

#[tokio::test]
async fn several_calls_in_one_message_consume_one_iteration() {
    let h = Harness::new(ADD_THEN_ANSWER).await;
    let (result, events) = h
        .run(request(
            json!({"messages": user("add"), "tools": ["add", "mul"], "tool_iterations": 3}),
        ))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop),
        "{result:?}"
    );
    assert_eq!(result.tool_iterations_used, 1);
    assert_eq!(h.tools.calls().len(), 2);
    assert_eq!(result.output, "Let me add.\n\nThe sum is 3.");
    assert_eq!(streamed_text(&events), result.output);
    // Results go back as tool messages holding JSON, answering each call's id.
    let assistant = &result.messages[1];
    assert_eq!(assistant.tool_calls.len(), 2);
    let tool_messages: Vec<_> = result
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .collect();
    assert_eq!(tool_messages.len(), 2);
    assert_eq!(
        tool_messages[0].tool_call_id.as_ref(),
        Some(&assistant.tool_calls[0].id)
    );
    let content: serde_json::Value = serde_json::from_str(&tool_messages[0].text()).unwrap();
    assert_eq!(content, json!({"sum": 3.0}));
    let names = event_names(&events);
    assert!(names.contains(&"tool_call") && names.contains(&"tool_result"));
    let first_call = h.backend_requests()[0].clone();
    let offered: Vec<&str> = first_call["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert!(
        offered.contains(&"add") && offered.contains(&"request_decision"),
        "{offered:?}"
    );
    // Invocations carry the correlation the tool service needs.
    let call = &h.tools.calls()[0];
    assert_eq!(
        (call.request_id.as_str(), call.name.as_str()),
        ("req-1", "add")
    );
}

const ADD_EVERY_TURN: &str = r#"
[[rules]]
when_turn = 3
reply = "All added."

[[rules]]
reply = "Adding."
tool_calls = [{ name = "add", arguments = { a = 1, b = 1 } }]
"#;

#[tokio::test]
async fn the_budget_decrements_once_per_iteration() {
    let h = Harness::new(ADD_EVERY_TURN).await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("go"), "tools": ["add"], "tool_iterations": 2}),
        ))
        .await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    assert_eq!(result.tool_iterations_used, 2);
    let bioses: Vec<String> = h.backend_requests().iter().map(bios_of).collect();
    assert!(bioses[0].ends_with("Tool iterations remaining: 2"));
    assert!(bioses[1].ends_with("Tool iterations remaining: 1"));
    assert!(bioses[2].ends_with("Tool iterations remaining: 0"));
}

#[tokio::test]
async fn an_exhausted_budget_fails_the_next_tool_call_and_keeps_the_output() {
    let h = Harness::new(ADD_EVERY_TURN).await;
    let (result, events) = h
        .run(request(
            json!({"messages": user("go"), "tools": ["add"], "tool_iterations": 1}),
        ))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::ToolExecutionError)
    );
    assert_eq!(result.detail.as_deref(), Some("tool budget exhausted"));
    assert_eq!(result.output, "Adding.\n\nAdding.");
    assert_eq!(
        h.tools.calls().len(),
        1,
        "the over-budget call is not executed"
    );
    let signal = result
        .signals
        .iter()
        .find(|s| s.code == "TOOL_LIMIT_REACHED")
        .expect("worker signal");
    assert_eq!(
        (signal.kind, signal.source),
        (SignalType::Issue, SignalSource::Worker)
    );
    assert!(event_names(&events).contains(&"signal"));

    let (result, _) = h
        .run(request(
            json!({"messages": user("go"), "tools": ["add"], "tool_iterations": 0}),
        ))
        .await;
    assert_eq!(result.detail.as_deref(), Some("tool budget exhausted"));
}

#[tokio::test]
async fn control_calls_are_recorded_without_consuming_budget() {
    let script = r#"
[[rules]]
when_last_role = "user"
reply = "Working."
tool_calls = [
  { name = "signal_issue", arguments = { code = "POLICY_RISK", severity = "low", summary = "odd input" } },
  { name = "add", arguments = { a = 2, b = 2 } },
]
[[rules]]
reply = "Four."
"#;
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("go"), "tools": ["add"], "tool_iterations": 1}),
        ))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop),
        "{result:?}"
    );
    assert_eq!(result.tool_iterations_used, 1);
    let signal = &result.signals[0];
    assert_eq!(
        (signal.kind, signal.code.as_str(), signal.source),
        (SignalType::Issue, "POLICY_RISK", SignalSource::Model)
    );
    assert_eq!(signal.request_id, "req-1");
    // Native mode: the control call gets a short acknowledgement.
    let acks: Vec<String> = result
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.text().to_string())
        .collect();
    assert!(
        acks.contains(&r#"{"recorded":true}"#.to_string()),
        "{acks:?}"
    );
}

#[tokio::test]
async fn control_calls_need_no_budget_and_a_control_turn_with_text_continues() {
    let script = r#"
[[rules]]
when_turn = 1
reply = "Flagging this."
tool_calls = [{ name = "signal_issue", arguments = { code = "NEEDS_EXTERNAL_INFO", severity = "med", summary = "missing data" } }]
[[rules]]
reply = "Final answer."
"#;
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("go"), "tool_iterations": 0}),
        ))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop),
        "{result:?}"
    );
    assert_eq!(result.output, "Flagging this.\n\nFinal answer.");
    assert_eq!(result.signals.len(), 1);
}

#[tokio::test]
async fn a_turn_with_only_control_calls_and_no_text_ends_the_generation() {
    let script = r#"
[[rules]]
tool_calls = [{ name = "declare_outcome", arguments = { code = "NOTHING_TO_DO", summary = "already done" } }]
"#;
    let h = Harness::new(script).await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop)
    );
    assert_eq!(result.signals[0].kind, SignalType::Outcome);
    assert_eq!(result.signals[0].code, "NOTHING_TO_DO");
    assert_eq!(h.backend_requests().len(), 1);
}

#[tokio::test]
async fn control_turns_in_a_row_are_bounded() {
    let script = r#"
[[rules]]
reply = "Still here."
tool_calls = [{ name = "declare_outcome", arguments = { code = "WAITING" } }]
"#;
    let h = Harness::new(script).await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop)
    );
    assert_eq!(
        h.backend_requests().len(),
        3,
        "generation.max_control_turns = 3"
    );
}

const DECIDE_AND_ADD: &str = r#"
[[rules]]
when_turn = 1
reply = "I need a decision."
tool_calls = [
  { name = "request_decision", arguments = { question = "Which path?", options = [{ id = "fast", label = "Fast", pros = "quick" }, { id = "safe", label = "Safe" }], default_option = "safe", context = "two ways" } },
  { name = "add", arguments = { a = 1, b = 2 } },
]
[[rules]]
reply = "Went with safe."
"#;

#[tokio::test]
async fn request_decision_ends_the_generation_at_once() {
    let h = Harness::new(DECIDE_AND_ADD).await;
    let (result, events) = h
        .run(request(json!({"messages": user("go"), "tools": ["add"]})))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::DecisionRequested),
        "{result:?}"
    );
    assert!(
        h.tools.calls().is_empty(),
        "nothing runs after a decision request"
    );
    assert_eq!(result.output, "I need a decision.");
    let signal = &result.signals[0];
    assert_eq!(
        (signal.kind, signal.code.as_str()),
        (SignalType::DecisionRequest, "NEEDS_MANAGER_DECISION")
    );
    let decision = signal
        .decision
        .as_ref()
        .expect("a decision block to answer");
    assert_eq!(decision.options.len(), 2);
    assert_eq!(decision.default_option.as_deref(), Some("safe"));
    assert!(!decision.decision_id.is_empty());
    assert!(
        events
            .iter()
            .any(|e| matches!(&e.body, EventBody::Signal { signal } if signal.decision.is_some()))
    );
}

#[tokio::test]
async fn without_stop_on_decision_request_the_signal_has_nothing_to_answer_and_generation_goes_on()
{
    let h = Harness::new(DECIDE_AND_ADD).await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("go"), "tools": ["add"], "stop_on_decision_request": false}),
        ))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop),
        "{result:?}"
    );
    assert!(result.signals[0].decision.is_none());
    assert_eq!(h.tools.calls().len(), 1);
    assert_eq!(result.output, "I need a decision.\n\nWent with safe.");
}

#[tokio::test]
async fn model_signals_are_bounded_and_the_excess_counted() {
    let script = r#"
[[rules]]
when_turn = 1
reply = "Many flags."
tool_calls = [
  { name = "signal_issue", arguments = { code = "POLICY_RISK", severity = "low", summary = "1" } },
  { name = "signal_issue", arguments = { code = "POLICY_RISK", severity = "low", summary = "2" } },
  { name = "signal_issue", arguments = { code = "POLICY_RISK", severity = "low", summary = "3" } },
  { name = "signal_issue", arguments = { code = "POLICY_RISK", severity = "low", summary = "4" } },
  { name = "signal_issue", arguments = { code = "POLICY_RISK", severity = "low", summary = "5" } },
]
[[rules]]
reply = "Done."
"#;
    let h = Harness::new(script).await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(result.signals.len(), 3);
    assert_eq!(result.signals_dropped, 2);
    assert_eq!(result.reason, Reason::Stop);
}

const TEXT_MODE_ADD: &str = r#"
[[rules]]
when_last_message_contains = "tool_response"
reply = "The sum is 3."
[[rules]]
reply = "Adding now. <tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}</tool_call>"
"#;

#[tokio::test]
async fn text_mode_parses_calls_from_text_and_answers_with_tool_responses() {
    let h = Harness::with(TEXT_MODE_ADD, |s| s.llm.tool_mode = ToolMode::Text).await;
    let (result, events) = h
        .run(request(json!({"messages": user("add"), "tools": ["add"]})))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop),
        "{result:?}"
    );
    assert_eq!(result.output, "Adding now. \n\nThe sum is 3.");
    assert!(
        !streamed_text(&events).contains("tool_call"),
        "call text is never streamed"
    );
    let calls = h.backend_requests();
    assert!(
        calls[0].get("tools").is_none(),
        "text mode sends no native tools"
    );
    let bios = bios_of(&calls[0]);
    assert!(
        bios.contains("<tool_call>") && bios.contains("\"properties\""),
        "{bios}"
    );
    let last = calls[1]["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(last["role"], "user");
    let text = last["content"].as_str().unwrap();
    assert!(
        text.starts_with("<tool_response>") && text.contains(r#""sum":3.0"#),
        "{text}"
    );
    assert_eq!(result.tool_iterations_used, 1);
}

#[tokio::test]
async fn text_mode_control_call_is_recorded_and_the_message_still_handled() {
    let script = r#"
[[rules]]
when_last_message_contains = "tool_response"
reply = "Done."
[[rules]]
reply = "<tool_call>{\"name\": \"signal_issue\", \"arguments\": {\"code\": \"POLICY_RISK\", \"severity\": \"low\", \"summary\": \"odd\"}}</tool_call>\n<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}</tool_call>"
"#;
    let h = Harness::with(script, |s| s.llm.tool_mode = ToolMode::Text).await;
    let (result, _) = h
        .run(request(json!({"messages": user("go"), "tools": ["add"]})))
        .await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    assert_eq!(result.signals[0].code, "POLICY_RISK");
    assert_eq!(h.tools.calls().len(), 1);
    assert_eq!(result.output, "Done.");
}

#[tokio::test]
async fn malformed_json_and_unknown_tools_fail_with_tool_parse_error() {
    let cases = [
        // Written as text, with broken JSON.
        (
            ToolMode::Text,
            "[[rules]]\nreply = '<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":1,\"b\":}}</tool_call>'\n",
            "not valid JSON",
        ),
        // A native call whose argument string is not JSON.
        (
            ToolMode::Native,
            "[[rules]]\ntool_calls = [{ name = \"add\", arguments = '{\"a\": 1,' }]\n",
            "not a JSON object",
        ),
        // A tool the request did not allow.
        (
            ToolMode::Native,
            "[[rules]]\ntool_calls = [{ name = \"launch\", arguments = {} }]\n",
            "`launch`, a tool this request does not offer",
        ),
        (
            ToolMode::Text,
            "[[rules]]\nreply = '<tool_call>{\"name\":\"launch\",\"arguments\":{}}</tool_call>'\n",
            "`launch`, a tool this request does not offer",
        ),
        // A call object with a stray key.
        (
            ToolMode::Text,
            "[[rules]]\nreply = '<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":1,\"b\":2},\"message\":\"hi\"}</tool_call>'\n",
            "invalid",
        ),
        // Arguments that break the schema.
        (
            ToolMode::Native,
            "[[rules]]\ntool_calls = [{ name = \"add\", arguments = { a = \"one\", b = 2 } }]\n",
            "/a",
        ),
    ];
    for (mode, script, needle) in cases {
        let h = Harness::with(script, |s| {
            s.llm.tool_mode = mode;
            s.tools.correction_attempts = 0;
        })
        .await;
        let (result, _) = h
            .run(request(json!({"messages": user("go"), "tools": ["add"]})))
            .await;
        assert_eq!(
            (result.state, result.reason),
            (RequestState::Failed, Reason::ToolParseError),
            "{script}: {result:?}"
        );
        let detail = result.detail.clone().unwrap_or_default();
        assert!(detail.contains(needle), "{script}: {detail}");
        assert!(h.tools.calls().is_empty());
        assert_eq!(
            h.backend_requests().len(),
            1,
            "no correction turn with correction_attempts = 0"
        );
    }
}

const CORRECTED: &str = r#"
[[rules]]
when_last_role = "tool"
reply = "The sum is 5."
[[rules]]
when_last_message_contains = "could not be used"
tool_calls = [{ name = "add", arguments = { a = 2, b = 3 } }]
[[rules]]
tool_calls = [{ name = "add", arguments = { a = "two", b = 3 } }]
"#;

#[tokio::test]
async fn an_invalid_call_gets_a_correction_turn_with_the_examples() {
    let h = Harness::new(CORRECTED).await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("add 2 and 3"), "tools": ["add"]}),
        ))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop),
        "{result:?}"
    );
    assert_eq!(
        result.tool_iterations_used, 1,
        "correction turns do not consume the budget"
    );
    assert_eq!(h.tools.calls().len(), 1);
    let correction = result
        .messages
        .iter()
        .find(|m| m.role == Role::User && m.text().contains("could not be used"))
        .expect("correction in messages");
    let text = correction.text();
    assert!(
        text.contains("/a") && text.contains("two plus three") && text.contains("Add two numbers"),
        "{text}"
    );
    // The examples tier appears in no prompt but the correction's.
    let calls = h.backend_requests();
    assert!(!calls[0].to_string().contains("two plus three"));
    assert!(calls[1].to_string().contains("two plus three"));
}

#[tokio::test]
async fn a_call_still_invalid_after_correction_fails() {
    let script =
        "[[rules]]\ntool_calls = [{ name = \"add\", arguments = { a = \"two\", b = 3 } }]\n";
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(json!({"messages": user("go"), "tools": ["add"]})))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::ToolParseError)
    );
    assert_eq!(
        h.backend_requests().len(),
        2,
        "one correction (tools.correction_attempts = 1)"
    );
}

#[tokio::test]
async fn tool_runner_timeouts_and_errors_fail_the_request_with_the_output_kept() {
    for (tool, needle) in [
        ("slow", "timed out after 200 ms"),
        ("broken", "connection reset"),
    ] {
        let script = format!(
            "[[rules]]\nreply = \"Calling.\"\ntool_calls = [{{ name = \"{tool}\", arguments = {{}} }}]\n"
        );
        let h = Harness::new(&script).await;
        let (result, _) = h
            .run(request(json!({"messages": user("go"), "tools": [tool]})))
            .await;
        assert_eq!(
            (result.state, result.reason),
            (RequestState::Failed, Reason::ToolExecutionError),
            "{tool}"
        );
        assert!(
            result
                .detail
                .as_deref()
                .unwrap_or_default()
                .contains(needle),
            "{result:?}"
        );
        assert_eq!(result.output, "Calling.");
    }
}

#[tokio::test]
async fn an_error_reply_from_a_tool_goes_back_to_the_model() {
    let script = r#"
[[rules]]
when_last_role = "tool"
reply = "The tool said: {{last_message}}"
[[rules]]
tool_calls = [{ name = "refuse", arguments = {} }]
"#;
    let h = Harness::new(script).await;
    let (result, events) = h
        .run(request(
            json!({"messages": user("go"), "tools": ["refuse"]}),
        ))
        .await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    assert!(result.output.contains("not today"), "{}", result.output);
    assert!(
        events
            .iter()
            .any(|e| matches!(&e.body, EventBody::ToolResult { ok: false, .. }))
    );
}

#[tokio::test]
async fn a_repeated_line_loop_is_stopped_with_partial_output() {
    let script = "[[rules]]\nreply = \"the quick brown fox jumps over the dog!\\n\"\nrepeat = 40\n";
    let h = Harness::new(script).await;
    let (result, events) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::LoopDetected),
        "{result:?}"
    );
    assert!(result.output.contains("quick brown fox"));
    assert!(
        result.output.len() < 40 * 40,
        "stopped early: {} bytes",
        result.output.len()
    );
    let signal = result
        .signals
        .iter()
        .find(|s| s.code == "LOOP_DETECTED")
        .expect("loop signal");
    assert_eq!(signal.source, SignalSource::Worker);
    assert!(
        events
            .iter()
            .any(|e| matches!(&e.body, EventBody::Signal { .. }))
    );

    let benign = "[[rules]]\nreply = \"the quick brown fox jumps over the dog!\\n\"\nrepeat = 3\n";
    let h = Harness::new(benign).await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(result.reason, Reason::Stop);
}

#[tokio::test]
async fn the_same_tool_call_over_and_over_is_a_loop() {
    let script = "[[rules]]\ntool_calls = [{ name = \"clock\", arguments = {} }]\n";
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("go"), "tools": ["clock"], "tool_iterations": 20}),
        ))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::LoopDetected),
        "{result:?}"
    );
    assert!(result.tool_iterations_used < 20);
}

#[tokio::test]
async fn max_tokens_ends_with_length_and_a_signal() {
    let script = "[[rules]]\nreply = \"one two three four five six seven eight\"\n";
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(json!({"messages": user("go"), "max_tokens": 3})))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Length),
        "{result:?}"
    );
    assert_eq!(result.output, "one two three ");
    assert!(
        result
            .signals
            .iter()
            .any(|s| s.code == "MAX_TOKENS_REACHED" && s.source == SignalSource::Worker)
    );
    assert_eq!(h.backend_requests()[0]["max_tokens"], 3);
}

#[tokio::test]
async fn a_broken_stream_is_a_backend_error_with_the_partial_output() {
    let script = "[[rules]]\nreply = \"one two three four five\"\nbreak_after = 2\n";
    let h = Harness::new(script).await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::BackendError),
        "{result:?}"
    );
    assert_eq!(result.output, "one two ");
    assert_eq!(result.messages.last().unwrap().text(), "one two ");
}

/// Some servers (llama-cpp-python's, when a stop string ends the text) send `[DONE]` without
/// ever giving a finish reason. By default that is a broken stream, as the contract says;
/// `llm.done_without_finish_reason = "stop"` takes it as a complete answer, tool calls
/// included, while a stream cut without `[DONE]` still fails.
#[tokio::test]
async fn done_without_a_finish_reason_is_a_stop_unless_configured_to_fail() {
    let script = "[[rules]]\nreply = \"Paris is the capital.\"\nomit_finish_reason = true\n";
    let fail = |s: &mut genfleet::settings::Settings| {
        s.llm.done_without_finish_reason = genfleet::settings::DoneWithoutFinish::Fail;
    };
    let h = Harness::with(script, fail).await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::BackendError),
        "{result:?}"
    );
    assert_eq!(result.output, "Paris is the capital.");
    let detail = result.detail.unwrap();
    assert!(
        detail.contains("[DONE] arrived before a finish reason")
            && detail.contains("llm.done_without_finish_reason"),
        "{detail}"
    );

    // The default: [DONE] is the stream's own clean end.
    let stop = |_: &mut genfleet::settings::Settings| {};
    let h = Harness::with(script, stop).await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(
        (result.state, result.reason, result.output.as_str()),
        (
            RequestState::Completed,
            Reason::Stop,
            "Paris is the capital."
        ),
        "{result:?}"
    );

    // Native tool calls in such a stream still run, and the answer after them completes.
    let script = r#"
[[rules]]
when_last_role = "tool"
reply = "the tool said {{last_message}}"
omit_finish_reason = true

[[rules]]
tool_calls = [{ name = "add", arguments = { a = 40, b = 2 } }]
omit_finish_reason = true
"#;
    let h = Harness::with(script, stop).await;
    let (result, _) = h
        .run(request(json!({"messages": user("go"), "tools": ["add"]})))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop),
        "{result:?}"
    );
    assert_eq!(h.tools.calls().len(), 1);
    assert!(result.output.contains("42"), "{result:?}");

    // A stream cut before any end still fails with the setting.
    let script = "[[rules]]\nreply = \"one two three four five\"\nbreak_after = 2\n";
    let h = Harness::with(script, stop).await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(
        (result.state, result.reason, result.output.as_str()),
        (RequestState::Failed, Reason::BackendError, "one two "),
        "{result:?}"
    );
}

#[tokio::test]
async fn server_errors_before_the_first_token_are_retried() {
    let h = Harness::new("[[rules]]\nreply = \"recovered\"\nstatus = 503\nfail_times = 2\n").await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(
        (result.reason, result.output.as_str()),
        (Reason::Stop, "recovered"),
        "{result:?}"
    );
    assert_eq!(h.backend_requests().len(), 3);

    let h = Harness::new("[[rules]]\nreply = \"never\"\nstatus = 500\nfail_times = 10\n").await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::BackendError)
    );
    assert!(result.detail.unwrap().contains("500"));
    assert_eq!(h.backend_requests().len(), 3, "llm.retries = 2");

    let h = Harness::new("[[rules]]\nreply = \"never\"\nstatus = 400\n").await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(result.reason, Reason::BackendError);
    assert_eq!(h.backend_requests().len(), 1, "a 400 is not retried");
}

#[tokio::test]
async fn a_backend_that_refuses_native_tools_is_called_in_text_mode_from_then_on() {
    let script = format!("reject_tools = true\n{TEXT_MODE_ADD}");
    let h = Harness::new(&script).await;
    let (result, _) = h
        .run(request(json!({"messages": user("add"), "tools": ["add"]})))
        .await;
    assert_eq!(
        (result.reason, result.tool_iterations_used),
        (Reason::Stop, 1),
        "{result:?}"
    );
    let calls = h.backend_requests();
    assert!(calls[0].get("tools").is_some());
    assert!(calls[1..].iter().all(|c| c.get("tools").is_none()));
    let before = calls.len();
    let (result, _) = h
        .run(request(json!({"messages": user("add"), "tools": ["add"]})))
        .await;
    assert_eq!(result.reason, Reason::Stop);
    let calls = h.backend_requests();
    assert!(
        calls[before..].iter().all(|c| c.get("tools").is_none()),
        "remembered for the backend"
    );
}

#[tokio::test]
async fn stream_options_are_dropped_for_a_backend_that_rejects_them() {
    let h = Harness::new("reject_stream_options = true\n[[rules]]\nreply = \"fine\"\n").await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(result.output, "fine");
    h.run(request(json!({"messages": user("go")}))).await;
    let calls = h.backend_requests();
    assert!(calls[0].get("stream_options").is_some());
    assert!(calls[1..].iter().all(|c| c.get("stream_options").is_none()));
    assert_eq!(calls.len(), 3);
}

#[tokio::test]
async fn reasoning_is_kept_apart_from_the_output() {
    let h = Harness::new("[[rules]]\nreasoning = \"thinking hard\"\nreply = \"answer\"\n").await;
    let (result, events) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(result.output, "answer");
    assert_eq!(result.reasoning, "thinking hard");
    let reasoning: String = events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::Reasoning { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(reasoning, "thinking hard");
}

#[tokio::test]
async fn options_model_and_sampling_reach_the_backend() {
    let h = Harness::new("[[rules]]\nreply = \"ok\"\n").await;
    h.run(request(json!({"messages": user("go"), "model": "other", "temperature": 0.5, "options": {"top_p": 0.9, "seed": 7}}))).await;
    let body = &h.backend_requests()[0];
    assert_eq!(body["model"], "other");
    assert_eq!(body["temperature"], 0.5);
    assert_eq!(body["top_p"], 0.9);
    assert_eq!(body["seed"], 7);
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
}

#[tokio::test]
async fn a_fenced_example_is_not_executed_in_native_mode() {
    let script = "[[rules]]\nreply = \"Example:\\n```json\\n{\\\"name\\\": \\\"add\\\", \\\"arguments\\\": {\\\"a\\\": 1, \\\"b\\\": 2}}\\n```\"\n";
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(json!({"messages": user("go"), "tools": ["add"]})))
        .await;
    assert_eq!(result.reason, Reason::Stop);
    assert!(h.tools.calls().is_empty());
    assert!(result.output.contains("```json"));
}

#[tokio::test]
async fn cancellation_mid_stream_keeps_the_partial_output() {
    // 26 words, 100 ms each: the stream is far from its end when the first word is out.
    let whole = "a b c d e f g h i j k l m n o p q r s t u v w x y z";
    let script = format!("[[rules]]\nreply = \"{whole}\"\ndelay_ms = 100\n");
    let h = Harness::new(&script).await;
    // Cancelled once the first word streamed.
    let (result, events) = h
        .run_cancelled_at(request(json!({"messages": user("go")})), |event| {
            matches!(event.body, EventBody::Delta { .. })
        })
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Cancelled, Reason::Cancelled)
    );
    assert!(
        !result.output.is_empty() && result.output.len() < whole.len(),
        "partial: {:?}",
        result.output
    );
    assert!(whole.starts_with(&result.output), "{:?}", result.output);
    assert_eq!(streamed_text(&events), result.output);
}

#[tokio::test]
async fn cancellation_reaches_a_hanging_tool_call() {
    let script =
        "[[rules]]\nreply = \"Calling.\"\ntool_calls = [{ name = \"hang\", arguments = {} }]\n";
    let h = Harness::new(script).await;
    let cancel = CancellationToken::new();
    let trigger = cancel.clone();
    let tools = h.tools.clone();
    // Cancelled once the tool has the call (it never answers).
    let ((result, _), ()) = tokio::join!(
        h.run_with_cancel(
            request(json!({"messages": user("go"), "tools": ["hang"]})),
            cancel,
        ),
        async {
            wait::until("the hanging tool to have the call", WITHIN, || async {
                !tools.calls().is_empty()
            })
            .await;
            trigger.cancel();
        }
    );
    let called: Vec<String> = h.tools.calls().into_iter().map(|c| c.name).collect();
    assert_eq!(called, ["hang"]);
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Cancelled, Reason::Cancelled)
    );
    assert_eq!(result.output, "Calling.");
}

#[tokio::test]
async fn the_deadline_fails_the_request_with_timeout_and_keeps_the_output() {
    let script = "[[rules]]\nreply = \"a b c d e f g h i j k l m n o p q r s t u v w x y z\"\ndelay_ms = 40\n";
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(json!({"messages": user("go"), "deadline_ms": 300})))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::Timeout)
    );
    assert!(!result.output.is_empty());
}

#[tokio::test]
async fn the_output_is_capped_and_marked_truncated() {
    let text = "Every line of this answer says something new, so no loop is seen; it is just long. It goes on to a second sentence, then a third.";
    let h = Harness::with(&format!("[[rules]]\nreply = \"{text}\"\n"), |s| {
        s.limits.max_output_bytes = 50
    })
    .await;
    let (result, _) = h.run(request(json!({"messages": user("go")}))).await;
    assert_eq!(result.reason, Reason::Stop);
    assert!(result.truncated);
    assert_eq!(result.output.len(), 50);
}

#[tokio::test]
async fn an_unknown_tool_in_the_request_is_an_invalid_request() {
    let h = Harness::new("[[rules]]\nreply = \"x\"\n").await;
    let err = h
        .engine
        .check_request(&request(json!({"messages": user("go"), "tools": ["nope"]})))
        .unwrap_err();
    assert!(err.message.contains("nope"));
    let (result, _) = h
        .run(request(json!({"messages": user("go"), "tools": ["nope"]})))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::InvalidRequest)
    );
    assert!(h.backend_requests().is_empty());
}

#[tokio::test]
async fn a_decision_request_at_the_chain_limit_fails_the_request() {
    let h = Harness::new(DECIDE_AND_ADD).await;
    let (result, _) = h
        .run_at(
            request(json!({"messages": user("go"), "tools": ["add"]})),
            CancellationToken::new(),
            5,
        )
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::ToolExecutionError)
    );
    assert_eq!(result.detail.as_deref(), Some("decision chain limit"));
    assert!(
        result.signals[0].decision.is_none(),
        "nothing left to answer"
    );
    let (result, _) = h
        .run_at(
            request(json!({"messages": user("go"), "tools": ["add"]})),
            CancellationToken::new(),
            4,
        )
        .await;
    assert_eq!(result.reason, Reason::DecisionRequested);
}

#[tokio::test]
async fn every_kind_of_invalid_call_is_corrected_when_the_model_fixes_it() {
    let fixed = r#"
[[rules]]
when_last_message_contains = "could not be used"
reply = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
tool_calls = [{ name = "add", arguments = { a = 2, b = 3 } }]
[[rules]]
when_last_message_contains = "tool_response"
reply = "Sum done."
[[rules]]
when_last_role = "tool"
reply = "Sum done."
"#;
    let cases = [
        (
            "malformed JSON",
            ToolMode::Text,
            "reply = '<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":2,\"b\":}}</tool_call>'",
            "not valid JSON",
        ),
        (
            "stray key",
            ToolMode::Text,
            "reply = '<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":2,\"b\":3},\"note\":\"x\"}</tool_call>'",
            "invalid",
        ),
        (
            "unknown tool, text",
            ToolMode::Text,
            "reply = '<tool_call>{\"name\":\"sum\",\"arguments\":{\"a\":2,\"b\":3}}</tool_call>'",
            "`sum` is not a tool",
        ),
        (
            "unknown tool, native",
            ToolMode::Native,
            "tool_calls = [{ name = \"sum\", arguments = { a = 2, b = 3 } }]",
            "`sum` is not a tool",
        ),
        (
            "malformed native arguments",
            ToolMode::Native,
            "tool_calls = [{ name = \"add\", arguments = '{\"a\": 2,' }]",
            "not a JSON object",
        ),
        (
            "missing required",
            ToolMode::Native,
            "tool_calls = [{ name = \"add\", arguments = { a = 2 } }]",
            "\"b\" is a required property",
        ),
        (
            "wrong type",
            ToolMode::Text,
            "reply = '<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":\"2\",\"b\":3}}</tool_call>'",
            "/a",
        ),
        (
            "extra property",
            ToolMode::Native,
            "tool_calls = [{ name = \"add\", arguments = { a = 2, b = 3, c = 4 } }]",
            "Additional properties",
        ),
    ];
    for (label, mode, broken, needle) in cases {
        // One form of the fixed call per mode.
        let fixed = match mode {
            ToolMode::Text => fixed.replace("tool_calls = [{ name = \"add\", arguments = { a = 2, b = 3 } }]\n", ""),
            ToolMode::Native => fixed.replace("reply = '<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}</tool_call>'\n", ""),
        };
        let script = format!("{fixed}[[rules]]\n{broken}\n");
        let h = Harness::with(&script, |s| s.llm.tool_mode = mode).await;
        let (result, _) = h
            .run(request(
                json!({"messages": user("add 2 and 3"), "tools": ["add"]}),
            ))
            .await;
        assert_eq!(
            (result.state, result.reason),
            (RequestState::Completed, Reason::Stop),
            "{label}: {result:?}"
        );
        assert_eq!(h.tools.calls().len(), 1, "{label}");
        assert_eq!(
            result.tool_iterations_used, 1,
            "{label}: corrections use no budget"
        );
        let correction = result
            .messages
            .iter()
            .find(|m| m.role == Role::User && m.text().contains("could not be used"))
            .unwrap_or_else(|| panic!("{label}: the correction is in the result's messages"));
        assert!(
            correction.text().contains(needle),
            "{label}: {}",
            correction.text()
        );
    }
}

#[tokio::test]
async fn a_tool_answer_past_the_bound_is_cut_for_the_model_and_the_record() {
    let h = Harness::with(
        "[[rules]]\nwhen_last_role = \"user\"\nreply = \"Fetching.\"\ntool_calls = [{ name = \"add\", arguments = { a = 1, b = 2 } }]\n[[rules]]\nwhen_last_role = \"tool\"\nreply = \"Got it.\"\n",
        |s| s.limits.max_tool_result_bytes = 4096,
    )
    .await;
    // About 900 KB, full of characters JSON escapes.
    let huge = "\"quoted\" \\ line\n".repeat(56_000);
    h.tools
        .set("add", Behaviour::Reply(json!({ "body": huge })));
    let (result, events) = h
        .run(request(
            json!({"messages": user("fetch"), "tools": ["add"]}),
        ))
        .await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    let tool_message = result
        .messages
        .iter()
        .find(|m| m.role == Role::Tool)
        .expect("the tool's answer is in the conversation");
    let content = tool_message.text();
    assert!(content.len() <= 4096, "{} bytes kept", content.len());
    let kept: serde_json::Value = serde_json::from_str(&content).unwrap();
    assert_eq!(kept["truncated"], true);
    assert!(kept["original_bytes"].as_u64().unwrap() > 800_000);
    assert!(
        kept["head"]
            .as_str()
            .unwrap()
            .starts_with("{\"body\":\"\\\"quoted")
    );
    // The model was handed the same bounded answer, and so was the tool_result event.
    let second_call = h.backend_requests()[1].clone();
    let sent = second_call["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(sent, content);
    let event = events
        .iter()
        .find_map(|e| match &e.body {
            EventBody::ToolResult { result, .. } => Some(result.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(event["truncated"], true);
    // An answer within the bound is handed over as it is.
    h.tools.set("add", Behaviour::Reply(json!({ "sum": 3 })));
    let (small, _) = h
        .run(request(
            json!({"messages": user("fetch"), "tools": ["add"]}),
        ))
        .await;
    let content = small
        .messages
        .iter()
        .find(|m| m.role == Role::Tool)
        .unwrap()
        .text();
    assert_eq!(content, "{\"sum\":3}");
}

/// The caller's own tool in the tests below: the fleet never runs it.
fn get_time() -> serde_json::Value {
    json!({"type": "function", "function": {
        "name": "get_time",
        "description": "Returns the local time in a city, as HH:MM.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false},
        "strict": true
    }})
}

/// The continuation a caller sends after `tool_calls`: the conversation so far and one `tool`
/// message per call, answered with `answer`.
fn continuation(
    first: &genfleet::protocol::GenerationResult,
    answer: &str,
    extra: serde_json::Value,
) -> genfleet::protocol::GenerationRequest {
    let mut messages = serde_json::to_value(&first.messages).unwrap();
    for call in &first.tool_calls {
        messages
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "tool", "tool_call_id": call.id, "content": answer}));
    }
    let mut body = json!({"messages": messages, "caller_tools": [get_time()]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    request(body)
}

const CALLS_GET_TIME: &str = r#"
[[rules]]
when_last_role = "tool"
reply = "It is {{last_message}} in Paris."
[[rules]]
reply = "Let me look."
tool_calls = [{ name = "get_time", arguments = { city = "Paris" } }]
"#;

#[tokio::test]
async fn a_caller_tool_call_ends_with_tool_calls_and_the_caller_continues() {
    let h = Harness::new(CALLS_GET_TIME).await;
    let first = request(json!({"messages": user("time in Paris?"), "caller_tools": [get_time()]}));
    first.validate(&Default::default()).unwrap();
    h.engine.check_request(&first).unwrap();
    let (result, events) = h.run(first).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::ToolCalls),
        "{result:?}"
    );
    assert_eq!(result.tool_calls.len(), 1);
    let call = &result.tool_calls[0];
    assert_eq!(call.function.name, "get_time");
    let arguments: serde_json::Value = serde_json::from_str(&call.function.arguments).unwrap();
    assert_eq!(arguments, json!({"city": "Paris"}));
    // The last message is the assistant's, holding the same call by the same id.
    let last = result.messages.last().unwrap();
    assert_eq!(last.role, Role::Assistant);
    assert_eq!(last.tool_calls, result.tool_calls);
    assert_eq!(last.text(), "Let me look.");
    assert!(
        h.tools.calls().is_empty(),
        "the fleet never runs a caller tool"
    );
    assert_eq!(result.tool_iterations_used, 0);
    // The call is an event like a bus tool's, with no tool_result after it.
    let names = event_names(&events);
    assert!(
        names.contains(&"tool_call") && !names.contains(&"tool_result"),
        "{names:?}"
    );
    // The backend got the caller's definition as given, beside the control tools.
    let sent = &h.backend_requests()[0]["tools"];
    let function = sent
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == "get_time")
        .unwrap();
    assert_eq!(function, &get_time());
    assert!(bios_of(&h.backend_requests()[0]).contains("- get_time: Returns the local time"));

    let next = continuation(&result, "12:00", json!({}));
    next.validate(&Default::default()).unwrap();
    let (result, _) = h.run(next).await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    assert_eq!(result.output, "It is 12:00 in Paris.");
    assert!(result.tool_calls.is_empty());
}

#[tokio::test]
async fn text_mode_finds_caller_calls_in_text_and_gives_them_ids() {
    let script = r#"
[[rules]]
when_last_message_contains = "tool_response"
reply = "Noon, by the caller's clock."
[[rules]]
reply = "Checking.\n<tool_call>{\"name\": \"get_time\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>"
"#;
    let h = Harness::with(script, |s| s.llm.tool_mode = ToolMode::Text).await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("time?"), "caller_tools": [get_time()]}),
        ))
        .await;
    assert_eq!(result.reason, Reason::ToolCalls, "{result:?}");
    let call = &result.tool_calls[0];
    assert!(!call.id.is_empty());
    assert_eq!(call.function.name, "get_time");
    let last = result.messages.last().unwrap();
    assert_eq!(
        last.tool_calls, result.tool_calls,
        "OpenAI's shape in text mode too"
    );
    assert_eq!(last.text().trim_end(), "Checking.");
    let first = &h.backend_requests()[0];
    assert!(
        first.get("tools").is_none(),
        "text mode sends no native tools"
    );
    let bios = bios_of(first);
    assert!(
        bios.contains("- get_time: Returns the local time")
            && bios.contains("\"required\":[\"city\"]"),
        "{bios}"
    );

    let (result, _) = h.run(continuation(&result, "\"12:00\"", json!({}))).await;
    assert_eq!(result.output, "Noon, by the caller's clock.", "{result:?}");
    // The model read the round trip the way text mode writes calls and answers.
    let sent = h.backend_requests()[1]["messages"]
        .as_array()
        .unwrap()
        .clone();
    let n = sent.len();
    assert_eq!(sent[n - 2]["role"], "assistant");
    assert_eq!(
        sent[n - 2]["content"],
        "Checking.\n<tool_call>{\"name\":\"get_time\",\"arguments\":{\"city\":\"Paris\"}}</tool_call>"
    );
    assert!(sent[n - 2].get("tool_calls").is_none());
    assert_eq!(sent[n - 1]["role"], "user");
    assert_eq!(
        sent[n - 1]["content"],
        "<tool_response>\n{\"content\":\"12:00\",\"name\":\"get_time\"}\n</tool_response>"
    );
}

#[tokio::test]
async fn caller_tool_arguments_are_held_to_the_callers_schema_with_a_correction_turn() {
    let script = r#"
[[rules]]
when_last_message_contains = "could not be used"
tool_calls = [{ name = "get_time", arguments = { city = "Paris" } }]
[[rules]]
tool_calls = [{ name = "get_time", arguments = { city = 75 } }]
"#;
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("time?"), "caller_tools": [get_time()]}),
        ))
        .await;
    assert_eq!(result.reason, Reason::ToolCalls, "{result:?}");
    assert_eq!(result.tool_calls.len(), 1);
    assert!(result.tool_calls[0].function.arguments.contains("Paris"));
    let correction = result
        .messages
        .iter()
        .find(|m| m.role == Role::User && m.text().contains("could not be used"))
        .expect("a correction turn");
    let text = correction.text();
    assert!(
        text.contains("/city") && text.contains("Returns the local time"),
        "{text}"
    );
    // The refused call was answered, so the conversation stays well formed.
    let refused = &result.messages[1].tool_calls[0].id;
    assert!(
        result
            .messages
            .iter()
            .any(|m| m.tool_call_id.as_ref() == Some(refused))
    );

    // Still invalid after the corrections: the request fails as for a bus tool.
    let h =
        Harness::new("[[rules]]\ntool_calls = [{ name = \"get_time\", arguments = {} }]\n").await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("time?"), "caller_tools": [get_time()]}),
        ))
        .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::ToolParseError),
        "{result:?}"
    );
    assert!(result.tool_calls.is_empty());
}

#[tokio::test]
async fn a_turn_mixing_bus_and_caller_tools_runs_the_bus_tools_and_keeps_their_answers() {
    let script = r#"
[[rules]]
when_last_role = "tool"
reply = "Done: {{last_message}}"
[[rules]]
tool_calls = [
  { name = "add", arguments = { a = 1, b = 2 } },
  { name = "get_time", arguments = { city = "Paris" } },
  { name = "signal_issue", arguments = { code = "POLICY_RISK", severity = "low", summary = "odd" } },
]
"#;
    let h = Harness::new(script).await;
    let (result, events) = h
        .run(request(
            json!({"messages": user("go"), "tools": ["add"], "caller_tools": [get_time()]}),
        ))
        .await;
    assert_eq!(result.reason, Reason::ToolCalls, "{result:?}");
    assert_eq!(h.tools.calls().len(), 1, "the bus tool ran");
    assert_eq!(result.tool_iterations_used, 1);
    assert_eq!(result.signals[0].code, "POLICY_RISK");
    let names: Vec<&str> = result
        .tool_calls
        .iter()
        .map(|c| c.function.name.as_str())
        .collect();
    assert_eq!(
        names,
        ["get_time"],
        "only the caller's calls are the caller's to answer"
    );
    // user, assistant (all three calls), the bus tool's answer, the control call's ack.
    let roles: Vec<Role> = result.messages.iter().map(|m| m.role).collect();
    assert_eq!(roles, [Role::User, Role::Assistant, Role::Tool, Role::Tool]);
    let assistant = &result.messages[1];
    assert_eq!(assistant.tool_calls.len(), 3);
    assert_eq!(
        result.messages[2].tool_call_id.as_ref(),
        Some(&assistant.tool_calls[0].id)
    );
    assert!(result.messages[2].text().contains("\"sum\""));
    let tool_events = events
        .iter()
        .filter(|e| matches!(e.body, EventBody::ToolCall { .. }))
        .count();
    assert_eq!(tool_events, 2, "one for the bus call, one for the caller's");

    let (result, _) = h
        .run(continuation(&result, "12:00", json!({"tools": ["add"]})))
        .await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    assert_eq!(result.output, "Done: 12:00");
    let roles: Vec<String> = h.backend_requests()[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "tool", "tool"]
    );
}

#[tokio::test]
async fn a_caller_tool_may_not_take_a_control_tools_name() {
    let h = Harness::new("[[rules]]\nreply = \"x\"\n").await;
    let body = json!({"messages": user("x"), "caller_tools": [{"type": "function", "function": {"name": "request_decision"}}]});
    let err = h.engine.check_request(&request(body)).unwrap_err();
    assert!(
        err.message.contains("caller_tools[0].function.name")
            && err.message.contains("control tool"),
        "{}",
        err.message
    );
}

#[tokio::test]
async fn a_bare_caller_function_is_sent_with_an_empty_schema_and_takes_any_object() {
    let script = r#"
[[rules]]
tool_calls = [{ name = "ping", arguments = { anything = [1, 2] } }]
"#;
    let h = Harness::new(script).await;
    let (result, _) = h
        .run(request(
            json!({"messages": user("ping"), "caller_tools": [{"function": {"name": "ping"}}]}),
        ))
        .await;
    assert_eq!(result.reason, Reason::ToolCalls, "{result:?}");
    let sent = h.backend_requests()[0]["tools"].clone();
    let ping = sent
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == "ping")
        .unwrap()
        .clone();
    assert_eq!(
        ping,
        json!({"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}})
    );
    let bios = bios_of(&h.backend_requests()[0]);
    assert!(bios.contains("\n- ping\n"), "{bios}");
}
