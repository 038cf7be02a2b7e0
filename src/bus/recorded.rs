//! What the fleet is told of a stored result: the worker's metrics, and for a FAILED one the
//! `signals.outcome.FAILED` signal (stored in the signals stream) for managers and the console.
//! Every path that stores a result calls [`recorded`] once it is stored. The events of a
//! request go out through [`publish_event`] wherever they are published from.

use super::shared::Shared;
use crate::protocol::{
    Event, EventBody, GenerationResult, RequestState, Severity, Signal, SignalSource, SignalType,
};

/// Characters of a failure's detail its signal carries.
const FAILURE_DETAIL_CHARS: usize = 1000;

/// What follows a result stored here first (by whichever path): its metrics and, when it
/// failed, `signals.outcome.FAILED` for managers.
pub(super) fn recorded(shared: &Shared, result: &GenerationResult) {
    shared.metrics.observe_result(result);
    if result.state == RequestState::Failed {
        let signal = failure_signal(result, &shared.settings.worker.pool);
        let subject = shared.subjects.signal(signal.kind, &signal.code);
        let body = serde_json::to_vec(&signal).expect("signals serialize");
        let jetstream = shared.stores.jetstream.clone();
        tokio::spawn(async move {
            let published = match jetstream.publish(subject, body.into()).await {
                Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                Err(error) => Err(error.to_string()),
            };
            if let Err(error) = published {
                tracing::warn!(message = "a failure signal was not stored in its stream", %error, request_id = %signal.request_id);
            }
        });
    }
}

/// Publishes one of a request's events on `gen.events.<request_id>`.
pub(super) async fn publish_event(shared: &Shared, event: &Event) {
    let subject = shared.subjects.events(&event.request_id);
    let body = serde_json::to_vec(event).expect("events serialize");
    if let Err(error) = shared.client.publish(subject, body.into()).await {
        tracing::warn!(message = "could not publish an event", %error, request_id = %event.request_id);
    }
}

/// The `finished` event of a result this worker stored for a request that was not running
/// here (its worker lost, or a take-up that could not go on), numbered `seq`.
pub(super) async fn publish_finished(shared: &Shared, result: &GenerationResult, seq: u64) {
    let event = Event {
        request_id: result.request_id.clone(),
        seq,
        ts: crate::protocol::ids::now_rfc3339(),
        body: EventBody::Finished {
            result: Box::new(result.clone()),
        },
    };
    publish_event(shared, &event).await;
}

/// `signals.outcome.FAILED`: a request ended FAILED, with its reason, detail and place in its
/// job, for managers and the console.
fn failure_signal(result: &GenerationResult, pool: &str) -> Signal {
    use crate::protocol::finished::opening;
    let detail = result
        .detail
        .as_deref()
        .map(|d| opening(d, FAILURE_DETAIL_CHARS));
    let mut meta = serde_json::Map::new();
    meta.insert("reason".into(), result.reason.as_str().into());
    meta.insert("detail".into(), detail.clone().into());
    meta.insert("attempt".into(), result.attempt.into());
    meta.insert("chain_position".into(), result.chain_position.into());
    meta.insert(
        "parent_request_id".into(),
        result.parent_request_id.clone().into(),
    );
    let summary = match &detail {
        Some(detail) => format!(
            "request failed: {}: {}",
            result.reason.as_str(),
            opening(detail, 200)
        ),
        None => format!("request failed: {}", result.reason.as_str()),
    };
    Signal {
        signal_id: crate::protocol::ids::new_id(),
        kind: SignalType::Outcome,
        code: "FAILED".into(),
        source: SignalSource::Worker,
        severity: Severity::High,
        summary,
        meta,
        request_id: result.request_id.clone(),
        root_request_id: result.root_request_id.clone(),
        job_name: result.job_name.clone(),
        worker_id: result.worker_id.clone(),
        pool: pool.to_string(),
        ts: crate::protocol::ids::now_rfc3339(),
        decision: None,
    }
}
