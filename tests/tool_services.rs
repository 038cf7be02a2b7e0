//! Tool services on the bus: `genfleet tool-demo` registers its tools in KV and serves them; a
//! worker calls them for a model; on SIGTERM they are withdrawn.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::nats::NatsServer;
use genfleet::bus::client::Client;
use genfleet::bus::worker::WorkerHandle;
use genfleet::llm::mock::{MockServer, Script};
use genfleet::protocol::{ErrorCode, GenerationRequest, Reason};
use genfleet::settings::Settings;

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

fn request(id: &str, text: &str) -> GenerationRequest {
    let mut r = GenerationRequest::user(text);
    r.request_id = Some(id.into());
    r.tools = vec!["calculate".into(), "clock".into()];
    r
}

#[tokio::test]
async fn the_demo_tools_serve_a_worker_and_are_withdrawn_on_sigterm() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(Script::from_toml_str(CALCULATES).unwrap())
        .await
        .unwrap();
    let mut settings = Settings::defaults();
    settings.nats.url = nats.url();
    settings.llm.base_url = mock.base_url();
    let s = settings.clone();
    let worker = tokio::task::spawn_blocking(move || WorkerHandle::spawn(s))
        .await
        .unwrap()
        .unwrap();
    let mut demo = Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .arg("tool-demo")
        .env("GENFLEET__NATS__URL", nats.url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let client = Client::connect(&settings).await.unwrap();
    let mut result = None;
    for i in 0..200 {
        match client
            .run(
                "default",
                request(&format!("mul{i}"), "seventeen times"),
                Duration::from_secs(10),
            )
            .await
        {
            Ok(r) => {
                result = Some(r);
                break;
            }
            Err(e) if e.code() == Some(ErrorCode::InvalidRequest) => {
                tokio::time::sleep(Duration::from_millis(25)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
    let result = result.expect("the demo tools get registered");
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
    let status = tokio::task::spawn_blocking(move || demo.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    let mut refused = false;
    for i in 0..200 {
        match client
            .submit("default", &request(&format!("late{i}"), "x"))
            .await
        {
            Err(e) if e.code() == Some(ErrorCode::InvalidRequest) => {
                refused = true;
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
    assert!(refused, "withdrawn tools are unknown");
    drop(worker);
}

#[tokio::test]
async fn a_slow_tool_times_out_and_the_slot_is_released() {
    let nats = NatsServer::start().await;
    let script = "[[rules]]\nwhen_last_role = \"tool\"\nreply = \"never\"\n[[rules]]\nreply = \"Waiting.\"\ntool_calls = [{ name = \"snail\", arguments = {} }]\n";
    let mock = MockServer::start(Script::from_toml_str(script).unwrap())
        .await
        .unwrap();
    let mut settings = Settings::defaults();
    settings.nats.url = nats.url();
    settings.llm.base_url = mock.base_url();
    settings.worker.slots = 1;
    let s = settings.clone();
    let worker = tokio::task::spawn_blocking(move || WorkerHandle::spawn(s))
        .await
        .unwrap()
        .unwrap();
    let definition = serde_json::from_value(serde_json::json!({
        "name": "snail", "brief": "Answer very slowly", "schema": {"type": "object"}, "timeout_ms": 200
    }))
    .unwrap();
    let _snail = genfleet::bus::tool_service::ToolService::start(
        nats.client().await,
        &settings,
        definition,
        |_, _| async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok(serde_json::json!("too late"))
        },
    )
    .await
    .unwrap();
    let client = Client::connect(&settings).await.unwrap();
    let mut snail_request = GenerationRequest::user("go");
    snail_request.tools = vec!["snail".into()];
    let mut result = None;
    for i in 0..200 {
        snail_request.request_id = Some(format!("snail{i}"));
        match client
            .run("default", snail_request.clone(), Duration::from_secs(10))
            .await
        {
            Ok(r) => {
                result = Some(r);
                break;
            }
            Err(e) if e.code() == Some(ErrorCode::InvalidRequest) => {
                tokio::time::sleep(Duration::from_millis(25)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
    let result = result.unwrap();
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
    drop(worker);
}
