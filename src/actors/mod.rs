//! The worker's actor runtime (actix): a Supervisor that owns the slots and every request
//! record, and one slot actor per running request.
//!
//! Architecture invariant: this layer stays thin (messages in, lifecycle out). The engine runs
//! inside a slot as a plain future and never learns which actor framework runs it.
//!
//! The files' imports run one way: `messages` (what is asked and answered) and `checker` name
//! no actor; `slot` knows only `messages`; the `supervisor` knows all three.

mod checker;
mod messages;
mod slot;
mod supervisor;

pub use checker::{CheckedRequest, RequestChecker, request_limits};
pub use messages::{
    Cancel, Canceller, Drain, DrainReport, Fence, GetResult, Held, HeldRequest, Lineage, Pause,
    Placement, Release, Released, Scheduling, Stats, Status, Submit, TenantSlots, Ticket, TicketOf,
};
pub use supervisor::{MAILBOX_CAPACITY, Supervisor, SupervisorConfig, SupervisorHandle};
// The wire replies the Supervisor's messages answer with.
pub use crate::protocol::{Accepted, CancelReply, Capacity, StatsReply, StatusReply};
