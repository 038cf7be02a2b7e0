//! A decision as a person at the console or a higher-level model sees it: the question, the
//! options with their pros and cons, the default, the context, the signal's `meta` (for an
//! escalation: confidence, checks, chain position, error history, prompt, output summary) and
//! the historical suggestions the fleet attached in `meta.suggestions`.
//!
//! `meta` is whatever the fleet put there, so it is rendered generically and robustly: known
//! keys first, every value trimmed, nothing assumed about its shape.

use std::fmt::Write as _;

use serde_json::{Map, Value};

use crate::protocol::decision::DecisionRecord;
use crate::protocol::text::{clip_chars_counted, one_line};
use crate::protocol::{DecisionBlock, DecisionKind, Signal};

/// Longest text shown for one value (prompts, outputs, contexts).
const MAX_TEXT_CHARS: usize = 800;
/// Longest line for one item of a list (a check, a history entry).
const MAX_ITEM_CHARS: usize = 240;
/// Items of a list shown before "... N more".
const MAX_ITEMS: usize = 12;
/// Keys of an escalation's `meta` shown first, in this order; the rest follow sorted.
const KNOWN_META_KEYS: &[&str] = &[
    "confidence",
    "threshold",
    "checks",
    "chain_position",
    "error_history",
    "prompt",
    "output_summary",
];

/// Everything known about one decision when it is judged.
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionView {
    pub signal: Signal,
    pub decision: DecisionBlock,
    /// The asking request's place in its chain (from the record).
    pub chain_position: Option<u32>,
    /// The asking request's `metadata` (from the record).
    pub metadata: Map<String, Value>,
}

impl DecisionView {
    /// `None` for a signal without a decision block.
    pub fn new(signal: &Signal, record: Option<&DecisionRecord>) -> Option<DecisionView> {
        let decision = signal.decision.clone()?;
        Some(DecisionView {
            signal: signal.clone(),
            decision,
            chain_position: record.map(|r| r.chain_position),
            metadata: record
                .map(|r| r.request.metadata.clone())
                .unwrap_or_default(),
        })
    }

    pub fn option_ids(&self) -> Vec<&str> {
        self.decision
            .options
            .iter()
            .map(|o| o.id.as_str())
            .collect()
    }

    /// Whether the answer may carry `modified_prompt`, `guidance` and `confidence_boost`
    /// (escalations and checkpoints; the fleet refuses them for a model's own question).
    pub fn takes_extras(&self) -> bool {
        self.decision.kind != DecisionKind::Model
    }

    /// The decision as text, options numbered from 1.
    pub fn render(&self) -> String {
        let d = &self.decision;
        let s = &self.signal;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "Decision {} ({} decision; signal {}.{}, severity {})",
            d.decision_id,
            kind_name(d.kind),
            s.kind.as_str(),
            s.code,
            severity_name(s)
        );
        let mut place = format!(
            "Job: {}   Request: {}   Pool: {}",
            s.job_name.as_deref().unwrap_or("-"),
            s.request_id,
            s.pool
        );
        if let Some(position) = self.chain_position {
            let _ = write!(place, "   Chain position: {position}");
        }
        let _ = writeln!(out, "{place}");
        if let Some(expires) = &d.expires_at {
            let _ = writeln!(out, "Expires: {expires}");
        }
        if !s.summary.is_empty() && s.summary != d.question {
            let _ = writeln!(
                out,
                "Summary: {}",
                indent_rest(&clip_chars_counted(&s.summary, MAX_TEXT_CHARS), 2)
            );
        }
        let _ = writeln!(
            out,
            "Question: {}",
            indent_rest(&clip_chars_counted(&d.question, MAX_TEXT_CHARS), 2)
        );
        if let Some(context) = d.context.as_deref().filter(|c| !c.is_empty()) {
            let _ = writeln!(
                out,
                "Context: {}",
                indent_rest(&clip_chars_counted(context, MAX_TEXT_CHARS), 2)
            );
        }
        let _ = writeln!(out, "Options:");
        for (i, option) in d.options.iter().enumerate() {
            let default = if d.default_option.as_deref() == Some(option.id.as_str()) {
                "  [default]"
            } else {
                ""
            };
            let _ = writeln!(
                out,
                "  {}. {}: {}{default}",
                i + 1,
                option.id,
                clipped_line(&option.label, MAX_ITEM_CHARS)
            );
            if let Some(pros) = option.pros.as_deref().filter(|p| !p.is_empty()) {
                let _ = writeln!(out, "       pros: {}", clipped_line(pros, MAX_TEXT_CHARS));
            }
            if let Some(cons) = option.cons.as_deref().filter(|c| !c.is_empty()) {
                let _ = writeln!(out, "       cons: {}", clipped_line(cons, MAX_TEXT_CHARS));
            }
        }
        match &d.default_option {
            Some(default) => {
                let _ = writeln!(out, "Default: {default}");
            }
            None => {
                let _ = writeln!(out, "Default: none");
            }
        }
        let meta_keys = ordered_keys(&s.meta);
        if !meta_keys.is_empty() {
            let _ = writeln!(out, "Meta:");
            for key in meta_keys {
                let _ = writeln!(out, "  {key}:{}", spaced(render_value(&s.meta[key], 4)));
            }
        }
        if let Some(suggestions) = s.meta.get("suggestions") {
            render_suggestions(&mut out, suggestions);
        }
        if !self.metadata.is_empty() {
            let _ = writeln!(
                out,
                "Request metadata: {}",
                clipped_line(
                    &Value::Object(self.metadata.clone()).to_string(),
                    MAX_TEXT_CHARS
                )
            );
        }
        out
    }
}

fn kind_name(kind: DecisionKind) -> &'static str {
    match kind {
        DecisionKind::Model => "model",
        DecisionKind::Escalation => "escalation",
        DecisionKind::Checkpoint => "checkpoint",
    }
}

fn severity_name(signal: &Signal) -> String {
    serde_json::to_value(signal.severity)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Known keys first, then the others sorted; `suggestions` is shown in its own section.
fn ordered_keys(meta: &Map<String, Value>) -> Vec<&str> {
    let mut keys: Vec<&str> = KNOWN_META_KEYS
        .iter()
        .copied()
        .filter(|k| meta.contains_key(*k))
        .collect();
    let mut rest: Vec<&str> = meta
        .keys()
        .map(String::as_str)
        .filter(|k| !KNOWN_META_KEYS.contains(k) && *k != "suggestions")
        .collect();
    rest.sort_unstable();
    keys.extend(rest);
    keys
}

fn render_suggestions(out: &mut String, suggestions: &Value) {
    let Value::Array(items) = suggestions else {
        let _ = writeln!(
            out,
            "Historical suggestions:{}",
            spaced(render_value(suggestions, 2))
        );
        return;
    };
    if items.is_empty() {
        let _ = writeln!(out, "Historical suggestions: none");
        return;
    }
    let _ = writeln!(
        out,
        "Historical suggestions (earlier decisions like this one):"
    );
    for (i, item) in items.iter().take(MAX_ITEMS).enumerate() {
        let Value::Object(fields) = item else {
            let _ = writeln!(
                out,
                "  {}. {}",
                i + 1,
                clipped_line(&scalar(item), MAX_ITEM_CHARS)
            );
            continue;
        };
        let pick =
            |names: &[&'static str]| names.iter().find_map(|n| fields.get(*n).map(|v| (*n, v)));
        let option = pick(&["option_id", "option", "chosen_option", "choice"]);
        let outcome = pick(&["outcome", "result", "state"]);
        let confidence = pick(&["confidence"]);
        let prompt = pick(&["prompt", "modified_prompt"]);
        let mut head = Vec::new();
        if let Some((_, v)) = option {
            head.push(format!("option {}", scalar(v)));
        }
        if let Some((_, v)) = outcome {
            head.push(format!("outcome {}", scalar(v)));
        }
        if let Some((_, v)) = confidence {
            head.push(format!("confidence {}", scalar(v)));
        }
        let head = if head.is_empty() {
            "(no option recorded)".to_string()
        } else {
            head.join(", ")
        };
        let _ = writeln!(out, "  {}. {head}", i + 1);
        if let Some((_, v)) = prompt {
            let _ = writeln!(
                out,
                "     prompt: {}",
                clipped_line(&scalar(v), MAX_TEXT_CHARS)
            );
        }
        let shown: Vec<&str> = [option, outcome, confidence, prompt]
            .iter()
            .flatten()
            .map(|(name, _)| *name)
            .collect();
        let mut others: Vec<(&String, &Value)> = fields
            .iter()
            .filter(|(k, _)| !shown.contains(&k.as_str()))
            .collect();
        others.sort_by(|a, b| a.0.cmp(b.0));
        for (key, value) in others {
            let _ = writeln!(
                out,
                "     {key}: {}",
                clipped_line(&scalar(value), MAX_ITEM_CHARS)
            );
        }
    }
    if items.len() > MAX_ITEMS {
        let _ = writeln!(out, "  ... {} more", items.len() - MAX_ITEMS);
    }
}

/// A value on one or more lines; continuation lines are indented by `indent`.
fn render_value(value: &Value, indent: usize) -> String {
    match value {
        Value::String(s) => indent_rest(&clip_chars_counted(s, MAX_TEXT_CHARS), indent),
        Value::Array(items) if items.is_empty() => "[]".into(),
        Value::Array(items) => {
            let pad = " ".repeat(indent);
            let mut text = String::new();
            for item in items.iter().take(MAX_ITEMS) {
                let _ = write!(
                    text,
                    "\n{pad}- {}",
                    clipped_line(&scalar(item), MAX_ITEM_CHARS)
                );
            }
            if items.len() > MAX_ITEMS {
                let _ = write!(text, "\n{pad}... {} more", items.len() - MAX_ITEMS);
            }
            text
        }
        other => clipped_line(&scalar(other), MAX_TEXT_CHARS),
    }
}

/// A value after its key: on the same line after a space, or on the lines below.
fn spaced(rendered: String) -> String {
    if rendered.starts_with('\n') {
        rendered
    } else {
        format!(" {rendered}")
    }
}

/// A string as is, anything else as compact JSON.
fn scalar(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Whitespace (newlines included) collapsed to single spaces, then trimmed to `max`
/// characters with a note of how many were left out.
pub fn clipped_line(text: &str, max: usize) -> String {
    clip_chars_counted(&one_line(text), max)
}

fn indent_rest(text: &str, indent: usize) -> String {
    let pad = format!("\n{}", " ".repeat(indent));
    text.trim_end().replace('\n', &pad)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::protocol::{DecisionOption, Severity, SignalSource, SignalType};
    use serde_json::json;

    pub(crate) fn escalation(meta: Value) -> DecisionView {
        let signal = Signal {
            signal_id: "s1".into(),
            kind: SignalType::Escalation,
            code: "LOW_CONFIDENCE".into(),
            source: SignalSource::Worker,
            severity: Severity::High,
            summary: "confidence 0.40 below 0.60".into(),
            meta: meta.as_object().cloned().unwrap(),
            request_id: "r1".into(),
            root_request_id: "r1".into(),
            job_name: Some("report".into()),
            worker_id: "w1".into(),
            pool: "default".into(),
            ts: "2026-01-01T00:00:00.000Z".into(),
            decision: None,
        };
        let option = |id: &str, label: &str| DecisionOption {
            id: id.into(),
            label: label.into(),
            pros: None,
            cons: None,
        };
        let mut retry = option("retry", "Retry");
        retry.pros = Some("cheap".into());
        retry.cons = Some("may fail again".into());
        let decision = DecisionBlock {
            decision_id: "d1".into(),
            question: "The output failed its checks. What now?".into(),
            options: vec![
                retry,
                option("skip", "Skip"),
                option("abort", "Abort"),
                option("modify_prompt", "Modify the prompt"),
            ],
            default_option: Some("retry".into()),
            context: Some("two checks failed".into()),
            kind: DecisionKind::Escalation,
            expires_at: Some("2026-01-02T00:00:00.000Z".into()),
        };
        DecisionView {
            signal,
            decision,
            chain_position: Some(2),
            metadata: json!({"tenant": "acme"}).as_object().cloned().unwrap(),
        }
    }

    #[test]
    fn an_escalation_shows_its_context_and_history() {
        let view = escalation(json!({
            "zeta": true,
            "prompt": format!("Write the report.\n{}", "x".repeat(2000)),
            "confidence": 0.4,
            "checks": [{"kind": "contains", "passed": false}, {"kind": "regex", "passed": true}],
            "error_history": ["first attempt: missing total"],
            "suggestions": [
                {"option_id": "modify_prompt", "outcome": "COMPLETED", "confidence": 0.9, "prompt": "Include the total.", "pass_rate": 100},
                "odd entry",
                {}
            ]
        }));
        let text = view.render();
        for needle in [
            "Decision d1 (escalation decision; signal escalation.LOW_CONFIDENCE, severity high)",
            "Chain position: 2",
            "1. retry: Retry  [default]",
            "pros: cheap",
            "cons: may fail again",
            "4. modify_prompt: Modify the prompt",
            "Default: retry",
            "Context: two checks failed",
            "confidence: 0.4",
            "- {\"kind\":\"contains\",\"passed\":false}",
            "- first attempt: missing total",
            "(1218 more characters)",
            "1. option modify_prompt, outcome COMPLETED, confidence 0.9",
            "prompt: Include the total.",
            "pass_rate: 100",
            "2. odd entry",
            "3. (no option recorded)",
            "Request metadata: {\"tenant\":\"acme\"}",
        ] {
            assert!(text.contains(needle), "{needle:?} in:\n{text}");
        }
        // Known keys come first, then the rest sorted.
        let at = |needle: &str| text.find(needle).unwrap();
        assert!(at("\n  confidence:") < at("\n  checks:"));
        assert!(at("\n  checks:") < at("\n  prompt:"));
        assert!(at("\n  prompt:") < at("\n  zeta:"));
    }

    #[test]
    fn odd_meta_is_shown_as_it_is() {
        let view = escalation(json!({"suggestions": {"not": "a list"}, "n": null}));
        let text = view.render();
        assert!(
            text.contains("Historical suggestions: {\"not\":\"a list\"}"),
            "{text}"
        );
        assert!(text.contains("n: null"), "{text}");
        let view = escalation(json!({"suggestions": []}));
        assert!(view.render().contains("Historical suggestions: none"));
    }

    #[test]
    fn a_clipped_line_collapses_whitespace_and_counts_characters() {
        assert_eq!(clipped_line("a\n  b\tc", 10), "a b c");
        assert_eq!(clipped_line("ä\nöü", 2), "ä ... (2 more characters)");
    }
}
