//! Tools the caller runs, through a real worker: the generation ends COMPLETED `tool_calls`, a
//! bus tool called in the same turn runs on the bus, and the caller's continuation (the result's
//! messages and a `tool` answer per call) is accepted and finished, in both tool modes.

mod common;

use std::time::Duration;

use common::fleet::{self, Fleet};
use genfleet::protocol::{
    ErrorCode, FunctionDefinition, FunctionTool, GenerationRequest, GenerationResult, Message,
    Reason, RequestState, Role,
};
use genfleet::settings::ToolMode;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(20);

/// Native mode: the model multiplies on the bus and asks the caller for the time in one turn.
const NATIVE: &str = r#"
[[rules]]
when_last_role = "tool"
reply = "Noon; the product is as computed. Last: {{last_message}}"
[[rules]]
reply = "Working."
tool_calls = [
  { name = "calculate", arguments = { operation = "mul", a = 17, b = 23 } },
  { name = "get_time", arguments = { city = "Paris" } },
]
"#;

/// Text mode: the same turn, written as text.
const TEXT: &str = r#"
[[rules]]
when_last_message_contains = "tool_response"
reply = "Noon; done. Last: {{last_message}}"
[[rules]]
reply = "Working.\n<tool_call>{\"name\": \"calculate\", \"arguments\": {\"operation\": \"mul\", \"a\": 17, \"b\": 23}}</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>"
"#;

fn get_time() -> FunctionTool {
    FunctionTool {
        kind: "function".into(),
        function: FunctionDefinition {
            name: "get_time".into(),
            description: Some("Returns the local time in a city, as HH:MM.".into()),
            parameters: Some(json!({
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"]
            })),
            strict: None,
        },
    }
}

fn first_request(id: &str) -> GenerationRequest {
    let mut request = fleet::request(id, "time in Paris, and 17 times 23?");
    request.tools = vec!["calculate".into()];
    request.caller_tools = vec![get_time()];
    request
}

/// What the caller sends next: the result's conversation and its answers.
fn continuation(id: &str, first: &GenerationResult, answer: &str) -> GenerationRequest {
    let mut request = first_request(id);
    request.messages = first.messages.clone();
    for call in &first.tool_calls {
        request
            .messages
            .push(Message::tool(call.id.clone(), answer));
    }
    request
}

async fn round_trip(mode: ToolMode, script: &str) {
    let f = Fleet::builder()
        .script(script)
        .settings(move |s| s.llm.tool_mode = mode)
        .calculator()
        .start()
        .await;
    let first = fleet::run_when_tools_known(&f.client, &first_request("ct-1"), WAIT).await;
    assert_eq!(
        (first.state, first.reason),
        (RequestState::Completed, Reason::ToolCalls),
        "{mode:?}: {first:?}"
    );
    assert_eq!(first.tool_calls.len(), 1, "{mode:?}");
    assert_eq!(first.tool_calls[0].function.name, "get_time");
    assert!(!first.tool_calls[0].id.is_empty());
    assert_eq!(first.tool_iterations_used, 1, "the bus tool ran");
    // The assistant turn holds both calls; the bus call's answer follows it.
    let assistant = first
        .messages
        .iter()
        .rfind(|m| m.role == Role::Assistant)
        .unwrap();
    assert_eq!(assistant.tool_calls.len(), 2, "{mode:?}: {assistant:?}");
    let last = first.messages.last().unwrap();
    assert_eq!(last.role, Role::Tool);
    assert!(last.text().contains("391"), "{mode:?}: {last:?}");

    let next = continuation("ct-2", &first, "12:00");
    let result = f.client.run("default", next, WAIT).await.unwrap();
    assert_eq!(result.reason, Reason::Stop, "{mode:?}: {result:?}");
    assert!(
        result.output.contains("12:00"),
        "{mode:?}: {}",
        result.output
    );
    assert!(result.tool_calls.is_empty());
}

#[tokio::test]
async fn a_caller_tool_round_trip_through_a_worker_in_native_mode() {
    round_trip(ToolMode::Native, NATIVE).await;
}

#[tokio::test]
async fn a_caller_tool_round_trip_through_a_worker_in_text_mode() {
    round_trip(ToolMode::Text, TEXT).await;
}

#[tokio::test]
async fn a_bad_caller_tool_is_refused_at_submit_naming_the_field() {
    let f = Fleet::builder().start().await;
    let mut clash = first_request("bad-1");
    clash.tools.clear();
    clash.caller_tools.push(get_time());
    let mut control = first_request("bad-2");
    control.tools.clear();
    control.caller_tools[0].function.name = "declare_outcome".into();
    let mut schema = first_request("bad-3");
    schema.tools.clear();
    schema.caller_tools[0].function.parameters = Some(json!({"type": 12}));
    for (request, field) in [
        (clash, "caller_tools[1].function.name"),
        (control, "caller_tools[0].function.name"),
        (schema, "caller_tools[0].function.parameters"),
    ] {
        let error = f.client.submit("default", &request).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::InvalidRequest), "{error}");
        assert!(error.to_string().contains(field), "{field}: {error}");
    }
}
