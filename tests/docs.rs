//! The docs keep up with the code: every configuration key is in docs/configuration.md, and
//! the README's by-hand flow runs as written.

mod common;

use std::path::Path;
use std::process::Command;

use common::nats::{NatsServer, free_port};
use common::process::Running;

#[test]
fn every_configuration_key_is_documented() {
    let defaults: toml::Table = toml::from_str(genfleet::settings::DEFAULT_TOML).unwrap();
    let reference = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .unwrap();
    let mut missing = Vec::new();
    for (section, table) in &defaults {
        for (key, value) in table.as_table().expect("sections are tables") {
            // A table within a section (`[worker.reserved_slots]`) is documented key by key.
            let names: Vec<String> = match value.as_table() {
                Some(inner) => inner
                    .keys()
                    .map(|k| format!("`{section}.{key}.{k}`"))
                    .collect(),
                None => vec![format!("`{section}.{key}`")],
            };
            for name in names {
                if !reference.contains(&name) {
                    missing.push(name);
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in docs/configuration.md (run scripts/config-reference.py): {missing:?}"
    );
}

/// The README's by-hand block: its commands, one per line, comments dropped.
fn readme_by_hand() -> Vec<String> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let from = readme
        .find("By hand, against a NATS you run")
        .expect("the README has its by-hand section");
    let block = &readme[from..];
    let start = block.find("```sh\n").expect("a sh block") + "```sh\n".len();
    let end = start + block[start..].find("```").expect("the block ends");
    block[start..end]
        .lines()
        .map(|line| {
            line.split(" #")
                .next()
                .unwrap_or_default()
                .trim()
                .to_string()
        })
        .filter(|line| !line.is_empty())
        .collect()
}

/// The README's Python snippet that follows its by-hand block.
fn readme_python() -> String {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let from = readme
        .find("By hand, against a NATS you run")
        .expect("the README has its by-hand section");
    let block = &readme[from..];
    let start = block.find("```python\n").expect("a python block") + "```python\n".len();
    let end = start + block[start..].find("```").expect("the block ends");
    block[start..end].to_string()
}

/// A command line as the shell splits it (double or single quotes group words; within single
/// quotes a double quote is a character).
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote: Option<char> = None;
    let mut any = false;
    for c in line.chars() {
        match c {
            '"' | '\'' if quote.is_none() => {
                quote = Some(c);
                any = true;
            }
            c if quote == Some(c) => quote = None,
            ' ' if quote.is_none() => {
                if any {
                    words.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            _ => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push(word);
    }
    words
}

/// The README's by-hand flow, word for word: each command of its block runs as written (from
/// the repository's root, so its file arguments resolve), with only the addresses moved to free
/// ports of this test's own servers.
#[test]
fn the_readmes_by_hand_flow_runs_as_written() {
    let root = env!("CARGO_MANIFEST_DIR");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let nats = runtime.block_on(NatsServer::start());
    let backend_port = free_port();
    let gateway_port = free_port();
    let env: Vec<(String, String)> = [
        ("GENFLEET__NATS__URL", nats.url()),
        (
            "GENFLEET__LLM__BASE_URL",
            format!("http://127.0.0.1:{backend_port}/v1"),
        ),
        ("GENFLEET__HTTP__LISTEN", "127.0.0.1:0".into()),
        ("GENFLEET__CONSOLE__LISTEN", "127.0.0.1:0".into()),
        (
            "GENFLEET__GATEWAY__LISTEN",
            format!("127.0.0.1:{gateway_port}"),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut running: Vec<Running> = Vec::new();
    let mut ran = Vec::new();
    for line in readme_by_hand() {
        if line == "nats-server -js" {
            // This test's own server stands in for it.
            continue;
        }
        let mut words = words(&line);
        let mut line_env = env.clone();
        while words
            .first()
            .is_some_and(|w| w.contains('=') && !w.starts_with('-'))
        {
            let assignment = words.remove(0);
            let (key, value) = assignment.split_once('=').unwrap();
            line_env.push((key.to_string(), value.to_string()));
        }
        if words[0] == "curl" {
            // Sent as curl sends it (curl may be missing here): the URL, the headers, the body.
            ran.push((
                "curl".into(),
                curl(&runtime, &words, gateway_port),
                String::new(),
            ));
            continue;
        }
        assert_eq!(
            words[..2],
            ["cargo", "run"],
            "a README command that is not genfleet: {line}"
        );
        assert_eq!(words[2], "--", "{line}");
        let args: Vec<String> = words[3..]
            .iter()
            .map(|w| w.replace("127.0.0.1:8000", &format!("127.0.0.1:{backend_port}")))
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let ready = match args[0] {
            "mock-llm" => Some("mock-llm listening on"),
            "worker" => Some("worker ready"),
            "tool-demo" => Some("tool-demo serving"),
            "manager" => Some("following signals.>"),
            "console" => Some("console listening on"),
            "gateway" => Some("gateway listening on"),
            _ => None,
        };
        match ready {
            Some(marker) => {
                let mut command = Running::start_in(args[0], root, &args, &line_env);
                command.wait_for(marker);
                running.push(command);
            }
            None => {
                let output = Command::new(env!("CARGO_BIN_EXE_genfleet"))
                    .current_dir(root)
                    .args(&args)
                    .envs(line_env.iter().map(|(k, v)| (k, v)))
                    .output()
                    .unwrap();
                let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
                let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
                assert!(
                    output.status.success(),
                    "{line}\n{stdout}\n{stderr}\nthe others said:\n{}",
                    running
                        .iter_mut()
                        .map(|r| r.output())
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                ran.push((args[0].to_string(), stdout, stderr));
            }
        }
    }
    // The job went through the calculator, a decision the manager answered, and the
    // continuation.
    let (_, submitted, said) = ran
        .iter()
        .find(|(command, ..)| command == "submit")
        .expect("the README submits a job");
    assert!(
        submitted.contains("7,006,652") && submitted.contains("Report filed"),
        "{submitted}\n{said}"
    );
    assert!(said.contains("continuing as"), "{said}");
    // The chat completion went through the gateway to the worker and the scripted model.
    let (_, answer, _) = ran
        .iter()
        .find(|(command, ..)| command == "curl")
        .expect("the README calls the gateway");
    let answer: serde_json::Value = serde_json::from_str(answer).unwrap();
    assert_eq!(
        answer.pointer("/choices/0/message/content"),
        Some(&serde_json::json!(
            "Hello from the fleet: a genfleet worker answered this through the gateway."
        )),
        "{answer}"
    );
    assert_eq!(
        answer.pointer("/choices/0/finish_reason"),
        Some(&serde_json::json!("stop"))
    );
    // The README's Python snippet, as written, against the same gateway.
    let snippet = readme_python().replace("127.0.0.1:8081", &format!("127.0.0.1:{gateway_port}"));
    let python = std::env::var("GENFLEET_TEST_PYTHON").unwrap_or_else(|_| {
        let venv = Path::new(root).join(".venv/bin/python");
        assert!(
            venv.exists(),
            "this test needs Python with the openai package: run ./scripts/test.sh (it creates \
             .venv), or set GENFLEET_TEST_PYTHON to such an interpreter"
        );
        venv.to_string_lossy().into_owned()
    });
    let output = Command::new(&python)
        .args(["-c", &snippet])
        .output()
        .unwrap_or_else(|e| panic!("{python} runs: {e}"));
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success()
            && printed.trim()
                == "Hello from the fleet: a genfleet worker answered this through the gateway.",
        "the README's Python snippet ({}):\n{printed}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let (_, fleet, _) = ran
        .iter()
        .find(|(command, ..)| command == "fleet")
        .expect("the README lists the fleet");
    assert!(fleet.contains("default"), "{fleet}");
    for command in running {
        let status = command.signal_and_wait("TERM");
        assert!(status.success(), "{status:?}");
    }
    drop(nats);
}

/// A README `curl URL -H 'Name: value' ... -d BODY` line, sent with reqwest to the gateway on
/// `gateway_port`; the answer's body (the call must succeed).
fn curl(runtime: &tokio::runtime::Runtime, words: &[String], gateway_port: u16) -> String {
    let mut url = None;
    let mut headers = Vec::new();
    let mut body = None;
    let mut rest = words[1..].iter();
    while let Some(word) = rest.next() {
        match word.as_str() {
            "-H" => headers.push(rest.next().expect("-H has a header").clone()),
            "-d" => body = Some(rest.next().expect("-d has a body").clone()),
            url_word if url_word.starts_with("http") => {
                url = Some(url_word.replace("127.0.0.1:8081", &format!("127.0.0.1:{gateway_port}")))
            }
            other => panic!("a curl option the test does not know: {other}"),
        }
    }
    let url = url.expect("curl has a URL");
    genfleet::llm::openai::install_crypto_provider();
    runtime.block_on(async {
        let mut request = reqwest::Client::new().post(&url);
        for header in &headers {
            let (name, value) = header.split_once(": ").expect("Name: value");
            request = request.header(name, value);
        }
        let response = request
            .body(body.expect("curl sends a body"))
            .send()
            .await
            .unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        assert!(status.is_success(), "{url}: {status} {text}");
        text
    })
}
