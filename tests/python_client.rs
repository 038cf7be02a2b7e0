//! The wire protocol as an outside user sees it: tests/python/fleet_client.py, a nats-py client
//! written from docs/protocol.md alone, against a real nats-server and one worker.

mod common;

use std::path::PathBuf;

use common::fleet::Fleet;
use common::wait;
use genfleet::llm::mock::Script;

async fn fleet() -> Fleet {
    fleet_with("", None).await
}

/// The fleet on a server configured with `nats_config`, its workers (and client) connecting as
/// `user` (name, password) when given.
async fn fleet_with(nats_config: &str, user: Option<(&str, &str)>) -> Fleet {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/openai_compat.toml");
    Fleet::builder()
        .nats_config(nats_config)
        .mock_script(Script::from_file(&script).unwrap())
        .default_settings()
        .slots(2)
        .settings(|s| {
            s.llm.api_key = "test-key".into();
            s.worker.pool = "default".into();
            s.worker.drain_timeout_ms = 2000;
            if let Some((name, password)) = user {
                s.nats.user = name.into();
                s.nats.password = password.into();
            }
        })
        .start()
        .await
}

fn python() -> String {
    std::env::var("GENFLEET_TEST_PYTHON").unwrap_or_else(|_| {
        let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
        assert!(
            venv.exists(),
            "this test needs Python with the nats-py and msgpack packages: run ./scripts/test.sh \
             (it creates .venv), or set GENFLEET_TEST_PYTHON to such an interpreter"
        );
        venv.to_string_lossy().into_owned()
    })
}

#[tokio::test]
async fn the_python_client_written_from_the_docs_talks_to_the_fleet() {
    let python = python();
    let f = fleet().await;
    let client = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/fleet_client.py");
    // tokio's Command: the mock backend runs on this test's runtime and must keep serving.
    let output = tokio::process::Command::new(&python)
        .arg(client)
        .arg(f.nats.url())
        .output()
        .await
        .unwrap_or_else(|e| panic!("{python} runs: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "python fleet client failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("python fleet client: all checks passed"),
        "{stdout}"
    );
}

/// A Python command of the package's (`python/`), run from the working tree's copy, so the
/// test sees the package as it is now.
fn package_python(python: &str, nats_url: &str) -> tokio::process::Command {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut command = tokio::process::Command::new(python);
    command
        .current_dir(root.join("python"))
        .env("PYTHONPATH", root.join("python"))
        .env("GENFLEET_NATS_URL", nats_url)
        .kill_on_drop(true);
    command
}

/// A long-running example, ready once it printed `ready`.
async fn example_serving(
    python: &str,
    nats_url: &str,
    script: &str,
    ready: &str,
) -> tokio::process::Child {
    use tokio::io::AsyncBufReadExt;
    let mut child = package_python(python, nats_url)
        .arg(script)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = wait::within(
        &format!("{script} to say it is ready"),
        std::time::Duration::from_secs(60),
        lines.next_line(),
    )
    .await
    .unwrap();
    assert_eq!(first.as_deref(), Some(ready), "{script}");
    // Its later lines are not read; they must not fill the pipe and block it.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    child
}

/// The Python package (caller, tool service, manager) against a real worker, then its examples
/// as they are written.
#[tokio::test]
async fn the_python_package_and_its_examples_work_against_the_fleet() {
    let python = python();
    let f = fleet().await;
    let url = f.nats.url();
    let output = package_python(&python, &url)
        .arg("tests/check_package.py")
        .arg(&url)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{stdout}");
    assert!(
        stdout.contains("a pool without workers is NoWorker"),
        "{stdout}"
    );

    // The examples, as docs/python.md runs them.
    let mut tools = example_serving(
        &python,
        &url,
        "examples/word_count_tool.py",
        "serving: word_count",
    )
    .await;
    let mut manager = example_serving(
        &python,
        &url,
        "examples/manager.py",
        "following the fleet's signals",
    )
    .await;
    let ask = |args: &'static [&'static str]| {
        let (python, url) = (&python, &url);
        async move {
            // The workers see a new tool a moment after it is registered: asked again until
            // then.
            let what = format!("{args:?} to be answered");
            wait::until(&what, std::time::Duration::from_secs(20), || async {
                let output = package_python(python, url)
                    .arg("examples/ask.py")
                    .args(args)
                    .output()
                    .await
                    .unwrap();
                let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
                let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
                if output.status.success() {
                    Ok(stdout)
                } else if stderr.contains("INVALID_REQUEST") {
                    Err(format!("{stdout}\n{stderr}"))
                } else {
                    panic!("{args:?}\n{stdout}\n{stderr}")
                }
            })
            .await
        }
    };
    let counted = ask(&["py-count: how many words?", "--tool", "word_count"]).await;
    assert!(
        counted.contains("[tool call: word_count") && counted.contains("\"words\":4"),
        "{counted}"
    );
    assert!(counted.contains("COMPLETED stop"), "{counted}");
    println!("{counted}");
    let decided = ask(&["py-decide: which way?"]).await;
    println!("{decided}");
    assert!(
        decided.contains("the decision was answered: continuing as")
            && decided.contains("Decision chosen: Left (left)")
            && decided.contains("COMPLETED stop"),
        "{decided}"
    );
    let _ = tools.kill().await;
    let _ = manager.kill().await;
}

/// Users for python/tests/check_tenant.py: `acme` may use only tenant acme's subjects, its own
/// events and its own reply prefix; `worker` may do anything.
const TENANT_USERS: &str = r#"
authorization {
  users = [
    { user: worker, password: wpass }
    { user: acme, password: acpass, permissions: {
        publish = { allow = [
          "gen.submit.*.acme", "gen.queue.*.*.acme.*",
          "gen.status.acme.*", "gen.result.acme.*", "gen.cancel.acme.*"
        ] }
        subscribe = { allow = [ "gen.events.acme.*", "_INBOX_acme.>" ] }
    } }
  ]
}
"#;

/// The package as a tenant's client (`tenant`, `inbox_prefix`, qualified ids, priority bands
/// on the queue) under a NATS user allowed nothing but that tenant's subjects.
#[tokio::test]
async fn the_python_package_acts_as_a_tenant_with_its_own_inbox() {
    let python = python();
    let f = fleet_with(TENANT_USERS, Some(("worker", "wpass"))).await;
    let url = f.nats.url();
    let mut check = package_python(&python, &url);
    check.arg("tests/check_tenant.py").arg(&url);
    passes(check, "python tenant client: all checks passed").await;
}

/// The package's placement of keyed submits (python/tests/check_placement.py): the rule
/// against the vectors every implementation shares, then against a fleet of three workers,
/// each turn of a conversation from a new client landing on the key's worker, the fallbacks
/// shown by fake heartbeats the check answers itself.
#[tokio::test]
async fn the_python_package_places_keyed_submits_by_the_fleets_rule() {
    let python = python();
    // Three workers: a turn that follows another at once may still see the worker it ran on
    // busy in that worker's last heartbeat, and of three workers with even slots one busy slot
    // stays under the default load bound.
    let f = Fleet::builder().workers(3).slots(2).start().await;
    let url = f.nats.url();
    let vectors = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/placement.json");
    let mut check = package_python(&python, &url);
    check
        .arg("tests/check_placement.py")
        .arg(vectors)
        .arg(&url)
        .arg(f.settings.worker.lost_after_ms.to_string())
        .args(f.workers.iter().map(|w| w.worker_id.clone()));
    passes(check, "python placement: all checks passed").await;
}

/// Runs a Python check of the package's to its end: it must succeed and say `passed`.
async fn passes(mut check: tokio::process::Command, passed: &str) {
    let output = check.output().await.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains(passed), "{stdout}");
}
