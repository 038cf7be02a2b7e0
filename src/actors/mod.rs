//! The worker's actor runtime (actix): a Supervisor that owns the slots and every request
//! record, and one slot actor per running request.
//!
//! Architecture invariant: this layer stays thin (messages in, lifecycle out). The engine runs
//! inside a slot as a plain future and never learns which actor framework runs it.

mod slot;
mod supervisor;

pub use supervisor::{
    Cancel, Canceller, CheckedRequest, Drain, DrainReport, Fence, GetResult, Held, HeldRequest,
    MAILBOX_CAPACITY, Pause, Placement, Release, Released, RequestChecker, Stats, Status, Submit,
    Supervisor, SupervisorConfig, SupervisorHandle, TenantSlots, Ticket, TicketOf, request_limits,
};
// The wire replies the Supervisor's messages answer with.
pub use crate::protocol::{Accepted, CancelReply, Capacity, StatsReply, StatusReply};
