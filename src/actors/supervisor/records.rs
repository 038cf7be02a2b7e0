//! A request on the Supervisor's record, one variant per step of its life: waiting for a slot,
//! running in one, ended until its result is read or released.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::actors::messages::{Canceller, Placement};
use crate::engine::RequestContext;
use crate::protocol::{GenerationRequest, GenerationResult, Priority, RequestState};

pub(super) enum Record<T> {
    Waiting(Box<Waiting<T>>),
    Running(Box<Running<T>>),
    Finished(Box<Ended<T>>),
}

impl<T> Record<T> {
    /// The ticket its owner keeps with it.
    pub(super) fn ticket(&self) -> &Option<T> {
        match self {
            Record::Waiting(waiting) => &waiting.placement.ticket,
            Record::Running(running) => &running.ticket,
            Record::Finished(ended) => &ended.ticket,
        }
    }
}

/// A request accepted to wait for a slot.
pub(super) struct Waiting<T> {
    pub(super) request: GenerationRequest,
    pub(super) placement: Placement<T>,
}

pub(super) struct Running<T> {
    pub(super) context: RequestContext,
    pub(super) job_name: Option<String>,
    pub(super) metadata: serde_json::Map<String, serde_json::Value>,
    pub(super) cancel: CancellationToken,
    pub(super) cancelled_by: Option<Canceller>,
    pub(super) waiters: Vec<oneshot::Sender<RequestState>>,
    pub(super) durable: bool,
    pub(super) sequence: Arc<AtomicU64>,
    pub(super) ticket: Option<T>,
    pub(super) band: Priority,
    pub(super) tenant: Option<String>,
    /// When it took its slot (the newest of a band is preempted first).
    pub(super) started_at: std::time::Instant,
}

/// An ended request, until its result is read or released.
pub(super) struct Ended<T> {
    pub(super) result: GenerationResult,
    pub(super) ticket: Option<T>,
    pub(super) cancelled_by: Option<Canceller>,
}
