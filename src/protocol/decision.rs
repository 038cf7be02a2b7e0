//! A decision on the bus: its record in the decisions bucket (documented in
//! docs/protocol.md), the answer it got, the reply to a manager's answer, the mark kept beside
//! the asking request, and the headers that place a continuation in its chain.

use serde::{Deserialize, Serialize};

use super::{
    ChainState, DecisionAnswer, DecisionBlock, DecisionOutcome, GenerationRequest, Signal,
};

/// Queue message headers that place a continuation in its chain (the request body stays the
/// caller-facing request).
pub const PARENT_HEADER: &str = "Genfleet-Parent-Request-Id";
pub const ROOT_HEADER: &str = "Genfleet-Root-Request-Id";
pub const CHAIN_HEADER: &str = "Genfleet-Chain-Position";
/// What the continuation carries from earlier in its chain (compact JSON of [`ChainState`]).
pub const CHAIN_STATE_HEADER: &str = "Genfleet-Chain-State";
/// The W3C `traceparent` of the decision a continuation answers: the continuation's trace is a
/// new one, linked to it (only when the fleet exports traces).
pub const TRACE_LINK_HEADER: &str = "Genfleet-Trace-Link";

/// The record of a decision in the bucket (documented in docs/protocol.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    pub decision_id: String,
    pub request_id: String,
    pub root_request_id: String,
    pub chain_position: u32,
    pub pool: String,
    pub decision: DecisionBlock,
    /// The signal as published.
    pub signal: Signal,
    /// The request that asked, to restate it in the continuation.
    pub request: GenerationRequest,
    /// The `seq` the `continued` (or `chain_ended`) event takes on the asking request's
    /// events subject.
    pub continued_seq: u64,
    /// What the asking request carried from earlier in its chain.
    #[serde(default)]
    pub chain: ChainState,
    /// The tenant the asking request ran for (absent: the default tenant); its continuation is
    /// queued under the same tenant, in the same band.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<Answer>,
    /// Set when the decision expired unanswered (DECISION_EXPIRED).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expired_at: Option<String>,
    /// The W3C `traceparent` of the asking request's span, when its worker exports traces:
    /// the decision's wait is recorded under it and the continuation's trace links to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl DecisionRecord {
    /// Still waiting for an answer: neither answered nor expired.
    pub fn is_pending(&self) -> bool {
        self.answer.is_none() && self.expired_at.is_none()
    }
}

/// The answer a decision got, as recorded: the manager's choice and what came of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    #[serde(flatten)]
    pub choice: DecisionAnswer,
    pub outcome: DecisionOutcome,
    /// The continuation it started (`continued` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation_request_id: Option<String>,
    pub decided_at: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionReply {
    pub decision_id: String,
    pub continuation_request_id: Option<String>,
    /// `continued`, or `skipped` / `aborted` for the options that end a chain.
    pub outcome: DecisionOutcome,
}

/// What became of the decision a request raised, kept beside its result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainMark {
    pub decision_id: String,
    pub outcome: DecisionOutcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation_request_id: Option<String>,
}
