//! Admission: the one path by which a request becomes the Supervisor's, whether it came as a
//! submit or from the durable queue.
//!
//! A request is checked once (its fields against the limits, its tools against the catalog)
//! before anything is written for it; the caller then claims its record in the store (one
//! create, see [`super::store`]) and hands it here, and it goes to the Supervisor with the
//! bus's [`Hold`] as its ticket. A durable request that finds no free slot may wait in the
//! Supervisor for the next one; its record says QUEUED while it waits.

use std::sync::Arc;

use tokio::sync::oneshot;

use super::shared::{Asked, Hold, Shared};
use super::store::LiveRecord;
use super::tenant_limit::TenantPermit;
use crate::actors::{Accepted, CheckedRequest, Lineage, Placement, Submit};
use crate::client::reply::header;
use crate::protocol::decision::{
    CHAIN_HEADER, CHAIN_STATE_HEADER, PARENT_HEADER, ROOT_HEADER, TRACE_LINK_HEADER,
};
use crate::protocol::ids::is_valid_request_id;
use crate::protocol::{ChainState, ErrorCode, GenerationRequest, RequestState, WireError};
use crate::schedule::Preference;
use crate::telemetry::{self, KeyValue, RequestTrace};

/// Checks a request for acceptance, giving it an id when it has none.
pub(super) fn check(
    shared: &Shared,
    request: GenerationRequest,
) -> Result<CheckedRequest, WireError> {
    shared.checker.check(request)
}

/// Where a request stands in its decision chain. A continuation's message names the decision
/// it comes from (`Genfleet-Chain-State`, with `Genfleet-Parent-Request-Id`,
/// `Genfleet-Root-Request-Id` and `Genfleet-Chain-Position` beside it), but those headers are
/// anyone's to write: they are believed only when the decision's record, which only workers
/// write, names this very request (its id on the bus, so its tenant too) as the continuation
/// its answer started. The chain is then taken from that record, never from the headers.
/// Headers the record does not vouch for are dropped: the request runs as one of its own.
/// Any request carries the caller's trace context.
pub(super) async fn vouched_chain(
    shared: &Shared,
    message: &async_nats::Message,
    request_id: &str,
) -> Result<Lineage, WireError> {
    let plain = Lineage {
        traceparent: super::tools::traceparent_of(message),
        ..Lineage::default()
    };
    let claims_chain = [CHAIN_HEADER, CHAIN_STATE_HEADER, PARENT_HEADER, ROOT_HEADER]
        .iter()
        .any(|name| header(message, name).is_some());
    if !claims_chain {
        return Ok(plain);
    }
    let decision_id = header(message, CHAIN_STATE_HEADER)
        .and_then(|state| ChainState::from_header(&state))
        .and_then(|chain| chain.decision_id)
        .filter(|id| is_valid_request_id(id));
    let record = match &decision_id {
        Some(decision_id) => shared.decisions.get(decision_id).await.map_err(|error| {
            WireError::new(
                ErrorCode::Internal,
                format!("cannot read the decision this continuation names: {error}"),
            )
        })?,
        None => None,
    };
    let vouched = record.and_then(|(record, _)| {
        let answer = record
            .answer
            .clone()
            .filter(|answer| answer.continuation_request_id.as_deref() == Some(request_id))?;
        Some((record, answer))
    });
    let Some((record, answer)) = vouched else {
        shared.metrics.chain_headers_dropped.inc();
        tracing::warn!(
            message = "chain headers no decision vouches for were dropped; the request runs as one of its own",
            request_id = %request_id,
            decision_id = decision_id.as_deref().unwrap_or("none"),
        );
        return Ok(plain);
    };
    Ok(Lineage {
        root_request_id: Some(record.root_request_id.clone()),
        parent_request_id: Some(record.request_id.clone()),
        chain_position: Some(record.chain_position + 1),
        chain: super::decisions::continuation_chain(&record, &answer.choice),
        trace_link: header(message, TRACE_LINK_HEADER),
        ..plain
    })
}

/// A request's claim on its record: the live record written and its revision, and its
/// tenant's place in the pool's count where a pool limit is set.
pub(super) struct Claim {
    pub(super) live: LiveRecord,
    pub(super) revision: u64,
    pub(super) permit: Option<TenantPermit>,
}

/// Hands a checked and claimed request to the Supervisor. On an error nothing of it is held
/// here; the claim is the caller's to give back or leave. `preference` is where the submitter
/// sent it first, for the result's affinity record.
pub(super) async fn admit(
    shared: &Shared,
    request: CheckedRequest,
    mut placement: Placement<Arc<Hold>>,
    claim: Claim,
    message: Option<async_nats::jetstream::Message>,
    preference: Preference,
) -> Result<Accepted, WireError> {
    let root_request_id = placement
        .lineage
        .root_request_id
        .clone()
        .unwrap_or_else(|| request.request_id().to_string());
    let chain_position = placement.lineage.chain_position.unwrap_or(1);
    let affinity = preference.record(
        request.request(),
        &root_request_id,
        chain_position,
        &shared.worker_id,
    );
    let asked = Asked {
        request: request.request().clone(),
        root_request_id,
        chain_position,
        chain: placement.lineage.chain.clone(),
        affinity,
    };
    let trace = request_trace(shared, &request, &placement);
    if let Some(ours) = trace.traceparent() {
        // The slot, the backend and tool services hang their spans under this worker's.
        placement.lineage.traceparent = Some(ours.to_string());
    }
    let hold = Arc::new(
        Hold::new(asked, claim.live, claim.revision, message, trace).holding(claim.permit),
    );
    placement.ticket = Some(hold.clone());
    placement.continuity.store = Some(Arc::new(super::checkpoints::RecordCheckpoints::new(
        shared.stores.clone(),
        hold.clone(),
        shared.listing.clone(),
        std::time::Duration::from_millis(shared.settings.worker.heartbeat_ms),
    )));
    let started = if placement.scheduling.wait_for_slot {
        let (tx, rx) = oneshot::channel();
        placement.on_start = Some(tx);
        Some(rx)
    } else {
        None
    };
    let accepted = shared
        .supervisor
        .send(Submit { request, placement })
        .await
        .map_err(|_| WireError::new(ErrorCode::Internal, "the worker is stopping"))??;
    // The record was claimed with the state the worker's capacity promised; the Supervisor's
    // answer is what holds.
    let claimed = hold.live.state;
    if accepted.state != claimed || accepted.state == RequestState::Queued {
        tokio::spawn(follow_state(
            shared.stores.clone(),
            hold,
            accepted.state,
            started,
        ));
    }
    Ok(accepted)
}

/// The request's span on this worker, from when the fleet accepted it: a child of the caller's
/// span, and for a continuation linked to the decision it answers.
fn request_trace(
    shared: &Shared,
    request: &CheckedRequest,
    placement: &Placement<Arc<Hold>>,
) -> RequestTrace {
    if !telemetry::exporting() {
        return RequestTrace::off();
    }
    let accepted = placement
        .scheduling
        .accepted_at
        .map_or_else(std::time::SystemTime::now, |at| {
            telemetry::wall_clock_ago(at.elapsed())
        });
    let link = placement.lineage.trace_link.clone();
    let attributes = vec![
        KeyValue::new("genfleet.request_id", request.request_id().to_string()),
        KeyValue::new("genfleet.pool", shared.settings.worker.pool.clone()),
        KeyValue::new("genfleet.worker_id", shared.worker_id.clone()),
        KeyValue::new(
            "genfleet.chain_position",
            i64::from(placement.lineage.chain_position.unwrap_or(1)),
        ),
        KeyValue::new(
            "genfleet.attempt",
            i64::from(placement.scheduling.attempt.unwrap_or(1)),
        ),
        KeyValue::new("genfleet.durable", placement.scheduling.durable),
    ];
    RequestTrace::start(
        placement.lineage.traceparent.as_deref(),
        link.as_deref(),
        accepted,
        attributes,
    )
}

/// Keeps a durable request's record telling its state when it differs from its claim: QUEUED
/// while it waits in the Supervisor for a slot, RUNNING once it starts (nothing more if it
/// never does: its end replaces the record).
async fn follow_state(
    stores: super::store::Stores,
    hold: Arc<Hold>,
    accepted: RequestState,
    started: Option<oneshot::Receiver<()>>,
) {
    let write = |state| {
        let stores = stores.clone();
        let hold = hold.clone();
        async move {
            let _writing = hold.writing.lock().await;
            let live = hold.live_now(state);
            match stores.set_live(&live, hold.revision()).await {
                Ok(Some(revision)) => hold.wrote(revision),
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(message = "could not update a request's record", %error, request_id = %live.request_id)
                }
            }
        }
    };
    if accepted != hold.live.state {
        write(accepted).await;
    }
    if accepted == RequestState::Queued
        && let Some(started) = started
        && started.await.is_ok()
    {
        write(RequestState::Running).await;
    }
}
