//! OpenAI's Responses API as the gateway reads and writes it: the body of
//! `POST /v1/responses` (read strictly: a field the gateway would drop is an error naming it),
//! its input items turned into chat messages, and the response object with its output items.
//!
//! A Responses request runs as a chat request does: its `instructions` become the first
//! system message, its input items the messages after the stored conversation of its
//! `previous_response_id`, its function tools the caller's tools. The tables are in
//! docs/gateway.md ("The Responses API").

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::gateway::mapping::Ending;
use crate::gateway::openai::{BadField, ChatRequest, GenfleetFields};
use crate::protocol::ToolCall;
use crate::protocol::ids::new_id;

/// The body of `POST /v1/responses`. `input` and `tools` stay JSON here: each item is read on
/// its own so that an error names `input[i]` or `tools[i]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponsesRequest {
    pub model: String,
    #[serde(default)]
    pub input: Option<Value>,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub background: Option<bool>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub text: Option<TextConfig>,
    #[serde(default)]
    pub reasoning: Option<ReasoningConfig>,
    /// genfleet's own fields, as on chat completions (`extra_body={"genfleet": {...}}`).
    #[serde(default)]
    pub genfleet: Option<GenfleetFields>,
    // Refused with a 400 naming them: the gateway has no Conversations or Prompts API.
    #[serde(default)]
    pub conversation: Option<Value>,
    #[serde(default)]
    pub prompt: Option<Value>,
    // Read and ignored: they say nothing to a fleet (docs/gateway.md).
    #[serde(default)]
    pub include: Option<Value>,
    #[serde(default)]
    pub truncation: Option<Value>,
    #[serde(default)]
    pub service_tier: Option<Value>,
    #[serde(default)]
    pub prompt_cache_key: Option<Value>,
    #[serde(default)]
    pub prompt_cache_retention: Option<Value>,
    #[serde(default)]
    pub prompt_cache_options: Option<Value>,
    #[serde(default)]
    pub safety_identifier: Option<Value>,
    #[serde(default)]
    pub context_management: Option<Value>,
    #[serde(default)]
    pub max_tool_calls: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextConfig {
    #[serde(default)]
    pub format: Option<Value>,
    #[serde(default)]
    pub verbosity: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReasoningConfig {
    #[serde(default)]
    pub effort: Option<Value>,
    #[serde(default)]
    pub summary: Option<Value>,
    #[serde(default)]
    pub generate_summary: Option<Value>,
}

/// Reads a body, naming the field of the first error (`input`, `genfleet.durable`).
pub fn parse(body: &[u8]) -> Result<ResponsesRequest, BadField> {
    crate::gateway::openai::read_strictly(body, "a Responses API request")
}

/// A Responses request read into what the fleet runs, and what its response echoes.
pub struct Prepared {
    /// The chat request it runs as (its messages: instructions, the stored conversation, the
    /// input).
    pub chat: ChatRequest,
    /// This response's input items, each with an id.
    pub input_items: Vec<Value>,
    /// The chat messages of the input (after the stored conversation).
    pub input_messages: Vec<Value>,
    /// What the response object echoes of the request.
    pub echo: Echo,
    pub store: bool,
    pub background: bool,
}

/// The request's fields a response object carries back.
#[derive(Debug, Clone)]
pub struct Echo {
    pub model: String,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub metadata: Map<String, Value>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub tool_choice: Value,
    pub tools: Vec<Value>,
    pub text: Value,
    pub reasoning: Value,
    pub user: Option<String>,
}

/// Reads the request's input, tools and options into a chat request whose messages start with
/// `history` (the stored conversation of its `previous_response_id`).
pub fn prepare(request: ResponsesRequest, history: &[Value]) -> Result<Prepared, BadField> {
    if request.conversation.is_some() {
        return Err(BadField::new(
            "conversation",
            "conversation: the gateway has no Conversations API; continue a conversation with \
             previous_response_id",
        ));
    }
    if request.prompt.is_some() {
        return Err(BadField::new(
            "prompt",
            "prompt: the gateway has no stored prompts; send instructions and input",
        ));
    }
    let store = request.store.unwrap_or(true);
    let background = request.background.unwrap_or(false);
    if background && !store {
        return Err(BadField::new(
            "background",
            "background: a background response must be stored (store cannot be false)",
        ));
    }
    if background && request.stream == Some(true) {
        return Err(BadField::new(
            "stream",
            "stream: a background response is polled (GET /v1/responses/{id}), not streamed",
        ));
    }
    let (input_items, input_messages) = match request.input {
        None => return Err(BadField::new("input", "input: required")),
        Some(Value::String(text)) => {
            let item = json!({"type": "message", "id": item_id("msg"), "role": "user",
                              "content": [{"type": "input_text", "text": text}]});
            (vec![item], vec![json!({"role": "user", "content": text})])
        }
        Some(Value::Array(items)) => read_items(items)?,
        Some(_) => {
            return Err(BadField::new(
                "input",
                "input must be a string or a list of items",
            ));
        }
    };
    if input_messages.is_empty() && history.is_empty() {
        return Err(BadField::new("input", "input: has no message"));
    }
    let mut tools = Vec::new();
    for (i, tool) in request.tools.iter().flatten().enumerate() {
        tools.push(read_tool(i, tool)?);
    }
    let tool_choice = match &request.tool_choice {
        None => None,
        Some(choice) => Some(read_tool_choice(choice)?),
    };
    let response_format = match request.text.as_ref().and_then(|t| t.format.as_ref()) {
        None => None,
        Some(format) => read_format(format)?,
    };
    let mut messages = Vec::with_capacity(history.len() + input_messages.len() + 1);
    if let Some(instructions) = &request.instructions {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    messages.extend(history.iter().cloned());
    messages.extend(input_messages.iter().cloned());
    let echo = Echo {
        model: request.model.clone(),
        instructions: request.instructions.clone(),
        max_output_tokens: request.max_output_tokens,
        metadata: request.metadata.clone().unwrap_or_default(),
        parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
        previous_response_id: request.previous_response_id.clone(),
        temperature: request.temperature,
        top_p: request.top_p,
        tool_choice: request.tool_choice.clone().unwrap_or_else(|| "auto".into()),
        tools: request.tools.clone().unwrap_or_default(),
        text: json!({"format": request.text.as_ref().and_then(|t| t.format.clone())
            .unwrap_or_else(|| json!({"type": "text"}))}),
        reasoning: json!({
            "effort": request.reasoning.as_ref().and_then(|r| r.effort.clone()),
            "summary": request.reasoning.as_ref().and_then(|r| r.summary.clone()),
        }),
        user: request.user.clone(),
    };
    let chat = ChatRequest {
        model: request.model,
        messages,
        stream: request.stream,
        stream_options: None,
        max_tokens: None,
        max_completion_tokens: request.max_output_tokens,
        temperature: request.temperature,
        n: None,
        stop: None,
        user: request.user,
        tools: (!tools.is_empty()).then_some(tools),
        metadata: request.metadata,
        genfleet: request.genfleet,
        top_p: request.top_p.map(Value::from),
        seed: None,
        presence_penalty: None,
        frequency_penalty: None,
        logit_bias: None,
        logprobs: request.top_logprobs.map(|_| Value::Bool(true)),
        top_logprobs: request.top_logprobs.map(Value::from),
        response_format,
        tool_choice,
        parallel_tool_calls: request.parallel_tool_calls.map(Value::Bool),
        reasoning_effort: request.reasoning.and_then(|r| r.effort),
        top_k: None,
        min_p: None,
        repetition_penalty: None,
        store: None,
        service_tier: None,
        modalities: None,
        prediction: None,
    };
    Ok(Prepared {
        chat,
        input_items,
        input_messages,
        echo,
        store,
        background,
    })
}

/// A fresh id for an item: `msg_`, `fc_`, `rs_` and a ULID.
pub fn item_id(prefix: &str) -> String {
    format!("{prefix}_{}", new_id())
}

/// Reads the input items into (the items with their ids, the chat messages they make).
fn read_items(items: Vec<Value>) -> Result<(Vec<Value>, Vec<Value>), BadField> {
    let mut kept = Vec::with_capacity(items.len());
    let mut messages: Vec<Value> = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("input[{i}]");
        let Value::Object(mut item) = item else {
            return Err(BadField::new(&at, format!("{at} must be an object")));
        };
        let kind = match item.get("type") {
            None if item.contains_key("role") => "message".to_string(),
            Some(Value::String(kind)) => kind.clone(),
            _ => {
                return Err(BadField::new(
                    format!("{at}.type"),
                    format!(
                        "{at}.type: required (message, function_call, function_call_output or reasoning)"
                    ),
                ));
            }
        };
        match kind.as_str() {
            "message" => {
                let message = read_message(&at, &item)?;
                item.entry("id").or_insert_with(|| item_id("msg").into());
                item.insert("type".into(), "message".into());
                messages.push(message);
            }
            "function_call" => {
                allow_keys(
                    &at,
                    &item,
                    &["type", "id", "call_id", "name", "arguments", "status"],
                )?;
                let call_id = string_field(&at, &item, "call_id")?;
                let name = string_field(&at, &item, "name")?;
                let arguments = string_field(&at, &item, "arguments")?;
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}});
                // The calls of one turn are one assistant message, with its text if any.
                match messages.last_mut() {
                    Some(Value::Object(last))
                        if last.get("role").and_then(Value::as_str) == Some("assistant") =>
                    {
                        let calls = last.entry("tool_calls").or_insert_with(|| json!([]));
                        if let Value::Array(calls) = calls {
                            calls.push(call);
                        }
                    }
                    _ => messages.push(json!({"role": "assistant", "content": null,
                                              "tool_calls": [call]})),
                }
                item.entry("id").or_insert_with(|| item_id("fc").into());
            }
            "function_call_output" => {
                allow_keys(&at, &item, &["type", "id", "call_id", "output", "status"])?;
                let call_id = string_field(&at, &item, "call_id")?;
                let output = match item.get("output") {
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(parts)) => text_of_parts(&format!("{at}.output"), parts)?,
                    _ => {
                        return Err(BadField::new(
                            format!("{at}.output"),
                            format!("{at}.output: required, a string or a list of text parts"),
                        ));
                    }
                };
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
                item.entry("id").or_insert_with(|| item_id("fco").into());
            }
            // A reasoning model's output echoed back: its reasoning is output, not input.
            "reasoning" => {
                item.entry("id").or_insert_with(|| item_id("rs").into());
            }
            other => {
                return Err(BadField::new(
                    format!("{at}.type"),
                    format!(
                        "{at}.type: {:?} is not served (message, function_call, \
                         function_call_output and reasoning are)",
                        crate::protocol::text::one_line(other)
                    ),
                ));
            }
        }
        kept.push(Value::Object(item));
    }
    Ok((kept, messages))
}

/// A message item as a chat message.
fn read_message(at: &str, item: &Map<String, Value>) -> Result<Value, BadField> {
    allow_keys(at, item, &["type", "id", "role", "content", "status"])?;
    let role = match item.get("role").and_then(Value::as_str) {
        Some(role @ ("user" | "assistant" | "system")) => role,
        Some("developer") => "system",
        _ => {
            return Err(BadField::new(
                format!("{at}.role"),
                format!("{at}.role: must be user, assistant, system or developer"),
            ));
        }
    };
    let content = match item.get("content") {
        Some(Value::String(text)) => Value::from(text.as_str()),
        Some(Value::Array(parts)) => read_parts(&format!("{at}.content"), parts)?,
        _ => {
            return Err(BadField::new(
                format!("{at}.content"),
                format!("{at}.content: required, a string or a list of content parts"),
            ));
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// Content parts as chat content: the text when every part is text, else chat's parts.
fn read_parts(at: &str, parts: &[Value]) -> Result<Value, BadField> {
    let mut chat_parts = Vec::with_capacity(parts.len());
    let mut all_text = true;
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{at}[{j}]");
        let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "input_text" | "output_text" | "text" | "refusal" => {
                let key = if kind == "refusal" { "refusal" } else { "text" };
                let Some(text) = part.get(key).and_then(Value::as_str) else {
                    return Err(BadField::new(
                        format!("{at}.{key}"),
                        format!("{at}.{key}: required, a string"),
                    ));
                };
                chat_parts.push(json!({"type": "text", "text": text}));
            }
            "input_image" => {
                all_text = false;
                let Some(url) = part.get("image_url").and_then(Value::as_str) else {
                    return Err(BadField::new(
                        format!("{at}.image_url"),
                        format!(
                            "{at}.image_url: required (a URL or a data URL; file_id is not served)"
                        ),
                    ));
                };
                let mut image = json!({"url": url});
                if let Some(detail) = part.get("detail") {
                    image["detail"] = detail.clone();
                }
                chat_parts.push(json!({"type": "image_url", "image_url": image}));
            }
            other => {
                return Err(BadField::new(
                    format!("{at}.type"),
                    format!(
                        "{at}.type: {:?} is not served (input_text, output_text and \
                         input_image are)",
                        crate::protocol::text::one_line(other)
                    ),
                ));
            }
        }
    }
    if all_text {
        let text: Vec<&str> = chat_parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect();
        return Ok(Value::from(text.join("\n")));
    }
    Ok(Value::Array(chat_parts))
}

/// The text of a function call output given as parts.
fn text_of_parts(at: &str, parts: &[Value]) -> Result<String, BadField> {
    match read_parts(at, parts)? {
        Value::String(text) => Ok(text),
        _ => Err(BadField::new(
            at,
            format!("{at}: only text parts are served in a function call's output"),
        )),
    }
}

fn allow_keys(at: &str, item: &Map<String, Value>, allowed: &[&str]) -> Result<(), BadField> {
    match item.keys().find(|k| !allowed.contains(&k.as_str())) {
        None => Ok(()),
        Some(key) => Err(BadField::new(
            format!("{at}.{key}"),
            format!(
                "{at}.{key}: unknown field (expected one of {})",
                allowed.join(", ")
            ),
        )),
    }
}

fn string_field(at: &str, item: &Map<String, Value>, key: &str) -> Result<String, BadField> {
    item.get(key)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| {
            BadField::new(
                format!("{at}.{key}"),
                format!("{at}.{key}: required, a string"),
            )
        })
}

/// A Responses function tool (`{"type": "function", "name", "parameters", ...}`) as a chat
/// tool.
fn read_tool(i: usize, tool: &Value) -> Result<crate::protocol::FunctionTool, BadField> {
    let at = format!("tools[{i}]");
    let Value::Object(map) = tool else {
        return Err(BadField::new(&at, format!("{at} must be an object")));
    };
    match map.get("type").and_then(Value::as_str) {
        Some("function") => {}
        other => {
            return Err(BadField::new(
                format!("{at}.type"),
                format!(
                    "{at}.type: {:?} is not served: the gateway serves function tools (the \
                     caller runs them) and the fleet's bus tools (genfleet.tools)",
                    other
                        .map(crate::protocol::text::one_line)
                        .unwrap_or_default()
                ),
            ));
        }
    }
    allow_keys(
        &at,
        map,
        &["type", "name", "description", "parameters", "strict"],
    )?;
    let mut function = map.clone();
    function.remove("type");
    let function = Value::Object(function);
    serde_json::from_value::<crate::protocol::FunctionDefinition>(function)
        .map(|function| crate::protocol::FunctionTool {
            kind: "function".into(),
            function,
        })
        .map_err(|error| BadField::new(&at, format!("{at}: {error}")))
}

/// `tool_choice` as chat completions write it.
fn read_tool_choice(choice: &Value) -> Result<Value, BadField> {
    match choice {
        Value::String(mode) if matches!(mode.as_str(), "auto" | "none" | "required") => {
            Ok(choice.clone())
        }
        Value::Object(map)
            if map.get("type").and_then(Value::as_str) == Some("function")
                && map.get("name").and_then(Value::as_str).is_some() =>
        {
            Ok(json!({"type": "function", "function": {"name": map["name"]}}))
        }
        _ => Err(BadField::new(
            "tool_choice",
            "tool_choice: must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

/// `text.format` as chat completions' `response_format` (`None` for plain text).
fn read_format(format: &Value) -> Result<Option<Value>, BadField> {
    let bad = |message: &str| BadField::new("text.format", format!("text.format: {message}"));
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let Some(schema) = format.get("schema") else {
                return Err(bad("a json_schema format needs its schema"));
            };
            let mut json_schema = json!({
                "name": format.get("name").cloned().unwrap_or_else(|| "response".into()),
                "schema": schema,
            });
            for key in ["strict", "description"] {
                if let Some(value) = format.get(key) {
                    json_schema[key] = value.clone();
                }
            }
            Ok(Some(
                json!({"type": "json_schema", "json_schema": json_schema}),
            ))
        }
        _ => Err(bad("type must be text, json_object or json_schema")),
    }
}

/// What a response produced.
#[derive(Debug, Default, Clone)]
pub struct Produced {
    pub reasoning: String,
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
}

/// The ids of a response's output items, chosen when each is first shown.
#[derive(Debug, Clone)]
pub struct ItemIds {
    pub reasoning: String,
    pub message: String,
    pub calls: Vec<String>,
}

impl ItemIds {
    pub fn new() -> ItemIds {
        ItemIds {
            reasoning: item_id("rs"),
            message: item_id("msg"),
            calls: Vec::new(),
        }
    }

    /// The id of the `i`th function call item.
    pub fn call(&mut self, i: usize) -> String {
        while self.calls.len() <= i {
            self.calls.push(item_id("fc"));
        }
        self.calls[i].clone()
    }
}

impl Default for ItemIds {
    fn default() -> Self {
        ItemIds::new()
    }
}

pub fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

pub fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [output_text(text)]})
}

pub fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

pub fn function_call_item(id: &str, call: &ToolCall, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call.id, "name": call.function.name,
           "arguments": arguments, "status": status})
}

impl Produced {
    /// The output items, in the order they were shown: reasoning, the message, the calls.
    pub fn items(&self, ids: &mut ItemIds) -> Vec<Value> {
        let mut items = Vec::new();
        if !self.reasoning.is_empty() {
            items.push(reasoning_item(&ids.reasoning, &self.reasoning));
        }
        if !self.text.is_empty() || self.tool_calls.is_empty() {
            items.push(message_item(&ids.message, &self.text, "completed"));
        }
        for (i, call) in self.tool_calls.iter().enumerate() {
            items.push(function_call_item(
                &ids.call(i),
                call,
                &call.function.arguments,
                "completed",
            ));
        }
        items
    }

    /// The assistant's turn as a chat message, for the conversation a later response
    /// continues (`None` when it said and called nothing).
    pub fn message(&self) -> Option<Value> {
        if self.text.is_empty() && self.tool_calls.is_empty() {
            return None;
        }
        let mut message = json!({"role": "assistant",
            "content": (!self.text.is_empty()).then_some(self.text.as_str())});
        if !self.tool_calls.is_empty() {
            message["tool_calls"] =
                serde_json::to_value(&self.tool_calls).expect("calls serialize");
        }
        Some(message)
    }
}

/// How a response ended, for its object.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Not yet: `queued` or `in_progress`.
    Open(&'static str),
    Completed,
    /// Ended early: OpenAI's `incomplete_details.reason` (`max_output_tokens`, or a decision
    /// ending such as `decision_timeout`).
    Incomplete(String),
    /// An error, with its code and message.
    Failed {
        code: String,
        message: String,
    },
    Cancelled,
}

impl Outcome {
    /// The outcome of a request's (or a chain's) ending.
    pub fn of(ending: &Ending, message: String) -> Outcome {
        match ending {
            Ending::Finish("stop" | "tool_calls") => Outcome::Completed,
            Ending::Finish("length") => Outcome::Incomplete("max_output_tokens".into()),
            Ending::Finish(other) => Outcome::Incomplete((*other).into()),
            Ending::Error {
                code: "cancelled", ..
            } => Outcome::Cancelled,
            Ending::Error { code, .. } => Outcome::Failed {
                code: (*code).into(),
                message,
            },
        }
    }
}

/// OpenAI's `usage` of a response.
pub fn usage(usage: crate::protocol::result::Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

/// The response object.
#[allow(clippy::too_many_arguments)]
pub fn response_object(
    id: &str,
    created_at: u64,
    echo: &Echo,
    outcome: &Outcome,
    output: Vec<Value>,
    used: Option<Value>,
    background: bool,
    store: bool,
) -> Value {
    let mut object = json!({
        "id": id,
        "object": "response",
        "created_at": created_at,
        "status": "queued",
        "background": background,
        "error": null,
        "incomplete_details": null,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "metadata": echo.metadata,
        "model": echo.model,
        "output": [],
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": echo.previous_response_id,
        "reasoning": echo.reasoning,
        "store": store,
        "temperature": echo.temperature,
        "text": echo.text,
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": echo.top_p,
        "truncation": "disabled",
        "usage": null,
        "user": echo.user,
    });
    settle(&mut object, outcome, output, used);
    object
}

/// Sets a response object's status, error, output and usage.
pub fn settle(object: &mut Value, outcome: &Outcome, output: Vec<Value>, used: Option<Value>) {
    let (status, error, incomplete) = match outcome {
        Outcome::Open(status) => (*status, Value::Null, Value::Null),
        Outcome::Completed => ("completed", Value::Null, Value::Null),
        Outcome::Incomplete(reason) => ("incomplete", Value::Null, json!({"reason": reason})),
        Outcome::Failed { code, message } => (
            "failed",
            json!({"code": code, "message": message}),
            Value::Null,
        ),
        Outcome::Cancelled => ("cancelled", Value::Null, Value::Null),
    };
    object["status"] = status.into();
    object["error"] = error;
    object["incomplete_details"] = incomplete;
    object["output"] = Value::Array(output);
    object["usage"] = used.unwrap_or(Value::Null);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepared(body: Value) -> Result<Prepared, BadField> {
        prepare(parse(body.to_string().as_bytes())?, &[])
    }

    #[test]
    fn a_string_input_is_one_user_message_after_the_instructions() {
        let p = prepared(
            json!({"model": "m", "input": "hi", "instructions": "be brief",
                                "max_output_tokens": 7, "user": "u"}),
        )
        .unwrap();
        assert_eq!(
            p.chat.messages,
            [
                json!({"role": "system", "content": "be brief"}),
                json!({"role": "user", "content": "hi"})
            ]
        );
        assert_eq!(p.chat.max_completion_tokens, Some(7));
        assert_eq!(p.input_items.len(), 1);
        assert!(p.input_items[0]["id"].as_str().unwrap().starts_with("msg_"));
        assert!(p.store && !p.background);
    }

    #[test]
    fn items_become_messages_with_calls_joined_to_their_turn() {
        let p = prepared(json!({"model": "m", "input": [
            {"role": "developer", "content": "sys"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}}))
        .unwrap();
        let m = &p.chat.messages;
        assert_eq!(m.len(), 5, "{m:?}");
        assert_eq!(m[0], json!({"role": "system", "content": "sys"}));
        assert_eq!(m[1], json!({"role": "user", "content": "a\nb"}));
        assert_eq!(m[2]["content"], "calling");
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "c1", "content": "one"})
        );
        assert_eq!(m[4]["content"], "two");
        assert_eq!(p.input_items.len(), 8);
        assert!(p.input_items.iter().all(|i| i["id"].is_string()));
        assert_eq!(p.chat.tools.as_ref().unwrap()[0].function.name, "f");
        assert_eq!(
            p.chat.tool_choice,
            Some(json!({"type": "function", "function": {"name": "f"}}))
        );
        assert_eq!(
            p.chat.response_format.as_ref().unwrap()["json_schema"]["name"],
            "s"
        );
    }

    #[test]
    fn bad_input_names_its_field() {
        for (body, param) in [
            (json!({"input": "x"}), None),
            (json!({"model": "m"}), Some("input")),
            (json!({"model": "m", "input": 3}), Some("input")),
            (
                json!({"model": "m", "input": "x", "temprature": 1}),
                Some("temprature"),
            ),
            (
                json!({"model": "m", "input": [{"role": "robot", "content": "x"}]}),
                Some("input[0].role"),
            ),
            (
                json!({"model": "m", "input": [{"type": "message", "role": "user"}]}),
                Some("input[0].content"),
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": "x", "colour": 1}]}),
                Some("input[0].colour"),
            ),
            (
                json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}),
                Some("input[0].type"),
            ),
            (
                json!({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}),
                Some("input[0].call_id"),
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
                Some("input[0].content[0].type"),
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
                Some("tools[0].type"),
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parametres": {}}]}),
                Some("tools[0].parametres"),
            ),
            (
                json!({"model": "m", "input": "x", "tool_choice": "sometimes"}),
                Some("tool_choice"),
            ),
            (
                json!({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}),
                Some("text.format"),
            ),
            (
                json!({"model": "m", "input": "x", "background": true, "store": false}),
                Some("background"),
            ),
            (
                json!({"model": "m", "input": "x", "background": true, "stream": true}),
                Some("stream"),
            ),
            (
                json!({"model": "m", "input": "x", "conversation": "c"}),
                Some("conversation"),
            ),
            (
                json!({"model": "m", "input": "x", "genfleet": {"durabel": true}}),
                Some("genfleet.durabel"),
            ),
        ] {
            let error = match prepared(body.clone()) {
                Err(error) => error,
                Ok(_) => panic!("{body} was accepted"),
            };
            assert_eq!(error.param.as_deref(), param, "{body}: {error:?}");
            if let Some(param) = param {
                assert!(error.message.contains(param), "{body}: {error:?}");
            }
        }
    }

    #[test]
    fn output_items_and_the_turn_kept_for_the_next_response() {
        let produced = Produced {
            reasoning: "think".into(),
            text: "hello".into(),
            tool_calls: vec![ToolCall {
                id: "c1".into(),
                kind: "function".into(),
                function: crate::protocol::FunctionCall {
                    name: "f".into(),
                    arguments: "{}".into(),
                },
            }],
        };
        let mut ids = ItemIds::new();
        let items = produced.items(&mut ids);
        let kinds: Vec<_> = items.iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["reasoning", "message", "function_call"]);
        assert_eq!(items[2]["call_id"], "c1");
        assert_eq!(items[2]["id"], ids.call(0));
        let message = produced.message().unwrap();
        assert_eq!(message["content"], "hello");
        assert_eq!(message["tool_calls"][0]["function"]["name"], "f");
        assert!(Produced::default().message().is_none());
        assert_eq!(Produced::default().items(&mut ids).len(), 1);
    }
}
