//! Policy rules: a TOML file of `[[rule]]` tables saying which decisions the manager answers by
//! itself, with which option, and how long it first leaves them to others.
//!
//! ```toml
//! [[rule]]
//! code = "NEEDS_MANAGER_DECISION"   # conditions: all optional, all must hold
//! job_name = "nightly-*"
//! answer = "default"                 # or an option id
//! after_ms = 30000                   # leave it to others this long (from the signal's ts)
//! rationale = "nightly jobs take the safe path"
//!
//! [[rule]]
//! type = "escalation"
//! action = "ignore"                  # log only
//! ```
//!
//! The first rule whose conditions all hold decides. The file is checked when it is loaded:
//! an unknown key, a misspelt value or a rule without an action is an error naming the rule
//! (1-based) and the key. Whether `answer` names an option of the decision can only be known
//! when the decision arrives; see [`Verdict::InvalidOption`].

use std::path::Path;

use serde_json::{Map, Value};

use crate::protocol::signal::is_valid_outcome_code;
use crate::protocol::text::one_line;
use crate::protocol::{DecisionBlock, DecisionKind, Signal, SignalType};

/// The option a rule answers with.
#[derive(Debug, Clone, PartialEq)]
pub enum OptionChoice {
    /// The decision's `default_option`; a decision without one is not answered by the rule.
    Default,
    Id(String),
}

/// What a rule sends when it answers.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerSpec {
    pub option: OptionChoice,
    /// Wait this long after the signal was raised before answering, standing down if someone
    /// else answered meanwhile.
    pub after_ms: Option<u64>,
    pub rationale: Option<String>,
    pub guidance: Option<String>,
    pub modified_prompt: Option<String>,
    pub confidence_boost: Option<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RuleAction {
    /// Log the decision and leave it (to other managers, or to its expiry).
    Ignore,
    Answer(AnswerSpec),
}

/// Conditions of a rule; `None` and empty tables hold for every decision.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Conditions {
    pub signal_type: Option<SignalType>,
    pub code: Option<String>,
    pub kind: Option<DecisionKind>,
    /// Exact, or a glob where `*` stands for any run of characters.
    pub job_name: Option<String>,
    pub pool: Option<String>,
    /// Each key must equal the signal's `meta` value.
    pub meta: Map<String, Value>,
    /// Each key must equal the asking request's `metadata` value.
    pub metadata: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// 1-based position in the file, for log lines and errors.
    pub index: usize,
    pub when: Conditions,
    pub action: RuleAction,
}

/// The rules of a policy file, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Policy {
    rules: Vec<Rule>,
}

/// What the policy says about one decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict<'a> {
    /// No rule applies.
    NoMatch,
    Ignore {
        rule: usize,
    },
    Answer {
        rule: usize,
        option_id: String,
        spec: &'a AnswerSpec,
    },
    /// The first matching rule names an option this decision does not have.
    InvalidOption {
        rule: usize,
        option_id: String,
        valid: Vec<String>,
    },
}

/// A policy file that cannot be used, as one line naming the rule and the key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct RulesError(pub String);

/// The keys of a rule as written in the file.
struct RuleSpec {
    signal_type: Option<SignalType>,
    code: Option<String>,
    kind: Option<DecisionKind>,
    job_name: Option<String>,
    pool: Option<String>,
    meta: Option<toml::Table>,
    metadata: Option<toml::Table>,
    answer: Option<String>,
    after_ms: Option<u64>,
    rationale: Option<String>,
    guidance: Option<String>,
    modified_prompt: Option<String>,
    confidence_boost: Option<f64>,
    action: Option<String>,
}

/// The keys a rule may have.
const RULE_KEYS: &[&str] = &[
    "type",
    "code",
    "kind",
    "job_name",
    "pool",
    "meta",
    "metadata",
    "answer",
    "after_ms",
    "rationale",
    "guidance",
    "modified_prompt",
    "confidence_boost",
    "action",
];

/// The value of `key` in a rule, as `T`; the error names the key.
fn field<T: serde::de::DeserializeOwned>(
    table: &toml::Table,
    key: &str,
) -> Result<Option<T>, String> {
    table
        .get(key)
        .map(|value| {
            value
                .clone()
                .try_into::<T>()
                .map_err(|e| format!("{key}: {}", one_line(e.message()).trim_end_matches('.')))
        })
        .transpose()
}

impl Policy {
    /// No rules: every decision goes on to the other modes.
    pub fn empty() -> Policy {
        Policy::default()
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    pub fn load(path: &Path) -> Result<Policy, RulesError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| RulesError(format!("cannot read rules file {}: {e}", path.display())))?;
        Policy::from_toml_str(&text)
            .map_err(|e| RulesError(format!("rules file {}: {}", path.display(), e.0)))
    }

    pub fn from_toml_str(text: &str) -> Result<Policy, RulesError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| {
            let place = e
                .span()
                .map(|span| {
                    let line = text[..span.start.min(text.len())].lines().count().max(1);
                    format!("line {line}: ")
                })
                .unwrap_or_default();
            RulesError(format!("{place}{}", one_line(e.message())))
        })?;
        let mut rules = Vec::new();
        for (key, value) in table {
            if key != "rule" {
                return Err(RulesError(format!(
                    "unknown top-level key `{key}` (rules are [[rule]] tables)"
                )));
            }
            let toml::Value::Array(items) = value else {
                return Err(RulesError(
                    "`rule` must be an array of tables: write each rule as [[rule]]".into(),
                ));
            };
            for (i, item) in items.into_iter().enumerate() {
                rules.push(Rule::from_value(i + 1, item)?);
            }
        }
        Ok(Policy { rules })
    }

    /// The first rule whose conditions hold for this decision, and what it says.
    /// `metadata` is the asking request's metadata (from the decision's record).
    pub fn evaluate(
        &self,
        signal: &Signal,
        decision: &DecisionBlock,
        metadata: &Map<String, Value>,
    ) -> Verdict<'_> {
        for rule in &self.rules {
            if !rule.when.hold(signal, decision, metadata) {
                continue;
            }
            let spec = match &rule.action {
                RuleAction::Ignore => return Verdict::Ignore { rule: rule.index },
                RuleAction::Answer(spec) => spec,
            };
            let option_id = match &spec.option {
                OptionChoice::Default => match &decision.default_option {
                    Some(default) => default.clone(),
                    // Without a default the rule does not apply: the next one may.
                    None => continue,
                },
                OptionChoice::Id(id) => id.clone(),
            };
            if !decision.options.iter().any(|o| o.id == option_id) {
                return Verdict::InvalidOption {
                    rule: rule.index,
                    option_id,
                    valid: decision.options.iter().map(|o| o.id.clone()).collect(),
                };
            }
            return Verdict::Answer {
                rule: rule.index,
                option_id,
                spec,
            };
        }
        Verdict::NoMatch
    }
}

impl Rule {
    fn from_value(index: usize, value: toml::Value) -> Result<Rule, RulesError> {
        let fail = |msg: String| RulesError(format!("rule {index}: {msg}"));
        let toml::Value::Table(table) = value else {
            return Err(fail("must be a table ([[rule]])".into()));
        };
        if let Some(unknown) = table.keys().find(|k| !RULE_KEYS.contains(&k.as_str())) {
            return Err(fail(format!(
                "unknown key `{unknown}` (known: {})",
                RULE_KEYS.join(", ")
            )));
        }
        let spec = RuleSpec {
            signal_type: field(&table, "type").map_err(fail)?,
            code: field(&table, "code").map_err(fail)?,
            kind: field(&table, "kind").map_err(fail)?,
            job_name: field(&table, "job_name").map_err(fail)?,
            pool: field(&table, "pool").map_err(fail)?,
            meta: field(&table, "meta").map_err(fail)?,
            metadata: field(&table, "metadata").map_err(fail)?,
            answer: field(&table, "answer").map_err(fail)?,
            after_ms: field(&table, "after_ms").map_err(fail)?,
            rationale: field(&table, "rationale").map_err(fail)?,
            guidance: field(&table, "guidance").map_err(fail)?,
            modified_prompt: field(&table, "modified_prompt").map_err(fail)?,
            confidence_boost: field(&table, "confidence_boost").map_err(fail)?,
            action: field(&table, "action").map_err(fail)?,
        };
        if let Some(code) = &spec.code
            && !is_valid_outcome_code(code)
        {
            return Err(fail(format!(
                "code: {code:?} is not a signal code (A-Z, 0-9 and '_', starting with a letter)"
            )));
        }
        let when = Conditions {
            signal_type: spec.signal_type,
            code: spec.code,
            kind: spec.kind,
            job_name: spec.job_name,
            pool: spec.pool,
            meta: spec.meta.map(table_to_json).unwrap_or_default(),
            metadata: spec.metadata.map(table_to_json).unwrap_or_default(),
        };
        let action = match (spec.answer, spec.action.as_deref()) {
            (Some(_), Some(_)) => {
                return Err(fail(
                    "set either `answer` or `action = \"ignore\"`, not both".into(),
                ));
            }
            (None, None) => {
                return Err(fail(
                    "has no action: set `answer = \"<option id>\"`, `answer = \"default\"` or `action = \"ignore\"`".into(),
                ));
            }
            (None, Some("ignore")) => {
                for (key, set) in [
                    ("after_ms", spec.after_ms.is_some()),
                    ("rationale", spec.rationale.is_some()),
                    ("guidance", spec.guidance.is_some()),
                    ("modified_prompt", spec.modified_prompt.is_some()),
                    ("confidence_boost", spec.confidence_boost.is_some()),
                ] {
                    if set {
                        return Err(fail(format!("{key}: applies only to rules with `answer`")));
                    }
                }
                RuleAction::Ignore
            }
            (None, Some(other)) => {
                return Err(fail(format!(
                    "action: unknown action {other:?} (the only action is \"ignore\"; to answer, set `answer`)"
                )));
            }
            (Some(answer), None) => {
                if answer.trim().is_empty() {
                    return Err(fail("answer: must name an option id or \"default\"".into()));
                }
                if let Some(boost) = spec.confidence_boost
                    && !(0.0..=1.0).contains(&boost)
                {
                    return Err(fail(format!(
                        "confidence_boost: {boost} must be a number from 0 to 1"
                    )));
                }
                let option = if answer == "default" {
                    OptionChoice::Default
                } else {
                    OptionChoice::Id(answer)
                };
                RuleAction::Answer(AnswerSpec {
                    option,
                    after_ms: spec.after_ms,
                    rationale: spec.rationale,
                    guidance: spec.guidance,
                    modified_prompt: spec.modified_prompt,
                    confidence_boost: spec.confidence_boost,
                })
            }
        };
        Ok(Rule {
            index,
            when,
            action,
        })
    }
}

impl Conditions {
    fn hold(
        &self,
        signal: &Signal,
        decision: &DecisionBlock,
        metadata: &Map<String, Value>,
    ) -> bool {
        self.signal_type.is_none_or(|t| t == signal.kind)
            && self.code.as_ref().is_none_or(|c| *c == signal.code)
            && self.kind.is_none_or(|k| k == decision.kind)
            && self.job_name.as_ref().is_none_or(|pattern| {
                signal
                    .job_name
                    .as_deref()
                    .is_some_and(|name| glob_match(pattern, name))
            })
            && self.pool.as_ref().is_none_or(|p| *p == signal.pool)
            && subset_of(&self.meta, &signal.meta)
            && subset_of(&self.metadata, metadata)
    }
}

/// Every key of `wanted` is in `actual` with an equal value.
fn subset_of(wanted: &Map<String, Value>, actual: &Map<String, Value>) -> bool {
    wanted
        .iter()
        .all(|(key, value)| actual.get(key).is_some_and(|have| json_eq(value, have)))
}

/// JSON equality where numbers compare by value: TOML's `1` and `1.0` both equal JSON's `1`.
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) => x == y,
            _ => x == y,
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_eq(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

/// `*` stands for any run of characters (none included); everything else is literal.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let pattern: Vec<char> = pattern.chars().collect();
    let text: Vec<char> = text.chars().collect();
    let (mut p, mut t) = (0, 0);
    // Where the last `*` was, and the text position it has swallowed up to.
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && pattern[p] == '*' {
            star = Some((p, t));
            p += 1;
        } else if p < pattern.len() && pattern[p] == text[t] {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            // Let the star swallow one more character and try again.
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|c| *c == '*')
}

fn table_to_json(table: toml::Table) -> Map<String, Value> {
    table
        .into_iter()
        .map(|(k, v)| (k, toml_to_json(v)))
        .collect()
}

fn toml_to_json(value: toml::Value) -> Value {
    match value {
        toml::Value::String(s) => Value::String(s),
        toml::Value::Integer(i) => Value::from(i),
        toml::Value::Float(f) => Value::from(f),
        toml::Value::Boolean(b) => Value::Bool(b),
        // Signals carry times as RFC 3339 strings.
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(items) => Value::Array(items.into_iter().map(toml_to_json).collect()),
        toml::Value::Table(t) => Value::Object(table_to_json(t)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{DecisionOption, Severity, SignalSource};
    use serde_json::json;

    fn signal(kind: SignalType, code: &str, job: Option<&str>, meta: Value) -> Signal {
        Signal {
            signal_id: "s1".into(),
            kind,
            code: code.into(),
            source: SignalSource::Model,
            severity: Severity::Med,
            summary: "which?".into(),
            meta: meta.as_object().cloned().unwrap_or_default(),
            request_id: "r1".into(),
            root_request_id: "r1".into(),
            job_name: job.map(str::to_string),
            worker_id: "w1".into(),
            pool: "default".into(),
            ts: "2026-01-01T00:00:00.000Z".into(),
            decision: None,
        }
    }

    fn decision(kind: DecisionKind, ids: &[&str], default: Option<&str>) -> DecisionBlock {
        DecisionBlock {
            decision_id: "d1".into(),
            question: "Which?".into(),
            options: ids
                .iter()
                .map(|id| DecisionOption {
                    id: id.to_string(),
                    label: id.to_uppercase(),
                    pros: None,
                    cons: None,
                })
                .collect(),
            default_option: default.map(str::to_string),
            context: None,
            kind,
            expires_at: None,
        }
    }

    /// The rule index and option a policy picks (`None`: no match; option `"!ignore"` for an
    /// ignore rule, `"!invalid:<id>"` for an answer that is not an option).
    fn check(
        rules: &str,
        s: &Signal,
        d: &DecisionBlock,
        metadata: Value,
    ) -> Option<(usize, String)> {
        let policy = Policy::from_toml_str(rules).unwrap();
        let metadata = metadata.as_object().cloned().unwrap_or_default();
        match policy.evaluate(s, d, &metadata) {
            Verdict::NoMatch => None,
            Verdict::Ignore { rule } => Some((rule, "!ignore".into())),
            Verdict::Answer {
                rule, option_id, ..
            } => Some((rule, option_id)),
            Verdict::InvalidOption {
                rule, option_id, ..
            } => Some((rule, format!("!invalid:{option_id}"))),
        }
    }

    #[test]
    fn the_first_matching_rule_decides() {
        let rules = r#"
[[rule]]
type = "escalation"
action = "ignore"

[[rule]]
code = "POLICY_RISK"
answer = "safe"

[[rule]]
job_name = "nightly-*"
kind = "model"
answer = "default"

[[rule]]
pool = "gpu"
answer = "fast"

[[rule]]
meta = { risk = "low", score = 1 }
answer = "fast"

[[rule]]
metadata = { tenant = "acme" }
answer = "warp"

[[rule]]
kind = "checkpoint"
answer = "proceed"
"#;
        let model = decision(DecisionKind::Model, &["fast", "safe"], Some("safe"));
        let no_default = decision(DecisionKind::Model, &["fast", "safe"], None);
        let checkpoint = decision(
            DecisionKind::Checkpoint,
            &["proceed", "skip", "abort", "modify_prompt"],
            None,
        );
        let dr = SignalType::DecisionRequest;
        let mut gpu = signal(dr, "NEEDS_MANAGER_DECISION", None, json!({}));
        gpu.pool = "gpu".into();
        // (what, signal, decision, the request's metadata, the rule and option expected)
        type Case<'a> = (
            &'a str,
            Signal,
            &'a DecisionBlock,
            Value,
            Option<(usize, &'a str)>,
        );
        let cases: Vec<Case> = vec![
            (
                "escalations are ignored",
                signal(SignalType::Escalation, "LOW_CONFIDENCE", None, json!({})),
                &model,
                json!({}),
                Some((1, "!ignore")),
            ),
            (
                "code",
                signal(dr, "POLICY_RISK", None, json!({})),
                &model,
                json!({}),
                Some((2, "safe")),
            ),
            (
                "glob and default",
                signal(dr, "NEEDS_MANAGER_DECISION", Some("nightly-42"), json!({})),
                &model,
                json!({}),
                Some((3, "safe")),
            ),
            (
                "glob needs a job name",
                signal(dr, "NEEDS_MANAGER_DECISION", None, json!({})),
                &model,
                json!({}),
                None,
            ),
            (
                "glob mismatch",
                signal(dr, "NEEDS_MANAGER_DECISION", Some("daily-1"), json!({})),
                &model,
                json!({}),
                None,
            ),
            (
                "no default: the rule does not apply, the next one may",
                signal(
                    dr,
                    "NEEDS_MANAGER_DECISION",
                    Some("nightly-1"),
                    json!({"risk": "low", "score": 1.0}),
                ),
                &no_default,
                json!({}),
                Some((5, "fast")),
            ),
            ("pool", gpu, &model, json!({}), Some((4, "fast"))),
            (
                "meta needs every key",
                signal(dr, "NEEDS_MANAGER_DECISION", None, json!({"risk": "low"})),
                &model,
                json!({}),
                None,
            ),
            (
                "meta values must be equal",
                signal(
                    dr,
                    "NEEDS_MANAGER_DECISION",
                    None,
                    json!({"risk": "high", "score": 1}),
                ),
                &model,
                json!({}),
                None,
            ),
            (
                "metadata of the request",
                signal(
                    dr,
                    "NEEDS_MANAGER_DECISION",
                    None,
                    json!({"tenant": "acme"}),
                ),
                &model,
                json!({"tenant": "acme"}),
                Some((6, "!invalid:warp")),
            ),
            (
                "metadata is not meta",
                signal(
                    dr,
                    "NEEDS_MANAGER_DECISION",
                    None,
                    json!({"tenant": "acme"}),
                ),
                &model,
                json!({}),
                None,
            ),
            (
                "kind",
                signal(dr, "CHECKPOINT", None, json!({})),
                &checkpoint,
                json!({}),
                Some((7, "proceed")),
            ),
        ];
        for (name, s, d, metadata, expected) in cases {
            let got = check(rules, &s, d, metadata);
            assert_eq!(
                got.as_ref().map(|(i, o)| (*i, o.as_str())),
                expected,
                "{name}"
            );
        }
    }

    #[test]
    fn answers_carry_what_the_rule_sets() {
        let policy = Policy::from_toml_str(
            "[[rule]]\nanswer = \"retry\"\nafter_ms = 500\nrationale = \"r\"\nguidance = \"g\"\nmodified_prompt = \"p\"\nconfidence_boost = 0.1\n",
        )
        .unwrap();
        let d = decision(DecisionKind::Escalation, &["retry", "skip"], None);
        let s = signal(SignalType::Escalation, "LOW_CONFIDENCE", None, json!({}));
        let Verdict::Answer {
            rule,
            option_id,
            spec,
        } = policy.evaluate(&s, &d, &Map::new())
        else {
            panic!("answers");
        };
        assert_eq!((rule, option_id.as_str()), (1, "retry"));
        assert_eq!(spec.after_ms, Some(500));
        assert_eq!(
            (
                spec.rationale.as_deref(),
                spec.guidance.as_deref(),
                spec.modified_prompt.as_deref(),
                spec.confidence_boost
            ),
            (Some("r"), Some("g"), Some("p"), Some(0.1))
        );
        assert!(Policy::from_toml_str("").unwrap().is_empty());
        assert!(Policy::from_toml_str("# nothing\n").unwrap().is_empty());
    }

    #[test]
    fn load_errors_name_the_rule_and_the_key() {
        for (text, needles) in [
            ("[[rule]]\nanwser = \"a\"\n", vec!["rule 1", "anwser"]),
            (
                "[[rule]]\nanswer = \"a\"\n[[rule]]\ntype = \"question\"\nanswer = \"a\"\n",
                vec!["rule 2", "question"],
            ),
            (
                "[[rule]]\nkind = \"robot\"\nanswer = \"a\"\n",
                vec!["rule 1", "robot"],
            ),
            (
                "[[rule]]\ncode = \"needs\"\nanswer = \"a\"\n",
                vec!["rule 1", "code"],
            ),
            ("[[rule]]\ncode = \"X\"\n", vec!["rule 1", "no action"]),
            (
                "[[rule]]\nanswer = \"a\"\naction = \"ignore\"\n",
                vec!["rule 1", "not both"],
            ),
            ("[[rule]]\naction = \"answer\"\n", vec!["rule 1", "action"]),
            (
                "[[rule]]\naction = \"ignore\"\nafter_ms = 5\n",
                vec!["rule 1", "after_ms"],
            ),
            ("[[rule]]\nanswer = \"\"\n", vec!["rule 1", "answer"]),
            ("[[rule]]\nanswer = \"a\"\nafter_ms = -1\n", vec!["rule 1"]),
            (
                "[[rule]]\nanswer = \"a\"\nafter_ms = \"soon\"\n",
                vec!["rule 1", "after_ms"],
            ),
            (
                "[[rule]]\nanswer = \"a\"\nconfidence_boost = -0.5\n",
                vec!["rule 1", "confidence_boost"],
            ),
            (
                "[[rule]]\nanswer = \"a\"\nconfidence_boost = 1.5\n",
                vec!["rule 1", "confidence_boost"],
            ),
            (
                "[[rule]]\nanswer = \"a\"\nmeta = 3\n",
                vec!["rule 1", "meta"],
            ),
            ("[[rules]]\nanswer = \"a\"\n", vec!["rules", "[[rule]]"]),
            ("rule = 3\n", vec!["[[rule]]"]),
            ("[[rule]]\nanswer = \n", vec!["line 2"]),
        ] {
            let err = Policy::from_toml_str(text).unwrap_err().to_string();
            for needle in needles {
                assert!(err.contains(needle), "{text:?}: {err}");
            }
            assert!(!err.contains('\n'), "one line: {err}");
        }
        let err = Policy::load(Path::new("/nonexistent/rules.toml")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/rules.toml"));
    }

    #[test]
    fn the_example_policy_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/manager-policy.toml");
        let policy = Policy::load(&path).unwrap();
        assert!(!policy.is_empty());
    }

    #[test]
    fn globs() {
        for (pattern, text, ok) in [
            ("nightly-*", "nightly-1", true),
            ("nightly-*", "nightly-", true),
            ("nightly-*", "daily-1", false),
            ("*-report", "weekly-report", true),
            ("*-report", "weekly-reports", false),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxbyy", false),
            ("*", "", true),
            ("exact", "exact", true),
            ("exact", "exactly", false),
            ("", "", true),
            ("", "x", false),
            ("**", "x", true),
        ] {
            assert_eq!(glob_match(pattern, text), ok, "{pattern:?} {text:?}");
        }
    }
}
