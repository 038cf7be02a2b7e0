//! The decisions a generation raises: how the worker raises its own (a checkpoint, an
//! escalation) and what each offers, when a decision expires, and the chain limit past which a
//! request may raise none (a model's `request_decision` keeps the same expiry and limit).
//!
//! A decision is answered by a fresh request further down the chain, so the limit is what keeps
//! a chain of continuations from growing without bound: a request at the limit ends with
//! `decision chain limit` instead of asking.

use crate::protocol::{
    DecisionBlock, DecisionKind, DecisionOption, Reason, Severity, SignalSource, SignalType,
};

use super::Generation;
use super::ending::Stop;

/// A decision about to be raised: what its block says but the id and the expiry, which it is
/// given only once it is raised.
pub(super) struct NewDecision {
    pub(super) kind: DecisionKind,
    pub(super) question: String,
    pub(super) options: Vec<DecisionOption>,
    pub(super) default_option: Option<String>,
    pub(super) context: Option<String>,
}

impl Stop {
    /// The request wanted a decision but stands at the chain limit.
    pub(super) fn chain_limit() -> Stop {
        Stop::new(Reason::ToolExecutionError, "decision chain limit")
    }
}

impl Generation<'_> {
    pub(super) fn at_chain_limit(&self) -> bool {
        self.ctx.chain_position >= self.engine.config.max_chain
    }

    /// When a decision raised now stops waiting for its answer; `None`: it never does.
    pub(super) fn decision_expiry(&self) -> Option<String> {
        self.engine.config.decision_ttl.map(|ttl| {
            humantime::format_rfc3339_millis(std::time::SystemTime::now() + ttl).to_string()
        })
    }

    /// Raises a worker signal that asks a manager to decide, and ends the request to wait for
    /// the answer. At the chain limit the signal still goes out, for the record, but without a
    /// decision to answer, and the request ends with `decision chain limit`.
    pub(super) async fn raise_decision(
        &mut self,
        signal_type: SignalType,
        code: &str,
        summary: String,
        meta: serde_json::Map<String, serde_json::Value>,
        decision: NewDecision,
    ) -> Stop {
        let mut signal = self.origin().signal(
            signal_type,
            code,
            SignalSource::Worker,
            Severity::Med,
            summary,
            meta,
        );
        let at_limit = self.at_chain_limit();
        if !at_limit {
            signal.decision = Some(DecisionBlock {
                decision_id: crate::protocol::ids::new_id(),
                question: decision.question,
                options: decision.options,
                default_option: decision.default_option,
                context: decision.context,
                kind: decision.kind,
                expires_at: self.decision_expiry(),
            });
        }
        self.push_worker_signal(signal).await;
        if at_limit {
            Stop::chain_limit()
        } else {
            Stop::plain(Reason::DecisionRequested)
        }
    }
}

fn option(id: &str, label: &str, pros: &str, cons: &str) -> DecisionOption {
    DecisionOption {
        id: id.into(),
        label: label.into(),
        pros: Some(pros.into()),
        cons: Some(cons.into()),
    }
}

/// What an escalation offers.
pub fn escalation_options() -> Vec<DecisionOption> {
    vec![
        option(
            "retry",
            "Run it again",
            "cheap; guidance and a confidence_boost can be added",
            "the same prompt may fall short the same way",
        ),
        option(
            "skip",
            "Skip this step",
            "the chain ends now; nothing more is spent",
            "this step's output stays below its checks",
        ),
        option(
            "abort",
            "Abort the job",
            "stops a job that is going wrong",
            "all work on it ends",
        ),
        option(
            "modify_prompt",
            "Run it again with a new prompt",
            "fixes a prompt that misleads the model",
            "needs modified_prompt, written by the manager",
        ),
    ]
}

/// What a checkpoint offers.
pub fn checkpoint_options() -> Vec<DecisionOption> {
    vec![
        option(
            "proceed",
            "Run it as asked",
            "the job goes on unchanged",
            "whatever the checkpoint guards against may happen",
        ),
        option(
            "skip",
            "Skip this step",
            "nothing runs; the chain ends",
            "the step's work is not done",
        ),
        option(
            "abort",
            "Abort the job",
            "nothing runs; the job is stopped",
            "all work on it ends",
        ),
        option(
            "modify_prompt",
            "Run it with a new prompt",
            "the step runs in a safer form",
            "needs modified_prompt, written by the manager",
        ),
    ]
}

/// The first and last part of a long text, for people.
pub(super) fn summarise(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let half = max / 2;
    let mut head = half;
    while !text.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = text.len() - half;
    while !text.is_char_boundary(tail) {
        tail += 1;
    }
    format!(
        "{} … [{} bytes left out] … {}",
        &text[..head],
        tail - head,
        &text[tail..]
    )
}
