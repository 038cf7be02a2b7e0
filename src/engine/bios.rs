//! The BIOS: the worker's own system prompt, produced apart from anything the caller wrote.
//!
//! It is regenerated whenever the remaining tool budget changes and ends with the line
//! `Tool iterations remaining: N`, so everything before that line stays byte-identical between
//! turns and a backend's prefix cache keeps it.

use std::fmt::Write;

use crate::settings::ToolMode;
use crate::tools::Tool;

/// What a BIOS may depend on.
pub struct BiosContext<'a> {
    /// The bus tools the request names (run by the fleet, within the tool budget).
    pub tools: &'a [&'a Tool],
    /// The caller's own tools (`caller_tools`): the caller runs them, so calling one ends the
    /// request and uses no tool iteration. Their descriptions are the caller's, as given.
    pub caller_tools: &'a [&'a Tool],
    /// The control tools (always offered).
    pub control_tools: &'a [&'a Tool],
    pub tool_mode: ToolMode,
    pub iterations_remaining: u32,
    pub stop_on_decision_request: bool,
    pub max_model_signals: u32,
    pub max_model_signal_bytes: usize,
}

/// Produces the BIOS. Swappable so a deployment can word it for its models; whatever it writes,
/// the engine places it first and regenerates it when the budget changes.
pub trait BiosProvider: Send + Sync + 'static {
    fn bios(&self, context: &BiosContext<'_>) -> String;
}

/// The line every BIOS must end with.
pub fn iterations_line(remaining: u32) -> String {
    format!("Tool iterations remaining: {remaining}")
}

/// genfleet's standard BIOS.
#[derive(Debug, Default, Clone)]
pub struct DefaultBios;

impl BiosProvider for DefaultBios {
    fn bios(&self, cx: &BiosContext<'_>) -> String {
        let mut out = String::with_capacity(2048);
        out.push_str(
            "You are a worker in a fleet of assistants. Do the task you are given; your managers \
             read your answer and the signals you raise.\n",
        );
        let text_mode = cx.tool_mode == ToolMode::Text;
        if cx.tools.is_empty() && cx.caller_tools.is_empty() {
            out.push_str("\nYou have no tools for this task.\n");
        } else {
            out.push_str("\n# Tools\n");
            for tool in cx.tools.iter().chain(cx.caller_tools) {
                let d = &tool.definition;
                match d.brief.trim() {
                    "" => {
                        let _ = writeln!(out, "- {}", d.name);
                    }
                    brief => {
                        let _ = writeln!(out, "- {}: {brief}", d.name);
                    }
                }
                if text_mode {
                    let _ = writeln!(out, "  arguments schema: {}", d.schema);
                }
            }
            out.push_str(
                "All the calls you write in one message count as one tool iteration. Tool results \
                 come back to you; use them to finish the task. Do not call a tool when you can \
                 answer without it.\n",
            );
        }
        out.push_str(
            "\n# Control tools\nThese reach your managers. They are recorded, never executed, \
             and do not use tool iterations.\n",
        );
        for tool in cx.control_tools {
            let d = &tool.definition;
            let _ = writeln!(out, "- {}: {}", d.name, d.brief.trim());
            if text_mode {
                let _ = writeln!(out, "  arguments schema: {}", d.schema);
            }
        }
        if cx.stop_on_decision_request {
            out.push_str(
                "If you need a higher-level decision, call request_decision and stop. Don't keep \
                 guessing.\n",
            );
        } else {
            out.push_str(
                "If you need a higher-level decision, call request_decision, then continue with \
                 your best choice.\n",
            );
        }
        let _ = writeln!(
            out,
            "Raise at most {} signals, {} bytes in all; more are dropped.",
            cx.max_model_signals, cx.max_model_signal_bytes
        );
        if text_mode {
            out.push_str(
                "\n# How to call a tool\nWrite each call on its own, exactly like this:\n\
                 <tool_call>{\"name\": \"TOOL_NAME\", \"arguments\": {ARGUMENTS AS JSON}}</tool_call>\n\
                 Results come back in <tool_response> blocks. Never write a <tool_response> \
                 yourself.\n",
            );
        }
        if cx.iterations_remaining == 0 && !cx.tools.is_empty() {
            out.push_str(
                "\nYou have no tool iterations left: answer with what you have (control tools \
                 still work).\n",
            );
        }
        out.push('\n');
        out.push_str(&iterations_line(cx.iterations_remaining));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::control::control_tools;
    use crate::tools::ToolDefinition;
    use serde_json::json;

    fn context<'a>(
        tools: &'a [&'a Tool],
        controls: &'a [&'a Tool],
        mode: ToolMode,
        n: u32,
    ) -> BiosContext<'a> {
        BiosContext {
            tools,
            caller_tools: &[],
            control_tools: controls,
            tool_mode: mode,
            iterations_remaining: n,
            stop_on_decision_request: true,
            max_model_signals: 3,
            max_model_signal_bytes: 4096,
        }
    }

    #[test]
    fn names_tools_and_controls_and_ends_with_the_budget() {
        let add = Tool::new(ToolDefinition {
            name: "add".into(),
            schema: json!({"type": "object", "properties": {"a": {"type": "number"}}}),
            brief: "Add two numbers".into(),
            examples: Some(crate::tools::ToolExamples {
                description: "SECRET EXAMPLES".into(),
                ..Default::default()
            }),
            timeout_ms: None,
        })
        .unwrap();
        let controls: Vec<&Tool> = control_tools().iter().map(|t| t.as_ref()).collect();
        let tools = [&add];
        let native = DefaultBios.bios(&context(&tools, &controls, ToolMode::Native, 4));
        assert!(native.contains("- add: Add two numbers"));
        assert!(
            !native.contains("\"properties\""),
            "native mode sends schemas as tools, not in the BIOS"
        );
        assert!(native.contains("call request_decision and stop. Don't keep guessing."));
        assert!(
            native.contains("request_escalation")
                && native.contains("declare_outcome")
                && native.contains("signal_issue")
        );
        assert!(native.contains("at most 3 signals"));
        assert!(native.ends_with("\nTool iterations remaining: 4"));
        assert!(
            !native.contains("SECRET EXAMPLES"),
            "the examples tier stays out of prompts"
        );

        let text = DefaultBios.bios(&context(&tools, &controls, ToolMode::Text, 2));
        assert!(text.contains("<tool_call>"));
        assert!(text.contains("\"properties\""));
        assert!(text.ends_with("Tool iterations remaining: 2"));

        // Only the last line changes with the budget, so a prefix cache keeps the rest.
        let three = DefaultBios.bios(&context(&tools, &controls, ToolMode::Native, 3));
        let (a, _) = native.rsplit_once('\n').unwrap();
        let (b, _) = three.rsplit_once('\n').unwrap();
        assert_eq!(a, b);
    }
}
