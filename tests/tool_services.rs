//! Tool services on the bus: `genfleet tool-demo` registers its tools in KV and serves them; a
//! worker calls them for a model; on SIGTERM they are withdrawn.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::fleet::{self, Fleet};
use common::wait;
use genfleet::protocol::{ErrorCode, GenerationRequest, Reason};

const CALCULATES: &str = r#"
[[rules]]
when_last_role = "tool"
reply = "Result: {{last_message}}"
[[rules]]
when_last_user_contains = "divide"
tool_calls = [{ name = "calculate", arguments = { operation = "div", a = 1, b = 0 } }]
[[rules]]
tool_calls = [{ name = "calculate", arguments = { operation = "mul", a = 17, b = 23 } }]
"#;

/// A request that may use the demo tools.
fn request(id: &str, text: &str) -> GenerationRequest {
    let mut r = fleet::request(id, text);
    r.tools = vec!["calculate".into(), "clock".into()];
    r
}

#[tokio::test]
async fn the_demo_tools_serve_a_worker_and_are_withdrawn_on_sigterm() {
    let f = Fleet::builder()
        .script(CALCULATES)
        .default_settings()
        .start()
        .await;
    let mut demo = Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .arg("tool-demo")
        .env("GENFLEET__NATS__URL", f.nats.url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let client = &f.client;
    // The demo tools get registered.
    let result = fleet::run_when_tools_known(
        client,
        &request("mul", "seventeen times"),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    assert!(result.output.contains("391"), "{}", result.output);
    // A tool's error reply reaches the model, which carries on.
    let result = client
        .run(
            "default",
            request("div", "divide by zero"),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(result.reason, Reason::Stop);
    assert!(
        result.output.contains("DIVISION_BY_ZERO"),
        "{}",
        result.output
    );
    // SIGTERM withdraws the tools: requests naming them are refused again.
    assert!(
        Command::new("kill")
            .args(["-TERM", &demo.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::task::spawn_blocking(move || {
        wait::until_blocking(
            "the tool demo to exit on SIGTERM",
            Duration::from_secs(20),
            || demo.try_wait().expect("waits for the tool demo"),
        )
    })
    .await
    .unwrap();
    assert!(status.success());
    let sent = std::cell::Cell::new(0);
    wait::until(
        "the withdrawn tools to be unknown",
        Duration::from_secs(10),
        || async {
            sent.set(sent.get() + 1);
            match client
                .submit("default", &request(&format!("late{}", sent.get()), "x"))
                .await
            {
                Err(e) if e.code() == Some(ErrorCode::InvalidRequest) => Ok(()),
                Err(e) => Err(e.to_string()),
                Ok(accepted) => Err(format!("{} accepted", accepted.request_id)),
            }
        },
    )
    .await;
}

#[tokio::test]
async fn a_slow_tool_times_out_and_the_slot_is_released() {
    let script = "[[rules]]\nwhen_last_role = \"tool\"\nreply = \"never\"\n[[rules]]\nreply = \"Waiting.\"\ntool_calls = [{ name = \"snail\", arguments = {} }]\n";
    let f = Fleet::builder()
        .script(script)
        .default_settings()
        .slots(1)
        .start()
        .await;
    let definition = serde_json::from_value(serde_json::json!({
        "name": "snail", "brief": "Answer very slowly", "schema": {"type": "object"}, "timeout_ms": 200
    }))
    .unwrap();
    let _snail = genfleet::client::tool_service::ToolService::start(
        f.nats.client().await,
        &f.settings,
        definition,
        |_, _| async {
            // Answers long after the call's timeout (200 ms): the tool's slowness, not a wait.
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok(serde_json::json!("too late"))
        },
    )
    .await
    .unwrap();
    let client = &f.client;
    let mut snail_request = fleet::request("snail", "go");
    snail_request.tools = vec!["snail".into()];
    let result = fleet::run_when_tools_known(client, &snail_request, Duration::from_secs(10)).await;
    assert_eq!(result.reason, Reason::ToolExecutionError, "{result:?}");
    assert!(
        result
            .detail
            .as_deref()
            .unwrap_or_default()
            .contains("timed out after 200 ms")
    );
    assert_eq!(result.output, "Waiting.");
    // The worker's single slot is free again at once.
    let stats = client
        .nats()
        .request("$SRV.STATS.genfleet", "".into())
        .await
        .unwrap();
    let stats: serde_json::Value = serde_json::from_slice(&stats.payload).unwrap();
    assert_eq!(stats["endpoints"][0]["data"]["free"], 1, "{stats}");
}
