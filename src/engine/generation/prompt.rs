//! What the backend is sent for a turn: the BIOS, the caller's system prompt and the
//! conversation, the tools offered natively, and the caller's options.
//!
//! It is built afresh for every turn because what it says moves while the generation runs: the
//! BIOS counts the tool iterations left, a backend that refuses native tools is called in text
//! mode from then on, and a chat template that refuses a system layout is sent another. It is
//! also what `Engine::first_call` hands out, so a benchmark that calls a backend directly sends
//! exactly what the worker would.

use crate::engine::SystemShape;
use crate::engine::bios::BiosContext;
use crate::engine::control;
use crate::llm::{ChatRequest, ToolSpec};
use crate::protocol::Message;
use crate::settings::ToolMode;
use crate::tools::Tool;

use super::Generation;
use super::answers::calls_as_text;

impl Generation<'_> {
    pub(super) fn stop_on_decision(&self) -> bool {
        self.request
            .stop_on_decision_request
            .unwrap_or(self.engine.config.stop_on_decision_request)
    }

    pub(super) fn max_tokens(&self) -> Option<u32> {
        self.request
            .max_tokens
            .or(Some(self.engine.config.default_max_tokens).filter(|n| *n > 0))
    }

    /// The messages the model is sent: BIOS, caller system, conversation, with the system
    /// messages laid out in `shape`.
    fn prompt(&self, shape: SystemShape) -> Vec<Message> {
        let config = &self.engine.config;
        let tools: Vec<&Tool> = self.tools.bus.iter().map(|t| t.as_ref()).collect();
        let caller_tools: Vec<&Tool> = self.tools.caller.iter().map(|t| t.as_ref()).collect();
        let controls: Vec<&Tool> = control::control_tools()
            .iter()
            .map(|t| t.as_ref())
            .collect();
        let bios = self.engine.bios.bios(&BiosContext {
            tools: &tools,
            caller_tools: &caller_tools,
            control_tools: &controls,
            tool_mode: self.tools.mode,
            iterations_remaining: self.iterations.left,
            stop_on_decision_request: self.stop_on_decision(),
            max_model_signals: config.signal_limits.max_model_signals,
            max_model_signal_bytes: config.signal_limits.max_model_signal_bytes,
        });
        let mut messages = Vec::with_capacity(self.transcript.conversation.len() + 2);
        messages.push(Message::system(bios));
        if let Some(system) = &self.request.system {
            messages.push(Message::system(system.clone()));
        }
        match self.tools.mode {
            ToolMode::Native => messages.extend(self.transcript.conversation.iter().cloned()),
            // Native calls and `tool` answers in the history (a caller's continuation after
            // `tool_calls`) are written the way a text-mode model reads and writes them.
            ToolMode::Text => messages.extend(calls_as_text(&self.transcript.conversation)),
        }
        shape.apply(messages)
    }

    fn native_tools(&self) -> Vec<ToolSpec> {
        if self.tools.mode == ToolMode::Text {
            return Vec::new();
        }
        let spec = |tool: &Tool| ToolSpec {
            name: tool.definition.name.clone(),
            description: tool.definition.brief.clone(),
            parameters: tool.definition.schema.clone(),
            strict: None,
        };
        // A caller's function goes to the backend as the caller defined it; one without
        // `parameters` is sent with an empty object schema, which some servers require.
        let caller = self.request.caller_tools.iter().map(|tool| {
            let function = &tool.function;
            ToolSpec {
                name: function.name.clone(),
                description: function.description.clone().unwrap_or_default(),
                parameters: function
                    .parameters
                    .clone()
                    .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}})),
                strict: function.strict,
            }
        });
        self.tools
            .bus
            .iter()
            .map(|tool| spec(tool))
            .chain(caller)
            .chain(control::control_tools().iter().map(|tool| spec(tool)))
            .collect()
    }

    /// The backend call of the turn about to be taken.
    pub(super) fn chat_request(&self, shape: SystemShape) -> ChatRequest {
        let mut options = self.request.options.clone();
        if self.tools.mode == ToolMode::Text {
            // tool_choice means nothing without native tools, and some servers reject it.
            options.remove("tool_choice");
        }
        ChatRequest {
            model: self.request.model.clone(),
            messages: self.prompt(shape),
            tools: self.native_tools(),
            max_tokens: self.max_tokens(),
            temperature: self.request.temperature,
            options,
            // The turn's span when traces are exported, else the caller's context as it came.
            traceparent: crate::telemetry::current_traceparent()
                .or_else(|| self.ctx.traceparent.clone()),
            continue_final: false,
        }
    }
}
