//! `genfleet mock-llm` as users run it: a separate process, driven by the engine's HTTP client
//! and by the official `openai` Python client.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use common::*;
use genfleet::engine::DefaultBios;
use genfleet::llm::mock::{MockServer, Script};
use genfleet::llm::{LlmBackend, OpenAiBackend};
use genfleet::protocol::Reason;
use genfleet::settings::Settings;
use serde_json::json;

/// The mock server process; killed on drop.
struct MockProcess {
    child: Child,
    base_url: String,
}

impl Drop for MockProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_mock(script: &str) -> MockProcess {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(script);
    let mut child = Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["mock-llm", "--listen", "127.0.0.1:0", "--script"])
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("genfleet mock-llm starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base_url = line
        .trim()
        .strip_prefix("mock-llm listening on ")
        .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
        .to_string();
    MockProcess { child, base_url }
}

#[tokio::test]
async fn the_engine_runs_against_the_mock_llm_process() {
    let mock = start_mock("openai_compat.toml");
    let mut settings = Settings::defaults();
    settings.llm.base_url = mock.base_url.clone();
    settings.llm.api_key = "test-key".into();
    let backend: Arc<dyn LlmBackend> = Arc::new(OpenAiBackend::new(&settings.llm).unwrap());
    // The in-process server only stands by; every call goes to the process.
    let idle = MockServer::start(Script::echo()).await.unwrap();
    let h = Harness::from_parts(idle, settings, backend, Arc::new(DefaultBios));
    let (result, _) = h
        .run(request(
            json!({"messages": [{"role": "user", "content": "Ada"}]}),
        ))
        .await;
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    assert_eq!(result.output, "Hello from the mock, Ada!");
    assert_eq!(result.reasoning, "Short thought.");

    let (result, _) = h
        .run(request(json!({"messages": [{"role": "user", "content": "add"}], "tools": ["add", "clock"], "tool_iterations": 1})))
        .await;
    // The script calls tools whenever tools are offered; the second turn has no budget left.
    assert_eq!(result.reason, Reason::ToolExecutionError, "{result:?}");
    assert_eq!(result.tool_iterations_used, 1);
    assert_eq!(h.tools.calls().len(), 2);
}

/// The prefix-cache flags turn the cache on in a script-less server, and its stats say so.
#[tokio::test]
async fn prefix_cache_flags_turn_the_cache_on() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args([
            "mock-llm",
            "--listen",
            "127.0.0.1:0",
            "--prefix-cache-entries",
            "7",
        ])
        .args(["--prefix-hit-ms", "0", "--prefill-ms-per-kb", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("genfleet mock-llm starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let mock = MockProcess {
        child,
        base_url: line
            .trim()
            .trim_start_matches("mock-llm listening on ")
            .to_string(),
    };
    genfleet::llm::openai::install_crypto_provider();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let stats_url = mock.base_url.replace("/v1", "/mock/stats");
    for _ in 0..2 {
        let reply = http
            .post(format!("{}/chat/completions", mock.base_url))
            .json(&json!({"messages": [{"role": "user", "content": "same"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 200);
    }
    let stats: serde_json::Value = http
        .get(&stats_url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        stats["prefix_cache"],
        json!({"hits": 1, "misses": 1, "entries": 1, "capacity": 7})
    );
}

#[test]
fn the_official_openai_python_client_talks_to_mock_llm() {
    let python = std::env::var("GENFLEET_TEST_PYTHON").unwrap_or_else(|_| {
        let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
        assert!(
            venv.exists(),
            "this test needs Python with the openai package: run ./scripts/test.sh (it creates .venv), \
             or set GENFLEET_TEST_PYTHON to such an interpreter"
        );
        venv.to_string_lossy().into_owned()
    });
    let mock = start_mock("openai_compat.toml");
    let client = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_client.py");
    let output = Command::new(python)
        .arg(client)
        .arg(&mock.base_url)
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "openai client failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
