//! A finished request's summary, for people: what the console's request page, `genfleet status`
//! and the requests list show after the caller has read (and so released) the result.
//!
//! Workers keep one per finished request in the `jetstream.finished_bucket` key-value bucket
//! (key `fin.<request_id>`), bounded by age and count. It is read-only for everyone else and
//! separate from the result, which callers read once.

use serde::{Deserialize, Serialize};

use super::text::clip_chars;
use super::{GenerationResult, Reason, RequestState, Role, Timings, Usage};

/// Characters of the prompt's first user message kept.
pub const PROMPT_START_CHARS: usize = 200;
/// Characters of the output kept.
pub const OUTPUT_START_CHARS: usize = 500;
/// Characters of the detail kept.
pub const DETAIL_CHARS: usize = 1000;
/// Signal codes kept (the result's own list is bounded too).
pub const SIGNALS_KEPT: usize = 16;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinishedSummary {
    pub request_id: String,
    pub root_request_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    pub chain_position: u32,
    pub state: RequestState,
    pub reason: Reason,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    pub worker_id: String,
    pub attempt: u32,
    pub usage: Usage,
    pub timings_ms: Timings,
    pub tool_iterations_used: u32,
    /// `<type>.<code>` of each signal the request raised, oldest first.
    #[serde(default)]
    pub signals: Vec<String>,
    /// The decision it asked for, when it ended `decision_requested`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    /// When the worker stored the result (RFC 3339, UTC); absent in a summary made from the
    /// result itself in the moment before it is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// The opening of the first user message.
    #[serde(default)]
    pub prompt_start: String,
    /// The opening of the output.
    #[serde(default)]
    pub output_start: String,
    /// The whole output's length in characters.
    #[serde(default)]
    pub output_chars: usize,
}

impl FinishedSummary {
    /// The summary of `result`, finished at `finished_at`.
    pub fn of(result: &GenerationResult, finished_at: Option<String>) -> FinishedSummary {
        let prompt = result
            .messages
            .iter()
            .find(|m| m.role == Role::User)
            .map(|m| m.text().into_owned())
            .unwrap_or_default();
        FinishedSummary {
            request_id: result.request_id.clone(),
            root_request_id: result.root_request_id.clone(),
            parent_request_id: result.parent_request_id.clone(),
            job_name: result.job_name.clone(),
            chain_position: result.chain_position,
            state: result.state,
            reason: result.reason,
            detail: result
                .detail
                .as_deref()
                .map(|d| clip_chars(d, DETAIL_CHARS)),
            worker_id: result.worker_id.clone(),
            attempt: result.attempt,
            usage: result.usage,
            timings_ms: result.timings_ms,
            tool_iterations_used: result.tool_iterations_used,
            signals: result
                .signals
                .iter()
                .take(SIGNALS_KEPT)
                .map(|s| s.subject_suffix())
                .collect(),
            decision_id: (result.reason == Reason::DecisionRequested)
                .then(|| {
                    result
                        .signals
                        .iter()
                        .rev()
                        .find_map(|s| s.decision.as_ref().map(|d| d.decision_id.clone()))
                })
                .flatten(),
            finished_at,
            prompt_start: clip_chars(&prompt, PROMPT_START_CHARS),
            output_start: clip_chars(&result.output, OUTPUT_START_CHARS),
            output_chars: result.output.chars().count(),
        }
    }
}

/// The first `max` characters of `text`, with `…` when there was more: the name callers knew
/// before the cuts moved to [`super::text`].
pub use super::text::clip_chars as opening;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Message;

    #[test]
    fn a_summary_keeps_the_openings_and_the_links() {
        let mut result = GenerationResult::empty(
            "r2",
            Reason::BackendError,
            "x".repeat(DETAIL_CHARS + 10),
            "w1",
        );
        result.root_request_id = "r1".into();
        result.parent_request_id = Some("r1".into());
        result.chain_position = 2;
        result.output = "é".repeat(OUTPUT_START_CHARS + 1);
        result.messages = vec![
            Message::system("be brief"),
            Message::user("what is 2 + 2?"),
            Message::user("ignored"),
        ];
        let summary = FinishedSummary::of(&result, Some("2026-11-24T10:00:00Z".into()));
        assert_eq!(summary.state, RequestState::Failed);
        assert_eq!(summary.prompt_start, "what is 2 + 2?");
        assert_eq!(summary.output_chars, OUTPUT_START_CHARS + 1);
        assert_eq!(
            summary.output_start,
            format!("{}…", "é".repeat(OUTPUT_START_CHARS))
        );
        assert_eq!(
            summary.detail.as_deref().map(|d| d.chars().count()),
            Some(DETAIL_CHARS + 1)
        );
        assert_eq!(
            (summary.root_request_id.as_str(), summary.chain_position),
            ("r1", 2)
        );
        assert_eq!(summary.parent_request_id.as_deref(), Some("r1"));
        assert_eq!(summary.decision_id, None);
    }
}
