//! A request followed to its end with nobody streaming it (a background response, a batch's
//! line): its steps gathered into what it produced and how it ended, the same way a
//! [`super::run::Run`] hands them to a caller (a decision chain's parts set apart, usage summed
//! over the chain, a part that waits on a decision followed to its continuation).

use super::mapping::{Ending, ending_of, ending_of_chain};
use super::responses::wire::Produced;
use super::run::CHAIN_SEPARATOR;
use crate::client::{Lost, Step};
use crate::protocol::Reason;
use crate::protocol::result::Usage;

/// What a step meant.
#[derive(Debug)]
pub enum Collected {
    /// More to come.
    Going,
    /// The chain ended. `release`: the request whose stored result to release once the end is
    /// kept.
    Ended {
        ending: Ending,
        message: String,
        release: Option<String>,
    },
    /// The bus went away: nothing is known of the end.
    Abandoned,
}

/// The steps of one chain, gathered.
#[derive(Debug, Default)]
pub struct Collector {
    pub produced: Produced,
    pub usage: Usage,
    separate: bool,
    through_decisions: bool,
}

impl Collector {
    pub fn new(through_decisions: bool) -> Collector {
        Collector {
            through_decisions,
            ..Default::default()
        }
    }

    pub fn take(&mut self, step: Step) -> Collected {
        match step {
            Step::Text(text) => {
                if std::mem::take(&mut self.separate) && !self.produced.text.is_empty() {
                    self.produced.text.push_str(CHAIN_SEPARATOR);
                }
                self.produced.text.push_str(&text);
            }
            Step::Reasoning(text) => self.produced.reasoning.push_str(&text),
            Step::Continued { .. } => self.separate = true,
            Step::Ended(result) => {
                self.usage.add(result.usage);
                let waits = result.reason == Reason::DecisionRequested
                    && self.through_decisions
                    && result.signals.iter().any(|s| s.decision.is_some());
                if waits {
                    return Collected::Going;
                }
                self.produced.tool_calls = result.tool_calls.clone();
                let message = result
                    .detail
                    .clone()
                    .unwrap_or_else(|| format!("the request ended {}", result.reason.as_str()));
                return Collected::Ended {
                    ending: ending_of(result.reason),
                    message,
                    release: Some(result.request_id),
                };
            }
            Step::ChainEnded { outcome } => {
                return Collected::Ended {
                    ending: Ending::Finish(ending_of_chain(outcome)),
                    message: "the decision ended the chain".into(),
                    release: None,
                };
            }
            Step::Lost(Lost::BusClosed) => return Collected::Abandoned,
            Step::Lost(Lost::Result(message) | Lost::Continuation(message)) => {
                return Collected::Ended {
                    ending: Ending::Error {
                        status: 502,
                        kind: "server_error",
                        code: "result_unavailable",
                    },
                    message,
                    release: None,
                };
            }
            Step::Started { .. } | Step::ToolCall { .. } | Step::ToolResult { .. } => {}
        }
        Collected::Going
    }
}
