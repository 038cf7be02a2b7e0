//! What a request carries from the decisions earlier in its decision chain.
//!
//! A continuation is a fresh request ("nuke and repave"), so whatever the chain has learnt
//! travels with it: the checkpoints a manager already confirmed, the threshold boost the
//! answer granted, and the failed attempts so far (the error history an escalation shows).
//! The fleet carries it in a queue message header; it is bounded by construction.

use serde::{Deserialize, Serialize};

use super::text::clip_bytes;

/// Failed attempts kept in the history (the oldest go first).
pub const MAX_ATTEMPTS_KEPT: usize = 8;
/// Failed checks named per attempt.
const MAX_CHECKS_NAMED: usize = 8;
/// Longest text of one history item.
const MAX_TEXT: usize = 200;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChainState {
    /// The decision whose answer started this request: its history entry is given this
    /// request's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    /// That decision's signal code (the history is kept by code).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_code: Option<String>,
    /// Checkpoints confirmed earlier in the chain: they do not fire again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checkpoints_passed: Vec<String>,
    /// Lowers this request's escalation threshold (granted by the answer that started it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub confidence_boost: f64,
    /// Failed attempts before this request, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub error_history: Vec<PastAttempt>,
}

fn is_zero(value: &f64) -> bool {
    *value == 0.0
}

/// One attempt of the chain that did not pass, as the error history shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PastAttempt {
    pub chain_position: u32,
    /// 1, or 2 for the automatic retry of a chain's first request.
    pub try_in_request: u32,
    /// The confidence its output scored, when validation ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<f64>,
    /// The checks its output failed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_checks: Vec<String>,
    /// What was decided about it, e.g. `retry by ops: "add the totals"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided: Option<String>,
}

impl PastAttempt {
    pub fn new(
        chain_position: u32,
        try_in_request: u32,
        confidence: Option<f64>,
        failed_checks: impl IntoIterator<Item = String>,
    ) -> PastAttempt {
        PastAttempt {
            chain_position,
            try_in_request,
            confidence,
            failed_checks: failed_checks
                .into_iter()
                .take(MAX_CHECKS_NAMED)
                .map(|c| clip_bytes(&c, MAX_TEXT))
                .collect(),
            decided: None,
        }
    }
}

impl ChainState {
    /// Adds an attempt to the history, keeping the newest [`MAX_ATTEMPTS_KEPT`].
    pub fn push_attempt(&mut self, attempt: PastAttempt) {
        self.error_history.push(attempt);
        let excess = self.error_history.len().saturating_sub(MAX_ATTEMPTS_KEPT);
        self.error_history.drain(..excess);
    }

    /// Notes what was decided about the newest attempt.
    pub fn note_decision(&mut self, decided: &str) {
        if let Some(last) = self.error_history.last_mut() {
            last.decided = Some(clip_bytes(decided, MAX_TEXT));
        }
    }

    pub fn checkpoint_passed(&self, name: &str) -> bool {
        self.checkpoints_passed.iter().any(|n| n == name)
    }

    /// Compact JSON for a message header (no line breaks).
    pub fn to_header(&self) -> String {
        serde_json::to_string(self).expect("chain states serialize")
    }

    /// Reads a header; `None` when it is not a chain state.
    pub fn from_header(value: &str) -> Option<ChainState> {
        let mut state: ChainState = serde_json::from_str(value).ok()?;
        // A header comes from the bus: keep it within the bounds this type promises.
        let excess = state.error_history.len().saturating_sub(MAX_ATTEMPTS_KEPT);
        state.error_history.drain(..excess);
        state.checkpoints_passed.truncate(64);
        if !state.confidence_boost.is_finite() {
            state.confidence_boost = 0.0;
        }
        state.confidence_boost = state.confidence_boost.clamp(0.0, 1.0);
        Some(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_keeps_the_newest_attempts() {
        let mut state = ChainState::default();
        for i in 0..20 {
            state.push_attempt(PastAttempt::new(i, 1, Some(0.1), ["x".to_string()]));
        }
        assert_eq!(state.error_history.len(), MAX_ATTEMPTS_KEPT);
        assert_eq!(state.error_history[0].chain_position, 12);
        state.note_decision("retry by ops");
        assert_eq!(
            state.error_history.last().unwrap().decided.as_deref(),
            Some("retry by ops")
        );
    }

    #[test]
    fn header_round_trip_and_bounds() {
        let mut state = ChainState {
            decision_id: Some("d1".into()),
            decision_code: Some("LOW_CONFIDENCE".into()),
            checkpoints_passed: vec!["deploy".into()],
            confidence_boost: 0.2,
            error_history: Vec::new(),
        };
        state.push_attempt(PastAttempt::new(
            1,
            2,
            Some(0.5),
            ["a\nb".to_string(), "é".repeat(300)],
        ));
        let header = state.to_header();
        assert!(!header.contains('\n'));
        assert_eq!(ChainState::from_header(&header), Some(state));
        assert_eq!(ChainState::from_header("not json"), None);
        let wild = r#"{"confidence_boost": 7}"#;
        assert_eq!(ChainState::from_header(wild).unwrap().confidence_boost, 1.0);
    }

    #[test]
    fn long_texts_are_clipped_on_a_char_boundary() {
        let attempt = PastAttempt::new(1, 1, None, ["é".repeat(300)]);
        assert!(attempt.failed_checks[0].len() <= MAX_TEXT + '…'.len_utf8());
    }
}
