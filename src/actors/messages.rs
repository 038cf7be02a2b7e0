//! What the Supervisor is asked and what it answers: the messages of the layer above, the two
//! notices a slot sends, and a submitted request's [`Placement`].
//!
//! Both the Supervisor and its slots import this file and not each other: a slot is handed the
//! [`Recipient`]s of its two notices, so it never names the actor it reports to.
//!
//! The ticket (`T` throughout) is what the layer above keeps with a request while the
//! Supervisor holds it. The Supervisor never looks inside: it keeps it in the request's record
//! and hands it back ([`Held`], [`TicketOf`], [`Release`]), so no second table of requests
//! exists beside the Supervisor's.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;

use super::checker::CheckedRequest;
use crate::engine::{ChainState, Continuity, Finished, RequestContext};
use crate::protocol::{
    Accepted, CancelReply, GenerationResult, Priority, RequestState, StatsReply, StatusReply,
    WireError,
};

/// What a ticket must be: kept in a record, cloned into an answer, sent between tasks.
pub trait Ticket: Clone + Send + Unpin + 'static {}

impl<T: Clone + Send + Unpin + 'static> Ticket for T {}

/// Who cancelled a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Canceller {
    /// A caller (or a manager) asked for it.
    Caller,
    /// The worker's drain ran out of time (a durable request is then handed back).
    Drain,
    /// The fleet declared this worker lost (its heartbeat expired while it was paused or cut
    /// off): what it held is no longer its own, and it says nothing more of it.
    Fenced,
    /// The worker's drain asked it to hand off: it writes a checkpoint and a live peer goes on
    /// from it (its end here is not the request's; see [`crate::engine::HANDED_OFF`]).
    HandOff,
    /// A request of a higher band took its slot: it writes a checkpoint and waits here to go
    /// on from it.
    Preempted,
}

/// Where a request stands in its decision chain and in its caller's trace; the defaults
/// describe a request of its own (the first of its chain).
#[derive(Debug, Clone, Default)]
pub struct Lineage {
    pub root_request_id: Option<String>,
    pub parent_request_id: Option<String>,
    /// 1 when absent.
    pub chain_position: Option<u32>,
    /// What it carries from earlier in its decision chain.
    pub chain: ChainState,
    /// The caller's W3C trace context (`traceparent` header), if it sent one.
    pub traceparent: Option<String>,
    /// For a continuation: the trace context of the decision it answers, to link its trace to.
    pub trace_link: Option<String>,
}

/// How a request is given a slot: its band and tenant, whether it may wait for one, and how it
/// came (interactive or from the durable queue, which delivery, since when); the defaults
/// describe a fresh interactive request accepted now.
#[derive(Debug, Clone, Default)]
pub struct Scheduling {
    /// Its priority band (from the request, or the queue subject it came on).
    pub band: Priority,
    /// Its tenant, from the subject it came on; `None` is the default tenant.
    pub tenant: Option<String>,
    /// With no free slot, wait for one (in order of arrival) instead of being refused. At most
    /// `slots` requests wait; past that the submit is refused with NO_SLOT_AVAILABLE.
    pub wait_for_slot: bool,
    /// Came from the durable queue: a drain hands it back instead of failing it.
    pub durable: bool,
    /// Its delivery; 1 when absent.
    pub attempt: Option<u32>,
    /// When the fleet accepted it; now when absent.
    pub accepted_at: Option<Instant>,
}

/// A submitted request's place: in its chain, among the slots, and what its owner keeps with
/// it.
#[derive(Debug)]
pub struct Placement<T> {
    pub lineage: Lineage,
    pub scheduling: Scheduling,
    /// Kept with the request's record and handed back with it.
    pub ticket: Option<T>,
    /// Told when a request that waited for a slot starts in one (dropped unsent when it never
    /// does: cancelled or drained while it waited).
    pub on_start: Option<oneshot::Sender<()>>,
    /// Where its checkpoints go, and the checkpoint it goes on from.
    pub continuity: Continuity,
}

impl<T> Default for Placement<T> {
    fn default() -> Self {
        Placement {
            lineage: Lineage::default(),
            scheduling: Scheduling::default(),
            ticket: None,
            on_start: None,
            continuity: Continuity::default(),
        }
    }
}

/// Start a request now, in a free slot (or, with `wait_for_slot`, in the next one).
pub struct Submit<T> {
    pub request: CheckedRequest,
    pub placement: Placement<T>,
}

impl<T: Ticket> Message for Submit<T> {
    type Result = Result<Accepted, WireError>;
}

pub struct Cancel {
    pub request_id: String,
}

impl Message for Cancel {
    type Result = Result<CancelReply, WireError>;
}

/// The requests on record (running, waiting for a slot, or ended and not yet released), each
/// with its ticket: what the layer above reports in its heartbeat and keeps alive.
pub struct Held<T>(PhantomData<fn() -> T>);

impl<T> Held<T> {
    pub fn new() -> Held<T> {
        Held(PhantomData)
    }
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Held::new()
    }
}

#[derive(Debug, Clone)]
pub struct HeldRequest<T> {
    pub request_id: String,
    /// QUEUED (waiting for a slot), RUNNING, or the terminal state of one not yet released.
    pub state: RequestState,
    pub ticket: Option<T>,
}

impl<T: Ticket> Message for Held<T> {
    type Result = Vec<HeldRequest<T>>;
}

/// The ticket of a request on record.
pub struct TicketOf<T> {
    pub request_id: String,
    ticket: PhantomData<fn() -> T>,
}

impl<T> TicketOf<T> {
    pub fn new(request_id: impl Into<String>) -> TicketOf<T> {
        TicketOf {
            request_id: request_id.into(),
            ticket: PhantomData,
        }
    }
}

impl<T: Ticket> Message for TicketOf<T> {
    type Result = Option<T>;
}

/// Takes an ended request off the record (the layer above stored its result): its ticket and
/// who cancelled it come back.
pub struct Release<T> {
    pub request_id: String,
    ticket: PhantomData<fn() -> T>,
}

impl<T> Release<T> {
    pub fn new(request_id: impl Into<String>) -> Release<T> {
        Release {
            request_id: request_id.into(),
            ticket: PhantomData,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Released<T> {
    pub ticket: Option<T>,
    pub cancelled_by: Option<Canceller>,
}

impl<T: Ticket> Message for Release<T> {
    type Result = Option<Released<T>>;
}

pub struct Status {
    pub request_id: String,
}

impl Message for Status {
    type Result = Result<StatusReply, WireError>;
}

/// Read a terminal result; `release` (the default on the wire) removes the record.
pub struct GetResult {
    pub request_id: String,
    pub release: bool,
}

impl Message for GetResult {
    type Result = Result<GenerationResult, WireError>;
}

/// Stop accepting; let running requests finish until `deadline`, then cancel the rest.
pub struct Drain {
    pub deadline: Duration,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Requests the drain cancelled, with whether each came from the durable queue (those are
    /// handed back for another worker rather than reported as failures).
    pub cancelled: Vec<(String, bool)>,
}

impl Message for Drain {
    type Result = DrainReport;
}

/// Stops (or resumes) taking work: a worker whose backend does not answer takes none. Running
/// requests go on; requests waiting for a slot are handed back (as by a drain).
pub struct Pause(pub bool);

impl Message for Pause {
    type Result = ();
}

/// Stops these requests, running or waiting for a slot, as [`Canceller::Fenced`]: the fleet
/// took them from this worker (it was declared lost). Answers with the ids it stopped.
pub struct Fence(pub Vec<String>);

impl Message for Fence {
    type Result = Vec<String>;
}

/// The slots each tenant holds on this worker, by band (those holding none are left out).
pub struct TenantSlots;

impl Message for TenantSlots {
    type Result = Vec<(String, Priority, u32)>;
}

/// Counts for the service API and tests.
pub struct Stats;

impl Message for Stats {
    type Result = StatsReply;
}

/// From a slot: its generation ended (or was lost).
pub(super) struct SlotDone {
    pub(super) request_id: String,
    pub(super) context: RequestContext,
    pub(super) outcome: Result<Finished, String>,
    pub(super) sequence: Arc<AtomicU64>,
}

impl Message for SlotDone {
    type Result = ();
}

/// From a slot's guard: the slot is free.
pub(super) struct SlotReleased {
    pub(super) request_id: String,
}

impl Message for SlotReleased {
    type Result = ();
}
