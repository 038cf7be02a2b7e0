//! The Supervisor: owns the worker's slots, every request record and all cancellation.
//!
//! It is the worker's one owner of per-request state: a request is on record here from its
//! submit (running, or waiting for a slot) until the layer above releases it after its end.
//! What that layer keeps with a request (its claim on the request id, its queue message, what
//! it asked) travels in the record as an opaque [`Ticket`] and comes back with the release, so
//! no second table of requests exists beside this one.
//!
//! Architecture invariant: only the Supervisor changes the busy count. A slot is taken in the
//! `Submit` handler and given back only in the `SlotReleased` handler, which the slot actor's
//! guard sends when it is dropped, on every path.
//!
//! Mailbox: bounded (see [`MAILBOX_CAPACITY`]). Callers whose rate a peer controls (the bus
//! layer forwarding submits, status reads, cancels) use `send`, which waits when the mailbox is
//! full, so a flood backs up into the bus's own bounded subscriptions instead of memory. Slot
//! actors use `do_send` for their two notices; there are at most two per slot in flight, so
//! what they queue is bounded by `worker.slots`.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::slot::{SlotActor, SlotGuard};
use crate::engine::{Engine, EventEmitter, EventSink, Finished, RequestContext};
use crate::protocol::ids::new_id;
use crate::protocol::{
    Accepted, CancelReply, Capacity, DEFAULT_TENANT, ErrorCode, EventBody, GenerationRequest,
    GenerationResult, Priority, Reason, RequestLimits, RequestState, StatsReply, StatusReply,
    WireError,
};
use crate::settings::{ReservedSlots, Settings};

/// Messages the Supervisor's mailbox holds before `send` callers wait.
pub const MAILBOX_CAPACITY: usize = 256;

#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    pub worker_id: String,
    pub pool: String,
    pub slots: u32,
    /// Finished results kept until read; past this the oldest are dropped (with a warning).
    pub max_retained_results: usize,
    /// How long a cancel waits for the cancelled request's result before answering.
    pub cancel_wait: Duration,
    pub limits: RequestLimits,
    /// Slots kept free for higher priority bands.
    pub reserved: ReservedSlots,
    /// Running requests of one tenant at most (0: no limit).
    pub tenant_max_running: u32,
}

impl SupervisorConfig {
    pub fn from_settings(settings: &Settings, worker_id: String) -> Self {
        SupervisorConfig {
            worker_id,
            pool: settings.worker.pool.clone(),
            slots: settings.worker.slots,
            max_retained_results: settings.worker.max_retained_results,
            cancel_wait: Duration::from_millis(settings.worker.cancel_wait_ms),
            limits: request_limits(settings),
            reserved: settings.worker.reserved_slots,
            tenant_max_running: settings.worker.tenants.max_running,
        }
    }
}

/// The bounds a request is checked against on acceptance, from the settings.
pub fn request_limits(settings: &Settings) -> RequestLimits {
    RequestLimits {
        max_metadata_bytes: settings.limits.max_metadata_bytes,
        max_tool_iterations: settings.generation.max_tool_iterations,
        ..RequestLimits::default()
    }
}

/// What the layer above keeps with a request while the Supervisor holds it. The Supervisor
/// never looks inside: it keeps it in the request's record and hands it back ([`Held`],
/// [`Release`]).
#[derive(Clone)]
pub struct Ticket(pub Arc<dyn Any + Send + Sync>);

impl Ticket {
    pub fn new<T: Any + Send + Sync>(value: T) -> Ticket {
        Ticket(Arc::new(value))
    }

    /// The value, if it is a `T`.
    pub fn get<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ticket")
    }
}

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
}

/// A request checked for acceptance: its fields within the limits and every tool it names
/// known. Only a [`RequestChecker`] makes one, so a request is checked once, before anything is
/// written for it, and the Supervisor takes it as it is.
#[derive(Debug, Clone)]
pub struct CheckedRequest(GenerationRequest);

impl CheckedRequest {
    pub fn request(&self) -> &GenerationRequest {
        &self.0
    }

    /// Its id (a checked request always has one).
    pub fn request_id(&self) -> &str {
        self.0.request_id.as_deref().unwrap_or_default()
    }

    pub fn into_request(self) -> GenerationRequest {
        self.0
    }

    /// The request under its id on the bus: `<tenant>.<id>` for a tenant other than the
    /// default, so that the same id in two tenants is two requests (see
    /// [`crate::protocol::schedule::qualified_id`]). Its id was checked bare.
    pub fn qualified(mut self, tenant: Option<&str>) -> CheckedRequest {
        let id = crate::protocol::schedule::qualified_id(tenant, self.request_id());
        self.0.request_id = Some(id);
        self
    }
}

/// Checks requests as the Supervisor accepts them: the limits from the settings and the tools
/// the engine knows now.
#[derive(Clone)]
pub struct RequestChecker {
    limits: RequestLimits,
    engine: Arc<Engine>,
}

impl RequestChecker {
    pub fn new(limits: RequestLimits, engine: Arc<Engine>) -> RequestChecker {
        RequestChecker { limits, engine }
    }

    /// Checks a request, giving it a fresh id when it has none.
    pub fn check(&self, mut request: GenerationRequest) -> Result<CheckedRequest, WireError> {
        request.request_id.get_or_insert_with(new_id);
        request.validate(&self.limits)?;
        self.engine.check_request(&request)?;
        Ok(CheckedRequest(request))
    }
}

/// Where a request stands in its chain and in the fleet; the defaults describe a fresh
/// interactive request accepted now.
#[derive(Debug, Default)]
pub struct Placement {
    pub root_request_id: Option<String>,
    pub parent_request_id: Option<String>,
    /// 1 when absent.
    pub chain_position: Option<u32>,
    /// 1 when absent.
    pub attempt: Option<u32>,
    /// Now when absent.
    pub accepted_at: Option<Instant>,
    /// Came from the durable queue: a drain hands it back instead of failing it.
    pub durable: bool,
    /// What it carries from earlier in its decision chain.
    pub chain: crate::engine::ChainState,
    /// The caller's W3C trace context (`traceparent` header), if it sent one.
    pub traceparent: Option<String>,
    /// For a continuation: the trace context of the decision it answers, to link its trace to.
    pub trace_link: Option<String>,
    /// With no free slot, wait for one (in order of arrival) instead of being refused. At most
    /// `slots` requests wait; past that the submit is refused with NO_SLOT_AVAILABLE.
    pub wait_for_slot: bool,
    /// Its priority band (from the request, or the queue subject it came on).
    pub band: Priority,
    /// Its tenant, from the subject it came on; `None` is the default tenant.
    pub tenant: Option<String>,
    /// Kept with the request's record and handed back with it.
    pub ticket: Option<Ticket>,
    /// Told when a request that waited for a slot starts in one (dropped unsent when it never
    /// does: cancelled or drained while it waited).
    pub on_start: Option<oneshot::Sender<()>>,
}

/// Start a request now, in a free slot (or, with `placement.wait_for_slot`, in the next one).
pub struct Submit {
    pub request: CheckedRequest,
    pub placement: Placement,
}

impl Message for Submit {
    type Result = Result<Accepted, WireError>;
}

pub struct Cancel {
    pub request_id: String,
}

/// The requests on record (running, waiting for a slot, or ended and not yet released), each
/// with its ticket: what the layer above reports in its heartbeat and keeps alive.
pub struct Held;

#[derive(Debug, Clone)]
pub struct HeldRequest {
    pub request_id: String,
    /// QUEUED (waiting for a slot), RUNNING, or the terminal state of one not yet released.
    pub state: RequestState,
    pub ticket: Option<Ticket>,
}

impl Message for Held {
    type Result = Vec<HeldRequest>;
}

/// The ticket of a request on record.
pub struct TicketOf {
    pub request_id: String,
}

impl Message for TicketOf {
    type Result = Option<Ticket>;
}

/// Takes an ended request off the record (the layer above stored its result): its ticket and
/// who cancelled it come back.
pub struct Release {
    pub request_id: String,
}

#[derive(Debug, Clone)]
pub struct Released {
    pub ticket: Option<Ticket>,
    pub cancelled_by: Option<Canceller>,
}

impl Message for Release {
    type Result = Option<Released>;
}

impl Message for Cancel {
    type Result = Result<CancelReply, WireError>;
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

enum Record {
    Waiting(Box<Waiting>),
    Running(Box<Running>),
    Finished(Box<Ended>),
}

/// A request accepted to wait for a slot.
struct Waiting {
    request: GenerationRequest,
    placement: Placement,
}

struct Running {
    context: RequestContext,
    job_name: Option<String>,
    metadata: serde_json::Map<String, serde_json::Value>,
    cancel: CancellationToken,
    cancelled_by: Option<Canceller>,
    waiters: Vec<oneshot::Sender<RequestState>>,
    durable: bool,
    sequence: Arc<AtomicU64>,
    ticket: Option<Ticket>,
    band: Priority,
    tenant: Option<String>,
}

/// An ended request, until its result is read or released.
struct Ended {
    result: GenerationResult,
    ticket: Option<Ticket>,
    cancelled_by: Option<Canceller>,
}

pub struct Supervisor {
    config: SupervisorConfig,
    engine: Arc<Engine>,
    sink: EventSink,
    busy: u32,
    draining: bool,
    /// Takes no work: its backend does not answer.
    paused: bool,
    records: HashMap<String, Record>,
    /// Requests waiting for a slot, oldest first.
    waiting: VecDeque<String>,
    /// Finished records in the order they finished, for the retention bound.
    finished_order: VecDeque<String>,
    /// The tenant and band of each taken slot, by request id, from the slot's start until
    /// its release (so at most `slots` entries).
    slot_tenants: HashMap<String, (String, Priority)>,
    capacity: watch::Sender<Capacity>,
}

/// A started Supervisor: its address and a view of its capacity that changes whenever a slot
/// is taken or freed (so the owner can subscribe to submits only while a slot is free).
#[derive(Clone)]
pub struct SupervisorHandle {
    pub addr: Addr<Supervisor>,
    pub capacity: watch::Receiver<Capacity>,
    /// Checks requests before they are submitted.
    pub checker: RequestChecker,
}

impl Supervisor {
    /// Starts the Supervisor on the current actix arbiter. Events of every request go to
    /// `sink` (a bounded channel; `None` drops them).
    pub fn start(
        config: SupervisorConfig,
        engine: Arc<Engine>,
        sink: EventSink,
    ) -> SupervisorHandle {
        let (capacity, receiver) = watch::channel(Capacity {
            total: config.slots,
            busy: 0,
            draining: false,
            waiting: 0,
            paused: false,
        });
        let checker = RequestChecker::new(config.limits.clone(), engine.clone());
        let supervisor = Supervisor {
            config,
            engine,
            sink,
            busy: 0,
            draining: false,
            paused: false,
            records: HashMap::new(),
            waiting: VecDeque::new(),
            finished_order: VecDeque::new(),
            slot_tenants: HashMap::new(),
            capacity,
        };
        SupervisorHandle {
            addr: supervisor.start(),
            capacity: receiver,
            checker,
        }
    }

    fn publish_capacity(&self) {
        let now = Capacity {
            total: self.config.slots,
            busy: self.busy,
            draining: self.draining,
            waiting: self.waiting.len() as u32,
            paused: self.paused,
        };
        self.capacity.send_if_modified(|c| {
            let changed = *c != now;
            *c = now;
            changed
        });
    }

    fn refuse(code: ErrorCode, message: impl Into<String>) -> WireError {
        WireError::new(code, message)
    }

    fn record_result(
        &mut self,
        result: GenerationResult,
        waiters: Vec<oneshot::Sender<RequestState>>,
        ticket: Option<Ticket>,
        cancelled_by: Option<Canceller>,
    ) {
        let state = result.state;
        let request_id = result.request_id.clone();
        self.records.insert(
            request_id.clone(),
            Record::Finished(Box::new(Ended {
                result,
                ticket,
                cancelled_by,
            })),
        );
        self.finished_order.push_back(request_id);
        for waiter in waiters {
            let _ = waiter.send(state);
        }
        while self.finished_order.len() > self.config.max_retained_results {
            let Some(oldest) = self.finished_order.pop_front() else {
                break;
            };
            if matches!(self.records.get(&oldest), Some(Record::Finished(_))) {
                self.records.remove(&oldest);
                tracing::warn!(
                    message = "dropped an unread result past worker.max_retained_results",
                    request_id = %oldest
                );
            }
        }
    }

    /// Starts a request in a free slot (the caller checked there is one).
    fn start_in_slot(
        &mut self,
        request: GenerationRequest,
        placement: Placement,
        ctx: &mut Context<Self>,
    ) -> String {
        let request_id = request.request_id.clone().unwrap_or_else(new_id);
        let context = context_of(&self.config, &request_id, &placement);
        if let Some(on_start) = placement.on_start {
            let _ = on_start.send(());
        }
        let cancel = CancellationToken::new();
        let sequence = Arc::new(AtomicU64::new(0));
        self.busy += 1;
        self.slot_tenants.insert(
            request_id.clone(),
            (tenant_name(&placement.tenant).to_string(), placement.band),
        );
        self.records.insert(
            request_id.clone(),
            Record::Running(Box::new(Running {
                context: context.clone(),
                job_name: request.job_name.clone(),
                metadata: request.metadata.clone(),
                cancel: cancel.clone(),
                cancelled_by: None,
                waiters: Vec::new(),
                durable: placement.durable,
                sequence: sequence.clone(),
                ticket: placement.ticket,
                band: placement.band,
                tenant: placement.tenant,
            })),
        );
        let guard = SlotGuard {
            request_id: request_id.clone(),
            supervisor: ctx.address(),
        };
        SlotActor {
            engine: self.engine.clone(),
            job: Some((request, context)),
            sink: self.sink.clone(),
            cancel,
            guard,
            sequence,
            task: None,
        }
        .start();
        request_id
    }

    /// Starts waiting requests while slots are free: the oldest of the highest band first,
    /// each only where its band's reserve and its tenant's limit allow.
    fn start_waiting(&mut self, ctx: &mut Context<Self>) {
        while !self.draining && !self.paused && self.busy < self.config.slots {
            let free = self.config.slots - self.busy;
            let next = self
                .waiting
                .iter()
                .enumerate()
                .filter_map(|(i, id)| match self.records.get(id) {
                    Some(Record::Waiting(w)) => Some((i, &w.placement)),
                    _ => None,
                })
                .filter(|(_, p)| free > self.config.reserved.above(p.band))
                .filter(|(_, p)| !self.at_tenant_limit(&p.tenant))
                .min_by_key(|(i, p)| (p.band, *i))
                .map(|(i, _)| i);
            let Some(index) = next else {
                break;
            };
            let Some(request_id) = self.waiting.remove(index) else {
                break;
            };
            let Some(Record::Waiting(waiting)) = self.records.remove(&request_id) else {
                continue;
            };
            let Waiting { request, placement } = *waiting;
            self.start_in_slot(request, placement, ctx);
        }
    }

    /// The tenant runs as many requests here as `worker.tenants.max_running` allows.
    fn at_tenant_limit(&self, tenant: &Option<String>) -> bool {
        let limit = self.config.tenant_max_running;
        limit > 0 && self.tenant_slots(tenant_name(tenant)) >= limit
    }

    /// The slots a tenant holds.
    fn tenant_slots(&self, tenant: &str) -> u32 {
        self.slot_tenants
            .values()
            .filter(|(t, _)| t == tenant)
            .count() as u32
    }

    /// Ends a request that waited for a slot without running: CANCELLED, by `by`.
    fn end_waiting(&mut self, request_id: &str, by: Canceller, detail: &str) -> bool {
        if !matches!(self.records.get(request_id), Some(Record::Waiting(_))) {
            return false;
        }
        let Some(Record::Waiting(waiting)) = self.records.remove(request_id) else {
            return false;
        };
        self.waiting.retain(|id| id != request_id);
        let Waiting { request, placement } = *waiting;
        let context = context_of(&self.config, request_id, &placement);
        let mut result = GenerationResult::empty(
            request_id,
            Reason::Cancelled,
            detail.to_string(),
            &self.config.worker_id,
        );
        fill_from_context(&mut result, &context, &request);
        let emitter = EventEmitter::continuing(
            request_id.to_string(),
            self.sink.clone(),
            self.engine.config().coalescing,
            Arc::new(AtomicU64::new(0)),
        );
        announce_finished(emitter, result.clone());
        self.record_result(result, Vec::new(), placement.ticket, Some(by));
        true
    }
}

/// Where a request runs, from its placement.
fn context_of(
    config: &SupervisorConfig,
    request_id: &str,
    placement: &Placement,
) -> RequestContext {
    RequestContext {
        root_request_id: placement
            .root_request_id
            .clone()
            .unwrap_or_else(|| request_id.to_string()),
        request_id: request_id.to_string(),
        parent_request_id: placement.parent_request_id.clone(),
        chain_position: placement.chain_position.unwrap_or(1),
        attempt: placement.attempt.unwrap_or(1),
        worker_id: config.worker_id.clone(),
        pool: config.pool.clone(),
        accepted_at: placement.accepted_at.unwrap_or_else(Instant::now),
        chain: placement.chain.clone(),
        traceparent: placement.traceparent.clone(),
    }
}

impl Actor for Supervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(MAILBOX_CAPACITY);
    }
}

impl Handler<Submit> for Supervisor {
    type Result = Result<Accepted, WireError>;

    fn handle(&mut self, msg: Submit, ctx: &mut Context<Self>) -> Self::Result {
        let Submit {
            request,
            mut placement,
        } = msg;
        if self.draining {
            return Err(Self::refuse(
                ErrorCode::NoSlotAvailable,
                "the worker is draining and accepts no new requests",
            ));
        }
        if self.paused && !placement.wait_for_slot {
            return Err(Self::refuse(
                ErrorCode::NoSlotAvailable,
                "the worker takes no work until its backend answers",
            ));
        }
        let request = request.into_request();
        let request_id = request.request_id.clone().unwrap_or_else(new_id);
        if self.records.contains_key(&request_id) {
            return Err(Self::refuse(
                ErrorCode::DuplicateRequestId,
                format!("request {request_id} is already known to this worker"),
            ));
        }
        let accepted = |state| Accepted {
            request_id: request_id.clone(),
            worker_id: self.config.worker_id.clone(),
            state,
        };
        let free = self.config.slots.saturating_sub(self.busy);
        let reserve = self.config.reserved.above(placement.band);
        let at_limit = self.at_tenant_limit(&placement.tenant);
        if at_limit && !placement.wait_for_slot {
            return Err(Self::refuse(
                ErrorCode::TenantLimit,
                format!(
                    "tenant {} already runs {} requests on this worker (worker.tenants.max_running)",
                    tenant_name(&placement.tenant),
                    self.config.tenant_max_running
                ),
            ));
        }
        if free > reserve && !at_limit && self.waiting.is_empty() {
            let accepted = accepted(RequestState::Running);
            // Started at once: nobody waits to hear it.
            placement.on_start = None;
            self.start_in_slot(request, placement, ctx);
            self.publish_capacity();
            return Ok(accepted);
        }
        if placement.wait_for_slot && self.waiting.len() < self.config.slots as usize {
            let accepted = accepted(RequestState::Queued);
            self.waiting.push_back(request_id.clone());
            self.records.insert(
                request_id,
                Record::Waiting(Box::new(Waiting { request, placement })),
            );
            self.publish_capacity();
            return Ok(accepted);
        }
        if free > 0 {
            return Err(Self::refuse(
                ErrorCode::NoSlotAvailable,
                format!(
                    "the {free} free slots are reserved for bands above {} (worker.reserved_slots)",
                    placement.band
                ),
            ));
        }
        Err(Self::refuse(
            ErrorCode::NoSlotAvailable,
            format!("all {} slots are busy", self.config.slots),
        ))
    }
}

impl Handler<SlotDone> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: SlotDone, _: &mut Context<Self>) {
        let Some(Record::Running(running)) = self.records.remove(&msg.request_id) else {
            // Already ended (e.g. released first): the first terminal result stands.
            tracing::warn!(message = "a second end for one request was ignored", request_id = %msg.request_id);
            return;
        };
        let running = *running;
        let result = match msg.outcome {
            Ok(finished) => finished.result,
            Err(detail) => lost_result(&running, &msg.context, detail),
        };
        let emitter = EventEmitter::continuing(
            msg.request_id,
            self.sink.clone(),
            self.engine.config().coalescing,
            msg.sequence,
        );
        announce_finished(emitter, result.clone());
        self.record_result(
            result,
            running.waiters,
            running.ticket,
            running.cancelled_by,
        );
    }
}

impl Handler<SlotReleased> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: SlotReleased, ctx: &mut Context<Self>) {
        self.busy = self.busy.checked_sub(1).unwrap_or_else(|| {
            tracing::error!(message = "a slot was released twice", request_id = %msg.request_id);
            0
        });
        self.slot_tenants.remove(&msg.request_id);
        // A slot that ends without a result (its actor stopped first) still ends its request.
        if let Some(Record::Running(_)) = self.records.get(&msg.request_id)
            && let Some(Record::Running(running)) = self.records.remove(&msg.request_id)
        {
            let running = *running;
            let detail = "the slot stopped before the generation ended".to_string();
            let result = lost_result(&running, &running.context, detail);
            let emitter = EventEmitter::continuing(
                msg.request_id.clone(),
                self.sink.clone(),
                self.engine.config().coalescing,
                running.sequence.clone(),
            );
            announce_finished(emitter, result.clone());
            self.record_result(
                result,
                running.waiters,
                running.ticket,
                running.cancelled_by,
            );
        }
        self.start_waiting(ctx);
        self.publish_capacity();
    }
}

impl Supervisor {
    fn cancel(
        &mut self,
        request_id: String,
        by: Canceller,
    ) -> ResponseFuture<Result<CancelReply, WireError>> {
        let immediate =
            |r: Result<CancelReply, WireError>| -> ResponseFuture<Result<CancelReply, WireError>> {
                Box::pin(async move { r })
            };
        if self.end_waiting(&request_id, by, "cancelled while waiting for a slot") {
            self.publish_capacity();
            return immediate(Ok(CancelReply {
                request_id,
                state: RequestState::Cancelled,
                decision_id: None,
            }));
        }
        match self.records.get_mut(&request_id) {
            None | Some(Record::Waiting(_)) => immediate(Err(WireError::new(
                ErrorCode::NotFound,
                format!("request {request_id} is not known to this worker"),
            ))),
            Some(Record::Finished(ended)) => immediate(Err(WireError::new(
                ErrorCode::AlreadyFinished,
                format!("request {request_id} already ended"),
            )
            .with_detail(serde_json::json!({"state": ended.result.state})))),
            Some(Record::Running(running)) => {
                running.cancel.cancel();
                running.cancelled_by.get_or_insert(by);
                let (tx, rx) = oneshot::channel();
                running.waiters.push(tx);
                let wait = self.config.cancel_wait;
                Box::pin(async move {
                    let state = match tokio::time::timeout(wait, rx).await {
                        Ok(Ok(state)) => state,
                        _ => RequestState::Running,
                    };
                    Ok(CancelReply {
                        request_id,
                        state,
                        decision_id: None,
                    })
                })
            }
        }
    }
}

impl Handler<Cancel> for Supervisor {
    type Result = ResponseFuture<Result<CancelReply, WireError>>;

    fn handle(&mut self, msg: Cancel, _: &mut Context<Self>) -> Self::Result {
        self.cancel(msg.request_id, Canceller::Caller)
    }
}

impl Handler<Status> for Supervisor {
    type Result = Result<StatusReply, WireError>;

    fn handle(&mut self, msg: Status, _: &mut Context<Self>) -> Self::Result {
        let state = match self.records.get(&msg.request_id) {
            None => {
                return Err(WireError::new(
                    ErrorCode::NotFound,
                    format!("request {} is not known to this worker", msg.request_id),
                ));
            }
            Some(Record::Waiting(waiting)) => (
                RequestState::Queued,
                Some((waiting.placement.band, waiting.placement.tenant.clone())),
            ),
            Some(Record::Running(running)) => (
                RequestState::Running,
                Some((running.band, running.tenant.clone())),
            ),
            Some(Record::Finished(ended)) => (ended.result.state, None),
        };
        let (state, placed) = state;
        let (priority, tenant) = match placed {
            Some((band, tenant)) => (
                Some(band),
                Some(tenant.unwrap_or_else(|| DEFAULT_TENANT.to_string())),
            ),
            None => (None, None),
        };
        Ok(StatusReply {
            worker_id: Some(self.config.worker_id.clone()),
            priority,
            tenant,
            ..StatusReply::new(&msg.request_id, state)
        })
    }
}

impl Handler<GetResult> for Supervisor {
    type Result = Result<GenerationResult, WireError>;

    fn handle(&mut self, msg: GetResult, _: &mut Context<Self>) -> Self::Result {
        match self.records.get(&msg.request_id) {
            None => Err(WireError::new(
                ErrorCode::NotFound,
                format!("no result for request {}", msg.request_id),
            )),
            Some(Record::Running(_)) | Some(Record::Waiting(_)) => {
                let state = match self.records.get(&msg.request_id) {
                    Some(Record::Waiting(_)) => RequestState::Queued,
                    _ => RequestState::Running,
                };
                Err(WireError::new(
                    ErrorCode::NotReady,
                    format!("request {} is {}", msg.request_id, state.as_str()),
                )
                .with_detail(serde_json::json!({"state": state})))
            }
            Some(Record::Finished(ended)) if !msg.release => Ok(ended.result.clone()),
            Some(Record::Finished(_)) => {
                let Some(Record::Finished(ended)) = self.records.remove(&msg.request_id) else {
                    unreachable!("matched as finished above");
                };
                self.finished_order.retain(|id| id != &msg.request_id);
                Ok(ended.result)
            }
        }
    }
}

impl Handler<Held> for Supervisor {
    type Result = MessageResult<Held>;

    fn handle(&mut self, _: Held, _: &mut Context<Self>) -> Self::Result {
        let held = self
            .records
            .iter()
            .map(|(request_id, record)| {
                let (state, ticket) = match record {
                    Record::Waiting(waiting) => (RequestState::Queued, &waiting.placement.ticket),
                    Record::Running(running) => (RequestState::Running, &running.ticket),
                    Record::Finished(ended) => (ended.result.state, &ended.ticket),
                };
                HeldRequest {
                    request_id: request_id.clone(),
                    state,
                    ticket: ticket.clone(),
                }
            })
            .collect();
        MessageResult(held)
    }
}

impl Handler<TicketOf> for Supervisor {
    type Result = Option<Ticket>;

    fn handle(&mut self, msg: TicketOf, _: &mut Context<Self>) -> Self::Result {
        match self.records.get(&msg.request_id)? {
            Record::Waiting(waiting) => waiting.placement.ticket.clone(),
            Record::Running(running) => running.ticket.clone(),
            Record::Finished(ended) => ended.ticket.clone(),
        }
    }
}

impl Handler<Release> for Supervisor {
    type Result = Option<Released>;

    fn handle(&mut self, msg: Release, _: &mut Context<Self>) -> Self::Result {
        if !matches!(self.records.get(&msg.request_id), Some(Record::Finished(_))) {
            return None;
        }
        let Some(Record::Finished(ended)) = self.records.remove(&msg.request_id) else {
            return None;
        };
        self.finished_order.retain(|id| id != &msg.request_id);
        Some(Released {
            ticket: ended.ticket,
            cancelled_by: ended.cancelled_by,
        })
    }
}

impl Handler<Pause> for Supervisor {
    type Result = ();

    fn handle(&mut self, Pause(paused): Pause, ctx: &mut Context<Self>) {
        self.paused = paused;
        if paused {
            // What waits here for a slot would wait for the backend: it goes back to the
            // queue for a worker whose backend answers, as in a drain.
            for request_id in self.waiting.clone() {
                self.end_waiting(
                    &request_id,
                    Canceller::Drain,
                    "the worker's backend stopped answering before the request started",
                );
            }
        } else {
            self.start_waiting(ctx);
        }
        self.publish_capacity();
    }
}

impl Handler<Fence> for Supervisor {
    type Result = MessageResult<Fence>;

    fn handle(&mut self, Fence(ids): Fence, _: &mut Context<Self>) -> Self::Result {
        let mut fenced = Vec::new();
        for request_id in ids {
            if self.end_waiting(
                &request_id,
                Canceller::Fenced,
                "the fleet declared this worker lost before the request started",
            ) {
                fenced.push(request_id);
            } else if let Some(Record::Running(running)) = self.records.get_mut(&request_id) {
                running.cancel.cancel();
                running.cancelled_by.get_or_insert(Canceller::Fenced);
                fenced.push(request_id);
            }
        }
        MessageResult(fenced)
    }
}

impl Handler<TenantSlots> for Supervisor {
    type Result = Vec<(String, Priority, u32)>;

    fn handle(&mut self, _: TenantSlots, _: &mut Context<Self>) -> Self::Result {
        let mut counts: HashMap<(&str, Priority), u32> = HashMap::new();
        for (tenant, band) in self.slot_tenants.values() {
            *counts.entry((tenant.as_str(), *band)).or_default() += 1;
        }
        counts
            .into_iter()
            .map(|((tenant, band), n)| (tenant.to_string(), band, n))
            .collect()
    }
}

impl Handler<Stats> for Supervisor {
    type Result = MessageResult<Stats>;

    fn handle(&mut self, _: Stats, _: &mut Context<Self>) -> Self::Result {
        let running = self
            .records
            .values()
            .filter(|r| matches!(r, Record::Running(_)))
            .count();
        MessageResult(StatsReply {
            capacity: *self.capacity.borrow(),
            running,
            retained_results: self.records.len() - running - self.waiting.len(),
        })
    }
}

impl Handler<Drain> for Supervisor {
    type Result = ResponseActFuture<Self, DrainReport>;

    fn handle(&mut self, msg: Drain, _: &mut Context<Self>) -> Self::Result {
        self.draining = true;
        // What waits for a slot will not get one here: it ends now, handed back by the drain.
        let mut handed_back = Vec::new();
        for request_id in self.waiting.clone() {
            if self.end_waiting(
                &request_id,
                Canceller::Drain,
                "the worker drained before it started",
            ) {
                handed_back.push((request_id, true));
            }
        }
        self.publish_capacity();
        let mut capacity = self.capacity.subscribe();
        let cancel_wait = self.config.cancel_wait;
        let idle = async move {
            tokio::time::timeout(msg.deadline, capacity.wait_for(|c| c.busy == 0))
                .await
                .is_ok()
        };
        Box::pin(idle.into_actor(self).then(move |all_done, act, _| {
            let mut report = DrainReport {
                cancelled: handed_back,
            };
            if !all_done {
                for (id, record) in &mut act.records {
                    if let Record::Running(running) = record {
                        running.cancel.cancel();
                        running.cancelled_by.get_or_insert(Canceller::Drain);
                        report.cancelled.push((id.clone(), running.durable));
                    }
                }
                tracing::info!(
                    message = "drain deadline passed; cancelled the remaining requests",
                    count = report.cancelled.len()
                );
            }
            let mut capacity = act.capacity.subscribe();
            async move {
                let _ = tokio::time::timeout(cancel_wait, capacity.wait_for(|c| c.busy == 0)).await;
                report
            }
            .into_actor(act)
        }))
    }
}

/// Publishes `finished` after the result is recorded, off the actor's thread.
fn announce_finished(mut emitter: EventEmitter, result: GenerationResult) {
    tokio::spawn(async move {
        emitter
            .emit(EventBody::Finished {
                result: Box::new(result),
            })
            .await;
    });
}

/// The result of a request whose generation was lost (a panic, a stopped slot).
fn lost_result(running: &Running, context: &RequestContext, detail: String) -> GenerationResult {
    let mut result = GenerationResult::empty(
        &context.request_id,
        Reason::WorkerLost,
        detail,
        &context.worker_id,
    );
    place(
        &mut result,
        context,
        running.job_name.clone(),
        running.metadata.clone(),
    );
    result
}

/// Fills a result made here (not by a generation) from its request and place.
fn fill_from_context(
    result: &mut GenerationResult,
    context: &RequestContext,
    request: &GenerationRequest,
) {
    place(
        result,
        context,
        request.job_name.clone(),
        request.metadata.clone(),
    );
}

/// The name of a placement's tenant.
fn tenant_name(tenant: &Option<String>) -> &str {
    tenant.as_deref().unwrap_or(DEFAULT_TENANT)
}

fn place(
    result: &mut GenerationResult,
    context: &RequestContext,
    job_name: Option<String>,
    metadata: serde_json::Map<String, serde_json::Value>,
) {
    result.root_request_id = context.root_request_id.clone();
    result.parent_request_id = context.parent_request_id.clone();
    result.job_name = job_name;
    result.attempt = context.attempt;
    result.chain_position = context.chain_position;
    result.metadata = metadata;
    result.timings_ms.total = context.accepted_at.elapsed().as_millis() as u64;
}
