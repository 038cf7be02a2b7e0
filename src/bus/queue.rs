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
use super::admission::{self, Claim};
use super::finish::recorded;
use super::reply::header;
use super::shared::{Shared, hold_of};
use super::store::{DurableClaim, LiveRecord, StoreError, Stored};
use super::subjects::Subjects;
use crate::actors::{Capacity, Placement};
use crate::protocol::decision::{CHAIN_HEADER, CHAIN_STATE_HEADER, PARENT_HEADER, ROOT_HEADER};
use crate::protocol::ids::is_valid_request_id;
use crate::protocol::{
    ChainState, ErrorCode, GenerationRequest, GenerationResult, Reason, RequestState, WireError,
};

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
/// The messages of a pull are started side by side (each start is the claim of the request's
/// record, one write), and the next pull does not wait for them: it asks
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
    // The same size limit as submit: a server allowing larger messages must not let a larger
    // request in through the queue.
    let request: GenerationRequest =
        match super::reply::decode(&message.message, shared.settings.limits.max_request_bytes) {
            Ok(request) => request,
            Err(error) => {
                return refuse(shared, message, &request_id, attempt, error.message, None).await;
            }
        };
    if request.request_id.as_deref() != Some(request_id.as_str()) {
        let detail = format!(
            "the body's request_id ({}) must equal the subject's ({request_id})",
            request.request_id.as_deref().unwrap_or("absent")
        );
        return refuse(shared, message, &request_id, attempt, detail, None).await;
    }
    // Checked before anything is written for it.
    let request = match admission::check(shared, request) {
        Ok(request) => request,
        Err(error) => {
            return refuse(shared, message, &request_id, attempt, error.message, None).await;
        }
    };
    // QUEUED when no slot is free for it (an interactive submit took the slot after the pull):
    // it waits here for the next one.
    let state = if shared.capacity.borrow().free() == 0 {
        RequestState::Queued
    } else {
        RequestState::Running
    };
    let live = LiveRecord {
        request_id: request_id.clone(),
        state,
        worker_id: shared.worker_id.clone(),
        attempt,
        durable: true,
    };
    // A request that already ended (or whose result was read) never runs again.
    let revision = match claim(shared, &message, &live).await {
        Ok(DurableClaim::Claimed(revision)) => revision,
        Ok(DurableClaim::Ended) => {
            let _ = message.ack().await;
            return;
        }
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
    let accepted_at = Instant::now()
        .checked_sub(queued_for)
        .unwrap_or_else(Instant::now);
    let root_request_id =
        header(&message.message, ROOT_HEADER).filter(|id| is_valid_request_id(id));
    let chain_position = header(&message.message, CHAIN_HEADER)
        .and_then(|p| p.parse::<u32>().ok())
        .filter(|p| *p >= 1)
        .unwrap_or(1);
    let placement = Placement {
        root_request_id,
        parent_request_id: header(&message.message, PARENT_HEADER)
            .filter(|id| is_valid_request_id(id)),
        chain_position: Some(chain_position),
        attempt: Some(attempt),
        accepted_at: Some(accepted_at),
        durable: true,
        chain: header(&message.message, CHAIN_STATE_HEADER)
            .and_then(|state| ChainState::from_header(&state))
            .unwrap_or_default(),
        traceparent: super::tools::traceparent_of(&message.message),
        // An interactive submit may have taken the slot this message was pulled for: it
        // waits for the next one, its delivery kept alive meanwhile.
        wait_for_slot: true,
        ..Placement::default()
    };
    let claim = Claim { live, revision };
    let kept = message.clone();
    match admission::admit(shared, request, placement, claim, Some(message)).await {
        Ok(_) => {}
        Err(error) if error.code == ErrorCode::NoSlotAvailable => {
            // Draining, or more waiting than slots: another worker (or this one later) runs
            // it. The record names this worker until the next one takes it over.
            let _ = kept.ack_with(AckKind::Nak(None)).await;
        }
        Err(error) if error.code == ErrorCode::Internal => {
            let _ = kept.ack_with(AckKind::Nak(None)).await;
        }
        Err(error) => {
            refuse(
                shared,
                kept,
                &request_id,
                attempt,
                error.message,
                Some(revision),
            )
            .await
        }
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
    claimed: Option<u64>,
) {
    tracing::warn!(message = "refused a durable request", request_id = %request_id, %detail);
    let mut result = GenerationResult::empty(
        request_id,
        Reason::InvalidRequest,
        detail,
        &shared.worker_id,
    );
    result.attempt = attempt;
    if let Ok(Stored::Stored) = shared.stores.store_result(&result, claimed).await {
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

/// Where a queued request waits: the stream sequence of its message.
pub(super) async fn find_queued(
    shared: &Shared,
    request_id: &str,
) -> Result<Option<u64>, QueueError> {
    let mut subjects = shared
        .stores
        .queue
        .info_with_subjects(shared.subjects.queued(request_id))
        .await
        .map_err(|e| QueueError::Look(e.to_string()))?;
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
        if shared.stores.store_result(&result, None).await? == Stored::Stored {
            recorded(shared, &result);
        }
    }
    Ok(removed)
}

/// Subscribes to the pool consumer's max-deliveries advisories (see [`serve_exhausted`]).
pub(super) async fn exhausted_advisories(
    shared: &Shared,
) -> Result<async_nats::Subscriber, BusError> {
    let subject = shared.subjects.max_deliveries_advisory(
        &shared.settings.jetstream.queue_stream,
        &consumer_name(&shared.settings.worker.pool),
    );
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
            let mut result = GenerationResult::empty(
                &request_id,
                Reason::WorkerLost,
                format!(
                    "deliveries exhausted: {deliveries} workers took the request and none finished it"
                ),
                &shared.worker_id,
            );
            result.attempt = u32::try_from(deliveries).unwrap_or(u32::MAX);
            match shared.stores.store_result(&result, None).await {
                Ok(Stored::Stored) => recorded(&shared, &result),
                Ok(Stored::AlreadyStored) => {}
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
