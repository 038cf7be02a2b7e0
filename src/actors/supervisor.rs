//! The Supervisor: owns the worker's slots and every request record, and all cancellation.
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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use actix::prelude::*;
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::slot::{SlotActor, SlotGuard};
use crate::engine::{Engine, EventEmitter, EventSink, Finished, RequestContext};
use crate::protocol::ids::new_id;
use crate::protocol::{
    ErrorCode, EventBody, GenerationRequest, GenerationResult, Reason, RequestLimits, RequestState,
    WireError,
};
use crate::settings::Settings;

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

/// The slots as the owner sees them. `free` is 0 while draining.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub total: u32,
    pub busy: u32,
    pub draining: bool,
}

impl Capacity {
    pub fn free(&self) -> u32 {
        if self.draining {
            0
        } else {
            self.total - self.busy
        }
    }
}

/// Where a request stands in its chain and in the fleet; the defaults describe a fresh
/// interactive request accepted now.
#[derive(Debug, Clone, Default)]
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
}

/// Start a request now, in a free slot.
pub struct Submit {
    pub request: GenerationRequest,
    pub placement: Placement,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Accepted {
    pub request_id: String,
    pub worker_id: String,
    pub state: RequestState,
}

impl Message for Submit {
    type Result = Result<Accepted, WireError>;
}

pub struct Cancel {
    pub request_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelReply {
    pub request_id: String,
    /// The state once the result is stored (CANCELLED, or the state it reached first); RUNNING
    /// when the wait for the result ran out.
    pub state: RequestState,
    /// Set when the request was waiting on this decision: the cancel expired it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
}

impl Message for Cancel {
    type Result = Result<CancelReply, WireError>;
}

pub struct Status {
    pub request_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReply {
    pub request_id: String,
    pub state: RequestState,
    pub worker_id: String,
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

/// Counts for the service API and tests.
pub struct Stats;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsReply {
    pub capacity: Capacity,
    pub running: usize,
    pub retained_results: usize,
}

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
    Running(Box<Running>),
    Finished(Box<GenerationResult>),
}

struct Running {
    context: RequestContext,
    job_name: Option<String>,
    metadata: serde_json::Map<String, serde_json::Value>,
    cancel: CancellationToken,
    waiters: Vec<oneshot::Sender<RequestState>>,
    durable: bool,
    sequence: Arc<AtomicU64>,
}

pub struct Supervisor {
    config: SupervisorConfig,
    engine: Arc<Engine>,
    sink: EventSink,
    busy: u32,
    draining: bool,
    records: HashMap<String, Record>,
    /// Finished records in the order they finished, for the retention bound.
    finished_order: VecDeque<String>,
    capacity: watch::Sender<Capacity>,
}

/// A started Supervisor: its address and a view of its capacity that changes whenever a slot
/// is taken or freed (so the owner can subscribe to submits only while a slot is free).
#[derive(Clone)]
pub struct SupervisorHandle {
    pub addr: Addr<Supervisor>,
    pub capacity: watch::Receiver<Capacity>,
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
        });
        let supervisor = Supervisor {
            config,
            engine,
            sink,
            busy: 0,
            draining: false,
            records: HashMap::new(),
            finished_order: VecDeque::new(),
            capacity,
        };
        SupervisorHandle {
            addr: supervisor.start(),
            capacity: receiver,
        }
    }

    fn publish_capacity(&self) {
        let now = Capacity {
            total: self.config.slots,
            busy: self.busy,
            draining: self.draining,
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
    ) {
        let state = result.state;
        let request_id = result.request_id.clone();
        self.records
            .insert(request_id.clone(), Record::Finished(Box::new(result)));
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
        let Submit { request, placement } = msg;
        if self.draining {
            return Err(Self::refuse(
                ErrorCode::NoSlotAvailable,
                "the worker is draining and accepts no new requests",
            ));
        }
        request.validate(&self.config.limits)?;
        self.engine.check_request(&request)?;
        let request_id = request.request_id.clone().unwrap_or_else(new_id);
        if self.records.contains_key(&request_id) {
            return Err(Self::refuse(
                ErrorCode::DuplicateRequestId,
                format!("request {request_id} is already known to this worker"),
            ));
        }
        if self.busy >= self.config.slots {
            return Err(Self::refuse(
                ErrorCode::NoSlotAvailable,
                format!("all {} slots are busy", self.config.slots),
            ));
        }
        let context = RequestContext {
            root_request_id: placement
                .root_request_id
                .unwrap_or_else(|| request_id.clone()),
            request_id: request_id.clone(),
            parent_request_id: placement.parent_request_id,
            chain_position: placement.chain_position.unwrap_or(1),
            attempt: placement.attempt.unwrap_or(1),
            worker_id: self.config.worker_id.clone(),
            pool: self.config.pool.clone(),
            accepted_at: placement.accepted_at.unwrap_or_else(Instant::now),
            chain: placement.chain,
            traceparent: placement.traceparent,
        };
        let cancel = CancellationToken::new();
        let sequence = Arc::new(AtomicU64::new(0));
        self.busy += 1;
        self.records.insert(
            request_id.clone(),
            Record::Running(Box::new(Running {
                context: context.clone(),
                job_name: request.job_name.clone(),
                metadata: request.metadata.clone(),
                cancel: cancel.clone(),
                waiters: Vec::new(),
                durable: placement.durable,
                sequence: sequence.clone(),
            })),
        );
        self.publish_capacity();
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
        Ok(Accepted {
            request_id,
            worker_id: self.config.worker_id.clone(),
            state: RequestState::Running,
        })
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
        self.record_result(result, running.waiters);
    }
}

impl Handler<SlotReleased> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: SlotReleased, _: &mut Context<Self>) {
        self.busy = self.busy.checked_sub(1).unwrap_or_else(|| {
            tracing::error!(message = "a slot was released twice", request_id = %msg.request_id);
            0
        });
        // A slot that ends without a result (its actor stopped first) still ends its request.
        if let Some(Record::Running(_)) = self.records.get(&msg.request_id)
            && let Some(Record::Running(running)) = self.records.remove(&msg.request_id)
        {
            let detail = "the slot stopped before the generation ended".to_string();
            let result = lost_result(&running, &running.context, detail);
            let emitter = EventEmitter::continuing(
                msg.request_id.clone(),
                self.sink.clone(),
                self.engine.config().coalescing,
                running.sequence.clone(),
            );
            announce_finished(emitter, result.clone());
            self.record_result(result, running.waiters);
        }
        self.publish_capacity();
    }
}

impl Handler<Cancel> for Supervisor {
    type Result = ResponseFuture<Result<CancelReply, WireError>>;

    fn handle(&mut self, msg: Cancel, _: &mut Context<Self>) -> Self::Result {
        let request_id = msg.request_id;
        let immediate =
            |r: Result<CancelReply, WireError>| -> Self::Result { Box::pin(async move { r }) };
        match self.records.get_mut(&request_id) {
            None => immediate(Err(WireError::new(
                ErrorCode::NotFound,
                format!("request {request_id} is not known to this worker"),
            ))),
            Some(Record::Finished(result)) => immediate(Err(WireError::new(
                ErrorCode::AlreadyFinished,
                format!("request {request_id} already ended"),
            )
            .with_detail(serde_json::json!({"state": result.state})))),
            Some(Record::Running(running)) => {
                running.cancel.cancel();
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
            Some(Record::Running(_)) => RequestState::Running,
            Some(Record::Finished(result)) => result.state,
        };
        Ok(StatusReply {
            request_id: msg.request_id,
            state,
            worker_id: self.config.worker_id.clone(),
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
            Some(Record::Running(_)) => Err(WireError::new(
                ErrorCode::NotReady,
                format!("request {} is still running", msg.request_id),
            )
            .with_detail(serde_json::json!({"state": RequestState::Running}))),
            Some(Record::Finished(result)) if !msg.release => Ok((**result).clone()),
            Some(Record::Finished(_)) => {
                let Some(Record::Finished(result)) = self.records.remove(&msg.request_id) else {
                    unreachable!("matched as finished above");
                };
                self.finished_order.retain(|id| id != &msg.request_id);
                Ok(*result)
            }
        }
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
            retained_results: self.records.len() - running,
        })
    }
}

impl Handler<Drain> for Supervisor {
    type Result = ResponseActFuture<Self, DrainReport>;

    fn handle(&mut self, msg: Drain, _: &mut Context<Self>) -> Self::Result {
        self.draining = true;
        self.publish_capacity();
        let mut capacity = self.capacity.subscribe();
        let cancel_wait = self.config.cancel_wait;
        let idle = async move {
            tokio::time::timeout(msg.deadline, capacity.wait_for(|c| c.busy == 0))
                .await
                .is_ok()
        };
        Box::pin(idle.into_actor(self).then(move |all_done, act, _| {
            let mut report = DrainReport::default();
            if !all_done {
                for (id, record) in &act.records {
                    if let Record::Running(running) = record {
                        running.cancel.cancel();
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
    result.root_request_id = context.root_request_id.clone();
    result.parent_request_id = context.parent_request_id.clone();
    result.job_name = running.job_name.clone();
    result.attempt = context.attempt;
    result.chain_position = context.chain_position;
    result.metadata = running.metadata.clone();
    result.timings_ms.total = context.accepted_at.elapsed().as_millis() as u64;
    result
}
