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
use crate::actors::{Accepted, CheckedRequest, Placement, Submit};
use crate::protocol::{ErrorCode, GenerationRequest, RequestState, WireError};

/// Checks a request for acceptance, giving it an id when it has none.
pub(super) fn check(
    shared: &Shared,
    request: GenerationRequest,
) -> Result<CheckedRequest, WireError> {
    shared.checker.check(request)
}

/// A request's claim on its record: the live record written and its revision.
pub(super) struct Claim {
    pub(super) live: LiveRecord,
    pub(super) revision: u64,
}

/// Hands a checked and claimed request to the Supervisor. On an error nothing of it is held
/// here; the claim is the caller's to give back or leave.
pub(super) async fn admit(
    shared: &Shared,
    request: CheckedRequest,
    mut placement: Placement,
    claim: Claim,
    message: Option<async_nats::jetstream::Message>,
) -> Result<Accepted, WireError> {
    let asked = Asked {
        request: request.request().clone(),
        root_request_id: placement
            .root_request_id
            .clone()
            .unwrap_or_else(|| request.request_id().to_string()),
        chain_position: placement.chain_position.unwrap_or(1),
        chain: placement.chain.clone(),
    };
    let hold = Arc::new(Hold::new(asked, claim.live, claim.revision, message));
    placement.ticket = Some(crate::actors::Ticket(hold.clone()));
    let started = if placement.wait_for_slot {
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
            let live = LiveRecord {
                state,
                ..hold.live.clone()
            };
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
