//! OpenAI's chat completions API as the gateway reads and writes it: the request body (read
//! strictly, so a field the gateway would drop is an error naming it), the completion, its
//! streamed chunks and the error body.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::protocol::{Checkpoint, Message, ToolCall, ValidationCheck};

/// Sampling and output fields passed to the backend as the generation request's `options`,
/// as they are.
pub const PASSED_OPTIONS: &[&str] = &[
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "top_k",
    "min_p",
    "repetition_penalty",
];

/// Fields OpenAI defines that say nothing to a fleet and are read and ignored (see
/// docs/gateway.md).
pub const IGNORED_FIELDS: &[&str] = &["store", "service_tier", "modalities", "prediction"];

/// The body of `POST /v1/chat/completions`. `messages` stay JSON here: each is read on its own
/// so that an error names `messages[i]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Value>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub tools: Option<Vec<crate::protocol::FunctionTool>>,
    /// OpenAI's metadata (string to string): added to the request's metadata.
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
    /// genfleet's own fields (`extra_body={"genfleet": {...}}` in the SDKs).
    #[serde(default)]
    pub genfleet: Option<GenfleetFields>,
    // Passed to the backend as options.
    #[serde(default)]
    pub top_p: Option<Value>,
    #[serde(default)]
    pub seed: Option<Value>,
    #[serde(default)]
    pub presence_penalty: Option<Value>,
    #[serde(default)]
    pub frequency_penalty: Option<Value>,
    #[serde(default)]
    pub logit_bias: Option<Value>,
    #[serde(default)]
    pub logprobs: Option<Value>,
    #[serde(default)]
    pub top_logprobs: Option<Value>,
    #[serde(default)]
    pub response_format: Option<Value>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<Value>,
    #[serde(default)]
    pub reasoning_effort: Option<Value>,
    #[serde(default)]
    pub top_k: Option<Value>,
    #[serde(default)]
    pub min_p: Option<Value>,
    #[serde(default)]
    pub repetition_penalty: Option<Value>,
    // Read and ignored.
    #[serde(default)]
    pub store: Option<Value>,
    #[serde(default)]
    pub service_tier: Option<Value>,
    #[serde(default)]
    pub modalities: Option<Value>,
    #[serde(default)]
    pub prediction: Option<Value>,
}

impl ChatRequest {
    /// The options passed through, by name, in [`PASSED_OPTIONS`] order.
    pub fn passed_options(&self) -> Vec<(&'static str, &Value)> {
        let fields = [
            &self.top_p,
            &self.seed,
            &self.presence_penalty,
            &self.frequency_penalty,
            &self.logit_bias,
            &self.logprobs,
            &self.top_logprobs,
            &self.response_format,
            &self.tool_choice,
            &self.parallel_tool_calls,
            &self.reasoning_effort,
            &self.top_k,
            &self.min_p,
            &self.repetition_penalty,
        ];
        PASSED_OPTIONS
            .iter()
            .zip(fields)
            .filter_map(|(name, value)| value.as_ref().map(|v| (*name, v)))
            .filter(|(_, v)| !v.is_null())
            .collect()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// genfleet's own fields of a chat request, beside OpenAI's.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenfleetFields {
    /// The request's id (idempotency across retries of the caller); default: a fresh ULID.
    #[serde(default)]
    pub request_id: Option<String>,
    /// Put the request on the durable queue at once (it survives a worker's failure).
    #[serde(default)]
    pub durable: bool,
    /// Wait in the durable queue when no slot is free (default), or answer 429 at once.
    #[serde(default = "yes")]
    pub queue: bool,
    /// Keep the response open across a decision and stream the continuation (default), or end
    /// with finish_reason `decision_requested`.
    #[serde(default = "yes")]
    pub follow_decisions: bool,
    #[serde(default)]
    pub job_name: Option<String>,
    #[serde(default)]
    pub metadata: Map<String, Value>,
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    #[serde(default)]
    pub validation: Vec<ValidationCheck>,
    #[serde(default)]
    pub escalation_threshold: Option<f64>,
    #[serde(default)]
    pub checkpoints: Vec<Checkpoint>,
    /// Bus tools (by name) the worker runs inside the loop.
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default)]
    pub tool_iterations: Option<u32>,
    /// The caller's system prompt after the fleet's own (system messages work too).
    #[serde(default)]
    pub system: Option<String>,
    /// The priority band: `high`, `normal` (default) or `low`.
    #[serde(default)]
    pub priority: Option<crate::protocol::Priority>,
    /// A conversation's or session's key: its requests go first to the worker that served it
    /// last (affinity). Default: the request's `user`.
    #[serde(default)]
    pub session: Option<String>,
}

impl Default for GenfleetFields {
    fn default() -> Self {
        GenfleetFields {
            request_id: None,
            durable: false,
            queue: true,
            follow_decisions: true,
            job_name: None,
            metadata: Map::new(),
            deadline_ms: None,
            validation: Vec::new(),
            escalation_threshold: None,
            checkpoints: Vec::new(),
            tools: Vec::new(),
            tool_iterations: None,
            system: None,
            priority: None,
            session: None,
        }
    }
}

fn yes() -> bool {
    true
}

/// A bad request: what is wrong, and the field (OpenAI's `param`).
#[derive(Debug, Clone, PartialEq)]
pub struct BadField {
    pub param: Option<String>,
    pub message: String,
}

impl BadField {
    pub fn new(param: impl Into<String>, message: impl Into<String>) -> BadField {
        BadField {
            param: Some(param.into()),
            message: message.into(),
        }
    }
}

/// Reads a body, naming the field of the first error (`messages[2].role`, `genfleet.durable`).
pub fn parse_request(body: &[u8]) -> Result<ChatRequest, BadField> {
    read_strictly(body, "a chat completions request")
}

/// Reads a body as `T`, naming the field of the first error; `what` the body should be, for an
/// error of the whole body. A body that reads is read once, without keeping the path of each
/// value on the way (what naming the field costs); one that does not is read again with it.
pub fn read_strictly<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> Result<T, BadField> {
    if let Ok(value) = serde_json::from_slice(body) {
        return Ok(value);
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        let param = (path != ".").then_some(path);
        let message = match &param {
            Some(path) => format!("{path}: {inner}"),
            None => format!("the body is not {what}: {inner}"),
        };
        BadField { param, message }
    })
}

/// Reads one message of the body. Keys whose value is null, an empty `annotations` and the
/// reasoning of an answer are dropped first: SDKs echo an assistant message back with
/// `refusal: null`, `audio: null`, `reasoning_content`.
pub fn parse_message(index: usize, value: &Value) -> Result<Message, BadField> {
    let at = format!("messages[{index}]");
    let Value::Object(map) = value else {
        return Err(BadField::new(&at, format!("{at} must be an object")));
    };
    let mut map: Map<String, Value> = map
        .iter()
        .filter(|(_, v)| !v.is_null())
        .filter(|(k, v)| !(k.as_str() == "annotations" && v.as_array().is_some_and(Vec::is_empty)))
        // A reasoning model's answer echoed back: its reasoning is output, not input.
        .filter(|(k, _)| !matches!(k.as_str(), "reasoning_content" | "reasoning"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // OpenAI's newer name for the system role.
    if map.get("role").and_then(Value::as_str) == Some("developer") {
        map.insert("role".into(), "system".into());
    }
    let value = Value::Object(map);
    // Read from the value as it is; only a message that does not read is written out and read
    // again, keeping the path, to name the field.
    if let Ok(message) = Message::deserialize(&value) {
        return Ok(message);
    }
    let text = value.to_string();
    let mut deserializer = serde_json::Deserializer::from_str(&text);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let param = if path == "." {
            at.clone()
        } else {
            format!("{at}.{path}")
        };
        BadField {
            message: format!("{param}: {}", error.into_inner()),
            param: Some(param),
        }
    })
}

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorObject<'a>,
}

#[derive(Debug, Serialize)]
pub struct ErrorObject<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: &'a str,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

impl From<crate::protocol::result::Usage> for Usage {
    fn from(usage: crate::protocol::result::Usage) -> Usage {
        Usage {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
        }
    }
}

/// A whole completion (`stream: false`).
#[derive(Debug, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: [CompletionChoice; 1],
    pub usage: Usage,
}

impl Completion {
    /// The completion of what a request produced, ended with `finish`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: String,
        created: u64,
        model: String,
        content: String,
        reasoning: String,
        tool_calls: Vec<ToolCall>,
        finish: &str,
        usage: crate::protocol::result::Usage,
    ) -> Completion {
        Completion {
            id,
            object: "chat.completion",
            created,
            model,
            choices: [CompletionChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant",
                    content: (!content.is_empty() || tool_calls.is_empty()).then_some(content),
                    reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
                    tool_calls,
                },
                logprobs: None,
                finish_reason: finish.to_string(),
            }],
            usage: Usage::from(usage),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<()>,
    pub finish_reason: String,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// One `chat.completion.chunk` of a stream.
#[derive(Debug, Serialize)]
pub struct Chunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChunkChoice<'a>>,
    /// Present (null until the last chunk) when the caller asked for usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'a str>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta<'a>>>,
}

/// A tool call streamed whole in one delta (OpenAI's clients join fragments by `index`).
#[derive(Debug, Serialize)]
pub struct ToolCallDelta<'a> {
    pub index: usize,
    pub id: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub function: &'a crate::protocol::FunctionCall,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bad(body: Value) -> BadField {
        parse_request(body.to_string().as_bytes()).unwrap_err()
    }

    #[test]
    fn errors_name_the_field() {
        let user = json!([{"role": "user", "content": "hi"}]);
        for (body, param) in [
            (json!({"messages": user}), None),
            (
                json!({"model": "m", "messages": user, "temprature": 1}),
                Some("temprature"),
            ),
            (
                json!({"model": "m", "messages": user, "max_tokens": "ten"}),
                Some("max_tokens"),
            ),
            (
                json!({"model": "m", "messages": user, "genfleet": {"durable": "yes"}}),
                Some("genfleet.durable"),
            ),
            (
                json!({"model": "m", "messages": user, "genfleet": {"priorty": 1}}),
                Some("genfleet.priorty"),
            ),
        ] {
            let error = bad(body.clone());
            assert_eq!(error.param.as_deref(), param, "{body}: {error:?}");
        }
        assert!(
            bad(json!({"model": "m", "messages": user, "temprature": 1}))
                .message
                .contains("temprature")
        );
    }

    #[test]
    fn messages_are_read_one_by_one_with_sdk_echoes_dropped() {
        let echoed = json!({"role": "assistant", "content": null, "refusal": null,
            "reasoning_content": "thought",
            "annotations": [], "audio": null, "function_call": null,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let message = parse_message(0, &echoed).unwrap();
        assert_eq!(message.tool_calls.len(), 1);
        let developer = parse_message(1, &json!({"role": "developer", "content": "x"})).unwrap();
        assert_eq!(developer.role, crate::protocol::Role::System);
        let error = parse_message(2, &json!({"role": "robot", "content": "x"})).unwrap_err();
        assert_eq!(
            error.param.as_deref(),
            Some("messages[2].role"),
            "{error:?}"
        );
        let error = parse_message(3, &json!({"role": "user", "contnet": "x"})).unwrap_err();
        assert!(error.message.contains("contnet"), "{error:?}");
    }

    #[test]
    fn passed_options_keep_their_names() {
        let request = parse_request(
            json!({"model": "m", "messages": [], "top_p": 0.5, "seed": 3, "tool_choice": "none"})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        let names: Vec<_> = request.passed_options().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["top_p", "seed", "tool_choice"]);
    }
}
