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

mod control;
mod lifecycle;
mod queries;
mod records;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

use self::records::{Ended, Record, Running, Waiting};
use super::checker::{RequestChecker, request_limits};
use super::messages::{Canceller, Placement, Ticket};
use super::slot::{SlotActor, SlotGuard};
use crate::engine::{Engine, EventEmitter, EventSink, RequestContext};
use crate::protocol::ids::new_id;
use crate::protocol::{
    Capacity, ErrorCode, EventBody, GenerationRequest, GenerationResult, Reason, RequestLimits,
    RequestState, WireError,
};
use crate::schedule::{SlotPolicy, Slots, TenantLimit};
use crate::settings::{DrainHandOff, ReservedSlots, Settings};

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
    /// What a drain does with the requests still running.
    pub drain_handoff: DrainHandOff,
    /// A higher band takes the slot of a lower one's newest request when none is free.
    pub preempt: bool,
    /// A tenant under its fair share takes the slot of the newest request of a tenant far over
    /// its share when none is free.
    pub preempt_fair_share: bool,
    pub max_preemptions: u32,
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
            drain_handoff: settings.worker.drain_handoff,
            preempt: settings.preempts_by_band(),
            preempt_fair_share: settings.preempts_by_share(),
            max_preemptions: settings.worker.max_preemptions,
        }
    }

    /// What its slots may be taken by (see [`crate::schedule`]).
    pub fn policy(&self) -> SlotPolicy {
        SlotPolicy {
            reserved: self.reserved,
            tenant_limit: TenantLimit(self.tenant_max_running),
        }
    }
}

pub struct Supervisor<T> {
    config: SupervisorConfig,
    engine: Arc<Engine>,
    sink: EventSink,
    busy: u32,
    draining: bool,
    /// Takes no work: its backend does not answer.
    paused: bool,
    records: HashMap<String, Record<T>>,
    /// Requests waiting for a slot, oldest first.
    waiting: VecDeque<String>,
    /// Finished records in the order they finished, for the retention bound.
    finished_order: VecDeque<String>,
    /// The tenant and band of each taken slot.
    slots: Slots,
    capacity: watch::Sender<Capacity>,
}

/// A started Supervisor: its address and a view of its capacity that changes whenever a slot
/// is taken or freed (so the owner can subscribe to submits only while a slot is free).
#[derive(Clone)]
pub struct SupervisorHandle<T: Ticket> {
    pub addr: Addr<Supervisor<T>>,
    pub capacity: watch::Receiver<Capacity>,
    /// Checks requests before they are submitted.
    pub checker: RequestChecker,
}

impl<T: Ticket> Supervisor<T> {
    /// Starts the Supervisor on the current actix arbiter. Events of every request go to
    /// `sink` (a bounded channel; `None` drops them).
    pub fn start(
        config: SupervisorConfig,
        engine: Arc<Engine>,
        sink: EventSink,
    ) -> SupervisorHandle<T> {
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
            slots: Slots::default(),
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
        ticket: Option<T>,
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
        placement: Placement<T>,
        ctx: &mut Context<Self>,
    ) -> String {
        let request_id = request.request_id.clone().unwrap_or_else(new_id);
        let context = context_of(&self.config, &request_id, &placement);
        if let Some(on_start) = placement.on_start {
            let _ = on_start.send(());
        }
        let cancel = CancellationToken::new();
        // A resumed request numbers its events on from its checkpoint's.
        let first_seq = context
            .continuity
            .from
            .as_ref()
            .map_or(0, |resume| resume.progress.next_seq);
        let sequence = Arc::new(AtomicU64::new(first_seq));
        self.busy += 1;
        self.slots.take(
            &request_id,
            placement.scheduling.tenant.as_deref(),
            placement.scheduling.band,
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
                durable: placement.scheduling.durable,
                sequence: sequence.clone(),
                ticket: placement.ticket,
                band: placement.scheduling.band,
                tenant: placement.scheduling.tenant,
                started_at: std::time::Instant::now(),
            })),
        );
        let guard = SlotGuard {
            request_id: request_id.clone(),
            released: ctx.address().recipient(),
        };
        SlotActor {
            done: ctx.address().recipient(),
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
            let waiting = self.waiting.iter().enumerate().filter_map(|(place, id)| {
                match self.records.get(id) {
                    Some(Record::Waiting(w)) => {
                        let scheduling = &w.placement.scheduling;
                        Some((place, scheduling.band, scheduling.tenant.as_deref()))
                    }
                    _ => None,
                }
            });
            let next = self
                .config
                .policy()
                .next_waiting(free, &self.slots, waiting);
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
            // One that was to go on from a checkpoint numbers on from it.
            Arc::new(AtomicU64::new(
                placement
                    .continuity
                    .from
                    .as_ref()
                    .map_or(0, |resume| resume.progress.next_seq),
            )),
        );
        announce_finished(emitter, result.clone());
        self.record_result(result, Vec::new(), placement.ticket, Some(by));
        true
    }
}

/// Where a request runs, from its placement.
fn context_of<T>(
    config: &SupervisorConfig,
    request_id: &str,
    placement: &Placement<T>,
) -> RequestContext {
    RequestContext {
        root_request_id: placement
            .lineage
            .root_request_id
            .clone()
            .unwrap_or_else(|| request_id.to_string()),
        request_id: request_id.to_string(),
        parent_request_id: placement.lineage.parent_request_id.clone(),
        chain_position: placement.lineage.chain_position.unwrap_or(1),
        attempt: placement.scheduling.attempt.unwrap_or(1),
        worker_id: config.worker_id.clone(),
        pool: config.pool.clone(),
        accepted_at: placement
            .scheduling
            .accepted_at
            .unwrap_or_else(Instant::now),
        chain: placement.lineage.chain.clone(),
        traceparent: placement.lineage.traceparent.clone(),
        continuity: placement.continuity.clone(),
    }
}

impl<T: Ticket> Actor for Supervisor<T> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(MAILBOX_CAPACITY);
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
fn lost_result<T>(
    running: &Running<T>,
    context: &RequestContext,
    detail: String,
) -> GenerationResult {
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
