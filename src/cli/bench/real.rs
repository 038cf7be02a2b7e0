//! The real-backend phase: a real model server (llama.cpp's `llama-server` with a small GGUF
//! model, as `scripts/real-backend.sh` installs them) behind one worker of the local fleet,
//! against the same HTTP client calling the server directly with the very body the worker
//! sends (BIOS, native tools, options), at each concurrency, in one run.
//!
//! Each request asks for exactly `tokens` tokens (`ignore_eos`, temperature 0), so both paths
//! generate the same amount; tokens/s is completion tokens over the level's wall time, and time
//! to first token is measured from the submit (genfleet) or the HTTP request (direct) to the
//! first content.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use serde::Serialize;
use serde_json::json;
use tokio::process::{Child, Command};

use super::interactive;
use super::latency::{Samples, Summary};
use super::local::LocalFleet;
use super::target::Target;
use crate::cli::private_nats::free_port;
use crate::engine::{DefaultBios, Engine, EngineConfig, RequestContext};
use crate::llm::{ChatRequest, LlmBackend, OpenAiBackend, StreamEvent};
use crate::protocol::GenerationRequest;
use crate::settings::Settings;
use crate::tools::{ToolInvocation, ToolReply, ToolRunError, ToolRunner};

/// The pool the real backend's worker serves, apart from the mock's.
const POOL: &str = "bench-real";
/// How long the model server may take to load its model.
const SERVER_START: Duration = Duration::from_secs(180);
/// The prompt of every request: long enough to answer at length.
const PROMPT: &str = "Write a long story about a lighthouse keeper and a storm.";

/// Where the real model server and its model are, from the flags or the environment that
/// `scripts/real-backend.sh` prints.
#[derive(Debug, Clone)]
pub struct RealSpec {
    pub server: PathBuf,
    pub model: PathBuf,
    /// A chat template for `--chat-template-file` (the model carries none), if any.
    pub template: Option<PathBuf>,
    /// Completion tokens per request.
    pub tokens: u32,
    /// Requests per path at each concurrency.
    pub requests: u64,
    pub levels: Vec<usize>,
}

impl RealSpec {
    /// The server and model given, or named by `GENFLEET_REAL_SERVER` and
    /// `GENFLEET_REAL_MODEL`; `None` when either is missing.
    pub fn locate(server: Option<PathBuf>, model: Option<PathBuf>) -> Option<(PathBuf, PathBuf)> {
        let from_env = |name: &str| std::env::var_os(name).map(PathBuf::from);
        let server = server.or_else(|| from_env("GENFLEET_REAL_SERVER"))?;
        let model = model.or_else(|| from_env("GENFLEET_REAL_MODEL"))?;
        Some((server, model))
    }

    /// The chat template `scripts/real-backend.sh` names (`GENFLEET_REAL_TEMPLATE`), if any.
    pub fn template() -> Option<PathBuf> {
        std::env::var_os("GENFLEET_REAL_TEMPLATE").map(PathBuf::from)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct RealReport {
    pub server: String,
    pub model: String,
    pub tokens_per_request: u32,
    pub levels: Vec<RealLevel>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RealLevel {
    pub concurrency: usize,
    pub direct: RealFigures,
    pub through_genfleet: RealFigures,
    /// genfleet's tokens/s over the direct client's.
    pub tokens_per_sec_ratio: Option<f64>,
    /// genfleet's time to first token p50 less the direct client's, in ms.
    pub added_first_token_p50_ms: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct RealFigures {
    pub requests: u64,
    pub completed: u64,
    pub errors: u64,
    pub completion_tokens: u64,
    pub wall_secs: f64,
    pub tokens_per_sec: f64,
    pub first_token_ms: Option<Summary>,
    pub first_error: Option<String>,
}

/// The model server, killed when dropped.
struct ModelServer {
    base_url: String,
    _child: Child,
}

impl ModelServer {
    async fn start(spec: &RealSpec, parallel: usize, log: &Path) -> anyhow::Result<ModelServer> {
        let port = free_port()?;
        let log_file =
            std::fs::File::create(log).context("cannot create the model server's log")?;
        // Each slot gets its own share of the context: enough for the BIOS, the native control
        // tools and the answer.
        let context = 4096 * parallel.max(1);
        let mut command = Command::new(&spec.server);
        if let Some(template) = &spec.template {
            command.arg("--chat-template-file").arg(template);
        }
        let mut child = command
            .arg("-m")
            .arg(&spec.model)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--jinja",
            ])
            .args([
                "-c",
                &context.to_string(),
                "--parallel",
                &parallel.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {}", spec.server.display()))?;
        let http = reqwest::Client::new();
        let health = format!("http://127.0.0.1:{port}/health");
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "the model server exited at start ({status}); its log:\n{}",
                    tail(log)
                );
            }
            if let Ok(response) = http
                .get(&health)
                .timeout(Duration::from_secs(1))
                .send()
                .await
                && response.status().is_success()
            {
                break;
            }
            anyhow::ensure!(
                started.elapsed() < SERVER_START,
                "the model server was not ready within {SERVER_START:?}; its log:\n{}",
                tail(log)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(ModelServer {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            _child: child,
        })
    }
}

/// The last lines of a log, for an error message.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// The bench's requests name no tools; the engine that lays out the direct call needs a
/// runner all the same.
struct NoTools;

impl ToolRunner for NoTools {
    fn run(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolReply, ToolRunError>> {
        async move { Err(ToolRunError::NoResponders(call.name)) }.boxed()
    }
}

fn request(request_id: String, tokens: u32) -> GenerationRequest {
    serde_json::from_value(json!({
        "request_id": request_id,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0.0,
        // Generate exactly max_tokens, whatever the model would say (llama.cpp's server).
        "options": {"ignore_eos": true},
    }))
    .expect("the bench's request is valid")
}

pub async fn run(
    fleet: &LocalFleet,
    settings: &Settings,
    spec: &RealSpec,
    timeout: Duration,
) -> anyhow::Result<RealReport> {
    let parallel = spec.levels.iter().copied().max().unwrap_or(1);
    eprintln!(
        "real backend: starting {} with {}",
        spec.server.display(),
        spec.model.display()
    );
    let server = ModelServer::start(spec, parallel, &fleet.dir().join("model-server.log")).await?;
    let worker = fleet
        .start_worker_at("bench-real-1", POOL, parallel as u32, &server.base_url)
        .await?;
    let target = Target::connect(settings.clone(), POOL.into(), parallel, timeout).await?;

    let mut llm = settings.llm.clone();
    llm.base_url = server.base_url.clone();
    let backend = Arc::new(OpenAiBackend::new(&llm).map_err(anyhow::Error::msg)?);
    let engine = Engine::new(
        EngineConfig::from_settings(settings),
        backend.clone(),
        Arc::new(NoTools),
        Arc::new(DefaultBios),
    );
    let first_call = engine
        .first_call(
            request("direct".into(), spec.tokens),
            RequestContext::new("direct", &worker.worker_id, POOL),
        )
        .map_err(anyhow::Error::msg)?;

    // One of each first: the server's prompt cache holds the shared prefix from then on.
    let warm = direct(&backend, &first_call, 1, 1).await;
    anyhow::ensure!(
        warm.completed == 1,
        "the model server did not answer the direct client: {}",
        warm.first_error.unwrap_or_default()
    );
    let warm = through_genfleet(&target, spec.tokens, "warm", 1, 1).await;
    anyhow::ensure!(
        warm.completed == 1,
        "the worker did not complete a request on the model server: {}",
        warm.first_error.unwrap_or_default()
    );

    let mut levels = Vec::new();
    for &concurrency in &spec.levels {
        eprintln!(
            "real backend: concurrency {concurrency}, {} requests per path",
            spec.requests
        );
        let direct = direct(&backend, &first_call, concurrency, spec.requests).await;
        let through = through_genfleet(
            &target,
            spec.tokens,
            &format!("c{concurrency}"),
            concurrency,
            spec.requests,
        )
        .await;
        let ratio =
            (direct.tokens_per_sec > 0.0).then(|| through.tokens_per_sec / direct.tokens_per_sec);
        let added = match (&through.first_token_ms, &direct.first_token_ms) {
            (Some(g), Some(d)) => Some(g.p50 - d.p50),
            _ => None,
        };
        levels.push(RealLevel {
            concurrency,
            direct,
            through_genfleet: through,
            tokens_per_sec_ratio: ratio,
            added_first_token_p50_ms: added,
        });
    }
    target.close().await;
    Ok(RealReport {
        server: spec.server.display().to_string(),
        model: spec.model.display().to_string(),
        tokens_per_request: spec.tokens,
        levels,
    })
}

/// Calls `one(n)` for `n` in `0..requests`, `concurrency` at a time, and tallies what they
/// measured.
async fn tallied_calls<F, Fut>(requests: u64, concurrency: usize, one: F) -> RealFigures
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = One>,
{
    let started = Instant::now();
    let results: Vec<One> = futures_util::stream::iter(0..requests)
        .map(one)
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    tally(results, started.elapsed())
}

/// What one request gave: time to first token, completion tokens, or an error.
type One = Result<(Option<Duration>, u64), String>;

fn tally(results: Vec<One>, wall: Duration) -> RealFigures {
    let mut figures = RealFigures {
        requests: results.len() as u64,
        wall_secs: wall.as_secs_f64(),
        ..RealFigures::default()
    };
    let mut first = Samples::default();
    for result in results {
        match result {
            Ok((first_token, tokens)) => {
                figures.completed += 1;
                figures.completion_tokens += tokens;
                if let Some(at) = first_token {
                    first.push(at);
                }
            }
            Err(error) => {
                figures.errors += 1;
                figures.first_error.get_or_insert(error);
            }
        }
    }
    figures.tokens_per_sec = figures.completion_tokens as f64 / wall.as_secs_f64().max(1e-9);
    figures.first_token_ms = first.summary();
    figures
}

/// `requests` calls straight to the server, `concurrency` at a time.
async fn direct(
    backend: &OpenAiBackend,
    call: &ChatRequest,
    concurrency: usize,
    requests: u64,
) -> RealFigures {
    tallied_calls(requests, concurrency, |_| async move {
        let sent = Instant::now();
        let mut stream = backend.chat_stream(call.clone());
        let mut first_token = None;
        let (mut usage, mut pieces) = (0, 0);
        while let Some(event) = stream.next().await {
            match event.map_err(|e| e.to_string())? {
                StreamEvent::Text(_) | StreamEvent::Reasoning(_) => {
                    first_token.get_or_insert_with(|| sent.elapsed());
                    pieces += 1;
                }
                StreamEvent::Usage(u) => usage += u.completion_tokens,
                _ => {}
            }
        }
        // Servers that send no usage: one streamed piece is one token.
        Ok((first_token, if usage > 0 { usage } else { pieces }))
    })
    .await
}

/// `requests` submits to the worker on the model server, `concurrency` at a time.
async fn through_genfleet(
    target: &Target,
    tokens: u32,
    phase: &str,
    concurrency: usize,
    requests: u64,
) -> RealFigures {
    tallied_calls(requests, concurrency, |n| async move {
        let id = target.request_id(&format!("real-{phase}"), n);
        let client = n as usize % concurrency.max(1);
        let outcome = interactive::one_request(target, client, request(id, tokens)).await;
        match outcome.error {
            Some(error) => Err(error),
            // The server's usage; words streamed where it sends none.
            None if outcome.completion_tokens > 0 => {
                Ok((outcome.first_delta, outcome.completion_tokens))
            }
            None => Ok((outcome.first_delta, outcome.tokens)),
        }
    })
    .await
}
