//! `gen.submit.<pool>`: interactive requests, started now in a free slot or refused.
//!
//! A worker is subscribed to its pool's submit subject only while it has a free slot, so a
//! submit that finds no responders means no worker of the pool has one. Leaving the queue
//! group drains the subscription: every submit that reached this worker is answered.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;

use super::admission::{self, Claim};
use super::reply::{decode, guarded, respond};
use super::shared::{Shared, spawn_handler};
use super::store::LiveRecord;
use crate::actors::{Accepted, Capacity, Placement};
use crate::protocol::{GenerationRequest, RequestState, WireError};

/// Subscribes to the pool's submit subject while a slot is free.
pub(super) async fn serve_submits(
    shared: Arc<Shared>,
    mut capacity: watch::Receiver<Capacity>,
    mut first: Option<async_nats::Subscriber>,
) {
    let subject = shared.subjects.submit(&shared.settings.worker.pool);
    let group = shared.subjects.submit_group(&shared.settings.worker.pool);
    loop {
        if capacity.wait_for(|c| c.free() > 0).await.is_err() {
            return;
        }
        let subscribed = match first.take() {
            Some(sub) => Ok(sub),
            None => {
                shared
                    .client
                    .queue_subscribe(subject.clone(), group.clone())
                    .await
            }
        };
        let mut sub = match subscribed {
            Ok(sub) => sub,
            Err(error) => {
                tracing::error!(message = "cannot subscribe to submits; retrying", %error);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            tokio::select! {
                message = sub.next() => match message {
                    Some(message) => spawn_handler(&shared, handle_submit(shared.clone(), message)).await,
                    None => break,
                },
                changed = capacity.changed() => {
                    if changed.is_err() || capacity.borrow().free() == 0 {
                        // Drain, not unsubscribe: a submit the server routed here before it saw
                        // the UNSUB still arrives and is answered.
                        let _ = sub.drain().await;
                        while let Some(message) = sub.next().await {
                            spawn_handler(&shared, handle_submit(shared.clone(), message)).await;
                        }
                        break;
                    }
                }
            }
        }
    }
}

async fn handle_submit(shared: Arc<Shared>, message: async_nats::Message) {
    let reply = guarded(submit(&shared, &message)).await;
    respond(&shared.client, &message, reply).await;
}

/// Checks, claims the id fleet-wide (the request's one write before it runs), and starts it.
async fn submit(shared: &Shared, message: &async_nats::Message) -> Result<Accepted, WireError> {
    let request: GenerationRequest = decode(message, shared.settings.limits.max_request_bytes)?;
    let request = admission::check(shared, request)?;
    let live = LiveRecord {
        request_id: request.request_id().to_string(),
        state: RequestState::Running,
        worker_id: shared.worker_id.clone(),
        attempt: 1,
        durable: false,
    };
    let revision = shared.stores.claim(&live).await?;
    let placement = Placement {
        traceparent: super::tools::traceparent_of(message),
        ..Placement::default()
    };
    let request_id = live.request_id.clone();
    let claim = Claim { live, revision };
    let admitted = admission::admit(shared, request, placement, claim, None).await;
    if admitted.is_err() {
        // Refused after all (the last slot went to another request meanwhile, or the worker
        // drains): the id is free again for the caller's next try.
        shared.stores.unclaim(&request_id, revision).await;
    }
    admitted
}
