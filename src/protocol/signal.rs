//! Signals: small structured records a worker publishes for managers (issues, escalations,
//! decision requests, outcomes).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SignalType {
    Issue,
    Escalation,
    DecisionRequest,
    Outcome,
}

impl SignalType {
    pub fn as_str(self) -> &'static str {
        match self {
            SignalType::Issue => "issue",
            SignalType::Escalation => "escalation",
            SignalType::DecisionRequest => "decision_request",
            SignalType::Outcome => "outcome",
        }
    }
}

/// Who raised a signal. Worker signals are never dropped by the per-request bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SignalSource {
    Model,
    Worker,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Low,
    Med,
    High,
}

/// The codes of issue, escalation and decision_request signals.
pub const SIGNAL_CODES: &[&str] = &[
    "NEEDS_MANAGER_DECISION",
    "NEEDS_EXTERNAL_INFO",
    "NEEDS_HIGHER_REASONER",
    "TOOL_LIMIT_REACHED",
    "LOW_CONFIDENCE",
    "LOOP_DETECTED",
    "MAX_TOKENS_REACHED",
    "POLICY_RISK",
    "CHECKPOINT",
];

/// Outcome codes are free-form but must look like `^[A-Z][A-Z0-9_]{0,63}$`.
pub fn is_valid_outcome_code(code: &str) -> bool {
    let bytes = code.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 64
        && bytes[0].is_ascii_uppercase()
        && bytes
            .iter()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || *b == b'_')
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionOption {
    pub id: String,
    pub label: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pros: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cons: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionKind {
    Model,
    Escalation,
    Checkpoint,
}

/// What became of a decision, for the chain it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionOutcome {
    /// Not answered yet (only in a request's status).
    Pending,
    /// Answered; a continuation request was started.
    Continued,
    /// Answered `skip`: the chain ended there.
    Skipped,
    /// Answered `abort`: the chain ended there.
    Aborted,
    /// Nobody answered in time (or the caller cancelled): the chain ended there.
    Expired,
}

impl DecisionOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionOutcome::Pending => "pending",
            DecisionOutcome::Continued => "continued",
            DecisionOutcome::Skipped => "skipped",
            DecisionOutcome::Aborted => "aborted",
            DecisionOutcome::Expired => "expired",
        }
    }

    /// The code of the outcome signal that announces it.
    pub fn signal_code(self) -> &'static str {
        match self {
            DecisionOutcome::Pending | DecisionOutcome::Continued => "DECIDED",
            DecisionOutcome::Skipped => "SKIPPED",
            DecisionOutcome::Aborted => "ABORTED",
            DecisionOutcome::Expired => "DECISION_EXPIRED",
        }
    }
}

/// Present on every signal that awaits an answer on `decisions.<decision_id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
// What the fleet writes is read leniently: a reader built before a field was added still
// reads what newer workers write (requests, what callers write, stay strict).
pub struct DecisionBlock {
    pub decision_id: String,
    pub question: String,
    pub options: Vec<DecisionOption>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_option: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    pub kind: DecisionKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
// What the fleet writes is read leniently: a reader built before a field was added still
// reads what newer workers write (requests, what callers write, stay strict).
pub struct Signal {
    pub signal_id: String,
    #[serde(rename = "type")]
    pub kind: SignalType,
    pub code: String,
    pub source: SignalSource,
    pub severity: Severity,
    pub summary: String,
    #[serde(default)]
    pub meta: serde_json::Map<String, serde_json::Value>,
    pub request_id: String,
    pub root_request_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    pub worker_id: String,
    pub pool: String,
    pub ts: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<DecisionBlock>,
}

impl Signal {
    /// The subject suffix `<type>.<code>` under the signals prefix.
    pub fn subject_suffix(&self) -> String {
        format!("{}.{}", self.kind.as_str(), self.code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_codes() {
        for (code, ok) in [
            ("DECIDED", true),
            ("A", true),
            ("A1_B", true),
            ("a", false),
            ("1A", false),
            ("", false),
            ("A-B", false),
        ] {
            assert_eq!(is_valid_outcome_code(code), ok, "{code}");
        }
        assert!(is_valid_outcome_code(&format!("A{}", "B".repeat(63))));
        assert!(!is_valid_outcome_code(&format!("A{}", "B".repeat(64))));
    }
}
