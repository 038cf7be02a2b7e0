//! One generation: the tool loop of one request, from its `started` event to exactly one
//! terminal result.
//!
//! This file holds the state of a generation and the loop that drives it; each job the loop
//! hands out has a file of its own, so that the loop reads as the flow. In the order a request
//! meets them: [`checkpoint`] (before anything runs); then, each turn, [`prompt`] and [`turn`]
//! (the backend called and its stream read), [`calls`] (the calls gathered and checked),
//! [`control_calls`] (the signals the model raises), [`correction`] or [`tools`] (run within the
//! budget), and [`answers`] (what goes back to the model); after the loop, [`escalation`] (the
//! output held to its checks); last, [`ending`]. [`signalling`] and [`decision`] serve them all:
//! the signals raised, within their bounds, and the decisions asked of managers.

mod answers;
mod caller_calls;
mod calls;
mod checkpoint;
mod control_calls;
mod correction;
mod decision;
mod ending;
mod escalation;
mod prompt;
mod signalling;
mod tools;
mod turn;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::control;
use super::events::EventEmitter;
use super::loop_detect::LoopDetector;
use super::signals::SignalBook;
use super::{Engine, Finished, RequestContext};
use crate::llm::{ChatRequest, FinishReason, LlmError};
use crate::protocol::{
    EventBody, GenerationRequest, Message, Reason, Severity, ToolCall, Usage, ValidationReport,
};
use crate::settings::ToolMode;
use crate::tools::Tool;

use caller_calls::TurnCalls;
use calls::ModelCall;
use ending::Stop;
use turn::TurnError;

pub(super) struct Generation<'e> {
    engine: &'e Engine,
    request: GenerationRequest,
    ctx: RequestContext,
    cancel: CancellationToken,
    deadline: Option<tokio::time::Instant>,
    events: EventEmitter,
    signals: SignalBook,
    loops: LoopDetector,
    mode: ToolMode,
    tools: Vec<Arc<Tool>>,
    /// The caller's own tools (`caller_tools`): offered to the model beside `tools`, never run
    /// here; a turn that calls one ends the generation with `tool_calls`.
    caller_tools: Vec<Arc<Tool>>,
    /// The caller-tool calls the generation ended with (the result's `tool_calls`).
    caller_calls: Vec<ToolCall>,
    conversation: Vec<Message>,
    output: String,
    reasoning: String,
    truncated: bool,
    usage: Usage,
    iterations_left: u32,
    iterations_used: u32,
    started_at: Instant,
    first_token: Option<Duration>,
    next_call_id: u32,
    /// 1, or 2 once validation sent the model back to its answer.
    tries: u32,
    /// Where in `output` the answer the checks judge starts: 0, or where the retry began.
    answer_from: usize,
    validation: Option<ValidationReport>,
}

impl<'e> Generation<'e> {
    pub(super) fn new(
        engine: &'e Engine,
        request: GenerationRequest,
        ctx: RequestContext,
        events: EventEmitter,
        cancel: CancellationToken,
    ) -> Self {
        let config = &engine.config;
        let deadline = request
            .deadline_ms
            .map(|ms| tokio::time::Instant::from_std(ctx.accepted_at + Duration::from_millis(ms)));
        let iterations = request
            .tool_iterations
            .unwrap_or(config.default_tool_iterations);
        Generation {
            events,
            signals: SignalBook::new(config.signal_limits),
            loops: LoopDetector::new(&config.loop_detection),
            mode: engine.effective_tool_mode(),
            tools: Vec::new(),
            caller_tools: Vec::new(),
            caller_calls: Vec::new(),
            conversation: request.messages.clone(),
            output: String::new(),
            reasoning: String::new(),
            truncated: false,
            usage: Usage::default(),
            iterations_left: iterations,
            iterations_used: 0,
            started_at: Instant::now(),
            first_token: None,
            next_call_id: 0,
            tries: 1,
            answer_from: 0,
            validation: None,
            engine,
            request,
            ctx,
            cancel,
            deadline,
        }
    }

    /// Every way a generation goes ends in [`Generation::finish`], so `Engine::run` always has a
    /// terminal result to return.
    pub(super) async fn run(mut self) -> Finished {
        self.events
            .emit(EventBody::Started {
                worker_id: self.ctx.worker_id.clone(),
                attempt: self.ctx.attempt,
                chain_position: self.ctx.chain_position,
            })
            .await;
        let stop = match self.resolve_tools() {
            Some(stop) => stop,
            None => match self.checkpoint().await {
                Some(stop) => stop,
                None => self.validated_loop().await,
            },
        };
        self.finish(stop).await
    }

    /// Takes the request's tools from the catalog as it is now (control tools need none); an
    /// unknown tool ends the request before the model is called.
    fn resolve_tools(&mut self) -> Option<Stop> {
        let catalog = self.engine.catalog();
        for name in &self.request.tools {
            match catalog.get(name) {
                Some(tool) => self.tools.push(tool.clone()),
                None if control::is_control_tool(name) => {}
                None => {
                    return Some(Stop::new(
                        Reason::InvalidRequest,
                        format!("unknown tool {name:?}"),
                    ));
                }
            }
        }
        for (i, tool) in self.request.caller_tools.iter().enumerate() {
            match Tool::from_function(&tool.function) {
                Ok(tool) => self.caller_tools.push(Arc::new(tool)),
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

    fn is_caller_tool(&self, name: &str) -> bool {
        self.caller_tools.iter().any(|t| t.name() == name)
    }

    /// The first backend call this request would make, exactly as it would be sent (what
    /// `genfleet bench` sends straight to a backend to compare with the worker's path).
    pub(super) fn first_call(mut self) -> Result<ChatRequest, String> {
        if let Some(stop) = self.resolve_tools() {
            return Err(stop.detail.unwrap_or_default());
        }
        Ok(self.chat_request(self.engine.system_shape()))
    }

    /// Takes turns until one ends the generation. A backend refusal is learnt (for the whole
    /// engine) and the turn taken again; an invalid call costs a correction, not a tool
    /// iteration; turns of control calls alone are bounded so a model cannot signal forever.
    async fn tool_loop(&mut self) -> Stop {
        let config = &self.engine.config;
        let mut corrections_left = config.correction_attempts;
        let mut control_turns = 0;
        loop {
            let span = self.turn_span();
            let before = self.usage;
            let turn = self.model_turn().instrument(span.clone()).await;
            self.end_turn_span(&span, before, &turn);
            let turn = match turn {
                Ok(turn) => turn,
                Err(TurnError::Stop(stop)) => return stop,
                Err(TurnError::ToolsRefused(body)) => {
                    tracing::warn!(
                        message = "the backend refused native tools; calling it in text mode from now on",
                        request_id = %self.ctx.request_id,
                        backend_said = %body
                    );
                    self.engine
                        .native_tools_refused
                        .store(true, Ordering::Relaxed);
                    self.mode = ToolMode::Text;
                    continue;
                }
                Err(TurnError::SystemRefused(shape, body)) => {
                    if self.engine.system_refused(shape, &body).is_some() {
                        continue;
                    }
                    let error = LlmError::SystemRejected(body);
                    return Stop::new(Reason::BackendError, error.to_string());
                }
            };
            if turn.finish == FinishReason::Length {
                self.conversation.push(Message::assistant(turn.raw));
                self.worker_signal(
                    "MAX_TOKENS_REACHED",
                    Severity::Med,
                    "the model reached max_tokens before finishing".into(),
                    json!({"max_tokens": self.max_tokens()}),
                )
                .await;
                return Stop::plain(Reason::Length);
            }

            let (calls, mut problems) = self.collect_calls(&turn);
            let assistant = self.assistant_message(&turn, &calls);
            // Kept in order only when the turn may end with the caller's calls.
            let in_order = calls
                .iter()
                .any(|c| self.is_caller_tool(&c.name))
                .then(|| calls.clone());
            let (controls, normal): (Vec<ModelCall>, Vec<ModelCall>) = calls
                .into_iter()
                .partition(|c| control::is_control_tool(&c.name));

            problems.extend(self.tool_call_problems(&normal));
            let recorded = match self.record_control_calls(&controls, &mut problems).await {
                Ok(recorded) => recorded,
                Err(stop) => {
                    self.conversation.push(assistant);
                    return stop;
                }
            };
            self.conversation.push(assistant);
            if recorded.awaits_decision {
                return Stop::plain(Reason::DecisionRequested);
            }

            if !problems.is_empty() {
                if corrections_left == 0 {
                    return Stop::new(
                        Reason::ToolParseError,
                        self.failed_calls_detail(&normal, &problems),
                    );
                }
                corrections_left -= 1;
                self.add_correction(&normal, &controls, &recorded, &problems);
                continue;
            }

            let (caller, normal): (Vec<ModelCall>, Vec<ModelCall>) = normal
                .into_iter()
                .partition(|c| self.is_caller_tool(&c.name));
            if let Some(all) = &in_order {
                let calls = TurnCalls {
                    all,
                    bus: &normal,
                    controls: &controls,
                    caller: &caller,
                };
                return self.end_with_caller_calls(&turn, calls, &recorded).await;
            }

            if normal.is_empty() {
                if controls.is_empty() || turn.visible.trim().is_empty() {
                    return match turn.finish {
                        FinishReason::ContentFilter => Stop::new(
                            Reason::Stop,
                            "the backend's content filter ended the output",
                        ),
                        _ => Stop::plain(Reason::Stop),
                    };
                }
                control_turns += 1;
                if control_turns >= self.engine.config.max_control_turns {
                    return Stop::new(
                        Reason::Stop,
                        format!("{control_turns} turns in a row held only control calls"),
                    );
                }
                self.add_tool_results(&[], &controls, &recorded, Vec::new());
                continue;
            }
            control_turns = 0;

            let replies = match self.run_within_budget(&normal).await {
                Ok(replies) => replies,
                Err(stop) => return stop,
            };
            self.add_tool_results(&normal, &controls, &recorded, replies);
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
