//! The model backend: a streaming chat API ([`LlmBackend`]), its OpenAI-compatible HTTP
//! implementation, and the mock server used by tests, the demo and benchmarks.

pub mod mock;
pub mod openai;

use futures_util::stream::BoxStream;

use crate::protocol::{Message, Usage};

pub use openai::OpenAiBackend;

/// One call of the model: everything the backend is sent. The engine builds it; the backend
/// only translates it to its wire format.
#[derive(Debug, Clone, Default)]
pub struct ChatRequest {
    /// Overrides the backend's configured model.
    pub model: Option<String>,
    /// The full conversation, BIOS included.
    pub messages: Vec<Message>,
    /// Native tool definitions; empty in text mode.
    pub tools: Vec<ToolSpec>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    /// Passed through as is (sampling and format parameters).
    pub options: serde_json::Map<String, serde_json::Value>,
    /// W3C trace context, sent as the `traceparent` header.
    pub traceparent: Option<String>,
    /// The last element of `messages` is an assistant message whose text the model continues
    /// (not a new turn): a generation cut off mid-answer, resumed from its output so far. Sent
    /// in the backend's [`Continuation`] form; asked only of a backend whose form is not
    /// [`Continuation::None`].
    pub continue_final: bool,
}

/// How a backend continues a final assistant message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Continuation {
    /// `continue_final_message: true, add_generation_prompt: false` beside the messages
    /// (vLLM, SGLang).
    ContinueFinalMessage,
    /// The assistant message last, nothing added: the server takes it as the start of its
    /// reply (llama.cpp's llama-server, Ollama).
    Prefill,
    /// The backend cannot continue: the engine generates the turn again from its start.
    None,
}

/// A function the model may call natively (OpenAI's `tools[].function`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ToolSpec {
    pub name: String,
    /// Left out when empty (a caller's function may have none).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub description: String,
    pub parameters: serde_json::Value,
    /// OpenAI's structured-outputs flag, as a caller's function sets it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A piece of a native tool call as it streams: the first piece of a call carries its id and
/// name, later ones more of the argument string.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolCallDelta {
    pub index: usize,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    ContentFilter,
    Other(String),
}

impl FinishReason {
    pub fn parse(text: &str) -> FinishReason {
        match text {
            "stop" | "eos" | "end_turn" => FinishReason::Stop,
            "length" | "max_tokens" => FinishReason::Length,
            "tool_calls" | "function_call" => FinishReason::ToolCalls,
            "content_filter" => FinishReason::ContentFilter,
            other => FinishReason::Other(other.to_string()),
        }
    }
}

/// What a backend stream yields. A successful stream yields `Finish` exactly once; a stream
/// that ends without it was cut short.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    Text(String),
    Reasoning(String),
    ToolCall(ToolCallDelta),
    Usage(Usage),
    Finish(FinishReason),
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LlmError {
    /// The backend refused native tools (e.g. vLLM without a tool parser): retry in text mode.
    #[error("the backend rejected native tools: {0}")]
    ToolsRejected(String),
    /// The backend's chat template refused the system messages as sent (a second one, or any):
    /// retry with them merged, or folded into the first user message.
    #[error("the backend's chat template refused the system messages: {0}")]
    SystemRejected(String),
    #[error("the backend answered HTTP {status}: {body}")]
    Http { status: u16, body: String },
    #[error("could not reach the backend: {0}")]
    Transport(String),
    #[error("the backend sent nothing for {0} ms")]
    Idle(u64),
    #[error("the backend stream broke: {0}")]
    StreamBroken(String),
    #[error("the backend sent an unreadable chunk: {0}")]
    Protocol(String),
    /// An error the backend reported inside the stream (or as its whole answer).
    #[error("the backend reported an error: {0}")]
    Backend(String),
}

impl LlmError {
    /// The same error with every occurrence of `secret` (the API key) replaced: a backend or a
    /// proxy may echo the Authorization header back in an error.
    pub fn redact(self, secret: Option<&str>) -> LlmError {
        let Some(secret) = secret.filter(|s| !s.is_empty()) else {
            return self;
        };
        let clean = |text: String| redact(&text, secret);
        match self {
            LlmError::ToolsRejected(text) => LlmError::ToolsRejected(clean(text)),
            LlmError::SystemRejected(text) => LlmError::SystemRejected(clean(text)),
            LlmError::Backend(text) => LlmError::Backend(clean(text)),
            LlmError::Http { status, body } => LlmError::Http {
                status,
                body: clean(body),
            },
            LlmError::Transport(text) => LlmError::Transport(clean(text)),
            LlmError::Idle(ms) => LlmError::Idle(ms),
            LlmError::StreamBroken(text) => LlmError::StreamBroken(clean(text)),
            LlmError::Protocol(text) => LlmError::Protocol(clean(text)),
        }
    }
}

/// `text` with every occurrence of `secret` replaced by `[redacted]`.
pub fn redact(text: &str, secret: &str) -> String {
    if secret.is_empty() {
        return text.to_string();
    }
    text.replace(secret, "[redacted]")
}

pub type ChatStream = BoxStream<'static, Result<StreamEvent, LlmError>>;

/// A model backend. Dropping the stream cancels the call (and closes its connection).
pub trait LlmBackend: Send + Sync + 'static {
    fn chat_stream(&self, request: ChatRequest) -> ChatStream;

    /// How this backend continues a final assistant message ([`ChatRequest::continue_final`]);
    /// `None` means it cannot, and the engine then restarts the turn instead. A backend that
    /// learns it from its server says `None` until it knows.
    fn continuation(&self) -> Continuation {
        Continuation::None
    }
}
