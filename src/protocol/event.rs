//! Progress events published on `gen.events.<request_id>`.
//!
//! Delivery is at most once (core NATS), so every event carries a gapless `seq` per request: a
//! follower that sees a gap knows it missed something and can read the stored result, which is
//! authoritative and which the `finished` event carries whole.

use serde::{Deserialize, Serialize};

use super::result::GenerationResult;
use super::signal::{DecisionOutcome, Signal};

/// The `seq` of a `finished` event published by a worker other than the request's, which ended
/// it after its worker was lost: it cannot know how many events the lost worker sent, so it
/// numbers this one past any (2^53 − 1, the largest integer a JSON number holds exactly). A
/// follower sees the gap, and the event carries the whole result.
pub const SEQ_AFTER_LOST: u64 = (1 << 53) - 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub request_id: String,
    pub seq: u64,
    pub ts: String,
    #[serde(flatten)]
    pub body: EventBody,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventBody {
    Started {
        worker_id: String,
        attempt: u32,
        chain_position: u32,
    },
    /// User-visible assistant text (coalesced; never dropped by the worker).
    Delta {
        text: String,
    },
    /// Reasoning text (`reasoning_content`), kept apart from the output.
    Reasoning {
        text: String,
    },
    ToolCall {
        call_id: String,
        name: String,
        arguments: serde_json::Value,
    },
    ToolResult {
        call_id: String,
        name: String,
        /// False when the tool service answered with an error reply.
        ok: bool,
        result: serde_json::Value,
    },
    Signal {
        signal: Box<Signal>,
    },
    Finished {
        result: Box<GenerationResult>,
    },
    Continued {
        continuation_request_id: String,
    },
    /// The request went on on another worker (its worker was lost, drained or preempted), from
    /// its last checkpoint: the events that follow continue the output exactly where the
    /// caller's stream stands (no text is sent twice), in place of a second `started`.
    Resumed {
        worker_id: String,
        attempt: u32,
        from_worker: String,
        reason: super::result::MoveReason,
        /// The turn in progress was taken again from its start: text of that turn was held
        /// back until its end, so none of it had been sent.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        turn_restarted: bool,
    },
    /// The decision this request raised ended its chain: skipped, aborted or expired.
    ChainEnded {
        decision_id: String,
        outcome: DecisionOutcome,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        option_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        decided_by: Option<String>,
    },
}

impl Event {
    /// An event from its JSON payload. A `finished` event, the largest (it carries the whole
    /// result), is read in one pass when it is laid out as a worker writes it; any other, or
    /// one laid out otherwise, as its type says (its fields gathered first, then read).
    pub fn from_json(payload: &[u8]) -> Result<Event, serde_json::Error> {
        #[derive(Deserialize)]
        struct Finished {
            request_id: String,
            seq: u64,
            ts: String,
            result: Box<GenerationResult>,
        }
        if Event::type_of(payload) == Some(b"finished".as_slice())
            && let Ok(finished) = serde_json::from_slice::<Finished>(payload)
        {
            return Ok(Event {
                request_id: finished.request_id,
                seq: finished.seq,
                ts: finished.ts,
                body: EventBody::Finished {
                    result: finished.result,
                },
            });
        }
        serde_json::from_slice(payload)
    }

    /// An event's type, read from its payload without parsing it: the first `"event":"`
    /// names it as a worker writes an event (the fields before it, the request id, the
    /// sequence number and the time, hold no quote). `None` when there is none; a payload laid
    /// out otherwise may name another type here than its own.
    pub fn type_of(payload: &[u8]) -> Option<&[u8]> {
        const TAG: &[u8] = b"\"event\":\"";
        let at = payload.windows(TAG.len()).position(|w| w == TAG)? + TAG.len();
        let len = payload[at..].iter().position(|b| *b == b'"')?;
        Some(&payload[at..at + len])
    }
}

impl EventBody {
    pub fn name(&self) -> &'static str {
        match self {
            EventBody::Started { .. } => "started",
            EventBody::Delta { .. } => "delta",
            EventBody::Reasoning { .. } => "reasoning",
            EventBody::ToolCall { .. } => "tool_call",
            EventBody::ToolResult { .. } => "tool_result",
            EventBody::Signal { .. } => "signal",
            EventBody::Finished { .. } => "finished",
            EventBody::Continued { .. } => "continued",
            EventBody::Resumed { .. } => "resumed",
            EventBody::ChainEnded { .. } => "chain_ended",
        }
    }
}
