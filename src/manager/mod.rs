//! `genfleet manager`, the reference manager agent.
//!
//! It follows every signal of the fleet through a durable JetStream consumer on the signals
//! stream, prints a live log of them, and answers the decisions among them (model decision
//! requests, escalations, checkpoints: any signal with a `decision` block):
//!
//! 1. by policy rules ([`rules`]), first match wins, optionally after leaving the decision to
//!    others for a while;
//! 2. else, when enabled, by a person at the console ([`console`]), one decision at a time;
//! 3. or by a higher-level model ([`llm_pick`]) through the OpenAI-compatible client;
//! 4. else it leaves the decision to another manager (or to the decision's expiry).
//!
//! Before answering it reads the decision's record in the decisions bucket: a decision that
//! is answered, expired or gone is never answered again, which is also how a restarted manager
//! (or one of several sharing a name) avoids answering twice. The fleet's compare-and-set makes
//! sure one answer wins if two managers answer at once.
//!
//! Architecture invariant: a signal is acknowledged only once it was handled (logged, and its
//! decision answered or deliberately left); until then it is kept alive with in-progress
//! acknowledgements, and on shutdown it is handed back (nak) to the next manager of its name.
//!
//! Architecture invariant: memory is bounded. The consumer's `max_ack_pending` and a semaphore
//! of the same size bound the signals held and the decisions in progress; waiting decisions
//! (a rule's `after_ms`, the console, the model) are tasks, so they never hold up the log.

mod agent;
pub mod console;
pub mod llm_pick;
pub mod log;
pub mod rules;
pub mod view;

pub use agent::{Manager, consumer_name};
pub use console::{Console, ConsoleHandle};
pub use llm_pick::LlmPicker;
pub use log::{Log, LogSink, MemorySink, StdoutSink};
pub use rules::Policy;
pub use view::DecisionView;

/// Which signals a new consumer starts with. An existing consumer (same name) keeps its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Deliver {
    /// Every signal still in the stream, then the new ones.
    #[default]
    All,
    /// Only signals published from now on.
    New,
}

/// How a manager decides (everything beyond the settings).
pub struct ManagerOptions {
    /// Managers with one name share the signals; each name sees all of them.
    pub name: String,
    pub deliver: Deliver,
    /// Print signals and actions as JSON lines.
    pub json: bool,
    pub policy: Policy,
    /// A person at a console, and their `decided_by` (`human:<user>`).
    pub console: Option<(ConsoleHandle, String)>,
    /// A higher-level model.
    pub llm: Option<LlmPicker>,
}

impl ManagerOptions {
    /// A manager with only the given rules.
    pub fn new(name: impl Into<String>, policy: Policy) -> ManagerOptions {
        ManagerOptions {
            name: name.into(),
            deliver: Deliver::All,
            json: false,
            policy,
            console: None,
            llm: None,
        }
    }
}

/// Why a manager could not start or go on. Each renders as one line.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Connect(String),
    #[error("{0}")]
    Setup(String),
}
