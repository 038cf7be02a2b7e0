//! The terminal result of a request.

use serde::{Deserialize, Serialize};

use super::message::Message;
use super::signal::Signal;

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
            Reason::Stop | Reason::Length | Reason::DecisionRequested => RequestState::Completed,
            Reason::Cancelled => RequestState::Cancelled,
            _ => RequestState::Failed,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Stop => "stop",
            Reason::Length => "length",
            Reason::DecisionRequested => "decision_requested",
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
        }
    }
}
