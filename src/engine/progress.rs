//! Where a generation's checkpoints go, and what a resumed generation starts from.
//!
//! The engine decides when a checkpoint is due and what it holds (see
//! `generation/progress.rs`); the layer that runs it decides where it is kept, through
//! [`Checkpoints`] (the bus writes it into the request's record, by compare-and-set). A
//! generation that goes on from a checkpoint is handed a [`Resume`].

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::protocol::{MoveReason, Progress};

/// Keeps a request's checkpoints.
pub trait Checkpoints: Send + Sync + 'static {
    /// Stores `progress` as the request's last checkpoint, replacing the one before.
    fn save(&self, progress: Progress) -> BoxFuture<'static, Result<(), CheckpointError>>;
}

/// Why a checkpoint was not stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    /// The request's record is no longer this run's (the fleet took the request over, or it
    /// ended): this run says nothing more of it.
    #[error("the request's record is no longer this run's")]
    Fenced,
    /// The store could not be written; the generation goes on without this checkpoint.
    #[error("the checkpoint could not be stored: {0}")]
    Failed(String),
}

/// Where a generation goes on from: another run's last checkpoint.
#[derive(Debug, Clone)]
pub struct Resume {
    pub progress: Progress,
    /// The worker the request left.
    pub from_worker: String,
    pub reason: MoveReason,
}

/// A request's continuity across workers: where its checkpoints go (none: it writes none), the
/// checkpoint it goes on from (none: it starts afresh), and the token that asks it to hand off.
#[derive(Clone, Default)]
pub struct Continuity {
    pub store: Option<Arc<dyn Checkpoints>>,
    pub from: Option<Arc<Resume>>,
    /// Cancelled to hand the request off (a drain, a preemption): it writes a checkpoint at the
    /// first point it can and stops there with [`HANDED_OFF`], for another run to go on from.
    pub hand_off: CancellationToken,
    /// How many times the request was preempted so far (bounded by `worker.max_preemptions`).
    pub preemptions: u32,
}

/// The detail of the CANCELLED result a generation that handed off ends with. It is never
/// stored: the run that goes on from its checkpoint stores the request's result.
pub const HANDED_OFF: &str = "handed off to go on from its checkpoint";

impl std::fmt::Debug for Continuity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Continuity")
            .field("checkpoints", &self.store.is_some())
            .field("from", &self.from)
            .field("hand_off", &self.hand_off.is_cancelled())
            .finish()
    }
}
