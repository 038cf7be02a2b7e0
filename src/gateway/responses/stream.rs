//! A response streamed as the Responses API's server-sent events, in OpenAI's order:
//! `response.created`, `response.in_progress`, then for each output item
//! `response.output_item.added`, its deltas (`response.reasoning_text.delta`,
//! `response.content_part.added` and `response.output_text.delta`,
//! `response.function_call_arguments.delta`), their `.done` events and
//! `response.output_item.done`; last `response.completed`, `response.incomplete` or
//! `response.failed`. Every event carries its `sequence_number`; there is no `[DONE]`.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Value, json};

use super::wire::{self, Outcome, Produced};
use super::{Job, outcome_label, outcome_of};
use crate::gateway::metrics::OpenGuard;
use crate::gateway::run::{Piece, Run};

/// Comment lines on a quiet stream (a decision waiting for its answer).
const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// The item being streamed now.
enum Open {
    None,
    Reasoning {
        id: String,
        index: usize,
        text: String,
    },
    Message {
        id: String,
        index: usize,
        text: String,
    },
}

struct Streamer {
    job: Job,
    run: Run,
    sequence: u64,
    open: Open,
    /// The items finished so far, as the final response lists them.
    output: Vec<Value>,
    produced: Produced,
    started: bool,
    finished: bool,
    _open: OpenGuard,
}

/// The response as server-sent events. The run lives in the stream: a caller that hangs up
/// drops it, and its request is cancelled.
pub(super) fn respond(job: Job, run: Run, open: OpenGuard) -> Response {
    let state = Streamer {
        job,
        run,
        sequence: 0,
        open: Open::None,
        output: Vec::new(),
        produced: Produced::default(),
        started: false,
        finished: false,
        _open: open,
    };
    let events = stream::unfold(state, |mut state| async move {
        let frames = state.step().await?;
        Some((
            stream::iter(frames.into_iter().map(Ok::<_, Infallible>)),
            state,
        ))
    });
    Sse::new(futures_util::StreamExt::flatten(events))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
}

impl Streamer {
    fn event(&mut self, kind: &str, mut body: Value) -> SseEvent {
        body["type"] = kind.into();
        body["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        SseEvent::default()
            .event(kind)
            .data(serde_json::to_string(&body).expect("events serialize"))
    }

    fn snapshot(&self, outcome: &Outcome, used: Option<Value>) -> Value {
        self.job.object(outcome, self.output.clone(), used)
    }

    async fn step(&mut self) -> Option<Vec<SseEvent>> {
        if self.finished {
            return None;
        }
        let mut frames = Vec::new();
        if !self.started {
            self.started = true;
            let response = self.snapshot(&Outcome::Open("in_progress"), None);
            frames.push(self.event("response.created", json!({ "response": response })));
            frames.push(self.event("response.in_progress", json!({ "response": response })));
        }
        match self.run.next().await {
            Some(Piece::Reasoning(text)) => {
                self.produced.reasoning.push_str(&text);
                if !matches!(self.open, Open::Reasoning { .. }) {
                    self.close(&mut frames);
                    let id = wire::item_id("rs");
                    let index = self.output.len();
                    let item = json!({"type": "reasoning", "id": id, "summary": [],
                                      "content": [], "status": "in_progress"});
                    frames.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    ));
                    self.open = Open::Reasoning {
                        id,
                        index,
                        text: String::new(),
                    };
                }
                if let Open::Reasoning {
                    id,
                    index,
                    text: all,
                } = &mut self.open
                {
                    all.push_str(&text);
                    let body = json!({"item_id": id, "output_index": index,
                                      "content_index": 0, "delta": text});
                    frames.push(self.event("response.reasoning_text.delta", body));
                }
            }
            Some(Piece::Text(text)) => {
                self.produced.text.push_str(&text);
                if !matches!(self.open, Open::Message { .. }) {
                    self.close(&mut frames);
                    let id = wire::item_id("msg");
                    let index = self.output.len();
                    let item = json!({"type": "message", "id": id, "status": "in_progress",
                                      "role": "assistant", "content": []});
                    frames.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    ));
                    frames.push(self.event(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                               "part": wire::output_text("")}),
                    ));
                    self.open = Open::Message {
                        id,
                        index,
                        text: String::new(),
                    };
                }
                if let Open::Message {
                    id,
                    index,
                    text: all,
                } = &mut self.open
                {
                    all.push_str(&text);
                    let body = json!({"item_id": id, "output_index": index,
                                      "content_index": 0, "delta": text, "logprobs": []});
                    frames.push(self.event("response.output_text.delta", body));
                }
            }
            Some(Piece::End(end)) => {
                self.finished = true;
                self.close(&mut frames);
                let job = self.job.clone();
                job.shared
                    .metrics
                    .answered(&job.tenant, &job.pool, outcome_label(&end), true);
                let outcome = outcome_of(&end);
                if matches!(outcome, Outcome::Completed | Outcome::Incomplete(_)) {
                    for call in &end.tool_calls {
                        let id = wire::item_id("fc");
                        let index = self.output.len();
                        let added = wire::function_call_item(&id, call, "", "in_progress");
                        frames.push(self.event(
                            "response.output_item.added",
                            json!({"output_index": index, "item": added}),
                        ));
                        let arguments = &call.function.arguments;
                        frames.push(self.event(
                            "response.function_call_arguments.delta",
                            json!({"item_id": id, "output_index": index, "delta": arguments}),
                        ));
                        frames.push(self.event(
                            "response.function_call_arguments.done",
                            json!({"item_id": id, "output_index": index,
                                   "name": call.function.name, "arguments": arguments}),
                        ));
                        let done = wire::function_call_item(&id, call, arguments, "completed");
                        frames.push(self.event(
                            "response.output_item.done",
                            json!({"output_index": index, "item": done}),
                        ));
                        self.output.push(done);
                    }
                    self.produced.tool_calls = end.tool_calls.clone();
                }
                let response = self.snapshot(&outcome, Some(wire::usage(end.usage)));
                let kind = match outcome {
                    Outcome::Completed => "response.completed",
                    Outcome::Incomplete(_) => "response.incomplete",
                    _ => "response.failed",
                };
                frames.push(self.event(kind, json!({ "response": response })));
                let request_id = self.run.caller_id().to_string();
                job.keep(&response, Some(&self.produced), &request_id).await;
            }
            None => self.finished = true,
        }
        Some(frames)
    }

    /// Ends the item being streamed, if any.
    fn close(&mut self, frames: &mut Vec<SseEvent>) {
        match std::mem::replace(&mut self.open, Open::None) {
            Open::None => {}
            Open::Reasoning { id, index, text } => {
                frames.push(self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "text": text}),
                ));
                let item = wire::reasoning_item(&id, &text);
                frames.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ));
                self.output.push(item);
            }
            Open::Message { id, index, text } => {
                frames.push(self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "text": text, "logprobs": []}),
                ));
                frames.push(self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "part": wire::output_text(&text)}),
                ));
                let item = wire::message_item(&id, &text, "completed");
                frames.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ));
                self.output.push(item);
            }
        }
    }
}
