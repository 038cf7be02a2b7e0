//! HTTP side of the mock server: routes, request checks, the reply plan and SSE writing.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream;
use serde::Serialize;
use serde_json::{Value, json};

use super::conversation::Conversation;
use super::prefix_cache::{PrefixCache, PrefixCacheStats};
use super::script::{RejectSystem, Rule, Script};

/// What the mock's `GET /version` says it is.
pub(super) const VERSION: &str = "genfleet-mock";

/// How many request bodies the log keeps (oldest dropped first).
pub(super) const LOG_CAPACITY: usize = 256;

/// Request bodies larger than this are refused (axum's 2 MiB default is too small for
/// long-context benchmarks).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// State shared by all connections. Streaming never holds a lock: the script is immutable,
/// counters are atomics, and the log mutex is held only to push or copy out bodies.
pub(super) struct Shared {
    script: Script,
    /// Per rule: how many requests it has matched, for `fail_times`.
    matched: Vec<AtomicU32>,
    next_id: AtomicU64,
    /// Raw bodies, parsed only when read back, to keep the hot path cheap.
    log: Mutex<VecDeque<Bytes>>,
    /// Streamed replies whose client closed the connection before the last frame.
    abandoned: AtomicU64,
    /// Streamed replies open now, and the most open at once (see [`Shared::most_open_streams`]).
    open: AtomicU64,
    most_open: AtomicU64,
    prefix_cache: Option<PrefixCache>,
    /// What was streamed or sent of completion text, for `GET /mock/stats`.
    generated: Generated,
}

/// Completion text handed to clients since the start or the last reset: what a test of
/// resumed generations measures (text generated again is text paid for twice).
#[derive(Default)]
struct Generated {
    /// Characters of content (not reasoning, not tool calls) sent.
    content_chars: AtomicU64,
    /// Content chunks sent (one chunk is one token).
    content_chunks: AtomicU64,
    /// Requests that continued a final assistant message.
    continuations: AtomicU64,
}

/// What [`Generated`] holds, as `GET /mock/stats` reports it under `generated`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct GeneratedStats {
    pub content_chars: u64,
    pub content_chunks: u64,
    pub continuations: u64,
}

impl Generated {
    fn sent(&self, chars: usize, chunks: usize) {
        self.content_chars
            .fetch_add(chars as u64, Ordering::Relaxed);
        self.content_chunks
            .fetch_add(chunks as u64, Ordering::Relaxed);
    }

    fn stats(&self) -> GeneratedStats {
        GeneratedStats {
            content_chars: self.content_chars.load(Ordering::Relaxed),
            content_chunks: self.content_chunks.load(Ordering::Relaxed),
            continuations: self.continuations.load(Ordering::Relaxed),
        }
    }

    fn reset(&self) {
        self.content_chars.store(0, Ordering::Relaxed);
        self.content_chunks.store(0, Ordering::Relaxed);
        self.continuations.store(0, Ordering::Relaxed);
    }
}

impl Shared {
    pub(super) fn new(script: Script) -> Arc<Shared> {
        let matched = script.rules.iter().map(|_| AtomicU32::new(0)).collect();
        Arc::new(Shared {
            prefix_cache: script.prefix_cache.map(PrefixCache::new),
            script,
            matched,
            next_id: AtomicU64::new(1),
            log: Mutex::new(VecDeque::with_capacity(LOG_CAPACITY)),
            abandoned: AtomicU64::new(0),
            open: AtomicU64::new(0),
            most_open: AtomicU64::new(0),
            generated: Generated::default(),
        })
    }

    /// Recorded bodies, oldest first; a body that is not JSON is returned as a JSON string.
    pub(super) fn requests(&self) -> Vec<Value> {
        let bodies: Vec<Bytes> = self.lock_log().iter().cloned().collect();
        bodies
            .iter()
            .map(|b| {
                serde_json::from_slice(b)
                    .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(b).into_owned()))
            })
            .collect()
    }

    /// Streamed replies the client hung up on before their last frame.
    pub(super) fn abandoned_streams(&self) -> u64 {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Streamed replies open now.
    pub(super) fn open_streams(&self) -> u64 {
        self.open.load(Ordering::SeqCst)
    }

    /// The most streamed replies open at once since the start or the last reset. A reply is
    /// open from its request until its last frame is handed to the connection (or its client
    /// hangs up), so a client that reads a reply's end and then asks again never finds both
    /// counted: what a fleet runs at once is never counted low.
    pub(super) fn most_open_streams(&self) -> u64 {
        self.most_open.load(Ordering::SeqCst)
    }

    /// Starts counting the most open at once again, from the replies open now.
    pub(super) fn reset_most_open_streams(&self) {
        self.most_open.store(self.open_streams(), Ordering::SeqCst);
    }

    fn stream_opened(&self) {
        let open = self.open.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_open.fetch_max(open, Ordering::SeqCst);
    }

    pub(super) fn clear_requests(&self) {
        self.lock_log().clear();
    }

    pub(super) fn generated_stats(&self) -> GeneratedStats {
        self.generated.stats()
    }

    pub(super) fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.prefix_cache.as_ref().map(PrefixCache::stats)
    }

    fn record(&self, body: &Bytes) {
        let mut log = self.lock_log();
        if log.len() == LOG_CAPACITY {
            log.pop_front();
        }
        log.push_back(body.clone());
    }

    fn lock_log(&self) -> std::sync::MutexGuard<'_, VecDeque<Bytes>> {
        // A panic while holding the lock cannot leave the deque inconsistent.
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The 401 to send when the script wants an API key and the request lacks it.
    fn auth_rejection(&self, headers: &HeaderMap) -> Option<Response> {
        let key = self.script.api_key.as_ref()?;
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given.map(str::trim) == Some(key.as_str()) {
            return None;
        }
        let message = if given.is_some() {
            "Incorrect API key provided."
        } else {
            "You didn't provide an API key. Provide it as 'Authorization: Bearer <key>'."
        };
        Some(openai_error(
            StatusCode::UNAUTHORIZED,
            message,
            None,
            Some("invalid_api_key"),
        ))
    }
}

/// Serves the mock API on `listener` until `shutdown` resolves, then waits for open
/// connections to finish.
pub(super) async fn run(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, rules = shared.script.rules.len(), "mock LLM server listening");
    }
    // A stream is many small writes: with Nagle's algorithm each response stalls until the
    // client's delayed ACK (40 ms on Linux), which would make every streamed reply that slow.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY on a mock connection");
        }
    });
    axum::serve(listener, router(shared))
        .with_graceful_shutdown(shutdown)
        .await
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        // Answered as vLLM does, so that a worker's `llm.continuation = "auto"` finds a
        // server that takes `continue_final_message` (the mock also continues a prefill).
        .route(
            "/version",
            get(|| async { Json(json!({ "version": VERSION })) }),
        )
        .route("/mock/requests", get(get_requests).delete(delete_requests))
        .route("/mock/stats", get(get_stats).delete(delete_stats))
        .route("/health", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

async fn models(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Some(resp) = shared.auth_rejection(&headers) {
        return resp;
    }
    Json(json!({
        "object": "list",
        "data": [{
            "id": shared.script.model_name(),
            "object": "model",
            "created": 0,
            "owned_by": "genfleet-mock",
        }],
    }))
    .into_response()
}

async fn get_requests(State(shared): State<Arc<Shared>>) -> Json<Vec<Value>> {
    Json(shared.requests())
}

async fn delete_requests(State(shared): State<Arc<Shared>>) -> StatusCode {
    shared.clear_requests();
    StatusCode::NO_CONTENT
}

/// `{"prefix_cache": {...}, "generated": {...}}`, the cache `null` without one.
async fn get_stats(State(shared): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({
        "prefix_cache": shared.prefix_cache_stats(),
        "generated": shared.generated_stats(),
    }))
}

async fn delete_stats(State(shared): State<Arc<Shared>>) -> StatusCode {
    if let Some(cache) = &shared.prefix_cache {
        cache.reset();
    }
    shared.generated.reset();
    StatusCode::NO_CONTENT
}

/// The request parameters that shape the reply.
struct Params {
    stream: bool,
    include_usage: bool,
    max_tokens: Option<u64>,
    model: String,
}

impl Params {
    fn from_body(body: &Value, script: &Script) -> Params {
        let include_usage = body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let max_tokens = body
            .get("max_completion_tokens")
            .and_then(Value::as_u64)
            .or_else(|| body.get("max_tokens").and_then(Value::as_u64));
        let model = match body.get("model").and_then(Value::as_str) {
            Some(m) if !m.is_empty() => m.to_string(),
            _ => script.model_name().to_string(),
        };
        Params {
            stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
            include_usage,
            max_tokens,
            model,
        }
    }
}

async fn chat_completions(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    shared.record(&body);
    if let Some(resp) = shared.auth_rejection(&headers) {
        return resp;
    }
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return bad_request("the request body must be a JSON object", None),
        Err(e) => return bad_request(&format!("invalid JSON body: {e}"), None),
    };
    let conv = match Conversation::from_request(&body) {
        Ok(c) => c,
        Err(msg) => return bad_request(&msg, Some("messages")),
    };
    let script = &shared.script;
    if script.reject_tools && body.get("tools").is_some_and(|t| !t.is_null()) {
        return bad_request(
            "tools are not supported by this server (no tool parser configured)",
            Some("tools"),
        );
    }
    if script.reject_stream_options && body.get("stream_options").is_some_and(|t| !t.is_null()) {
        return bad_request(
            "stream_options is not supported by this server",
            Some("stream_options"),
        );
    }
    if let Some(refusal) = script.reject_system
        && let Some(message) = system_refusal(refusal, &body)
    {
        return openai_error(StatusCode::BAD_REQUEST, message, Some("messages"), None);
    }
    let params = Params::from_body(&body, script);
    // A continuation is answered as the reply it continues: the rules see the conversation
    // as it stood before that reply began.
    let continued = match continuation(&body, &conv) {
        Ok(continued) => continued,
        Err(message) => return bad_request(message, Some("messages")),
    };
    if continued.is_some() {
        shared
            .generated
            .continuations
            .fetch_add(1, Ordering::Relaxed);
    }
    let (matched, partial) = match &continued {
        Some((before, partial)) => (before, Some(partial.as_str())),
        None => (&conv, None),
    };

    let fallback = Rule::default();
    let (index, rule) = match script.select(matched) {
        Some((i, r)) => (Some(i), r),
        None => (None, &fallback),
    };
    tracing::debug!(rule = ?index.map(|i| i + 1), stream = params.stream, "mock chat request");
    if let Some(path) = &rule.replay {
        let delay = Duration::from_millis(rule.delay_ms.unwrap_or(script.token_delay_ms));
        return replay(path, rule.status.unwrap_or(200), delay).await;
    }
    if let Some(status) = rule.error_status() {
        let seen = index.map_or(0, |i| shared.matched[i].fetch_add(1, Ordering::Relaxed));
        if rule.fail_times.is_none_or(|n| seen < n) {
            return scripted_error(status, rule);
        }
    }

    let n = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let mut plan = Plan::build(script, rule, matched, partial, &params, n);
    if let Some(cache) = &shared.prefix_cache {
        // The prefill comes before the rule's own wait for its first token.
        plan.first_delay += cache.first_token_delay(&conv);
    }
    if params.stream {
        plan.into_sse(shared.clone())
    } else {
        plan.into_json(&shared).await
    }
}

/// Whether the request continues a final assistant message, and if so the conversation
/// before it and its text. Either form counts: `continue_final_message: true` (vLLM's, which
/// refuses it beside `add_generation_prompt`, true unless said, and after anything but an
/// assistant message), or an assistant message last (llama.cpp's prefill).
fn continuation(
    body: &Value,
    conv: &Conversation,
) -> Result<Option<(Conversation, String)>, &'static str> {
    let flag = |key: &str| body.get(key).and_then(Value::as_bool);
    if flag("continue_final_message") == Some(true) {
        if flag("add_generation_prompt") != Some(false) {
            return Err(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            );
        }
        return match conv.continued() {
            Some(continued) => Ok(Some(continued)),
            None => Err(
                "continue_final_message is set but the final message is not an assistant message",
            ),
        };
    }
    Ok(conv.continued())
}

/// A native tool call as it will be sent.
struct PlannedCall {
    id: String,
    name: String,
    arguments: String,
    fragments: Vec<String>,
}

#[derive(Serialize, Clone, Copy)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

/// Everything one reply sends, decided before the first byte goes out.
struct Plan {
    id: String,
    created: u64,
    model: String,
    reasoning: Vec<String>,
    content: Vec<String>,
    calls: Vec<PlannedCall>,
    finish_reason: String,
    usage: Usage,
    include_usage: bool,
    delay: Duration,
    first_delay: Duration,
    break_after: Option<u32>,
    break_with_error: bool,
    omit_finish_reason: bool,
}

impl Plan {
    /// The reply `rule` gives to `conv`; with `partial` (a continuation's text so far), only
    /// what follows it in that reply.
    fn build(
        script: &Script,
        rule: &Rule,
        conv: &Conversation,
        partial: Option<&str>,
        params: &Params,
        n: u64,
    ) -> Plan {
        let text = match &rule.reply {
            Some(template) => conv.render(template),
            None if rule.tool_calls.is_empty() => conv.last_user().to_string(),
            None => String::new(),
        };
        let mut text = text.repeat(rule.repeat.unwrap_or(1) as usize);
        let mut reasoning = rule.reasoning.as_deref().map(|r| conv.render(r));
        if let Some(partial) = partial.filter(|p| !p.is_empty())
            && let Some(rest) = text.strip_prefix(partial)
        {
            // The reply was cut after its reasoning, within its content: only the rest of
            // the content is generated. A reply that does not start with the text so far is
            // sent whole, as a model that went its own way would.
            text = rest.to_string();
            reasoning = None;
        }

        let mut reasoning = reasoning.map_or_else(Vec::new, |r| rule.chunk.split(&r));
        let mut content = rule.chunk.split(&text);
        let mut truncated = false;
        if let Some(max) = params.max_tokens {
            // One budget for reasoning then content, as a real model spends its tokens.
            let max = usize::try_from(max).unwrap_or(usize::MAX);
            truncated = reasoning.len() + content.len() > max;
            reasoning.truncate(max);
            content.truncate(max - reasoning.len());
        }
        let calls: Vec<PlannedCall> = if truncated {
            Vec::new()
        } else {
            rule.tool_calls
                .iter()
                .enumerate()
                .map(|(i, spec)| {
                    let arguments = spec.arguments_string();
                    PlannedCall {
                        id: spec.id.clone().unwrap_or_else(|| format!("call_{n}_{i}")),
                        name: spec.name.clone(),
                        fragments: rule.chunk.split_arguments(&arguments),
                        arguments,
                    }
                })
                .collect()
        };
        let finish_reason = match &rule.finish_reason {
            Some(forced) => forced.clone(),
            None if truncated => "length".to_string(),
            None if !calls.is_empty() => "tool_calls".to_string(),
            None => "stop".to_string(),
        };
        let overrides = rule.usage.unwrap_or_default();
        let prompt_tokens = overrides.prompt_tokens.unwrap_or_else(|| {
            let partial = partial.map_or(0, |p| p.chars().count());
            ((conv.char_count() + partial) as u64 / 4).max(1)
        });
        let completion_tokens = overrides
            .completion_tokens
            .unwrap_or((reasoning.len() + content.len() + calls.len()) as u64);
        let delay = Duration::from_millis(rule.delay_ms.unwrap_or(script.token_delay_ms));
        Plan {
            id: format!("chatcmpl-mock-{n}"),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: params.model.clone(),
            reasoning,
            content,
            calls,
            finish_reason,
            usage: Usage {
                prompt_tokens,
                completion_tokens,
                total_tokens: prompt_tokens + completion_tokens,
            },
            include_usage: params.include_usage,
            delay,
            first_delay: Duration::from_millis(rule.first_token_delay_ms),
            break_after: rule.break_after,
            break_with_error: rule.break_with_error,
            omit_finish_reason: rule.omit_finish_reason,
        }
    }

    /// Number of generated chunks after the role chunk, each preceded by the token delay.
    fn generated_chunks(&self) -> usize {
        let call_chunks: usize = self.calls.iter().map(|c| 1 + c.fragments.len()).sum();
        self.reasoning.len() + self.content.len() + call_chunks
    }

    async fn into_json(self, shared: &Shared) -> Response {
        let wait = self.first_delay
            + self
                .delay
                .saturating_mul(u32::try_from(self.generated_chunks()).unwrap_or(u32::MAX));
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        if self.break_after.is_some() {
            // The body fails before its first byte, so hyper closes the connection without
            // a complete response: a server dying mid-request.
            let body = Body::from_stream(stream::iter([Err::<Bytes, _>(broken())]));
            return ([(header::CONTENT_TYPE, "application/json")], body).into_response();
        }
        let content = self.content.concat();
        shared
            .generated
            .sent(content.chars().count(), self.content.len());
        let mut message = json!({ "role": "assistant", "content": content });
        if !self.calls.is_empty() {
            if content.is_empty() {
                message["content"] = Value::Null;
            }
            message["tool_calls"] = self
                .calls
                .iter()
                .map(|c| {
                    json!({
                        "id": c.id,
                        "type": "function",
                        "function": { "name": c.name, "arguments": c.arguments },
                    })
                })
                .collect();
        }
        if !self.reasoning.is_empty() {
            message["reasoning_content"] = Value::String(self.reasoning.concat());
        }
        Json(json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": null,
                "finish_reason": self.finish_reason,
            }],
            "usage": self.usage,
        }))
        .into_response()
    }

    fn into_sse(self, shared: Arc<Shared>) -> Response {
        shared.stream_opened();
        let frames = Unsent {
            frames: self.frames().into_iter(),
            shared,
            open: true,
        };
        let body = Body::from_stream(stream::unfold(frames, |mut frames| async move {
            let frame = frames.frames.next()?;
            if !frame.delay.is_zero() {
                tokio::time::sleep(frame.delay).await;
            }
            if frames.frames.len() == 0 {
                // The last frame: closed before the client can read it.
                frames.close();
            }
            if frame.content_chars > 0 {
                frames.shared.generated.sent(frame.content_chars, 1);
            }
            Some((frame.data, frames))
        }));
        sse_response(StatusCode::OK, body)
    }

    /// Renders the whole stream up front; a frame is a few hundred bytes, so even long
    /// replies stay small, and sending is then only writes (and the scripted sleeps).
    fn frames(&self) -> Vec<Frame> {
        let role = Delta {
            role: Some("assistant"),
            content: Some(""),
            ..Delta::default()
        };
        let mut generated = Vec::with_capacity(self.generated_chunks());
        // Each generated chunk with the characters of content it carries.
        for token in &self.reasoning {
            let delta = Delta {
                reasoning_content: Some(token),
                ..Delta::default()
            };
            generated.push((self.chunk(delta, None), 0));
        }
        for token in &self.content {
            let delta = Delta {
                content: Some(token),
                ..Delta::default()
            };
            generated.push((self.chunk(delta, None), token.chars().count()));
        }
        for (index, call) in self.calls.iter().enumerate() {
            let head = [ToolCallDelta {
                index,
                id: Some(&call.id),
                kind: Some("function"),
                function: FunctionDelta {
                    name: Some(&call.name),
                    arguments: "",
                },
            }];
            let delta = Delta {
                tool_calls: Some(&head),
                ..Delta::default()
            };
            generated.push((self.chunk(delta, None), 0));
            for fragment in &call.fragments {
                let part = [ToolCallDelta {
                    index,
                    id: None,
                    kind: None,
                    function: FunctionDelta {
                        name: None,
                        arguments: fragment,
                    },
                }];
                let delta = Delta {
                    tool_calls: Some(&part),
                    ..Delta::default()
                };
                generated.push((self.chunk(delta, None), 0));
            }
        }

        let mut out = Vec::with_capacity(generated.len() + 4);
        out.push(Frame::ok(self.first_delay, self.chunk(role, None)));
        if let Some(n) = self.break_after {
            generated.truncate(n as usize);
        }
        out.extend(generated.into_iter().map(|(data, content_chars)| Frame {
            content_chars,
            ..Frame::ok(self.delay, data)
        }));
        if self.break_after.is_some() {
            if self.break_with_error {
                // hyper drops unflushed output when the body fails; a short pause (the body
                // is pending, so hyper flushes) gets the chunks before the break out first.
                out.push(Frame {
                    delay: Duration::from_millis(10),
                    data: Err(broken()),
                    content_chars: 0,
                });
            }
            return out;
        }
        if !self.omit_finish_reason {
            let finish = self.chunk(Delta::default(), Some(&self.finish_reason));
            out.push(Frame::ok(Duration::ZERO, finish));
        }
        if self.include_usage {
            let chunk = Chunk {
                id: &self.id,
                object: "chat.completion.chunk",
                created: self.created,
                model: &self.model,
                choices: &[],
                usage: Some(Some(self.usage)),
            };
            out.push(Frame::ok(Duration::ZERO, sse_data(&chunk)));
        }
        out.push(Frame::ok(
            Duration::ZERO,
            Bytes::from_static(b"data: [DONE]\n\n"),
        ));
        out
    }

    fn chunk(&self, delta: Delta<'_>, finish_reason: Option<&str>) -> Bytes {
        let choices = [Choice {
            index: 0,
            delta,
            logprobs: None,
            finish_reason,
        }];
        sse_data(&Chunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            choices: &choices,
            // OpenAI sends `"usage": null` on every chunk but the last when usage is asked for.
            usage: self.include_usage.then_some(None),
        })
    }
}

struct Frame {
    delay: Duration,
    data: Result<Bytes, std::io::Error>,
    /// Characters of content the frame carries, counted as sent when it is handed out.
    content_chars: usize,
}

impl Frame {
    fn ok(delay: Duration, data: Bytes) -> Frame {
        Frame {
            delay,
            data: Ok(data),
            content_chars: 0,
        }
    }
}

/// The frames of a streamed reply not sent yet: dropped with some left, the client hung up.
struct Unsent {
    frames: std::vec::IntoIter<Frame>,
    shared: Arc<Shared>,
    /// Counted among the open replies.
    open: bool,
}

impl Unsent {
    fn close(&mut self) {
        if std::mem::take(&mut self.open) {
            self.shared.open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Unsent {
    fn drop(&mut self) {
        if self.frames.len() > 0 {
            self.shared.abandoned.fetch_add(1, Ordering::Relaxed);
        }
        self.close();
    }
}

#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: &'a [Choice<'a>],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<Usage>>,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
}

#[derive(Serialize, Default)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<&'a [ToolCallDelta<'a>]>,
}

#[derive(Serialize)]
struct ToolCallDelta<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'a str>,
    function: FunctionDelta<'a>,
}

#[derive(Serialize)]
struct FunctionDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    arguments: &'a str,
}

/// The error a chat template that refuses these system messages raises, if it does.
fn system_refusal(refusal: RejectSystem, body: &Value) -> Option<&'static str> {
    let roles: Vec<&str> = body["messages"]
        .as_array()?
        .iter()
        .map(|m| m["role"].as_str().unwrap_or_default())
        .collect();
    let system_at = |i: usize| roles.get(i) == Some(&"system");
    match refusal {
        RejectSystem::AfterFirst => (1..roles.len())
            .any(system_at)
            .then_some("Conversation roles must alternate user/assistant/user/assistant/..."),
        RejectSystem::All => (0..roles.len())
            .any(system_at)
            .then_some("System role not supported"),
    }
}

/// A recorded response sent back as it was recorded: an `.sse` transcript one event at a time
/// (each with `delay` before it), any other file as one JSON body.
async fn replay(path: &std::path::Path, status: u16, delay: Duration) -> Response {
    let body = match tokio::fs::read(path).await {
        Ok(body) => Bytes::from(body),
        Err(e) => {
            let message = format!("mock: cannot read the replay file {}: {e}", path.display());
            return openai_error(StatusCode::INTERNAL_SERVER_ERROR, &message, None, None);
        }
    };
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let is_sse = path.extension().is_some_and(|e| e == "sse");
    if !is_sse {
        let json = HeaderValue::from_static("application/json");
        return (status, [(header::CONTENT_TYPE, json)], body).into_response();
    }
    // Events end at a blank line (LF or CRLF); each goes out with its end, as a server
    // writes them.
    let mut frames = Vec::new();
    let mut start = 0;
    while start < body.len() {
        let rest = &body[start..];
        let end = (0..rest.len())
            .find_map(|i| match rest[i..] {
                [b'\n', b'\n', ..] => Some(i + 2),
                [b'\n', b'\r', b'\n', ..] => Some(i + 3),
                _ => None,
            })
            .map_or(body.len(), |at| start + at);
        frames.push(body.slice(start..end));
        start = end;
    }
    let stream = stream::unfold(frames.into_iter(), move |mut frames| async move {
        let frame = frames.next()?;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        Some((Ok::<_, std::io::Error>(frame), frames))
    });
    sse_response(status, Body::from_stream(stream))
}

/// A server-sent event stream with `status`, as the servers the mock stands for send one.
fn sse_response(status: StatusCode, body: Body) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

fn sse_data(value: &impl Serialize) -> Bytes {
    let mut buf = Vec::with_capacity(256);
    buf.extend_from_slice(b"data: ");
    // Serializing plain structs of strings and numbers into a Vec cannot fail.
    serde_json::to_writer(&mut buf, value).unwrap_or_default();
    buf.extend_from_slice(b"\n\n");
    Bytes::from(buf)
}

fn broken() -> std::io::Error {
    std::io::Error::other("mock: response broken off by script (break_after)")
}

fn bad_request(message: &str, param: Option<&str>) -> Response {
    openai_error(StatusCode::BAD_REQUEST, message, param, None)
}

fn scripted_error(status: u16, rule: &Rule) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let default_message = format!("mock: scripted failure (HTTP {})", status.as_u16());
    let message = rule.error_message.as_deref().unwrap_or(&default_message);
    let code = (status == StatusCode::TOO_MANY_REQUESTS).then_some("rate_limit_exceeded");
    openai_error(status, message, None, code)
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
fn openai_error(
    status: StatusCode,
    message: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Response {
    let kind = match status.as_u16() {
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    let body = json!({
        "error": { "message": message, "type": kind, "param": param, "code": code },
    });
    (status, Json(body)).into_response()
}
