//! Wire types and codecs: what crosses the bus, with no I/O. Every layer shares these.

pub mod answer;
pub mod chain;
pub mod codec;
pub mod decision;
pub mod error;
pub mod event;
pub mod finished;
pub mod ids;
pub mod lru;
pub mod message;
pub mod progress;
pub mod replies;
pub mod request;
pub mod result;
pub mod schedule;
pub mod signal;
pub mod task;
pub mod text;

pub use answer::DecisionAnswer;
pub use chain::ChainState;
pub use codec::Encoding;
pub use error::{ErrorBody, ErrorCode, ErrorReply, WireError};
pub use event::{Event, EventBody};
pub use finished::FinishedSummary;
pub use message::{
    Content, FunctionCall, FunctionDefinition, FunctionTool, Message, Role, ToolCall,
};
pub use progress::Progress;
pub use replies::{Accepted, CancelReply, Capacity, StatsReply, StatusReply};
pub use request::{Checkpoint, GenerationRequest, RequestLimits, ValidationCheck};
pub use result::{
    AffinityRecord, CheckResult, GenerationResult, MoveReason, Reason, RequestState, Resumed,
    Timings, Usage, ValidationReport,
};
pub use schedule::{DEFAULT_TENANT, Priority};
pub use signal::{
    DecisionBlock, DecisionKind, DecisionOption, DecisionOutcome, Severity, Signal, SignalSource,
    SignalType,
};
