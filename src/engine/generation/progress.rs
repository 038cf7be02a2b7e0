//! Checkpoints: the generation's progress written where another worker can go on from it, and
//! the generation that goes on from one.
//!
//! A request that has run longer than `generation.checkpoint_ms` writes a checkpoint between
//! turns (after every tool batch) and, while a turn streams text, every interval. From its
//! first checkpoint on, its events wait until the checkpoint that holds them is stored
//! ([`crate::engine::EventEmitter::hold`]): whatever the caller was sent, the last checkpoint
//! holds, so a run that goes on from it sends no text twice and skips none.
//!
//! A turn is checkpointed mid-stream only where it can be continued: the backend continues a
//! final assistant message, the request asks for no structured output, no native call has
//! begun, and the text-call parser holds nothing back. Otherwise only the boundaries between
//! turns are written, and the turn's text waits for the turn's end (a resumed run takes the
//! turn again from its start, and the caller has seen none of it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::engine::text_calls::TextCallParser;
use crate::engine::{CheckpointError, Checkpoints, HANDED_OFF, Resume};
use crate::protocol::{Message, Progress, Reason};

use super::Generation;
use super::ending::Stop;
use super::turn::Turn;

/// When the checkpoints of this run are due, and where they go.
pub(super) struct Checkpointing {
    store: Option<Arc<dyn Checkpoints>>,
    every: Duration,
    started: Instant,
    last: Option<Instant>,
    /// A turn may be checkpointed while it streams.
    mid_turn: bool,
    /// Asks for a checkpoint at the first point one can be written, then the end of this run.
    hand_off: CancellationToken,
}

impl Checkpointing {
    pub(super) fn new(
        store: Option<Arc<dyn Checkpoints>>,
        every: Option<Duration>,
        mid_turn: bool,
        hand_off: CancellationToken,
    ) -> Self {
        Checkpointing {
            store: every.and(store),
            every: every.unwrap_or(Duration::MAX),
            started: Instant::now(),
            last: None,
            mid_turn,
            hand_off,
        }
    }

    /// Whether this run writes checkpoints at all.
    pub(super) fn writes(&self) -> bool {
        self.store.is_some()
    }

    fn handing_off(&self) -> bool {
        self.store.is_some() && self.hand_off.is_cancelled()
    }

    fn due(&self, mid_turn: bool) -> bool {
        if mid_turn && !self.mid_turn {
            return false;
        }
        if self.handing_off() {
            return true;
        }
        if self.store.is_none() || self.started.elapsed() < self.every {
            return false;
        }
        !mid_turn || self.last.is_none_or(|t| t.elapsed() >= self.every)
    }
}

/// The turn a checkpoint was cut in, to be continued by the first turn of the resumed run.
pub(super) struct Carried {
    pub(super) raw: String,
    pub(super) visible: String,
}

impl Generation<'_> {
    /// A checkpoint between turns, when one is due.
    pub(super) async fn checkpoint_between_turns(&mut self) -> Result<(), Stop> {
        if self.carried.is_some() || !self.checkpoints.due(false) {
            return Ok(());
        }
        self.write_checkpoint(String::new(), String::new()).await
    }

    /// A checkpoint of the turn streaming now, when one is due and the turn can be continued
    /// from here.
    pub(super) async fn checkpoint_mid_turn(
        &mut self,
        turn: &Turn,
        parser: &TextCallParser,
    ) -> Result<(), Stop> {
        if !turn.native.is_empty()
            || turn.visible.is_empty()
            || !parser.at_rest()
            || !self.checkpoints.due(true)
        {
            return Ok(());
        }
        self.write_checkpoint(turn.raw.clone(), turn.visible.clone())
            .await
    }

    async fn write_checkpoint(
        &mut self,
        partial: String,
        partial_visible: String,
    ) -> Result<(), Stop> {
        let Some(store) = self.checkpoints.store.clone() else {
            return Ok(());
        };
        self.events.flush().await;
        let progress = self.progress(partial, partial_visible);
        let saved = tokio::select! {
            biased;
            stop = self.bounds.crossed("the request's deadline passed") => return Err(stop),
            saved = store.save(progress) => saved,
        };
        self.checkpoints.last = Some(Instant::now());
        if saved.is_ok() {
            self.events.checkpointed();
        }
        match saved {
            Ok(()) if self.checkpoints.handing_off() => {
                // Everything the caller was sent is in it: another run goes on from here.
                self.events.release().await;
                Err(Stop::new(Reason::Cancelled, HANDED_OFF))
            }
            Ok(()) => {
                self.events.hold();
                self.events.release().await;
                Ok(())
            }
            Err(CheckpointError::Fenced) => {
                // Another worker goes on with it: nothing more is said of this run.
                self.events.mute();
                Err(Stop::new(
                    Reason::WorkerLost,
                    "the request went on on another worker",
                ))
            }
            Err(error) => {
                // The stream matters more than the checkpoint: what waited goes out, and the
                // next checkpoint is tried in its time.
                tracing::warn!(message = "a checkpoint was not stored", request_id = %self.ctx.request_id, %error);
                self.events.release().await;
                Ok(())
            }
        }
    }

    /// The progress as it stands, with `partial` the text of the turn in progress.
    fn progress(&self, partial: String, partial_visible: String) -> Progress {
        let asked = self.request.messages.len();
        Progress {
            request: self.request.clone(),
            conversation: self
                .transcript
                .conversation
                .get(asked..)
                .unwrap_or_default()
                .to_vec(),
            partial,
            partial_visible,
            output: self.transcript.output.clone(),
            reasoning: self.transcript.reasoning.clone(),
            truncated: self.transcript.truncated,
            usage: self.meter.usage,
            tool_iterations_used: self.iterations.used,
            tool_iterations_left: self.iterations.left,
            signals: self.signals.signals().to_vec(),
            signals_dropped: self.signals.dropped(),
            next_seq: self.events.next_seq(),
            released: self.events.recent(),
            elapsed_ms: self.ctx.accepted_at.elapsed().as_millis() as u64,
            first_token_ms: self.meter.first_token_ms(),
            root_request_id: self.ctx.root_request_id.clone(),
            parent_request_id: self.ctx.parent_request_id.clone(),
            chain_position: self.ctx.chain_position,
        }
    }

    /// Takes up `resume`'s checkpoint: the conversation, the output and the counts; the turn
    /// it was cut in is carried into the first turn, or, where it cannot be continued, taken
    /// again from its start (its text is then cut from the output). Returns whether it was.
    pub(super) fn take_up(&mut self, resume: &Resume) -> bool {
        let progress = &resume.progress;
        self.transcript
            .conversation
            .extend(progress.conversation.iter().cloned());
        self.transcript.output = progress.output.clone();
        self.transcript.reasoning = progress.reasoning.clone();
        self.transcript.truncated = progress.truncated;
        self.iterations.used = progress.tool_iterations_used;
        self.iterations.left = progress.tool_iterations_left;
        self.meter.resume(progress.usage, progress.first_token_ms);
        self.signals
            .restore(progress.signals.clone(), progress.signals_dropped);
        if progress.partial.is_empty() {
            return false;
        }
        if self.engine.continues_turns(&self.request) {
            self.carried = Some(Carried {
                raw: progress.partial.clone(),
                visible: progress.partial_visible.clone(),
            });
            return false;
        }
        let keep = self
            .transcript
            .output
            .len()
            .saturating_sub(progress.partial_visible.len());
        let mut keep = keep;
        while !self.transcript.output.is_char_boundary(keep) {
            keep -= 1;
        }
        self.transcript.output.truncate(keep);
        true
    }

    /// The first turn of a resumed run asks the backend to continue the turn that was cut;
    /// the text it continues, if it does.
    pub(super) fn carry_into(
        &mut self,
        chat: &mut crate::llm::ChatRequest,
        turn: &mut Turn,
        parser: &mut TextCallParser,
    ) -> Option<String> {
        let carried = self.carried.take()?;
        chat.messages.push(Message::assistant(carried.raw.clone()));
        chat.continue_final = true;
        // The parser is brought to where it stood at the cut; what it shows again was shown.
        let mut shown = String::new();
        parser.push(&carried.raw, &mut shown);
        turn.raw = carried.raw.clone();
        turn.visible = carried.visible;
        Some(carried.raw)
    }
}
