//! Decision history: what was decided about earlier escalations, and how it turned out, so a
//! new escalation can show what worked before.
//!
//! The engine ranks; where the history lives (JetStream, for the fleet) is behind
//! [`DecisionHistory`], so the engine stays free of NATS.

use std::collections::HashSet;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::protocol::{DecisionAnswer, DecisionKind};

/// Suggestions an escalation carries at most.
pub const MAX_SUGGESTIONS: usize = 3;
/// How far a past confidence may be from the current one to count as similar.
pub const CONFIDENCE_WINDOW: f64 = 0.15;
/// How far a past pass rate (in percent) may be from the current one.
pub const PASS_RATE_WINDOW: f64 = 15.0;

/// How a decision turned out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HistoryOutcome {
    /// The continuation has not ended yet.
    Pending,
    /// The continuation completed and its output passed its checks.
    Success,
    /// The continuation failed, fell short of its checks again, or needed another decision.
    Failure,
    /// The step was skipped (the chain ended there).
    Skipped,
    /// The job was aborted (the chain ended there).
    Aborted,
}

/// One answered decision, as the history keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub decision_id: String,
    pub code: String,
    pub kind: DecisionKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    pub pool: String,
    pub request_id: String,
    pub root_request_id: String,
    pub chain_position: u32,
    /// The confidence and pass rate that raised an escalation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_rate: Option<f64>,
    /// The task (the caller's last user message), trimmed.
    pub prompt: String,
    pub question: String,
    /// The answer (its `modified_prompt` trimmed like the prompt).
    #[serde(flatten)]
    pub choice: DecisionAnswer,
    pub decided_at: String,
    pub outcome: HistoryOutcome,
    /// The continuation whose ending set the outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation_request_id: Option<String>,
    /// The confidence the continuation reached, when it was validated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome_confidence: Option<f64>,
    /// How the continuation ended (`COMPLETED stop`, `FAILED timeout`...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome_detail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome_at: Option<String>,
}

/// The escalation suggestions are wanted for.
#[derive(Debug, Clone)]
pub struct SuggestionQuery {
    pub code: String,
    pub confidence: f64,
    pub pass_rate: f64,
    pub prompt: String,
}

/// A past decision offered to whoever answers a new one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Suggestion {
    pub decision_id: String,
    /// What was answered then.
    #[serde(flatten)]
    pub choice: DecisionAnswer,
    pub outcome: HistoryOutcome,
    pub confidence: f64,
    pub pass_rate: f64,
    /// Word overlap of the two prompts, 0.0 to 1.0.
    pub prompt_similarity: f64,
    pub prompt: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome_confidence: Option<f64>,
    pub decided_at: String,
}

/// Where the history is kept.
pub trait DecisionHistory: Send + Sync + 'static {
    /// Past decisions about escalations with this code (bounded by the store). Failures to
    /// read are the store's to log; the engine then offers no suggestions.
    fn entries(&self, code: &str) -> BoxFuture<'static, Vec<HistoryEntry>>;
}

/// No history: no suggestions.
pub struct NoHistory;

impl DecisionHistory for NoHistory {
    fn entries(&self, _code: &str) -> BoxFuture<'static, Vec<HistoryEntry>> {
        Box::pin(async { Vec::new() })
    }
}

/// The suggestions for `query`: entries of the same code whose confidence is within
/// [`CONFIDENCE_WINDOW`] and pass rate within [`PASS_RATE_WINDOW`] points, ordered successful
/// outcomes first, then by closeness of confidence, then of pass rate, then by prompt
/// similarity, newest first on a tie; at most [`MAX_SUGGESTIONS`].
pub fn suggestions(query: &SuggestionQuery, entries: &[HistoryEntry]) -> Vec<Suggestion> {
    struct Candidate<'a> {
        entry: &'a HistoryEntry,
        confidence_gap: f64,
        pass_rate_gap: f64,
        similarity: f64,
    }
    let words = word_set(&query.prompt);
    let mut candidates: Vec<Candidate> = entries
        .iter()
        .filter(|e| e.code == query.code)
        .filter_map(|entry| {
            let confidence_gap = (entry.confidence? - query.confidence).abs();
            let pass_rate_gap = (entry.pass_rate? - query.pass_rate).abs();
            let similar = confidence_gap <= CONFIDENCE_WINDOW + 1e-9
                && pass_rate_gap <= PASS_RATE_WINDOW + 1e-9;
            similar.then(|| Candidate {
                entry,
                confidence_gap,
                pass_rate_gap,
                similarity: jaccard(&words, &word_set(&entry.prompt)),
            })
        })
        .collect();
    candidates.sort_by(|a, b| {
        let unsuccessful = |c: &Candidate| c.entry.outcome != HistoryOutcome::Success;
        unsuccessful(a)
            .cmp(&unsuccessful(b))
            .then(a.confidence_gap.total_cmp(&b.confidence_gap))
            .then(a.pass_rate_gap.total_cmp(&b.pass_rate_gap))
            .then(b.similarity.total_cmp(&a.similarity))
            .then(b.entry.decided_at.cmp(&a.entry.decided_at))
    });
    candidates
        .into_iter()
        .take(MAX_SUGGESTIONS)
        .map(|c| {
            let e = c.entry;
            Suggestion {
                decision_id: e.decision_id.clone(),
                choice: e.choice.clone(),
                outcome: e.outcome,
                confidence: e.confidence.unwrap_or_default(),
                pass_rate: e.pass_rate.unwrap_or_default(),
                prompt_similarity: (c.similarity * 1000.0).round() / 1000.0,
                prompt: e.prompt.clone(),
                job_name: e.job_name.clone(),
                outcome_confidence: e.outcome_confidence,
                decided_at: e.decided_at.clone(),
            }
        })
        .collect()
}

/// Lower-case words of two or more letters or digits.
fn word_set(text: &str) -> HashSet<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.chars().count() >= 2)
        .map(str::to_lowercase)
        .collect()
}

/// Shared words over all words of the two texts.
fn jaccard(a: &HashSet<String>, b: &HashSet<String>) -> f64 {
    let all = a.union(b).count();
    if all == 0 {
        return 0.0;
    }
    a.intersection(b).count() as f64 / all as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(
        id: &str,
        outcome: HistoryOutcome,
        confidence: f64,
        pass_rate: f64,
        prompt: &str,
    ) -> HistoryEntry {
        HistoryEntry {
            decision_id: id.into(),
            code: "LOW_CONFIDENCE".into(),
            kind: DecisionKind::Escalation,
            job_name: None,
            pool: "default".into(),
            request_id: format!("r-{id}"),
            root_request_id: format!("r-{id}"),
            chain_position: 1,
            confidence: Some(confidence),
            pass_rate: Some(pass_rate),
            prompt: prompt.into(),
            question: "q".into(),
            choice: DecisionAnswer::option("retry"),
            decided_at: format!("2026-01-01T00:00:0{}Z", id.len() % 10),
            outcome,
            continuation_request_id: None,
            outcome_confidence: None,
            outcome_detail: None,
            outcome_at: None,
        }
    }

    fn ids(found: &[Suggestion]) -> Vec<&str> {
        found.iter().map(|s| s.decision_id.as_str()).collect()
    }

    fn query(confidence: f64, pass_rate: f64, prompt: &str) -> SuggestionQuery {
        SuggestionQuery {
            code: "LOW_CONFIDENCE".into(),
            confidence,
            pass_rate,
            prompt: prompt.into(),
        }
    }

    #[test]
    fn only_the_same_code_within_both_windows_is_suggested() {
        use HistoryOutcome::*;
        let mut other_code = entry("code", Success, 0.5, 50.0, "x");
        other_code.code = "CHECKPOINT".into();
        let mut no_confidence = entry("none", Success, 0.5, 50.0, "x");
        no_confidence.confidence = None;
        let entries = [
            entry("in", Failure, 0.6, 60.0, "x"),
            entry("edge", Failure, 0.35, 35.0, "x"),
            entry("conf-far", Success, 0.2, 50.0, "x"),
            entry("pass-far", Success, 0.5, 70.0, "x"),
            other_code,
            no_confidence,
        ];
        let found = suggestions(&query(0.5, 50.0, "x"), &entries);
        assert_eq!(ids(&found), ["in", "edge"]);
    }

    #[test]
    fn ordered_success_first_then_confidence_then_pass_rate_then_prompt() {
        use HistoryOutcome::*;
        let task = "summarise the quarterly sales report for the board";
        let entries = [
            entry("fail-exact", Failure, 0.5, 50.0, task),
            entry("ok-far", Success, 0.6, 50.0, task),
            entry("ok-near", Success, 0.55, 50.0, "unrelated words entirely"),
            entry(
                "ok-near-pass",
                Success,
                0.55,
                45.0,
                "unrelated words entirely",
            ),
            entry("ok-near-similar", Success, 0.55, 45.0, task),
        ];
        let found = suggestions(&query(0.5, 50.0, task), &entries);
        assert_eq!(ids(&found), ["ok-near", "ok-near-similar", "ok-near-pass"]);
        let mut fewer = entries.to_vec();
        fewer.retain(|e| e.decision_id.starts_with("fail") || e.decision_id == "ok-far");
        let found = suggestions(&query(0.5, 50.0, task), &fewer);
        assert_eq!(ids(&found), ["ok-far", "fail-exact"]);
        assert_eq!(found[1].prompt_similarity, 1.0);
    }

    #[test]
    fn prompt_similarity_counts_shared_words() {
        let a = word_set("Summarise the SALES report");
        let b = word_set("summarise the marketing report");
        assert!((jaccard(&a, &b) - 0.6).abs() < 1e-9);
        assert_eq!(jaccard(&word_set(""), &word_set("")), 0.0);
    }
}
