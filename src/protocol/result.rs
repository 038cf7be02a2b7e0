//! The terminal result of a request.

use serde::{Deserialize, Serialize};

use super::message::{Message, ToolCall};
use super::signal::Signal;
use super::text::floor_char_boundary;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RequestState {
    Queued,
    Running,
    Completed,
    Failed,
    Cancelled,
}

impl RequestState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RequestState::Completed | RequestState::Failed | RequestState::Cancelled
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RequestState::Queued => "QUEUED",
            RequestState::Running => "RUNNING",
            RequestState::Completed => "COMPLETED",
            RequestState::Failed => "FAILED",
            RequestState::Cancelled => "CANCELLED",
        }
    }
}

/// Why a request ended. Each reason belongs to one terminal state (see [`Reason::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Stop,
    Length,
    DecisionRequested,
    /// The model called one or more of the caller's own tools (`caller_tools`): the calls are
    /// in the result's `tool_calls`, and the caller continues with a new request holding the
    /// `tool` messages.
    ToolCalls,
    Cancelled,
    ToolExecutionError,
    ToolParseError,
    LoopDetected,
    BackendError,
    WorkerLost,
    Timeout,
    InvalidRequest,
}

impl Reason {
    pub fn state(self) -> RequestState {
        match self {
            Reason::Stop | Reason::Length | Reason::DecisionRequested | Reason::ToolCalls => {
                RequestState::Completed
            }
            Reason::Cancelled => RequestState::Cancelled,
            _ => RequestState::Failed,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Stop => "stop",
            Reason::Length => "length",
            Reason::DecisionRequested => "decision_requested",
            Reason::ToolCalls => "tool_calls",
            Reason::Cancelled => "cancelled",
            Reason::ToolExecutionError => "tool_execution_error",
            Reason::ToolParseError => "tool_parse_error",
            Reason::LoopDetected => "loop_detected",
            Reason::BackendError => "backend_error",
            Reason::WorkerLost => "worker_lost",
            Reason::Timeout => "timeout",
            Reason::InvalidRequest => "invalid_request",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Usage {
    pub fn add(&mut self, other: Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timings {
    /// From acceptance until the generation started.
    pub queued: u64,
    /// From the start of the generation until the first token of any kind; absent when none came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token: Option<u64>,
    /// From acceptance until the result.
    pub total: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
// What the fleet writes is read leniently: a reader built before a field was added still
// reads what newer workers write (requests, what callers write, stay strict).
pub struct GenerationResult {
    pub request_id: String,
    pub root_request_id: String,
    pub parent_request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    pub state: RequestState,
    pub reason: Reason,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    pub output: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reasoning: String,
    pub messages: Vec<Message>,
    pub signals: Vec<Signal>,
    pub signals_dropped: u32,
    pub tool_iterations_used: u32,
    pub usage: Usage,
    pub worker_id: String,
    pub attempt: u32,
    pub chain_position: u32,
    pub truncated: bool,
    #[serde(default)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub timings_ms: Timings,
    /// How the output fared against the request's `validation` checks (absent without checks,
    /// or when the generation did not produce a final output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<ValidationReport>,
    /// The calls of the caller's own tools the model made in its last turn, when `reason` is
    /// `tool_calls` (absent otherwise). The same calls are on the last assistant message of
    /// `messages`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Where a request with an affinity key ran against where it was sent first (absent for a
    /// request without a key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<AffinityRecord>,
    /// The tenant it ran as: the tenant token of the subject it came on (absent for the
    /// default tenant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Each move of the request to another worker, in order (at most
    /// [`MAX_MOVES_LISTED`]); absent when it ran where it started.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resumed: Vec<Resumed>,
}

/// How a request with an affinity key was placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AffinityRecord {
    pub key: String,
    /// The key's worker, as whoever placed the request saw it; absent when nobody placed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_worker: Option<String>,
    /// It ran on `preferred_worker`.
    pub held: bool,
    /// Why it went elsewhere: `busy` (no free slot on the key's worker, or it is gone) or
    /// `load` (the key's worker was over the load bound).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
}

/// The checks of a request's final output and the confidence they give.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationReport {
    /// The weighted share of checks that passed, 0.0 to 1.0.
    pub confidence: f64,
    /// The unweighted share of checks that passed, in percent.
    pub pass_rate: f64,
    /// The bar the confidence had to reach (after any `confidence_boost`).
    pub threshold: f64,
    pub passed: bool,
    pub checks: Vec<CheckResult>,
    /// The first answer fell short and the request retried on its own.
    pub retried: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    /// json_schema, regex, contains or max_chars.
    pub kind: String,
    /// What the check asks, for people (`contains "total"`).
    pub name: String,
    pub weight: f64,
    pub passed: bool,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl ValidationReport {
    /// The checks that did not pass, in their order.
    pub fn failed_checks(&self) -> impl Iterator<Item = &CheckResult> {
        self.checks.iter().filter(|c| !c.passed)
    }
}

impl GenerationResult {
    /// The result of a request that produced nothing: refused before it ran, cancelled while
    /// queued, or lost with its worker. Callers fill in what they know beyond the ids.
    pub fn empty(request_id: &str, reason: Reason, detail: String, worker_id: &str) -> Self {
        GenerationResult {
            request_id: request_id.to_string(),
            root_request_id: request_id.to_string(),
            parent_request_id: None,
            job_name: None,
            state: reason.state(),
            reason,
            detail: Some(detail),
            output: String::new(),
            reasoning: String::new(),
            messages: Vec::new(),
            signals: Vec::new(),
            signals_dropped: 0,
            tool_iterations_used: 0,
            usage: Usage::default(),
            worker_id: worker_id.to_string(),
            attempt: 0,
            chain_position: 1,
            truncated: false,
            metadata: serde_json::Map::new(),
            timings_ms: Timings::default(),
            validation: None,
            tool_calls: Vec::new(),
            affinity: None,
            tenant: None,
            resumed: Vec::new(),
        }
    }
}

/// The size of `value` as JSON, the largest of the encodings a result travels in.
fn json_len<T: Serialize>(value: &T) -> usize {
    serde_json::to_vec(value).map_or(0, |body| body.len())
}

impl GenerationResult {
    /// Makes the result fit in `max_bytes` of JSON, so that it can be stored, read and carried
    /// by its `finished` event in one NATS message: a result the server refuses would be lost.
    ///
    /// `messages` goes first, oldest first (the caller has what it sent; the latest turns
    /// explain the output), with any tool answer left without its call. Should the result
    /// still not fit, `reasoning` and then `output` lose their ends. Returns whether anything
    /// was cut; `truncated` is set when it was.
    pub fn fit_within(&mut self, max_bytes: usize) -> bool {
        let mut size = json_len(self);
        if size <= max_bytes {
            return false;
        }
        self.truncated = true;
        // One comma between array elements; the loop below settles any difference.
        let sizes: Vec<usize> = self.messages.iter().map(|m| json_len(m) + 1).collect();
        let mut dropped = 0;
        while size > max_bytes && dropped < self.messages.len() {
            size = size.saturating_sub(sizes[dropped]);
            dropped += 1;
        }
        while self
            .messages
            .get(dropped)
            .is_some_and(|m| m.role == super::message::Role::Tool)
        {
            dropped += 1;
        }
        self.messages.drain(..dropped);
        loop {
            let size = json_len(self);
            if size <= max_bytes {
                break;
            }
            // Each byte of text is at least one byte of JSON, so cutting the excess never
            // cuts too much.
            let excess = size - max_bytes;
            let text = if !self.reasoning.is_empty() {
                &mut self.reasoning
            } else if !self.output.is_empty() {
                &mut self.output
            } else {
                // What is left (signals, metadata, validation) is bounded by the limits.
                break;
            };
            text.truncate(floor_char_boundary(text, text.len().saturating_sub(excess)));
        }
        true
    }
}

/// Why a request moved to another worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveReason {
    /// Its worker stopped (killed, its node lost): found by its peers.
    WorkerLost,
    /// Its worker drained (SIGTERM: a scale-in, a rolling update) and handed it on.
    Drained,
    /// A request of a higher band took its slot; it waited and went on.
    Preempted,
}

/// One move of a request, as its result records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Resumed {
    /// The worker it left.
    pub from_worker: String,
    /// The worker that went on.
    pub to_worker: String,
    /// The completion tokens counted when it left (the checkpoint's).
    pub at_token: u64,
    /// The output's length in bytes when it left.
    pub at_output_bytes: usize,
    pub reason: MoveReason,
    /// The turn in progress was taken again from its start instead of continued (the backend
    /// cannot continue a final assistant message, or the request asks for structured output).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub turn_restarted: bool,
    /// When it went on (RFC 3339).
    pub at: String,
}

/// The most moves a result lists (the oldest are kept).
pub const MAX_MOVES_LISTED: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Reason;

    fn result(output: &str, reasoning: &str, messages: Vec<Message>) -> GenerationResult {
        let mut result = GenerationResult::empty("r1", Reason::Stop, String::new(), "w1");
        result.output = output.to_string();
        result.reasoning = reasoning.to_string();
        result.messages = messages;
        result
    }

    fn texts(result: &GenerationResult) -> Vec<String> {
        result
            .messages
            .iter()
            .map(|m| m.text().into_owned())
            .collect()
    }

    #[test]
    fn a_result_that_fits_is_left_alone() {
        let mut r = result(
            "out",
            "",
            vec![Message::user("hi"), Message::assistant("out")],
        );
        let before = r.clone();
        assert!(!r.fit_within(json_len(&r)));
        assert_eq!(r, before);
    }

    #[test]
    fn fitting_cuts_what_it_must_and_no_more() {
        let big = |c: char| c.to_string().repeat(1000);
        struct Case {
            name: &'static str,
            result: GenerationResult,
            /// Room beyond the result without its messages, output and reasoning cut.
            max: Box<dyn Fn(&GenerationResult) -> usize>,
            messages: Vec<String>,
            output_len: Option<usize>,
            reasoning_len: Option<usize>,
        }
        let bare = |r: &GenerationResult| {
            let mut r = r.clone();
            r.messages.clear();
            r.truncated = true;
            json_len(&r)
        };
        let cases = vec![
            Case {
                name: "the oldest messages go first",
                result: result(
                    "done",
                    "",
                    vec![
                        Message::user(big('a')),
                        Message::assistant(big('b')),
                        Message::user(big('c')),
                        Message::assistant("done"),
                    ],
                ),
                max: Box::new(move |r| bare(r) + 1100),
                messages: vec![big('c'), "done".into()],
                output_len: Some(4),
                reasoning_len: Some(0),
            },
            Case {
                name: "a tool answer does not stay without its call",
                result: result(
                    "done",
                    "",
                    vec![
                        Message::user(big('a')),
                        Message::assistant(big('b')),
                        Message::tool("call-1", "42"),
                        Message::assistant("done"),
                    ],
                ),
                max: Box::new(move |r| bare(r) + 100),
                messages: vec!["done".into()],
                output_len: Some(4),
                reasoning_len: Some(0),
            },
            Case {
                name: "then the reasoning loses its end",
                result: result("out", &big('r'), vec![Message::user(big('a'))]),
                max: Box::new(move |r| bare(r) - 600),
                messages: vec![],
                output_len: Some(3),
                reasoning_len: None,
            },
            Case {
                name: "then the output, on a char boundary",
                result: result(&big('é'), &big('r'), vec![Message::user("q")]),
                max: Box::new(move |r| bare(r) - 1000 - 301),
                messages: vec![],
                output_len: None,
                reasoning_len: Some(0),
            },
        ];
        for case in cases {
            let mut r = case.result.clone();
            let max = (case.max)(&r);
            assert!(r.fit_within(max), "{}: cut nothing", case.name);
            assert!(r.truncated, "{}", case.name);
            assert!(
                json_len(&r) <= max,
                "{}: {} > {max}",
                case.name,
                json_len(&r)
            );
            assert_eq!(texts(&r), case.messages, "{}", case.name);
            if let Some(len) = case.output_len {
                assert_eq!(r.output.len(), len, "{}", case.name);
            } else {
                assert!(!r.output.is_empty() && r.output.len() < case.result.output.len());
                assert!(case.result.output.starts_with(&r.output), "{}", case.name);
                // No more than the char boundary asks: one 'é' is two bytes.
                assert!(json_len(&r) + 2 > max, "{}: cut too much", case.name);
            }
            if let Some(len) = case.reasoning_len {
                assert_eq!(r.reasoning.len(), len, "{}", case.name);
            } else {
                assert!(!r.reasoning.is_empty());
                assert!(case.result.reasoning.starts_with(&r.reasoning));
                // Cut no more than needed.
                assert_eq!(json_len(&r), max, "{}: cut too much", case.name);
            }
        }
    }
}
