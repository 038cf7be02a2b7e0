//! Chat messages in the OpenAI chat completions format, as callers send them and as the
//! backend receives them.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// Message content: a plain string, or OpenAI's array of typed parts (kept as JSON so that
/// parts genfleet does not interpret, such as images, reach the backend untouched).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<serde_json::Value>),
}

impl Content {
    /// The text a person would read: the string, or the `text` of every text part.
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Content::Text(text) => std::borrow::Cow::Borrowed(text),
            Content::Parts(parts) => {
                let mut out = String::new();
                for part in parts {
                    if let Some(text) = part.get("text").and_then(|t| t.as_str()) {
                        if !out.is_empty() {
                            out.push('\n');
                        }
                        out.push_str(text);
                    }
                }
                std::borrow::Cow::Owned(out)
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Content::Text(text) => text.len(),
            Content::Parts(parts) => parts.iter().map(|p| p.to_string().len()).sum(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A native tool call on an assistant message. `arguments` is a string holding JSON, exactly
/// as OpenAI sends it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".to_string()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCall {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

/// A tool the caller runs itself, as OpenAI's `tools` entries define it:
/// `{"type": "function", "function": {"name", "description", "parameters", "strict"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionTool {
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionDefinition,
}

/// The definition of a caller's function: its name, what it does, and the JSON Schema of its
/// arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionDefinition {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// One chat message. Unknown keys are refused: a field genfleet would silently drop is a
/// field the caller believes reached the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    fn with_text(role: Role, text: impl Into<String>) -> Self {
        Message {
            role,
            content: Some(Content::Text(text.into())),
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    pub fn system(text: impl Into<String>) -> Self {
        Self::with_text(Role::System, text)
    }

    pub fn user(text: impl Into<String>) -> Self {
        Self::with_text(Role::User, text)
    }

    pub fn assistant(text: impl Into<String>) -> Self {
        Self::with_text(Role::Assistant, text)
    }

    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        let mut message = Self::with_text(Role::Tool, content);
        message.tool_call_id = Some(tool_call_id.into());
        message
    }

    /// The message's readable text ("" when it has none).
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        match &self.content {
            Some(content) => content.text(),
            None => std::borrow::Cow::Borrowed(""),
        }
    }

    /// Bytes this message holds, for size limits.
    pub fn size(&self) -> usize {
        self.content.as_ref().map_or(0, Content::len)
            + self
                .tool_calls
                .iter()
                .map(|c| c.id.len() + c.function.name.len() + c.function.arguments.len())
                .sum::<usize>()
    }
}
