//! Asking a higher-level model to decide, through the same OpenAI-compatible client the
//! workers use ([`LlmBackend`]).
//!
//! The model gets a system prompt explaining its role and the decision rendered as text (see
//! [`DecisionView::render`]), and is asked for one JSON object
//! `{"option_id": "...", "rationale": "..."}` (plus `modified_prompt` and `guidance` where the
//! decision takes them). The reply is read robustly: the object may be fenced or surrounded by
//! prose. An unusable reply is named back to the model once; a second one falls back to the
//! decision's default option, if it has one.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::Value;

use super::console::{CHAIN_ENDING_OPTIONS, MODIFY_PROMPT};
use super::view::{DecisionView, clipped_line};
use crate::llm::{ChatRequest, LlmBackend, LlmError, OpenAiBackend, StreamEvent};
use crate::protocol::{DecisionAnswer, DecisionOption, Message};
use crate::settings::Settings;

/// Most of a reply kept; a model that talks on is cut here.
const MAX_REPLY_BYTES: usize = 64 * 1024;
/// Tokens the model may spend on its answer (reasoning models need room).
const MAX_TOKENS: u32 = 2048;

const SYSTEM_PROMPT: &str = "You are the manager of a fleet of LLM workers. A worker, or the \
fleet itself, has stopped a job to ask for a decision it may not take alone: a model's own \
question, a low-confidence result (escalation) or a checkpoint before a sensitive step. Read \
the question, the options with their pros and cons, the context, the meta data (checks, \
confidence, error history, the prompt, an output summary) and the outcomes of similar earlier \
decisions, then choose the option that best serves the job and the people who run it. Prefer \
the default when the evidence does not clearly favour another option. Be brief and concrete \
in your rationale: the worker reads it.";

#[derive(Debug, Clone, PartialEq)]
pub enum Pick {
    /// A valid answer, at the first or second attempt; the model gives no `confidence_boost`,
    /// and who answered (`decided_by`) is the manager's to fill in.
    Chosen {
        answer: DecisionAnswer,
        attempts: u32,
    },
    /// Two unusable replies: the decision's default option.
    Fallback {
        option_id: String,
        errors: Vec<String>,
    },
    /// No answer: the backend failed, or the replies were unusable and there is no default.
    Failed { reason: String },
}

/// The higher-level model.
#[derive(Clone)]
pub struct LlmPicker {
    backend: Arc<dyn LlmBackend>,
    model: String,
    timeout: Duration,
}

impl LlmPicker {
    pub fn new(
        backend: Arc<dyn LlmBackend>,
        model: impl Into<String>,
        timeout: Duration,
    ) -> LlmPicker {
        LlmPicker {
            backend,
            model: model.into(),
            timeout,
        }
    }

    /// The model of `manager.llm_*`, falling back to `llm.*` for what they leave empty.
    pub fn from_settings(settings: &Settings) -> Result<LlmPicker, LlmError> {
        let llm = settings.manager.llm(&settings.llm);
        let backend = OpenAiBackend::new(&llm)?;
        Ok(LlmPicker::new(
            Arc::new(backend),
            llm.model,
            Duration::from_millis(settings.manager.llm_timeout_ms),
        ))
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    /// `decided_by` of its answers.
    pub fn decided_by(&self) -> String {
        format!("llm:{}", self.model)
    }

    pub async fn pick(&self, view: &DecisionView) -> Pick {
        let options = &view.decision.options;
        let extras = view.takes_extras();
        let mut messages = vec![
            Message::system(SYSTEM_PROMPT),
            Message::user(question(view)),
        ];
        let mut errors = Vec::new();
        for attempt in 1..=2 {
            let reply = match self.ask(&messages).await {
                Ok(reply) => reply,
                Err(reason) => return Pick::Failed { reason },
            };
            match parse_reply(&reply, options, extras) {
                Ok(answer) => {
                    return Pick::Chosen {
                        answer,
                        attempts: attempt,
                    };
                }
                Err(error) => {
                    messages.push(Message::assistant(reply));
                    messages.push(Message::user(format!(
                        "Your answer could not be used: {error}. Reply again with only the JSON \
                         object {{\"option_id\": \"...\", \"rationale\": \"...\"}}, where option_id \
                         is one of: {}.",
                        ids(options)
                    )));
                    errors.push(error);
                }
            }
        }
        match &view.decision.default_option {
            Some(default) => Pick::Fallback {
                option_id: default.clone(),
                errors,
            },
            None => Pick::Failed {
                reason: format!(
                    "no usable answer in two replies and no default option ({})",
                    errors.join("; ")
                ),
            },
        }
    }

    /// One call: the reply's text, within the timeout.
    async fn ask(&self, messages: &[Message]) -> Result<String, String> {
        let request = ChatRequest {
            model: None,
            messages: messages.to_vec(),
            tools: Vec::new(),
            max_tokens: Some(MAX_TOKENS),
            temperature: Some(0.0),
            options: Default::default(),
            traceparent: None,
            continue_final: false,
        };
        let call = async {
            let mut stream = self.backend.chat_stream(request);
            let mut text = String::new();
            while let Some(event) = stream.next().await {
                match event.map_err(|e| e.to_string())? {
                    StreamEvent::Text(piece) if text.len() < MAX_REPLY_BYTES => {
                        text.push_str(&piece)
                    }
                    StreamEvent::Finish(_) => return Ok(text),
                    _ => {}
                }
            }
            Err("the model's answer broke off".to_string())
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "the model did not answer within {:?}",
                    self.timeout
                ))
            })
    }
}

fn ids(options: &[DecisionOption]) -> String {
    options
        .iter()
        .map(|o| o.id.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The user message: the decision and the expected answer.
fn question(view: &DecisionView) -> String {
    let mut text = view.render();
    text.push_str("\nAnswer with one JSON object and nothing else:\n");
    if view.takes_extras() {
        text.push_str(
            "{\"option_id\": \"<one of the option ids>\", \"rationale\": \"<why, briefly>\", \
             \"modified_prompt\": \"<only with modify_prompt: the new prompt>\", \
             \"guidance\": \"<optional: a note for the next attempt>\"}\n",
        );
    } else {
        text.push_str(
            "{\"option_id\": \"<one of the option ids>\", \"rationale\": \"<why, briefly>\"}\n",
        );
    }
    text.push_str(&format!(
        "The option ids are: {}.",
        ids(&view.decision.options)
    ));
    text
}

/// Reads the model's reply: the first JSON object with `option_id` anywhere in the text
/// (fenced, or surrounded by prose), its option checked against the decision's. An id given
/// in another case, or the option's label, is taken for the option.
pub fn parse_reply(
    text: &str,
    options: &[DecisionOption],
    extras_allowed: bool,
) -> Result<DecisionAnswer, String> {
    let object = json_objects(text)
        .into_iter()
        .find(|o| o.contains_key("option_id"))
        .ok_or_else(|| "no JSON object with \"option_id\" in the reply".to_string())?;
    let chosen = match &object["option_id"] {
        Value::String(s) => s.trim().to_string(),
        other => return Err(format!("option_id must be a string, not {other}")),
    };
    let option = options
        .iter()
        .find(|o| o.id == chosen)
        .or_else(|| options.iter().find(|o| o.id.eq_ignore_ascii_case(&chosen)))
        .or_else(|| {
            options
                .iter()
                .find(|o| o.label.eq_ignore_ascii_case(&chosen))
        })
        .ok_or_else(|| {
            format!(
                "{:?} is not one of the option ids ({})",
                clipped_line(&chosen, 80),
                ids(options)
            )
        })?;
    let text_field = |key: &str| match object.get(key) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.trim().to_string()).filter(|s| !s.is_empty()),
        Some(other) => Some(other.to_string()),
    };
    let mut answer = DecisionAnswer {
        rationale: text_field("rationale"),
        ..DecisionAnswer::option(option.id.clone())
    };
    if extras_allowed && !CHAIN_ENDING_OPTIONS.contains(&answer.option_id.as_str()) {
        answer.guidance = text_field("guidance");
        if answer.option_id == MODIFY_PROMPT {
            answer.modified_prompt = text_field("modified_prompt");
            if answer.modified_prompt.is_none() {
                return Err(
                    "option modify_prompt needs \"modified_prompt\", the new prompt".into(),
                );
            }
        }
    }
    Ok(answer)
}

/// Every top-level JSON object in `text`, in order (objects inside one are not listed again).
fn json_objects(text: &str) -> Vec<serde_json::Map<String, Value>> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(offset) = text[at..].find('{') {
        let start = at + offset;
        let mut stream = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
        match stream.next() {
            Some(Ok(Value::Object(object))) => {
                found.push(object);
                at = start + stream.byte_offset();
            }
            _ => at = start + 1,
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> Vec<DecisionOption> {
        ["fast", "safe", "modify_prompt"]
            .iter()
            .map(|id| DecisionOption {
                id: id.to_string(),
                label: format!("{} way", id),
                pros: None,
                cons: None,
            })
            .collect()
    }

    #[test]
    fn replies_are_read_robustly() {
        let ok = |id: &str, rationale: Option<&str>| {
            Ok(DecisionAnswer {
                rationale: rationale.map(str::to_string),
                ..DecisionAnswer::option(id)
            })
        };
        let cases: Vec<(&str, &str, bool, Result<DecisionAnswer, String>)> = vec![
            (
                "bare",
                r#"{"option_id": "fast", "rationale": "deadline"}"#,
                false,
                ok("fast", Some("deadline")),
            ),
            (
                "fenced",
                "Here you go:\n```json\n{\"option_id\": \"safe\"}\n```\n",
                false,
                ok("safe", None),
            ),
            (
                "in prose",
                "I pick {\"option_id\":\"safe\",\"rationale\":\"prod\"} because.",
                false,
                ok("safe", Some("prod")),
            ),
            (
                "braces before",
                "Thinking {about it}... {\"option_id\": \"fast\"}",
                false,
                ok("fast", None),
            ),
            (
                "first object without option_id skipped",
                r#"{"note": 1} {"option_id": "fast"}"#,
                false,
                ok("fast", None),
            ),
            (
                "nested objects are not separate",
                r#"{"x": {"option_id": "safe"}, "option_id": "fast"}"#,
                false,
                ok("fast", None),
            ),
            ("case", r#"{"option_id": "FAST"}"#, false, ok("fast", None)),
            (
                "label",
                r#"{"option_id": "Safe way"}"#,
                false,
                ok("safe", None),
            ),
            (
                "empty rationale",
                r#"{"option_id": "fast", "rationale": "  "}"#,
                false,
                ok("fast", None),
            ),
            (
                "extras dropped for a model's decision",
                r#"{"option_id": "fast", "guidance": "g"}"#,
                false,
                ok("fast", None),
            ),
            (
                "no json",
                "I would go fast.",
                false,
                Err("no JSON object".into()),
            ),
            (
                "unknown option",
                r#"{"option_id": "warp"}"#,
                false,
                Err("\"warp\" is not one of the option ids (fast, safe, modify_prompt)".into()),
            ),
            (
                "not a string",
                r#"{"option_id": 2}"#,
                false,
                Err("option_id must be a string".into()),
            ),
            (
                "broken json",
                r#"{"option_id": "fast""#,
                false,
                Err("no JSON object".into()),
            ),
            (
                "modify_prompt needs the prompt",
                r#"{"option_id": "modify_prompt"}"#,
                true,
                Err("needs \"modified_prompt\"".into()),
            ),
        ];
        for (name, text, extras, expected) in cases {
            let got = parse_reply(text, &options(), extras);
            match (&got, &expected) {
                (Ok(_), Ok(_)) => assert_eq!(got, expected, "{name}"),
                (Err(e), Err(needle)) => assert!(e.contains(needle.as_str()), "{name}: {e}"),
                _ => panic!("{name}: {got:?}"),
            }
        }
        let full = parse_reply(
            r#"{"option_id": "modify_prompt", "rationale": "r", "modified_prompt": "Be brief.", "guidance": "g"}"#,
            &options(),
            true,
        )
        .unwrap();
        assert_eq!(
            (full.modified_prompt.as_deref(), full.guidance.as_deref()),
            (Some("Be brief."), Some("g"))
        );
    }
}
