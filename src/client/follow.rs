//! Following a request through its whole decision chain: one stream of what a caller sees,
//! from the first request to its last continuation.
//!
//! Events come first. They are at most once, so the stored state is read only where an event
//! can be missed: after [`CHECK_AFTER`] of silence (a missed `finished`, `continued` or
//! `chain_ended`), when a sequence number is skipped (the part's text then comes from its
//! stored result, never twice), and when a continuation is followed after it may already have
//! run. The CLI's `submit --follow`, the gateway and the Python package's `Client.follow` walk
//! a chain this one way.
//!
//! Architecture invariant: each text is handed out once and in order. A part's text is what
//! its deltas carried, then whatever of its stored output they did not (all of it when its
//! events were missed); the same for its reasoning.

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::Duration;

use futures_util::{Stream, StreamExt};

use super::{Client, ClientError};
use crate::protocol::{
    DecisionOutcome, ErrorCode, Event, EventBody, GenerationResult, Reason, RequestState,
};

/// How long the events may be silent before the stored state is read.
pub const CHECK_AFTER: Duration = Duration::from_secs(1);

/// The longest silence between two reads of the stored state while they find nothing new:
/// each read that finds the request still waiting in the queue, still running as it was known
/// to, or its decision still pending doubles the wait before the next, from [`CHECK_AFTER`] up
/// to this; an event, or a read that finds something new, brings [`CHECK_AFTER`] back. Many
/// requests waiting behind busy slots (a batch, a backlog), running without streaming (a
/// batch's lines, a long tool call) or waiting for a person's decision would otherwise each
/// ask every second, and the asking would slow the fleet they wait for.
pub const CHECK_MAX: Duration = Duration::from_secs(16);

/// How long a result whose part ended may take to be readable (`not_ready`) before following
/// gives up on it.
const RESULT_WAIT: Duration = Duration::from_secs(10);

type Events = Pin<Box<dyn Stream<Item = Event> + Send>>;

/// What following a chain yields, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// A part of the chain (the first request or a continuation) started on a worker. Seen at
    /// most once per part; a part whose `started` was missed may not show it.
    Started { request_id: String },
    /// Output text, in order.
    Text(String),
    /// Reasoning text, kept apart from the output.
    Reasoning(String),
    /// The model called a tool the fleet runs.
    ToolCall {
        name: String,
        arguments: serde_json::Value,
    },
    /// That tool's result (`ok: false` when the tool service answered with an error).
    ToolResult {
        name: String,
        ok: bool,
        result: serde_json::Value,
    },
    /// A part ended, with its stored result (not released). When the part asks for a
    /// decision and the chain is followed through decisions, more steps follow.
    Ended(Box<GenerationResult>),
    /// The decision was answered: the chain goes on as this request.
    Continued { request_id: String },
    /// The decision ended the chain (skipped, aborted, expired).
    ChainEnded { outcome: DecisionOutcome },
    /// The chain cannot be followed further.
    Lost(Lost),
}

/// Why a chain could not be followed further.
#[derive(Debug, Clone, PartialEq)]
pub enum Lost {
    /// The bus connection closed.
    BusClosed,
    /// A part ended but its result could not be read.
    Result(String),
    /// A continuation could not be subscribed to.
    Continuation(String),
}

/// One request followed through its chain; [`Follow::next`] gives its steps, `None` after the
/// last. Dropping a `next()` that has not finished may lose a step: drop the follow with it.
pub struct Follow {
    client: Client,
    events: Events,
    /// The request's first id on the bus.
    root: String,
    /// The part followed now.
    current: String,
    through_decisions: bool,
    next_seq: u64,
    /// An event of the current part was missed: its text comes from its result.
    gapped: bool,
    started: bool,
    streamed: String,
    streamed_reasoning: String,
    /// The current part ended asking for a decision; its answer is awaited.
    awaiting_decision: bool,
    check: Check,
    pending: VecDeque<Step>,
    done: bool,
}

/// When the stored state is read next: [`CHECK_AFTER`] after the last event (or read), longer
/// while the reads find nothing new ([`CHECK_MAX`]).
struct Check {
    timer: Pin<Box<tokio::time::Sleep>>,
    wait: Duration,
}

impl Check {
    fn new() -> Check {
        Check {
            timer: Box::pin(tokio::time::sleep(CHECK_AFTER)),
            wait: CHECK_AFTER,
        }
    }

    /// Something was heard (or read): the next read after [`CHECK_AFTER`] of silence.
    fn heard(&mut self) {
        self.wait = CHECK_AFTER;
        self.arm();
    }

    /// The read found nothing new (still queued, still running, a decision still pending):
    /// the next after twice as long.
    fn back_off(&mut self) {
        self.wait = (self.wait * 2).min(CHECK_MAX);
        self.arm();
    }

    /// The next read as long after this one as this one came after the last.
    fn again(&mut self) {
        self.arm();
    }

    /// The next read at once.
    fn now(&mut self) {
        self.timer.as_mut().reset(tokio::time::Instant::now());
    }

    fn arm(&mut self) {
        let at = tokio::time::Instant::now() + self.wait;
        self.timer.as_mut().reset(at);
    }

    /// Resolves when the next read is due (cancel-safe: a `select!` may drop it); re-arm it
    /// before awaiting it again.
    async fn due(&mut self) {
        self.timer.as_mut().await;
    }
}

impl Client {
    /// Follows a request through its decision chain (`through_decisions`), or only itself.
    /// Subscribe before sending the request, with a request id of your own, to miss nothing;
    /// following a request that already ran reads what is stored.
    pub async fn follow_chain(
        &self,
        request_id: &str,
        through_decisions: bool,
    ) -> Result<Follow, ClientError> {
        let root = self.on_bus(request_id);
        let events = self.follow(&root).await?;
        Ok(self.follow_chain_on(&root, through_decisions, events))
    }

    /// [`Client::follow_chain`] given the first request's events (from an
    /// [`EventFanout`](super::fanout::EventFanout), say); a continuation's are subscribed to.
    pub fn follow_chain_on(
        &self,
        request_id: &str,
        through_decisions: bool,
        events: impl Stream<Item = Event> + Send + 'static,
    ) -> Follow {
        let root = self.on_bus(request_id);
        let events: Events = Box::pin(events);
        Follow {
            client: self.clone(),
            events,
            current: root.clone(),
            root,
            through_decisions,
            next_seq: 0,
            gapped: false,
            started: false,
            streamed: String::new(),
            streamed_reasoning: String::new(),
            awaiting_decision: false,
            check: Check::new(),
            pending: VecDeque::new(),
            done: false,
        }
    }
}

impl Follow {
    /// The chain's first request id on the bus.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// The part followed now (the last continuation once the chain went on).
    pub fn current(&self) -> &str {
        &self.current
    }

    /// The next step; `None` once the chain ended.
    pub async fn next(&mut self) -> Option<Step> {
        loop {
            if let Some(step) = self.pending.pop_front() {
                return Some(step);
            }
            if self.done {
                return None;
            }
            tokio::select! {
                event = self.events.next() => match event {
                    Some(event) => {
                        // The stored state is read only after a silence: events are flowing.
                        self.check.heard();
                        self.on_event(event).await;
                    }
                    None => self.lose(Lost::BusClosed),
                },
                () = self.check.due() => {
                    self.check.again();
                    self.check_stored().await;
                }
            }
        }
    }

    async fn on_event(&mut self, event: Event) {
        if event.request_id != self.current {
            return;
        }
        if event.seq < self.next_seq {
            // Sent again after a move (the run that took the request up cannot know whether
            // its predecessor sent it): seen already.
            return;
        }
        if event.seq != self.next_seq && !self.gapped {
            tracing::debug!(
                message = "an event was missed: the text comes from the result",
                request_id = %self.current,
                expected = self.next_seq,
                seq = event.seq
            );
            self.gapped = true;
        }
        self.next_seq = event.seq + 1;
        let open = !self.awaiting_decision;
        match event.body {
            EventBody::Started { .. } => self.part_started(),
            EventBody::Delta { text } if open && !self.gapped => {
                self.part_started();
                self.streamed.push_str(&text);
                push_text(&mut self.pending, text);
            }
            EventBody::Reasoning { text } if open && !self.gapped => {
                self.part_started();
                self.streamed_reasoning.push_str(&text);
                self.pending.push_back(Step::Reasoning(text));
            }
            EventBody::ToolCall {
                name, arguments, ..
            } if open => {
                self.part_started();
                self.pending.push_back(Step::ToolCall { name, arguments });
            }
            EventBody::ToolResult {
                name, ok, result, ..
            } if open => self
                .pending
                .push_back(Step::ToolResult { name, ok, result }),
            EventBody::Finished { result } if open => self.on_result(*result),
            EventBody::Continued {
                continuation_request_id,
            } => {
                self.catch_up().await;
                if !self.done {
                    self.continue_as(continuation_request_id).await;
                }
            }
            EventBody::ChainEnded { outcome, .. } => {
                self.catch_up().await;
                if !self.done {
                    self.end_chain(outcome);
                }
            }
            _ => {}
        }
    }

    fn part_started(&mut self) {
        if !std::mem::replace(&mut self.started, true) {
            self.pending.push_back(Step::Started {
                request_id: self.current.clone(),
            });
        }
    }

    /// A `continued` or `chain_ended` came while the `finished` before it was missed: the
    /// part's result is read first.
    async fn catch_up(&mut self) {
        if self.awaiting_decision || self.done {
            return;
        }
        if let Some(result) = self.stored_result().await {
            self.on_result(result);
        }
    }

    /// The current part's stored result, waiting while it is not ready (bounded).
    async fn stored_result(&mut self) -> Option<GenerationResult> {
        let deadline = tokio::time::Instant::now() + RESULT_WAIT;
        loop {
            match self.client.result(&self.current, false).await {
                Ok(result) => return Some(result),
                Err(error)
                    if error.code() == Some(ErrorCode::NotReady)
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(error) => {
                    self.lose(Lost::Result(format!(
                        "the request's result cannot be read: {error}"
                    )));
                    return None;
                }
            }
        }
    }

    /// The stored state, read after a silence: a missed `started`, `finished`, `continued` or
    /// `chain_ended`.
    async fn check_stored(&mut self) {
        let Ok(status) = self.client.status(&self.current).await else {
            return;
        };
        if self.awaiting_decision {
            if let Some(next) = status.continuation_request_id {
                self.continue_as(next).await;
            } else if let Some(outcome) = status.decision_outcome
                && !matches!(
                    outcome,
                    DecisionOutcome::Pending | DecisionOutcome::Continued
                )
            {
                self.end_chain(outcome);
            } else {
                // Still pending: a person may take hours.
                self.check.back_off();
            }
            return;
        }
        // Nothing new: still waiting in the queue, or still running as it was known to.
        let unchanged =
            status.state == RequestState::Queued || (self.started && !status.state.is_terminal());
        if unchanged {
            self.check.back_off();
        } else {
            self.check.heard();
            self.part_started();
        }
        if status.state.is_terminal()
            && let Some(result) = self.stored_result().await
        {
            self.on_result(result);
        }
    }

    fn on_result(&mut self, result: GenerationResult) {
        if result.request_id != self.current {
            return;
        }
        self.part_started();
        if let Some(rest) = result
            .reasoning
            .strip_prefix(self.streamed_reasoning.as_str())
            && !rest.is_empty()
        {
            self.pending.push_back(Step::Reasoning(rest.to_string()));
        }
        if let Some(rest) = result.output.strip_prefix(self.streamed.as_str())
            && !rest.is_empty()
        {
            push_text(&mut self.pending, rest.to_string());
        }
        let asks = result.reason == Reason::DecisionRequested
            && result.signals.iter().any(|s| s.decision.is_some());
        self.awaiting_decision = asks && self.through_decisions;
        self.done = !self.awaiting_decision;
        self.pending.push_back(Step::Ended(Box::new(result)));
    }

    async fn continue_as(&mut self, next: String) {
        match self.client.follow(&next).await {
            Ok(events) => {
                tracing::debug!(message = "following the continuation", request_id = %next, root = %self.root);
                self.events = Box::pin(events);
                self.current = next.clone();
                self.next_seq = 0;
                self.gapped = false;
                self.started = false;
                self.streamed.clear();
                self.streamed_reasoning.clear();
                self.awaiting_decision = false;
                self.pending.push_back(Step::Continued { request_id: next });
                // The continuation may have run before it was followed.
                self.check.now();
            }
            Err(error) => self.lose(Lost::Continuation(format!(
                "cannot follow the continuation: {error}"
            ))),
        }
    }

    fn end_chain(&mut self, outcome: DecisionOutcome) {
        self.done = true;
        self.pending.push_back(Step::ChainEnded { outcome });
    }

    fn lose(&mut self, lost: Lost) {
        self.done = true;
        self.pending.push_back(Step::Lost(lost));
    }
}

fn push_text(pending: &mut VecDeque<Step>, text: String) {
    if !text.is_empty() {
        pending.push_back(Step::Text(text));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the check comes due within `within` (of paused time, which a wait advances).
    async fn due_within(check: &mut Check, within: Duration) -> bool {
        tokio::time::timeout(within, check.due()).await.is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_found_unchanged_is_asked_after_less_and_less_often() {
        let mut check = Check::new();
        let margin = Duration::from_millis(1);
        assert!(!due_within(&mut check, CHECK_AFTER - margin).await);
        assert!(due_within(&mut check, 2 * margin).await);
        // Each read that finds nothing new doubles the wait, up to the most.
        let mut wait = CHECK_AFTER;
        for _ in 0..8 {
            check.again();
            check.back_off();
            wait = (wait * 2).min(CHECK_MAX);
            assert!(!due_within(&mut check, wait - margin).await, "{wait:?}");
            assert!(due_within(&mut check, 2 * margin).await, "{wait:?}");
        }
        assert_eq!(wait, CHECK_MAX);
        // An event, or a read that finds something new, brings the short wait back.
        check.heard();
        assert!(!due_within(&mut check, CHECK_AFTER - margin).await);
        assert!(due_within(&mut check, 2 * margin).await);
        // A read that failed waits as long as the last.
        check.again();
        assert!(!due_within(&mut check, CHECK_AFTER - margin).await);
        assert!(due_within(&mut check, 2 * margin).await);
        // A continuation that may have run already is read at once.
        check.now();
        assert!(due_within(&mut check, margin).await);
    }
}
