//! A request's record in the results bucket, as every process of the fleet reads it.
//!
//! One key per request, `res.<request_id>`, holds everything the fleet knows of it: the live
//! record while a worker holds it (which worker, which attempt), then its terminal result until
//! the result is read, then a small tombstone with the request's summary that stays until the
//! bucket's TTL. The worker's writes of it (claim, take-over, result, release) are in the
//! worker's `bus::store`.

use serde::{Deserialize, Serialize};

use crate::protocol::{FinishedSummary, GenerationResult, RequestState};

/// A request's live record: where it runs, and which attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveRecord {
    pub request_id: String,
    /// RUNNING, or QUEUED while a durable request in a worker's hands waits for a slot.
    pub state: RequestState,
    pub worker_id: String,
    pub attempt: u32,
    #[serde(default)]
    pub durable: bool,
    /// Its priority band; absent for `normal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<crate::protocol::Priority>,
    /// Its tenant; absent for the default tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Deliveries of a durable request that a worker gave back at once because its slot was
    /// taken before the request started: they are no attempt (`attempt` counts the others).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub handed_back: u32,
    /// A durable request's: the stream sequence of the queue message that claimed it. Only a
    /// redelivery of that very message may take the request over; another message with the
    /// same id is a duplicate and never runs. Absent for interactive requests (and in records
    /// of workers older than this field, whose redeliveries are taken as the same message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_seq: Option<u64>,
    /// Its last checkpoint: written while it runs, once it has run longer than
    /// `generation.checkpoint_ms`, so that a peer can go on from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Box<crate::protocol::Progress>>,
    /// The moves it made so far (its result lists them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resumed: Vec<crate::protocol::Resumed>,
    /// A durable request's: the acknowledgement subject of the queue delivery that runs it, so
    /// that a worker taking it up from its checkpoint keeps that delivery (alive, then
    /// acknowledged) instead of waiting for the queue to deliver it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack: Option<String>,
}

/// The `worker_id` of a durable request's record while no worker holds it: its worker gave
/// its message back to the queue (no free slot after all, or a drain), and the next delivery
/// of that message takes it over.
pub const GIVEN_BACK: &str = "";

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What `res.<id>` holds: the live record while the request runs, then its result until it is
/// read, then a small tombstone that keeps redeliveries from running the request again until
/// the bucket's TTL drops it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RequestRecord {
    Released {
        released: bool,
        state: RequestState,
        /// The request's summary, for `status` after the read.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        finished: Option<Box<FinishedSummary>>,
    },
    Live {
        live: LiveRecord,
    },
    Result(Box<GenerationResult>),
}

impl RequestRecord {
    /// The state the record tells.
    pub fn state(&self) -> RequestState {
        match self {
            RequestRecord::Released { state, .. } => *state,
            RequestRecord::Live { live } => live.state,
            RequestRecord::Result(result) => result.state,
        }
    }

    pub(crate) fn encode(&self) -> bytes::Bytes {
        serde_json::to_vec(self).expect("records serialize").into()
    }
}

/// A record as read: with its revision and the server's time of the write.
#[derive(Debug, Clone)]
pub struct Versioned {
    pub record: RequestRecord,
    pub revision: u64,
    pub written: std::time::SystemTime,
}

pub fn record_key(request_id: &str) -> String {
    format!("res.{request_id}")
}
