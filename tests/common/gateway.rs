//! A `genfleet gateway` process in front of a fleet of the mock backend
//! (tests/data/gateway.toml), for the tests of the gateway's APIs.

use std::path::PathBuf;
use std::time::Duration;

use genfleet::llm::mock::Script;

use super::fleet::Fleet;
use super::process::Running;

/// The key callers use, and the tenant it stands for.
pub const KEY: &str = "sk-gateway-test-0123456789";
pub const TENANT: &str = "team-test";
/// Generous: a busy machine is slow, never wrong.
pub const WITHIN: Duration = Duration::from_secs(60);

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub async fn fleet(slots: u32) -> Fleet {
    let script = Script::from_file(root().join("tests/data/gateway.toml")).unwrap();
    let mut fleet = Fleet::builder()
        .mock_script(script)
        .slots(slots)
        .calculator()
        // The slow answer repeats itself on purpose.
        .settings(|s| s.loop_detection.enabled = false)
        .start()
        .await;
    // The test looks at the requests the gateway sends as the key's tenant: its client is
    // that tenant's, so the ids the test chose name them (`<tenant>.<id>` on the bus).
    fleet.client = fleet.client.clone().with_tenant(TENANT).unwrap();
    fleet
}

/// A `genfleet gateway` process of the fleet, listening on `port`.
pub struct Gateway {
    process: Option<Running>,
    pub port: u16,
    _config: tempfile::TempDir,
}

impl Gateway {
    /// A gateway whose one key is [`KEY`], for [`TENANT`].
    pub async fn start(fleet: &Fleet, port: u16, extra: &[(&str, &str)]) -> Gateway {
        Gateway::start_with_keys(fleet, port, &[(KEY, TENANT)], extra).await
    }

    /// A gateway with these keys (each with its tenant), configured by their hashes.
    pub async fn start_with_keys(
        fleet: &Fleet,
        port: u16,
        keys: &[(&str, &str)],
        extra: &[(&str, &str)],
    ) -> Gateway {
        let config = tempfile::tempdir().unwrap();
        let path = config.path().join("gateway.toml");
        let mut toml = String::new();
        for (key, tenant) in keys {
            toml.push_str(&format!(
                "[[gateway.api_keys]]\nsha256 = \"{}\"\ntenant = \"{tenant}\"\n\n",
                genfleet::gateway::keys::hash_hex(key)
            ));
        }
        toml.push_str("[gateway.models.gpt-test]\npool = \"default\"\nmodel = \"mock-model\"\n");
        std::fs::write(&path, toml).unwrap();
        let mut env: Vec<(String, String)> = vec![
            ("GENFLEET__NATS__URL".into(), fleet.nats.url()),
            (
                "GENFLEET__GATEWAY__LISTEN".into(),
                format!("127.0.0.1:{port}"),
            ),
        ];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let config_path = path.to_string_lossy().into_owned();
        let process = tokio::task::spawn_blocking(move || {
            let mut process =
                Running::start("gateway", &["--config", &config_path, "gateway"], &env);
            process.wait_for("gateway listening on");
            process
        })
        .await
        .unwrap();
        Gateway {
            process: Some(process),
            port,
            _config: config,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    pub async fn stop(&mut self, signal: &'static str) {
        let process = self.process.take().unwrap();
        tokio::task::spawn_blocking(move || process.signal_and_wait(signal))
            .await
            .unwrap();
    }
}

pub fn python() -> String {
    std::env::var("GENFLEET_TEST_PYTHON").unwrap_or_else(|_| {
        let venv = root().join(".venv/bin/python");
        assert!(
            venv.exists(),
            "this test needs Python with the openai package: run ./scripts/test.sh (it creates \
             .venv), or set GENFLEET_TEST_PYTHON to such an interpreter"
        );
        venv.to_string_lossy().into_owned()
    })
}

/// Answers the next decision asked on `asks` (a subscription to `signals.decision_request.>`)
/// with option `a`, as a manager would.
pub async fn answer_next_decision(
    client: &genfleet::client::Client,
    asks: &mut async_nats::Subscriber,
) {
    use futures_util::StreamExt;
    let signal = super::wait::within("the model asks", WITHIN, asks.next())
        .await
        .unwrap();
    let signal: serde_json::Value = serde_json::from_slice(&signal.payload).unwrap();
    let decision_id = signal["decision"]["decision_id"].as_str().unwrap();
    let answer = genfleet::protocol::DecisionAnswer {
        option_id: "a".into(),
        rationale: None,
        decided_by: Some("test".into()),
        modified_prompt: None,
        guidance: None,
        confidence_boost: None,
    };
    client.decide(decision_id, &answer).await.unwrap();
}

/// Runs one part of a client script of tests/python/ (`<script>.py BASE_URL KEY PART [ARGS]`)
/// against the gateway, and returns what it printed; the part must end printing
/// `<passed_as>: PART passed`.
pub async fn python_part(
    gateway: &Gateway,
    script: &str,
    passed_as: &str,
    part: &str,
    args: &[&str],
) -> String {
    let python = python();
    let output = tokio::process::Command::new(&python)
        .arg(root().join("tests/python").join(script))
        .args([&gateway.base_url(), KEY, part])
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{python} runs: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success() && stdout.contains(&format!("{passed_as}: {part} passed")),
        "{script} {part} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}
