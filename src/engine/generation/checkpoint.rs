//! Checkpoints: rules a request carries for holding itself before it runs, when its prompt names
//! something (or its place in the chain is reached) that a manager should see first.
//!
//! They are checked before the first backend call, so nothing is spent on a request a manager
//! may refuse; one that needs no confirmation only signals. A chain does not fire again a
//! checkpoint it has passed.

use serde_json::json;

use crate::protocol::{DecisionKind, Role, Severity, SignalType};

use super::Generation;
use super::decision::{NewDecision, checkpoint_options, summarise};
use super::ending::Stop;

impl Generation<'_> {
    /// Fires the first checkpoint whose conditions hold (and that the chain has not passed):
    /// with confirmation the request ends at once with a decision request; without, it only
    /// signals.
    pub(super) async fn checkpoint(&mut self) -> Option<Stop> {
        let texts: Vec<String> = self
            .request
            .system
            .iter()
            .cloned()
            .chain(
                self.request
                    .messages
                    .iter()
                    .filter(|m| m.role == Role::User)
                    .map(|m| m.text().into_owned()),
            )
            .map(|t| t.to_lowercase())
            .collect();
        let position = self.ctx.chain_position;
        let (checkpoint, matched) = self.request.checkpoints.iter().find_map(|c| {
            if self.ctx.chain.checkpoint_passed(&c.name)
                || c.min_attempt.is_some_and(|n| position < n)
            {
                return None;
            }
            let matched: Vec<String> = c
                .prompt_contains
                .iter()
                .filter(|k| {
                    let k = k.to_lowercase();
                    texts.iter().any(|t| t.contains(&k))
                })
                .cloned()
                .collect();
            (c.prompt_contains.is_empty() || !matched.is_empty()).then(|| (c.clone(), matched))
        })?;
        let mut meta = serde_json::Map::new();
        meta.insert("checkpoint".into(), json!(checkpoint.name));
        meta.insert("matched".into(), json!(matched));
        meta.insert("chain_position".into(), json!(position));
        if let Some(n) = checkpoint.min_attempt {
            meta.insert("min_attempt".into(), json!(n));
        }
        if let Some(message) = &checkpoint.message {
            meta.insert("message".into(), json!(message));
        }
        meta.insert(
            "prompt".into(),
            json!(summarise(
                &crate::protocol::task::task_text(&self.request.messages),
                2000
            )),
        );
        let why = if matched.is_empty() {
            String::new()
        } else {
            format!(" (the prompt mentions {})", matched.join(", "))
        };
        if !checkpoint.requires_confirmation {
            let summary = format!(
                "checkpoint {} passed without confirmation{why}",
                checkpoint.name
            );
            self.worker_signal("CHECKPOINT", Severity::Low, summary, meta.into())
                .await;
            return None;
        }
        let summary = format!(
            "checkpoint {} asks for confirmation before the request runs{why}",
            checkpoint.name
        );
        let question = checkpoint.message.clone().unwrap_or_else(|| {
            format!(
                "Checkpoint {}: should this request run{why}?",
                checkpoint.name
            )
        });
        let decision = NewDecision {
            kind: DecisionKind::Checkpoint,
            question,
            options: checkpoint_options(),
            default_option: self
                .engine
                .config
                .escalation
                .checkpoint_default_option
                .clone(),
            context: checkpoint.message.clone(),
        };
        let stop = self
            .raise_decision(
                SignalType::DecisionRequest,
                "CHECKPOINT",
                summary,
                meta,
                decision,
            )
            .await;
        Some(stop)
    }
}
