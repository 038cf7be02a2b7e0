//! Decisions on the worker's side: a pending decision put on record before its signal goes
//! out, and managers' answers on `decisions.<decision_id>`.

use std::sync::Arc;

use futures_util::StreamExt;

use super::shared::{Shared, hold_of, spawn_handler};
use crate::client::reply::{decode, guarded, respond};
use crate::client::subjects::Subjects;
use crate::protocol::DecisionAnswer;
use crate::protocol::decision::{DecisionRecord, DecisionReply};
use crate::protocol::{DecisionBlock, Signal, WireError};

/// Largest answer body read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Stores a pending decision before its signal goes out, so a fast manager finds it.
pub(super) async fn record_decision(
    shared: &Shared,
    signal: &Signal,
    decision: &DecisionBlock,
    seq: u64,
) {
    let Some(hold) = hold_of(shared, &signal.request_id).await else {
        tracing::warn!(message = "a decision for a request not running here was not recorded", request_id = %signal.request_id);
        return;
    };
    let asked = hold.asked.clone();
    // The engine adds this request's failed tries to the error history it reports.
    let mut chain = asked.chain;
    if let Some(history) = signal
        .meta
        .get("error_history")
        .and_then(|h| serde_json::from_value(h.clone()).ok())
    {
        chain.error_history = history;
    }
    shared
        .decisions
        .note_pending(&signal.request_id, &decision.decision_id)
        .await;
    let record = DecisionRecord {
        decision_id: decision.decision_id.clone(),
        request_id: signal.request_id.clone(),
        root_request_id: asked.root_request_id,
        chain_position: asked.chain_position,
        pool: signal.pool.clone(),
        decision: decision.clone(),
        signal: signal.clone(),
        request: asked.request,
        // A decision request ends the generation: its signal is the generation's last event,
        // `finished` follows, and `continued` comes after that.
        continued_seq: seq + 2,
        chain,
        tenant: hold.live.tenant.clone(),
        answer: None,
        expired_at: None,
        traceparent: hold.trace.traceparent().map(str::to_string),
    };
    if let Err(error) = shared.decisions.record(&record).await {
        tracing::error!(message = "could not store a pending decision", %error, decision_id = %record.decision_id);
    }
}

/// Answers managers' decisions (queue group: one worker answers each).
pub(super) async fn serve_answers(shared: Arc<Shared>, mut sub: async_nats::Subscriber) {
    while let Some(message) = sub.next().await {
        let shared2 = shared.clone();
        spawn_handler(&shared, async move {
            let decision_id = Subjects::request_id_of(&message.subject).to_string();
            let reply = guarded(answer(&shared2, &decision_id, &message)).await;
            respond(&shared2.client, &message, reply).await;
        })
        .await;
    }
}

async fn answer(
    shared: &Shared,
    decision_id: &str,
    message: &async_nats::Message,
) -> Result<DecisionReply, WireError> {
    let answer: DecisionAnswer = decode(message, MAX_ANSWER_BYTES)?;
    let (reply, _) = shared
        .decisions
        .answer(&shared.client, &shared.worker_id, decision_id, answer)
        .await?;
    Ok(reply)
}
