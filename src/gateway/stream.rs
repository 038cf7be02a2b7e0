//! A completion streamed as server-sent `chat.completion.chunk`s: one step of the run at a
//! time, each turned into the frames OpenAI's SDKs expect.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;

use super::answer::{Answer, RequestId};
use super::error::ApiError;
use super::mapping::Ending;
use super::openai::{Chunk, ChunkChoice, Delta, ToolCallDelta, Usage};
use super::run::{Piece, Run};

/// Comment lines on a quiet stream (a decision waiting for its answer), so that proxies and
/// clients keep it open.
const KEEP_ALIVE: Duration = Duration::from_secs(10);

impl Answer {
    /// Server-sent `chat.completion.chunk`s, then `data: [DONE]`; a failure after the start is
    /// an `error` object in place of the last chunk (OpenAI's SDKs raise it). The run lives in
    /// the stream: a caller that hangs up drops it.
    pub(super) fn stream(self, run: Run) -> Response {
        let request_id = self.request_id.clone();
        let state = StreamState {
            answer: self,
            run,
            started: false,
            finished: false,
        };
        let events = stream::unfold(state, |mut state| async move {
            let frames = state.step().await?;
            Some((
                stream::iter(frames.into_iter().map(Ok::<_, Infallible>)),
                state,
            ))
        });
        let events = futures_util::StreamExt::flatten(events);
        let mut response = Sse::new(events)
            .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
            .into_response();
        response.extensions_mut().insert(RequestId(request_id));
        response
    }
}

struct StreamState {
    answer: Answer,
    run: Run,
    started: bool,
    finished: bool,
}

impl StreamState {
    fn chunk(&self, delta: Delta<'_>, finish: Option<&str>) -> SseEvent {
        let chunk = Chunk {
            id: &self.answer.id,
            object: "chat.completion.chunk",
            created: self.answer.created,
            model: &self.answer.model,
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason: finish,
            }],
            usage: self.answer.include_usage.then_some(None),
        };
        SseEvent::default().data(serde_json::to_string(&chunk).expect("chunks serialize"))
    }

    /// The next frames, `None` once the stream is over.
    async fn step(&mut self) -> Option<Vec<SseEvent>> {
        if self.finished {
            return None;
        }
        let mut frames = Vec::new();
        if !self.started {
            self.started = true;
            frames.push(self.chunk(
                Delta {
                    role: Some("assistant"),
                    content: Some(""),
                    ..Default::default()
                },
                None,
            ));
        }
        let piece = self.run.next().await;
        match piece {
            Some(Piece::Text(text)) => frames.push(self.chunk(
                Delta {
                    content: Some(&text),
                    ..Default::default()
                },
                None,
            )),
            Some(Piece::Reasoning(text)) => frames.push(self.chunk(
                Delta {
                    reasoning_content: Some(&text),
                    ..Default::default()
                },
                None,
            )),
            Some(Piece::End(end)) => {
                self.finished = true;
                let metrics = &self.answer.shared.metrics;
                match end.ending {
                    Ending::Finish(finish) => {
                        metrics.answered(&self.answer.tenant, &self.answer.pool, finish, true);
                        if !end.tool_calls.is_empty() {
                            let calls = end
                                .tool_calls
                                .iter()
                                .enumerate()
                                .map(|(index, call)| ToolCallDelta {
                                    index,
                                    id: &call.id,
                                    kind: &call.kind,
                                    function: &call.function,
                                })
                                .collect();
                            frames.push(self.chunk(
                                Delta {
                                    tool_calls: Some(calls),
                                    ..Default::default()
                                },
                                None,
                            ));
                        }
                        frames.push(self.chunk(Delta::default(), Some(finish)));
                        if self.answer.include_usage {
                            let chunk = Chunk {
                                id: &self.answer.id,
                                object: "chat.completion.chunk",
                                created: self.answer.created,
                                model: &self.answer.model,
                                choices: Vec::new(),
                                usage: Some(Some(Usage::from(end.usage))),
                            };
                            frames
                                .push(SseEvent::default().data(
                                    serde_json::to_string(&chunk).expect("chunks serialize"),
                                ));
                        }
                        frames.push(SseEvent::default().data("[DONE]"));
                    }
                    Ending::Error { status, kind, code } => {
                        metrics.answered(&self.answer.tenant, &self.answer.pool, code, true);
                        let error = ApiError::new(status, kind, code, end.message);
                        frames.push(SseEvent::default().data(error.body()));
                    }
                }
            }
            None => self.finished = true,
        }
        Some(frames)
    }
}
