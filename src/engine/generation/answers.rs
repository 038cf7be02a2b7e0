//! How the model's calls are answered, in the form its tool mode expects: a `tool` message per
//! call in native mode, `<tool_response>` blocks in one user message in text mode.
//!
//! Tool results and correction turns both end here, so the two modes are told apart in one
//! place and a conversation never holds a call without its answer.

use std::collections::HashMap;
use std::fmt::Write;

use serde_json::json;

use crate::protocol::{Message, Role};
use crate::settings::ToolMode;

use super::Generation;
use super::calls::ModelCall;

impl Generation<'_> {
    /// Answers each call with its content, then adds `note` (a correction) for the model.
    pub(super) fn push_answers(
        &mut self,
        answers: Vec<(&ModelCall, String)>,
        note: Option<String>,
    ) {
        match self.tools.mode {
            ToolMode::Native => {
                // Calls the model wrote without an id in native mode were given one when they
                // were added to the assistant message, so every call has its answer here.
                for (call, content) in answers {
                    self.transcript
                        .conversation
                        .push(Message::tool(call.id.clone(), content));
                }
                if let Some(note) = note {
                    self.transcript.conversation.push(Message::user(note));
                }
            }
            ToolMode::Text => {
                let mut text = String::new();
                for (call, content) in answers {
                    let body = json!({"name": call.name, "content": RawJson(&content)});
                    let _ = writeln!(text, "<tool_response>\n{body}\n</tool_response>");
                }
                if let Some(note) = note {
                    text.push_str(&note);
                }
                if !text.is_empty() {
                    self.transcript
                        .conversation
                        .push(Message::user(text.trim_end().to_string()));
                }
            }
        }
    }
}

/// The conversation as a text-mode model reads it: an assistant message's native calls written
/// as `<tool_call>` blocks after its text, and each run of `tool` messages as one user message
/// of `<tool_response>` blocks (named after the call they answer), exactly as the worker writes
/// them itself in text mode. Other messages are unchanged.
pub(super) fn calls_as_text(conversation: &[Message]) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(conversation.len());
    let mut names: HashMap<&str, &str> = HashMap::new();
    let mut responses = String::new();
    for message in conversation {
        if message.role == Role::Tool {
            let id = message.tool_call_id.as_deref().unwrap_or_default();
            let name = names.get(id).copied().unwrap_or(id);
            let content = message.text();
            let body = json!({"name": name, "content": RawJson(&content)});
            let _ = writeln!(responses, "<tool_response>\n{body}\n</tool_response>");
            continue;
        }
        if !responses.is_empty() {
            out.push(Message::user(std::mem::take(&mut responses).trim_end()));
        }
        if message.role != Role::Assistant || message.tool_calls.is_empty() {
            out.push(message.clone());
            continue;
        }
        let mut text = message.text().into_owned();
        for call in &message.tool_calls {
            names.insert(&call.id, &call.function.name);
            // Name first, as the BIOS shows the form (a JSON map would sort the keys).
            let body = format!(
                "{{\"name\":{},\"arguments\":{}}}",
                json!(call.function.name),
                json!(RawJson(&call.function.arguments))
            );
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            let _ = write!(text, "<tool_call>{body}</tool_call>");
        }
        out.push(Message::assistant(text));
    }
    if !responses.is_empty() {
        out.push(Message::user(responses.trim_end()));
    }
    out
}

/// Embeds text that already is JSON without quoting it again.
struct RawJson<'a>(&'a str);

impl serde::Serialize for RawJson<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match serde_json::from_str::<serde_json::Value>(self.0) {
            Ok(value) => value.serialize(serializer),
            Err(_) => serializer.serialize_str(self.0),
        }
    }
}
