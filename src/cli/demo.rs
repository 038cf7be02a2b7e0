//! `genfleet demo`: the whole flow on one machine, narrated. It starts a private nats-server
//! (JetStream, a free port, a temporary store), the mock backend with a demo script, a worker,
//! the example tool service and a manager with a demo policy; then submits a job that calls a
//! tool, asks for a decision, is answered by the manager and finishes in a continuation.
//! Last, one chat completion goes through `genfleet gateway`, as any OpenAI client sends it.
//! Everything it started is stopped on exit, on an error and on Ctrl-C.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use indicatif::{ProgressBar, ProgressStyle};

use super::private_nats::{PrivateNats, TempDir};
use crate::bus::worker::WorkerHandle;
use crate::client::Client;
use crate::client::tool_service::ToolService;
use crate::llm::mock::{MockServer, Script};
use crate::manager::{LogSink, Manager, ManagerOptions, Policy};
use crate::protocol::{Event, EventBody, GenerationRequest, GenerationResult, Reason};
use crate::settings::Settings;

const DEMO_SCRIPT: &str = include_str!("../../config/demo-llm.toml");
const DEMO_POLICY: &str = include_str!("../../config/demo-policy.toml");

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The nats-server binary [default: nats-server on PATH, /usr/sbin, /usr/local/bin].
    #[arg(long, value_name = "PATH")]
    pub nats_server: Option<PathBuf>,
    /// Give up if the job has not finished after this many seconds.
    #[arg(long, default_value_t = 60)]
    pub wait_secs: u64,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    // Installed first: a Ctrl-C at any point ends the demo through the clean-up below.
    let interrupted = super::shutdown_signal();
    let mut stack = Stack::default();
    let outcome = tokio::select! {
        outcome = demo(&args, &mut stack) => outcome,
        _ = interrupted => {
            say("interrupted: stopping everything the demo started");
            Ok(())
        }
    };
    stack.tear_down().await;
    outcome
}

/// What the demo started, stopped in reverse order.
#[derive(Default)]
struct Stack {
    nats: Option<PrivateNats>,
    store: Option<TempDir>,
    mock: Option<MockServer>,
    worker: Option<WorkerHandle>,
    tools: Vec<ToolService>,
    manager: Option<Running>,
    gateway: Option<Running>,
}

/// A part of the demo that runs in its own task until it is told to stop.
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Spawns `run`, handing it the future that resolves when [`Running::stop`] is called.
    fn spawn<F>(run: impl FnOnce(BoxFuture<'static, ()>) -> F) -> Running
    where
        F: Future + Send + 'static,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = run(async {
            let _ = stopped.await;
        }
        .boxed());
        let task = tokio::spawn(async move {
            let _ = running.await;
        });
        Running { stop, task }
    }

    /// Tells it to stop and waits for it, up to 5 s.
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(5), self.task).await;
    }
}

impl Stack {
    async fn tear_down(&mut self) {
        if let Some(gateway) = self.gateway.take() {
            gateway.stop().await;
        }
        if let Some(manager) = self.manager.take() {
            manager.stop().await;
        }
        for tool in self.tools.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(2), tool.withdraw()).await;
        }
        if let Some(worker) = self.worker.take() {
            let _ = tokio::task::spawn_blocking(move || worker.stop()).await;
        }
        self.mock.take();
        if let Some(mut nats) = self.nats.take() {
            nats.stop().await;
        }
        self.store.take();
        say("stopped: gateway, manager, tool service, worker, mock backend, nats-server");
    }
}

async fn demo(args: &DemoArgs, stack: &mut Stack) -> anyhow::Result<()> {
    let store = TempDir::new("genfleet-demo")?;
    let nats = PrivateNats::start(args.nats_server.as_deref(), store.path()).await?;
    step(&format!(
        "started nats-server with JetStream on {} ({})",
        nats.url.trim_start_matches("nats://"),
        nats.binary.display()
    ));
    let url = nats.url.clone();
    let nats_url = url.clone();
    stack.store = Some(store);
    stack.nats = Some(nats);

    let script = Script::from_toml_str(DEMO_SCRIPT).map_err(anyhow::Error::msg)?;
    let mock = MockServer::start(script)
        .await
        .context("cannot start the mock backend")?;
    step(&format!(
        "started the mock backend (OpenAI-compatible) at {}",
        mock.base_url()
    ));
    let mut settings = Settings::defaults();
    settings.nats.url = url;
    settings.llm.base_url = mock.base_url();
    settings.llm.model = "demo-model".into();
    settings.worker.id = "demo-worker".into();
    settings.worker.slots = 2;
    settings.worker.drain_timeout_ms = 3000;
    settings.http.listen = "127.0.0.1:0".into();
    stack.mock = Some(mock);

    // Each part under its own connection name, as the server's connection list shows them.
    settings.nats.name = "genfleet-demo".into();
    let tool_settings = settings.clone();
    let client = Client::connect(&settings)
        .await?
        .with_timeout(Duration::from_secs(10));
    stack.tools.push(
        ToolService::start(
            client.nats().clone(),
            &tool_settings,
            super::tool_demo::calculate_definition(),
            |arguments, _| async move { super::tool_demo::calculate(&arguments) },
        )
        .await?,
    );
    step("started the example tool service: calculate (tools.calculate)");

    let mut worker_settings = settings.clone();
    worker_settings.nats.name = "genfleet-demo-worker".into();
    let worker = tokio::task::spawn_blocking(move || WorkerHandle::spawn(worker_settings))
        .await?
        .context("the worker did not start")?;
    let metrics = worker
        .http_addr
        .map(|a| format!("; metrics at http://{a}/metrics"))
        .unwrap_or_default();
    step(&format!(
        "started worker {} (pool default, 2 slots){metrics}",
        worker.worker_id
    ));
    stack.worker = Some(worker);

    let policy = Policy::from_toml_str(DEMO_POLICY)?;
    let mut options = ManagerOptions::new("demo", policy);
    options.deliver = crate::manager::Deliver::New;
    let mut manager_settings = settings.clone();
    manager_settings.nats.name = "genfleet-demo-manager".into();
    let manager = Manager::start(&manager_settings, options, Arc::new(ManagerLines)).await?;
    stack.manager = Some(Running::spawn(|stopped| manager.run(stopped)));
    step(
        "started manager \"demo\": it answers a model's decision request with its default after 1.5 s",
    );

    let mut gateway_settings = settings.clone();
    gateway_settings.nats.name = "genfleet-demo-gateway".into();
    gateway_settings.gateway.drain_ms = 1000;
    let gateway = crate::gateway::Gateway::start(
        &gateway_settings,
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
    )
    .await
    .context("the gateway did not start")?;
    let gateway_url = format!("http://{}/v1", gateway.addr());
    stack.gateway = Some(Running::spawn(|stopped| gateway.run(stopped)));
    step(&format!(
        "started genfleet gateway: OpenAI's chat completions API at {gateway_url}"
    ));

    let wait = Duration::from_secs(args.wait_secs);
    run_job(&client, &nats_url, wait).await?;
    through_gateway(&gateway_url, wait).await
}

/// One chat completion through the gateway: the curl command line that sends it, then the
/// answer (sent from here with the same body, so no curl is needed).
async fn through_gateway(base_url: &str, wait: Duration) -> anyhow::Result<()> {
    let body = serde_json::json!({
        "model": "default",
        "messages": [{"role": "user", "content": "Say hello through the gateway."}],
    });
    let url = format!("{base_url}/chat/completions");
    step("one chat completion through the gateway, as any OpenAI client sends it:");
    say(&format!(
        "    curl {url} -H 'Content-Type: application/json' -d '{body}'"
    ));
    crate::llm::openai::install_crypto_provider();
    let http = reqwest::Client::builder().timeout(wait).build()?;
    let response = http
        .post(&url)
        .json(&body)
        .send()
        .await
        .context("the gateway did not answer")?;
    let status = response.status();
    let request_id = response
        .headers()
        .get("x-genfleet-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let answer: serde_json::Value = response
        .json()
        .await
        .context("the gateway's answer is not JSON")?;
    anyhow::ensure!(
        status.is_success(),
        "the gateway answered {status}: {answer}"
    );
    let content = answer
        .pointer("/choices/0/message/content")
        .and_then(|c| c.as_str())
        .unwrap_or_default();
    let finish = answer
        .pointer("/choices/0/finish_reason")
        .and_then(|c| c.as_str())
        .unwrap_or_default();
    say(&format!("  assistant: {content}"));
    say(&format!(
        "  (id {}, finish_reason {finish}, {} tokens; request {request_id} on the bus)",
        answer["id"].as_str().unwrap_or_default(),
        answer
            .pointer("/usage/total_tokens")
            .and_then(|t| t.as_u64())
            .unwrap_or_default()
    ));
    say("");
    Ok(())
}

async fn run_job(client: &Client, nats_url: &str, wait: Duration) -> anyhow::Result<()> {
    let mut request = GenerationRequest::user(
        "What is 1234 × 5678? Use the calculator, then file a short report.",
    );
    request.job_name = Some("demo-report".into());
    request.tools = vec!["calculate".into()];
    let id = crate::protocol::ids::new_id();
    request.request_id = Some(id.clone());
    let deadline = tokio::time::Instant::now() + wait;
    step(&format!(
        "submitting job demo-report as request {id}: \"{}\"",
        request.messages[0].text()
    ));
    let mut events = Box::pin(client.follow(&id).await?);
    // The tool definition reaches the worker through the bucket it watches: retry briefly.
    let mut tries = 0;
    loop {
        match client.submit("default", &request).await {
            Ok(_) => break,
            Err(error) if tries < 50 => {
                tries += 1;
                tracing::debug!(%error, "submit retried");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
    let mut current = id;
    loop {
        let result = narrate(&mut events, nats_url, deadline).await?;
        if result.reason != Reason::DecisionRequested {
            print_final(&result);
            return Ok(());
        }
        step("waiting for a manager to answer the decision ...");
        let next = tokio::time::timeout_at(deadline, async {
            while let Some(event) = events.next().await {
                match event.body {
                    EventBody::Continued {
                        continuation_request_id,
                    } => return Ok(continuation_request_id),
                    EventBody::ChainEnded { outcome, .. } => {
                        return Err(anyhow::anyhow!(
                            "the decision ended the job: {}",
                            outcome.as_str()
                        ));
                    }
                    _ => {}
                }
            }
            Err(anyhow::anyhow!("the events of {current} stopped"))
        })
        .await
        .context("no answer in time")??;
        step(&format!(
            "the job continues as request {next} (a fresh request with the choice injected)"
        ));
        events = Box::pin(client.follow(&next).await?);
        current = next;
    }
}

/// Prints one request's events as they come, until `finished`.
async fn narrate(
    events: &mut (impl futures_util::Stream<Item = Event> + Unpin),
    nats_url: &str,
    deadline: tokio::time::Instant,
) -> anyhow::Result<GenerationResult> {
    let mut streaming: Option<(ProgressBar, String)> = None;
    let finish_stream = |streaming: &mut Option<(ProgressBar, String)>| {
        if let Some((bar, text)) = streaming.take() {
            bar.finish_and_clear();
            say(&format!("  model: {}", text.trim()));
        }
    };
    loop {
        let event = tokio::time::timeout_at(deadline, events.next())
            .await
            .context("the job did not finish in time")?
            .context("the event stream ended")?;
        match event.body {
            EventBody::Started {
                worker_id,
                attempt,
                chain_position,
            } => step(&format!(
                "request started on {worker_id} (chain position {chain_position}, attempt {attempt})"
            )),
            EventBody::Resumed {
                worker_id,
                from_worker,
                ..
            } => step(&format!(
                "request went on on {worker_id}, from its last checkpoint on {from_worker}"
            )),
            EventBody::Delta { text } => {
                let (bar, so_far) = streaming.get_or_insert_with(|| {
                    let bar = ProgressBar::new_spinner();
                    bar.set_style(
                        ProgressStyle::with_template("  {spinner} streaming: {wide_msg}")
                            .expect("a valid template"),
                    );
                    bar.enable_steady_tick(Duration::from_millis(80));
                    (bar, String::new())
                });
                so_far.push_str(&text);
                bar.set_message(tail(so_far, 70));
            }
            EventBody::Reasoning { .. } => {}
            EventBody::ToolCall {
                name, arguments, ..
            } => {
                finish_stream(&mut streaming);
                step(&format!("tool call: {name} {arguments}"));
            }
            EventBody::ToolResult {
                name, ok, result, ..
            } => {
                let how = if ok { "result" } else { "error reply" };
                step(&format!("tool {how}: {name} → {result}"));
            }
            EventBody::Signal { signal } => {
                finish_stream(&mut streaming);
                step(&format!(
                    "signal {}.{}: {}",
                    signal.kind.as_str(),
                    signal.code,
                    signal.summary
                ));
                if let Some(decision) = &signal.decision {
                    for option in &decision.options {
                        let default = if decision.default_option.as_deref() == Some(&option.id) {
                            " (default)"
                        } else {
                            ""
                        };
                        say(&format!(
                            "    option {}: {}{default}",
                            option.id, option.label
                        ));
                    }
                    say(&format!(
                        "    (to answer first yourself: GENFLEET__NATS__URL={nats_url} genfleet decide {} archive)",
                        decision.decision_id
                    ));
                }
            }
            EventBody::Finished { result } => {
                finish_stream(&mut streaming);
                step(&format!(
                    "request {} finished: {} {}",
                    result.request_id,
                    result.state.as_str(),
                    result.reason.as_str()
                ));
                return Ok(*result);
            }
            EventBody::Continued { .. } | EventBody::ChainEnded { .. } => {}
        }
    }
}

fn print_final(result: &GenerationResult) {
    say("");
    say(&format!(
        "result of {} (chain position {}, parent {}):",
        result.request_id,
        result.chain_position,
        result.parent_request_id.as_deref().unwrap_or("none")
    ));
    say(&format!("  {}", result.output));
    say(&format!(
        "  {} {} in {} ms, {} prompt + {} completion tokens",
        result.state.as_str(),
        result.reason.as_str(),
        result.timings_ms.total,
        result.usage.prompt_tokens,
        result.usage.completion_tokens
    ));
    say("");
}

/// The manager's log lines, marked as the manager's.
struct ManagerLines;

impl LogSink for ManagerLines {
    fn write_line(&self, line: &str) {
        say(&format!("  manager │ {line}"));
    }
}

fn step(text: &str) {
    say(&format!("▸ {text}"));
}

fn say(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

/// The last `max` characters of a text, on one line.
fn tail(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c == '\n' { ' ' } else { c })
        .collect();
    let count = flat.chars().count();
    flat.chars().skip(count.saturating_sub(max)).collect()
}
