//! `genfleet demo` as a user runs it: the whole flow narrated, and nothing left behind.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::wait;
use tokio::io::{AsyncBufReadExt, BufReader};

fn demo() -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"));
    command
        .arg("demo")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

/// The port of the demo's nats-server, from its first line.
fn nats_port(line: &str) -> u16 {
    let at = line.find("127.0.0.1:").expect("the address is printed") + "127.0.0.1:".len();
    line[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Waits (bounded, loud) until nothing listens on `port` any more.
async fn wait_gone(port: u16) {
    wait::until(
        &format!("the demo's nats-server on port {port} to be stopped"),
        Duration::from_secs(5),
        || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
        },
    )
    .await;
}

#[tokio::test]
async fn the_demo_shows_the_tool_call_the_decision_the_answer_and_the_result() {
    let output = wait::within("the demo ends", Duration::from_secs(60), demo().output())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for expected in [
        "tool call: calculate",
        "tool result: calculate",
        "signal decision_request.NEEDS_MANAGER_DECISION",
        "option email: Email it to the team (default)",
        "finished: COMPLETED decision_requested",
        "manager:demo chose Email it to the team (email)",
        "the job continues as request",
        "chain position 2",
        "finished: COMPLETED stop",
        "Report filed as the manager decided.",
        "started genfleet gateway: OpenAI's chat completions API at http://127.0.0.1:",
        "curl http://127.0.0.1:",
        "/v1/chat/completions -H 'Content-Type: application/json' -d '{",
        "assistant: Hello from the fleet: a genfleet worker answered this through the gateway.",
        "finish_reason stop",
        "stopped: gateway, manager, tool service, worker, mock backend, nats-server",
    ] {
        assert!(
            stdout.contains(expected),
            "{expected:?} missing from\n{stdout}"
        );
    }
    let port = nats_port(stdout.lines().next().unwrap());
    wait_gone(port).await;
}

#[tokio::test]
async fn ctrl_c_stops_everything_the_demo_started() {
    // As at a terminal: the demo leads its own process group, and Ctrl-C goes to the group.
    let mut child = demo().process_group(0).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut errors = BufReader::new(child.stderr.take().unwrap()).lines();
    let stderr = tokio::spawn(async move {
        let mut all = Vec::new();
        while let Ok(Some(line)) = errors.next_line().await {
            all.push(line);
        }
        all
    });
    let first = lines.next_line().await.unwrap().unwrap();
    let port = nats_port(&first);
    wait::within("the job starts", Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("request started") {
                return;
            }
        }
        panic!("the demo ended before its job started");
    })
    .await;
    let pid = child.id().unwrap().to_string();
    let kill = std::process::Command::new("kill")
        .args(["-INT", "--", &format!("-{pid}")])
        .status()
        .unwrap();
    assert!(kill.success());
    let mut rest = Vec::new();
    let status = wait::within(
        "the demo stops after Ctrl-C",
        Duration::from_secs(20),
        async {
            while let Some(line) = lines.next_line().await.unwrap() {
                rest.push(line);
            }
            child.wait().await.unwrap()
        },
    )
    .await;
    assert!(status.success(), "{rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("interrupted"))
            && rest.iter().any(|l| l.starts_with("stopped:")),
        "{rest:?}"
    );
    // No nats-server is left behind.
    wait_gone(port).await;
    // The server goes last: nothing lost it on the way down.
    let stderr = stderr.await.unwrap();
    assert!(
        !stderr.iter().any(|l| l.contains("WARN")),
        "warnings while stopping: {stderr:#?}"
    );
}
