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
        let tools: Vec<&Tool> = self.tools.iter().map(|t| t.as_ref()).collect();
        let controls: Vec<&Tool> = control::control_tools()
            .iter()
            .map(|t| t.as_ref())
            .collect();
        let bios = self.engine.bios.bios(&BiosContext {
            tools: &tools,
            control_tools: &controls,
            tool_mode: self.mode,
            iterations_remaining: self.iterations_left,
            stop_on_decision_request: self.stop_on_decision(),
            max_model_signals: config.signal_limits.max_model_signals,
            max_model_signal_bytes: config.signal_limits.max_model_signal_bytes,
        });
        let mut messages = Vec::with_capacity(self.conversation.len() + 2);
        messages.push(Message::system(bios));
        if let Some(system) = &self.request.system {
            messages.push(Message::system(system.clone()));
        }
        messages.extend(self.conversation.iter().cloned());
        shape.apply(messages)
    }

    fn native_tools(&self) -> Vec<ToolSpec> {
        if self.mode == ToolMode::Text {
            return Vec::new();
        }
        self.tools
            .iter()
            .chain(control::control_tools())
            .map(|tool| ToolSpec {
                name: tool.definition.name.clone(),
                description: tool.definition.brief.clone(),
                parameters: tool.definition.schema.clone(),
            })
            .collect()
    }

    /// The backend call of the turn about to be taken.
    pub(super) fn chat_request(&self, shape: SystemShape) -> ChatRequest {
        let mut options = self.request.options.clone();
        if self.mode == ToolMode::Text {
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
            traceparent: self.ctx.traceparent.clone(),
        }
    }
}
