//! The tool loop of one request: call the model, parse its calls, record control calls as
//! signals, correct invalid calls, run tools within the budget, and end in exactly one result.

mod calls;
mod checkpoint;
mod control_calls;
mod decision;
mod ending;
mod escalation;
mod prompt;
mod signalling;
mod turn;

use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::control;
use super::events::EventEmitter;
use super::loop_detect::LoopDetector;
use super::signals::SignalBook;
use super::{Engine, Finished, RequestContext};
use crate::llm::{ChatRequest, FinishReason, LlmError};
use crate::protocol::{
    EventBody, GenerationRequest, Message, Reason, Severity, Usage, ValidationReport,
};
use crate::settings::ToolMode;
use crate::tools::{Tool, ToolInvocation, ToolReply};

use calls::{ModelCall, Problem};
use control_calls::RecordedControls;
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

    /// The first backend call this request would make, exactly as it would be sent (what
    /// `genfleet bench` sends straight to a backend to compare with the worker's path).
    pub(super) fn first_call(mut self) -> Result<ChatRequest, String> {
        if let Some(stop) = self.resolve_tools() {
            return Err(stop.detail.unwrap_or_default());
        }
        Ok(self.chat_request(self.engine.system_shape()))
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
        recorded: &RecordedControls,
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
            answers.push((call, recorded.ack(call)));
        }
        self.push_answers(answers, None);
    }

    /// A correction turn: every call is answered (native mode requires it), then the model is
    /// shown what was wrong and the tools' examples, and asked to send its calls again.
    fn add_correction(
        &mut self,
        normal: &[ModelCall],
        controls: &[ModelCall],
        recorded: &RecordedControls,
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
                recorded.ack(call)
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
    let mut end = room.min(text.len());
    loop {
        while !text.is_char_boundary(end) {
            end -= 1;
        }
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
