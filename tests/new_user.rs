//! What a new user hit, tried as a new user tries it: the demo's model with any prompt, a model
//! that calls a tool the request did not offer, a pool no worker serves, `submit --follow` on a
//! request that uses a tool, and a cancelled request's status (issue 38).

mod common;

use std::time::Duration;

use common::fleet::{Fleet, request};
use genfleet::protocol::{Reason, RequestState};

const WITHIN: Duration = Duration::from_secs(60);

/// Runs `genfleet ARGS` against the fleet's NATS: (exit success, stdout, stderr).
async fn genfleet(f: &Fleet, args: &[&str]) -> (bool, String, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(args)
        .env("GENFLEET__NATS__URL", f.nats.url())
        .env_remove("RUST_LOG")
        .output()
        .await
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn demo_script() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/demo-llm.toml")).unwrap()
}

/// The demo's model answers a prompt that is not its multiplication with a plain sentence, not
/// with a call of a tool the request never offered.
#[tokio::test]
async fn the_demo_model_answers_any_prompt_without_a_tool() {
    let f = Fleet::builder()
        .script(&demo_script())
        .settings(|s| s.loop_detection.enabled = false)
        .start()
        .await;
    let (ok, stdout, stderr) = genfleet(&f, &["submit", "--follow", "Tell me a story"]).await;
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("demo model"), "{stdout}");
    assert!(stderr.contains("COMPLETED stop"), "{stderr}");
}

/// A model that calls a tool the request did not offer ends FAILED `tool_parse_error` with a
/// detail written for the person reading it: which tool, and what the request offers.
#[tokio::test]
async fn a_call_of_a_tool_not_offered_is_explained_to_a_person() {
    let f = Fleet::builder()
        .script(
            "[[rules]]\ntool_calls = [{ name = \"calculate\", arguments = { a = 1, b = 2 } }]\n",
        )
        .start()
        .await;
    let result = f
        .client
        .run("default", request("no-tools", "anything"), WITHIN)
        .await
        .unwrap();
    assert_eq!(result.reason, Reason::ToolParseError, "{result:?}");
    let detail = result.detail.unwrap_or_default();
    assert!(
        detail.contains("the model called `calculate`, a tool this request does not offer")
            && detail.contains("it offers no tools"),
        "{detail}"
    );
}

/// A pool no worker serves: a submit says so and names the pools that have workers; a durable
/// submit is queued and says that it waits for a worker of that pool.
#[tokio::test]
async fn a_pool_without_workers_is_named_as_such() {
    let f = Fleet::builder()
        .script("[[rules]]\nreply = \"hi\"\n")
        .start()
        .await;
    let (ok, _, stderr) = genfleet(&f, &["submit", "--pool", "nope", "hello"]).await;
    assert!(!ok);
    assert!(
        stderr.contains("no worker of pool nope is connected")
            && stderr.contains("pools with workers now: default"),
        "{stderr}"
    );
    let (ok, stdout, stderr) = genfleet(
        &f,
        &[
            "submit",
            "--pool",
            "nope",
            "--durable",
            "--request-id",
            "waits",
            "hello",
        ],
    )
    .await;
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with("waits QUEUED"), "{stdout}");
    assert!(
        stderr.contains("no worker of pool nope is connected")
            && stderr.contains("waits in the queue until one is"),
        "{stderr}"
    );
    // Where a worker serves the pool, nothing is said.
    let (ok, _, stderr) = genfleet(&f, &["submit", "--durable", "hello"]).await;
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("no worker of pool"), "{stderr}");
}

/// `submit --follow` shows the tool loop on stderr beside the output, as the demo narrates it.
#[tokio::test]
async fn submit_follow_shows_tool_calls_and_results() {
    let f = Fleet::builder()
        .script(&demo_script())
        .calculator()
        .start()
        .await;
    let (_, stdout, stderr) = genfleet(
        &f,
        &[
            "submit",
            "--follow",
            "--no-chain",
            "--tool",
            "calculate",
            "What is 1234 × 5678?",
        ],
    )
    .await;
    assert!(
        stderr.contains("▸ tool call: calculate {"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("▸ tool result: calculate → {\"value\":7006652"),
        "{stdout}\n{stderr}"
    );
}

/// A cancelled request says who cancelled it and why (when the cancel said), and a request cut
/// before its backend counted tokens does not claim zero.
#[tokio::test]
async fn a_cancelled_requests_status_says_why_and_does_not_claim_zero_tokens() {
    let f = Fleet::builder()
        .script("[[rules]]\nreply = \"tick \"\nrepeat = 2000\nchunk = \"word\"\ndelay_ms = 20\n")
        .settings(|s| s.loop_detection.enabled = false)
        .start()
        .await;
    let mut events = Box::pin(f.client.follow("cut").await.unwrap());
    f.client
        .submit("default", &request("cut", "go"))
        .await
        .unwrap();
    // Some output has streamed.
    tokio::time::timeout(WITHIN, async {
        use futures_util::StreamExt;
        while let Some(event) = events.next().await {
            if event.body.name() == "delta" {
                return;
            }
        }
        panic!("the events ended before a delta");
    })
    .await
    .expect("a delta of the request within the wait");
    f.client
        .cancel_because("cut", "the user closed the tab")
        .await
        .unwrap();
    let result = f.client.result("cut", false).await.unwrap();
    assert_eq!(result.state, RequestState::Cancelled);
    assert_eq!(
        result.detail.as_deref(),
        Some("cancelled by its caller: the user closed the tab")
    );
    assert!(!result.output.is_empty());
    let (ok, stdout, stderr) = genfleet(&f, &["status", "cut"]).await;
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("cancelled by its caller: the user closed the tab"),
        "{stdout}"
    );
    assert!(
        stdout.contains("tokens:   not reported (it ended before the backend counted them)"),
        "{stdout}"
    );
}

/// SIGTERM while NATS is out of reach: the worker cannot store or hand back anything, so it
/// says so and stops without waiting out its drain (an hour here: that it exits at all shows it
/// did not wait), with status 0.
#[tokio::test]
async fn sigterm_with_nats_out_of_reach_stops_the_worker_without_draining() {
    let mut f = Fleet::builder()
        .script("[[rules]]\nreply = \"tick \"\nrepeat = 100000\nchunk = \"word\"\ndelay_ms = 20\n")
        .settings(|s| s.loop_detection.enabled = false)
        .worker_env("GENFLEET__WORKER__DRAIN_TIMEOUT_MS", 3_600_000)
        .worker_processes(["w1"])
        .start()
        .await;
    let mut events = Box::pin(f.client.follow("long").await.unwrap());
    f.client
        .submit("default", &request("long", "go"))
        .await
        .unwrap();
    tokio::time::timeout(WITHIN, async {
        use futures_util::StreamExt;
        while let Some(event) = events.next().await {
            if event.body.name() == "delta" {
                return;
            }
        }
    })
    .await
    .expect("the request runs");
    f.nats.kill().await;
    // SIGTERM once the worker knows NATS is gone (before that it would drain as usual).
    let log_path = f.logs().join("w1.log");
    common::wait::until("the worker to see NATS gone", WITHIN, || async {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        if log.contains("disconnected from NATS") {
            Ok(())
        } else {
            Err("not yet")
        }
    })
    .await;
    let pid = f.processes[0].pid().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(sent.success());
    let mut status = None;
    let deadline = tokio::time::Instant::now() + WITHIN;
    while status.is_none() && tokio::time::Instant::now() < deadline {
        status = f.processes[0].child.try_wait().unwrap();
        if status.is_none() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let log = std::fs::read_to_string(f.logs().join("w1.log")).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("the worker still drains; its log:\n{log}"));
    assert!(status.success(), "{status:?}\n{log}");
    assert!(
        log.contains("NATS is out of reach: nothing can be stored or handed back"),
        "{log}"
    );
}

/// A worker whose model server does not answer takes no work: a submit is refused
/// NO_SLOT_AVAILABLE saying why (not taken and failed `backend_error`), and its log says what
/// it waits for. Once the model server answers, it takes work.
#[tokio::test]
async fn a_worker_takes_no_work_until_its_backend_answers() {
    let port = common::nats::free_port();
    let f = Fleet::builder()
        .backend_url(format!("http://127.0.0.1:{port}/v1"))
        .worker_processes(["w"])
        .start()
        .await;
    let refused = f
        .client
        .submit_once("default", &request("too-early", "hello"))
        .await
        .expect_err("a worker without its backend takes no work");
    assert_eq!(
        refused.code(),
        Some(genfleet::protocol::ErrorCode::NoSlotAvailable),
        "{refused}"
    );
    assert!(
        refused
            .to_string()
            .contains("takes no work until its backend answers"),
        "{refused}"
    );
    let log = std::fs::read_to_string(f.logs().join("w.log")).unwrap_or_default();
    assert!(
        log.contains("waiting for the backend to answer before taking work"),
        "{log}"
    );
    // The model server comes up: the worker takes work.
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("up.toml");
    std::fs::write(&script, "[[rules]]\nreply = \"up now\"\n").unwrap();
    let (_backend, _) = common::fleet::mock_llm(&format!("127.0.0.1:{port}"), &script);
    let deadline = tokio::time::Instant::now() + WITHIN;
    let result = loop {
        match f
            .client
            .run("default", request("in-time", "hello"), WITHIN)
            .await
        {
            Ok(result) => break result,
            Err(error) => {
                assert_eq!(
                    error.code(),
                    Some(genfleet::protocol::ErrorCode::NoSlotAvailable),
                    "{error}"
                );
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the worker never took work: {error}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(result.state, RequestState::Completed, "{result:?}");
    assert_eq!(result.output, "up now");
}
