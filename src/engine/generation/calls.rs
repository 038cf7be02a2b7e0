//! The calls a turn holds, as one list whatever way the model made them, and the problems with
//! them that a correction turn names.
//!
//! Native calls and calls written as text are gathered alike so that everything after them
//! (checking, control calls, execution, answers) handles one kind of call. Each call gets an id
//! here, because a native conversation must answer every call by id, text calls included.

use crate::engine::text_calls::{self, InvalidCallKind, ParsedItem};
use crate::protocol::ids::new_id;
use crate::protocol::{Content, FunctionCall, Message, ToolCall};
use crate::settings::ToolMode;
use crate::tools::Tool;

use super::Generation;
use super::turn::Turn;

/// One call the model made, native or written as text.
#[derive(Clone)]
pub(super) struct ModelCall {
    pub(super) id: String,
    pub(super) name: String,
    pub(super) arguments: serde_json::Map<String, serde_json::Value>,
    /// The argument string as the model sent it (native calls), kept for the conversation.
    raw_arguments: Option<String>,
}

/// An invalid call: corrected, or the request fails with `tool_parse_error`.
pub(super) struct Problem {
    /// The native call id this problem answers, if there is one.
    pub(super) call_id: Option<String>,
    pub(super) tool: Option<String>,
    pub(super) what: String,
}

/// The ids given to calls the model made without one. Only gathering a turn's calls (here)
/// gives them out.
#[derive(Default)]
pub(super) struct CallIds {
    given: u32,
}

impl CallIds {
    /// An id for a call the model made without one: unique in the conversation, also across
    /// the requests that continue it (a caller's continuation after `tool_calls`, a decision's
    /// continuation), since it carries 8 random characters (of a fresh ULID, whose last 16 are
    /// random). Nothing of the request's id goes into it: the backend sees call ids.
    fn next(&mut self) -> String {
        self.given += 1;
        let fresh = new_id();
        format!("call_{}_{}", &fresh[fresh.len() - 8..], self.given)
    }
}

impl Generation<'_> {
    /// The turn's calls in order (native first, then those written as text), and the invalid ones.
    pub(super) fn collect_calls(&mut self, turn: &Turn) -> (Vec<ModelCall>, Vec<Problem>) {
        let mut calls = Vec::new();
        let mut problems = Vec::new();
        for native in turn.native.values() {
            let id = native.id.clone().unwrap_or_else(|| self.call_ids.next());
            if native.name.is_empty() {
                problems.push(Problem {
                    call_id: Some(id),
                    tool: None,
                    what: "a tool call without a tool name".into(),
                });
                continue;
            }
            let raw = serde_json::Value::String(native.arguments.clone());
            match text_calls::parse_arguments(&raw) {
                Ok(arguments) => calls.push(ModelCall {
                    id,
                    name: native.name.clone(),
                    arguments,
                    raw_arguments: Some(native.arguments.clone()),
                }),
                Err(reason) => problems.push(Problem {
                    call_id: Some(id.clone()),
                    tool: Some(native.name.clone()),
                    what: format!(
                        "the arguments of `{}` are not a JSON object: {reason}",
                        native.name
                    ),
                }),
            }
        }
        for item in &turn.parsed {
            match item {
                ParsedItem::Call(call) => {
                    let id = call.id.clone().unwrap_or_else(|| self.call_ids.next());
                    calls.push(ModelCall {
                        id,
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                        raw_arguments: None,
                    });
                }
                ParsedItem::Invalid(invalid) => problems.push(Problem {
                    call_id: None,
                    tool: None,
                    what: match invalid.kind {
                        InvalidCallKind::Malformed => {
                            format!(
                                "a tool call is not valid JSON ({}): {}",
                                invalid.reason, invalid.raw
                            )
                        }
                        InvalidCallKind::InvalidCall => {
                            format!(
                                "a tool call object is invalid ({}): {}",
                                invalid.reason, invalid.raw
                            )
                        }
                    },
                }),
            }
        }
        (calls, problems)
    }

    /// The assistant turn as it goes into the conversation. In native mode calls are native
    /// `tool_calls` (those written as text too, so every tool result has a call to answer); in
    /// text mode the model's own text stands as written.
    pub(super) fn assistant_message(&self, turn: &Turn, calls: &[ModelCall]) -> Message {
        if self.tools.mode == ToolMode::Text || calls.is_empty() {
            return Message::assistant(turn.raw.clone());
        }
        self.calls_message(turn, calls)
    }

    /// The assistant turn in OpenAI's shape whatever the tool mode: its visible text, and every
    /// call as a native `tool_calls` entry with its id. A generation that ends with the caller's
    /// tool calls leaves this message last, so the caller can answer them by id.
    pub(super) fn calls_message(&self, turn: &Turn, calls: &[ModelCall]) -> Message {
        let tool_calls = calls
            .iter()
            .map(|call| ToolCall {
                id: call.id.clone(),
                kind: "function".into(),
                function: FunctionCall {
                    name: call.name.clone(),
                    arguments: call.raw_arguments.clone().unwrap_or_else(|| {
                        serde_json::Value::Object(call.arguments.clone()).to_string()
                    }),
                },
            })
            .collect();
        Message {
            content: (!turn.visible.trim().is_empty()).then(|| Content::Text(turn.visible.clone())),
            tool_calls,
            ..Message::assistant("")
        }
    }

    /// Calls of tools this request may not use, and arguments their schemas refuse (a caller
    /// tool's arguments are held to the caller's schema exactly as a bus tool's).
    pub(super) fn tool_call_problems(&self, calls: &[ModelCall]) -> Vec<Problem> {
        let mut problems = Vec::new();
        for call in calls {
            let tool = self.tools.callable().find(|t| t.name() == call.name);
            match tool {
                None => problems.push(Problem {
                    call_id: Some(call.id.clone()),
                    tool: None,
                    what: format!("`{}` is not a tool you can call", call.name),
                }),
                Some(tool) => problems.extend(argument_problems(tool, call)),
            }
        }
        problems
    }
}

impl Generation<'_> {
    /// The result's detail when the model's calls stayed invalid after its correction turn:
    /// written for the person reading the result, not for the model (which was told in its
    /// own words).
    pub(super) fn failed_calls_detail(&self, calls: &[ModelCall], problems: &[Problem]) -> String {
        let offered: Vec<&str> = self.tools.callable().map(|t| t.name()).collect();
        let unknown = calls
            .iter()
            .find(|call| !offered.contains(&call.name.as_str()));
        match unknown {
            Some(call) => {
                let offers = if offered.is_empty() {
                    "it offers no tools".to_string()
                } else {
                    format!("it offers {}", offered.join(", "))
                };
                format!(
                    "the model called `{}`, a tool this request does not offer ({offers}), and called it again after it was told",
                    call.name
                )
            }
            None => format!(
                "the model's tool call was still invalid after it was told what was wrong: {}",
                problems.first().map_or("", |p| p.what.as_str())
            ),
        }
    }
}

pub(super) fn argument_problems(tool: &Tool, call: &ModelCall) -> Vec<Problem> {
    let arguments = serde_json::Value::Object(call.arguments.clone());
    tool.check_arguments(&arguments)
        .into_iter()
        .map(|error| Problem {
            call_id: Some(call.id.clone()),
            tool: Some(call.name.clone()),
            what: format!("invalid arguments for `{}` {error}", call.name),
        })
        .collect()
}
