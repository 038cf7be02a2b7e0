//! Replies a worker sends on the bus besides results and errors: a submit's acceptance, a
//! request's status, a cancel's answer, and a worker's slot counts (the service API's `capacity` endpoint).

use serde::{Deserialize, Serialize};

use super::{DecisionOutcome, FinishedSummary, RequestState};

/// The answer on `gen.submit.<pool>`: the request was accepted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Accepted {
    pub request_id: String,
    pub worker_id: String,
    /// RUNNING (QUEUED for a durable request waiting in a worker for a slot).
    pub state: RequestState,
}

/// The answer on `gen.status.<request_id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReply {
    pub request_id: String,
    pub state: RequestState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Set once a decision this request raised was answered with an option that continues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation_request_id: Option<String>,
    /// The decision this request raised, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    /// What became of it: pending, continued, skipped, aborted or expired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_outcome: Option<DecisionOutcome>,
    /// A finished request's summary (how it ended, why, its figures and openings), kept for
    /// people after its result is read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<FinishedSummary>,
    /// Its priority band, while it waits or runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<super::Priority>,
    /// Its tenant, while it waits or runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

impl StatusReply {
    pub fn new(request_id: &str, state: RequestState) -> StatusReply {
        StatusReply {
            request_id: request_id.into(),
            state,
            worker_id: None,
            attempt: None,
            continuation_request_id: None,
            decision_id: None,
            decision_outcome: None,
            finished: None,
            priority: None,
            tenant: None,
        }
    }
}

/// The answer on `gen.cancel.<request_id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelReply {
    pub request_id: String,
    /// CANCELLED once the request's result is stored; the state it had (RUNNING) when the
    /// wait for the result ran out.
    pub state: RequestState,
    /// Set when the request was waiting on this decision: the cancel expired it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
}

/// A worker's slots. `free` is 0 while draining or paused (its backend does not answer), and
/// while requests wait for a slot (the next free slot is theirs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub total: u32,
    pub busy: u32,
    pub draining: bool,
    /// Requests accepted to wait for a slot (durable ones pulled while an interactive submit
    /// took the last slot).
    #[serde(default)]
    pub waiting: u32,
    /// The worker takes no work: its backend does not answer (yet).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
}

impl Capacity {
    pub fn free(&self) -> u32 {
        if self.draining || self.paused {
            0
        } else {
            self.total
                .saturating_sub(self.busy)
                .saturating_sub(self.waiting)
        }
    }
}

/// The answer of a worker's `capacity` endpoint (`gen.worker.<worker_id>.capacity`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsReply {
    pub capacity: Capacity,
    pub running: usize,
    pub retained_results: usize,
}
