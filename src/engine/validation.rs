//! Validation of a request's final output and the confidence it gives.
//!
//! confidence = the weighted share of checks that pass (1.0 with no checks); the pass rate is
//! the unweighted share, in percent. A run that fails every check scores 0.0, whatever the
//! weights: confidence comes only from checks that passed.

use crate::protocol::{CheckResult, ValidationCheck, ValidationReport};

/// Runs every check on `output`. `threshold` is the bar the confidence must reach.
pub fn evaluate(checks: &[ValidationCheck], output: &str, threshold: f64) -> ValidationReport {
    let results: Vec<CheckResult> = checks.iter().map(|c| run_check(c, output)).collect();
    let total: f64 = results.iter().map(|r| r.weight).sum();
    // A float sum of nothing is -0.0, which would show as "-0.00"; + 0.0 makes it 0.0.
    let passed_weight: f64 = results
        .iter()
        .filter(|r| r.passed)
        .map(|r| r.weight)
        .sum::<f64>()
        + 0.0;
    let confidence = if results.is_empty() || total <= 0.0 {
        1.0
    } else {
        (passed_weight / total).clamp(0.0, 1.0)
    };
    let pass_rate = if results.is_empty() {
        100.0
    } else {
        100.0 * results.iter().filter(|r| r.passed).count() as f64 / results.len() as f64
    };
    ValidationReport {
        confidence: round4(confidence),
        pass_rate: round4(pass_rate),
        threshold: round4(threshold),
        passed: confidence + 1e-9 >= threshold,
        checks: results,
        retried: false,
    }
}

fn round4(value: f64) -> f64 {
    (value * 10_000.0).round() / 10_000.0
}

/// The text a JSON check reads: the output, or the body of the one fenced block it consists of
/// (models often fence JSON they were asked to write).
fn json_text(output: &str) -> &str {
    let trimmed = output.trim();
    if let Some(rest) = trimmed.strip_prefix("```")
        && let Some(body) = rest.strip_suffix("```")
    {
        let body = body.strip_prefix("json").unwrap_or(body);
        if !body.contains("```") {
            return body.trim();
        }
    }
    trimmed
}

fn run_check(check: &ValidationCheck, output: &str) -> CheckResult {
    let (kind, name, outcome): (&str, String, Result<(), String>) = match check {
        ValidationCheck::Contains { text, .. } => (
            "contains",
            format!("contains {text:?}"),
            if output.contains(text.as_str()) {
                Ok(())
            } else {
                Err(format!("the output does not contain {text:?}"))
            },
        ),
        ValidationCheck::Regex { pattern, .. } => (
            "regex",
            format!("matches /{pattern}/"),
            match regex::Regex::new(pattern) {
                Ok(re) if re.is_match(output) => Ok(()),
                Ok(_) => Err(format!("the output does not match /{pattern}/")),
                Err(error) => Err(format!("the pattern does not compile: {error}")),
            },
        ),
        ValidationCheck::MaxChars { max, .. } => {
            let count = output.chars().count();
            (
                "max_chars",
                format!("at most {max} characters"),
                if count <= *max {
                    Ok(())
                } else {
                    Err(format!("the output has {count} characters, over {max}"))
                },
            )
        }
        ValidationCheck::JsonSchema { schema, .. } => (
            "json_schema",
            "JSON valid against the schema".to_string(),
            json_schema_check(schema, output),
        ),
    };
    CheckResult {
        kind: kind.to_string(),
        name,
        weight: check.weight(),
        passed: outcome.is_ok(),
        detail: outcome.err(),
    }
}

fn json_schema_check(schema: &serde_json::Value, output: &str) -> Result<(), String> {
    let validator = jsonschema::validator_for(schema)
        .map_err(|error| format!("the schema does not compile: {error}"))?;
    let value: serde_json::Value = serde_json::from_str(json_text(output))
        .map_err(|error| format!("the output is not JSON: {error}"))?;
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .take(3)
        .map(|e| {
            let path = e.instance_path().to_string();
            let path = if path.is_empty() { "/".into() } else { path };
            format!("at {path}: {e}")
        })
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// The note that sends the model back to its answer, naming what failed.
pub fn retry_note(report: &ValidationReport) -> String {
    let mut note = format!(
        "Your answer did not pass the checks it is held to (confidence {:.2}, needed {:.2}). \
         Write the whole answer again so that it passes them. Failed checks:",
        report.confidence, report.threshold
    );
    for check in report.failed_checks() {
        note.push_str(&format!(
            "\n- {}: {}",
            check.name,
            check.detail.as_deref().unwrap_or("failed")
        ));
    }
    note
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn checks(value: serde_json::Value) -> Vec<ValidationCheck> {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn confidence_is_the_weighted_share_of_passed_checks() {
        let table = [
            // (checks, output, confidence, pass rate)
            (json!([]), "anything", 1.0, 100.0),
            (
                json!([{"kind": "contains", "text": "total"}]),
                "the total is 4",
                1.0,
                100.0,
            ),
            (
                json!([{"kind": "contains", "text": "total", "weight": 3.0},
                       {"kind": "max_chars", "max": 5}]),
                "the total is 4",
                0.75,
                50.0,
            ),
            (
                json!([{"kind": "contains", "text": "x", "weight": 9.0},
                       {"kind": "regex", "pattern": "^\\d+$", "weight": 0.5}]),
                "nothing here",
                0.0,
                0.0,
            ),
            (
                json!([{"kind": "regex", "pattern": "^\\d+$"},
                       {"kind": "json_schema", "schema": {"type": "integer"}}]),
                "42",
                1.0,
                100.0,
            ),
        ];
        for (i, (list, output, confidence, pass_rate)) in table.into_iter().enumerate() {
            let report = evaluate(&checks(list), output, 0.6);
            assert_eq!(report.confidence, confidence, "case {i}");
            assert_eq!(report.pass_rate, pass_rate, "case {i}");
            assert_eq!(report.passed, confidence >= 0.6, "case {i}");
        }
    }

    #[test]
    fn a_run_that_fails_every_check_never_scores_above_zero() {
        let list = checks(json!([
            {"kind": "contains", "text": "a", "weight": 1.0},
            {"kind": "contains", "text": "b", "weight": 100.0},
        ]));
        let report = evaluate(&list, "zzz", 0.0);
        assert_eq!(report.confidence, 0.0);
        assert!(
            report.confidence.is_sign_positive(),
            "no -0.0 to print as -0.00"
        );
        assert!(report.passed, "a threshold of 0 passes everything");
        assert!(!evaluate(&list, "zzz", 0.01).passed);
    }

    #[test]
    fn json_schema_reads_a_fenced_block_and_names_the_failing_path() {
        let schema = json!({"type": "object", "required": ["total"],
                            "properties": {"total": {"type": "number"}}});
        let list = checks(json!([{"kind": "json_schema", "schema": schema}]));
        assert!(evaluate(&list, "```json\n{\"total\": 3}\n```", 0.6).passed);
        assert!(evaluate(&list, " {\"total\": 3} ", 0.6).passed);
        let bad = evaluate(&list, "{\"total\": \"three\"}", 0.6);
        assert!(!bad.passed);
        let detail = bad.checks[0].detail.clone().unwrap();
        assert!(detail.contains("/total"), "{detail}");
        let prose = evaluate(&list, "The total is 3.", 0.6);
        assert!(
            prose.checks[0]
                .detail
                .as_deref()
                .unwrap()
                .contains("not JSON")
        );
    }

    #[test]
    fn max_chars_counts_characters_not_bytes() {
        let list = checks(json!([{"kind": "max_chars", "max": 3}]));
        assert!(evaluate(&list, "ééé", 0.6).passed);
        assert!(!evaluate(&list, "éééé", 0.6).passed);
    }

    #[test]
    fn the_retry_note_names_each_failed_check() {
        let list = checks(json!([
            {"kind": "contains", "text": "TOTAL"},
            {"kind": "max_chars", "max": 100},
        ]));
        let note = retry_note(&evaluate(&list, "no", 0.6));
        assert!(note.contains("contains \"TOTAL\""), "{note}");
        assert!(!note.contains("at most 100"), "{note}");
    }
}
