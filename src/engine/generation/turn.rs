//! One model turn: the backend called, and its stream read to the end into a [`Turn`].
//!
//! The stream is where a generation waits on a peer, so every await here also watches
//! cancellation and the deadline, and flushes the coalesced deltas on time. Visible text reaches
//! the output, the events and the loop detector while it streams (the text call parser holds
//! back only what may be a call), so a looping model is stopped mid-turn, not at `max_tokens`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use crate::engine::SystemShape;
use crate::engine::text_calls::{ParseMode, ParsedItem, TextCallParser};
use crate::llm::{FinishReason, LlmError, StreamEvent};
use crate::protocol::{EventBody, Message, Reason, Timings, Usage};
use crate::settings::ToolMode;
use crate::telemetry::{self, KeyValue};

use super::Generation;
use super::ending::Stop;

/// What the generation spent, as the result reports it: the backend's token usage and the
/// times. Only the turn changes it, as the backend streams.
pub(super) struct Meter {
    started_at: Instant,
    /// From `started_at` to the first token of the first turn that produced one.
    first_token: Option<Duration>,
    pub(super) usage: Usage,
}

impl Meter {
    /// A meter started now.
    pub(super) fn new() -> Self {
        Meter {
            started_at: Instant::now(),
            first_token: None,
            usage: Usage::default(),
        }
    }

    /// A resumed run's meter goes on from its checkpoint's counts.
    pub(super) fn resume(&mut self, usage: Usage, first_token_ms: Option<u64>) {
        self.usage = usage;
        if let Some(ms) = first_token_ms {
            self.first_token = Some(Duration::from_millis(ms));
        }
    }

    /// The time to first token so far, as a checkpoint keeps it.
    pub(super) fn first_token_ms(&self) -> Option<u64> {
        self.first_token.map(|d| d.as_millis() as u64)
    }

    /// A token arrived: the first one sets the time to first token.
    fn token_arrived(&mut self) {
        self.first_token
            .get_or_insert_with(|| self.started_at.elapsed());
    }

    /// The result's timings, taken now, for a request accepted at `accepted_at`.
    pub(super) fn timings(&self, accepted_at: Instant) -> Timings {
        let total = accepted_at.elapsed();
        let queued = self.started_at.saturating_duration_since(accepted_at);
        Timings {
            queued: queued.as_millis() as u64,
            first_token: self.first_token.map(|d| d.as_millis() as u64),
            total: total.as_millis() as u64,
        }
    }
}

/// What one backend call produced.
pub(super) struct Turn {
    pub(super) raw: String,
    pub(super) visible: String,
    /// Whitespace seen before the turn's first visible words, not yet shown.
    pub(super) lead: String,
    pub(super) native: BTreeMap<usize, NativeCall>,
    pub(super) parsed: Vec<ParsedItem>,
    pub(super) finish: FinishReason,
}

/// A native call as its deltas arrive: the name and the arguments come in pieces.
#[derive(Default)]
pub(super) struct NativeCall {
    pub(super) id: Option<String>,
    pub(super) name: String,
    pub(super) arguments: String,
}

/// A turn that produced nothing to go on with. A refusal need not end the request: the
/// generation learns from it (for the whole engine, not only this request) and takes the turn
/// again when another way to call the backend is left.
pub(super) enum TurnError {
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

impl Generation<'_> {
    /// Streams one model call. Cancellation and the deadline are checked at every await.
    pub(super) async fn model_turn(&mut self) -> Result<Turn, TurnError> {
        let turn_started = Instant::now();
        let cap = self.engine.config.max_output_bytes;
        let shape = self.engine.system_shape();
        let mut chat = self.chat_request(shape);
        let parse_mode = match self.tools.mode {
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
        // A server may stream the text it was asked to continue before the continuation
        // (llama.cpp's does): that echo is not new text.
        let mut echo = self
            .carry_into(&mut chat, &mut turn, &mut parser)
            .map(|prefix| (prefix, String::new()));
        let mut stream = self.engine.backend.chat_stream(chat);
        let mut finish = None;
        let mut any_token = false;
        let mut visible = String::new();
        // The deadline and the gathered text's flush are each one timer for the whole turn,
        // armed once (the flush's moved when its time changes), not one made and dropped for
        // every token the stream brings.
        let bounds = self.bounds.clone();
        let crossed = bounds.crossed("the request's deadline passed");
        tokio::pin!(crossed);
        let flush_timer = tokio::time::sleep_until(tokio::time::Instant::now());
        tokio::pin!(flush_timer);
        let mut flush_armed = None;
        loop {
            let flush_at = self.events.flush_deadline();
            if let Some(at) = flush_at
                && flush_armed != flush_at
            {
                flush_timer.as_mut().reset(at);
            }
            flush_armed = flush_at;
            let item = tokio::select! {
                biased;
                stop = &mut crossed => {
                    return Err(self.interrupted(&turn, stop).into());
                }
                _ = &mut flush_timer, if flush_at.is_some() => {
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
                    if !any_token && self.tools.mode == ToolMode::Native =>
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
                self.meter.token_arrived();
                let first_token = turn_started.elapsed().as_secs_f64() * 1000.0;
                let ttft = KeyValue::new("genfleet.time_to_first_token_ms", first_token);
                telemetry::annotate(&tracing::Span::current(), vec![ttft]);
            }
            match event {
                StreamEvent::Text(text) => {
                    let text = match echo.as_mut() {
                        Some((prefix, seen)) => {
                            seen.push_str(&text);
                            if seen.len() < prefix.len() && prefix.starts_with(seen.as_str()) {
                                // Maybe the echo, maybe not yet: wait for more.
                                continue;
                            }
                            let new = match seen.strip_prefix(prefix.as_str()) {
                                Some(rest) => rest.to_string(),
                                None => std::mem::take(seen),
                            };
                            echo = None;
                            if new.is_empty() {
                                continue;
                            }
                            new
                        }
                        None => text,
                    };
                    push_capped(&mut turn.raw, &text, cap, &mut self.transcript.truncated);
                    visible.clear();
                    parser.push(&text, &mut visible);
                    if let Err(stop) = self.show(&visible, &mut turn).await {
                        return Err(self.interrupted(&turn, stop).into());
                    }
                    if let Err(stop) = self.checkpoint_mid_turn(&turn, &parser).await {
                        return Err(self.interrupted(&turn, stop).into());
                    }
                }
                StreamEvent::Reasoning(text) => {
                    push_capped(
                        &mut self.transcript.reasoning,
                        &text,
                        cap,
                        &mut self.transcript.truncated,
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
                        cap,
                        &mut self.transcript.truncated,
                    );
                }
                StreamEvent::Usage(usage) => self.meter.usage.add(usage),
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

    /// The span of the turn about to be taken, named as OpenTelemetry's GenAI conventions
    /// name a chat call (`chat <model>`); none when traces are not exported.
    pub(super) fn turn_span(&self) -> tracing::Span {
        if !telemetry::exporting() {
            return tracing::Span::none();
        }
        let model = self
            .request
            .model
            .as_deref()
            .unwrap_or(&self.engine.config.model);
        let span = tracing::info_span!("chat", otel.name = %format!("chat {model}"));
        telemetry::annotate(
            &span,
            vec![
                KeyValue::new("gen_ai.operation.name", "chat"),
                KeyValue::new("gen_ai.request.model", model.to_string()),
            ],
        );
        span
    }

    /// What the turn used and how it ended, on its span.
    pub(super) fn end_turn_span(
        &self,
        span: &tracing::Span,
        before: Usage,
        turn: &Result<Turn, TurnError>,
    ) {
        if !telemetry::exporting() {
            return;
        }
        let mut attributes = vec![
            KeyValue::new(
                "gen_ai.usage.input_tokens",
                self.meter
                    .usage
                    .prompt_tokens
                    .saturating_sub(before.prompt_tokens) as i64,
            ),
            KeyValue::new(
                "gen_ai.usage.output_tokens",
                self.meter
                    .usage
                    .completion_tokens
                    .saturating_sub(before.completion_tokens) as i64,
            ),
        ];
        if let Ok(turn) = turn {
            let reason = match &turn.finish {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
                FinishReason::ToolCalls => "tool_calls",
                FinishReason::ContentFilter => "content_filter",
                FinishReason::Other(other) => other.as_str(),
            };
            attributes.push(telemetry::string_list(
                "gen_ai.response.finish_reasons",
                vec![reason.to_string()],
            ));
        }
        telemetry::annotate(span, attributes);
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
        let cap = self.engine.config.max_output_bytes;
        let transcript = &mut self.transcript;
        if turn.visible.is_empty()
            && !transcript.output.is_empty()
            && !transcript.output.ends_with('\n')
        {
            // A later turn starts a new paragraph of the output (and of the streamed text).
            push_capped(
                &mut transcript.output,
                "\n\n",
                cap,
                &mut transcript.truncated,
            );
            self.events.delta("\n\n").await;
        }
        push_capped(&mut turn.visible, text, cap, &mut transcript.truncated);
        push_capped(&mut transcript.output, text, cap, &mut transcript.truncated);
        self.events.delta(text).await;
        match self.loops.push_text(text) {
            Some(verdict) => Err(self.loop_detected(verdict).await),
            None => Ok(()),
        }
    }

    /// A turn cut short: keep what the model said in the conversation.
    fn interrupted(&mut self, turn: &Turn, stop: Stop) -> Stop {
        if !turn.raw.is_empty() {
            self.transcript
                .conversation
                .push(Message::assistant(turn.raw.clone()));
        }
        stop
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
    let mut cut = room;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    buffer.push_str(&text[..cut]);
}
