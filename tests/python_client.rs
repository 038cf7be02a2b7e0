//! The wire protocol as an outside user sees it: tests/python/fleet_client.py, a nats-py client
//! written from docs/protocol.md alone, against a real nats-server and one worker.

mod common;

use std::path::PathBuf;

use common::nats::NatsServer;
use genfleet::bus::worker::WorkerHandle;
use genfleet::llm::mock::{MockServer, Script};
use genfleet::settings::Settings;

/// Fields drop in order: the worker drains while NATS is still up, the server goes last.
struct Fleet {
    worker: WorkerHandle,
    mock: MockServer,
    nats: NatsServer,
}

async fn fleet() -> Fleet {
    let nats = NatsServer::start().await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/openai_compat.toml");
    let mock = MockServer::start(Script::from_file(&script).unwrap())
        .await
        .unwrap();
    let mut settings = Settings::defaults();
    settings.nats.url = nats.url();
    settings.llm.base_url = mock.base_url();
    settings.llm.api_key = "test-key".into();
    settings.worker.pool = "default".into();
    settings.worker.slots = 2;
    settings.worker.drain_timeout_ms = 2000;
    let worker = tokio::task::spawn_blocking(move || WorkerHandle::spawn(settings))
        .await
        .unwrap()
        .unwrap();
    Fleet { worker, mock, nats }
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
    let Fleet { worker, mock, nats } = f;
    drop(worker);
    drop(mock);
    drop(nats);
}
