//! The parts of a generation's state that more than one step reads or changes; a part that one
//! step alone changes lives in that step's file.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::engine::control;
use crate::protocol::{GenerationRequest, Message, Reason, ToolCall};
use crate::settings::ToolMode;
use crate::tools::{Tool, ToolCatalog};

use super::ending::Stop;

/// What ends a wait from outside the generation: the caller's cancellation and the request's
/// deadline. Fixed when the generation starts; every wait on a peer (a turn's stream, a turn's
/// tool calls) races it.
#[derive(Clone)]
pub(super) struct Bounds {
    pub(super) cancel: CancellationToken,
    pub(super) deadline: Option<tokio::time::Instant>,
}

impl Bounds {
    /// Resolves once the request is cancelled or its deadline passes (cancellation first when
    /// both have), with the stop that says which; `deadline_detail` says what it cut short.
    pub(super) async fn crossed(&self, deadline_detail: &'static str) -> Stop {
        tokio::select! {
            biased;
            _ = self.cancel.cancelled() => Stop::plain(Reason::Cancelled),
            _ = sleep_until(self.deadline) => Stop::new(Reason::Timeout, deadline_detail),
        }
    }
}

/// Waits for the deadline, or forever when the request has none.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The tools the model is offered, and how it calls them. Filled once before the first turn;
/// after that only the loop changes it, to text mode when the backend refuses native tools.
/// The prompt offers them, and the calls are checked, corrected and run against them.
pub(super) struct ToolSet {
    pub(super) mode: ToolMode,
    /// The request's tools from the catalog, run on the bus.
    pub(super) bus: Vec<Arc<Tool>>,
    /// The caller's own tools (`caller_tools`): offered to the model beside `bus`, never run
    /// here; a turn that calls one ends the generation with `tool_calls`.
    pub(super) caller: Vec<Arc<Tool>>,
}

impl ToolSet {
    pub(super) fn new(mode: ToolMode) -> Self {
        ToolSet {
            mode,
            bus: Vec::new(),
            caller: Vec::new(),
        }
    }

    /// Takes the request's tools from the catalog as it is now (control tools need none); an
    /// unknown tool ends the request before the model is called.
    pub(super) fn resolve(
        &mut self,
        catalog: &ToolCatalog,
        request: &GenerationRequest,
    ) -> Option<Stop> {
        for name in &request.tools {
            match catalog.get(name) {
                Some(tool) => self.bus.push(tool.clone()),
                None if control::is_control_tool(name) => {}
                None => {
                    return Some(Stop::new(
                        Reason::InvalidRequest,
                        format!("unknown tool {name:?}"),
                    ));
                }
            }
        }
        for (i, tool) in request.caller_tools.iter().enumerate() {
            match Tool::from_function(&tool.function) {
                Ok(tool) => self.caller.push(Arc::new(tool)),
                Err(error) => {
                    return Some(Stop::new(
                        Reason::InvalidRequest,
                        format!("caller_tools[{i}]: {error}"),
                    ));
                }
            }
        }
        None
    }

    /// The tools the model may call but the control tools: the bus's, then the caller's.
    pub(super) fn callable(&self) -> impl Iterator<Item = &Arc<Tool>> {
        self.bus.iter().chain(&self.caller)
    }

    pub(super) fn is_caller_tool(&self, name: &str) -> bool {
        self.caller.iter().any(|t| t.name() == name)
    }
}

/// What the generation hands back of the exchange: the conversation, the visible output and
/// the reasoning (both capped, `truncated` once either was cut), and the caller's calls it
/// ended with. The turn streams the output and the reasoning into it; the turn, the loop, the
/// answers, the retry and the caller's calls add to the conversation.
pub(super) struct Transcript {
    pub(super) conversation: Vec<Message>,
    pub(super) output: String,
    pub(super) reasoning: String,
    pub(super) truncated: bool,
    /// The caller-tool calls the generation ended with (the result's `tool_calls`).
    pub(super) caller_calls: Vec<ToolCall>,
}

impl Transcript {
    /// A transcript that continues the request's messages.
    pub(super) fn new(messages: Vec<Message>) -> Self {
        Transcript {
            conversation: messages,
            output: String::new(),
            reasoning: String::new(),
            truncated: false,
            caller_calls: Vec::new(),
        }
    }
}
