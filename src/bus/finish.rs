//! Events out, and the end of a request: its result stored, its queue message settled, then
//! its `finished` event published.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use tokio::sync::mpsc;

use super::decide::record_decision;
use super::recorded::publish_event;
use super::shared::{Hold, Shared};
use super::store::{Over, Stored};
use crate::actors::{Canceller, Release};
use crate::protocol::{Event, EventBody, GenerationResult, RequestState, Signal};
use crate::telemetry::KeyValue;

/// Requests whose results are being stored at once (see [`publish_events`]).
pub(super) const FINISHING_AT_ONCE: u32 = 64;
/// How long a finished request's result is tried to be stored before it is given up (a
/// durable one then goes back to the queue).
const STORE_RESULT_FOR: Duration = Duration::from_secs(60);
/// The longest pause between two tries at storing a result.
const STORE_RESULT_PAUSE: Duration = Duration::from_secs(2);
/// Room left in a NATS message for what goes around a result: the event's or the stored
/// record's fields, headers, a reply's error envelope.
const RESULT_ENVELOPE_BYTES: usize = 4096;

/// Publishes events in order; a `finished` event goes out only after its result is stored, and
/// signals also go to their own subjects (captured by the signals stream).
///
/// `finished` is the last event a request sends through here, so finishing it (storing the
/// result, settling its queue message, then publishing) runs as a task of its own: the store
/// round trip of one request does not hold up the events of all the others. At most
/// [`FINISHING_AT_ONCE`] run at once; past that this loop waits, and so do the generations.
pub(super) async fn publish_events(shared: Arc<Shared>, mut events: mpsc::Receiver<Event>) {
    while let Some(event) = events.recv().await {
        if !matches!(event.body, EventBody::Finished { .. })
            && shared.fencing.muted(&event.request_id)
        {
            // The fleet may have taken this worker for lost: it says nothing more of what it
            // holds (the request's end decides what is stored and told).
            continue;
        }
        match &event.body {
            EventBody::Finished { .. } => {
                let Ok(permit) = shared.finishing.clone().acquire_owned().await else {
                    return;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    finish(&shared, event).await;
                    drop(permit);
                });
                continue;
            }
            EventBody::Signal { signal } => {
                shared.metrics.observe_signal(signal.kind, &signal.code);
                if let Some(decision) = &signal.decision {
                    record_decision(&shared, signal, decision, event.seq).await;
                }
                publish_signal(&shared, signal).await
            }
            _ => {}
        }
        publish_event(&shared, &event).await;
    }
}

/// Takes an ended request from the Supervisor, stores its result, settles its queue message,
/// then publishes its `finished` event.
async fn finish(shared: &Shared, mut event: Event) {
    let EventBody::Finished { result } = &mut event.body else {
        return;
    };
    // One NATS message must hold the result: in the bucket, in a `gen.result` reply and in the
    // `finished` event, each with a little envelope around it.
    let max_bytes = shared
        .client
        .max_payload()
        .saturating_sub(RESULT_ENVELOPE_BYTES);
    if result.fit_within(max_bytes) {
        tracing::warn!(message = "the result was larger than the server's max_payload; its messages were trimmed", request_id = %result.request_id, max_bytes);
    }
    let released = shared
        .supervisor
        .send(Release::new(result.request_id.clone()))
        .await
        .ok()
        .flatten();
    let (hold, cancelled_by) = match released {
        Some(released) => (released.ticket, released.cancelled_by),
        None => (None, None),
    };
    if let Some(hold) = &hold {
        // Its generation ended: the pool's count of its tenant may go down now.
        hold.give_place_back();
        result.affinity = hold.asked.affinity.clone();
        result.tenant = hold.live.tenant.clone();
        result.resumed = hold.live.resumed.clone();
        // A caller's cancel says who stopped it, and why when the cancel said.
        if result.reason == crate::protocol::Reason::Cancelled
            && cancelled_by == Some(Canceller::Caller)
            && result.detail.is_none()
        {
            result.detail = Some(match hold.cancel_reason() {
                Some(reason) => format!("cancelled by its caller: {reason}"),
                None => "cancelled by its caller".to_string(),
            });
        }
    }
    if let Some(hold) = &hold
        && cancelled_by == Some(Canceller::HandOff)
        && result.reason == crate::protocol::Reason::Cancelled
        && result.detail.as_deref() == Some(crate::engine::HANDED_OFF)
        && (hold.has_progress() || hold.live.progress.is_some())
    {
        // Handed off: its record holds the checkpoint that covers everything its caller was
        // sent, and names this worker until a live peer takes it up (as this worker's entry
        // goes). Nothing is stored or told here, and a durable request's delivery is left for
        // that peer to keep and acknowledge.
        shared
            .handed_off
            .add(result.request_id.clone(), hold.is_durable());
        tracing::info!(message = "handed a request off", request_id = %result.request_id);
        return;
    }
    if let Some(hold) = &hold
        && cancelled_by == Some(Canceller::Preempted)
        && result.reason == crate::protocol::Reason::Cancelled
        && result.detail.as_deref() == Some(crate::engine::HANDED_OFF)
        && hold.has_progress()
    {
        // Preempted: it waits here, in its own band, to go on from the checkpoint it just
        // wrote (its record moves to its next attempt, the move listed).
        shared.metrics.preempted.inc();
        let live = hold.live_now(RequestState::Running);
        match super::resume::take_up_record(
            shared,
            live,
            hold.revision(),
            crate::protocol::MoveReason::Preempted,
        )
        .await
        {
            Ok(outcome) => {
                tracing::info!(message = "a preempted request waits to go on", request_id = %result.request_id, ?outcome)
            }
            Err(error) => {
                tracing::warn!(message = "a preempted request could not be queued again; a peer takes it up if this worker goes", request_id = %result.request_id, %error)
            }
        }
        return;
    }
    let fenced =
        shared.fencing.ended(&result.request_id) || cancelled_by == Some(Canceller::Fenced);
    if fenced {
        // The fleet declared this worker lost: the run's own end is not the request's. An
        // interactive request ends `worker_lost` (as its peers would have ended it), stored
        // only where its record is still this run's.
        result.state = RequestState::Failed;
        result.reason = crate::protocol::Reason::WorkerLost;
        result.detail = Some(format!(
            "worker {} was declared lost (no heartbeat for worker.lost_after_ms) while running the request",
            shared.worker_id
        ));
    }
    let result = &*result;
    let id = &result.request_id;
    let message = hold.as_ref().and_then(|hold| hold.message.as_ref());
    if let (Some(message), Some(hold)) = (message, &hold)
        && matches!(cancelled_by, Some(Canceller::Drain | Canceller::Fenced))
    {
        // A drain or a fence stopped it: it goes back to the queue for another worker, and
        // nothing is stored. Its record says it was given back, if it is still this run's;
        // a run that was taken over leaves the message to the worker that took it.
        match shared.stores.give_back(&hold.live, hold.revision()).await {
            Ok(true) => {
                settle(message, id, AckKind::Nak(None)).await;
                tracing::info!(message = "handed a durable request back to the queue", request_id = %id);
            }
            Ok(false) => {
                shared.metrics.fenced.inc();
                tracing::info!(message = "a durable request was taken over by another worker; this run is discarded", request_id = %id);
            }
            Err(error) => {
                // Its record still names this worker: the next delivery finds it lost or
                // waits for its deliveries to run out.
                tracing::warn!(message = "could not give a durable request back", %error, request_id = %id);
                settle(message, id, AckKind::Nak(None)).await;
            }
        }
        let _ = shared.stored.send(id.clone());
        return;
    }
    let over = hold
        .as_ref()
        .map_or(Over::Nothing, |hold| Over::Claim(hold.revision()));
    let stored = store_result(shared, result, over, message).await;
    let _ = shared.stored.send(id.clone());
    match stored {
        Some(Stored::Stored) => super::recorded::recorded(shared, result),
        _ => shared.metrics.observe_result(result),
    }
    if let Some(hold) = &hold {
        shared.tenant_stats.finished(
            hold.live.tenant.as_deref(),
            hold.asked.request.band(),
            result,
        );
    }
    if let Some(message) = message {
        match stored {
            // A durable request whose result could not be stored goes back to the queue to
            // run again, rather than be acknowledged and lost.
            None => settle(message, id, AckKind::Nak(None)).await,
            Some(Stored::Stored | Stored::AlreadyStored) => settle(message, id, AckKind::Ack).await,
            // Another worker took the request over: the message is its to settle.
            Some(Stored::Fenced) => {}
        }
    }
    if let Some(hold) = &hold {
        end_trace(hold, result);
    }
    // Only the result that was stored is told: a run whose result lost (another runner's
    // stood, or this worker was taken over) says nothing, so no event contradicts the record.
    if stored != Some(Stored::Stored) {
        return;
    }
    if let Some(hold) = &hold {
        record_outcome(shared, &hold.asked.chain, result).await;
    }
    publish_event(shared, &event).await;
}

/// Ends the request's span with what came of it (exported traces only).
fn end_trace(hold: &Hold, result: &GenerationResult) {
    if !crate::telemetry::exporting() {
        return;
    }
    let attributes = vec![
        KeyValue::new("genfleet.state", result.state.as_str()),
        KeyValue::new("genfleet.reason", result.reason.as_str()),
        KeyValue::new(
            "gen_ai.usage.input_tokens",
            result.usage.prompt_tokens as i64,
        ),
        KeyValue::new(
            "gen_ai.usage.output_tokens",
            result.usage.completion_tokens as i64,
        ),
        KeyValue::new(
            "genfleet.tool_iterations",
            i64::from(result.tool_iterations_used),
        ),
    ];
    let error = (result.state == RequestState::Failed).then(|| {
        result
            .detail
            .clone()
            .unwrap_or_else(|| result.reason.as_str().into())
    });
    hold.trace.end(attributes, error);
}

/// Acknowledges (or hands back) a durable request's queue message, waiting for the server.
pub(super) async fn settle(
    message: &async_nats::jetstream::Message,
    request_id: &str,
    kind: AckKind,
) {
    if let Err(error) = message.double_ack_with(kind).await {
        tracing::warn!(message = "could not settle a queue message", %error, request_id = %request_id);
    }
}

/// Stores a result, trying again for up to [`STORE_RESULT_FOR`] (NATS reconnecting, a bucket
/// electing a leader). `None` when it gave up.
///
/// A durable request's `message` is kept alive meanwhile, well inside the queue's ack wait: its
/// request is no longer held here (nothing else keeps it alive), and a delivery let lapse while
/// the results bucket elects a leader goes to another worker, which finds the record still this
/// worker's and hands it back, until the deliveries run out and the request, finished here, is
/// given up as `worker_lost`.
async fn store_result(
    shared: &Shared,
    result: &GenerationResult,
    over: Over,
    message: Option<&async_nats::jetstream::Message>,
) -> Option<Stored> {
    let longest = match message {
        Some(_) => Duration::from_millis(shared.settings.jetstream.queue_ack_wait_ms / 3)
            .min(STORE_RESULT_PAUSE),
        None => STORE_RESULT_PAUSE,
    };
    let mut delay = Duration::from_millis(50).min(longest);
    let started = tokio::time::Instant::now();
    let mut attempt = 0;
    loop {
        attempt += 1;
        match shared.stores.store_result(result, over).await {
            Ok(Stored::Stored) => return Some(Stored::Stored),
            Ok(Stored::AlreadyStored) => {
                tracing::warn!(message = "another runner stored this request's result first; this one is discarded", request_id = %result.request_id);
                return Some(Stored::AlreadyStored);
            }
            Ok(Stored::Fenced) => {
                shared.metrics.fenced.inc();
                tracing::warn!(message = "the request's record is no longer this run's (taken over, or another request's); this result is discarded", request_id = %result.request_id);
                return Some(Stored::Fenced);
            }
            Err(error) if started.elapsed() + delay < STORE_RESULT_FOR => {
                tracing::warn!(message = "storing a result failed; retrying", %error, attempt, request_id = %result.request_id);
                if let Some(message) = message {
                    let _ = message.ack_with(AckKind::Progress).await;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(longest);
            }
            Err(error) => {
                tracing::error!(message = "gave up storing a result", %error, attempt, request_id = %result.request_id);
                return None;
            }
        }
    }
}

/// A continuation's ending is its decision's outcome in the history.
async fn record_outcome(
    shared: &Shared,
    chain: &crate::protocol::ChainState,
    result: &GenerationResult,
) {
    let (Some(decision_id), Some(code)) = (&chain.decision_id, &chain.decision_code) else {
        return;
    };
    if let Err(error) = shared
        .decisions
        .history()
        .set_outcome(code, decision_id, result)
        .await
    {
        tracing::warn!(message = "the decision's outcome was not written to the history", %error, decision_id = %decision_id);
    }
}

async fn publish_signal(shared: &Shared, signal: &Signal) {
    let subject = shared.subjects.signal(signal.kind, &signal.code);
    let body = serde_json::to_vec(signal).expect("signals serialize");
    let jetstream = &shared.stores.jetstream;
    let published = match jetstream.publish(subject, body.into()).await {
        Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
        Err(error) => Err(error.to_string()),
    };
    if let Err(error) = published {
        tracing::warn!(message = "a signal was not stored in its stream", %error, request_id = %signal.request_id);
    }
}
