//! The validation hand-off: the output held to the request's checks, and what follows when it
//! falls short.
//!
//! A first request of a chain gets one more try with the failed checks named, which is cheaper
//! than a manager's time when the model can fix what it is told about. After that a shortfall
//! escalates: the request ends with a decision for a manager, with the context to take it (the
//! checks, the confidence, the chain's history, suggestions from earlier decisions).

use std::time::Duration;

use serde_json::json;

use crate::engine::history::{self, SuggestionQuery};
use crate::engine::validation;
use crate::protocol::chain::PastAttempt;
use crate::protocol::task::task_text;
use crate::protocol::{DecisionKind, Message, Reason, Severity, SignalType, ValidationReport};

use super::Generation;
use super::decision::{NewDecision, escalation_options, summarise};
use super::ending::Stop;

/// How long an escalation waits for the decision history before it goes without suggestions.
const HISTORY_WAIT: Duration = Duration::from_secs(3);

/// How the output fares against the request's checks: which try this is, where the answer
/// under judgement starts, and the report the result carries (`validation`). Only the
/// validation hand-off, here, changes it.
pub(super) struct Judgement {
    /// 1, or 2 once validation sent the model back to its answer.
    tries: u32,
    /// Where in the output the answer the checks judge starts: 0, or where the retry began.
    answer_from: usize,
    pub(super) report: Option<ValidationReport>,
}

impl Judgement {
    pub(super) fn new() -> Self {
        Judgement {
            tries: 1,
            answer_from: 0,
            report: None,
        }
    }

    /// The part of `output` under judgement: all of it, or the retry's.
    fn answer<'o>(&self, output: &'o str) -> &'o str {
        output
            .get(self.answer_from..)
            .unwrap_or_default()
            .trim_start_matches('\n')
    }

    /// The model goes back to its answer: the checks judge what it writes past `output_len`.
    fn retry_from(&mut self, output_len: usize) {
        self.answer_from = output_len;
        self.tries += 1;
    }
}

impl Generation<'_> {
    /// Runs the tool loop, then holds the output to the request's checks: the first request
    /// of a chain gets one more try with the failed checks named, then a shortfall escalates.
    pub(super) async fn validated_loop(&mut self) -> Stop {
        loop {
            let stop = self.tool_loop().await;
            if self.request.validation.is_empty()
                || !matches!(stop.reason, Reason::Stop | Reason::Length)
            {
                return stop;
            }
            let config = &self.engine.config.escalation;
            let threshold = (self
                .request
                .escalation_threshold
                .unwrap_or(config.threshold)
                - self.ctx.chain.confidence_boost)
                .max(0.0);
            let mut report =
                validation::evaluate(&self.request.validation, self.judged_answer(), threshold);
            report.retried = self.judgement.tries > 1;
            if report.passed {
                self.judgement.report = Some(report);
                return stop;
            }
            let failed = report
                .checks
                .iter()
                .filter(|c| !c.passed)
                .map(|c| format!("{}: {}", c.name, c.detail.as_deref().unwrap_or("failed")));
            self.ctx.chain.push_attempt(PastAttempt::new(
                self.ctx.chain_position,
                self.judgement.tries,
                Some(report.confidence),
                failed,
            ));
            if self.judgement.tries == 1
                && self.ctx.chain_position == 1
                && config.auto_retry_on_first_failure
            {
                self.auto_retry(&report).await;
                continue;
            }
            let stop = self.escalate(&report).await;
            self.judgement.report = Some(report);
            return stop;
        }
    }

    /// The output since the answer under judgement began: all of it, or the retry's.
    fn judged_answer(&self) -> &str {
        self.judgement.answer(&self.transcript.output)
    }

    /// Sends the model back to its answer with the failed checks named. The output keeps the
    /// first answer (it was streamed, and `output` is every turn); the checks judge the retry.
    async fn auto_retry(&mut self, report: &ValidationReport) {
        let failed = failed_checks(report);
        let summary = format!(
            "the answer scored {:.2}, below {:.2}; retrying once with the failed checks named",
            report.confidence, report.threshold
        );
        let meta = json!({
            "confidence": report.confidence,
            "threshold": report.threshold,
            "pass_rate": report.pass_rate,
            "failed_checks": failed,
        });
        self.worker_signal("LOW_CONFIDENCE", Severity::Low, summary, meta)
            .await;
        self.transcript
            .conversation
            .push(Message::user(validation::retry_note(report)));
        self.judgement.retry_from(self.transcript.output.len());
    }

    /// Ends the request with `escalation.LOW_CONFIDENCE`, whose decision offers retry, skip,
    /// abort and modify_prompt and whose meta holds the context a manager needs.
    async fn escalate(&mut self, report: &ValidationReport) -> Stop {
        let task = task_text(&self.request.messages);
        let query = SuggestionQuery {
            code: "LOW_CONFIDENCE".into(),
            confidence: report.confidence,
            pass_rate: report.pass_rate,
            prompt: task.clone(),
        };
        let entries =
            tokio::time::timeout(HISTORY_WAIT, self.engine.history.entries("LOW_CONFIDENCE"))
                .await
                .unwrap_or_default();
        let suggestions = history::suggestions(&query, &entries);
        let passed = report.checks.iter().filter(|c| c.passed).count();
        let mut meta = serde_json::Map::new();
        meta.insert("checks".into(), json!(report.checks));
        meta.insert("confidence".into(), json!(report.confidence));
        meta.insert("threshold".into(), json!(report.threshold));
        meta.insert("pass_rate".into(), json!(report.pass_rate));
        meta.insert("chain_position".into(), json!(self.ctx.chain_position));
        meta.insert("attempt".into(), json!(self.ctx.attempt));
        meta.insert("tries".into(), json!(self.judgement.tries));
        meta.insert("error_history".into(), json!(self.ctx.chain.error_history));
        meta.insert("prompt".into(), json!(summarise(&task, 2000)));
        meta.insert(
            "output_summary".into(),
            json!(summarise(self.judged_answer(), 1000)),
        );
        meta.insert("suggestions".into(), json!(suggestions));
        let summary = format!(
            "the output scored {:.2}, below the threshold {:.2} ({passed} of {} checks passed)",
            report.confidence,
            report.threshold,
            report.checks.len()
        );
        let failed = failed_checks(report);
        let decision = NewDecision {
            kind: DecisionKind::Escalation,
            question: "The output fell short of its checks. How should this job go on?".into(),
            options: escalation_options(),
            default_option: self.engine.config.escalation.default_option.clone(),
            context: Some(format!(
                "confidence {:.2} (needed {:.2}); failed: {}",
                report.confidence,
                report.threshold,
                failed.join("; ")
            )),
        };
        self.raise_decision(
            SignalType::Escalation,
            "LOW_CONFIDENCE",
            summary,
            meta,
            decision,
        )
        .await
    }
}

/// The names of the checks the output failed.
fn failed_checks(report: &ValidationReport) -> Vec<&str> {
    report
        .checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| c.name.as_str())
        .collect()
}
