//! The durable queue: stream `GENFLEET_QUEUE` (work-queue retention), one durable pull
//! consumer per pool. A worker pulls only as many messages as it has free slots, keeps long
//! generations alive with in-progress acks, stores the result and then acks. A worker that dies
//! leaves its message to be redelivered to another (`attempt` + 1); when deliveries run out, a
//! worker stores FAILED `worker_lost` and removes the message.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, AckKind, consumer};
use futures_util::StreamExt;
use tokio::sync::watch;

use super::BusError;
use super::decisions::{CHAIN_HEADER, CHAIN_STATE_HEADER, PARENT_HEADER, ROOT_HEADER};
use super::reply::header;
use super::store::{LiveRecord, Stored};
use super::subjects::Subjects;
use super::worker::{Asked, Shared};
use crate::actors::{Capacity, Placement, Submit};
use crate::protocol::ids::is_valid_request_id;
use crate::protocol::{ErrorCode, GenerationRequest, GenerationResult, Reason, RequestState};

/// The durable consumer of a pool.
pub fn consumer_name(pool: &str) -> String {
    format!("genfleet-{pool}")
}

pub(super) async fn pool_consumer(shared: &Shared) -> Result<consumer::PullConsumer, BusError> {
    let pool = &shared.settings.worker.pool;
    let js = &shared.settings.jetstream;
    shared
        .stores
        .queue
        .get_or_create_consumer(
            &consumer_name(pool),
            consumer::pull::Config {
                durable_name: Some(consumer_name(pool)),
                description: Some(format!("genfleet workers of pool {pool}")),
                filter_subject: shared.subjects.pool_queue(pool),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_millis(js.queue_ack_wait_ms),
                max_deliver: js.queue_max_deliver,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| {
            BusError::Setup(format!(
                "cannot open the queue consumer of pool {pool}: {e}"
            ))
        })
}

/// Keeps `genfleet_queue_pending` and `genfleet_queue_ack_pending` current (the pool's lag).
pub(super) async fn measure_lag(shared: Arc<Shared>) {
    let name = consumer_name(&shared.settings.worker.pool);
    loop {
        let info = shared
            .stores
            .queue
            .get_consumer::<consumer::pull::Config>(&name)
            .await;
        if let Ok(mut consumer) = info
            && let Ok(info) = consumer.info().await
        {
            shared.metrics.queue_pending.set(info.num_pending as i64);
            shared
                .metrics
                .queue_ack_pending
                .set(info.num_ack_pending as i64);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Pulls as many messages as there are free slots, for as long as the worker runs.
///
/// The messages of a pull are started side by side (each start is a look-up of the stored
/// result and the write of the live record), and the next pull does not wait for them: it asks
/// only for the slots neither taken nor being taken, so a worker never holds more messages than
/// it has slots.
pub(super) async fn serve_queue(
    shared: Arc<Shared>,
    consumer: consumer::PullConsumer,
    mut capacity: watch::Receiver<Capacity>,
) {
    let mut starting = tokio::task::JoinSet::new();
    loop {
        while starting.try_join_next().is_some() {}
        if capacity.wait_for(|c| c.free() > 0).await.is_err() {
            return;
        }
        let free = (capacity.borrow().free() as usize).saturating_sub(starting.len());
        if free == 0 {
            // Every free slot is being taken by a message in hand.
            starting.join_next().await;
            continue;
        }
        let batch = consumer
            .fetch()
            .max_messages(free)
            .expires(Duration::from_secs(1))
            .messages()
            .await;
        let mut batch = match batch {
            Ok(batch) => batch,
            Err(error) => {
                tracing::warn!(message = "pulling from the queue failed; retrying", %error);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        while let Some(message) = batch.next().await {
            match message {
                Ok(message) => {
                    let shared = shared.clone();
                    starting.spawn(async move { handle(&shared, message).await });
                }
                Err(error) => tracing::debug!(message = "queue pull ended", %error),
            }
        }
    }
}

async fn handle(shared: &Arc<Shared>, message: jetstream::Message) {
    let Ok(info) = message.info() else {
        tracing::warn!(message = "a queue message without JetStream metadata was ignored");
        return;
    };
    let attempt = u32::try_from(info.delivered).unwrap_or(u32::MAX).max(1);
    let queued_for = since(info.published.unix_timestamp_nanos());
    let request_id = Subjects::request_id_of(&message.subject).to_string();
    if !is_valid_request_id(&request_id) {
        tracing::warn!(message = "a queue message with an invalid request id was removed", subject = %message.subject);
        let _ = message.ack_with(AckKind::Term).await;
        return;
    }
    // A request that already ended (or whose result was read) never runs again.
    match shared.stores.stored(&request_id).await {
        Ok(Some(_)) => {
            let _ = message.ack().await;
            return;
        }
        Ok(None) => {}
        Err(error) => {
            tracing::warn!(message = "cannot read the request's record; handing the message back", %error);
            let _ = message
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
            return;
        }
    }
    // The same size limit as submit: a server allowing larger messages must not let a larger
    // request in through the queue.
    let request: GenerationRequest =
        match super::reply::decode(&message.message, shared.settings.limits.max_request_bytes) {
            Ok(request) => request,
            Err(error) => {
                return refuse(shared, message, &request_id, attempt, error.message).await;
            }
        };
    if request.request_id.as_deref() != Some(request_id.as_str()) {
        let detail = format!(
            "the body's request_id ({}) must equal the subject's ({request_id})",
            request.request_id.as_deref().unwrap_or("absent")
        );
        return refuse(shared, message, &request_id, attempt, detail).await;
    }
    // Refused before anything is written for it (the supervisor checks again, with the tools).
    if let Err(error) = request.validate(&crate::actors::request_limits(&shared.settings)) {
        return refuse(shared, message, &request_id, attempt, error.message).await;
    }
    let accepted_at = Instant::now()
        .checked_sub(queued_for)
        .unwrap_or_else(Instant::now);
    let parent_request_id =
        header(&message.message, PARENT_HEADER).filter(|id| is_valid_request_id(id));
    let root_request_id = header(&message.message, ROOT_HEADER)
        .filter(|id| is_valid_request_id(id))
        .unwrap_or_else(|| request_id.clone());
    let chain_position = header(&message.message, CHAIN_HEADER)
        .and_then(|p| p.parse::<u32>().ok())
        .filter(|p| *p >= 1)
        .unwrap_or(1);
    let chain = header(&message.message, CHAIN_STATE_HEADER)
        .and_then(|state| crate::engine::ChainState::from_header(&state))
        .unwrap_or_default();
    // QUEUED while no slot is free for it (an interactive submit took the slot after the pull).
    let state = if shared.capacity.borrow().free() == 0 {
        RequestState::Queued
    } else {
        RequestState::Running
    };
    let record = LiveRecord {
        request_id: request_id.clone(),
        state,
        worker_id: shared.worker_id.clone(),
        attempt,
        durable: true,
    };
    // On record, here and in the store, before the generation can start: one that ends at once
    // must find its message to settle and its record to take away.
    // Entered among those not yet started before it is visible as running, so a cancel that
    // finds it here always finds its mark to set too.
    {
        let mut running = shared.lock_running();
        if running.contains_key(&request_id) {
            // Already running here (a redelivery after a missed keep-alive); the running copy
            // acks.
            return;
        }
        shared
            .lock_waiting()
            .insert(request_id.clone(), Default::default());
        running.insert(request_id.clone(), record.clone());
    }
    shared
        .lock_durable()
        .insert(request_id.clone(), message.clone());
    if let Err(error) = shared.stores.put_live(&record).await {
        tracing::warn!(message = "could not record a running request", %error, request_id = %request_id);
    }
    // On record before the generation can raise a decision about it.
    let had = shared.lock_asked().insert(
        request_id.clone(),
        Asked {
            request: request.clone(),
            root_request_id: root_request_id.clone(),
            chain_position,
            chain: chain.clone(),
        },
    );
    let mut capacity = shared.capacity.clone();
    loop {
        if shared
            .lock_waiting()
            .get(&request_id)
            .is_some_and(|waiting| waiting.cancelled)
        {
            leave_waiting(shared, &request_id);
            return cancel_in_hand(shared, message, &record, had).await;
        }
        let submitted = shared
            .supervisor
            .send(Submit {
                request: request.clone(),
                placement: Placement {
                    root_request_id: Some(root_request_id.clone()),
                    parent_request_id: parent_request_id.clone(),
                    chain_position: Some(chain_position),
                    attempt: Some(attempt),
                    accepted_at: Some(accepted_at),
                    durable: true,
                    chain: chain.clone(),
                    traceparent: super::tools::traceparent_of(&message.message),
                },
            })
            .await;
        match submitted {
            Ok(Ok(_)) => {
                set_state(shared, &request_id, RequestState::Running).await;
                if leave_waiting(shared, &request_id) {
                    // Cancelled while it waited, and started before it saw that: cancelled
                    // now, as any running request.
                    let _ = shared
                        .supervisor
                        .send(crate::actors::Cancel {
                            request_id: request_id.clone(),
                        })
                        .await;
                }
                return;
            }
            Ok(Err(error)) if error.code == ErrorCode::NoSlotAvailable => {
                // An interactive submit took the slot meanwhile: wait for one (unless draining).
                if capacity.borrow().draining {
                    if leave_waiting(shared, &request_id) {
                        return cancel_in_hand(shared, message, &record, had).await;
                    }
                    forget(shared, &record, had, true).await;
                    let _ = message.ack_with(AckKind::Nak(None)).await;
                    return;
                }
                let wake = shared
                    .lock_waiting()
                    .entry(request_id.clone())
                    .or_default()
                    .wake
                    .clone();
                set_state(shared, &request_id, RequestState::Queued).await;
                let _ = message.ack_with(AckKind::Progress).await;
                tokio::select! {
                    _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        capacity.wait_for(|c| c.free() > 0),
                    ) => {}
                    () = wake.notified() => {}
                }
            }
            Ok(Err(error)) if error.code == ErrorCode::DuplicateRequestId => {
                // The id runs here under another path; its records are its own.
                leave_waiting(shared, &request_id);
                forget(shared, &record, had, false).await;
                return;
            }
            Ok(Err(error)) => {
                leave_waiting(shared, &request_id);
                forget(shared, &record, had, true).await;
                return refuse(shared, message, &request_id, attempt, error.message).await;
            }
            Err(_) => {
                leave_waiting(shared, &request_id);
                forget(shared, &record, had, true).await;
                let _ = message.ack_with(AckKind::Nak(None)).await;
                return;
            }
        }
    }
}

/// Sets the state of a durable request in hand, here and in its stored record (written only
/// when it changes).
async fn set_state(shared: &Arc<Shared>, request_id: &str, state: RequestState) {
    let record = shared
        .lock_running()
        .get_mut(request_id)
        .filter(|record| record.state != state)
        .map(|record| {
            record.state = state;
            record.clone()
        });
    let Some(record) = record else {
        return;
    };
    if let Err(error) = shared.stores.put_live(&record).await {
        tracing::warn!(message = "could not update a request's record", %error, request_id = %request_id);
    }
    if !shared.lock_running().contains_key(request_id) {
        // It finished meanwhile: what was just written goes once its result is stored.
        tokio::spawn(super::worker::take_back_refreshed(shared.clone(), record));
    }
}

/// Takes a request off the list of those waiting for a slot; true if a caller cancelled it.
fn leave_waiting(shared: &Shared, request_id: &str) -> bool {
    shared
        .lock_waiting()
        .remove(request_id)
        .is_some_and(|waiting| waiting.cancelled)
}

/// Ends a durable request in hand that a caller cancelled before it found a slot: it never
/// runs, its result is CANCELLED and its message is acknowledged.
async fn cancel_in_hand(
    shared: &Shared,
    message: jetstream::Message,
    record: &LiveRecord,
    had: Option<Asked>,
) {
    let request_id = &record.request_id;
    shared.lock_cancelled().remove(request_id);
    forget(shared, record, had, false).await;
    let mut result = unrun_result(
        request_id,
        Reason::Cancelled,
        "cancelled while waiting for a slot".into(),
        &shared.worker_id,
    );
    result.attempt = record.attempt;
    match shared.stores.store_result(&result).await {
        Ok(stored) => {
            if stored == Stored::Stored {
                shared.recorded(&result);
            }
            if let Err(error) = message.double_ack().await {
                tracing::warn!(message = "could not settle a queue message", %error, request_id = %request_id);
            }
        }
        Err(error) => {
            // Handed back rather than lost: it runs elsewhere.
            tracing::warn!(message = "could not store a cancelled request's result", %error, request_id = %request_id);
            shared.stores.unclaim(record).await;
            let _ = message.ack_with(AckKind::Nak(None)).await;
        }
    }
    let _ = shared.stored.send(request_id.clone());
    tracing::info!(message = "cancelled a durable request before it started", request_id = %request_id);
}

/// Takes back what was put on record for a message that did not start here: the local
/// entries, what was recorded as asked before, and (`unrecord`) the stored live record.
async fn forget(shared: &Shared, record: &LiveRecord, had: Option<Asked>, unrecord: bool) {
    let request_id = &record.request_id;
    shared.lock_running().remove(request_id);
    shared.lock_durable().remove(request_id);
    restore_asked(shared, request_id, had);
    if unrecord {
        shared.stores.unclaim(record).await;
    }
}

/// Puts back what was recorded as asked under `request_id` before a refused attempt.
fn restore_asked(shared: &Shared, request_id: &str, previous: Option<Asked>) {
    match previous {
        Some(previous) => shared.lock_asked().insert(request_id.to_string(), previous),
        None => shared.lock_asked().remove(request_id),
    };
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
) {
    tracing::warn!(message = "refused a durable request", request_id = %request_id, %detail);
    let mut result = unrun_result(
        request_id,
        Reason::InvalidRequest,
        detail,
        &shared.worker_id,
    );
    result.attempt = attempt;
    if let Ok(Stored::Stored) = shared.stores.store_result(&result).await {
        shared.recorded(&result);
    }
    let _ = message.ack_with(AckKind::Term).await;
}

/// The result of a request that never ran (refused, cancelled while queued, deliveries
/// exhausted).
pub(super) fn unrun_result(
    request_id: &str,
    reason: Reason,
    detail: String,
    worker_id: &str,
) -> GenerationResult {
    GenerationResult::empty(request_id, reason, detail, worker_id)
}

/// Keeps running durable requests' deliveries alive well inside the ack wait.
pub(super) async fn keep_alive(shared: Arc<Shared>) {
    let every = Duration::from_millis(shared.settings.jetstream.queue_ack_wait_ms / 3);
    loop {
        tokio::time::sleep(every).await;
        let messages: Vec<jetstream::Message> = shared.lock_durable().values().cloned().collect();
        for message in messages {
            let _ = message.ack_with(AckKind::Progress).await;
        }
    }
}

/// Ends a durable message once its result is stored (or hands it back when a drain cancelled
/// it).
pub(super) async fn settle(shared: &Shared, request_id: &str, handed_back: bool) {
    let message = shared.lock_durable().remove(request_id);
    if let Some(message) = message {
        let kind = if handed_back {
            AckKind::Nak(None)
        } else {
            AckKind::Ack
        };
        if let Err(error) = message.double_ack_with(kind).await {
            tracing::warn!(message = "could not settle a queue message", %error, request_id = %request_id);
        }
    }
}

/// Where a queued request waits: the stream sequence of its message.
pub(super) async fn find_queued(
    shared: &Shared,
    request_id: &str,
) -> Result<Option<u64>, BusError> {
    let mut subjects = shared
        .stores
        .queue
        .info_with_subjects(shared.subjects.queued(request_id))
        .await
        .map_err(|e| BusError::Store(format!("cannot look into the queue: {e}")))?;
    let Some(Ok((subject, _))) = subjects.next().await else {
        return Ok(None);
    };
    match shared
        .stores
        .queue
        .get_last_raw_message_by_subject(&subject)
        .await
    {
        Ok(message) => Ok(Some(message.sequence)),
        Err(_) => Ok(None),
    }
}

/// Cancels a request still waiting in the queue: the message is removed and never runs.
pub(super) async fn cancel_queued(
    shared: &Shared,
    request_id: &str,
    sequence: u64,
) -> Result<bool, BusError> {
    let removed = shared
        .stores
        .queue
        .delete_message(sequence)
        .await
        .map_err(|e| BusError::Store(format!("cannot remove the queued request: {e}")))?;
    if removed {
        let result = unrun_result(
            request_id,
            Reason::Cancelled,
            "cancelled while queued".into(),
            &shared.worker_id,
        );
        if shared.stores.store_result(&result).await? == Stored::Stored {
            shared.recorded(&result);
        }
    }
    Ok(removed)
}

/// Listens for the consumer's max-deliveries advisories: the request is given up as FAILED
/// `worker_lost` and its message removed.
pub(super) async fn watch_exhausted(shared: Arc<Shared>) -> Result<(), BusError> {
    let subject = format!(
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.{}",
        shared.settings.jetstream.queue_stream,
        consumer_name(&shared.settings.worker.pool)
    );
    let mut sub = shared
        .client
        .queue_subscribe(subject, "genfleet-exhausted".into())
        .await
        .map_err(|e| BusError::Setup(e.to_string()))?;
    tokio::spawn(async move {
        while let Some(message) = sub.next().await {
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
            let request_id = Subjects::request_id_of(&stored.subject).to_string();
            if is_valid_request_id(&request_id) {
                let mut result = unrun_result(
                    &request_id,
                    Reason::WorkerLost,
                    format!(
                        "deliveries exhausted: {deliveries} workers took the request and none finished it"
                    ),
                    &shared.worker_id,
                );
                result.attempt = u32::try_from(deliveries).unwrap_or(u32::MAX);
                match shared.stores.store_result(&result).await {
                    Ok(Stored::Stored) => shared.recorded(&result),
                    Ok(_) => {}
                    Err(error) => {
                        tracing::warn!(message = "could not store a worker_lost result", %error, request_id = %request_id);
                        continue;
                    }
                }
                tracing::warn!(message = "a durable request ran out of deliveries", request_id = %request_id, deliveries);
            }
            let _ = shared.stores.queue.delete_message(sequence).await;
        }
    });
    Ok(())
}
