//! Every long-running command stops on SIGTERM and on SIGINT at any point of its life: while it
//! waits for a NATS server that does not answer, and while it serves. Each is started as a user
//! starts it (the built binary, settings from the environment), signalled once it says where it
//! is, and must then exit by itself with status 0.
//!
//! No assertion depends on timing: the bounds below are only how long the test waits before it
//! calls a command stuck.

mod common;

use std::process::{Command, Stdio};

use common::nats::{NatsServer, free_port};
use common::process::Running;

/// The long-running commands that wait for NATS, with what each prints once it serves.
const WAITING_COMMANDS: [(&str, &[&str], &str); 2] = [
    ("worker", &["worker"], "worker ready"),
    ("tool-demo", &["tool-demo"], "tool-demo serving"),
];

/// The long-running commands that fail fast without NATS, with what each prints once it serves.
const SERVING_COMMANDS: [(&str, &[&str], &str); 2] = [
    (
        "manager",
        &["manager", "--deliver", "new"],
        "following signals.>",
    ),
    (
        "console",
        &["console", "--listen", "127.0.0.1:0"],
        "console listening on",
    ),
];

fn env_for(nats_url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("GENFLEET__NATS__URL", nats_url.to_string()),
        // A backend nobody serves: starting and stopping do not need one.
        (
            "GENFLEET__LLM__BASE_URL",
            format!("http://127.0.0.1:{}/v1", free_port()),
        ),
        ("GENFLEET__HTTP__LISTEN", "127.0.0.1:0".to_string()),
    ]
}

#[test]
fn a_signal_stops_a_command_waiting_for_an_unreachable_nats() {
    let unreachable = format!("nats://127.0.0.1:{}", free_port());
    for (name, args, _) in WAITING_COMMANDS {
        for signal in ["TERM", "INT"] {
            let mut running = Running::start(name, args, &env_for(&unreachable));
            running.wait_for("NATS is not reachable yet; still trying");
            let status = running.signal_and_wait(signal);
            assert!(
                status.success(),
                "{name} while connecting, SIG{signal}: {status:?}"
            );
        }
    }
    // The others do not wait: without NATS they say so and exit by themselves.
    for (name, args, _) in SERVING_COMMANDS {
        let output = Command::new(env!("CARGO_BIN_EXE_genfleet"))
            .args(args)
            .envs(env_for(&unreachable))
            .stdin(Stdio::null())
            .output()
            .expect("runs");
        assert!(!output.status.success(), "{name} without NATS");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("NATS"), "{name}: {stderr}");
    }
}

#[tokio::test]
async fn a_signal_stops_every_long_running_command_while_it_serves() {
    let nats = NatsServer::start().await;
    let url = nats.url();
    tokio::task::spawn_blocking(move || {
        let script = std::env::temp_dir().join(format!("genfleet-stopping-{}.toml", free_port()));
        std::fs::write(&script, "[[rules]]\nreply = \"ok\"\n").unwrap();
        let script = script.to_string_lossy().to_string();
        let mock_args = ["mock-llm", "--listen", "127.0.0.1:0", "--script", &script];
        let all = WAITING_COMMANDS
            .iter()
            .chain(SERVING_COMMANDS.iter())
            .copied()
            .chain([("mock-llm", &mock_args[..], "mock-llm listening on")]);
        for (name, args, ready) in all {
            for signal in ["TERM", "INT"] {
                let mut running = Running::start(name, args, &env_for(&url));
                running.wait_for(ready);
                let status = running.signal_and_wait(signal);
                assert!(status.success(), "{name} serving, SIG{signal}: {status:?}");
            }
        }
        let _ = std::fs::remove_file(&script);
    })
    .await
    .unwrap();
    drop(nats);
}
