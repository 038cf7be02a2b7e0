//! One generation: the tool loop of one request, from its `started` event to exactly one
//! terminal result.
//!
//! This file holds the loop that drives a generation. Each job the loop hands out has a file of
//! its own, so that the loop reads as the flow, and a part of the state that one job alone
//! changes lives in that job's file ([`state`] holds the parts several share). In the order a
//! request meets them: [`checkpoint`] (before anything runs); then, each turn, [`prompt`] and
//! [`turn`] (the backend called and its stream read), [`calls`] (the calls gathered and
//! checked), [`control_calls`] (the signals the model raises), [`correction`] or [`tools`] (run
//! within the budget), and [`answers`] (what goes back to the model); after the loop,
//! [`escalation`] (the output held to its checks); last, [`ending`]. [`signalling`] and
//! [`decision`] serve them all: the signals raised, within their bounds, and the decisions asked
//! of managers.

mod answers;
mod caller_calls;
mod calls;
mod checkpoint;
mod control_calls;
mod correction;
mod decision;
mod ending;
mod escalation;
mod progress;
mod prompt;
mod signalling;
mod state;
mod tools;
mod turn;

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::control;
use super::events::EventEmitter;
use super::loop_detect::LoopDetector;
use super::signals::SignalBook;
use super::{Engine, Finished, RequestContext};
use crate::llm::{ChatRequest, FinishReason, LlmError};
use crate::protocol::{EventBody, GenerationRequest, Message, Reason, Severity};
use crate::settings::ToolMode;

use caller_calls::TurnCalls;
use calls::{CallIds, ModelCall};
use ending::Stop;
use escalation::Judgement;
use progress::{Carried, Checkpointing};
use state::{Bounds, ToolSet, Transcript};
use tools::ToolBudget;
use turn::{Meter, TurnError};

/// A generation's state, in parts each owned by the step that changes it. The request, its
/// context and the engine are what it runs on; the parts are what it has done so far.
pub(super) struct Generation<'e> {
    engine: &'e Engine,
    request: GenerationRequest,
    /// The request's place in its chain; only the escalation adds to it (a failed attempt).
    ctx: RequestContext,
    bounds: Bounds,
    /// Every step tells the caller what it does here, in order.
    events: EventEmitter,
    tools: ToolSet,
    transcript: Transcript,
    call_ids: CallIds,
    iterations: ToolBudget,
    meter: Meter,
    /// The signals raised so far, within their bounds; only [`signalling`] adds to it.
    signals: SignalBook,
    /// Fed the visible text by the turn and the calls by the tool step, which stop the
    /// generation when it reports a loop.
    loops: LoopDetector,
    judgement: Judgement,
    /// When its checkpoints are due, and where they go.
    checkpoints: Checkpointing,
    /// The turn a checkpoint was cut in, continued by a resumed run's first turn.
    carried: Option<Carried>,
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
        let checkpoints = Checkpointing::new(
            ctx.continuity.store.clone(),
            config.checkpoint_every,
            engine.continues_turns(&request),
            ctx.continuity.hand_off.clone(),
        );
        let mut events = events;
        if checkpoints.writes() {
            events.keep_recent();
        }
        Generation {
            checkpoints,
            carried: None,
            events,
            signals: SignalBook::new(config.signal_limits),
            loops: LoopDetector::new(&config.loop_detection),
            tools: ToolSet::new(engine.effective_tool_mode()),
            transcript: Transcript::new(request.messages.clone()),
            iterations: ToolBudget::new(iterations),
            meter: Meter::new(),
            call_ids: CallIds::default(),
            judgement: Judgement::new(),
            engine,
            request,
            ctx,
            bounds: Bounds { cancel, deadline },
        }
    }

    /// Every way a generation goes ends in [`Generation::finish`], so `Engine::run` always has a
    /// terminal result to return.
    pub(super) async fn run(mut self) -> Finished {
        let resume = self.ctx.continuity.from.clone();
        let first = match &resume {
            None => EventBody::Started {
                worker_id: self.ctx.worker_id.clone(),
                attempt: self.ctx.attempt,
                chain_position: self.ctx.chain_position,
            },
            Some(resume) => EventBody::Resumed {
                worker_id: self.ctx.worker_id.clone(),
                attempt: self.ctx.attempt,
                from_worker: resume.from_worker.clone(),
                reason: resume.reason,
                turn_restarted: self.take_up(resume),
            },
        };
        self.events.emit(first).await;
        let stop = match self.resolve_tools() {
            Some(stop) => stop,
            // A resumed run passed its decision checkpoints where it started.
            None if resume.is_some() => self.validated_loop().await,
            None => match self.checkpoint().await {
                Some(stop) => stop,
                None => self.validated_loop().await,
            },
        };
        self.finish(stop).await
    }

    /// Takes the request's tools from the catalog as it is now; an unknown tool ends the
    /// request before the model is called.
    fn resolve_tools(&mut self) -> Option<Stop> {
        self.tools.resolve(&self.engine.catalog(), &self.request)
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
            if let Err(stop) = self.checkpoint_between_turns().await {
                return stop;
            }
            let span = self.turn_span();
            let before = self.meter.usage;
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
                    self.tools.mode = ToolMode::Text;
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
                self.transcript
                    .conversation
                    .push(Message::assistant(turn.raw));
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
                .any(|c| self.tools.is_caller_tool(&c.name))
                .then(|| calls.clone());
            let (controls, normal): (Vec<ModelCall>, Vec<ModelCall>) = calls
                .into_iter()
                .partition(|c| control::is_control_tool(&c.name));

            problems.extend(self.tool_call_problems(&normal));
            let recorded = match self.record_control_calls(&controls, &mut problems).await {
                Ok(recorded) => recorded,
                Err(stop) => {
                    self.transcript.conversation.push(assistant);
                    return stop;
                }
            };
            self.transcript.conversation.push(assistant);
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
                .partition(|c| self.tools.is_caller_tool(&c.name));
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
