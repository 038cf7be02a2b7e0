//! Resume: a request whose worker is gone taken up from its last checkpoint (written by
//! `checkpoints`) by a live worker of the pool.
//!
//! Taking a request up is one compare-and-set: of the live workers that find it, one wins,
//! writes its own id and the next attempt into the record with the move listed, and runs the
//! request from the checkpoint in its Supervisor (waiting for a slot if none is free).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::admission::{self, Claim};
use super::shared::Shared;
use super::store::{LiveRecord, Over, StoreError, Stored};
use crate::actors::{Lineage, Placement, Scheduling};
use crate::client::records::{RequestRecord, Versioned};
use crate::engine::{Continuity, Resume};
use crate::protocol::result::MAX_MOVES_LISTED;
use crate::protocol::{GenerationResult, MoveReason, Progress, Reason, RequestState, Resumed};
use crate::schedule::Preference;

/// What became of a gone worker's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TakenUp {
    /// It goes on here, from its checkpoint.
    Here,
    /// Its record no longer names that worker (another worker took it up, or it ended).
    NotThere,
    /// It has no checkpoint (it ran less than `generation.checkpoint_ms`): nothing to go on
    /// from.
    NoCheckpoint,
}

/// Takes up an interactive request of `gone` (a lost worker) from its last checkpoint, if its
/// record still names that worker.
pub(super) async fn take_up(
    shared: &Shared,
    request_id: &str,
    gone: &str,
    reason: MoveReason,
) -> Result<TakenUp, StoreError> {
    let Some(Versioned {
        record: RequestRecord::Live { live },
        revision,
        ..
    }) = shared.stores.versioned(request_id).await?
    else {
        return Ok(TakenUp::NotThere);
    };
    if live.worker_id != gone || (live.durable && live.ack.is_none()) {
        return Ok(TakenUp::NotThere);
    }
    take_up_record(shared, live, revision, reason).await
}

/// Takes up the request of `live` (at `revision`) here, from its checkpoint.
pub(super) async fn take_up_record(
    shared: &Shared,
    live: LiveRecord,
    revision: u64,
    reason: MoveReason,
) -> Result<TakenUp, StoreError> {
    let Some(progress) = live.progress.clone() else {
        return Ok(TakenUp::NoCheckpoint);
    };
    let from_worker = live.worker_id.clone();
    let resumed = moved(shared, &live, &progress, reason);
    let next = LiveRecord {
        state: RequestState::Running,
        worker_id: shared.worker_id.clone(),
        attempt: live.attempt + 1,
        resumed,
        ..live
    };
    let Some(revision) = shared.stores.take_over(&next, revision).await? else {
        return Ok(TakenUp::NotThere);
    };
    // The request is this worker's now: it runs here, or ends here.
    shared.metrics.resumed.inc();
    resend_released(shared, &next.request_id, &progress).await;
    let next_seq = progress.next_seq;
    tracing::info!(
        message = "took up a request from its last checkpoint",
        request_id = %next.request_id,
        from_worker = %from_worker,
        reason = ?reason,
        at_token = progress.usage.completion_tokens,
    );
    if let Err(error) = run_here(shared, &next, revision, *progress, from_worker, reason).await {
        let mut result = GenerationResult::empty(
            &next.request_id,
            Reason::WorkerLost,
            format!("its worker was lost and it could not go on here: {error}"),
            &shared.worker_id,
        );
        result.attempt = next.attempt;
        result.resumed = next.resumed.clone();
        if let Ok(Stored::Stored) = shared
            .stores
            .store_result(&result, Over::Claim(revision))
            .await
        {
            super::recorded::recorded(shared, &result);
            // Its followers hear of the end, numbered on from the checkpoint.
            super::recorded::publish_finished(shared, &result, next_seq).await;
        }
    }
    Ok(TakenUp::Here)
}

/// The moves of `live`'s request with one more: from its worker to this one, at `progress`.
fn moved(
    shared: &Shared,
    live: &LiveRecord,
    progress: &Progress,
    reason: MoveReason,
) -> Vec<Resumed> {
    let mut resumed = live.resumed.clone();
    if resumed.len() < MAX_MOVES_LISTED {
        resumed.push(Resumed {
            from_worker: live.worker_id.clone(),
            to_worker: shared.worker_id.clone(),
            at_token: progress.usage.completion_tokens,
            at_output_bytes: progress.output.len(),
            reason,
            turn_restarted: !progress.partial.is_empty()
                && !shared.checker.continues_turns(&progress.request),
            at: crate::protocol::ids::now_rfc3339(),
        });
    }
    resumed
}

/// A redelivered durable request about to be taken over from `holder`: the record it writes
/// carries the last checkpoint `holder` stored, and the move.
pub(super) async fn carry_over(shared: &Shared, live: &mut LiveRecord, holder: &str) {
    let Ok(Some(Versioned {
        record: RequestRecord::Live { live: held },
        ..
    })) = shared.stores.versioned(&live.request_id).await
    else {
        return;
    };
    if held.worker_id != holder {
        return;
    }
    if let Some(progress) = &held.progress {
        live.resumed = moved(shared, &held, progress, MoveReason::WorkerLost);
        live.progress = held.progress.clone();
    }
}

/// Sends again, as they were, the events the checkpoint let go: its worker may have died
/// after storing it and before they went out. They go straight out (not through the worker's
/// event publisher, which would publish a signal again on its own subject), ahead of every event
/// of the run that goes on; a follower that has them drops them by their numbers. Only events
/// of `request_id` itself go out, on its own subject.
pub(super) async fn resend_released(shared: &Shared, request_id: &str, progress: &Progress) {
    for event in progress
        .released
        .iter()
        .filter(|event| event.request_id == request_id)
    {
        super::recorded::publish_event(shared, event).await;
    }
}

/// What a request taken over from `holder` with `live` goes on from.
pub(super) fn carried(live: &LiveRecord, holder: &str) -> Option<Arc<Resume>> {
    let progress = live.progress.as_deref()?.clone();
    Some(Arc::new(Resume {
        progress,
        from_worker: holder.to_string(),
        reason: MoveReason::WorkerLost,
    }))
}

/// The queue delivery a taken-up durable request runs under: the one its lost worker held,
/// kept alive and acknowledged from here through its acknowledgement subject.
fn adopted_delivery(shared: &Shared, live: &LiveRecord) -> Option<async_nats::jetstream::Message> {
    let ack = live.ack.clone()?;
    Some(async_nats::jetstream::Message {
        message: async_nats::Message {
            subject: shared
                .subjects
                .queue(&shared.settings.worker.pool, &live.request_id)
                .into(),
            reply: Some(ack.into()),
            payload: bytes::Bytes::new(),
            headers: None,
            status: None,
            description: None,
            length: 0,
        },
        context: shared.stores.jetstream.clone(),
    })
}

/// Hands the taken-up request to the Supervisor with its checkpoint.
async fn run_here(
    shared: &Shared,
    live: &LiveRecord,
    revision: u64,
    progress: Progress,
    from_worker: String,
    reason: MoveReason,
) -> Result<(), crate::protocol::WireError> {
    let mut request = progress.request.clone();
    // Its id was checked bare, then put under its tenant.
    let bare = match &live.tenant {
        Some(tenant) => live
            .request_id
            .strip_prefix(&format!("{tenant}."))
            .unwrap_or(&live.request_id),
        None => &live.request_id,
    };
    request.request_id = Some(bare.to_string());
    let checked = admission::check(shared, request)?.qualified(live.tenant.as_deref());
    let accepted_at = Instant::now()
        .checked_sub(Duration::from_millis(progress.elapsed_ms))
        .unwrap_or_else(Instant::now);
    let placement = Placement {
        lineage: Lineage {
            root_request_id: Some(progress.root_request_id.clone()),
            parent_request_id: progress.parent_request_id.clone(),
            chain_position: Some(progress.chain_position),
            ..Lineage::default()
        },
        scheduling: Scheduling {
            band: live.priority.unwrap_or_default(),
            tenant: live.tenant.clone(),
            wait_for_slot: true,
            durable: live.durable,
            attempt: Some(live.attempt),
            accepted_at: Some(accepted_at),
        },
        continuity: Continuity {
            from: Some(Arc::new(Resume {
                progress,
                from_worker,
                reason,
            })),
            preemptions: live
                .resumed
                .iter()
                .filter(|moved| moved.reason == MoveReason::Preempted)
                .count() as u32,
            ..Continuity::default()
        },
        ..Placement::default()
    };
    let claim = Claim {
        live: live.clone(),
        revision,
        permit: None,
    };
    let delivery = if live.durable {
        adopted_delivery(shared, live)
    } else {
        None
    };
    admission::admit(
        shared,
        checked,
        placement,
        claim,
        delivery,
        Preference::direct(&shared.worker_id),
    )
    .await
    .map(|_| ())
}
