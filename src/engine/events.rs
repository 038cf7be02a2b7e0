//! The event stream of one generation: gapless sequence numbers and coalesced deltas.
//!
//! Deltas are gathered until `coalesce_bytes` or `coalesce_ms` have passed, so a fast model
//! does not cost one bus message per token. The first delta goes out at once: the time to
//! first token a caller sees is the model's, not the coalescing interval. Nothing is ever dropped here: the sink is a bounded
//! channel, and a slow consumer slows the generation rather than losing text.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::protocol::ids::now_rfc3339;
use crate::protocol::{Event, EventBody};

/// Where a generation's events go. `None` discards them (a request nobody follows).
pub type EventSink = Option<mpsc::Sender<Event>>;

#[derive(Debug, Clone, Copy)]
pub struct Coalescing {
    pub bytes: usize,
    pub interval: Duration,
}

pub struct EventEmitter {
    request_id: String,
    sink: EventSink,
    /// Shared, so that whoever ends a request after its generation was lost (a panic) goes on
    /// numbering without a gap.
    next_seq: Arc<AtomicU64>,
    coalescing: Coalescing,
    pending: String,
    pending_since: Option<Instant>,
    /// Whether a delta went out already.
    first_delta_sent: bool,
    /// From a request's first checkpoint on, its events wait here until the next checkpoint
    /// that holds them is stored ([`EventEmitter::release`]): a caller is never sent what a
    /// resumed run would not know it was sent.
    holding: bool,
    held: Vec<Event>,
    /// Whether the events sent since the last checkpoint are kept ([`EventEmitter::keep_recent`]).
    keeping: bool,
    /// The events sent, not held, since the last checkpoint (before the first one: once
    /// events are held, `held` has them), at most [`MAX_RECENT`]: the next checkpoint carries
    /// them with the held ones, for a run that takes the request up to send again.
    recent: VecDeque<Event>,
}

/// Events kept for the next checkpoint at most; past it the oldest go (sent long before).
const MAX_RECENT: usize = 1024;

impl EventEmitter {
    pub fn new(request_id: String, sink: EventSink, coalescing: Coalescing) -> Self {
        Self::continuing(request_id, sink, coalescing, Arc::default())
    }

    /// An emitter that numbers on from `sequence` (see [`EventEmitter::sequence`]).
    pub fn continuing(
        request_id: String,
        sink: EventSink,
        coalescing: Coalescing,
        sequence: Arc<AtomicU64>,
    ) -> Self {
        EventEmitter {
            request_id,
            sink,
            next_seq: sequence,
            coalescing,
            pending: String::new(),
            pending_since: None,
            first_delta_sent: false,
            holding: false,
            held: Vec::new(),
            keeping: false,
            recent: VecDeque::new(),
        }
    }

    /// From now on the events since the last checkpoint are kept (a run that writes
    /// checkpoints): see [`EventEmitter::recent`].
    pub fn keep_recent(&mut self) {
        self.keeping = true;
    }

    /// Adds visible text; sends it once enough has gathered.
    pub async fn delta(&mut self, text: &str) {
        if text.is_empty() || self.sink.is_none() {
            return;
        }
        self.pending.push_str(text);
        let since = *self.pending_since.get_or_insert_with(Instant::now);
        if !self.first_delta_sent
            || self.pending.len() >= self.coalescing.bytes
            || since.elapsed() >= self.coalescing.interval
        {
            self.first_delta_sent = true;
            self.flush().await;
        }
    }

    /// When the gathered text must go out even if no more arrives.
    pub fn flush_deadline(&self) -> Option<Instant> {
        self.pending_since.map(|t| t + self.coalescing.interval)
    }

    pub async fn flush(&mut self) {
        self.pending_since = None;
        if self.pending.is_empty() {
            return;
        }
        let text = std::mem::take(&mut self.pending);
        self.send(EventBody::Delta { text }).await;
    }

    /// Sends an event after any gathered text, keeping the order the model produced.
    pub async fn emit(&mut self, body: EventBody) {
        self.flush().await;
        self.send(body).await;
    }

    async fn send(&mut self, body: EventBody) {
        if self.sink.is_none() {
            return;
        }
        let finished = matches!(body, EventBody::Finished { .. });
        let event = Event {
            request_id: self.request_id.clone(),
            seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
            ts: now_rfc3339(),
            body,
        };
        if self.holding && !finished {
            self.held.push(event);
            return;
        }
        if self.keeping && !finished {
            if self.recent.len() >= MAX_RECENT {
                self.recent.pop_front();
            }
            self.recent.push_back(event.clone());
        }
        if finished {
            // The result is the last checkpoint: what it holds goes out before it.
            self.release().await;
        }
        self.deliver(event).await;
    }

    async fn deliver(&mut self, event: Event) {
        let Some(sink) = &self.sink else {
            return;
        };
        if sink.send(event).await.is_err() {
            // Nobody listens any more: stop building events for them.
            self.sink = None;
        }
    }

    /// From now on events wait for [`EventEmitter::release`] (a checkpoint holds them).
    pub fn hold(&mut self) {
        self.holding = true;
    }

    /// Sends the events held so far (the checkpoint that holds them is stored, or none can
    /// be, and the stream must go on).
    pub async fn release(&mut self) {
        for event in std::mem::take(&mut self.held) {
            self.deliver(event).await;
        }
    }

    /// The events numbered since the last checkpoint ([`EventEmitter::checkpointed`]), sent
    /// already or held, in order: a worker that dies right after storing a checkpoint may not
    /// have sent them all yet.
    pub fn recent(&self) -> Vec<Event> {
        self.recent.iter().chain(&self.held).cloned().collect()
    }

    /// A checkpoint holding [`EventEmitter::recent`] is stored.
    pub fn checkpointed(&mut self) {
        self.recent.clear();
    }

    /// Drops the events held and sends no more: the request is no longer this run's.
    pub fn mute(&mut self) {
        self.held.clear();
        self.sink = None;
    }

    /// The sequence number the next event will carry (a continuation of the same subject, such
    /// as `continued`, goes on from here).
    pub fn next_seq(&self) -> u64 {
        self.next_seq.load(Ordering::Relaxed)
    }

    /// The shared counter, to go on numbering in another emitter.
    pub fn sequence(&self) -> Arc<AtomicU64> {
        self.next_seq.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_checkpoint_carries_every_event_numbered_since_the_one_before_it() {
        let (tx, _rx) = mpsc::channel(64);
        let mut emitter = EventEmitter::new(
            "r".into(),
            Some(tx),
            Coalescing {
                bytes: 1,
                interval: Duration::ZERO,
            },
        );
        emitter.keep_recent();
        let seqs = |events: Vec<Event>| events.iter().map(|e| e.seq).collect::<Vec<_>>();
        emitter.delta("a").await;
        emitter.delta("b").await;
        // Before the first checkpoint: the events sent.
        assert_eq!(seqs(emitter.recent()), vec![0, 1]);
        emitter.checkpointed();
        emitter.hold();
        emitter.release().await;
        emitter.delta("c").await;
        emitter.delta("d").await;
        // After it: the events held since, and nothing twice.
        assert_eq!(seqs(emitter.recent()), vec![2, 3]);
        emitter.checkpointed();
        emitter.release().await;
        assert_eq!(seqs(emitter.recent()), Vec::<u64>::new());
    }

    #[tokio::test]
    async fn sends_the_first_delta_at_once_then_coalesces_and_numbers_without_gaps() {
        let (tx, mut rx) = mpsc::channel(64);
        let mut emitter = EventEmitter::new(
            "r".into(),
            Some(tx),
            Coalescing {
                bytes: 8,
                interval: Duration::from_secs(60),
            },
        );
        emitter
            .emit(EventBody::Started {
                worker_id: "w".into(),
                attempt: 1,
                chain_position: 1,
            })
            .await;
        for piece in ["ab", "cd", "ef", "gh", "ij"] {
            emitter.delta(piece).await;
        }
        emitter
            .emit(EventBody::Reasoning { text: "r".into() })
            .await;
        drop(emitter);
        let mut events = Vec::new();
        while let Some(e) = rx.recv().await {
            events.push(e);
        }
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![0, 1, 2, 3]);
        let texts: Vec<String> = events
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::Delta { text } => Some(text.clone()),
                _ => None,
            })
            .collect();
        // The first delta at once (time to first token), then 8 bytes at a time.
        assert_eq!(texts, vec!["ab", "cdefghij"]);
        assert!(matches!(events[3].body, EventBody::Reasoning { .. }));
    }

    #[tokio::test]
    async fn held_events_go_out_on_release_in_order_and_before_finished() {
        let (tx, mut rx) = mpsc::channel(64);
        let coalescing = Coalescing {
            bytes: 1,
            interval: Duration::from_secs(60),
        };
        let mut emitter = EventEmitter::new("r".into(), Some(tx), coalescing);
        emitter.delta("a").await;
        emitter.hold();
        emitter.delta("b").await;
        emitter.delta("c").await;
        assert_eq!(rx.try_recv().map(|e| e.seq), Ok(0));
        assert!(
            rx.try_recv().is_err(),
            "held events wait for their checkpoint"
        );
        emitter.release().await;
        emitter.delta("d").await;
        let mut result = crate::protocol::GenerationResult::empty(
            "r",
            crate::protocol::Reason::Stop,
            String::new(),
            "w",
        );
        result.detail = None;
        emitter
            .emit(EventBody::Finished {
                result: Box::new(result),
            })
            .await;
        drop(emitter);
        let mut seen = Vec::new();
        while let Some(e) = rx.recv().await {
            seen.push((e.seq, e.body.name()));
        }
        assert_eq!(
            seen,
            vec![(1, "delta"), (2, "delta"), (3, "delta"), (4, "finished")]
        );
    }
}
