//! The OpenAI-compatible chat completions client (vLLM, llama.cpp server, Ollama, OpenAI),
//! always streaming over SSE.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::stream::{self, BoxStream, StreamExt};
use serde::{Deserialize, Serialize};

use super::{
    ChatRequest, ChatStream, FinishReason, LlmBackend, LlmError, StreamEvent, ToolCallDelta,
    ToolSpec,
};
use crate::protocol::{Message, Usage};
use crate::settings::{DoneWithoutFinish, LlmSettings};

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
            }),
        })
    }

    /// Whether the backend answers HTTP at all (`GET <base>/models`, any status): what a
    /// readiness check wants to know. Errors are the caller's to log.
    pub async fn probe(&self, timeout: Duration) -> Result<(), String> {
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
                Ok(response) => sse_events(response, inner.idle_timeout, inner.done_is_stop),
                Err(error) => stream::once(async move { Err(error) }).boxed(),
            }
        })
        .flatten()
        .map(move |event| event.map_err(|error| error.redact(secret.as_deref())))
        .boxed()
    }
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
                options: &request.options,
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
                    if (status == 400 || status == 422)
                        && !request.tools.is_empty()
                        && body.to_ascii_lowercase().contains("tool")
                    {
                        return Err(LlmError::ToolsRejected(body));
                    }
                    let retryable = status == 429 || status >= 500;
                    (retryable, LlmError::Http { status, body }, retry_after)
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
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    /// Some servers (e.g. Ollama) name it `reasoning`.
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCallDelta>>,
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

struct SseState {
    events: BoxStream<'static, Result<eventsource_stream::Event, String>>,
    pending: VecDeque<Result<StreamEvent, LlmError>>,
    idle_timeout: Duration,
    finished: bool,
    done: bool,
    /// `[DONE]` before a finish reason ends a complete answer instead of a broken stream.
    done_is_stop: bool,
}

fn sse_events(
    response: reqwest::Response,
    idle_timeout: Duration,
    done_is_stop: bool,
) -> ChatStream {
    use eventsource_stream::Eventsource;
    let mut line_bytes = 0usize;
    let bytes = response.bytes_stream().map(move |chunk| {
        let chunk = chunk.map_err(|e| transport_error(&e))?;
        line_bytes = match chunk.iter().rposition(|b| *b == b'\n') {
            Some(pos) => chunk.len() - pos - 1,
            None => line_bytes + chunk.len(),
        };
        if line_bytes > MAX_LINE_BYTES {
            return Err(format!("an SSE line exceeded {MAX_LINE_BYTES} bytes"));
        }
        Ok(chunk)
    });
    let events = bytes
        .eventsource()
        .map(|event| event.map_err(|e| e.to_string()))
        .boxed();
    let state = SseState {
        events,
        pending: VecDeque::new(),
        idle_timeout,
        finished: false,
        done: false,
        done_is_stop,
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
            let next = tokio::time::timeout(wait, state.events.next()).await;
            match next {
                Ok(Some(Ok(event))) => state.on_event(&event.data),
                Ok(Some(Err(error))) => state.end(LlmError::StreamBroken(error)),
                Ok(None) => state.end(LlmError::StreamBroken(
                    "the stream closed before a finish reason".into(),
                )),
                Err(_) => state.end(LlmError::Idle(wait.as_millis() as u64)),
            }
        }
    })
    .boxed()
}

impl SseState {
    /// Ends the stream; an error only counts when the finish reason has not been seen.
    fn end(&mut self, error: LlmError) {
        self.done = true;
        if !self.finished {
            self.pending.push_back(Err(error));
        }
    }

    fn on_event(&mut self, data: &str) {
        let data = data.trim();
        if data.is_empty() {
            return;
        }
        if data == "[DONE]" {
            if self.done_is_stop && !self.finished {
                self.finished = true;
                self.pending
                    .push_back(Ok(StreamEvent::Finish(FinishReason::Stop)));
            }
            self.end(LlmError::StreamBroken(
                "[DONE] arrived before a finish reason (llm.done_without_finish_reason = \"stop\" \
                 takes it as the end of a complete answer)"
                    .into(),
            ));
            return;
        }
        let chunk: Chunk = match serde_json::from_str(data) {
            Ok(chunk) => chunk,
            Err(e) => {
                let shown: String = data.chars().take(200).collect();
                self.end(LlmError::Protocol(format!("{e}: {shown}")));
                return;
            }
        };
        if let Some(error) = chunk.error {
            let message = error
                .get("message")
                .and_then(|m| m.as_str())
                .map(str::to_string)
                .unwrap_or_else(|| error.to_string());
            self.end(LlmError::StreamBroken(format!(
                "the backend reported: {message}"
            )));
            return;
        }
        for choice in chunk.choices {
            if let Some(delta) = choice.delta {
                self.on_delta(delta);
            }
            if let Some(reason) = choice.finish_reason
                && !self.finished
            {
                self.finished = true;
                self.pending
                    .push_back(Ok(StreamEvent::Finish(FinishReason::parse(&reason))));
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
            self.pending.push_back(Ok(StreamEvent::Reasoning(text)));
        }
        if let Some(text) = delta.content
            && !text.is_empty()
        {
            self.pending.push_back(Ok(StreamEvent::Text(text)));
        }
        for (position, call) in delta.tool_calls.into_iter().flatten().enumerate() {
            let function = call.function;
            let arguments = match function.as_ref().and_then(|f| f.arguments.as_ref()) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            self.pending
                .push_back(Ok(StreamEvent::ToolCall(ToolCallDelta {
                    index: call.index.unwrap_or(position),
                    id: call.id,
                    name: function.and_then(|f| f.name),
                    arguments,
                })));
        }
    }
}
