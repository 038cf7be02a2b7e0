//! The generation request, decoded strictly: an unknown top-level field is an error, so a typo
//! never passes silently and an older worker refuses a field it cannot honour.

use serde::{Deserialize, Serialize};

use super::error::WireError;
use super::ids::{MAX_NAME_LEN, is_valid_name, is_valid_request_id};
use super::message::{FunctionTool, Message, Role};

/// Keys of `options` that the worker itself sets, so a caller may not override them there.
pub const RESERVED_OPTION_KEYS: &[&str] = &[
    "model",
    "messages",
    "tools",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct GenerationRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
    /// Tools the caller runs itself, as OpenAI function definitions. When the model calls one,
    /// the generation ends COMPLETED `tool_calls` with the calls in the result.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caller_tools: Vec<FunctionTool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_iterations: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub options: serde_json::Map<String, serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// The priority band (`high`, `normal`, `low`); absent is `normal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<super::schedule::Priority>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_on_decision_request: Option<bool>,
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub validation: Vec<ValidationCheck>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalation_threshold: Option<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checkpoints: Vec<Checkpoint>,
    /// Requests that share a key go to the key's worker, the same for every sender (see
    /// docs/protocol.md, Affinity); a continuation's default is its chain's root request id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity_key: Option<String>,
}

/// The longest `affinity_key`, in bytes.
pub const MAX_AFFINITY_KEY_LEN: usize = 256;

/// Header of a submit: the worker that last served the request's `affinity_key`, as the
/// submitter knows it (the worker records whether affinity held).
pub const PREFERRED_WORKER_HEADER: &str = "Genfleet-Preferred-Worker";
/// Header of a submit sent to the pool after its preferred worker refused it: why
/// (`busy`: no free slot there, or the worker is gone).
pub const AFFINITY_FALLBACK_HEADER: &str = "Genfleet-Affinity-Fallback";
/// Header of a pool submit a full worker forwarded to a peer's own subject: the forwarding
/// worker. The peer serves it as a pool submit, and never forwards it again.
pub const FORWARDED_BY_HEADER: &str = "Genfleet-Forwarded-By";

/// One check of the final output; the confidence of a result is the weighted share of checks
/// that pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ValidationCheck {
    JsonSchema {
        schema: serde_json::Value,
        #[serde(default = "one")]
        weight: f64,
    },
    Regex {
        pattern: String,
        #[serde(default = "one")]
        weight: f64,
    },
    Contains {
        text: String,
        #[serde(default = "one")]
        weight: f64,
    },
    MaxChars {
        max: usize,
        #[serde(default = "one")]
        weight: f64,
    },
}

fn one() -> f64 {
    1.0
}

impl ValidationCheck {
    pub fn weight(&self) -> f64 {
        match self {
            ValidationCheck::JsonSchema { weight, .. }
            | ValidationCheck::Regex { weight, .. }
            | ValidationCheck::Contains { weight, .. }
            | ValidationCheck::MaxChars { weight, .. } => *weight,
        }
    }
}

/// A pre-execution checkpoint: fires before the request runs when its conditions hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    pub name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_contains: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_attempt: Option<u32>,
    #[serde(default = "yes")]
    pub requires_confirmation: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

fn yes() -> bool {
    true
}

/// The deepest nesting of arrays and objects allowed in a free-form value of a request
/// (`metadata`, `options`, a validation `schema`, content parts) or a signal's `meta`. Results,
/// records and signals embed these values a few levels down, and every reader in the fleet
/// (serde_json, with its limit of 128) must still be able to read them.
pub const MAX_VALUE_DEPTH: usize = 64;

/// How deeply `value` nests arrays and objects (a scalar is 0, `[]` and `{}` are 1).
pub fn value_depth(value: &serde_json::Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((value, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &serde_json::Value>> = match value {
            serde_json::Value::Array(items) => Box::new(items.iter()),
            serde_json::Value::Object(map) => Box::new(map.values()),
            _ => continue,
        };
        deepest = deepest.max(depth + 1);
        stack.extend(children.map(|child| (child, depth + 1)));
    }
    deepest
}

/// An error naming `field` when `value` nests deeper than [`MAX_VALUE_DEPTH`].
pub fn check_depth(field: &str, value: &serde_json::Value) -> Result<(), WireError> {
    let depth = value_depth(value);
    if depth > MAX_VALUE_DEPTH {
        return Err(WireError::invalid(format!(
            "{field} is nested {depth} levels deep; at most {MAX_VALUE_DEPTH} are allowed"
        )));
    }
    Ok(())
}

/// How deeply a map nests, counting the map itself.
fn map_depth(map: &serde_json::Map<String, serde_json::Value>) -> usize {
    1 + map.values().map(value_depth).max().unwrap_or(0)
}

/// Caller tools a request may carry by default (OpenAI's own bound on `tools`).
pub const MAX_CALLER_TOOLS: usize = 128;
/// The caller tools' definitions together, as JSON, by default.
pub const MAX_CALLER_TOOLS_BYTES: usize = 64 * 1024;

/// The bounds a request is checked against on acceptance.
#[derive(Debug, Clone)]
pub struct RequestLimits {
    pub max_metadata_bytes: usize,
    pub max_tool_iterations: u32,
    pub max_job_name_len: usize,
    /// Caller tools (`caller_tools`) a request may carry.
    pub max_caller_tools: usize,
    /// The caller tools' definitions together, as JSON, in bytes: they go into every turn's
    /// prompt.
    pub max_caller_tools_bytes: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_metadata_bytes: 4096,
            max_tool_iterations: 64,
            max_job_name_len: 256,
            max_caller_tools: MAX_CALLER_TOOLS,
            max_caller_tools_bytes: MAX_CALLER_TOOLS_BYTES,
        }
    }
}

impl GenerationRequest {
    /// Whether the request asks the backend for structured output (a JSON schema, JSON mode,
    /// a grammar, a regular expression or a choice, in any server's option for it): a turn of
    /// it is taken again from its start, never continued from a cut (a grammar cannot be
    /// picked up from a prefix on every server).
    pub fn structured_output(&self) -> bool {
        const FORMAT_OPTIONS: [&str; 8] = [
            "guided_json",
            "guided_grammar",
            "guided_regex",
            "guided_choice",
            "guided_decoding",
            "grammar",
            "json_schema",
            "format",
        ];
        if FORMAT_OPTIONS
            .iter()
            .any(|key| self.options.contains_key(*key))
        {
            return true;
        }
        match self.options.get("response_format") {
            None | Some(serde_json::Value::Null) => false,
            Some(format) => format.get("type").and_then(|t| t.as_str()) != Some("text"),
        }
    }

    /// The priority band, `normal` when absent.
    pub fn band(&self) -> super::schedule::Priority {
        self.priority.unwrap_or_default()
    }

    /// A request with one user message, for examples and tests.
    pub fn user(text: impl Into<String>) -> Self {
        GenerationRequest {
            messages: vec![Message::user(text)],
            ..Default::default()
        }
    }

    /// Checks everything that can be checked without the worker's tool registry. The error
    /// names the offending field so a caller can fix it without reading the source.
    pub fn validate(&self, limits: &RequestLimits) -> Result<(), WireError> {
        if let Some(id) = &self.request_id
            && !is_valid_request_id(id)
        {
            return Err(WireError::invalid(
                "request_id must be 1-128 characters of A-Z, a-z, 0-9, '_' or '-'",
            ));
        }
        if let Some(job) = &self.job_name
            && (job.len() > limits.max_job_name_len || job.chars().any(char::is_control))
        {
            return Err(WireError::invalid(format!(
                "job_name must be at most {} bytes without control characters",
                limits.max_job_name_len
            )));
        }
        if let Some(key) = &self.affinity_key
            && (key.is_empty()
                || key.len() > MAX_AFFINITY_KEY_LEN
                || key.chars().any(char::is_control))
        {
            return Err(WireError::invalid(format!(
                "affinity_key must be 1-{MAX_AFFINITY_KEY_LEN} bytes without control characters"
            )));
        }
        if self.messages.is_empty() {
            return Err(WireError::invalid(
                "messages must hold at least one message",
            ));
        }
        for (i, message) in self.messages.iter().enumerate() {
            validate_message(i, message)?;
        }
        for (field, map) in [("metadata", &self.metadata), ("options", &self.options)] {
            let depth = map_depth(map);
            if depth > MAX_VALUE_DEPTH {
                return Err(WireError::invalid(format!(
                    "{field} is nested {depth} levels deep; at most {MAX_VALUE_DEPTH} are allowed"
                )));
            }
        }
        let mut seen = std::collections::HashSet::new();
        for tool in &self.tools {
            if !is_valid_name(tool) {
                return Err(WireError::invalid(format!(
                    "tools: {tool:?} is not a tool name (1-{MAX_NAME_LEN} characters of A-Z, a-z, 0-9, '_' or '-')"
                )));
            }
            if !seen.insert(tool.as_str()) {
                return Err(WireError::invalid(format!(
                    "tools: {tool:?} is listed twice"
                )));
            }
        }
        self.validate_caller_tools(limits)?;
        if let Some(n) = self.tool_iterations
            && n > limits.max_tool_iterations
        {
            return Err(WireError::invalid(format!(
                "tool_iterations must be at most {}",
                limits.max_tool_iterations
            )));
        }
        if self.max_tokens == Some(0) {
            return Err(WireError::invalid("max_tokens must be at least 1"));
        }
        if let Some(t) = self.temperature
            && !(0.0..=2.0).contains(&t)
        {
            return Err(WireError::invalid("temperature must be between 0 and 2"));
        }
        if let Some(model) = &self.model
            && (model.is_empty() || model.len() > 256)
        {
            return Err(WireError::invalid("model must be 1-256 bytes"));
        }
        let reserved: Vec<&str> = RESERVED_OPTION_KEYS
            .iter()
            .copied()
            .filter(|k| self.options.contains_key(*k))
            .collect();
        if !reserved.is_empty() {
            return Err(WireError::invalid(format!(
                "options may not set {}: the worker sets them (use the request's own fields)",
                reserved.join(", ")
            ))
            .with_detail(serde_json::json!({ "fields": reserved })));
        }
        if self.deadline_ms == Some(0) {
            return Err(WireError::invalid("deadline_ms must be at least 1"));
        }
        let metadata_bytes = serde_json::to_vec(&self.metadata).map_or(usize::MAX, |v| v.len());
        if metadata_bytes > limits.max_metadata_bytes {
            return Err(WireError::invalid(format!(
                "metadata is {metadata_bytes} bytes as JSON; at most {} are allowed",
                limits.max_metadata_bytes
            )));
        }
        if let Some(t) = self.escalation_threshold
            && !(0.0..=1.0).contains(&t)
        {
            return Err(WireError::invalid(
                "escalation_threshold must be between 0 and 1",
            ));
        }
        for (i, check) in self.validation.iter().enumerate() {
            validate_check(i, check)?;
        }
        for (i, checkpoint) in self.checkpoints.iter().enumerate() {
            if !is_valid_name(&checkpoint.name) {
                return Err(WireError::invalid(format!(
                    "checkpoints[{i}].name must be 1-{MAX_NAME_LEN} characters of A-Z, a-z, 0-9, '_' or '-'"
                )));
            }
        }
        Ok(())
    }
}

impl GenerationRequest {
    /// The caller's own tools: each a function with a valid name no other tool of the request
    /// has, and a JSON Schema of its arguments that compiles; bounded in number and size. The
    /// names of the control tools are checked by the engine, which owns them.
    fn validate_caller_tools(&self, limits: &RequestLimits) -> Result<(), WireError> {
        if self.caller_tools.is_empty() {
            return Ok(());
        }
        if self.caller_tools.len() > limits.max_caller_tools {
            return Err(WireError::invalid(format!(
                "caller_tools holds {} tools; at most {} are allowed",
                self.caller_tools.len(),
                limits.max_caller_tools
            )));
        }
        let bytes = serde_json::to_vec(&self.caller_tools).map_or(usize::MAX, |v| v.len());
        if bytes > limits.max_caller_tools_bytes {
            return Err(WireError::invalid(format!(
                "caller_tools is {bytes} bytes as JSON; at most {} are allowed",
                limits.max_caller_tools_bytes
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, tool) in self.caller_tools.iter().enumerate() {
            if tool.kind != "function" {
                return Err(WireError::invalid(format!(
                    "caller_tools[{i}].type must be \"function\", not {:?}",
                    tool.kind
                )));
            }
            let name = &tool.function.name;
            if !is_valid_name(name) {
                return Err(WireError::invalid(format!(
                    "caller_tools[{i}].function.name: {name:?} is not a tool name (1-{MAX_NAME_LEN} characters of A-Z, a-z, 0-9, '_' or '-')"
                )));
            }
            if !seen.insert(name.as_str()) {
                return Err(WireError::invalid(format!(
                    "caller_tools[{i}].function.name: {name:?} is defined twice"
                )));
            }
            if self.tools.contains(name) {
                return Err(WireError::invalid(format!(
                    "caller_tools[{i}].function.name: {name:?} is also a bus tool in tools; a name means one tool"
                )));
            }
            if let Some(parameters) = &tool.function.parameters {
                let field = format!("caller_tools[{i}].function.parameters");
                if !parameters.is_object() {
                    return Err(WireError::invalid(format!(
                        "{field} must be a JSON Schema object"
                    )));
                }
                check_depth(&field, parameters)?;
                jsonschema::validator_for(parameters)
                    .map_err(|e| WireError::invalid(format!("{field}: {e}")))?;
            }
        }
        Ok(())
    }
}

fn validate_message(i: usize, message: &Message) -> Result<(), WireError> {
    if let Some(super::message::Content::Parts(parts)) = &message.content {
        for (j, part) in parts.iter().enumerate() {
            check_depth(&format!("messages[{i}].content[{j}]"), part)?;
        }
    }
    let has_text = message.content.as_ref().is_some_and(|c| !c.is_empty());
    match message.role {
        Role::System | Role::User if message.content.is_none() => Err(WireError::invalid(format!(
            "messages[{i}]: a {} message needs content",
            message.role.as_str()
        ))),
        Role::Tool if message.tool_call_id.is_none() => Err(WireError::invalid(format!(
            "messages[{i}]: a tool message needs tool_call_id"
        ))),
        Role::Assistant if !has_text && message.tool_calls.is_empty() => Err(WireError::invalid(
            format!("messages[{i}]: an assistant message needs content or tool_calls"),
        )),
        _ if !message.tool_calls.is_empty() && message.role != Role::Assistant => {
            Err(WireError::invalid(format!(
                "messages[{i}]: only assistant messages carry tool_calls"
            )))
        }
        _ => Ok(()),
    }
}

fn validate_check(i: usize, check: &ValidationCheck) -> Result<(), WireError> {
    let weight = check.weight();
    if !(weight.is_finite() && weight > 0.0) {
        return Err(WireError::invalid(format!(
            "validation[{i}].weight must be a positive number"
        )));
    }
    match check {
        ValidationCheck::Regex { pattern, .. } => regex::Regex::new(pattern)
            .map(|_| ())
            .map_err(|e| WireError::invalid(format!("validation[{i}].pattern: {e}"))),
        ValidationCheck::JsonSchema { schema, .. } => {
            check_depth(&format!("validation[{i}].schema"), schema)?;
            jsonschema::validator_for(schema)
                .map(|_| ())
                .map_err(|e| WireError::invalid(format!("validation[{i}].schema: {e}")))
        }
        ValidationCheck::Contains { text, .. } if text.is_empty() => Err(WireError::invalid(
            format!("validation[{i}].text must not be empty"),
        )),
        ValidationCheck::MaxChars { max: 0, .. } => Err(WireError::invalid(format!(
            "validation[{i}].max must be at least 1"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(body: serde_json::Value) -> Result<GenerationRequest, String> {
        let request: GenerationRequest =
            serde_json::from_value(body).map_err(|e| format!("decode: {e}"))?;
        request
            .validate(&RequestLimits::default())
            .map_err(|e| e.message)?;
        Ok(request)
    }

    #[test]
    fn caller_tools_are_checked_field_by_field() {
        let user = json!([{"role": "user", "content": "x"}]);
        let f = |name: &str| json!({"type": "function", "function": {"name": name}});
        let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let ok = json!({"messages": user, "tools": ["add"], "caller_tools": [
            f("get_time"),
            {"function": {"name": "weather", "description": "Any text, however long or worded.", "parameters": schema, "strict": true}},
        ]});
        let request = check(ok).unwrap();
        assert_eq!(request.caller_tools[1].kind, "function", "type defaults");
        let too_many: Vec<_> = (0..=MAX_CALLER_TOOLS)
            .map(|i| f(&format!("t{i}")))
            .collect();
        let huge = json!({"name": "big", "description": "d".repeat(MAX_CALLER_TOOLS_BYTES)});
        let cases = [
            (
                json!([f("ok"), f("bad name")]),
                "caller_tools[1].function.name",
            ),
            (json!([f(&"x".repeat(65))]), "caller_tools[0].function.name"),
            (
                json!([f("t"), f("t")]),
                "caller_tools[1].function.name: \"t\" is defined twice",
            ),
            (json!([f("add")]), "is also a bus tool"),
            (
                json!([{"type": "custom", "function": {"name": "t"}}]),
                "caller_tools[0].type",
            ),
            (
                json!([{"function": {"name": "t", "parameters": [1]}}]),
                "caller_tools[0].function.parameters must be",
            ),
            (
                json!([{"function": {"name": "t", "parameters": {"type": "nope"}}}]),
                "caller_tools[0].function.parameters:",
            ),
            (
                json!([{"function": {"name": "t", "parameters": {"k": nested(MAX_VALUE_DEPTH)}}}]),
                "nested",
            ),
            (json!(too_many), "at most 128"),
            (json!([{"function": huge}]), "bytes as JSON"),
        ];
        for (tools, needle) in cases {
            let err = check(json!({"messages": user, "tools": ["add"], "caller_tools": tools}))
                .unwrap_err();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        // Unknown keys are refused when decoding, like everywhere in a request.
        let err =
            check(json!({"messages": user, "caller_tools": [{"function": {"name": "t", "x": 1}}]}))
                .unwrap_err();
        assert!(err.starts_with("decode"), "{err}");
    }

    #[test]
    fn a_continuation_answering_tool_calls_is_accepted() {
        check(json!({"messages": [
            {"role": "user", "content": "time in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{\"city\":\"Paris\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}
        ], "caller_tools": [{"type": "function", "function": {"name": "get_time"}}]}))
        .unwrap();
    }

    /// A value nesting `depth` levels of arrays.
    fn nested(depth: usize) -> serde_json::Value {
        let mut value = json!(1);
        for _ in 0..depth {
            value = json!([value]);
        }
        value
    }

    #[test]
    fn free_form_values_nest_at_most_max_value_depth() {
        assert_eq!(value_depth(&json!(1)), 0);
        assert_eq!(value_depth(&json!({"a": [1, {"b": []}], "c": {}})), 4);
        assert_eq!(value_depth(&nested(MAX_VALUE_DEPTH)), MAX_VALUE_DEPTH);
        let user = json!([{"role": "user", "content": "x"}]);
        // The map counts as a level: its values may nest one less.
        let fits = nested(MAX_VALUE_DEPTH - 1);
        let over = nested(MAX_VALUE_DEPTH);
        for field in ["metadata", "options"] {
            check(json!({"messages": user, field: {"k": fits}})).unwrap();
            let err = check(json!({"messages": user, field: {"k": over}})).unwrap_err();
            assert!(
                err.starts_with(&format!("{field} is nested 65 levels")),
                "{err}"
            );
        }
        let parts = |part| json!([{"role": "user", "content": [part]}]);
        check(json!({"messages": parts(nested(MAX_VALUE_DEPTH))})).unwrap();
        let err = check(json!({"messages": parts(nested(MAX_VALUE_DEPTH + 1))})).unwrap_err();
        assert!(err.starts_with("messages[0].content[0] is nested"), "{err}");
        let schema = |schema| json!([{"kind": "json_schema", "schema": {"enum": [schema]}}]);
        check(json!({"messages": user, "validation": schema(nested(MAX_VALUE_DEPTH - 2))}))
            .unwrap();
        let err = check(json!({"messages": user, "validation": schema(nested(MAX_VALUE_DEPTH))}))
            .unwrap_err();
        assert!(err.starts_with("validation[0].schema is nested"), "{err}");
    }

    #[test]
    fn accepts_the_contract_example() {
        let request = check(json!({
            "request_id": "01J0ABC",
            "job_name": "label",
            "system": "be brief",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": ["add"],
            "tool_iterations": 4,
            "max_tokens": 1024,
            "temperature": 0.2,
            "model": "m",
            "options": {"top_p": 0.9, "stop": ["x"], "seed": 7, "response_format": {}, "tool_choice": "auto"},
            "deadline_ms": 120000,
            "stop_on_decision_request": true,
            "metadata": {"k": "v"},
            "validation": [{"kind": "contains", "text": "x", "weight": 1.0}],
            "escalation_threshold": 0.6,
            "checkpoints": [{"name": "deploy", "prompt_contains": ["prod"], "requires_confirmation": true}]
        }))
        .unwrap();
        assert_eq!(request.tools, vec!["add"]);
        assert!(request.checkpoints[0].requires_confirmation);
    }

    #[test]
    fn rejects_bad_requests_with_a_reason_naming_the_field() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (
                json!({"messages": user, "tool_iteration": 3}),
                "tool_iteration",
            ),
            (json!({"messages": []}), "messages"),
            (json!({}), "messages"),
            (json!({"messages": user, "request_id": "a.b"}), "request_id"),
            (json!({"messages": user, "tools": ["a b"]}), "tools"),
            (json!({"messages": user, "tools": ["a", "a"]}), "twice"),
            (
                json!({"messages": user, "tool_iterations": 1000}),
                "tool_iterations",
            ),
            (json!({"messages": user, "max_tokens": 0}), "max_tokens"),
            (json!({"messages": user, "temperature": 3.0}), "temperature"),
            (
                json!({"messages": user, "options": {"stream": true}}),
                "stream",
            ),
            (
                json!({"messages": user, "options": {"model": "x"}}),
                "model",
            ),
            (json!({"messages": user, "deadline_ms": 0}), "deadline_ms"),
            (
                json!({"messages": user, "metadata": {"k": "x".repeat(5000)}}),
                "metadata",
            ),
            (
                json!({"messages": user, "escalation_threshold": 2}),
                "escalation_threshold",
            ),
            (
                json!({"messages": user, "validation": [{"kind": "regex", "pattern": "("}]}),
                "pattern",
            ),
            (
                json!({"messages": user, "validation": [{"kind": "bogus"}]}),
                "bogus",
            ),
            (
                json!({"messages": user, "validation": [{"kind": "contains", "text": "x", "weight": 0}]}),
                "weight",
            ),
            (json!({"messages": [{"role": "user"}]}), "content"),
            (
                json!({"messages": [{"role": "tool", "content": "x"}]}),
                "tool_call_id",
            ),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "wizard",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x", "extra": 1}]}),
                "extra",
            ),
            (
                json!({"messages": user, "checkpoints": [{"name": "a b"}]}),
                "checkpoints",
            ),
            (json!({"messages": user, "job_name": "a\u{0}b"}), "job_name"),
            (
                json!({"messages": user, "affinity_key": ""}),
                "affinity_key",
            ),
            (
                json!({"messages": user, "affinity_key": "k".repeat(257)}),
                "affinity_key",
            ),
            (
                json!({"messages": user, "affinity_key": "a\nb"}),
                "affinity_key",
            ),
        ];
        for (body, needle) in cases {
            let err = check(body.clone()).expect_err(&body.to_string());
            assert!(
                err.contains(needle),
                "{body}: {err:?} should mention {needle}"
            );
        }
    }

    #[test]
    fn content_parts_are_read_as_text() {
        let request = check(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "one"}, {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "two"}]}]}))
        .unwrap();
        assert_eq!(request.messages[0].text(), "one\ntwo");
    }
}
