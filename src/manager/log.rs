//! The manager's live log: one line per signal it sees and one per action it takes, on standard
//! output (diagnostics go to standard error through `tracing`).
//!
//! Human lines:
//!
//! ```text
//! 2026-11-22T10:00:00.000Z decision_request.NEEDS_MANAGER_DECISION med job=triage request=01JD.. "Which path?" decision=01JE.. kind=model options=[fast "Fast", safe "Safe"] default=safe
//! 2026-11-22T10:00:00.120Z   action answered decision=01JE.. request=01JD.. option=safe by=manager:ops: rule 2; continued as 01JF..
//! ```
//!
//! With `--json` every line is a JSON object: a signal exactly as published (it has
//! `signal_id`), or an action (it has `action`).

use std::io::Write;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use super::view::clipped_line;
use crate::protocol::Signal;
use crate::protocol::ids::now_rfc3339;

/// Longest summary shown on a human signal line.
const SUMMARY_CHARS: usize = 160;

/// Where log lines go. Each call writes one whole line.
pub trait LogSink: Send + Sync {
    fn write_line(&self, line: &str);
}

/// Standard output, one locked write per line so lines never tear.
pub struct StdoutSink;

impl LogSink for StdoutSink {
    fn write_line(&self, line: &str) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// Lines kept in memory (tests, embedding).
#[derive(Default, Clone)]
pub struct MemorySink {
    lines: Arc<Mutex<Vec<String>>>,
}

impl MemorySink {
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl LogSink for MemorySink {
    fn write_line(&self, line: &str) {
        self.lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(line.to_string());
    }
}

/// What the manager did about a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    /// The fleet took this manager's answer.
    Answered,
    /// Someone else had answered (seen in the record, or the same option was answered first).
    AlreadyAnswered,
    /// The fleet refused the answer with ALREADY_DECIDED: another answer won.
    AlreadyDecided,
    /// The decision expired, or its record is gone (NOT_FOUND).
    Expired,
    /// A rule waits before answering.
    Waiting,
    /// Someone answered while a rule waited.
    StoodDown,
    /// A rule said to ignore the decision.
    Ignored,
    /// Nothing here answers it; another manager (or the expiry) will.
    Left,
    /// A rule or a model named an option the decision does not have.
    InvalidAnswer,
    /// The fleet refused the answer (INVALID_OPTION, INVALID_REQUEST ...).
    Refused,
    /// The fleet or a store could not be reached; the signal comes back later.
    RetryLater,
    /// The higher-level model gave no usable answer.
    ModelFailed,
    /// Not a signal this manager can read.
    Unreadable,
}

impl ActionKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::Answered => "answered",
            ActionKind::AlreadyAnswered => "already_answered",
            ActionKind::AlreadyDecided => "already_decided",
            ActionKind::Expired => "expired",
            ActionKind::Waiting => "waiting",
            ActionKind::StoodDown => "stood_down",
            ActionKind::Ignored => "ignored",
            ActionKind::Left => "left",
            ActionKind::InvalidAnswer => "invalid_answer",
            ActionKind::Refused => "refused",
            ActionKind::RetryLater => "retry_later",
            ActionKind::ModelFailed => "model_failed",
            ActionKind::Unreadable => "unreadable",
        }
    }
}

/// One action line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Action {
    pub ts: String,
    pub action: ActionKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub option_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    pub detail: String,
}

impl Action {
    pub fn new(action: ActionKind, detail: impl Into<String>) -> Action {
        Action {
            ts: now_rfc3339(),
            action,
            decision_id: None,
            request_id: None,
            option_id: None,
            decided_by: None,
            detail: detail.into(),
        }
    }

    /// About the decision of `signal`.
    pub fn about(signal: &Signal, action: ActionKind, detail: impl Into<String>) -> Action {
        let mut a = Action::new(action, detail);
        a.decision_id = signal.decision.as_ref().map(|d| d.decision_id.clone());
        a.request_id = Some(signal.request_id.clone());
        a
    }

    pub fn option(mut self, option_id: impl Into<String>) -> Action {
        self.option_id = Some(option_id.into());
        self
    }

    pub fn by(mut self, decided_by: impl Into<String>) -> Action {
        self.decided_by = Some(decided_by.into());
        self
    }

    fn human(&self) -> String {
        let mut line = format!("{}   action {}", self.ts, self.action.as_str());
        for (key, value) in [
            ("decision", &self.decision_id),
            ("request", &self.request_id),
            ("option", &self.option_id),
            ("by", &self.decided_by),
        ] {
            if let Some(value) = value {
                line.push_str(&format!(" {key}={value}"));
            }
        }
        if !self.detail.is_empty() {
            line.push_str(": ");
            line.push_str(&clipped_line(&self.detail, 600));
        }
        line
    }
}

/// The manager's log.
#[derive(Clone)]
pub struct Log {
    sink: Arc<dyn LogSink>,
    json: bool,
}

impl Log {
    pub fn new(sink: Arc<dyn LogSink>, json: bool) -> Log {
        Log { sink, json }
    }

    pub fn signal(&self, signal: &Signal) {
        let line = if self.json {
            serde_json::to_string(signal).unwrap_or_default()
        } else {
            signal_line(signal)
        };
        self.sink.write_line(&line);
    }

    pub fn action(&self, action: Action) {
        let line = if self.json {
            serde_json::to_string(&action).unwrap_or_default()
        } else {
            action.human()
        };
        self.sink.write_line(&line);
    }

    /// A line about the manager itself (start, stop): a plain line, or `{"manager": ...}`.
    pub fn note(&self, text: &str) {
        let line = if self.json {
            serde_json::json!({"ts": now_rfc3339(), "manager": text}).to_string()
        } else {
            format!("{} manager: {text}", now_rfc3339())
        };
        self.sink.write_line(&line);
    }
}

/// The human line of a signal.
pub fn signal_line(signal: &Signal) -> String {
    let severity = serde_json::to_value(signal.severity)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let mut line = format!(
        "{} {}.{} {severity} job={} request={} {:?}",
        signal.ts,
        signal.kind.as_str(),
        signal.code,
        signal.job_name.as_deref().unwrap_or("-"),
        signal.request_id,
        clipped_line(&signal.summary, SUMMARY_CHARS),
    );
    if let Some(d) = &signal.decision {
        let options: Vec<String> = d
            .options
            .iter()
            .map(|o| format!("{} {:?}", o.id, clipped_line(&o.label, 60)))
            .collect();
        let kind = serde_json::to_value(d.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        line.push_str(&format!(
            " decision={} kind={kind} options=[{}] default={}",
            d.decision_id,
            options.join(", "),
            d.default_option.as_deref().unwrap_or("none")
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{
        DecisionBlock, DecisionKind, DecisionOption, Severity, SignalSource, SignalType,
    };

    fn signal(with_decision: bool) -> Signal {
        Signal {
            signal_id: "s1".into(),
            kind: SignalType::DecisionRequest,
            code: "NEEDS_MANAGER_DECISION".into(),
            source: SignalSource::Model,
            severity: Severity::Med,
            summary: "Which\npath?".into(),
            meta: Default::default(),
            request_id: "r1".into(),
            root_request_id: "r1".into(),
            job_name: Some("triage".into()),
            worker_id: "w1".into(),
            pool: "default".into(),
            ts: "2026-01-01T00:00:00.000Z".into(),
            decision: with_decision.then(|| DecisionBlock {
                decision_id: "d1".into(),
                question: "Which path?".into(),
                options: vec![
                    DecisionOption {
                        id: "fast".into(),
                        label: "Fast".into(),
                        pros: None,
                        cons: None,
                    },
                    DecisionOption {
                        id: "safe".into(),
                        label: "Safe".into(),
                        pros: None,
                        cons: None,
                    },
                ],
                default_option: Some("safe".into()),
                context: None,
                kind: DecisionKind::Model,
                expires_at: None,
            }),
        }
    }

    #[test]
    fn human_and_json_lines() {
        let sink = MemorySink::default();
        let log = Log::new(Arc::new(sink.clone()), false);
        log.signal(&signal(false));
        log.signal(&signal(true));
        log.action(
            Action::about(
                &signal(true),
                ActionKind::Answered,
                "rule 1; continued as c1",
            )
            .option("safe")
            .by("manager:ops"),
        );
        let lines = sink.lines();
        assert_eq!(
            lines[0],
            "2026-01-01T00:00:00.000Z decision_request.NEEDS_MANAGER_DECISION med job=triage request=r1 \"Which path?\""
        );
        assert!(
            lines[1].ends_with(
                "decision=d1 kind=model options=[fast \"Fast\", safe \"Safe\"] default=safe"
            ),
            "{}",
            lines[1]
        );
        assert!(
            lines[2].ends_with("action answered decision=d1 request=r1 option=safe by=manager:ops: rule 1; continued as c1"),
            "{}",
            lines[2]
        );
        let sink = MemorySink::default();
        let log = Log::new(Arc::new(sink.clone()), true);
        log.signal(&signal(true));
        log.action(Action::about(
            &signal(true),
            ActionKind::Left,
            "no rule matched",
        ));
        let lines = sink.lines();
        let first: Signal = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!(first, signal(true));
        let second: serde_json::Value = serde_json::from_str(&lines[1]).unwrap();
        assert_eq!(
            (second["action"].as_str(), second["decision_id"].as_str()),
            (Some("left"), Some("d1"))
        );
        assert!(second.get("option_id").is_none());
    }
}
