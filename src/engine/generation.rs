//! The tool loop of one request: call the model, parse its calls, record control calls as
//! signals, correct invalid calls, run tools within the budget, and end in exactly one result.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::future::join_all;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::bios::BiosContext;
use super::chain::PastAttempt;
use super::control::{self, REQUEST_DECISION, SignalOrigin};
use super::events::EventEmitter;
use super::history::{self, SuggestionQuery};
use super::loop_detect::{LoopDetector, LoopVerdict};
use super::signals::SignalBook;
use super::text_calls::{self, InvalidCallKind, ParseMode, ParsedItem, TextCallParser};
use super::validation;
use super::{Engine, Finished, RequestContext, SystemShape};
use crate::llm::{ChatRequest, FinishReason, LlmError, StreamEvent, ToolSpec};
use crate::protocol::task::task_text;
use crate::protocol::text::{ceil_char_boundary, floor_char_boundary, head_bytes};
use crate::protocol::{
    Content, DecisionBlock, DecisionKind, DecisionOption, EventBody, FunctionCall,
    GenerationRequest, GenerationResult, Message, Reason, Role, Severity, Signal, SignalSource,
    SignalType, Timings, ToolCall, Usage, ValidationReport,
};
use crate::settings::ToolMode;
use crate::tools::{Tool, ToolInvocation, ToolReply};

/// Why the generation stops, with the detail the result carries.
struct Stop {
    reason: Reason,
    detail: Option<String>,
}

impl Stop {
    fn new(reason: Reason, detail: impl Into<String>) -> Stop {
        Stop {
            reason,
            detail: Some(detail.into()),
        }
    }

    fn plain(reason: Reason) -> Stop {
        Stop {
            reason,
            detail: None,
        }
    }
}

/// One call the model made, native or written as text.
struct ModelCall {
    id: String,
    name: String,
    arguments: serde_json::Map<String, serde_json::Value>,
    /// The argument string as the model sent it (native calls), kept for the conversation.
    raw_arguments: Option<String>,
}

/// An invalid call: corrected, or the request fails with `tool_parse_error`.
struct Problem {
    /// The native call id this problem answers, if there is one.
    call_id: Option<String>,
    tool: Option<String>,
    what: String,
}

/// What one backend call produced.
struct Turn {
    raw: String,
    visible: String,
    /// Whitespace seen before the turn's first visible words, not yet shown.
    lead: String,
    native: BTreeMap<usize, NativeCall>,
    parsed: Vec<ParsedItem>,
    finish: FinishReason,
}

#[derive(Default)]
struct NativeCall {
    id: Option<String>,
    name: String,
    arguments: String,
}

enum TurnError {
    Stop(Stop),
    ToolsRefused(String),
    /// The chat template refused the system messages laid out in this shape.
    SystemRefused(SystemShape, String),
}

impl From<Stop> for TurnError {
    fn from(stop: Stop) -> Self {
        TurnError::Stop(stop)
    }
}

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
        None
    }

    /// Fires the first checkpoint whose conditions hold (and that the chain has not passed):
    /// with confirmation the request ends at once with a decision request; without, it only
    /// signals.
    async fn checkpoint(&mut self) -> Option<Stop> {
        let texts: Vec<String> = self
            .request
            .system
            .iter()
            .cloned()
            .chain(
                self.request
                    .messages
                    .iter()
                    .filter(|m| m.role == Role::User)
                    .map(|m| m.text().into_owned()),
            )
            .map(|t| t.to_lowercase())
            .collect();
        let position = self.ctx.chain_position;
        let (checkpoint, matched) = self.request.checkpoints.iter().find_map(|c| {
            if self.ctx.chain.checkpoint_passed(&c.name)
                || c.min_attempt.is_some_and(|n| position < n)
            {
                return None;
            }
            let matched: Vec<String> = c
                .prompt_contains
                .iter()
                .filter(|k| {
                    let k = k.to_lowercase();
                    texts.iter().any(|t| t.contains(&k))
                })
                .cloned()
                .collect();
            (c.prompt_contains.is_empty() || !matched.is_empty()).then(|| (c.clone(), matched))
        })?;
        let mut meta = serde_json::Map::new();
        meta.insert("checkpoint".into(), json!(checkpoint.name));
        meta.insert("matched".into(), json!(matched));
        meta.insert("chain_position".into(), json!(position));
        if let Some(n) = checkpoint.min_attempt {
            meta.insert("min_attempt".into(), json!(n));
        }
        if let Some(message) = &checkpoint.message {
            meta.insert("message".into(), json!(message));
        }
        meta.insert(
            "prompt".into(),
            json!(summarise(&task_text(&self.request.messages), 2000)),
        );
        let why = if matched.is_empty() {
            String::new()
        } else {
            format!(" (the prompt mentions {})", matched.join(", "))
        };
        if !checkpoint.requires_confirmation {
            let summary = format!(
                "checkpoint {} passed without confirmation{why}",
                checkpoint.name
            );
            let signal = self.origin().signal(
                SignalType::Issue,
                "CHECKPOINT",
                SignalSource::Worker,
                Severity::Low,
                summary,
                meta,
            );
            self.push_worker_signal(signal).await;
            return None;
        }
        let summary = format!(
            "checkpoint {} asks for confirmation before the request runs{why}",
            checkpoint.name
        );
        let mut signal = self.origin().signal(
            SignalType::DecisionRequest,
            "CHECKPOINT",
            SignalSource::Worker,
            Severity::Med,
            summary,
            meta,
        );
        let at_limit = position >= self.engine.config.max_chain;
        if !at_limit {
            let question = checkpoint.message.clone().unwrap_or_else(|| {
                format!(
                    "Checkpoint {}: should this request run{why}?",
                    checkpoint.name
                )
            });
            signal.decision = Some(
                self.decision_block(
                    DecisionKind::Checkpoint,
                    question,
                    checkpoint_options(),
                    self.engine
                        .config
                        .escalation
                        .checkpoint_default_option
                        .clone(),
                    checkpoint.message.clone(),
                ),
            );
        }
        self.push_worker_signal(signal).await;
        Some(if at_limit {
            Stop::new(Reason::ToolExecutionError, "decision chain limit")
        } else {
            Stop::plain(Reason::DecisionRequested)
        })
    }

    /// Runs the tool loop, then holds the output to the request's checks: the first request
    /// of a chain gets one more try with the failed checks named, then a shortfall escalates.
    async fn validated_loop(&mut self) -> Stop {
        loop {
            let stop = self.tool_loop().await;
            if self.request.validation.is_empty()
                || !matches!(stop.reason, Reason::Stop | Reason::Length)
            {
                return stop;
            }
            let config = &self.engine.config.escalation;
            let threshold = (self
                .request
                .escalation_threshold
                .unwrap_or(config.threshold)
                - self.ctx.chain.confidence_boost)
                .max(0.0);
            let mut report =
                validation::evaluate(&self.request.validation, self.judged_answer(), threshold);
            report.retried = self.tries > 1;
            if report.passed {
                self.validation = Some(report);
                return stop;
            }
            let failed = report
                .failed_checks()
                .map(|c| format!("{}: {}", c.name, c.detail.as_deref().unwrap_or("failed")));
            self.ctx.chain.push_attempt(PastAttempt::new(
                self.ctx.chain_position,
                self.tries,
                Some(report.confidence),
                failed,
            ));
            if self.tries == 1 && self.ctx.chain_position == 1 && config.auto_retry_on_first_failure
            {
                self.auto_retry(&report).await;
                continue;
            }
            let stop = self.escalate(&report).await;
            self.validation = Some(report);
            return stop;
        }
    }

    /// The output since the answer under judgement began: all of it, or the retry's.
    fn judged_answer(&self) -> &str {
        self.output
            .get(self.answer_from..)
            .unwrap_or_default()
            .trim_start_matches('\n')
    }

    /// Sends the model back to its answer with the failed checks named. The output keeps the
    /// first answer (it was streamed, and `output` is every turn); the checks judge the retry.
    async fn auto_retry(&mut self, report: &ValidationReport) {
        let failed: Vec<&str> = report.failed_checks().map(|c| c.name.as_str()).collect();
        let summary = format!(
            "the answer scored {:.2}, below {:.2}; retrying once with the failed checks named",
            report.confidence, report.threshold
        );
        let meta = json!({
            "confidence": report.confidence,
            "threshold": report.threshold,
            "pass_rate": report.pass_rate,
            "failed_checks": failed,
        });
        self.worker_signal("LOW_CONFIDENCE", Severity::Low, summary, meta)
            .await;
        self.conversation
            .push(Message::user(validation::retry_note(report)));
        self.answer_from = self.output.len();
        self.tries += 1;
    }

    /// Ends the request with `escalation.LOW_CONFIDENCE`, whose decision offers retry, skip,
    /// abort and modify_prompt and whose meta holds the context a manager needs.
    async fn escalate(&mut self, report: &ValidationReport) -> Stop {
        let task = task_text(&self.request.messages);
        let query = SuggestionQuery {
            code: "LOW_CONFIDENCE".into(),
            confidence: report.confidence,
            pass_rate: report.pass_rate,
            prompt: task.clone(),
        };
        let entries =
            tokio::time::timeout(HISTORY_WAIT, self.engine.history.entries("LOW_CONFIDENCE"))
                .await
                .unwrap_or_default();
        let suggestions = history::suggestions(&query, &entries);
        let passed = report.checks.iter().filter(|c| c.passed).count();
        let mut meta = serde_json::Map::new();
        meta.insert("checks".into(), json!(report.checks));
        meta.insert("confidence".into(), json!(report.confidence));
        meta.insert("threshold".into(), json!(report.threshold));
        meta.insert("pass_rate".into(), json!(report.pass_rate));
        meta.insert("chain_position".into(), json!(self.ctx.chain_position));
        meta.insert("attempt".into(), json!(self.ctx.attempt));
        meta.insert("tries".into(), json!(self.tries));
        meta.insert("error_history".into(), json!(self.ctx.chain.error_history));
        meta.insert("prompt".into(), json!(summarise(&task, 2000)));
        meta.insert(
            "output_summary".into(),
            json!(summarise(self.judged_answer(), 1000)),
        );
        meta.insert("suggestions".into(), json!(suggestions));
        let summary = format!(
            "the output scored {:.2}, below the threshold {:.2} ({passed} of {} checks passed)",
            report.confidence,
            report.threshold,
            report.checks.len()
        );
        let mut signal = self.origin().signal(
            SignalType::Escalation,
            "LOW_CONFIDENCE",
            SignalSource::Worker,
            Severity::Med,
            summary,
            meta,
        );
        let at_limit = self.ctx.chain_position >= self.engine.config.max_chain;
        if !at_limit {
            let failed: Vec<&str> = report.failed_checks().map(|c| c.name.as_str()).collect();
            signal.decision = Some(self.decision_block(
                DecisionKind::Escalation,
                "The output fell short of its checks. How should this job go on?".into(),
                escalation_options(),
                self.engine.config.escalation.default_option.clone(),
                Some(format!(
                    "confidence {:.2} (needed {:.2}); failed: {}",
                    report.confidence,
                    report.threshold,
                    failed.join("; ")
                )),
            ));
        }
        self.push_worker_signal(signal).await;
        if at_limit {
            Stop::new(Reason::ToolExecutionError, "decision chain limit")
        } else {
            Stop::plain(Reason::DecisionRequested)
        }
    }

    fn decision_block(
        &self,
        kind: DecisionKind,
        question: String,
        options: Vec<DecisionOption>,
        default_option: Option<String>,
        context: Option<String>,
    ) -> DecisionBlock {
        DecisionBlock {
            decision_id: crate::protocol::ids::new_id(),
            question,
            options,
            default_option,
            context,
            kind,
            expires_at: self.engine.config.decision_ttl.map(|ttl| {
                humantime::format_rfc3339_millis(std::time::SystemTime::now() + ttl).to_string()
            }),
        }
    }

    async fn tool_loop(&mut self) -> Stop {
        let config = &self.engine.config;
        let mut corrections_left = config.correction_attempts;
        let mut control_turns = 0;
        loop {
            let turn = match self.model_turn().await {
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
            let (controls, normal): (Vec<ModelCall>, Vec<ModelCall>) = calls
                .into_iter()
                .partition(|c| control::is_control_tool(&c.name));

            for call in &normal {
                match self.tools.iter().find(|t| t.name() == call.name) {
                    None => problems.push(Problem {
                        call_id: Some(call.id.clone()),
                        tool: None,
                        what: format!("`{}` is not a tool you can call", call.name),
                    }),
                    Some(tool) => problems.extend(argument_problems(tool, call)),
                }
            }
            // Control calls are recorded whenever they appear; an invalid one is corrected.
            let mut decision_stop = false;
            let mut recorded = BTreeMap::new();
            for call in &controls {
                let tool = control::control_tool(&call.name).expect("partitioned as control");
                let arg_problems = argument_problems(tool, call);
                if !arg_problems.is_empty() {
                    problems.extend(arg_problems);
                    continue;
                }
                let wants_decision = call.name == REQUEST_DECISION && self.stop_on_decision();
                let at_chain_limit = self.ctx.chain_position >= self.engine.config.max_chain;
                let awaits = wants_decision && !at_chain_limit;
                match control::to_signal(&call.name, &call.arguments, &self.origin(), awaits) {
                    Ok(mut signal) => {
                        if let (Some(decision), Some(ttl)) =
                            (signal.decision.as_mut(), self.engine.config.decision_ttl)
                        {
                            decision.expires_at = Some(
                                humantime::format_rfc3339_millis(
                                    std::time::SystemTime::now() + ttl,
                                )
                                .to_string(),
                            );
                        }
                        let kept = self.model_signal(signal).await;
                        if kept && wants_decision && at_chain_limit {
                            self.conversation.push(assistant);
                            return Stop::new(Reason::ToolExecutionError, "decision chain limit");
                        }
                        decision_stop |= kept && awaits;
                        recorded.insert(call.id.clone(), kept);
                    }
                    Err(what) => problems.push(Problem {
                        call_id: Some(call.id.clone()),
                        tool: Some(call.name.clone()),
                        what,
                    }),
                }
            }
            self.conversation.push(assistant);
            if decision_stop {
                return Stop::plain(Reason::DecisionRequested);
            }

            if !problems.is_empty() {
                if corrections_left == 0 {
                    return Stop::new(Reason::ToolParseError, problems[0].what.clone());
                }
                corrections_left -= 1;
                self.add_correction(&normal, &controls, &recorded, &problems);
                continue;
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

            if self.iterations_left == 0 {
                self.worker_signal(
                    "TOOL_LIMIT_REACHED",
                    Severity::Med,
                    "the model called a tool with no tool iterations left".into(),
                    json!({"tool_iterations": self.iterations_used}),
                )
                .await;
                return Stop::new(Reason::ToolExecutionError, "tool budget exhausted");
            }
            for call in &normal {
                if let Some(verdict) = self.loops.push_tool_call(
                    &call.name,
                    &serde_json::Value::Object(call.arguments.clone()),
                ) {
                    return self.loop_detected(verdict).await;
                }
            }
            let results = match self.run_tools(&normal).await {
                Ok(results) => results,
                Err(stop) => return stop,
            };
            self.iterations_left -= 1;
            self.iterations_used += 1;
            self.add_tool_results(&normal, &controls, &recorded, results);
        }
    }

    fn stop_on_decision(&self) -> bool {
        self.request
            .stop_on_decision_request
            .unwrap_or(self.engine.config.stop_on_decision_request)
    }

    fn max_tokens(&self) -> Option<u32> {
        self.request
            .max_tokens
            .or(Some(self.engine.config.default_max_tokens).filter(|n| *n > 0))
    }

    fn origin(&self) -> SignalOrigin<'_> {
        SignalOrigin {
            request_id: &self.ctx.request_id,
            root_request_id: &self.ctx.root_request_id,
            job_name: self.request.job_name.as_deref(),
            worker_id: &self.ctx.worker_id,
            pool: &self.ctx.pool,
        }
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
    fn chat_request(&self, shape: SystemShape) -> ChatRequest {
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

    /// The first backend call this request would make, exactly as it would be sent (what
    /// `genfleet bench` sends straight to a backend to compare with the worker's path).
    pub(super) fn first_call(mut self) -> Result<ChatRequest, String> {
        if let Some(stop) = self.resolve_tools() {
            return Err(stop.detail.unwrap_or_default());
        }
        Ok(self.chat_request(self.engine.system_shape()))
    }

    /// Streams one model call. Cancellation and the deadline are checked at every await.
    async fn model_turn(&mut self) -> Result<Turn, TurnError> {
        let shape = self.engine.system_shape();
        let chat = self.chat_request(shape);
        let mut stream = self.engine.backend.chat_stream(chat);
        let parse_mode = match self.mode {
            ToolMode::Native => ParseMode::Native,
            ToolMode::Text => ParseMode::Text,
        };
        let mut parser = TextCallParser::new(parse_mode);
        let mut turn = Turn {
            raw: String::new(),
            visible: String::new(),
            lead: String::new(),
            native: BTreeMap::new(),
            parsed: Vec::new(),
            finish: FinishReason::Stop,
        };
        let mut finish = None;
        let mut any_token = false;
        let mut visible = String::new();
        loop {
            let flush_at = self.events.flush_deadline();
            let item = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => {
                    return Err(self.interrupted(&turn, Stop::plain(Reason::Cancelled)).into());
                }
                _ = sleep_until(self.deadline) => {
                    let stop = Stop::new(Reason::Timeout, "the request's deadline passed");
                    return Err(self.interrupted(&turn, stop).into());
                }
                _ = sleep_until(flush_at) => {
                    self.events.flush().await;
                    continue;
                }
                item = stream.next() => item,
            };
            let event = match item {
                None if finish.is_some() => break,
                None => {
                    let stop = Stop::new(
                        Reason::BackendError,
                        "the backend stream ended without a finish reason",
                    );
                    return Err(self.interrupted(&turn, stop).into());
                }
                Some(Err(LlmError::ToolsRejected(body)))
                    if !any_token && self.mode == ToolMode::Native =>
                {
                    return Err(TurnError::ToolsRefused(body));
                }
                Some(Err(LlmError::SystemRejected(body))) if !any_token => {
                    return Err(TurnError::SystemRefused(shape, body));
                }
                Some(Err(error)) => {
                    let stop = Stop::new(Reason::BackendError, error.to_string());
                    return Err(self.interrupted(&turn, stop).into());
                }
                Some(Ok(event)) => event,
            };
            if !any_token && !matches!(event, StreamEvent::Usage(_) | StreamEvent::Finish(_)) {
                any_token = true;
                self.first_token
                    .get_or_insert_with(|| self.started_at.elapsed());
            }
            match event {
                StreamEvent::Text(text) => {
                    push_capped(
                        &mut turn.raw,
                        &text,
                        self.engine.config.max_output_bytes,
                        &mut self.truncated,
                    );
                    visible.clear();
                    parser.push(&text, &mut visible);
                    if let Err(stop) = self.show(&visible, &mut turn).await {
                        return Err(self.interrupted(&turn, stop).into());
                    }
                }
                StreamEvent::Reasoning(text) => {
                    push_capped(
                        &mut self.reasoning,
                        &text,
                        self.engine.config.max_output_bytes,
                        &mut self.truncated,
                    );
                    self.events.emit(EventBody::Reasoning { text }).await;
                }
                StreamEvent::ToolCall(delta) => {
                    let call = turn.native.entry(delta.index).or_default();
                    if let Some(id) = delta.id {
                        call.id = Some(id);
                    }
                    if let Some(name) = delta.name {
                        call.name.push_str(&name);
                    }
                    push_capped(
                        &mut call.arguments,
                        &delta.arguments,
                        self.engine.config.max_output_bytes,
                        &mut self.truncated,
                    );
                }
                StreamEvent::Usage(usage) => self.usage.add(usage),
                StreamEvent::Finish(reason) => finish = Some(reason),
            }
        }
        visible.clear();
        turn.parsed = parser.finish(&mut visible);
        if let Err(stop) = self.show(&visible, &mut turn).await {
            return Err(self.interrupted(&turn, stop).into());
        }
        if let Some(verdict) = self.loops.end_turn() {
            let stop = self.loop_detected(verdict).await;
            return Err(self.interrupted(&turn, stop).into());
        }
        self.events.flush().await;
        turn.finish = finish.unwrap_or(FinishReason::Stop);
        Ok(turn)
    }

    /// Adds visible text to the output and the event stream, and watches it for loops.
    async fn show(&mut self, text: &str, turn: &mut Turn) -> Result<(), Stop> {
        if text.is_empty() {
            return Ok(());
        }
        let held;
        let mut text = text;
        if turn.visible.is_empty() {
            // Blank lines before a turn's first words (and whitespace between calls) are not
            // output; indentation on the first line is.
            if text.trim().is_empty() {
                turn.lead.push_str(text);
                return Ok(());
            }
            turn.lead.push_str(text);
            held = std::mem::take(&mut turn.lead);
            text = &held;
            let blank = text.len() - text.trim_start().len();
            if let Some(newline) = text[..blank].rfind('\n') {
                text = &text[newline + 1..];
            }
        }
        if turn.visible.is_empty() && !self.output.is_empty() && !self.output.ends_with('\n') {
            // A later turn starts a new paragraph of the output (and of the streamed text).
            let cap = self.engine.config.max_output_bytes;
            push_capped(&mut self.output, "\n\n", cap, &mut self.truncated);
            self.events.delta("\n\n").await;
        }
        let cap = self.engine.config.max_output_bytes;
        push_capped(&mut turn.visible, text, cap, &mut self.truncated);
        push_capped(&mut self.output, text, cap, &mut self.truncated);
        self.events.delta(text).await;
        match self.loops.push_text(text) {
            Some(verdict) => Err(self.loop_detected(verdict).await),
            None => Ok(()),
        }
    }

    /// A turn cut short: keep what the model said in the conversation.
    fn interrupted(&mut self, turn: &Turn, stop: Stop) -> Stop {
        if !turn.raw.is_empty() {
            self.conversation.push(Message::assistant(turn.raw.clone()));
        }
        stop
    }

    async fn loop_detected(&mut self, verdict: LoopVerdict) -> Stop {
        let detail = verdict.detail.clone();
        self.worker_signal(
            "LOOP_DETECTED",
            Severity::High,
            format!("the model was stopped in a loop: {detail}"),
            json!({"kind": format!("{:?}", verdict.kind), "detail": detail}),
        )
        .await;
        Stop::new(Reason::LoopDetected, detail)
    }

    fn call_id(&mut self) -> String {
        self.next_call_id += 1;
        format!("call_{}_{}", self.ctx.chain_position, self.next_call_id)
    }

    /// The turn's calls in order (native first, then those written as text), and the invalid ones.
    fn collect_calls(&mut self, turn: &Turn) -> (Vec<ModelCall>, Vec<Problem>) {
        let mut calls = Vec::new();
        let mut problems = Vec::new();
        for native in turn.native.values() {
            let id = native.id.clone().unwrap_or_else(|| self.call_id());
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
                    let id = call.id.clone().unwrap_or_else(|| self.call_id());
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
    fn assistant_message(&self, turn: &Turn, calls: &[ModelCall]) -> Message {
        if self.mode == ToolMode::Text || calls.is_empty() {
            return Message::assistant(turn.raw.clone());
        }
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

    async fn run_tools(&mut self, calls: &[ModelCall]) -> Result<Vec<ToolReply>, Stop> {
        for call in calls {
            self.events
                .emit(EventBody::ToolCall {
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    arguments: serde_json::Value::Object(call.arguments.clone()),
                })
                .await;
        }
        let default_timeout = self.engine.config.default_tool_timeout;
        let runs = calls.iter().map(|call| {
            let tool = self
                .tools
                .iter()
                .find(|t| t.name() == call.name)
                .expect("validated");
            let timeout = tool
                .definition
                .timeout_ms
                .map_or(default_timeout, Duration::from_millis);
            let invocation = ToolInvocation {
                name: call.name.clone(),
                arguments: call.arguments.clone(),
                request_id: self.ctx.request_id.clone(),
                call_id: call.id.clone(),
                job_name: self.request.job_name.clone(),
                traceparent: self.ctx.traceparent.clone(),
            };
            let run = self.engine.runner.run(invocation);
            async move {
                match tokio::time::timeout(timeout, run).await {
                    Ok(Ok(reply)) => Ok(reply),
                    Ok(Err(error)) => Err(format!("tool `{}` failed: {error}", call.name)),
                    Err(_) => Err(format!(
                        "tool `{}` timed out after {} ms",
                        call.name,
                        timeout.as_millis()
                    )),
                }
            }
        });
        let all = join_all(runs);
        let results = tokio::select! {
            biased;
            _ = self.cancel.cancelled() => return Err(Stop::plain(Reason::Cancelled)),
            _ = sleep_until(self.deadline) => {
                return Err(Stop::new(Reason::Timeout, "the request's deadline passed during a tool call"));
            }
            results = all => results,
        };
        let mut replies = Vec::with_capacity(results.len());
        for (call, result) in calls.iter().zip(results) {
            match result {
                Ok(reply) => {
                    let reply = bound_tool_reply(reply, self.engine.config.max_tool_result_bytes);
                    let (ok, value) = match &reply {
                        ToolReply::Ok(v) => (true, v.clone()),
                        ToolReply::Error(v) => (false, v.clone()),
                    };
                    self.events
                        .emit(EventBody::ToolResult {
                            call_id: call.id.clone(),
                            name: call.name.clone(),
                            ok,
                            result: value,
                        })
                        .await;
                    replies.push(reply);
                }
                Err(detail) => return Err(Stop::new(Reason::ToolExecutionError, detail)),
            }
        }
        Ok(replies)
    }

    /// Tool results (and control acknowledgements) go back to the model.
    fn add_tool_results(
        &mut self,
        calls: &[ModelCall],
        controls: &[ModelCall],
        recorded: &BTreeMap<String, bool>,
        replies: Vec<ToolReply>,
    ) {
        let mut answers: Vec<(&ModelCall, String)> = calls
            .iter()
            .zip(replies)
            .map(|(call, reply)| {
                let content = match reply {
                    ToolReply::Ok(value) => value.to_string(),
                    ToolReply::Error(error) => json!({ "error": error }).to_string(),
                };
                (call, content)
            })
            .collect();
        for call in controls {
            answers.push((call, control_ack(recorded.get(&call.id).copied())));
        }
        self.push_answers(answers, None);
    }

    /// A correction turn: every call is answered (native mode requires it), then the model is
    /// shown what was wrong and the tools' examples, and asked to send its calls again.
    fn add_correction(
        &mut self,
        normal: &[ModelCall],
        controls: &[ModelCall],
        recorded: &BTreeMap<String, bool>,
        problems: &[Problem],
    ) {
        let mut answers = Vec::new();
        let mut answered = std::collections::HashSet::new();
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
                control_ack(recorded.get(&call.id).copied())
            } else {
                json!({"error": {"code": "NOT_EXECUTED", "message": "not run: another call in the same message was invalid"}}).to_string()
            };
            answers.push((call, content));
        }
        let text = self.correction_text(problems);
        self.push_answers(answers, Some(text));
    }

    fn push_answers(&mut self, answers: Vec<(&ModelCall, String)>, note: Option<String>) {
        match self.mode {
            ToolMode::Native => {
                // Calls the model wrote without an id in native mode were given one when they
                // were added to the assistant message, so every call has its answer here.
                for (call, content) in answers {
                    self.conversation
                        .push(Message::tool(call.id.clone(), content));
                }
                if let Some(note) = note {
                    self.conversation.push(Message::user(note));
                }
            }
            ToolMode::Text => {
                let mut text = String::new();
                for (call, content) in answers {
                    let body = json!({"name": call.name, "content": RawJson(&content)});
                    let _ = writeln!(text, "<tool_response>\n{body}\n</tool_response>");
                }
                if let Some(note) = note {
                    text.push_str(&note);
                }
                if !text.is_empty() {
                    self.conversation
                        .push(Message::user(text.trim_end().to_string()));
                }
            }
        }
    }

    fn correction_text(&self, problems: &[Problem]) -> String {
        let mut text = String::from("Your last tool call could not be used:\n");
        for problem in problems {
            let _ = writeln!(text, "- {}", problem.what);
        }
        let mut shown = std::collections::HashSet::new();
        for problem in problems {
            let Some(name) = &problem.tool else { continue };
            if !shown.insert(name.clone()) {
                continue;
            }
            let tool = self
                .tools
                .iter()
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
            for tool in self.tools.iter().chain(control::control_tools()) {
                let _ = writeln!(
                    text,
                    "- {}: {}",
                    tool.definition.name, tool.definition.brief
                );
            }
        }
        text.push_str("\nSend your tool calls again, corrected.");
        if self.mode == ToolMode::Text {
            text.push_str(
                " Write each as <tool_call>{\"name\": \"TOOL_NAME\", \"arguments\": {...}}</tool_call>.",
            );
        }
        text
    }

    async fn model_signal(&mut self, signal: Signal) -> bool {
        let kept = self.signals.add(signal).cloned();
        let Some(signal) = kept else {
            tracing::debug!(message = "model signal dropped by the per-request bound", request_id = %self.ctx.request_id);
            return false;
        };
        self.events
            .emit(EventBody::Signal {
                signal: Box::new(signal),
            })
            .await;
        true
    }

    async fn worker_signal(
        &mut self,
        code: &str,
        severity: Severity,
        summary: String,
        meta: serde_json::Value,
    ) {
        let meta = match meta {
            serde_json::Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        let signal = self.origin().signal(
            SignalType::Issue,
            code,
            SignalSource::Worker,
            severity,
            summary,
            meta,
        );
        self.push_worker_signal(signal).await;
    }

    /// Records a signal the worker raises (always kept, meta bounded) and emits it.
    async fn push_worker_signal(&mut self, signal: Signal) {
        if let Some(signal) = self.signals.add(signal).cloned() {
            self.events
                .emit(EventBody::Signal {
                    signal: Box::new(signal),
                })
                .await;
        }
    }

    async fn finish(mut self, stop: Stop) -> Finished {
        self.events.flush().await;
        let total = self.ctx.accepted_at.elapsed();
        let queued = self
            .started_at
            .saturating_duration_since(self.ctx.accepted_at);
        let signals_dropped = self.signals.dropped();
        let result = GenerationResult {
            request_id: self.ctx.request_id,
            root_request_id: self.ctx.root_request_id,
            parent_request_id: self.ctx.parent_request_id,
            job_name: self.request.job_name,
            state: stop.reason.state(),
            reason: stop.reason,
            detail: stop.detail,
            output: self.output,
            reasoning: self.reasoning,
            messages: self.conversation,
            signals: self.signals.into_signals(),
            signals_dropped,
            tool_iterations_used: self.iterations_used,
            usage: self.usage,
            worker_id: self.ctx.worker_id,
            attempt: self.ctx.attempt,
            chain_position: self.ctx.chain_position,
            truncated: self.truncated,
            metadata: self.request.metadata,
            timings_ms: Timings {
                queued: queued.as_millis() as u64,
                first_token: self.first_token.map(|d| d.as_millis() as u64),
                total: total.as_millis() as u64,
            },
            validation: self.validation,
        };
        Finished {
            result,
            events: self.events,
        }
    }
}

fn argument_problems(tool: &Tool, call: &ModelCall) -> Vec<Problem> {
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

fn control_ack(kept: Option<bool>) -> String {
    match kept {
        Some(false) => json!({"recorded": false, "reason": "signal limit reached"}).to_string(),
        _ => json!({"recorded": true}).to_string(),
    }
}

/// Embeds text that already is JSON without quoting it again.
struct RawJson<'a>(&'a str);

impl serde::Serialize for RawJson<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match serde_json::from_str::<serde_json::Value>(self.0) {
            Ok(value) => value.serialize(serializer),
            Err(_) => serializer.serialize_str(self.0),
        }
    }
}

/// Appends at most up to `cap` bytes (on a char boundary), noting when text was cut.
fn push_capped(buffer: &mut String, text: &str, cap: usize, truncated: &mut bool) {
    let room = cap.saturating_sub(buffer.len());
    if text.len() <= room {
        buffer.push_str(text);
        return;
    }
    *truncated = true;
    buffer.push_str(head_bytes(text, room));
}

/// How long an escalation waits for the decision history before it goes without suggestions.
const HISTORY_WAIT: Duration = Duration::from_secs(3);

fn option(id: &str, label: &str, pros: &str, cons: &str) -> DecisionOption {
    DecisionOption {
        id: id.into(),
        label: label.into(),
        pros: Some(pros.into()),
        cons: Some(cons.into()),
    }
}

/// What an escalation offers.
pub fn escalation_options() -> Vec<DecisionOption> {
    vec![
        option(
            "retry",
            "Run it again",
            "cheap; guidance and a confidence_boost can be added",
            "the same prompt may fall short the same way",
        ),
        option(
            "skip",
            "Skip this step",
            "the chain ends now; nothing more is spent",
            "this step's output stays below its checks",
        ),
        option(
            "abort",
            "Abort the job",
            "stops a job that is going wrong",
            "all work on it ends",
        ),
        option(
            "modify_prompt",
            "Run it again with a new prompt",
            "fixes a prompt that misleads the model",
            "needs modified_prompt, written by the manager",
        ),
    ]
}

/// What a checkpoint offers.
pub fn checkpoint_options() -> Vec<DecisionOption> {
    vec![
        option(
            "proceed",
            "Run it as asked",
            "the job goes on unchanged",
            "whatever the checkpoint guards against may happen",
        ),
        option(
            "skip",
            "Skip this step",
            "nothing runs; the chain ends",
            "the step's work is not done",
        ),
        option(
            "abort",
            "Abort the job",
            "nothing runs; the job is stopped",
            "all work on it ends",
        ),
        option(
            "modify_prompt",
            "Run it with a new prompt",
            "the step runs in a safer form",
            "needs modified_prompt, written by the manager",
        ),
    ]
}

/// The first and last part of a long text, for people.
fn summarise(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let half = max / 2;
    let head = floor_char_boundary(text, half);
    let tail = ceil_char_boundary(text, text.len() - half);
    format!(
        "{} … [{} bytes left out] … {}",
        &text[..head],
        tail - head,
        &text[tail..]
    )
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// A tool's answer as the model and the conversation get it: at most `max` bytes of JSON text.
/// A larger answer is replaced by what it began with, marked as cut, so the model knows.
fn bound_tool_reply(reply: ToolReply, max: usize) -> ToolReply {
    let (ok, value) = match reply {
        ToolReply::Ok(value) => (true, value),
        ToolReply::Error(value) => (false, value),
    };
    let text = value.to_string();
    if text.len() <= max {
        return if ok {
            ToolReply::Ok(value)
        } else {
            ToolReply::Error(value)
        };
    }
    // Room for the envelope; the head is cut at a character boundary, short enough that it
    // still fits once its quotes and escapes are written out.
    let room = max.saturating_sub(200);
    let mut end = room;
    loop {
        end = floor_char_boundary(&text, end);
        let escaped = serde_json::to_string(&text[..end]).map_or(usize::MAX, |s| s.len());
        if escaped <= room || end == 0 {
            break;
        }
        end = end * room / escaped;
    }
    let bounded = json!({
        "truncated": true,
        "original_bytes": text.len(),
        "head": &text[..end],
        "note": format!("the tool's answer was {} bytes; only its first {end} bytes are shown", text.len()),
    });
    if ok {
        ToolReply::Ok(bounded)
    } else {
        ToolReply::Error(bounded)
    }
}
