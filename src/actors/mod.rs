//! The worker's actor runtime (actix): a Supervisor that owns the slots and every request
//! record, and one slot actor per running request.
//!
//! Architecture invariant: this layer stays thin (messages in, lifecycle out). The engine runs
//! inside a slot as a plain future and never learns which actor framework runs it.

mod slot;
mod supervisor;

pub use supervisor::{
    Accepted, Cancel, CancelReply, Capacity, Drain, DrainReport, GetResult, MAILBOX_CAPACITY,
    Placement, Stats, StatsReply, Status, StatusReply, Submit, Supervisor, SupervisorConfig,
    SupervisorHandle, request_limits,
};
