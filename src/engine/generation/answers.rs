//! How the model's calls are answered, in the form its tool mode expects: a `tool` message per
//! call in native mode, `<tool_response>` blocks in one user message in text mode.
//!
//! Tool results and correction turns both end here, so the two modes are told apart in one
//! place and a conversation never holds a call without its answer.

use std::fmt::Write;

use serde_json::json;

use crate::protocol::Message;
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
        match self.mode {
            ToolMode::Native => {
                // Calls the model wrote without an id in native mode were given one when they
                // were added to the assistant message, so every call has its answer here.
                for (call, content) in answers {
                    self.conversation
                        .push(Message::tool(call.id.clone(), content));
                }
                if let Some(note) = note {
                    self.conversation.push(Message::user(note));
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
                    self.conversation
                        .push(Message::user(text.trim_end().to_string()));
                }
            }
        }
    }
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
