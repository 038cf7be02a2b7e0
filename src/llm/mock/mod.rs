//! A scriptable mock of an OpenAI-compatible chat completions server.
//!
//! genfleet's tests, demo and benchmarks run workers against it instead of a GPU-backed
//! model server, and users can do the same to try a fleet out (`genfleet mock-llm --listen
//! ADDR [--script FILE]`). It speaks the subset of the API the workers use:
//!
//! - `POST /v1/chat/completions`, streaming (SSE `data: {chunk}` frames ending in
//!   `data: [DONE]`) or not, with `stream_options.include_usage`, `max_tokens` /
//!   `max_completion_tokens` (finish reason `length`), native tool calls streamed as OpenAI
//!   does (a head delta with `id`, `type`, `function.name`, then argument fragments) and
//!   `reasoning_content` deltas before the content;
//! - `GET /v1/models` (the script's model, default `mock`);
//! - `GET /mock/requests` (the last 256 chat request bodies, oldest first) and
//!   `DELETE /mock/requests` (clears them);
//! - `GET /mock/stats` (the prefix cache's hits, misses and entries; the content characters
//!   and chunks sent and the continuations asked for) and `DELETE /mock/stats` (forgets what
//!   the cache holds and zeroes every counter);
//! - `GET /version` (`{"version": "genfleet-mock"}`, as vLLM answers it, so that
//!   `llm.continuation = "auto"` takes the mock for a server that continues);
//! - `GET /health` (`ok`).
//!
//! A request that continues a final assistant message, in either form
//! (`continue_final_message: true` with `add_generation_prompt: false`, or an assistant
//! message last), is matched against the conversation without that message, so the rule that
//! gave the reply being continued answers; when that reply starts with the text so far, only
//! the rest is sent (no reasoning, usage counting what was sent), else the reply is sent
//! whole. `continue_final_message: true` after anything but an assistant message, or beside
//! `add_generation_prompt` left true, is a 400 as vLLM answers.
//!
//! A streamed reply whose client hangs up before its last frame is counted
//! ([`MockServer::abandoned_streams`]): a worker that cancels a generation closes its backend
//! connection, and the tests check it does.
//!
//! Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for a body
//! that is not JSON or lacks `messages`, 401 for a wrong or missing key when the script sets
//! `api_key`, and whatever status a rule scripts.
//!
//! # Script
//!
//! What the server answers comes from a [`Script`], a TOML or JSON file or built in Rust. Rules
//! are tried in order and the first whose conditions all hold answers; without a match the
//! last user message is echoed verbatim, so the empty script ([`Script::echo`]) is an echo
//! server. Text conditions are case-insensitive substring matches.
//!
//! ```toml
//! model = "mock"                 # name in /v1/models and in replies to requests naming none
//! api_key = "secret"             # require "Authorization: Bearer secret" on /v1/*
//! reject_tools = false           # 400 (param "tools") for any request carrying `tools`
//! reject_stream_options = false  # 400 (param "stream_options") for any request carrying it
//! reject_system = "after_first"  # 400 like Gemma's template: "after_first" (a system message not first) or "all"
//! token_delay_ms = 0             # default delay before each generated chunk
//! # A prefix cache (absent: none): a request whose messages start with a conversation served
//! # recently gets its first token after prefix_hit_ms, any other after prefill_ms_per_kb per
//! # KiB of its messages' text (see docs/mock-llm.md).
//! prefix_cache = { entries = 4096, prefix_hit_ms = 5, prefill_ms_per_kb = 50 }
//!
//! [[rules]]
//! # conditions (all optional; none = match everything)
//! when_last_user_contains = "weather"   # last message with role "user"
//! when_last_role = "user"               # role of the last message
//! when_last_message_contains = "error"  # last message, any role
//! when_any_message_contains = "pirate"  # any message, system included
//! when_turn = 1                         # assistant messages in the request + 1
//! when_has_tools = true                 # request has a non-empty `tools` array
//! # reply
//! reply = "It is sunny. You said: {{last_user}} (turn {{turn}}, last {{last_message}})"
//! reasoning = "The user wants the weather."    # streamed first as reasoning_content
//! tool_calls = [{ name = "get_weather", arguments = { city = "Paris" } }]  # or a raw string
//! repeat = 1                    # reply text repeated N times
//! chunk = "word"                # "word" | "char" | N (chars per chunk); one chunk = one token
//! delay_ms = 0                  # before each generated chunk (overrides token_delay_ms)
//! first_token_delay_ms = 0      # extra, before the first chunk
//! finish_reason = "stop"        # forced finish reason
//! break_after = 3               # drop the stream after N generated chunks (no finish, no [DONE])
//! break_with_error = false      # with break_after: abort the connection instead of a clean end
//! omit_finish_reason = false    # streaming: no finish reason, but usage and [DONE] (llama-cpp-python on a stop string)
//! status = 503                  # answer with this HTTP error instead
//! fail_times = 2                # only the first 2 matches fail (status defaults to 500)
//! error_message = "overloaded"  # message of the scripted error
//! usage = { prompt_tokens = 10, completion_tokens = 5 }
//! replay = "vllm/tool_call.sse"   # answer with this recorded file byte for byte (.sse streamed event by
//!                                # event, delay_ms before each; other files as a JSON body), with status
//! ```
//!
//! Token accounting: every generated chunk (reasoning and content) is one token; a tool call
//! counts as one completion token whatever its argument fragments. `max_tokens` is one budget
//! for reasoning then content; when it cuts the reply, tool calls are dropped and the finish
//! reason is `length`. Prompt tokens default to the message text's characters / 4 (at least 1).
//! A reply without `reply` echoes the last user message unless it has tool calls (then its
//! content is empty, `null` in non-streamed replies).
//!
//! Tool-call arguments are streamed in 8-char fragments with `chunk = "word"` (JSON has no
//! spaces to split at), else by the rule's `chunk`.

mod conversation;
mod prefix_cache;
mod script;
mod server;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub use prefix_cache::{PrefixCacheSettings, PrefixCacheStats};
pub use script::{
    Chunking, DEFAULT_MODEL, RejectSystem, Rule, Script, ToolCallSpec, UsageOverride,
};
pub use server::GeneratedStats;

/// How many chat request bodies the server keeps for `GET /mock/requests`.
pub const REQUEST_LOG_CAPACITY: usize = server::LOG_CAPACITY;

/// Serves the mock API on `listener` until `shutdown` resolves, then lets open responses
/// finish. The caller binds the listener, so it knows the address (port 0 works).
pub async fn serve(
    listener: TcpListener,
    script: Script,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    script
        .validate()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    server::run(listener, server::Shared::new(script), shutdown).await
}

/// A mock server on an ephemeral loopback port, for tests: it runs on the current Tokio
/// runtime and stops when dropped. Recorded requests are read directly, without HTTP.
pub struct MockServer {
    addr: SocketAddr,
    shared: Arc<server::Shared>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl MockServer {
    /// Binds `127.0.0.1:0` and starts serving `script`.
    pub async fn start(script: Script) -> io::Result<MockServer> {
        Self::start_at(SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, 0)), script).await
    }

    /// Binds `addr` (e.g. the address of a server that stopped, to bring it back).
    pub async fn start_at(addr: SocketAddr, script: Script) -> io::Result<MockServer> {
        script
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = server::Shared::new(script);
        let (tx, rx) = oneshot::channel::<()>();
        let signal = async move {
            // Either an explicit send or the sender being dropped means stop.
            let _ = rx.await;
        };
        let task_shared = Arc::clone(&shared);
        tokio::spawn(async move {
            if let Err(e) = server::run(listener, task_shared, signal).await {
                tracing::warn!(error = %e, "mock LLM server stopped with an error");
            }
        });
        Ok(MockServer {
            addr,
            shared,
            shutdown: Some(tx),
        })
    }

    /// The OpenAI base URL clients are configured with: `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Chat request bodies received so far (the last [`REQUEST_LOG_CAPACITY`]), oldest
    /// first; a body that was not JSON appears as a JSON string.
    pub fn requests(&self) -> Vec<serde_json::Value> {
        self.shared.requests()
    }

    /// Streamed replies whose client closed the connection before their last frame (a worker
    /// that cancels a generation closes its backend connection).
    pub fn abandoned_streams(&self) -> u64 {
        self.shared.abandoned_streams()
    }

    /// Streamed replies open now (from their request until their last frame is handed out).
    pub fn open_streams(&self) -> u64 {
        self.shared.open_streams()
    }

    /// The most streamed replies open at once since the start or the last
    /// [`MockServer::reset_most_open_streams`]: how many generations its clients ran at once,
    /// never counted low (a reply closes before its client can read its end).
    pub fn most_open_streams(&self) -> u64 {
        self.shared.most_open_streams()
    }

    /// Counts the most open at once again from the replies open now.
    pub fn reset_most_open_streams(&self) {
        self.shared.reset_most_open_streams()
    }

    /// What the prefix cache has done (`None` without one).
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.shared.prefix_cache_stats()
    }

    /// Completion text sent since the start or the last `DELETE /mock/stats`: content
    /// characters and chunks, and the requests that continued a final assistant message.
    pub fn generated_stats(&self) -> GeneratedStats {
        self.shared.generated_stats()
    }

    /// Forgets the recorded requests.
    pub fn clear_requests(&self) {
        self.shared.clear_requests();
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}
