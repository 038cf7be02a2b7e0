//! A running request's checkpoints, written into its record by compare-and-set: stored only
//! while the record is still this run's, so a run that was taken over learns it at its next
//! checkpoint ([`CheckpointError::Fenced`]) and says nothing more. A request's first
//! checkpoint waits until a heartbeat lists the request (see [`Listing`]).

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::shared::{Hold, Listing};
use super::store::Stores;
use crate::engine::{CheckpointError, Checkpoints};
use crate::protocol::{Progress, RequestState};

/// How long a checkpoint may take to be stored before the generation goes on without it.
const SAVE_WITHIN: Duration = Duration::from_secs(5);

/// Writes a request's checkpoints into its live record.
pub(super) struct RecordCheckpoints {
    stores: Stores,
    hold: Arc<Hold>,
    /// Asked for a heartbeat listing the request before its first checkpoint.
    listing: Arc<Listing>,
    heartbeat: Duration,
}

impl RecordCheckpoints {
    pub(super) fn new(
        stores: Stores,
        hold: Arc<Hold>,
        listing: Arc<Listing>,
        heartbeat: Duration,
    ) -> RecordCheckpoints {
        RecordCheckpoints {
            stores,
            hold,
            listing,
            heartbeat,
        }
    }
}

impl Checkpoints for RecordCheckpoints {
    fn save(&self, progress: Progress) -> BoxFuture<'static, Result<(), CheckpointError>> {
        let stores = self.stores.clone();
        let hold = self.hold.clone();
        let listing = self.listing.clone();
        let heartbeat = self.heartbeat;
        Box::pin(async move {
            if !hold.has_progress() && !listing.beat_listing(heartbeat * 2).await {
                return Err(CheckpointError::Failed(
                    "no heartbeat listing the request could be written".into(),
                ));
            }
            let _writing = hold.writing.lock().await;
            let progress = Box::new(progress);
            let mut live = hold.live_now(RequestState::Running);
            live.progress = Some(progress.clone());
            match tokio::time::timeout(SAVE_WITHIN, stores.set_live(&live, hold.revision())).await {
                Ok(Ok(Some(revision))) => {
                    hold.wrote(revision);
                    hold.keep_progress(progress);
                    Ok(())
                }
                Ok(Ok(None)) => Err(CheckpointError::Fenced),
                Ok(Err(error)) => Err(CheckpointError::Failed(error.to_string())),
                Err(_) => Err(CheckpointError::Failed(format!(
                    "not stored within {} ms",
                    SAVE_WITHIN.as_millis()
                ))),
            }
        })
    }
}
