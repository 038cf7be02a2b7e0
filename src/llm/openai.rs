//! The OpenAI-compatible chat completions client (vLLM, llama.cpp server, Ollama, OpenAI),
//! always streaming over SSE.
//!
//! It also knows how its server continues a partial assistant message
//! ([`ChatRequest::continue_final`]): as configured (`llm.continuation`), or, with `auto`,
//! as learnt from what the server answers when it is first probed (`detect`).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::stream::{self, BoxStream, StreamExt};
use serde::{Deserialize, Serialize};
use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};
use tokio_util::io::StreamReader;

use super::{
    ChatRequest, ChatStream, Continuation, FinishReason, LlmBackend, LlmError, StreamEvent,
    ToolCallDelta, ToolSpec,
};
use crate::protocol::text::head_chars;
use crate::protocol::{Message, Role, Usage};
use crate::settings::{ContinuationSetting, DoneWithoutFinish, LlmSettings};

/// The longest SSE line accepted: a backend that never sends a newline must not grow a buffer
/// without bound.
const MAX_LINE_BYTES: usize = 8 * 1024 * 1024;
/// How much of an error body is kept for the error message.
const MAX_ERROR_BODY: usize = 4096;
/// After the finish reason only the usage chunk and `[DONE]` remain; a backend that then keeps
/// the connection open is not waited on for long.
const AFTER_FINISH_WAIT: Duration = Duration::from_secs(2);

/// An OpenAI-compatible streaming backend. Cheap to clone; clones share the connection pool and
/// what was learnt about the server (e.g. that it rejects `stream_options`).
#[derive(Clone)]
pub struct OpenAiBackend {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    url: String,
    api_key: Option<String>,
    model: String,
    idle_timeout: Duration,
    retries: u32,
    retry_backoff: Duration,
    /// Set once the server refused `stream_options`; it is not sent again.
    no_stream_options: AtomicBool,
    /// Whether `[DONE]` without a finish reason ends a complete answer (finish reason `stop`).
    done_is_stop: bool,
    /// The server's root (the base URL without its `/v1`), where the servers answer what
    /// they are.
    root: String,
    continuation: ContinuationSetting,
    /// With `llm.continuation = "auto"`: the form learnt from the server, set once by the
    /// first probe the server answers.
    detected: OnceLock<Continuation>,
}

impl OpenAiBackend {
    pub fn new(settings: &LlmSettings) -> Result<OpenAiBackend, LlmError> {
        install_crypto_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(settings.connect_timeout_ms))
            .user_agent(concat!("genfleet/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| LlmError::Transport(format!("cannot build the HTTP client: {e}")))?;
        let base = settings.base_url.trim_end_matches('/');
        Ok(OpenAiBackend {
            inner: Arc::new(Inner {
                http,
                url: format!("{base}/chat/completions"),
                api_key: Some(settings.api_key.clone()).filter(|k| !k.is_empty()),
                model: settings.model.clone(),
                idle_timeout: Duration::from_millis(settings.idle_timeout_ms.max(1)),
                retries: settings.retries,
                retry_backoff: Duration::from_millis(settings.retry_backoff_ms),
                no_stream_options: AtomicBool::new(false),
                done_is_stop: settings.done_without_finish_reason == DoneWithoutFinish::Stop,
                root: base.strip_suffix("/v1").unwrap_or(base).to_string(),
                continuation: settings.continuation,
                detected: OnceLock::new(),
            }),
        })
    }

    /// Whether the backend answers HTTP at all (`GET <base>/models`, any status): what a
    /// readiness check wants to know. Errors are the caller's to log.
    ///
    /// With `llm.continuation = "auto"`, the first probe the server answers also asks it what
    /// it is (`detect`), for [`LlmBackend::continuation`]; that never fails the probe.
    pub async fn probe(&self, timeout: Duration) -> Result<(), String> {
        self.answers(timeout).await?;
        if self.inner.continuation == ContinuationSetting::Auto
            && self.inner.detected.get().is_none()
        {
            let headers = self.inner.auth_headers();
            if let Some(found) = detect(&self.inner.http, &self.inner.root, headers, timeout).await
            {
                tracing::info!(
                    message = "the backend's server, as it says (llm.continuation = \"auto\")",
                    server = found.server,
                    version = found.version.as_deref().unwrap_or(""),
                    continuation = ?found.continuation,
                );
                let _ = self.inner.detected.set(found.continuation);
            }
        }
        Ok(())
    }

    async fn answers(&self, timeout: Duration) -> Result<(), String> {
        let url = self
            .inner
            .url
            .trim_end_matches("/chat/completions")
            .to_string()
            + "/models";
        let mut builder = self.inner.http.get(url).timeout(timeout);
        if let Some(key) = &self.inner.api_key {
            builder = builder.bearer_auth(key);
        }
        builder.send().await.map(|_| ()).map_err(|e| {
            let text = format!("the backend does not answer: {e}");
            match &self.inner.api_key {
                Some(key) => super::redact(&text, key),
                None => text,
            }
        })
    }
}

/// reqwest is built without a bundled crypto provider so that it shares ring with the NATS
/// client; the process-wide default is installed once here.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl LlmBackend for OpenAiBackend {
    fn chat_stream(&self, request: ChatRequest) -> ChatStream {
        let inner = self.inner.clone();
        let secret = self.inner.api_key.clone();
        stream::once(async move {
            match inner.connect(&request).await {
                Ok(response) if is_json(&response) => json_events(response, inner.idle_timeout),
                Ok(response) => sse_events(response, inner.idle_timeout, inner.done_is_stop),
                Err(error) => stream::once(async move { Err(error) }).boxed(),
            }
        })
        .flatten()
        .map(move |event| event.map_err(|error| error.redact(secret.as_deref())))
        .boxed()
    }

    fn continuation(&self) -> Continuation {
        self.inner.continuation()
    }
}

/// What [`detect`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Detected {
    /// The server, for the log: `llama.cpp`, `Ollama`, `SGLang`, `vLLM`, or `not recognised`.
    server: &'static str,
    version: Option<String>,
    continuation: Continuation,
}

/// Asks the server at `root` (its URL without `/v1`) what it is, each way at once, and reads
/// from it how it continues a final assistant message. A server that answers as none of them
/// (OpenAI's API, a proxy) cannot continue. `None` when no question was answered at all (the
/// server is unreachable): asked again at the next probe.
///
/// - llama.cpp's llama-server answers `GET /props` with its `default_generation_settings`
///   and `chat_template`; it takes a trailing assistant message as the start of its reply
///   (unless started with `--no-prefill-assistant`).
/// - Ollama answers `GET /api/version` with `{"version"}`; its templates leave a trailing
///   assistant message open, so the model continues it.
/// - SGLang answers `GET /get_model_info` with its `model_path`, and takes
///   `continue_final_message`.
/// - vLLM answers `GET /version` with `{"version"}`, and takes `continue_final_message`.
///
/// Asked in that order of trust: a server answering as two of them is taken as the first.
async fn detect(
    http: &reqwest::Client,
    root: &str,
    headers: reqwest::header::HeaderMap,
    timeout: Duration,
) -> Option<Detected> {
    let ask = |path: &'static str| {
        let request = http
            .get(format!("{root}{path}"))
            .headers(headers.clone())
            .timeout(timeout);
        async move {
            let response = request.send().await.ok()?;
            if !response.status().is_success() {
                return Some(None);
            }
            let body = response.bytes().await.ok()?;
            Some(serde_json::from_slice::<serde_json::Value>(&body).ok())
        }
    };
    let (props, ollama, sglang, vllm) = tokio::join!(
        ask("/props"),
        ask("/api/version"),
        ask("/get_model_info"),
        ask("/version"),
    );
    if [&props, &ollama, &sglang, &vllm]
        .iter()
        .all(|a| a.is_none())
    {
        return None;
    }
    let has = |answer: &Option<Option<serde_json::Value>>, key: &str| {
        answer
            .as_ref()
            .and_then(Option::as_ref)
            .filter(|body| body.get(key).is_some_and(|v| !v.is_null()))
            .cloned()
    };
    let version = |body: &serde_json::Value| {
        body.get("version")
            .or_else(|| body.get("build_info"))
            .and_then(serde_json::Value::as_str)
            .map(str::to_string)
    };
    let found = |server, body: Option<&serde_json::Value>, continuation| {
        Some(Detected {
            server,
            version: body.and_then(version),
            continuation,
        })
    };
    if let Some(body) = has(&props, "default_generation_settings").or(has(&props, "chat_template"))
    {
        return found("llama.cpp", Some(&body), Continuation::Prefill);
    }
    if let Some(body) = has(&ollama, "version") {
        return found("Ollama", Some(&body), Continuation::Prefill);
    }
    if let Some(body) = has(&sglang, "model_path") {
        return found("SGLang", Some(&body), Continuation::ContinueFinalMessage);
    }
    if let Some(body) = has(&vllm, "version") {
        return found("vLLM", Some(&body), Continuation::ContinueFinalMessage);
    }
    found("not recognised", None, Continuation::None)
}

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    messages: &'a [Message],
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "<[WireTool]>::is_empty")]
    tools: &'a [WireTool<'a>],
    /// vLLM's and SGLang's way to continue the final assistant message; never sent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    continue_final_message: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    add_generation_prompt: Option<bool>,
    #[serde(flatten)]
    options: &'a serde_json::Map<String, serde_json::Value>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct WireTool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: &'a ToolSpec,
}

impl Inner {
    fn continuation(&self) -> Continuation {
        match self.continuation {
            ContinuationSetting::Auto => self.detected.get().copied().unwrap_or(Continuation::None),
            ContinuationSetting::ContinueFinalMessage => Continuation::ContinueFinalMessage,
            ContinuationSetting::Prefill => Continuation::Prefill,
            ContinuationSetting::None => Continuation::None,
        }
    }

    fn auth_headers(&self) -> reqwest::header::HeaderMap {
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(value) = self
            .api_key
            .as_ref()
            .and_then(|key| reqwest::header::HeaderValue::from_str(&format!("Bearer {key}")).ok())
        {
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        headers
    }

    /// Sends the request, retrying a 429, a 5xx or an unreachable server before anything was
    /// streamed; after the first token a failure is final (the engine reports it).
    async fn connect(&self, request: &ChatRequest) -> Result<reqwest::Response, LlmError> {
        let tools: Vec<WireTool<'_>> = request
            .tools
            .iter()
            .map(|function| WireTool {
                kind: "function",
                function,
            })
            .collect();
        // A continuation is sent in the server's form; asked of a backend that has none, the
        // messages go as they are, which is the prefill form.
        let continue_final_message =
            request.continue_final && self.continuation() == Continuation::ContinueFinalMessage;
        let options = if continue_final_message {
            // The flags are the backend's to set: a caller's own copy would be a second key.
            let mut options = request.options.clone();
            options.remove("continue_final_message");
            options.remove("add_generation_prompt");
            Cow::Owned(options)
        } else {
            Cow::Borrowed(&request.options)
        };
        let mut attempt = 0;
        loop {
            let with_stream_options = !self.no_stream_options.load(Ordering::Relaxed);
            let body = WireRequest {
                model: request.model.as_deref().unwrap_or(&self.model),
                messages: &request.messages,
                stream: true,
                stream_options: with_stream_options.then_some(StreamOptions {
                    include_usage: true,
                }),
                max_tokens: request.max_tokens,
                temperature: request.temperature,
                tools: &tools,
                continue_final_message: continue_final_message.then_some(true),
                add_generation_prompt: continue_final_message.then_some(false),
                options: &options,
            };
            let mut builder = self.http.post(&self.url).json(&body);
            if let Some(key) = &self.api_key {
                builder = builder.bearer_auth(key);
            }
            if let Some(traceparent) = &request.traceparent {
                builder = builder.header("traceparent", traceparent);
            }
            let (retryable, error, retry_after) = match builder.send().await {
                Ok(response) if response.status().is_success() => return Ok(response),
                Ok(response) => {
                    let status = response.status().as_u16();
                    let retry_after = retry_after(&response);
                    let body = read_error_body(response, self.api_key.as_deref()).await;
                    if status == 400 && with_stream_options && body.contains("stream_options") {
                        tracing::warn!(
                            message = "backend rejects stream_options; not sending it again"
                        );
                        self.no_stream_options.store(true, Ordering::Relaxed);
                        continue;
                    }
                    let message = error_message(&body);
                    if matches!(status, 400 | 422 | 500)
                        && request.messages.iter().any(|m| m.role == Role::System)
                        && refuses_system_role(&body)
                    {
                        return Err(LlmError::SystemRejected(message));
                    }
                    if (status == 400 || status == 422)
                        && !request.tools.is_empty()
                        && body.to_ascii_lowercase().contains("tool")
                    {
                        return Err(LlmError::ToolsRejected(message));
                    }
                    let retryable = status == 429 || status >= 500;
                    (
                        retryable,
                        LlmError::Http {
                            status,
                            body: message,
                        },
                        retry_after,
                    )
                }
                Err(error) => (true, LlmError::Transport(transport_error(&error)), None),
            };
            if !retryable || attempt >= self.retries {
                return Err(error);
            }
            let backoff = retry_after.unwrap_or(self.retry_backoff * 2u32.pow(attempt.min(10)));
            tracing::warn!(message = "backend call failed; retrying", %error, attempt = attempt + 1, backoff_ms = backoff.as_millis() as u64);
            tokio::time::sleep(backoff).await;
            attempt += 1;
        }
    }
}

/// Whether a successful answer is one JSON completion rather than an event stream.
fn is_json(response: &reqwest::Response) -> bool {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.to_ascii_lowercase().starts_with("application/json"))
}

fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    let seconds: u64 = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (seconds <= 30).then(|| Duration::from_secs(seconds))
}

/// The error with its causes (the URL carries no credential: the key travels in a header).
fn transport_error(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// The start of an error body, without the API key should the backend echo it.
async fn read_error_body(mut response: reqwest::Response, secret: Option<&str>) -> String {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        body.extend_from_slice(&chunk);
        if body.len() >= MAX_ERROR_BODY {
            body.truncate(MAX_ERROR_BODY);
            break;
        }
    }
    let text = String::from_utf8_lossy(&body).trim().to_string();
    match secret {
        Some(secret) => super::redact(&text, secret),
        None => text,
    }
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
    /// `"error"` on the bare error objects some servers stream (older vLLM).
    #[serde(default)]
    object: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    /// A whole answer: a server that ignored `stream: true` and answered with JSON.
    #[serde(default)]
    message: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    /// Some servers (Ollama, newer vLLM) name it `reasoning`.
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCallDelta>>,
    /// The deprecated single `function_call` form (OpenAI before tools, some older servers).
    #[serde(default)]
    function_call: Option<WireFunctionDelta>,
}

#[derive(Deserialize)]
struct WireToolCallDelta {
    #[serde(default)]
    index: Option<usize>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<WireFunctionDelta>,
}

#[derive(Deserialize)]
struct WireFunctionDelta {
    #[serde(default)]
    name: Option<String>,
    /// Usually a string fragment; some servers send the whole arguments as an object.
    #[serde(default)]
    arguments: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

/// One server-sent event as it is being read: its type and its data lines.
#[derive(Default)]
struct Frame {
    event: String,
    data: String,
}

struct SseState {
    lines: BoxStream<'static, Result<String, LinesCodecError>>,
    frame: Frame,
    pending: VecDeque<Result<StreamEvent, LlmError>>,
    idle_timeout: Duration,
    finished: bool,
    done: bool,
    /// `[DONE]` before a finish reason ends a complete answer instead of a broken stream.
    done_is_stop: bool,
    calls: CallIndexes,
    /// Whether any content, reasoning or tool call arrived.
    any_output: bool,
}

/// Gives each native tool call its own index, whatever the server sends: some leave `index`
/// out (each delta is then a call of its own when it brings a new id, else more of the last
/// one), some give every call index 0 with a new id.
#[derive(Default)]
struct CallIndexes {
    /// Per call so far: the server's index, its id, its name.
    seen: Vec<(Option<usize>, Option<String>, String)>,
}

impl CallIndexes {
    /// The index to use for this delta, and the part of its name not yet seen (servers that
    /// repeat the whole name in every delta must not double it).
    fn place(
        &mut self,
        index: Option<usize>,
        id: Option<&str>,
        name: Option<&str>,
    ) -> (usize, Option<String>) {
        let known = match index {
            Some(index) => self.seen.iter().rposition(|(i, _, _)| *i == Some(index)),
            None => self.seen.len().checked_sub(1),
        };
        let same_call = known.filter(|&at| match (id, &self.seen[at].1) {
            (Some(new), Some(old)) => new == old,
            _ => true,
        });
        let at = match same_call {
            Some(at) if !(index.is_none() && id.is_some() && self.seen[at].1.is_none()) => at,
            _ => {
                self.seen
                    .push((index, id.map(str::to_string), String::new()));
                self.seen.len() - 1
            }
        };
        let entry = &mut self.seen[at];
        if entry.1.is_none() {
            entry.1 = id.map(str::to_string);
        }
        let name = name.filter(|n| !n.is_empty()).and_then(|n| {
            if entry.2 == n {
                None
            } else {
                entry.2.push_str(n);
                Some(n.to_string())
            }
        });
        (at, name)
    }

    fn any(&self) -> bool {
        !self.seen.is_empty()
    }
}

fn sse_events(
    response: reqwest::Response,
    idle_timeout: Duration,
    done_is_stop: bool,
) -> ChatStream {
    let bytes = response
        .bytes_stream()
        .map(|chunk| chunk.map_err(|e| std::io::Error::other(transport_error(&e))));
    let lines = FramedRead::new(
        StreamReader::new(bytes),
        LinesCodec::new_with_max_length(MAX_LINE_BYTES),
    )
    .boxed();
    let state = SseState {
        lines,
        frame: Frame::default(),
        pending: VecDeque::new(),
        idle_timeout,
        finished: false,
        done: false,
        done_is_stop,
        calls: CallIndexes::default(),
        any_output: false,
    };
    stream::unfold(state, |mut state| async move {
        loop {
            if let Some(item) = state.pending.pop_front() {
                return Some((item, state));
            }
            if state.done {
                return None;
            }
            let wait = if state.finished {
                AFTER_FINISH_WAIT
            } else {
                state.idle_timeout
            };
            match tokio::time::timeout(wait, state.lines.next()).await {
                Ok(Some(Ok(line))) => state.on_line(&line),
                Ok(Some(Err(LinesCodecError::MaxLineLengthExceeded))) => state.end(
                    LlmError::StreamBroken(format!("an SSE line exceeded {MAX_LINE_BYTES} bytes")),
                ),
                Ok(Some(Err(LinesCodecError::Io(error)))) => {
                    state.end(LlmError::StreamBroken(error.to_string()))
                }
                Ok(None) => {
                    // A last event without its blank line still counts.
                    state.dispatch();
                    state.end(LlmError::StreamBroken(
                        "the stream closed before a finish reason".into(),
                    ))
                }
                Err(_) => state.end(LlmError::Idle(wait.as_millis() as u64)),
            }
        }
    })
    .boxed()
}

/// The human part of an error object or body: `error.message`, `message`, `detail`, or the
/// text itself.
fn error_text(value: &serde_json::Value) -> Option<String> {
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        _ => None,
    };
    let error = value.get("error").unwrap_or(value);
    text(error)
        .or_else(|| error.get("message").and_then(text))
        .or_else(|| value.get("message").and_then(text))
        .or_else(|| value.get("detail").and_then(text))
        .or_else(|| {
            value
                .get("detail")
                .filter(|d| !d.is_null())
                .map(|d| d.to_string())
        })
}

/// An error body reduced to its message, for people (the raw body when it is not JSON).
fn error_message(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|value| error_text(&value))
        .unwrap_or_else(|| body.to_string())
}

/// Whether an error body says the chat template refuses the system messages it was sent: a
/// second system message, one that is not first, or any at all (Gemma's, Mistral's and
/// Llama 2's templates raise these).
fn refuses_system_role(body: &str) -> bool {
    let body = body.to_ascii_lowercase();
    [
        "roles must alternate",
        "system role not supported",
        "system role is not supported",
        "system messages are not supported",
        "does not support system",
        "system message must be at the beginning",
        "system message must be first",
        "only one system message",
        "system message is only supported at the beginning",
    ]
    .iter()
    .any(|pattern| body.contains(pattern))
}

impl SseState {
    /// Ends the stream; an error only counts when the finish reason has not been seen.
    fn end(&mut self, error: LlmError) {
        self.done = true;
        if !self.finished {
            self.pending.push_back(Err(error));
        }
    }

    /// One line of the event stream (the line codec took its end off).
    fn on_line(&mut self, line: &str) {
        if line.is_empty() {
            self.dispatch();
            return;
        }
        if line.starts_with(':') {
            // A comment: keep-alives and proxies' padding.
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match field {
            "data" => {
                if self.frame.data.len() + value.len() >= MAX_LINE_BYTES {
                    self.end(LlmError::StreamBroken(format!(
                        "an SSE event exceeded {MAX_LINE_BYTES} bytes"
                    )));
                    return;
                }
                if !self.frame.data.is_empty() {
                    self.frame.data.push('\n');
                }
                self.frame.data.push_str(value);
            }
            "event" => self.frame.event = value.to_string(),
            // llama.cpp's server writes an error inside a stream as an `error:` line.
            "error" => {
                self.dispatch();
                self.on_error(value);
            }
            _ => {}
        }
    }

    fn dispatch(&mut self) {
        let frame = std::mem::take(&mut self.frame);
        if self.done {
            return;
        }
        if frame.event == "error" {
            self.on_error(&frame.data);
        } else {
            self.on_event(&frame.data);
        }
    }

    /// An error the server reports inside the stream: the request failed on its side.
    fn on_error(&mut self, data: &str) {
        let message = serde_json::from_str::<serde_json::Value>(data)
            .ok()
            .and_then(|value| error_text(&value))
            .unwrap_or_else(|| data.trim().to_string());
        self.fail_with(message);
    }

    fn fail_with(&mut self, message: String) {
        // Whatever came before, an error ends the answer as a failure.
        self.finished = false;
        self.pending
            .retain(|event| !matches!(event, Ok(StreamEvent::Finish(_))));
        self.end(LlmError::Backend(message));
    }

    fn on_event(&mut self, data: &str) {
        let data = data.trim();
        if data.is_empty() {
            return;
        }
        if data == "[DONE]" {
            if self.done_is_stop && !self.finished && self.any_output {
                // The stream's own clean end: the official SDKs end there without an error.
                let reason = if self.calls.any() {
                    FinishReason::ToolCalls
                } else {
                    FinishReason::Stop
                };
                tracing::debug!(
                    message = "[DONE] without a finish reason; taken as the end of the answer",
                    ?reason
                );
                self.finished = true;
                self.pending.push_back(Ok(StreamEvent::Finish(reason)));
            }
            self.end(LlmError::StreamBroken(if self.any_output {
                "[DONE] arrived before a finish reason (llm.done_without_finish_reason = \"fail\")"
                    .into()
            } else {
                "the stream ended with [DONE] before any answer or finish reason".into()
            }));
            return;
        }
        let chunk: Chunk = match serde_json::from_str(data) {
            Ok(chunk) => chunk,
            Err(e) => {
                let shown = head_chars(data, 200);
                self.end(LlmError::Protocol(format!("{e}: {shown}")));
                return;
            }
        };
        if let Some(error) = chunk.error.as_ref().filter(|e| !e.is_null()) {
            let message = error_text(error).unwrap_or_else(|| error.to_string());
            self.fail_with(message);
            return;
        }
        if chunk.object.as_deref() == Some("error") {
            let message = chunk.message.clone().unwrap_or_else(|| data.to_string());
            self.fail_with(message);
            return;
        }
        self.on_chunk(chunk);
    }

    fn on_chunk(&mut self, chunk: Chunk) {
        for choice in chunk.choices {
            if let Some(delta) = choice.delta.or(choice.message) {
                self.on_delta(delta);
            }
            if let Some(reason) = choice.finish_reason.filter(|r| !r.is_empty())
                && !self.finished
            {
                self.finished = true;
                let mut reason = FinishReason::parse(&reason);
                if reason == FinishReason::Stop && self.calls.any() {
                    // Servers that say `stop` after a native call (older Ollama).
                    reason = FinishReason::ToolCalls;
                }
                self.pending.push_back(Ok(StreamEvent::Finish(reason)));
            }
        }
        if let Some(usage) = chunk.usage {
            self.pending.push_back(Ok(StreamEvent::Usage(Usage {
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
            })));
        }
    }

    fn on_delta(&mut self, delta: Delta) {
        if let Some(text) = delta.reasoning_content.or(delta.reasoning)
            && !text.is_empty()
        {
            self.any_output = true;
            self.pending.push_back(Ok(StreamEvent::Reasoning(text)));
        }
        if let Some(text) = delta.content
            && !text.is_empty()
        {
            self.any_output = true;
            self.pending.push_back(Ok(StreamEvent::Text(text)));
        }
        let legacy = delta.function_call.map(|function| WireToolCallDelta {
            index: Some(0),
            id: None,
            function: Some(function),
        });
        for call in delta.tool_calls.into_iter().flatten().chain(legacy) {
            let function = call.function;
            let arguments = match function.as_ref().and_then(|f| f.arguments.as_ref()) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            self.any_output = true;
            let (index, name) = self.calls.place(
                call.index,
                call.id.as_deref(),
                function.as_ref().and_then(|f| f.name.as_deref()),
            );
            self.pending
                .push_back(Ok(StreamEvent::ToolCall(ToolCallDelta {
                    index,
                    id: call.id,
                    name,
                    arguments,
                })));
        }
    }
}

/// A server that answered `stream: true` with one JSON completion: read it whole (bounded) and
/// yield it as the events a stream would have.
fn json_events(response: reqwest::Response, idle_timeout: Duration) -> ChatStream {
    stream::once(async move {
        let mut response = response;
        let mut body = Vec::new();
        loop {
            match tokio::time::timeout(idle_timeout, response.chunk()).await {
                Err(_) => return vec![Err(LlmError::Idle(idle_timeout.as_millis() as u64))],
                Ok(Err(e)) => return vec![Err(LlmError::StreamBroken(transport_error(&e)))],
                Ok(Ok(None)) => break,
                Ok(Ok(Some(chunk))) => {
                    body.extend_from_slice(&chunk);
                    if body.len() > MAX_LINE_BYTES {
                        return vec![Err(LlmError::Protocol(format!(
                            "a JSON answer exceeded {MAX_LINE_BYTES} bytes"
                        )))];
                    }
                }
            }
        }
        let text = String::from_utf8_lossy(&body);
        let mut state = SseState {
            lines: stream::empty().boxed(),
            frame: Frame::default(),
            pending: VecDeque::new(),
            idle_timeout,
            finished: false,
            done: false,
            done_is_stop: false,
            calls: CallIndexes::default(),
            any_output: false,
        };
        state.on_event(&text);
        if !state.finished && !state.done {
            state.end(LlmError::Protocol(
                "the backend's JSON answer has no finish reason".into(),
            ));
        }
        state.pending.into_iter().collect()
    })
    .flat_map(stream::iter)
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::mock::{MockServer, Script};
    use crate::settings::Settings;

    fn backend_at(base_url: &str, continuation: ContinuationSetting) -> OpenAiBackend {
        let mut settings = Settings::defaults().llm;
        settings.base_url = base_url.to_string();
        settings.continuation = continuation;
        settings.retries = 0;
        OpenAiBackend::new(&settings).unwrap()
    }

    fn continuing(continue_final: bool) -> ChatRequest {
        let mut options = serde_json::Map::new();
        options.insert("add_generation_prompt".into(), true.into());
        ChatRequest {
            messages: vec![Message::user("go on"), Message::assistant("Once upon")],
            continue_final,
            options,
            ..ChatRequest::default()
        }
    }

    /// The body the mock received for `request`, after the stream ended.
    async fn sent(
        mock: &MockServer,
        backend: &OpenAiBackend,
        request: ChatRequest,
    ) -> serde_json::Value {
        mock.clear_requests();
        let mut stream = backend.chat_stream(request);
        while let Some(event) = stream.next().await {
            event.unwrap();
        }
        mock.requests().pop().expect("one request")
    }

    #[tokio::test]
    async fn each_continuation_form_sends_its_body_and_none_adds_nothing_when_not_continuing() {
        let mock = MockServer::start(Script::echo()).await.unwrap();
        let roles = |body: &serde_json::Value| {
            body["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["role"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        };
        // (setting, continue_final, continue_final_message, add_generation_prompt)
        let table = [
            (
                ContinuationSetting::ContinueFinalMessage,
                true,
                Some(true),
                Some(false),
            ),
            // The flags are the backend's: the caller's own add_generation_prompt gives way.
            (ContinuationSetting::Prefill, true, None, Some(true)),
            // Asked anyway of a backend that cannot: sent as prefill.
            (ContinuationSetting::None, true, None, Some(true)),
        ];
        for (setting, continue_final, flag, generation_prompt) in table {
            let backend = backend_at(&mock.base_url(), setting);
            let body = sent(&mock, &backend, continuing(continue_final)).await;
            let said = format!("{setting:?}: {body}");
            assert_eq!(body["continue_final_message"].as_bool(), flag, "{said}");
            assert_eq!(
                body["add_generation_prompt"].as_bool(),
                generation_prompt,
                "{said}"
            );
            assert_eq!(roles(&body), ["user", "assistant"], "{said}");
            assert_eq!(body["messages"][1]["content"], "Once upon", "{said}");
        }
        // Not continuing: no new field on the wire, whatever the form.
        for setting in [
            ContinuationSetting::Auto,
            ContinuationSetting::ContinueFinalMessage,
            ContinuationSetting::Prefill,
            ContinuationSetting::None,
        ] {
            let backend = backend_at(&mock.base_url(), setting);
            let request = ChatRequest {
                messages: vec![Message::user("hello")],
                ..ChatRequest::default()
            };
            let body = sent(&mock, &backend, request).await;
            let keys: Vec<&str> = body
                .as_object()
                .unwrap()
                .keys()
                .map(String::as_str)
                .collect();
            assert_eq!(
                keys,
                ["messages", "model", "stream", "stream_options"],
                "{setting:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_configured_form_is_used_without_asking_the_server() {
        for (setting, form) in [
            (
                ContinuationSetting::ContinueFinalMessage,
                Continuation::ContinueFinalMessage,
            ),
            (ContinuationSetting::Prefill, Continuation::Prefill),
            (ContinuationSetting::None, Continuation::None),
            // Auto says None until a probe has learnt the form.
            (ContinuationSetting::Auto, Continuation::None),
        ] {
            assert_eq!(
                backend_at("http://127.0.0.1:9/v1", setting).continuation(),
                form
            );
        }
    }

    /// A server answering `GET path` with `body` (and 404 to anything else), its base URL.
    async fn answering(routes: &[(&'static str, serde_json::Value)]) -> String {
        let mut router =
            axum::Router::new().route("/v1/models", axum::routing::get(|| async { "{}" }));
        for (path, body) in routes {
            let body = body.clone();
            router = router.route(
                path,
                axum::routing::get(move || async move { axum::Json(body) }),
            );
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        format!("http://{addr}/v1")
    }

    #[tokio::test]
    async fn auto_learns_the_form_from_what_the_server_says_it_is() {
        let llama = serde_json::json!({"default_generation_settings": {"n_ctx": 4096}, "chat_template": "x", "build_info": "b5000"});
        let ollama = serde_json::json!({"version": "0.9.0"});
        let sglang = serde_json::json!({"model_path": "/models/m", "is_generation": true});
        let vllm = serde_json::json!({"version": "0.8.5"});
        let table = [
            (vec![("/props", llama.clone())], Continuation::Prefill),
            (vec![("/api/version", ollama)], Continuation::Prefill),
            (
                vec![("/get_model_info", sglang), ("/version", vllm.clone())],
                Continuation::ContinueFinalMessage,
            ),
            (vec![("/version", vllm)], Continuation::ContinueFinalMessage),
            // A /props without what llama.cpp's holds is not llama.cpp's.
            (
                vec![("/props", serde_json::json!({"other": 1}))],
                Continuation::None,
            ),
            // OpenAI's API, a proxy: nothing answers.
            (vec![], Continuation::None),
        ];
        for (routes, form) in table {
            let base = answering(&routes).await;
            let backend = backend_at(&base, ContinuationSetting::Auto);
            backend.probe(Duration::from_secs(5)).await.unwrap();
            assert_eq!(backend.continuation(), form, "{routes:?}");
        }
        // The mock answers as vLLM does.
        let mock = MockServer::start(Script::echo()).await.unwrap();
        let backend = backend_at(&mock.base_url(), ContinuationSetting::Auto);
        backend.probe(Duration::from_secs(5)).await.unwrap();
        assert_eq!(backend.continuation(), Continuation::ContinueFinalMessage);
        // Configured, the server is not asked.
        let base = answering(&[("/props", llama)]).await;
        let backend = backend_at(&base, ContinuationSetting::None);
        backend.probe(Duration::from_secs(5)).await.unwrap();
        assert_eq!(backend.continuation(), Continuation::None);
    }

    #[tokio::test]
    async fn a_server_that_does_not_answer_is_asked_again_at_the_next_probe() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let backend = backend_at(&format!("http://{addr}/v1"), ContinuationSetting::Auto);
        assert!(backend.probe(Duration::from_secs(2)).await.is_err());
        assert_eq!(backend.continuation(), Continuation::None);
        let mock = MockServer::start_at(addr, Script::echo()).await.unwrap();
        backend.probe(Duration::from_secs(5)).await.unwrap();
        assert_eq!(backend.continuation(), Continuation::ContinueFinalMessage);
        drop(mock);
    }
}
