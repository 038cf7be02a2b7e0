//! The parts of a chat request the mock looks at: read once from the request body, then
//! matched by the script's rules, rendered into their replies and hashed by the prefix cache.

use serde_json::Value;

/// The parts of a chat request the rules look at.
#[derive(Clone)]
pub(super) struct Conversation {
    pub(super) messages: Vec<Message>,
    pub(super) has_tools: bool,
}

#[derive(Clone)]
pub(super) struct Message {
    pub(super) role: String,
    pub(super) text: String,
}

impl Conversation {
    /// Reads `messages` and `tools` from a request body; `Err` explains a missing or
    /// malformed `messages`.
    pub(super) fn from_request(body: &Value) -> Result<Conversation, String> {
        let messages = match body.get("messages") {
            None | Some(Value::Null) => {
                return Err("missing required parameter: 'messages'".to_string());
            }
            Some(Value::Array(list)) => list,
            Some(_) => return Err("'messages' must be an array".to_string()),
        };
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let Value::Object(m) = m else {
                    return Err(format!("'messages[{i}]' must be an object"));
                };
                let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
                Ok(Message {
                    role: role.to_string(),
                    text: content_text(m.get("content")),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let has_tools = body
            .get("tools")
            .and_then(Value::as_array)
            .is_some_and(|t| !t.is_empty());
        Ok(Conversation {
            messages,
            has_tools,
        })
    }

    /// A continuation's conversation as it stood before the reply being continued (the
    /// trailing assistant message taken off), and that message's text; `None` when the last
    /// message is not an assistant's.
    pub(super) fn continued(&self) -> Option<(Conversation, String)> {
        let (last, before) = self.messages.split_last()?;
        (last.role == "assistant").then(|| {
            let before = Conversation {
                messages: before.to_vec(),
                has_tools: self.has_tools,
            };
            (before, last.text.clone())
        })
    }

    pub(super) fn last_user(&self) -> &str {
        self.messages
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map_or("", |m| m.text.as_str())
    }

    pub(super) fn last_text(&self) -> &str {
        self.messages.last().map_or("", |m| m.text.as_str())
    }

    pub(super) fn last_role(&self) -> &str {
        self.messages.last().map_or("", |m| m.role.as_str())
    }

    pub(super) fn turn(&self) -> u32 {
        let assistants = self.messages.iter().filter(|m| m.role == "assistant");
        u32::try_from(assistants.count()).unwrap_or(u32::MAX - 1) + 1
    }

    /// Total characters of message text, for the rough prompt token estimate.
    pub(super) fn char_count(&self) -> usize {
        self.messages.iter().map(|m| m.text.chars().count()).sum()
    }

    /// Substitutes `{{last_user}}`, `{{last_message}}` and `{{turn}}` in one pass, so text
    /// coming from the request is never itself expanded.
    pub(super) fn render(&self, template: &str) -> String {
        let mut out = String::with_capacity(template.len());
        let mut rest = template;
        while let Some(pos) = rest.find("{{") {
            out.push_str(&rest[..pos]);
            let after = &rest[pos..];
            if let Some(r) = after.strip_prefix("{{last_user}}") {
                out.push_str(self.last_user());
                rest = r;
            } else if let Some(r) = after.strip_prefix("{{last_message}}") {
                out.push_str(self.last_text());
                rest = r;
            } else if let Some(r) = after.strip_prefix("{{turn}}") {
                out.push_str(&self.turn().to_string());
                rest = r;
            } else {
                out.push_str("{{");
                rest = &after[2..];
            }
        }
        out.push_str(rest);
        out
    }
}

/// Message content as text: a string, or the `text` of `{type: "text"}` parts joined by
/// newlines; anything else (null content of a tool-calling assistant turn, images) is empty.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_is_single_pass() {
        let body = serde_json::json!({"messages": [
            {"role": "user", "content": "say {{turn}}"},
            {"role": "assistant", "content": null},
            {"role": "tool", "content": [{"type": "text", "text": "42"}]},
        ]});
        let conv = Conversation::from_request(&body).unwrap();
        assert_eq!(
            conv.render("{{last_user}} / {{last_message}} / {{turn}} {{x}}"),
            "say {{turn}} / 42 / 2 {{x}}"
        );
    }
}
