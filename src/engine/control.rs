//! Control (exit) tools: the calls a model makes to talk to its managers rather than to act.
//! They are recorded as signals, never executed, and never consume the tool budget.

use std::sync::{Arc, OnceLock};

use serde::Deserialize;
use serde_json::json;

use crate::protocol::ids::{is_valid_name, new_id, now_rfc3339};
use crate::protocol::request::{MAX_VALUE_DEPTH, value_depth};
use crate::protocol::signal::{SIGNAL_CODES, is_valid_outcome_code};
use crate::protocol::{
    DecisionBlock, DecisionKind, DecisionOption, Severity, Signal, SignalSource, SignalType,
};
use crate::tools::{Tool, ToolDefinition};

pub const SIGNAL_ISSUE: &str = "signal_issue";
pub const REQUEST_ESCALATION: &str = "request_escalation";
pub const REQUEST_DECISION: &str = "request_decision";
pub const DECLARE_OUTCOME: &str = "declare_outcome";

pub fn is_control_tool(name: &str) -> bool {
    matches!(
        name,
        SIGNAL_ISSUE | REQUEST_ESCALATION | REQUEST_DECISION | DECLARE_OUTCOME
    )
}

/// The control tools with their schemas, compiled once per process.
pub fn control_tools() -> &'static [Arc<Tool>] {
    static TOOLS: OnceLock<Vec<Arc<Tool>>> = OnceLock::new();
    TOOLS.get_or_init(|| {
        definitions()
            .into_iter()
            .map(|d| Arc::new(Tool::new(d).expect("control tool definitions are valid")))
            .collect()
    })
}

pub fn control_tool(name: &str) -> Option<&'static Arc<Tool>> {
    control_tools().iter().find(|t| t.name() == name)
}

fn definitions() -> Vec<ToolDefinition> {
    let codes = json!(SIGNAL_CODES);
    let meta = json!({"type": "object", "description": "Small JSON object with extra facts"});
    let def = |name: &str, brief: &str, schema: serde_json::Value| ToolDefinition {
        name: name.into(),
        schema,
        brief: brief.into(),
        examples: None,
        timeout_ms: None,
    };
    vec![
        def(
            SIGNAL_ISSUE,
            "Report a problem to your managers and keep working",
            json!({
                "type": "object",
                "properties": {
                    "code": {"type": "string", "enum": codes},
                    "severity": {"type": "string", "enum": ["low", "med", "high"]},
                    "summary": {"type": "string", "minLength": 1, "maxLength": 500},
                    "meta": meta
                },
                "required": ["code", "severity", "summary"],
                "additionalProperties": false
            }),
        ),
        def(
            REQUEST_ESCALATION,
            "Ask for the task to be escalated to a stronger reasoner or a person",
            json!({
                "type": "object",
                "properties": {
                    "reason": {"type": "string", "enum": codes},
                    "summary": {"type": "string", "minLength": 1, "maxLength": 500},
                    "meta": meta
                },
                "required": ["reason", "summary"],
                "additionalProperties": false
            }),
        ),
        def(
            REQUEST_DECISION,
            "Ask your manager to choose between options, then stop",
            json!({
                "type": "object",
                "properties": {
                    "question": {"type": "string", "minLength": 1, "maxLength": 500},
                    "options": {
                        "type": "array", "minItems": 2, "maxItems": 6,
                        "items": {
                            "type": "object",
                            "properties": {
                                "id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                "label": {"type": "string", "minLength": 1, "maxLength": 200},
                                "pros": {"type": "string", "maxLength": 300},
                                "cons": {"type": "string", "maxLength": 300}
                            },
                            "required": ["id", "label"],
                            "additionalProperties": false
                        }
                    },
                    "default_option": {"type": "string"},
                    "context": {"type": "string", "maxLength": 2000},
                    "code": {"type": "string", "enum": codes},
                    "meta": meta
                },
                "required": ["question", "options"],
                "additionalProperties": false
            }),
        ),
        def(
            DECLARE_OUTCOME,
            "Declare how the task ended, as a short upper-case code",
            json!({
                "type": "object",
                "properties": {
                    "code": {"type": "string", "pattern": "^[A-Z][A-Z0-9_]{0,63}$"},
                    "summary": {"type": "string", "maxLength": 500},
                    "meta": meta
                },
                "required": ["code"],
                "additionalProperties": false
            }),
        ),
    ]
}

/// Who a signal is about, filled in by the worker.
#[derive(Debug, Clone)]
pub struct SignalOrigin<'a> {
    pub request_id: &'a str,
    pub root_request_id: &'a str,
    pub job_name: Option<&'a str>,
    pub worker_id: &'a str,
    pub pool: &'a str,
}

impl SignalOrigin<'_> {
    pub fn signal(
        &self,
        kind: SignalType,
        code: &str,
        source: SignalSource,
        severity: Severity,
        summary: String,
        meta: serde_json::Map<String, serde_json::Value>,
    ) -> Signal {
        Signal {
            signal_id: new_id(),
            kind,
            code: code.to_string(),
            source,
            severity,
            summary,
            meta,
            request_id: self.request_id.to_string(),
            root_request_id: self.root_request_id.to_string(),
            job_name: self.job_name.map(str::to_string),
            worker_id: self.worker_id.to_string(),
            pool: self.pool.to_string(),
            ts: now_rfc3339(),
            decision: None,
        }
    }
}

#[derive(Deserialize)]
struct IssueArgs {
    code: String,
    severity: Severity,
    summary: String,
    #[serde(default)]
    meta: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
struct EscalationArgs {
    reason: String,
    summary: String,
    #[serde(default)]
    meta: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
struct DecisionArgs {
    question: String,
    options: Vec<DecisionOption>,
    #[serde(default)]
    default_option: Option<String>,
    #[serde(default)]
    context: Option<String>,
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    meta: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
struct OutcomeArgs {
    code: String,
    #[serde(default)]
    summary: Option<String>,
    #[serde(default)]
    meta: serde_json::Map<String, serde_json::Value>,
}

/// Turns a control call whose arguments passed its schema into a model signal.
/// `awaits_answer` adds the decision block to a decision request (only when the generation stops
/// for it: otherwise there is nothing to answer). An error is a reason to correct the call.
pub fn to_signal(
    name: &str,
    arguments: &serde_json::Map<String, serde_json::Value>,
    origin: &SignalOrigin<'_>,
    awaits_answer: bool,
) -> Result<Signal, String> {
    let args = serde_json::Value::Object(arguments.clone());
    // Signals are published and stored inside results: their meta must stay readable there.
    let depth = value_depth(&args);
    if depth > MAX_VALUE_DEPTH {
        return Err(format!(
            "the arguments are nested {depth} levels deep; at most {MAX_VALUE_DEPTH} are allowed"
        ));
    }
    let model = SignalSource::Model;
    match name {
        SIGNAL_ISSUE => {
            let a: IssueArgs = serde_json::from_value(args).map_err(|e| e.to_string())?;
            Ok(origin.signal(
                SignalType::Issue,
                &a.code,
                model,
                a.severity,
                a.summary,
                a.meta,
            ))
        }
        REQUEST_ESCALATION => {
            let a: EscalationArgs = serde_json::from_value(args).map_err(|e| e.to_string())?;
            Ok(origin.signal(
                SignalType::Escalation,
                &a.reason,
                model,
                Severity::High,
                a.summary,
                a.meta,
            ))
        }
        REQUEST_DECISION => {
            let a: DecisionArgs = serde_json::from_value(args).map_err(|e| e.to_string())?;
            let mut ids = std::collections::HashSet::new();
            for option in &a.options {
                if !is_valid_name(&option.id) {
                    return Err(format!("option id {:?} is not a valid id", option.id));
                }
                if !ids.insert(option.id.as_str()) {
                    return Err(format!("option id {:?} is used twice", option.id));
                }
            }
            if let Some(default) = &a.default_option
                && !ids.contains(default.as_str())
            {
                return Err(format!(
                    "default_option {default:?} is not one of the option ids"
                ));
            }
            let code = a.code.as_deref().unwrap_or("NEEDS_MANAGER_DECISION");
            let mut signal = origin.signal(
                SignalType::DecisionRequest,
                code,
                model,
                Severity::Med,
                a.question.clone(),
                a.meta,
            );
            if awaits_answer {
                signal.decision = Some(DecisionBlock {
                    decision_id: new_id(),
                    question: a.question,
                    options: a.options,
                    default_option: a.default_option,
                    context: a.context,
                    kind: DecisionKind::Model,
                    expires_at: None,
                });
            } else {
                signal.meta.insert("options".into(), json!(a.options));
                if let Some(context) = a.context {
                    signal.meta.insert("context".into(), json!(context));
                }
            }
            Ok(signal)
        }
        DECLARE_OUTCOME => {
            let a: OutcomeArgs = serde_json::from_value(args).map_err(|e| e.to_string())?;
            if !is_valid_outcome_code(&a.code) {
                return Err(format!(
                    "outcome code {:?} must match ^[A-Z][A-Z0-9_]{{0,63}}$",
                    a.code
                ));
            }
            Ok(origin.signal(
                SignalType::Outcome,
                &a.code,
                model,
                Severity::Low,
                a.summary.unwrap_or_default(),
                a.meta,
            ))
        }
        other => Err(format!("{other} is not a control tool")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> SignalOrigin<'static> {
        SignalOrigin {
            request_id: "r",
            root_request_id: "root",
            job_name: Some("job"),
            worker_id: "w",
            pool: "p",
        }
    }

    fn args(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn schemas_accept_good_and_refuse_bad_calls() {
        let cases = [
            (
                SIGNAL_ISSUE,
                json!({"code": "POLICY_RISK", "severity": "high", "summary": "s"}),
                true,
            ),
            (
                SIGNAL_ISSUE,
                json!({"code": "MADE_UP", "severity": "high", "summary": "s"}),
                false,
            ),
            (
                SIGNAL_ISSUE,
                json!({"code": "POLICY_RISK", "severity": "urgent", "summary": "s"}),
                false,
            ),
            (
                REQUEST_ESCALATION,
                json!({"reason": "NEEDS_HIGHER_REASONER", "summary": "s"}),
                true,
            ),
            (
                REQUEST_DECISION,
                json!({"question": "q", "options": [{"id": "a", "label": "A"}]}),
                false,
            ),
            (
                REQUEST_DECISION,
                json!({"question": "q", "options": [{"id": "a", "label": "A"}, {"id": "b", "label": "B", "pros": "p"}]}),
                true,
            ),
            (
                REQUEST_DECISION,
                json!({"question": "q", "options": [{"id": "a", "label": "A"}, {"id": "b", "label": "B"}], "extra": 1}),
                false,
            ),
            (DECLARE_OUTCOME, json!({"code": "DONE"}), true),
            (DECLARE_OUTCOME, json!({"code": "done"}), false),
        ];
        for (name, arguments, ok) in cases {
            let errors = control_tool(name).unwrap().check_arguments(&arguments);
            assert_eq!(errors.is_empty(), ok, "{name} {arguments}: {errors:?}");
        }
    }

    #[test]
    fn decision_requests_carry_a_decision_block_only_when_awaited() {
        let a = args(
            json!({"question": "Which?", "options": [{"id": "a", "label": "A"}, {"id": "b", "label": "B"}], "default_option": "b", "context": "ctx"}),
        );
        let signal = to_signal(REQUEST_DECISION, &a, &origin(), true).unwrap();
        assert_eq!(signal.kind, SignalType::DecisionRequest);
        assert_eq!(signal.code, "NEEDS_MANAGER_DECISION");
        assert_eq!(signal.root_request_id, "root");
        let decision = signal.decision.unwrap();
        assert_eq!(decision.default_option.as_deref(), Some("b"));
        assert_eq!(decision.kind, DecisionKind::Model);
        let signal = to_signal(REQUEST_DECISION, &a, &origin(), false).unwrap();
        assert!(signal.decision.is_none());
        assert_eq!(signal.meta["options"][1]["id"], "b");

        let bad = args(
            json!({"question": "Which?", "options": [{"id": "a", "label": "A"}, {"id": "a", "label": "B"}]}),
        );
        assert!(
            to_signal(REQUEST_DECISION, &bad, &origin(), true)
                .unwrap_err()
                .contains("twice")
        );
        let bad = args(
            json!({"question": "Which?", "options": [{"id": "a", "label": "A"}, {"id": "b", "label": "B"}], "default_option": "c"}),
        );
        assert!(
            to_signal(REQUEST_DECISION, &bad, &origin(), true)
                .unwrap_err()
                .contains("default_option")
        );
    }

    #[test]
    fn other_control_tools_map_to_their_signal_types() {
        let s = to_signal(
            REQUEST_ESCALATION,
            &args(json!({"reason": "NEEDS_EXTERNAL_INFO", "summary": "s"})),
            &origin(),
            true,
        )
        .unwrap();
        assert_eq!(
            (s.kind, s.code.as_str()),
            (SignalType::Escalation, "NEEDS_EXTERNAL_INFO")
        );
        let s = to_signal(
            DECLARE_OUTCOME,
            &args(json!({"code": "SHIPPED", "summary": "ok"})),
            &origin(),
            true,
        )
        .unwrap();
        assert_eq!(
            (s.kind, s.code.as_str(), s.severity),
            (SignalType::Outcome, "SHIPPED", Severity::Low)
        );
        let s = to_signal(SIGNAL_ISSUE, &args(json!({"code": "POLICY_RISK", "severity": "high", "summary": "s", "meta": {"k": 1}})), &origin(), true).unwrap();
        assert_eq!(
            (s.kind, s.source, s.meta["k"].as_i64()),
            (SignalType::Issue, SignalSource::Model, Some(1))
        );
    }

    #[test]
    fn meta_nested_too_deep_is_a_reason_to_correct_the_call() {
        let mut deep = json!(1);
        for _ in 0..MAX_VALUE_DEPTH {
            deep = json!([deep]);
        }
        let a = args(json!({"code": "DONE", "meta": {"k": deep}}));
        let err = to_signal(DECLARE_OUTCOME, &a, &origin(), true).unwrap_err();
        assert!(err.contains("nested"), "{err}");
        let a = args(json!({"code": "DONE", "meta": {"k": [[1]]}}));
        to_signal(DECLARE_OUTCOME, &a, &origin(), true).unwrap();
    }
}
