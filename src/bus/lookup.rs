//! `gen.status.<id>`, `gen.result.<id>` and `gen.cancel.<id>`: any worker answers (one queue
//! group), from the request's record in the store. A cancel of a request running on another
//! worker is forwarded to it.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::Deserialize;

use super::heartbeat::end_if_lost;
use super::queue::{cancel_queued, find_queued};
use super::shared::{Shared, spawn_handler};
use super::store::{LiveRecord, RequestRecord, Versioned};
use crate::actors::Cancel;
use crate::client::reply::{decode, guarded, respond};
use crate::protocol::ids::rfc3339;
use crate::protocol::schedule::is_valid_qualified_id;
use crate::protocol::{
    CancelReply, DecisionOutcome, ErrorCode, ErrorReply, FinishedSummary, GenerationResult,
    RequestState, StatusReply, WireError,
};

/// How long status and result wait for the stores (callers commonly wait 5-10 s).
const STORE_WAIT: Duration = Duration::from_secs(4);
/// Largest body of a result request (`{"release": false}`).
const MAX_OPTIONS_BYTES: usize = 4096;

/// What a caller asks of a request it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lookup {
    Status,
    Result,
    Cancel,
}

impl Lookup {
    pub(super) const ALL: [Lookup; 3] = [Lookup::Status, Lookup::Result, Lookup::Cancel];

    /// The verb in its subject (`gen.<verb>.<request_id>`).
    pub(super) fn verb(self) -> &'static str {
        match self {
            Lookup::Status => "status",
            Lookup::Result => "result",
            Lookup::Cancel => "cancel",
        }
    }

    /// The name of the task that serves the verb's subjects of tenants other than the
    /// default.
    pub(super) fn tenants_task(self) -> &'static str {
        match self {
            Lookup::Status => "status (tenants)",
            Lookup::Result => "result (tenants)",
            Lookup::Cancel => "cancel (tenants)",
        }
    }
}

/// Answers one verb's requests.
pub(super) async fn serve(shared: Arc<Shared>, lookup: Lookup, mut sub: async_nats::Subscriber) {
    while let Some(message) = sub.next().await {
        let shared2 = shared.clone();
        spawn_handler(&shared, async move {
            let shared = &*shared2;
            let request_id = shared
                .subjects
                .request_of(lookup.verb(), &message.subject)
                .to_string();
            match lookup {
                Lookup::Status => {
                    let reply = guarded(bounded(status(shared, &request_id))).await;
                    respond(&shared.client, &message, reply).await;
                }
                Lookup::Result => {
                    let reply = guarded(bounded(result(shared, &request_id, &message))).await;
                    respond(&shared.client, &message, reply).await;
                }
                Lookup::Cancel => {
                    let reason = cancel_reason(&message.payload);
                    let reply = guarded(cancel(shared, &request_id, reason)).await;
                    respond(&shared.client, &message, reply).await;
                }
            }
        })
        .await;
    }
}

/// Reads of the stores answer within [`STORE_WAIT`]: a caller waiting on a stuck store gets
/// INTERNAL in time rather than no answer.
async fn bounded<T>(
    read: impl std::future::Future<Output = Result<T, WireError>>,
) -> Result<T, WireError> {
    tokio::time::timeout(STORE_WAIT, read)
        .await
        .unwrap_or_else(|_| {
            Err(WireError::new(
                ErrorCode::Internal,
                "the stores did not answer in time",
            ))
        })
}

fn checked_id(request_id: &str) -> Result<(), WireError> {
    if is_valid_qualified_id(request_id) {
        Ok(())
    } else {
        Err(WireError::invalid(
            "the subject does not end in a valid request id",
        ))
    }
}

fn not_found(request_id: &str) -> WireError {
    WireError::new(
        ErrorCode::NotFound,
        format!("request {request_id} is not known (or its result was already read)"),
    )
}

/// What the store says of a request: its record, with a live record whose worker is gone
/// turned into the `worker_lost` result that ends it.
async fn read(shared: &Shared, request_id: &str) -> Result<Option<Versioned>, WireError> {
    let versioned = shared.stores.versioned(request_id).await?;
    if let Some(Versioned {
        record: RequestRecord::Live { live },
        revision,
        ..
    }) = &versioned
        && end_if_lost(shared, live, *revision).await?.is_some()
    {
        return Ok(shared.stores.versioned(request_id).await?);
    }
    Ok(versioned)
}

async fn status(shared: &Shared, request_id: &str) -> Result<StatusReply, WireError> {
    checked_id(request_id)?;
    let versioned = read(shared, request_id).await?;
    let reply = match versioned.map(|v| (v.record, v.written)) {
        Some((RequestRecord::Live { live }, _)) => running(&live),
        Some((RequestRecord::Result(result), written)) => StatusReply {
            worker_id: Some(result.worker_id.clone()),
            attempt: Some(result.attempt),
            // Finished when its result was stored.
            finished: Some(FinishedSummary::of(&result, Some(rfc3339(written)))),
            ..StatusReply::new(request_id, result.state)
        },
        Some((
            RequestRecord::Released {
                state, finished, ..
            },
            _,
        )) => {
            let finished = match finished {
                Some(summary) => Some(*summary),
                None => shared.stores.finished_summary(request_id).await,
            };
            StatusReply {
                worker_id: finished.as_ref().map(|s| s.worker_id.clone()),
                attempt: finished.as_ref().map(|s| s.attempt),
                finished,
                ..StatusReply::new(request_id, state)
            }
        }
        None => {
            if let Some(queued) = find_queued(shared, request_id).await? {
                return Ok(StatusReply {
                    priority: Some(queued.band),
                    tenant: Some(queued.tenant),
                    ..StatusReply::new(request_id, RequestState::Queued)
                });
            }
            // Its result (and the tombstone that outlives a read) aged out: the summary kept
            // for people still says how it ended.
            let Some(summary) = shared.stores.finished_summary(request_id).await else {
                return Err(not_found(request_id));
            };
            StatusReply {
                worker_id: Some(summary.worker_id.clone()),
                attempt: Some(summary.attempt),
                finished: Some(summary.clone()),
                ..StatusReply::new(request_id, summary.state)
            }
        }
    };
    Ok(with_decision(shared, reply).await)
}

fn running(live: &LiveRecord) -> StatusReply {
    StatusReply {
        worker_id: Some(live.worker_id.clone()),
        attempt: Some(live.attempt),
        priority: Some(live.priority.unwrap_or_default()),
        tenant: Some(
            live.tenant
                .clone()
                .unwrap_or_else(|| crate::protocol::DEFAULT_TENANT.to_string()),
        ),
        ..StatusReply::new(&live.request_id, live.state)
    }
}

/// A finished request's status names the decision it raised and what became of it.
async fn with_decision(shared: &Shared, mut reply: StatusReply) -> StatusReply {
    if !reply.state.is_terminal() {
        return reply;
    }
    if let Some(mark) = shared.decisions.mark_of(&reply.request_id).await {
        reply.continuation_request_id = mark.continuation_request_id;
        reply.decision_id = Some(mark.decision_id);
        reply.decision_outcome = Some(mark.outcome);
    }
    reply
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultOptions {
    #[serde(default = "yes")]
    release: bool,
}

fn yes() -> bool {
    true
}

async fn result(
    shared: &Shared,
    request_id: &str,
    message: &async_nats::Message,
) -> Result<GenerationResult, WireError> {
    checked_id(request_id)?;
    let options: ResultOptions = if message.payload.is_empty() {
        ResultOptions { release: true }
    } else {
        decode(message, MAX_OPTIONS_BYTES)?
    };
    let Some(Versioned {
        record,
        revision,
        written,
    }) = read(shared, request_id).await?
    else {
        return if find_queued(shared, request_id).await?.is_some() {
            Err(not_ready(request_id, RequestState::Queued))
        } else {
            Err(not_found(request_id))
        };
    };
    match record {
        RequestRecord::Result(result) => {
            if !options.release {
                return Ok(*result);
            }
            let summary = FinishedSummary::of(&result, Some(rfc3339(written)));
            if shared.stores.release(&result, &summary, revision).await? {
                // Kept for people beyond the tombstone's life, off the caller's path.
                shared.stores.keep_finished(summary);
                Ok(*result)
            } else {
                // Another caller read it first.
                Err(not_found(request_id))
            }
        }
        RequestRecord::Released { .. } => Err(not_found(request_id)),
        RequestRecord::Live { live } => Err(not_ready(request_id, live.state)),
    }
}

fn not_ready(request_id: &str, state: RequestState) -> WireError {
    WireError::new(
        ErrorCode::NotReady,
        format!("request {request_id} is {}", state.as_str()),
    )
    .with_detail(serde_json::json!({ "state": state }))
}

/// The longest reason a cancel may give (longer ones are cut).
const MAX_CANCEL_REASON_CHARS: usize = 200;

/// Header of a forwarded cancel: the reason its caller gave.
const CANCEL_REASON_HEADER: &str = "Genfleet-Cancel-Reason";

/// Why the caller cancels, when its body says (`{"reason": "..."}`). The body of a cancel was
/// never read before, so anything else in it is still ignored, as v1 callers expect.
fn cancel_reason(payload: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Body {
        reason: Option<String>,
    }
    let body: Body = serde_json::from_slice(payload).ok()?;
    let reason = body
        .reason
        .map(|r| {
            r.chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect::<String>()
        })
        .filter(|r| !r.trim().is_empty())?;
    Some(crate::protocol::finished::opening(
        reason.trim(),
        MAX_CANCEL_REASON_CHARS,
    ))
}

async fn cancel(
    shared: &Shared,
    request_id: &str,
    reason: Option<String>,
) -> Result<CancelReply, WireError> {
    checked_id(request_id)?;
    let cancelled = |decision_id| CancelReply {
        request_id: request_id.into(),
        state: RequestState::Cancelled,
        decision_id,
    };
    let live = match read(shared, request_id).await?.map(|v| v.record) {
        Some(RequestRecord::Live { live }) => live,
        Some(record) => {
            // A request waiting on a decision: cancelling it expires the decision.
            if let Some(mark) = shared.decisions.mark_of(request_id).await
                && mark.outcome == DecisionOutcome::Pending
                && let Some(record) = shared
                    .decisions
                    .expire(
                        &shared.client,
                        &shared.worker_id,
                        &mark.decision_id,
                        "the caller cancelled the request that raised it",
                    )
                    .await
                    .map_err(|e| WireError::new(ErrorCode::Internal, e.to_string()))?
            {
                return Ok(cancelled(Some(record.decision_id)));
            }
            return Err(already_finished(request_id, record.state()));
        }
        None => {
            if let Some(waiting) = find_queued(shared, request_id).await?
                && cancel_queued(shared, request_id, waiting.sequence).await?
            {
                return Ok(cancelled(None));
            }
            return Err(not_found(request_id));
        }
    };
    if live.worker_id == shared.worker_id {
        return cancel_here(shared, request_id, reason).await;
    }
    forward_cancel(shared, &live, reason).await
}

fn already_finished(request_id: &str, state: RequestState) -> WireError {
    WireError::new(
        ErrorCode::AlreadyFinished,
        format!("request {request_id} already ended"),
    )
    .with_detail(serde_json::json!({ "state": state }))
}

/// Another worker runs it: the cancel is forwarded and its answer relayed.
async fn forward_cancel(
    shared: &Shared,
    live: &LiveRecord,
    reason: Option<String>,
) -> Result<CancelReply, WireError> {
    let wait =
        Duration::from_millis(shared.settings.worker.cancel_wait_ms) + Duration::from_secs(2);
    let subject = shared.subjects.worker_cancel(&live.worker_id);
    let mut headers = async_nats::HeaderMap::new();
    if let Some(reason) = &reason {
        headers.insert(CANCEL_REASON_HEADER, reason.as_str());
    }
    let request = async_nats::Request::new()
        .headers(headers)
        .payload(live.request_id.clone().into());
    let reply = tokio::time::timeout(wait, shared.client.send_request(subject, request)).await;
    match reply {
        Ok(Ok(message)) => {
            if let Ok(reply) = serde_json::from_slice::<CancelReply>(&message.payload) {
                return Ok(reply);
            }
            match serde_json::from_slice::<ErrorReply>(&message.payload) {
                Ok(error) => Err(error.into()),
                Err(_) => Err(WireError::new(
                    ErrorCode::Internal,
                    "the running worker sent an unreadable answer",
                )),
            }
        }
        Ok(Err(error)) => Err(WireError::new(
            ErrorCode::Internal,
            format!("worker {} does not answer: {error}", live.worker_id),
        )),
        Err(_) => Err(WireError::new(
            ErrorCode::Internal,
            format!("worker {} did not answer in time", live.worker_id),
        )),
    }
}

/// Cancels a request this worker holds (running, or waiting for a slot). The reply comes once
/// its result is stored (bounded by `worker.cancel_wait_ms`), so a caller's next `result`
/// finds it.
pub(super) async fn cancel_here(
    shared: &Shared,
    request_id: &str,
    reason: Option<String>,
) -> Result<CancelReply, WireError> {
    if let Some(hold) = super::shared::hold_of(shared, request_id).await {
        hold.cancelled_because(reason);
    }
    // Listening before the cancel goes in, so the notice of the stored result is not missed.
    let mut stored = shared.stored.subscribe();
    let reply = shared
        .supervisor
        .send(Cancel {
            request_id: request_id.to_string(),
        })
        .await
        .map_err(|_| WireError::new(ErrorCode::Internal, "the worker is stopping"))??;
    let wait = Duration::from_millis(shared.settings.worker.cancel_wait_ms);
    let _ = tokio::time::timeout(wait, async {
        loop {
            match stored.recv().await {
                Ok(id) if id == request_id => return,
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    if let Ok(Some((record, _))) = shared.stores.record(request_id).await
                        && record.state().is_terminal()
                    {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    })
    .await;
    Ok(reply)
}

/// Cancels forwarded by other workers (`gen.worker.<worker_id>.cancel`).
pub(super) async fn serve_forwarded_cancels(shared: Arc<Shared>, mut sub: async_nats::Subscriber) {
    while let Some(message) = sub.next().await {
        let shared2 = shared.clone();
        spawn_handler(&shared, async move {
            let request_id = String::from_utf8_lossy(&message.payload).to_string();
            let reason = crate::client::reply::header(&message, CANCEL_REASON_HEADER);
            let reply = guarded(cancel_here(&shared2, &request_id, reason)).await;
            respond(&shared2.client, &message, reply).await;
        })
        .await;
    }
}
