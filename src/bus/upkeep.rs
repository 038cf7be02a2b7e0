//! Upkeep of the requests this worker holds, on a timer rather than per request: their records
//! are rewritten well inside the results bucket's TTL, and the deliveries of durable ones are
//! kept alive well inside the queue's ack wait.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;

use super::shared::{Shared, held_requests};
use crate::protocol::RequestState;

/// Rewrites the records of the requests held here every `jetstream.running_refresh_ms`, so a
/// request running longer than `jetstream.results_ttl_ms` keeps its record.
pub(super) async fn refresh_records(shared: Arc<Shared>) {
    let every = Duration::from_millis(shared.settings.jetstream.running_refresh_ms);
    loop {
        tokio::time::sleep(every).await;
        for (held, hold) in held_requests(&shared).await {
            if held.state.is_terminal() {
                continue;
            }
            let _writing = hold.writing.lock().await;
            let live = hold.live_now(held.state);
            match shared.stores.set_live(&live, hold.revision()).await {
                Ok(Some(revision)) => hold.wrote(revision),
                // Ended meanwhile: its result replaced the record.
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(message = "could not refresh a request's record", %error, request_id = %held.request_id)
                }
            }
        }
    }
}

/// Keeps the deliveries of the durable requests held here (running, or waiting for a slot)
/// alive well inside the ack wait.
pub(super) async fn keep_deliveries(shared: Arc<Shared>) {
    let every = Duration::from_millis(shared.settings.jetstream.queue_ack_wait_ms / 3);
    loop {
        tokio::time::sleep(every).await;
        for (held, hold) in held_requests(&shared).await {
            if let Some(message) = &hold.message
                && matches!(held.state, RequestState::Running | RequestState::Queued)
            {
                let _ = message.ack_with(AckKind::Progress).await;
            }
        }
    }
}
