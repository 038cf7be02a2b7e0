//! The durable queue: stream `GENFLEET_QUEUE` (work-queue retention), one durable pull
//! consumer per pool, band and tenant (see [`crate::schedule`] for which a free slot takes). A
//! worker pulls only as many messages as it has free slots, keeps long generations alive with
//! in-progress acks, stores the result and then acks. A worker that dies leaves its message to
//! be redelivered to another (`attempt` + 1); when deliveries run out, a worker stores FAILED
//! `worker_lost` and removes the message.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use tokio::sync::watch;

use super::BusError;
use super::admission::{self, Claim};
use super::affinity::preference_of;
use super::pull::{Scheduler, is_pool_consumer, queue_of_consumer};
use super::recorded::recorded;
use super::shared::{Shared, hold_of, this_load};
use super::store::{DurableClaim, LiveRecord, Over, StoreError, Stored};
use super::tenant_limit::TenantPermit;
use crate::actors::{Capacity, Placement, Scheduling, TenantSlots};
use crate::client::subjects::Subjects;
use crate::observe::metrics::PoolSignals;
use crate::protocol::ids::is_valid_request_id;
use crate::protocol::{
    DEFAULT_TENANT, ErrorCode, GenerationRequest, GenerationResult, Priority, Reason, RequestState,
    WireError,
};
use crate::schedule::{PassedOver, TenantLoad};

pub use super::pull::consumer_name;

/// Keeps `genfleet_queue_pending` and `genfleet_queue_ack_pending` current (the pool's lag,
/// over all its bands and tenants), the waiting and running counts of each tenant and band,
/// and the pool's scaling signals (its backlog beside its live workers' slots, as their
/// heartbeats tell).
pub(super) async fn measure_lag(shared: Arc<Shared>) {
    let pool = shared.settings.worker.pool.clone();
    loop {
        let mut consumers = shared.stores.queue.consumers();
        let (mut pending, mut ack_pending, mut complete) = (0u64, 0u64, true);
        let mut waiting = Vec::new();
        while let Some(info) = consumers.next().await {
            match info {
                Ok(info) if is_pool_consumer(&pool, &info.name) => {
                    pending += info.num_pending;
                    ack_pending += info.num_ack_pending as u64;
                    if let Some(key) = queue_of_consumer(&pool, &info.name) {
                        waiting.push((key.tenant, key.band, info.num_pending));
                    }
                }
                Ok(_) => {}
                Err(_) => complete = false,
            }
        }
        if complete {
            shared.metrics.queue_pending.set(pending as i64);
            shared.metrics.queue_ack_pending.set(ack_pending as i64);
            shared.tenant_stats.set_waiting(waiting);
            shared
                .metrics
                .set_pool_signals(pool_signals(&shared, pending, ack_pending));
        }
        if let Ok(slots) = shared.supervisor.send(TenantSlots).await {
            shared.tenant_stats.set_running(
                slots
                    .into_iter()
                    .map(|(tenant, band, n)| (tenant, band, u64::from(n))),
            );
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// The pool's live workers that take work (the peers as their heartbeats tell, and this one as
/// it is) beside its durable queue's `waiting` and `running` requests.
fn pool_signals(shared: &Shared, waiting: u64, running: u64) -> PoolSignals {
    let (mut workers, mut slots, mut busy) = shared.peer_slots.totals();
    if let Some(this) = this_load(shared) {
        workers += 1;
        slots += u64::from(this.slots);
        busy += u64::from(this.busy);
    }
    PoolSignals::new(
        &shared.settings.worker.pool,
        workers,
        slots,
        busy,
        waiting,
        running,
    )
}

/// Pulls as many messages as there are free slots, for as long as the worker runs.
///
/// The messages of a pull are started side by side (each start is the claim of the request's
/// record, one write), and the next pull does not wait for them: it asks
/// only for the slots neither taken nor being taken, so a worker never holds more messages than
/// it has slots.
pub(super) async fn serve_queue(
    shared: Arc<Shared>,
    mut scheduler: Scheduler,
    mut capacity: watch::Receiver<Capacity>,
) {
    let mut starting = tokio::task::JoinSet::new();
    let mut tick = tokio::time::Instant::now() + TRY_ALL_EVERY;
    let fair_share = shared.settings.preempts_by_share();
    loop {
        while starting.try_join_next().is_some() {}
        if fair_share && capacity.borrow().free() == 0 {
            // Full: a tenant under its fair share may still take a slot from one far over it
            // (one message at a time, none while another waits for its slot here).
            take_for_share(
                &shared,
                &mut scheduler,
                &mut capacity,
                &mut starting,
                &mut tick,
            )
            .await;
            continue;
        }
        if capacity.borrow().free() == 0 {
            // Full: the queues heard of meanwhile still get their consumers, so that the
            // pool's backlog (`measure_lag`) counts their requests before a slot frees.
            tokio::select! {
                changed = capacity.changed() => if changed.is_err() {
                    return;
                },
                () = scheduler.until_heard(TRY_ALL_EVERY) => {}
            }
            scheduler.absorb().await;
            continue;
        }
        let free = (capacity.borrow().free() as usize).saturating_sub(starting.len());
        if free == 0 {
            // Every free slot is being taken by a message in hand.
            starting.join_next().await;
            continue;
        }
        scheduler.absorb().await;
        if tokio::time::Instant::now() >= tick {
            scheduler.try_all();
            tick = tokio::time::Instant::now() + TRY_ALL_EVERY;
        }
        let load = tenant_load(&shared).await;
        let messages = scheduler.next(free as u32, &load).await;
        if messages.is_empty() {
            // Nothing to take: wait for a notice, a slot freeing, or the next tick.
            let wait = tick.saturating_duration_since(tokio::time::Instant::now());
            if scheduler.any_pending() {
                // Held back by a reserve or a tenant's limit: a slot freeing, or a tenant's
                // count in the pool changing, changes that.
                tokio::select! {
                    _ = scheduler.until_heard(wait) => {}
                    _ = capacity.changed() => {}
                    _ = shared.tenant_counts.changed() => {}
                }
            } else {
                scheduler.wait_heard(wait).await;
            }
            continue;
        }
        for (message, place) in messages {
            let shared = shared.clone();
            starting.spawn(async move { handle(&shared, message, place).await });
        }
    }
}

/// A full worker's turn with `worker.preempt_fair_share`: pulls one message of a tenant under
/// its fair share of the slots while another is far over it, which takes a slot of that tenant
/// as it is admitted (the Supervisor preempts), when no request waits for a slot here already
/// and none is being started; otherwise waits for a slot to free, a queue to be heard of, or
/// the next try of every queue.
async fn take_for_share(
    shared: &Arc<Shared>,
    scheduler: &mut Scheduler,
    capacity: &mut watch::Receiver<Capacity>,
    starting: &mut tokio::task::JoinSet<()>,
    tick: &mut tokio::time::Instant,
) {
    let now = *capacity.borrow_and_update();
    if now.waiting == 0 && starting.is_empty() && !now.draining && !now.paused {
        scheduler.absorb().await;
        if tokio::time::Instant::now() >= *tick {
            scheduler.try_all();
            *tick = tokio::time::Instant::now() + TRY_ALL_EVERY;
        }
        let load = tenant_load(shared).await;
        let messages = scheduler.next_for_share(now.total, &load).await;
        if !messages.is_empty() {
            for (message, place) in messages {
                let shared = shared.clone();
                starting.spawn(async move { handle(&shared, message, place).await });
            }
            return;
        }
    }
    let wait = tick.saturating_duration_since(tokio::time::Instant::now());
    tokio::select! {
        _ = scheduler.until_heard(wait) => {}
        _ = capacity.changed() => {}
        _ = starting.join_next(), if !starting.is_empty() => {}
    }
    // Taken in after the wait, whichever ended it: the queues heard of while full get their
    // consumers (and count in the pool's backlog) before a slot frees.
    scheduler.absorb().await;
    if tokio::time::Instant::now() >= *tick {
        scheduler.try_all();
        *tick = tokio::time::Instant::now() + TRY_ALL_EVERY;
    }
}

/// How often every known queue is tried, heard of or not.
const TRY_ALL_EVERY: Duration = Duration::from_secs(1);

/// The requests each tenant runs on this worker, and how many more of each its pool may start.
async fn tenant_load(shared: &Shared) -> TenantLoad {
    let load = match shared.supervisor.send(TenantSlots).await {
        Ok(slots) => TenantLoad::from_slots(slots),
        Err(_) => TenantLoad::default(),
    };
    load.with_pool_room(shared.tenant_counts.rooms())
}

/// Runs a pulled message (`place`: its tenant's place in the pool's count, where a pool limit
/// is set; it goes back if the message does not run here).
async fn handle(shared: &Arc<Shared>, message: jetstream::Message, place: Option<TenantPermit>) {
    let Ok(info) = message.info() else {
        tracing::warn!(message = "a queue message without JetStream metadata was ignored");
        return;
    };
    let attempt = u32::try_from(info.delivered).unwrap_or(u32::MAX).max(1);
    let queued_for = since(info.published.unix_timestamp_nanos());
    let Some(queued) = shared
        .subjects
        .parse_queued(&message.subject)
        .filter(|queued| is_valid_request_id(&queued.request_id))
    else {
        tracing::warn!(message = "a queue message without a valid queue subject was removed", subject = %message.subject);
        let _ = message.ack_with(AckKind::Term).await;
        return;
    };
    let sequence = info.stream_sequence;
    // The request's id on the bus: `<tenant>.<id>` for a tenant other than the default.
    let request_id = queued.qualified_id();
    let tenant = (queued.tenant != DEFAULT_TENANT).then(|| queued.tenant.clone());
    // Checked before anything is written for it.
    let request = match read_request(shared, &message, &queued) {
        Ok(request) => request.qualified(tenant.as_deref()),
        Err(detail) => {
            return refuse(
                shared,
                message,
                &request_id,
                attempt,
                detail,
                Over::Message(sequence),
            )
            .await;
        }
    };
    // Deliveries given back for want of a slot are no attempt: the record of the last one says
    // how many there were (a first delivery has none).
    let handed_back = if attempt > 1 {
        handed_back_before(shared, &request_id).await
    } else {
        0
    };
    let attempt = attempt.saturating_sub(handed_back).max(1);
    // A continuation's place in its chain, as far as its decision's record vouches for it.
    let chain = match admission::vouched_chain(shared, &message.message, &request_id).await {
        Ok(chain) => chain,
        Err(error) => {
            tracing::warn!(message = "cannot check a continuation's chain; handing the message back", error = %error.message, request_id = %request_id);
            let _ = message
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
            return;
        }
    };
    // Its tenant's place in the pool's count, where a pool limit is set: a message pulled
    // without one waits for it here, before anything is written for it.
    let place = match place {
        Some(place) => Some(place),
        None => {
            let waited = shared.tenant_counts.wait_for_place(
                &message,
                &queued.tenant,
                &shared.capacity,
                || shared.fencing.stale(),
            );
            match waited.await {
                Ok(place) => place,
                Err(_) => return,
            }
        }
    };
    // No slot is free for it when an interactive submit took the slot after the pull. While
    // another worker of the pool has a free slot, the message goes back to the queue at once
    // for that worker to take (at most MAX_HAND_BACKS times, never on its last delivery);
    // otherwise it waits here, QUEUED, for the next slot.
    let no_slot = shared.capacity.borrow().free() == 0;
    let give_back = no_slot
        && handed_back < MAX_HAND_BACKS
        && i64::from(u32::try_from(info.delivered).unwrap_or(u32::MAX))
            < shared.settings.jetstream.queue_max_deliver
        && shared.peer_slots.any_free();
    let state = if no_slot {
        RequestState::Queued
    } else {
        RequestState::Running
    };
    let mut live = LiveRecord {
        request_id: request_id.clone(),
        state,
        worker_id: shared.worker_id.clone(),
        attempt,
        durable: true,
        priority: request.request().priority,
        tenant: tenant.clone(),
        handed_back: handed_back + u32::from(give_back),
        queue_seq: Some(sequence),
        progress: None,
        resumed: Vec::new(),
        ack: message.reply.as_ref().map(|r| r.to_string()),
    };
    // A request taken over from a lost worker goes on from that worker's last checkpoint.
    let mut resume_from = None;
    // A request that already ended (or whose result was read) never runs again; a message
    // whose id another request holds never runs at all.
    let revision = match claim(shared, &message, &live).await {
        Ok(DurableClaim::Claimed(revision)) => revision,
        Ok(DurableClaim::Ended) => {
            let _ = message.ack().await;
            return;
        }
        Ok(DurableClaim::Duplicate) => {
            shared.metrics.queue_duplicates.inc();
            tracing::warn!(message = "a queue message whose request id another request holds was removed unrun", request_id = %request_id, sequence);
            let _ = message.ack_with(AckKind::Term).await;
            return;
        }
        Ok(DurableClaim::HeldBy {
            worker_id,
            revision,
        }) => match take_over(shared, &message, &mut live, &worker_id, revision).await {
            TakeOver::Taken(revision) => {
                resume_from = super::resume::carried(&live, &worker_id);
                if let Some(resume) = &resume_from {
                    super::resume::resend_released(shared, &live.request_id, &resume.progress)
                        .await;
                }
                revision
            }
            TakeOver::Ended => {
                let _ = message.ack().await;
                return;
            }
            TakeOver::Held => {
                // Its runner still beats (and keeps the message alive while it runs it): this
                // delivery waits. Should that runner have lost it, the message comes back
                // until its deliveries run out.
                tracing::debug!(message = "a redelivered request is still held by a live worker", request_id = %request_id, holder = %worker_id);
                let wait = Duration::from_millis(shared.settings.jetstream.queue_ack_wait_ms);
                let _ = message.ack_with(AckKind::Nak(Some(wait))).await;
                return;
            }
        },
        Ok(DurableClaim::OnRecordHere(revision)) => {
            if hold_of(shared, &request_id).await.is_some() {
                // Running here (a redelivery after a missed keep-alive): the running copy
                // acknowledges.
                return;
            }
            // Handed back by this worker earlier and delivered here again.
            match shared.stores.set_live(&live, revision).await {
                Ok(Some(revision)) => revision,
                Ok(None) => {
                    let _ = message.ack().await;
                    return;
                }
                Err(error) => return hand_back(message, &request_id, error).await,
            }
        }
        Err(error) => return hand_back(message, &request_id, error).await,
    };
    if give_back {
        // The record (QUEUED, given back, with the count of hand-backs) is taken over by the
        // worker that takes the message next.
        tracing::debug!(message = "no slot for a pulled request; handing it to a free worker", request_id = %request_id);
        give_back_message(shared, &message, &live, revision).await;
        return;
    }
    let accepted_at = Instant::now()
        .checked_sub(queued_for)
        .unwrap_or_else(Instant::now);
    let placement = Placement {
        lineage: chain,
        scheduling: Scheduling {
            attempt: Some(attempt),
            accepted_at: Some(accepted_at),
            durable: true,
            // An interactive submit may have taken the slot this message was pulled for: it
            // waits for the next one, its delivery kept alive meanwhile.
            wait_for_slot: true,
            band: queued.band,
            tenant,
        },
        continuity: crate::engine::Continuity {
            from: resume_from,
            ..Default::default()
        },
        ..Placement::default()
    };
    let kept = (message.clone(), live.clone());
    let claim = Claim {
        live,
        revision,
        permit: place,
    };
    let mut preference = preference_of(message.headers.as_ref());
    if preference.worker.is_none()
        && let Some(key) = request.request().affinity_key.as_deref()
    {
        // The queue hands a message to whichever worker pulls it: the record says whether
        // that was the key's worker, and when not, why: a slot freed here before one did there
        // (or that worker is gone), as for a submit its key's worker had no room for.
        preference.worker = shared.peer_slots.key_worker(key, this_load(shared));
        if preference
            .worker
            .as_deref()
            .is_some_and(|worker| worker != shared.worker_id)
        {
            preference.fallback = Some(PassedOver::Busy.as_str().to_string());
        }
    }
    match admission::admit(shared, request, placement, claim, Some(message), preference).await {
        Ok(_) => {}
        Err(error)
            if error.code == ErrorCode::NoSlotAvailable || error.code == ErrorCode::Internal =>
        {
            // Draining, or more waiting than slots: another worker (or this one later) runs
            // it.
            give_back_message(shared, &kept.0, &kept.1, revision).await;
        }
        Err(error) => {
            refuse(
                shared,
                kept.0,
                &request_id,
                attempt,
                error.message,
                Over::Claim(revision),
            )
            .await
        }
    }
}

/// What came of a redelivery that found its request held by another worker.
enum TakeOver {
    /// Taken over (that worker was lost, or the record was given back): at this revision.
    Taken(u64),
    /// The request ended meanwhile.
    Ended,
    /// That worker still beats after `worker.lost_after_ms`, or another taker was first.
    Held,
}

/// Takes a redelivered request over from the worker its record names once that worker is
/// lost (its heartbeat gone from the bucket). A worker killed a moment ago still has its
/// heartbeat for up to `worker.lost_after_ms`, so the delivery is kept (alive, with
/// in-progress acknowledgements) while the heartbeat is watched that long: the request is
/// taken over as soon as its worker is found lost, and this delivery is its next attempt.
async fn take_over(
    shared: &Shared,
    message: &jetstream::Message,
    live: &mut LiveRecord,
    holder: &str,
    mut revision: u64,
) -> TakeOver {
    // What the lost run stored of its progress goes on in the record this delivery writes.
    super::resume::carry_over(shared, live, holder).await;
    let every = Duration::from_millis(shared.settings.worker.heartbeat_ms);
    let verdict = Duration::from_millis(shared.settings.worker.lost_after_ms) + every;
    let deadline = tokio::time::Instant::now() + verdict;
    let mut since = None;
    loop {
        let holding = super::heartbeat::holds(shared, holder, &live.request_id, &mut since).await;
        if holding != super::heartbeat::Holding::Holds {
            return match shared.stores.take_over(live, revision).await {
                Ok(Some(revision)) => {
                    tracing::info!(message = "took a durable request over", request_id = %live.request_id, from = %holder, ?holding, from_checkpoint = live.progress.is_some());
                    TakeOver::Taken(revision)
                }
                Ok(None) => TakeOver::Held,
                Err(error) => {
                    tracing::warn!(message = "cannot take a durable request over", %error, request_id = %live.request_id);
                    TakeOver::Held
                }
            };
        }
        if tokio::time::Instant::now() + every > deadline {
            return TakeOver::Held;
        }
        let _ = message.ack_with(AckKind::Progress).await;
        tokio::time::sleep(every).await;
        // Meanwhile the request may have ended, or its worker given it back.
        match shared.stores.record(&live.request_id).await {
            Ok(Some((super::store::RequestRecord::Live { live: held }, now))) => {
                if held.worker_id == super::store::GIVEN_BACK {
                    return match shared.stores.take_over(live, now).await {
                        Ok(Some(revision)) => TakeOver::Taken(revision),
                        _ => TakeOver::Held,
                    };
                }
                if held.worker_id != holder {
                    return TakeOver::Held;
                }
                revision = now;
            }
            Ok(Some(_)) => return TakeOver::Ended,
            // Its record aged out or cannot be read now: the next delivery looks again.
            Ok(None) | Err(_) => return TakeOver::Held,
        }
    }
}

/// Hands a claimed message back to the queue for another worker: its record says it is given
/// back (so the next delivery takes it over, whichever live worker takes it), then the
/// message is naked.
pub(super) async fn give_back_message(
    shared: &Shared,
    message: &jetstream::Message,
    live: &LiveRecord,
    revision: u64,
) {
    if let Err(error) = shared.stores.give_back(live, revision).await {
        tracing::warn!(message = "could not mark a request's record given back", %error, request_id = %live.request_id);
    }
    let _ = message.ack_with(AckKind::Nak(None)).await;
}

/// A queue message's request, decoded and checked against its subject (the id, the band) and
/// the limits; the reason it is refused otherwise.
fn read_request(
    shared: &Shared,
    message: &jetstream::Message,
    queued: &crate::client::subjects::QueueSubject,
) -> Result<crate::actors::CheckedRequest, String> {
    if queued.pool != shared.settings.worker.pool {
        return Err(format!(
            "{} is not a queue subject of this pool",
            message.subject
        ));
    }
    // The same size limit as submit: a server allowing larger messages must not let a larger
    // request in through the queue.
    let mut request: GenerationRequest =
        crate::client::reply::decode(&message.message, shared.settings.limits.max_request_bytes)
            .map_err(|error| error.message)?;
    if request.request_id.as_deref() != Some(queued.request_id.as_str()) {
        return Err(format!(
            "the body's request_id ({}) must equal the subject's ({})",
            request.request_id.as_deref().unwrap_or("absent"),
            queued.request_id
        ));
    }
    // The band is the subject's: the body may repeat it, never contradict it. A continuation
    // inherits the band the request carries.
    match request.priority {
        Some(band) if band != queued.band => {
            return Err(format!(
                "priority is {band}, but the request was queued in band {}",
                queued.band
            ));
        }
        None if queued.band != Priority::Normal => request.priority = Some(queued.band),
        _ => {}
    }
    admission::check(shared, request).map_err(|error| error.message)
}

/// How many times one durable request is given back for want of a slot before a worker keeps
/// it until a slot frees: a fleet whose workers all fill between their heartbeats must not
/// pass a request around for ever.
const MAX_HAND_BACKS: u32 = 1;

/// The hand-backs the request's record counts (none when it holds no live record).
async fn handed_back_before(shared: &Shared, request_id: &str) -> u32 {
    match shared.stores.record(request_id).await {
        Ok(Some((super::store::RequestRecord::Live { live }, _))) => live.handed_back,
        _ => 0,
    }
}

/// How long a claim is tried again while the results bucket does not answer (a JetStream
/// cluster electing a leader takes seconds).
const CLAIM_FOR: Duration = Duration::from_secs(20);

/// Claims a durable request's record, trying again while the store fails, with the delivery
/// kept alive meanwhile: a message handed back at once would spend its deliveries in a few
/// seconds of a leader election and be given up as `worker_lost`.
async fn claim(
    shared: &Shared,
    message: &jetstream::Message,
    live: &LiveRecord,
) -> Result<DurableClaim, StoreError> {
    let started = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(100);
    loop {
        match shared.stores.claim_durable(live).await {
            Err(error) if started.elapsed() + pause < CLAIM_FOR => {
                tracing::debug!(message = "claiming a durable request failed; trying again", %error, request_id = %live.request_id);
                let _ = message.ack_with(AckKind::Progress).await;
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            claimed => return claimed,
        }
    }
}

/// A message whose record could not be read or written goes back to the queue, to be tried
/// again in a moment.
async fn hand_back(message: jetstream::Message, request_id: &str, error: StoreError) {
    tracing::warn!(message = "cannot claim the request's record; handing the message back", %error, request_id = %request_id);
    let _ = message
        .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
        .await;
}

/// How long ago a JetStream timestamp (ns since the epoch) was.
fn since(published_nanos: i128) -> Duration {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i128;
    Duration::from_nanos(u64::try_from(now - published_nanos).unwrap_or(0))
}

/// An undecodable or invalid durable request: FAILED `invalid_request` under the subject's id,
/// and the message is terminated (it would fail the same way anywhere).
async fn refuse(
    shared: &Shared,
    message: jetstream::Message,
    request_id: &str,
    attempt: u32,
    detail: String,
    over: Over,
) {
    tracing::warn!(message = "refused a durable request", request_id = %request_id, %detail);
    let mut result = GenerationResult::empty(
        request_id,
        Reason::InvalidRequest,
        detail,
        &shared.worker_id,
    );
    result.attempt = attempt;
    if let Ok(Stored::Stored) = shared.stores.store_result(&result, over).await {
        recorded(shared, &result);
    }
    let _ = message.ack_with(AckKind::Term).await;
}

/// The queue could not be looked into or changed.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("cannot look into the queue: {0}")]
    Look(String),
    #[error("cannot remove the queued request: {0}")]
    Remove(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<QueueError> for WireError {
    fn from(error: QueueError) -> WireError {
        WireError::new(ErrorCode::Internal, error.to_string())
    }
}

/// A request waiting in the queue.
pub(super) struct Waiting {
    /// The stream sequence of its message.
    pub(super) sequence: u64,
    pub(super) band: Priority,
    pub(super) tenant: String,
}

/// Where a queued request waits, on the v1 subjects or a band's.
///
/// This worker's own pool is looked into first, one subject at a time (each found at once,
/// however many requests wait); only a request not waiting there is looked for in every pool,
/// by a wildcard that the stream answers by going through each subject it holds. Followers ask
/// where their request stands while it waits, so the common answer must not cost as much as
/// the queue is long.
pub(super) async fn find_queued(
    shared: &Shared,
    request_id: &str,
) -> Result<Option<Waiting>, QueueError> {
    let own = shared
        .subjects
        .queued_in(&shared.settings.worker.pool, request_id);
    let found = futures_util::future::join_all(own.iter().map(|subject| async move {
        let message = shared
            .stores
            .queue
            .get_last_raw_message_by_subject(subject)
            .await;
        (subject, message)
    }))
    .await;
    for (subject, message) in found {
        match message {
            Ok(message) => {
                if let Some(queued) = shared.subjects.parse_queued(subject) {
                    return Ok(Some(Waiting {
                        sequence: message.sequence,
                        band: queued.band,
                        tenant: queued.tenant,
                    }));
                }
            }
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {}
            Err(error) => return Err(QueueError::Look(error.to_string())),
        }
    }
    for filter in shared.subjects.queued(request_id) {
        let mut subjects = shared
            .stores
            .queue
            .info_with_subjects(filter)
            .await
            .map_err(|e| QueueError::Look(e.to_string()))?;
        let Some(Ok((subject, _))) = subjects.next().await else {
            continue;
        };
        let Some(queued) = shared.subjects.parse_queued(&subject) else {
            continue;
        };
        if let Ok(message) = shared
            .stores
            .queue
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            return Ok(Some(Waiting {
                sequence: message.sequence,
                band: queued.band,
                tenant: queued.tenant,
            }));
        }
    }
    Ok(None)
}

/// Cancels a request still waiting in the queue: the message is removed and never runs.
pub(super) async fn cancel_queued(
    shared: &Shared,
    request_id: &str,
    sequence: u64,
) -> Result<bool, QueueError> {
    let removed = shared
        .stores
        .queue
        .delete_message(sequence)
        .await
        .map_err(|e| QueueError::Remove(e.to_string()))?;
    if removed {
        let result = GenerationResult::empty(
            request_id,
            Reason::Cancelled,
            "cancelled while queued".into(),
            &shared.worker_id,
        );
        if shared
            .stores
            .store_result(&result, Over::Message(sequence))
            .await?
            == Stored::Stored
        {
            recorded(shared, &result);
        }
    }
    Ok(removed)
}

/// Subscribes to the max-deliveries advisories of the queue's consumers (see
/// [`serve_exhausted`], which keeps those of the pool's own).
pub(super) async fn exhausted_advisories(
    shared: &Shared,
) -> Result<async_nats::Subscriber, BusError> {
    let subject = shared
        .subjects
        .max_deliveries_advisory(&shared.settings.jetstream.queue_stream, "*");
    shared
        .client
        .queue_subscribe(subject, shared.subjects.exhausted_group().into())
        .await
        .map_err(|e| BusError::Setup(format!("cannot follow the queue's advisories: {e}")))
}

/// Gives up the requests whose deliveries ran out: FAILED `worker_lost` (replacing the record
/// of the last worker that took one) and the message removed.
pub(super) async fn serve_exhausted(shared: Arc<Shared>, mut sub: async_nats::Subscriber) {
    while let Some(message) = sub.next().await {
        let consumer = Subjects::request_id_of(&message.subject);
        if !is_pool_consumer(&shared.settings.worker.pool, consumer) {
            continue;
        }
        let Ok(advisory) = serde_json::from_slice::<serde_json::Value>(&message.payload) else {
            continue;
        };
        let Some(sequence) = advisory.get("stream_seq").and_then(|s| s.as_u64()) else {
            continue;
        };
        let deliveries = advisory
            .get("deliveries")
            .and_then(|d| d.as_u64())
            .unwrap_or(0);
        let Ok(stored) = shared.stores.queue.get_raw_message(sequence).await else {
            continue;
        };
        let queued = shared
            .subjects
            .parse_queued(&stored.subject)
            .filter(|queued| is_valid_request_id(&queued.request_id));
        if let Some(queued) = queued {
            let request_id = queued.qualified_id();
            let mut result = GenerationResult::empty(
                &request_id,
                Reason::WorkerLost,
                format!(
                    "deliveries exhausted: {deliveries} workers took the request and none finished it"
                ),
                &shared.worker_id,
            );
            result.attempt = u32::try_from(deliveries).unwrap_or(u32::MAX);
            match shared
                .stores
                .store_result(&result, Over::Message(sequence))
                .await
            {
                Ok(Stored::Stored) => recorded(&shared, &result),
                Ok(Stored::AlreadyStored | Stored::Fenced) => {}
                Err(error) => {
                    tracing::warn!(message = "could not store a worker_lost result", %error, request_id = %request_id);
                    continue;
                }
            }
            tracing::warn!(message = "a durable request ran out of deliveries", request_id = %request_id, deliveries);
        }
        let _ = shared.stores.queue.delete_message(sequence).await;
    }
}
