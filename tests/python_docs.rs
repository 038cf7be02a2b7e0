//! docs/python.md's Python programs run as written: each ```python block of the page, in order,
//! against a real fleet (nats-server, a worker, the scripted model, the demo calculator), with
//! only the page's server address, nats://127.0.0.1:4222, moved to the test's server. Each is
//! checked for what it shows: what the callers print, a conversation held on its key's worker,
//! a tenant's qualified id, a request that uses the tool a tool service serves, a decision a
//! manager answers, and the long-running ones' clean exit (0) on SIGTERM and on SIGINT
//! (Ctrl-C).

mod common;

use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fleet::{self, Fleet};
use common::wait;
use genfleet::llm::mock::Script;
use genfleet::protocol::{GenerationRequest, Reason};
use tokio::io::AsyncBufReadExt;

/// The one address the page's programs connect to.
const DOCS_URL: &str = "nats://127.0.0.1:4222";

/// How long a program, a request or an exit may take before the test fails.
const WITHIN: Duration = Duration::from_secs(30);

/// The scripted model, for the page's prompts.
const SCRIPT: &str = r#"
# Managers: the continuation carries the manager's choice.
[[rules]]
when_last_user_contains = "Decision chosen"
reply = "Filed as decided. {{last_user}}"

# Callers: the calculator, then its result.
[[rules]]
when_last_user_contains = "1234 × 5678"
when_last_role = "user"
tool_calls = [{ name = "calculate", arguments = { operation = "mul", a = 1234, b = 5678 } }]

[[rules]]
when_any_message_contains = "1234 × 5678"
when_last_role = "tool"
reply = "The calculator says {{last_message}}"

[[rules]]
when_last_user_contains = "haiku about queues"
reply = "Requests wait in line, a free slot takes the oldest, the queue empties out."

# Tenants.
[[rules]]
when_last_user_contains = "Summarise the report"
reply = "The report, summarised."

# Tool services: the test's request calls word_count.
[[rules]]
when_last_user_contains = "How many words"
when_last_role = "user"
tool_calls = [{ name = "word_count", arguments = { text = "the quick brown fox jumps" } }]

[[rules]]
when_any_message_contains = "How many words"
when_last_role = "tool"
reply = "word_count said {{last_message}}"

# Managers: the test's request asks a decision.
[[rules]]
when_last_user_contains = "Where should the report go"
reply = "The report is ready."
tool_calls = [{ name = "request_decision", arguments = { question = "Where should the report go?", options = [{ id = "email", label = "Email it" }, { id = "archive", label = "Archive it" }], default_option = "email" } }]

[[rules]]
reply = "Hello from the mock, {{last_user}}!"
"#;

/// Users for the Tenants program: `acme` may use only tenant acme's subjects, its own events
/// and its own reply prefix; every other connection (the workers, the test's client, the other
/// programs) is `worker`, which may do anything.
const NATS_CONFIG: &str = r#"
no_auth_user: worker
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

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn python() -> String {
    std::env::var("GENFLEET_TEST_PYTHON").unwrap_or_else(|_| {
        let venv = root().join(".venv/bin/python");
        assert!(
            venv.exists(),
            "this test needs Python with the nats-py and msgpack packages: run ./scripts/test.sh \
             (it creates .venv), or set GENFLEET_TEST_PYTHON to such an interpreter"
        );
        venv.to_string_lossy().into_owned()
    })
}

/// Every ```python block of the page, in order, with the heading it is under.
fn snippets(page: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut heading = String::new();
    let mut block: Option<String> = None;
    for line in page.lines() {
        match &mut block {
            Some(code) if line.trim_end() == "```" => {
                found.push((heading.clone(), std::mem::take(code)));
                block = None;
            }
            Some(code) => {
                code.push_str(line);
                code.push('\n');
            }
            None if line.trim_end() == "```python" => block = Some(String::new()),
            None if line.starts_with('#') => {
                heading = line.trim_start_matches('#').trim().to_string();
            }
            None => {}
        }
    }
    assert!(block.is_none(), "a ```python block of the page never ends");
    found
}

/// A program of the page, its address moved to `url`, run with the working tree's package.
fn program(python: &str, code: &str, url: &str) -> tokio::process::Command {
    assert!(
        code.contains(DOCS_URL),
        "a program of the page connects somewhere other than {DOCS_URL}:\n{code}"
    );
    let mut command = tokio::process::Command::new(python);
    command
        .arg("-c")
        .arg(code.replace(DOCS_URL, url))
        .current_dir(root())
        .env("PYTHONPATH", root().join("python"))
        .env("PYTHONUNBUFFERED", "1")
        .env("NATS_PASSWORD", "acpass")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

/// Runs a program to its end; what it printed (it must exit 0).
async fn run_to_end(python: &str, heading: &str, code: &str, url: &str) -> String {
    let output = wait::within(
        &format!("the {heading} program to end"),
        WITHIN,
        program(python, code, url).output(),
    )
    .await
    .unwrap_or_else(|e| panic!("{python} runs: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "the {heading} program ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{heading}:\n{stdout}");
    stdout
}

/// A long-running program of the page: started, its output gathered as it comes.
struct Serving {
    heading: String,
    child: tokio::process::Child,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<Vec<String>>>,
    /// The tasks that read its pipes: they end when the program's pipes close.
    readers: Vec<tokio::task::JoinHandle<()>>,
}

impl Serving {
    /// Starts the program and waits for its first line, `ready`.
    async fn start(python: &str, heading: &str, code: &str, url: &str, ready: &str) -> Serving {
        let mut child = program(python, code, url)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{python} runs: {e}"));
        let gather = |pipe: Box<dyn tokio::io::AsyncRead + Send + Unpin>| {
            let lines = Arc::new(Mutex::new(Vec::new()));
            let kept = lines.clone();
            let reader = tokio::spawn(async move {
                let mut reader = tokio::io::BufReader::new(pipe).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    kept.lock().unwrap().push(line);
                }
            });
            (lines, reader)
        };
        let (stdout, out_reader) = gather(Box::new(child.stdout.take().unwrap()));
        let (stderr, err_reader) = gather(Box::new(child.stderr.take().unwrap()));
        let serving = Serving {
            heading: heading.to_string(),
            child,
            stdout,
            stderr,
            readers: vec![out_reader, err_reader],
        };
        wait::until_showing(
            &format!("the {heading} program to print {ready:?}"),
            WITHIN,
            || async {
                let first = serving.stdout.lock().unwrap().first().cloned();
                first.filter(|line| line == ready)
            },
            || serving.said(),
        )
        .await;
        serving
    }

    fn said(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            self.stdout.lock().unwrap().join("\n"),
            self.stderr.lock().unwrap().join("\n")
        )
    }

    /// Sends `signal` (`TERM`, `INT`), waits for the exit; its status and what it printed.
    async fn stop_with(mut self, signal: &str) -> (ExitStatus, String) {
        let pid = self.child.id().expect("the program still runs").to_string();
        let sent = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill -{signal} {pid}");
        let status = wait::within(
            &format!("the {} program to exit on SIG{signal}", self.heading),
            WITHIN,
            self.child.wait(),
        )
        .await
        .unwrap();
        // The pipes close with the exit: read to their end.
        for reader in std::mem::take(&mut self.readers) {
            wait::within(
                &format!("the {} program's output to be read", self.heading),
                WITHIN,
                reader,
            )
            .await
            .unwrap();
        }
        (status, self.said())
    }
}

#[tokio::test]
async fn the_python_docs_programs_run_as_written() {
    let python = python();
    let f: Fleet = Fleet::builder()
        .nats_config(NATS_CONFIG)
        .mock_script(Script::from_toml_str(SCRIPT).unwrap())
        .default_settings()
        .slots(2)
        .calculator()
        .start()
        .await;
    let url = f.nats.url();
    // The calculator the Callers program names reaches the workers a moment after it registers.
    let mut known = GenerationRequest::user("What is 1234 × 5678?");
    known.tools = vec!["calculate".into()];
    fleet::run_when_tools_known(&f.client, &known, WITHIN).await;

    let page = std::fs::read_to_string(root().join("docs/python.md")).unwrap();
    let snippets = snippets(&page);
    let headings: Vec<&str> = snippets.iter().map(|(h, _)| h.as_str()).collect();
    assert_eq!(
        headings,
        [
            "Callers",
            "Affinity",
            "Tenants",
            "Tool services",
            "Managers"
        ],
        "docs/python.md's Python programs changed: give each its check here"
    );
    for (heading, code) in &snippets {
        match heading.as_str() {
            "Callers" => callers(&python, code, &url).await,
            "Affinity" => affinity(&python, code, &url).await,
            "Tenants" => tenants(&python, code, &url).await,
            "Tool services" => tool_service(&python, code, &url, &f).await,
            "Managers" => manager(&python, code, &url, &f).await,
            other => unreachable!("{other}"),
        }
    }
}

/// One request through the calculator, printed as `state reason output`; then a streamed
/// answer, delta by delta.
async fn callers(python: &str, code: &str, url: &str) {
    let printed = run_to_end(python, "Callers", code, url).await;
    let mut lines = printed.lines();
    let first = lines.next().unwrap_or_default();
    assert!(
        first.starts_with("COMPLETED stop The calculator says") && first.contains("7006652"),
        "{printed}"
    );
    assert_eq!(
        lines.collect::<Vec<_>>().join("\n"),
        "Requests wait in line, a free slot takes the oldest, the queue empties out.",
        "{printed}"
    );
}

/// A conversation's two turns, each held on the key's worker (the fleet's only one here):
/// the program waits for the client to follow the workers, so the first is placed too.
async fn affinity(python: &str, code: &str, url: &str) {
    let printed = run_to_end(python, "Affinity", code, url).await;
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(
        lines,
        [
            "True Hello from the mock, Plan a weekend in Lisbon!",
            "True Hello from the mock, Now make it rain-proof!"
        ],
        "{printed}"
    );
}

/// A tenant's request, known by its qualified id; its status found by the bare id.
async fn tenants(python: &str, code: &str, url: &str) {
    let printed = run_to_end(python, "Tenants", code, url).await;
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(
        lines,
        ["acme.report-7", "acme.report-7 COMPLETED"],
        "{printed}"
    );
}

/// The tool service serves word_count until SIGTERM: a request through the fleet uses it, and
/// the program exits 0, its tool withdrawn.
async fn tool_service(python: &str, code: &str, url: &str, f: &Fleet) {
    let serving = Serving::start(
        python,
        "Tool services",
        code,
        url,
        "serving word_count until Ctrl-C",
    )
    .await;
    let mut request = GenerationRequest::user("How many words are in my sentence?");
    request.tools = vec!["word_count".into()];
    let result = fleet::run_when_tools_known(&f.client, &request, WITHIN).await;
    assert_eq!(
        result.reason,
        Reason::Stop,
        "{result:?}\n{}",
        serving.said()
    );
    assert_eq!(
        result.output,
        r#"word_count said {"words":5}"#,
        "{result:?}\n{}",
        serving.said()
    );
    let (status, said) = serving.stop_with("TERM").await;
    println!("Tool services (stopped with SIGTERM, {status}):\n{said}\n{result:?}");
    assert!(status.success(), "{status}\n{said}");
    // Withdrawn: the definition is gone from the bucket.
    let js = async_nats::jetstream::new(f.client.nats().clone());
    let bucket = js.get_key_value("GENFLEET_TOOLS").await.unwrap();
    assert!(
        bucket.get("word_count").await.unwrap().is_none(),
        "word_count is still registered after the program stopped"
    );
}

/// The manager answers a decision with its default option; the continuation carries it; the
/// program exits 0 on SIGINT.
async fn manager(python: &str, code: &str, url: &str, f: &Fleet) {
    let serving = Serving::start(
        python,
        "Managers",
        code,
        url,
        "answering the fleet's decisions until Ctrl-C",
    )
    .await;
    let request = GenerationRequest::user("Where should the report go?");
    let asked = f.client.run("default", request, WITHIN).await.unwrap();
    assert_eq!(asked.reason, Reason::DecisionRequested, "{asked:?}");
    let asking = asked.request_id.clone();
    let continuation = wait::until_showing(
        "the manager program to answer the decision",
        WITHIN,
        || async {
            let status = f.client.status(&asking).await.ok()?;
            status.continuation_request_id
        },
        || serving.said(),
    )
    .await;
    let continued = fleet::wait_result(
        &f.client,
        &continuation,
        WITHIN,
        fleet::RUNNING_OR_UNCLAIMED,
    )
    .await;
    assert!(
        continued
            .output
            .contains("Decision chosen: Email it (email)"),
        "{continued:?}\n{}",
        serving.said()
    );
    // Ctrl-C here, SIGTERM for the tool service: the programs stop cleanly on either.
    let (status, said) = serving.stop_with("INT").await;
    println!("Managers (stopped with SIGINT, {status}):\n{said}");
    assert!(status.success(), "{status}\n{said}");
    // It printed the signal that asked, as `type code summary`.
    assert!(
        said.lines()
            .any(|line| line.starts_with("decision_request ")),
        "{said}"
    );
}
