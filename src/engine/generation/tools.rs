//! Running the model's tool calls within the request's budget, and handing their replies back.
//!
//! One tool iteration is one turn's calls, run together, and is counted only once they all
//! answered. Each tool has its own timeout, and cancellation and the deadline end the wait for
//! all of them. A reply is cut to `limits.max_tool_result_bytes` before the model or the events
//! see it, because a tool service is a peer whose answers must not grow the conversation
//! without bound.

use std::time::Duration;

use futures_util::future::join_all;
use serde_json::json;
use tracing::Instrument;

use crate::protocol::{EventBody, Reason, Severity};
use crate::telemetry::{self, KeyValue};
use crate::tools::{ToolInvocation, ToolReply};

use super::Generation;
use super::calls::ModelCall;
use super::control_calls::RecordedControls;
use super::ending::Stop;

/// The request's tool iterations: how many are left, and how many were run. Only a turn's
/// tools, run here, spend one; the BIOS tells the model what is left.
pub(super) struct ToolBudget {
    pub(super) left: u32,
    pub(super) used: u32,
}

impl ToolBudget {
    pub(super) fn new(iterations: u32) -> Self {
        ToolBudget {
            left: iterations,
            used: 0,
        }
    }

    /// One iteration ran (the budget was checked before it started).
    fn spend(&mut self) {
        self.left -= 1;
        self.used += 1;
    }
}

impl Generation<'_> {
    /// Runs a turn's tool calls as one tool iteration: refused once the budget is spent, and
    /// stopped before they run when the same calls repeat in a loop.
    pub(super) async fn run_within_budget(
        &mut self,
        calls: &[ModelCall],
    ) -> Result<Vec<ToolReply>, Stop> {
        if self.iterations.left == 0 {
            self.worker_signal(
                "TOOL_LIMIT_REACHED",
                Severity::Med,
                "the model called a tool with no tool iterations left".into(),
                json!({"tool_iterations": self.iterations.used}),
            )
            .await;
            return Err(Stop::new(
                Reason::ToolExecutionError,
                "tool budget exhausted",
            ));
        }
        for call in calls {
            if let Some(verdict) = self.loops.push_tool_call(
                &call.name,
                &serde_json::Value::Object(call.arguments.clone()),
            ) {
                return Err(self.loop_detected(verdict).await);
            }
        }
        let replies = self.run_tools(calls).await?;
        self.iterations.spend();
        Ok(replies)
    }

    /// Tells the caller the model called a tool (a `tool_call` event).
    pub(super) async fn announce_call(&mut self, call: &ModelCall) {
        self.events
            .emit(EventBody::ToolCall {
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments: serde_json::Value::Object(call.arguments.clone()),
            })
            .await;
    }

    async fn run_tools(&mut self, calls: &[ModelCall]) -> Result<Vec<ToolReply>, Stop> {
        for call in calls {
            self.announce_call(call).await;
        }
        let default_timeout = self.engine.config.default_tool_timeout;
        let runs = calls.iter().map(|call| {
            let tool = self
                .tools
                .bus
                .iter()
                .find(|t| t.name() == call.name)
                .expect("validated");
            let timeout = tool
                .definition
                .timeout_ms
                .map_or(default_timeout, Duration::from_millis);
            let span = tool_span(call);
            let invocation = ToolInvocation {
                name: call.name.clone(),
                arguments: call.arguments.clone(),
                request_id: self.ctx.request_id.clone(),
                call_id: call.id.clone(),
                job_name: self.request.job_name.clone(),
                // The tool service's span becomes a child of this call's.
                traceparent: telemetry::traceparent_of(&span)
                    .or_else(|| self.ctx.traceparent.clone()),
            };
            let run = self.engine.runner.run(invocation).instrument(span);
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
            stop = self.bounds.crossed("the request's deadline passed during a tool call") => {
                return Err(stop);
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
    pub(super) fn add_tool_results(
        &mut self,
        calls: &[ModelCall],
        controls: &[ModelCall],
        recorded: &RecordedControls,
        replies: Vec<ToolReply>,
    ) {
        let answers = tool_answers(calls, controls, recorded, replies);
        self.push_answers(answers, None);
    }
}

/// What answers each call: a tool's reply (an error reply as `{"error": ...}`), or a control
/// call's acknowledgement.
pub(super) fn tool_answers<'c>(
    calls: &'c [ModelCall],
    controls: &'c [ModelCall],
    recorded: &RecordedControls,
    replies: Vec<ToolReply>,
) -> Vec<(&'c ModelCall, String)> {
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
    answers
}

/// The span of one tool call, named as OpenTelemetry's GenAI conventions name it; none when
/// traces are not exported.
fn tool_span(call: &ModelCall) -> tracing::Span {
    if !telemetry::exporting() {
        return tracing::Span::none();
    }
    let span =
        tracing::info_span!("execute_tool", otel.name = %format!("execute_tool {}", call.name));
    telemetry::annotate(
        &span,
        vec![
            KeyValue::new("gen_ai.operation.name", "execute_tool"),
            KeyValue::new("gen_ai.tool.name", call.name.clone()),
            KeyValue::new("gen_ai.tool.call.id", call.id.clone()),
        ],
    );
    span
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
