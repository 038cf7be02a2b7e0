//! Decisions: a signal that awaits an answer is stored as a pending decision in KV bucket
//! `GENFLEET_DECISIONS` (key = decision id) before it is published; a manager answers on
//! `decisions.<decision_id>`. The answer is recorded with compare-and-set (one answer wins),
//! then a continuation request ("nuke and repave": the original task with the choice injected)
//! is published to the durable queue with `Nats-Msg-Id` = its id, so answering the same option
//! again returns the same continuation and publishing it again is deduplicated.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};

use super::BusError;
use super::store::ensure_bucket;
use super::subjects::Subjects;
use crate::engine::chain::ChainState;
use crate::protocol::ids::{new_id, now_rfc3339};
use crate::protocol::{
    DecisionBlock, ErrorCode, Event, EventBody, GenerationRequest, Message, Severity, Signal,
    SignalSource, SignalType, WireError,
};
use crate::settings::Settings;

/// Queue message headers that place a continuation in its chain (the request body stays the
/// caller-facing request).
pub const PARENT_HEADER: &str = "Genfleet-Parent-Request-Id";
pub const ROOT_HEADER: &str = "Genfleet-Root-Request-Id";
pub const CHAIN_HEADER: &str = "Genfleet-Chain-Position";

/// The record of a decision in the bucket (documented in docs/protocol.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    pub decision_id: String,
    pub request_id: String,
    pub root_request_id: String,
    pub chain_position: u32,
    pub pool: String,
    pub decision: DecisionBlock,
    /// The signal as published.
    pub signal: Signal,
    /// The request that asked, to restate it in the continuation.
    pub request: GenerationRequest,
    /// The `seq` the `continued` (or `chain_ended`) event takes on the asking request's
    /// events subject.
    pub continued_seq: u64,
    /// What the asking request carried from earlier in its chain.
    #[serde(default)]
    pub chain: ChainState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<Answer>,
    /// Set when the decision expired unanswered (DECISION_EXPIRED).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expired_at: Option<String>,
}

impl DecisionRecord {
    /// Still waiting for an answer: neither answered nor expired.
    pub fn is_pending(&self) -> bool {
        self.answer.is_none() && self.expired_at.is_none()
    }
}

/// What an answer did to the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionOutcome {
    /// A continuation request was started.
    Continued,
    /// The chain ended: the step was skipped.
    Skipped,
    /// The chain ended: the job was aborted.
    Aborted,
}

impl DecisionOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionOutcome::Continued => "continued",
            DecisionOutcome::Skipped => "skipped",
            DecisionOutcome::Aborted => "aborted",
        }
    }
}

/// The answer a decision got, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub option_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rationale: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modified_prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guidance: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence_boost: Option<f64>,
    pub outcome: DecisionOutcome,
    /// The continuation it started (`continued` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation_request_id: Option<String>,
    pub decided_at: String,
}

/// A manager's answer on `decisions.<decision_id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionAnswer {
    pub option_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rationale: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modified_prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guidance: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence_boost: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionReply {
    pub decision_id: String,
    pub continuation_request_id: Option<String>,
    /// `continued`, or `skipped` / `aborted` for the options that end a chain.
    pub outcome: DecisionOutcome,
}

pub struct Decisions {
    pub bucket: kv::Store,
    subjects: Subjects,
    gen_prefix: String,
}

impl Decisions {
    pub async fn open(
        js: &async_nats::jetstream::Context,
        settings: &Settings,
    ) -> Result<Decisions, BusError> {
        let ttl = Duration::from_millis(
            settings
                .decisions
                .ttl_ms
                .max(settings.jetstream.results_ttl_ms),
        );
        // Answers outlive the decision a while, so a repeated answer still finds its
        // continuation.
        let bucket = ensure_bucket(
            js,
            &settings.decisions.bucket,
            1,
            ttl * 2,
            settings.jetstream.replicas,
        )
        .await?;
        Ok(Decisions {
            bucket,
            subjects: Subjects::new(&settings.subjects),
            gen_prefix: settings.subjects.gen_prefix.clone(),
        })
    }

    /// Stores a pending decision before its signal goes out.
    pub async fn record(&self, record: &DecisionRecord) -> Result<(), BusError> {
        let body = serde_json::to_vec(record).expect("records serialize");
        self.bucket
            .create(&record.decision_id, body.into())
            .await
            .map(|_| ())
            .map_err(|e| BusError::Store(format!("cannot store the decision: {e}")))
    }

    /// Answers a decision (returning the reply and the asking request's id): validates, records the answer once, publishes the continuation and
    /// the `continued` event and the outcome signal.
    pub async fn answer(
        &self,
        client: &async_nats::Client,
        worker_id: &str,
        decision_id: &str,
        answer: DecisionAnswer,
    ) -> Result<(DecisionReply, String), WireError> {
        let internal = |e: String| WireError::new(ErrorCode::Internal, e);
        let not_found = || {
            WireError::new(
                ErrorCode::NotFound,
                format!("no pending decision {decision_id}"),
            )
        };
        if !crate::protocol::ids::is_valid_request_id(decision_id) {
            return Err(WireError::invalid(
                "the subject does not end in a valid decision id",
            ));
        }
        loop {
            let entry = self
                .bucket
                .entry(decision_id)
                .await
                .map_err(|e| internal(e.to_string()))?;
            let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
                return Err(not_found());
            };
            let mut record: DecisionRecord = serde_json::from_slice(&entry.value)
                .map_err(|e| internal(format!("unreadable decision record: {e}")))?;
            let valid: Vec<&str> = record
                .decision
                .options
                .iter()
                .map(|o| o.id.as_str())
                .collect();
            if !valid.contains(&answer.option_id.as_str()) {
                return Err(WireError::new(
                    ErrorCode::InvalidOption,
                    format!("{:?} is not an option of this decision", answer.option_id),
                )
                .with_detail(serde_json::json!({ "valid_options": valid })));
            }
            if answer.modified_prompt.is_some()
                || answer.guidance.is_some()
                || answer.confidence_boost.is_some()
            {
                return Err(WireError::invalid(
                    "modified_prompt, guidance and confidence_boost apply to escalations and checkpoints only",
                ));
            }
            if let Some(given) = &record.answer {
                if given.option_id != answer.option_id {
                    return Err(WireError::new(
                        ErrorCode::AlreadyDecided,
                        "this decision was already answered",
                    )
                    .with_detail(serde_json::json!({
                        "option_id": given.option_id,
                        "decided_by": given.decided_by,
                        "continuation_request_id": given.continuation_request_id,
                    })));
                }
                // The same answer again: publish the same continuation again (deduplicated by
                // the queue), which also repairs a crash between recording and publishing.
                let continuation = given.continuation_request_id.clone();
                let outcome = given.outcome;
                self.publish_continuation(client, &record, given)
                    .await
                    .map_err(|e| internal(e.to_string()))?;
                let reply = DecisionReply {
                    decision_id: decision_id.into(),
                    continuation_request_id: continuation,
                    outcome,
                };
                return Ok((reply, record.request_id));
            }
            if record
                .decision
                .expires_at
                .as_deref()
                .and_then(|t| humantime::parse_rfc3339(t).ok())
                .is_some_and(|t| t < SystemTime::now())
            {
                return Err(WireError::new(
                    ErrorCode::NotFound,
                    format!("decision {decision_id} expired"),
                ));
            }
            let given = Answer {
                option_id: answer.option_id.clone(),
                rationale: answer.rationale.clone(),
                decided_by: answer.decided_by.clone(),
                modified_prompt: None,
                guidance: None,
                confidence_boost: None,
                outcome: DecisionOutcome::Continued,
                continuation_request_id: Some(new_id()),
                decided_at: now_rfc3339(),
            };
            record.answer = Some(given.clone());
            let body = serde_json::to_vec(&record).expect("records serialize");
            match self
                .bucket
                .update(decision_id, body.into(), entry.revision)
                .await
            {
                Ok(_) => {}
                // Someone answered meanwhile: read again and compare.
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(internal(format!("cannot record the answer: {e}"))),
            }
            self.publish_continuation(client, &record, &given)
                .await
                .map_err(|e| internal(e.to_string()))?;
            self.announce(client, worker_id, &record, &given).await;
            let reply = DecisionReply {
                decision_id: decision_id.into(),
                continuation_request_id: given.continuation_request_id,
                outcome: DecisionOutcome::Continued,
            };
            return Ok((reply, record.request_id));
        }
    }

    async fn publish_continuation(
        &self,
        client: &async_nats::Client,
        record: &DecisionRecord,
        answer: &Answer,
    ) -> Result<(), BusError> {
        let Some(id) = &answer.continuation_request_id else {
            return Ok(());
        };
        let request = continuation(record, answer, id);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.as_str());
        headers.insert(PARENT_HEADER, record.request_id.as_str());
        headers.insert(ROOT_HEADER, record.root_request_id.as_str());
        headers.insert(
            CHAIN_HEADER,
            (record.chain_position + 1).to_string().as_str(),
        );
        let subject = format!("{}.queue.{}.{id}", self.gen_prefix, record.pool);
        let js = async_nats::jetstream::new(client.clone());
        js.publish_with_headers(
            subject,
            headers,
            serde_json::to_vec(&request)
                .expect("requests serialize")
                .into(),
        )
        .await
        .map_err(|e| BusError::Store(e.to_string()))?
        .await
        .map_err(|e| BusError::Store(format!("the queue did not take the continuation: {e}")))?;
        Ok(())
    }

    /// The `continued` event on the asking request's subject and the outcome signal.
    async fn announce(
        &self,
        client: &async_nats::Client,
        worker_id: &str,
        record: &DecisionRecord,
        answer: &Answer,
    ) {
        let event = Event {
            request_id: record.request_id.clone(),
            seq: record.continued_seq,
            ts: now_rfc3339(),
            body: EventBody::Continued {
                continuation_request_id: answer.continuation_request_id.clone().unwrap_or_default(),
            },
        };
        let _ = client
            .publish(
                self.subjects.events(&record.request_id),
                serde_json::to_vec(&event).expect("events serialize").into(),
            )
            .await;
        let label = record
            .decision
            .options
            .iter()
            .find(|o| o.id == answer.option_id)
            .map(|o| o.label.clone())
            .unwrap_or_default();
        let mut meta = serde_json::Map::new();
        meta.insert("decision_id".into(), record.decision_id.clone().into());
        meta.insert("option_id".into(), answer.option_id.clone().into());
        meta.insert("decided_by".into(), answer.decided_by.clone().into());
        meta.insert("rationale".into(), answer.rationale.clone().into());
        meta.insert(
            "continuation_request_id".into(),
            answer.continuation_request_id.clone().into(),
        );
        let signal = Signal {
            signal_id: new_id(),
            kind: SignalType::Outcome,
            code: "DECIDED".into(),
            source: SignalSource::Worker,
            severity: Severity::Low,
            summary: format!(
                "{} chose {label} ({})",
                answer.decided_by.as_deref().unwrap_or("a manager"),
                answer.option_id
            ),
            meta,
            request_id: record.request_id.clone(),
            root_request_id: record.root_request_id.clone(),
            job_name: record.request.job_name.clone(),
            worker_id: worker_id.to_string(),
            pool: record.pool.clone(),
            ts: now_rfc3339(),
            decision: None,
        };
        let js = async_nats::jetstream::new(client.clone());
        let subject = self.subjects.signal(SignalType::Outcome, "DECIDED");
        if let Ok(ack) = js
            .publish(
                subject,
                serde_json::to_vec(&signal)
                    .expect("signals serialize")
                    .into(),
            )
            .await
        {
            let _ = ack.await;
        }
    }
}

/// The continuation: the original caller system and messages, plus the choice, a fresh
/// request id and a fresh tool budget.
pub fn continuation(record: &DecisionRecord, answer: &Answer, id: &str) -> GenerationRequest {
    let mut request = record.request.clone();
    request.request_id = Some(id.to_string());
    let label = record
        .decision
        .options
        .iter()
        .find(|o| o.id == answer.option_id)
        .map(|o| o.label.as_str())
        .unwrap_or("");
    let mut text = format!("Decision chosen: {label} ({})", answer.option_id);
    if let Some(rationale) = &answer.rationale {
        text.push_str(&format!("\nRationale: {rationale}"));
    }
    text.push_str(&format!(
        "\nThe question was: {}\nProceed with the task using this decision.",
        record.decision.question
    ));
    request.messages.push(Message::user(text));
    request
}
