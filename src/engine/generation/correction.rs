//! The correction turn: what the model is told when its calls cannot be used.
//!
//! An invalid call is not the end of a request while corrections are left: the model sees what
//! was wrong, with the schema and examples of the tools it got wrong, and sends its calls again.
//! None of the message's tool calls runs (its control calls are already recorded), so the model
//! never has to work out which of its calls took effect.

use std::collections::HashSet;
use std::fmt::Write;

use serde_json::json;

use crate::engine::control;
use crate::settings::ToolMode;

use super::Generation;
use super::calls::{ModelCall, Problem};
use super::control_calls::RecordedControls;

impl Generation<'_> {
    /// A correction turn: every call is answered (native mode requires it), then the model is
    /// shown what was wrong and the tools' examples, and asked to send its calls again.
    pub(super) fn add_correction(
        &mut self,
        normal: &[ModelCall],
        controls: &[ModelCall],
        recorded: &RecordedControls,
        problems: &[Problem],
    ) {
        let mut answers = Vec::new();
        let mut answered = HashSet::new();
        for problem in problems {
            if let Some(id) = &problem.call_id
                && let Some(call) = normal.iter().chain(controls).find(|c| &c.id == id)
                && answered.insert(id.clone())
            {
                let content = json!({"error": {"code": "INVALID_CALL", "message": problem.what}});
                answers.push((call, content.to_string()));
            }
        }
        for call in normal.iter().chain(controls) {
            if answered.contains(&call.id) {
                continue;
            }
            let content = if control::is_control_tool(&call.name) {
                recorded.ack(call)
            } else {
                json!({"error": {"code": "NOT_EXECUTED", "message": "not run: another call in the same message was invalid"}}).to_string()
            };
            answers.push((call, content));
        }
        let text = self.correction_text(problems);
        self.push_answers(answers, Some(text));
    }

    fn correction_text(&self, problems: &[Problem]) -> String {
        let mut text = String::from("Your last tool call could not be used:\n");
        for problem in problems {
            let _ = writeln!(text, "- {}", problem.what);
        }
        let mut shown = HashSet::new();
        for problem in problems {
            let Some(name) = &problem.tool else { continue };
            if !shown.insert(name.clone()) {
                continue;
            }
            let tool = self
                .tools
                .callable()
                .chain(control::control_tools())
                .find(|t| t.name() == name);
            if let Some(tool) = tool {
                let d = &tool.definition;
                let _ = write!(
                    text,
                    "\nTool `{}`: {}\nArguments schema: {}\n",
                    d.name, d.brief, d.schema
                );
                if let Some(examples) = &d.examples {
                    let rendered = serde_json::to_string_pretty(examples).unwrap_or_default();
                    let _ = writeln!(text, "How to use it:\n{rendered}");
                }
            }
        }
        if problems.iter().any(|p| p.tool.is_none()) {
            text.push_str("\nThe tools you can call:\n");
            for tool in self.tools.callable().chain(control::control_tools()) {
                let _ = writeln!(
                    text,
                    "- {}: {}",
                    tool.definition.name, tool.definition.brief
                );
            }
        }
        text.push_str("\nSend your tool calls again, corrected.");
        if self.tools.mode == ToolMode::Text {
            text.push_str(
                " Write each as <tool_call>{\"name\": \"TOOL_NAME\", \"arguments\": {...}}</tool_call>.",
            );
        }
        text
    }
}
