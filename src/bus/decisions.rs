//! Decisions: a signal that awaits an answer is stored as a pending decision in KV bucket
//! `GENFLEET_DECISIONS` (key = decision id) before it is published; a manager answers on
//! `decisions.<decision_id>`. The answer is recorded with compare-and-set (one answer wins),
//! then a continuation request ("nuke and repave": the original task with the choice injected)
//! is published to the durable queue with `Nats-Msg-Id` = its id, so answering the same option
//! again returns the same continuation and publishing it again is deduplicated.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::kv;

use super::BusError;
use super::affinity::{Offer, offer_continuation, on_record};
use super::store::ensure_bucket;
use crate::client::subjects::Subjects;
use std::collections::HashMap;

use futures_util::StreamExt;

use std::sync::Arc;

use super::history::History;
use crate::engine::history::{HistoryEntry, HistoryOutcome};
use crate::observe::Metrics;
use crate::protocol::chain::ChainState;
pub use crate::protocol::decision::{
    Answer, CHAIN_HEADER, CHAIN_STATE_HEADER, ChainMark, DecisionRecord, DecisionReply,
    PARENT_HEADER, ROOT_HEADER, TRACE_LINK_HEADER,
};
use crate::protocol::ids::{new_id, now_rfc3339};
use crate::protocol::request::{AFFINITY_FALLBACK_HEADER, PREFERRED_WORKER_HEADER};
use crate::protocol::task::{
    DECISION_NOTE_PREFIX, GUIDANCE_NOTE_PREFIX, task_message_index, task_text,
};
use crate::protocol::text::clip_bytes;
pub use crate::protocol::{DecisionAnswer, DecisionOutcome};
use crate::protocol::{
    DecisionKind, ErrorCode, Event, EventBody, GenerationRequest, Message, Severity, Signal,
    SignalSource, SignalType, WireError,
};
use crate::schedule::Choice;
use crate::settings::Settings;
use crate::telemetry::KeyValue;

/// A decision could not be read, written or followed: one variant per operation.
#[derive(Debug, thiserror::Error)]
pub enum DecisionStoreError {
    #[error("cannot store the decision: {0}")]
    Record(String),
    #[error("cannot read the decision: {0}")]
    Read(String),
    #[error("unreadable decision record: {0}")]
    Unreadable(String),
    #[error("cannot expire the decision: {0}")]
    Expire(String),
    #[error("cannot follow the decisions bucket: {0}")]
    Follow(String),
    #[error("the queue did not take the continuation: {0}")]
    Continuation(String),
}

pub struct Decisions {
    pub bucket: kv::Store,
    /// The results bucket, where a request's mark (`cont.<request_id>`) says what became of
    /// the decision it raised.
    results: kv::Store,
    history: History,
    subjects: Subjects,
    answer_default_on_expiry: bool,
    max_pending_tracked: usize,
    metrics: Arc<Metrics>,
    /// Where a keyed continuation of this worker's pool goes by the fleet's rule (set once
    /// the worker's view of its pool exists).
    placer: std::sync::OnceLock<Placer>,
}

/// The fleet's placement as this worker sees its pool: `(pool, key)` → where a keyed request
/// goes, `None` when the pool is another or no worker has a free slot.
pub type Placer = Box<dyn Fn(&str, &str) -> Option<Choice> + Send + Sync>;

/// Who answers a decision that expired with a default option.
pub const TIMEOUT_DECIDER: &str = "timeout";

impl Decisions {
    pub async fn open(
        js: &async_nats::jetstream::Context,
        settings: &Settings,
        results: kv::Store,
        metrics: Arc<Metrics>,
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
            results,
            history: History::open(js, settings).await?,
            subjects: Subjects::new(&settings.subjects),
            answer_default_on_expiry: settings.decisions.answer_default_on_expiry,
            max_pending_tracked: 100_000,
            metrics,
            placer: std::sync::OnceLock::new(),
        })
    }

    /// Places keyed continuations with `placer` from now on.
    pub fn place_with(&self, placer: Placer) {
        let _ = self.placer.set(placer);
    }

    pub fn history(&self) -> &History {
        &self.history
    }

    /// Stores a pending decision before its signal goes out.
    pub async fn record(&self, record: &DecisionRecord) -> Result<(), DecisionStoreError> {
        let body = serde_json::to_vec(record).expect("records serialize");
        self.bucket
            .create(&record.decision_id, body.into())
            .await
            .map(|_| ())
            .map_err(|e| DecisionStoreError::Record(e.to_string()))
    }

    /// A decision's record and its revision.
    pub async fn get(
        &self,
        decision_id: &str,
    ) -> Result<Option<(DecisionRecord, u64)>, DecisionStoreError> {
        let entry = self
            .bucket
            .entry(decision_id)
            .await
            .map_err(|e| DecisionStoreError::Read(e.to_string()))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(None);
        };
        let record = serde_json::from_slice(&entry.value)
            .map_err(|e| DecisionStoreError::Unreadable(e.to_string()))?;
        Ok(Some((record, entry.revision)))
    }

    /// Answers a decision: validates, records the answer once (compare-and-set), then starts
    /// the continuation, or ends the chain for skip and abort; announces what happened and
    /// keeps it in the history. Returns the reply and the record as answered.
    pub async fn answer(
        &self,
        client: &async_nats::Client,
        worker_id: &str,
        decision_id: &str,
        answer: DecisionAnswer,
    ) -> Result<(DecisionReply, DecisionRecord), WireError> {
        self.answer_as(client, worker_id, decision_id, answer, false)
            .await
    }

    async fn answer_as(
        &self,
        client: &async_nats::Client,
        worker_id: &str,
        decision_id: &str,
        answer: DecisionAnswer,
        by_timeout: bool,
    ) -> Result<(DecisionReply, DecisionRecord), WireError> {
        let internal = |e: String| WireError::new(ErrorCode::Internal, e);
        let not_found = |why: &str| {
            WireError::new(ErrorCode::NotFound, format!("decision {decision_id} {why}"))
        };
        if !crate::protocol::ids::is_valid_request_id(decision_id) {
            return Err(WireError::invalid(
                "the subject does not end in a valid decision id",
            ));
        }
        loop {
            let Some((mut record, revision)) = self
                .get(decision_id)
                .await
                .map_err(|e| internal(e.to_string()))?
            else {
                return Err(not_found("is not known (or no longer kept)"));
            };
            let outcome = check_answer(&record, &answer)?;
            if let Some(given) = &record.answer {
                if given.choice.option_id != answer.option_id {
                    return Err(WireError::new(
                        ErrorCode::AlreadyDecided,
                        format!(
                            "this decision was already answered by {} at {} with option {}",
                            given
                                .choice
                                .decided_by
                                .as_deref()
                                .unwrap_or("someone unnamed"),
                            given.decided_at,
                            given.choice.option_id
                        ),
                    )
                    .with_detail(serde_json::json!({
                        "option_id": given.choice.option_id,
                        "decided_by": given.choice.decided_by,
                        "decided_at": given.decided_at,
                        "outcome": given.outcome,
                        "continuation_request_id": given.continuation_request_id,
                    })));
                }
                // The same answer again: publish the same continuation again (deduplicated by
                // the queue), which also repairs a crash between recording and publishing.
                self.publish_continuation(client, &record, given, record.traceparent.as_deref())
                    .await
                    .map_err(|e| internal(e.to_string()))?;
                self.mark(&record).await;
                let reply = DecisionReply {
                    decision_id: decision_id.into(),
                    continuation_request_id: given.continuation_request_id.clone(),
                    outcome: given.outcome,
                };
                return Ok((reply, record));
            }
            if record.expired_at.is_some() {
                return Err(not_found("expired unanswered"));
            }
            if !by_timeout && is_past(&record) {
                return Err(not_found("expired unanswered"));
            }
            let given = Answer {
                choice: answer.clone(),
                outcome,
                // The continuation belongs to the chain's tenant: its id on the bus is
                // qualified the same way.
                continuation_request_id: (outcome == DecisionOutcome::Continued).then(|| {
                    crate::protocol::schedule::qualified_id(record.tenant.as_deref(), &new_id())
                }),
                decided_at: now_rfc3339(),
            };
            record.answer = Some(given.clone());
            let body = serde_json::to_vec(&record).expect("records serialize");
            match self.bucket.update(decision_id, body.into(), revision).await {
                Ok(_) => {}
                // Someone answered meanwhile: read again and compare.
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(internal(format!("cannot record the answer: {e}"))),
            }
            let waited = trace_decision_wait(&record, Some(&given));
            let link = waited.as_deref().or(record.traceparent.as_deref());
            // The history entry is kept before the continuation starts: a continuation that
            // ends first (the chain's worker takes it at once) fills in the outcome of an
            // entry that exists, instead of finding none and being overwritten as pending.
            self.keep_in_history(&record, &given).await;
            self.publish_continuation(client, &record, &given, link)
                .await
                .map_err(|e| internal(e.to_string()))?;
            self.mark(&record).await;
            self.announce(client, worker_id, &record).await;
            let reply = DecisionReply {
                decision_id: decision_id.into(),
                continuation_request_id: given.continuation_request_id,
                outcome,
            };
            return Ok((reply, record));
        }
    }

    /// Ends a pending decision unanswered (DECISION_EXPIRED). Returns the record when this
    /// call expired it; `None` when it was not pending.
    pub async fn expire(
        &self,
        client: &async_nats::Client,
        worker_id: &str,
        decision_id: &str,
        why: &str,
    ) -> Result<Option<DecisionRecord>, DecisionStoreError> {
        loop {
            let Some((mut record, revision)) = self.get(decision_id).await? else {
                return Ok(None);
            };
            if !record.is_pending() {
                return Ok(None);
            }
            record.expired_at = Some(now_rfc3339());
            record
                .signal
                .meta
                .insert("expired_because".into(), why.into());
            let body = serde_json::to_vec(&record).expect("records serialize");
            match self.bucket.update(decision_id, body.into(), revision).await {
                Ok(_) => {
                    trace_decision_wait(&record, None);
                    self.mark(&record).await;
                    self.announce(client, worker_id, &record).await;
                    return Ok(Some(record));
                }
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(DecisionStoreError::Expire(e.to_string())),
            }
        }
    }

    /// Watches the bucket and deals with decisions whose `expires_at` passes unanswered: the
    /// default option is answered (`decided_by: "timeout"`) when there is one and
    /// `decisions.answer_default_on_expiry` holds, else the decision expires. Every worker
    /// runs this; compare-and-set lets one act.
    pub async fn sweep(&self, client: async_nats::Client, worker_id: String) {
        loop {
            if let Err(error) = self.sweep_watch(&client, &worker_id).await {
                tracing::warn!(message = "watching decisions for expiry failed; starting again", %error);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    async fn sweep_watch(
        &self,
        client: &async_nats::Client,
        worker_id: &str,
    ) -> Result<(), DecisionStoreError> {
        let mut watch = self
            .bucket
            .watch_all_from_revision(1)
            .await
            .map_err(|e| DecisionStoreError::Follow(e.to_string()))?;
        // decision id -> when it expires; only pending decisions with an expiry.
        let mut pending: HashMap<String, SystemTime> = HashMap::new();
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                entry = watch.next() => {
                    let Some(entry) = entry else { return Ok(()) };
                    let entry = entry.map_err(|e| DecisionStoreError::Follow(e.to_string()))?;
                    let record = (entry.operation == kv::Operation::Put)
                        .then(|| serde_json::from_slice::<DecisionRecord>(&entry.value).ok())
                        .flatten();
                    let expiry = record
                        .filter(DecisionRecord::is_pending)
                        .and_then(|r| r.decision.expires_at.as_deref().and_then(|t| humantime::parse_rfc3339(t).ok()));
                    match expiry {
                        Some(at) if pending.len() < self.max_pending_tracked => {
                            pending.insert(entry.key.clone(), at);
                        }
                        Some(_) => {
                            tracing::warn!(message = "too many pending decisions to track their expiry", decision_id = %entry.key);
                        }
                        None => {
                            pending.remove(&entry.key);
                        }
                    }
                    self.metrics.decisions_pending.set(pending.len() as i64);
                }
                _ = tick.tick() => {
                    let now = SystemTime::now();
                    let due: Vec<String> = pending
                        .iter()
                        .filter(|(_, at)| **at <= now)
                        .map(|(id, _)| id.clone())
                        .collect();
                    for id in due {
                        pending.remove(&id);
                        self.on_expiry(client, worker_id, &id).await;
                    }
                    self.metrics.decisions_pending.set(pending.len() as i64);
                }
            }
        }
    }

    async fn on_expiry(&self, client: &async_nats::Client, worker_id: &str, decision_id: &str) {
        let record = match self.get(decision_id).await {
            Ok(Some((record, _))) if record.is_pending() => record,
            Ok(_) => return,
            Err(error) => {
                tracing::warn!(message = "cannot read an expiring decision", %error, decision_id);
                return;
            }
        };
        if self.answer_default_on_expiry
            && let Some(default) = record.decision.default_option.clone()
        {
            let answer = DecisionAnswer {
                rationale: Some("nobody answered before the decision expired".into()),
                decided_by: Some(TIMEOUT_DECIDER.into()),
                ..DecisionAnswer::option(default)
            };
            match self
                .answer_as(client, worker_id, decision_id, answer, true)
                .await
            {
                Ok((reply, _)) => {
                    tracing::info!(
                        message = "answered an expired decision with its default",
                        decision_id,
                        outcome = reply.outcome.as_str()
                    );
                    return;
                }
                Err(error) if error.code == ErrorCode::AlreadyDecided => return,
                Err(error) => {
                    tracing::warn!(message = "could not answer an expired decision with its default; it expires", error = %error.message, decision_id);
                }
            }
        }
        match self
            .expire(
                client,
                worker_id,
                decision_id,
                "nobody answered before expires_at",
            )
            .await
        {
            Ok(Some(_)) => {
                tracing::info!(message = "a decision expired unanswered", decision_id);
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(message = "could not expire a decision", %error, decision_id);
            }
        }
    }

    async fn publish_continuation(
        &self,
        client: &async_nats::Client,
        record: &DecisionRecord,
        answer: &Answer,
        trace_link: Option<&str>,
    ) -> Result<(), DecisionStoreError> {
        let Some(id) = &answer.continuation_request_id else {
            return Ok(());
        };
        // The body and the subjects carry the bare id; the tenant's token qualifies it.
        let bare =
            crate::protocol::schedule::split_qualified(id).map_or(id.as_str(), |(_, bare)| bare);
        let request = continuation(record, &answer.choice, bare);
        let chain = continuation_chain(record, &answer.choice);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.as_str());
        headers.insert(PARENT_HEADER, record.request_id.as_str());
        headers.insert(ROOT_HEADER, record.root_request_id.as_str());
        headers.insert(
            CHAIN_HEADER,
            (record.chain_position + 1).to_string().as_str(),
        );
        headers.insert(CHAIN_STATE_HEADER, chain.to_header().as_str());
        if let Some(link) = trace_link {
            headers.insert(TRACE_LINK_HEADER, link);
        }
        let body: bytes::Bytes = serde_json::to_vec(&request)
            .expect("requests serialize")
            .into();
        // Affinity: a keyed chain goes where the fleet's rule puts its key (the worker that
        // ran it before, while that one is its key's worker and has a free slot). Any other
        // chain goes first to the worker that ran its previous request, which likely still
        // holds its conversation in its backend's cache. Without a free slot there, the queue
        // takes it at once.
        let previous = record.signal.worker_id.as_str();
        let keyed = request
            .affinity_key
            .as_deref()
            .and_then(|key| self.placer.get().and_then(|place| place(&record.pool, key)));
        let (target, preferred) = match &keyed {
            Some(choice) => (choice.worker.as_str(), choice.key_worker.as_str()),
            None => (previous, previous),
        };
        let mut offered = headers.clone();
        if !preferred.is_empty() {
            offered.insert(PREFERRED_WORKER_HEADER, preferred);
        }
        if let Some(passed_over) = keyed.as_ref().and_then(|c| c.passed_over) {
            offered.insert(AFFINITY_FALLBACK_HEADER, passed_over.as_str());
        }
        let offer = offer_continuation(
            client,
            &self.results,
            target,
            self.subjects
                .worker_submit(target, record.tenant.as_deref()),
            id,
            offered,
            body.clone(),
        )
        .await;
        if offer == Offer::Taken {
            return Ok(());
        }
        // A continuation on record has started somewhere (an earlier offer of the same answer
        // that went unanswered in time): queueing it again could only run it twice.
        if on_record(&self.results, id).await {
            return Ok(());
        }
        if !preferred.is_empty() {
            headers.insert(PREFERRED_WORKER_HEADER, preferred);
            headers.insert(AFFINITY_FALLBACK_HEADER, "busy");
        }
        // The chain keeps its band and its tenant.
        let subject =
            self.subjects
                .queue_for(&record.pool, request.band(), record.tenant.as_deref(), bare);
        let js = async_nats::jetstream::new(client.clone());
        js.publish_with_headers(subject, headers, body)
            .await
            .map_err(|e| DecisionStoreError::Continuation(e.to_string()))?
            .await
            .map_err(|e| DecisionStoreError::Continuation(e.to_string()))?;
        Ok(())
    }

    /// Notes on the asking request what became of its decision (its status shows it).
    async fn mark(&self, record: &DecisionRecord) {
        let mark = ChainMark {
            decision_id: record.decision_id.clone(),
            outcome: record
                .answer
                .as_ref()
                .map_or(DecisionOutcome::Expired, |a| a.outcome),
            continuation_request_id: record
                .answer
                .as_ref()
                .and_then(|a| a.continuation_request_id.clone()),
        };
        let body = serde_json::to_vec(&mark).expect("marks serialize");
        if let Err(error) = self
            .results
            .put(mark_key(&record.request_id), body.into())
            .await
        {
            tracing::warn!(message = "could not note the decision's outcome on its request", %error, request_id = %record.request_id);
        }
    }

    /// The decision a request raised and what became of it, if any.
    pub async fn mark_of(&self, request_id: &str) -> Option<ChainMark> {
        let value = self.results.get(mark_key(request_id)).await.ok()??;
        serde_json::from_slice(&value).ok()
    }

    /// Notes which decision a request raised (so a cancel finds it).
    pub async fn note_pending(&self, request_id: &str, decision_id: &str) {
        let mark = ChainMark {
            decision_id: decision_id.to_string(),
            outcome: DecisionOutcome::Pending,
            continuation_request_id: None,
        };
        let body = serde_json::to_vec(&mark).expect("marks serialize");
        let _ = self.results.put(mark_key(request_id), body.into()).await;
    }

    /// Tells the asking request's followers (`continued` or `chain_ended`) and the managers
    /// (an outcome signal) what became of the decision.
    async fn announce(
        &self,
        client: &async_nats::Client,
        worker_id: &str,
        record: &DecisionRecord,
    ) {
        let answer = record.answer.as_ref();
        let outcome = answer.map_or(DecisionOutcome::Expired, |a| a.outcome);
        let body = match answer.and_then(|a| a.continuation_request_id.clone()) {
            Some(continuation_request_id) => EventBody::Continued {
                continuation_request_id,
            },
            None => EventBody::ChainEnded {
                decision_id: record.decision_id.clone(),
                outcome,
                option_id: answer.map(|a| a.choice.option_id.clone()),
                decided_by: answer.and_then(|a| a.choice.decided_by.clone()),
            },
        };
        let event = Event {
            request_id: record.request_id.clone(),
            seq: record.continued_seq,
            ts: now_rfc3339(),
            body,
        };
        let _ = client
            .publish(
                self.subjects.events(&record.request_id),
                serde_json::to_vec(&event).expect("events serialize").into(),
            )
            .await;
        let mut meta = serde_json::Map::new();
        meta.insert("decision_id".into(), record.decision_id.clone().into());
        meta.insert("kind".into(), serde_json::json!(record.decision.kind));
        meta.insert("outcome".into(), outcome.as_str().into());
        let summary = match answer {
            Some(answer) => {
                let label = record
                    .decision
                    .options
                    .iter()
                    .find(|o| o.id == answer.choice.option_id)
                    .map(|o| o.label.clone())
                    .unwrap_or_default();
                meta.insert("option_id".into(), answer.choice.option_id.clone().into());
                meta.insert("decided_by".into(), answer.choice.decided_by.clone().into());
                meta.insert("rationale".into(), answer.choice.rationale.clone().into());
                meta.insert(
                    "continuation_request_id".into(),
                    answer.continuation_request_id.clone().into(),
                );
                format!(
                    "{} chose {label} ({})",
                    answer.choice.decided_by.as_deref().unwrap_or("a manager"),
                    answer.choice.option_id
                )
            }
            None => {
                let why = record
                    .signal
                    .meta
                    .get("expired_because")
                    .and_then(|v| v.as_str())
                    .unwrap_or("nobody answered in time")
                    .to_string();
                meta.insert("expired_because".into(), why.clone().into());
                format!("decision {} expired unanswered: {why}", record.decision_id)
            }
        };
        let signal = Signal {
            signal_id: new_id(),
            kind: SignalType::Outcome,
            code: outcome.signal_code().into(),
            source: SignalSource::Worker,
            severity: if outcome == DecisionOutcome::Continued {
                Severity::Low
            } else {
                Severity::Med
            },
            summary,
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
        let subject = self
            .subjects
            .signal(SignalType::Outcome, outcome.signal_code());
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

    async fn keep_in_history(&self, record: &DecisionRecord, answer: &Answer) {
        let number = |key: &str| record.signal.meta.get(key).and_then(|v| v.as_f64());
        let entry = HistoryEntry {
            decision_id: record.decision_id.clone(),
            code: record.signal.code.clone(),
            kind: record.decision.kind,
            job_name: record.request.job_name.clone(),
            pool: record.pool.clone(),
            request_id: record.request_id.clone(),
            root_request_id: record.root_request_id.clone(),
            chain_position: record.chain_position,
            confidence: number("confidence"),
            pass_rate: number("pass_rate"),
            prompt: clip_bytes(&task_text(&record.request.messages), 1000),
            question: record.decision.question.clone(),
            choice: DecisionAnswer {
                modified_prompt: (answer.choice.modified_prompt.as_deref())
                    .map(|p| clip_bytes(p, 1000)),
                ..answer.choice.clone()
            },
            decided_at: answer.decided_at.clone(),
            outcome: match answer.outcome {
                DecisionOutcome::Skipped => HistoryOutcome::Skipped,
                DecisionOutcome::Aborted => HistoryOutcome::Aborted,
                _ => HistoryOutcome::Pending,
            },
            continuation_request_id: answer.continuation_request_id.clone(),
            outcome_confidence: None,
            outcome_detail: None,
            outcome_at: None,
        };
        if let Err(error) = self.history.record(&entry).await {
            tracing::warn!(message = "an answered decision was not kept in the history", %error, decision_id = %record.decision_id);
        }
    }
}

/// The wait for a manager's answer, in the asking request's trace: from the decision's signal
/// to its answer (or its expiry). Returns its `traceparent` (the continuation's trace links to
/// it).
fn trace_decision_wait(record: &DecisionRecord, answer: Option<&Answer>) -> Option<String> {
    if !crate::telemetry::exporting() {
        return None;
    }
    let now = SystemTime::now();
    let asked = humantime::parse_rfc3339_weak(&record.signal.ts).unwrap_or(now);
    let mut attributes = vec![
        KeyValue::new("genfleet.decision_id", record.decision_id.clone()),
        KeyValue::new("genfleet.request_id", record.request_id.clone()),
        KeyValue::new("genfleet.pool", record.pool.clone()),
    ];
    match answer {
        Some(answer) => {
            attributes.push(KeyValue::new(
                "genfleet.decision.option_id",
                answer.choice.option_id.clone(),
            ));
            attributes.push(KeyValue::new(
                "genfleet.decision.outcome",
                answer.outcome.as_str(),
            ));
            if let Some(by) = &answer.choice.decided_by {
                attributes.push(KeyValue::new("genfleet.decision.decided_by", by.clone()));
            }
            if let Some(id) = &answer.continuation_request_id {
                attributes.push(KeyValue::new(
                    "genfleet.continuation_request_id",
                    id.clone(),
                ));
            }
        }
        None => attributes.push(KeyValue::new(
            "genfleet.decision.outcome",
            DecisionOutcome::Expired.as_str(),
        )),
    }
    crate::telemetry::record_interval(
        "genfleet.decision_wait",
        record.traceparent.as_deref(),
        asked,
        now,
        attributes,
    )
}

fn mark_key(request_id: &str) -> String {
    format!("cont.{request_id}")
}

fn is_past(record: &DecisionRecord) -> bool {
    record
        .decision
        .expires_at
        .as_deref()
        .and_then(|t| humantime::parse_rfc3339(t).ok())
        .is_some_and(|t| t < SystemTime::now())
}

/// Checks an answer against its decision; returns what it does to the chain.
fn check_answer(
    record: &DecisionRecord,
    answer: &DecisionAnswer,
) -> Result<DecisionOutcome, WireError> {
    let valid: Vec<&str> = record
        .decision
        .options
        .iter()
        .map(|o| o.id.as_str())
        .collect();
    if !valid.contains(&answer.option_id.as_str()) {
        return Err(WireError::new(
            ErrorCode::InvalidOption,
            format!(
                "{:?} is not an option of this decision (valid: {})",
                answer.option_id,
                valid.join(", ")
            ),
        )
        .with_detail(serde_json::json!({ "valid_options": valid })));
    }
    let extras = answer.modified_prompt.is_some()
        || answer.guidance.is_some()
        || answer.confidence_boost.is_some();
    if record.decision.kind == DecisionKind::Model {
        if extras {
            return Err(WireError::invalid(
                "modified_prompt, guidance and confidence_boost apply to escalations and checkpoints only",
            ));
        }
        return Ok(DecisionOutcome::Continued);
    }
    let outcome = match answer.option_id.as_str() {
        "skip" => DecisionOutcome::Skipped,
        "abort" => DecisionOutcome::Aborted,
        _ => DecisionOutcome::Continued,
    };
    let modifies = answer.option_id == "modify_prompt";
    match &answer.modified_prompt {
        None if modifies => {
            return Err(WireError::invalid(
                "option modify_prompt needs modified_prompt (the new text of the last user message)",
            ));
        }
        Some(_) if !modifies => {
            return Err(WireError::invalid(
                "modified_prompt goes with option modify_prompt only",
            ));
        }
        Some(prompt) if prompt.trim().is_empty() => {
            return Err(WireError::invalid("modified_prompt must not be empty"));
        }
        _ => {}
    }
    if outcome != DecisionOutcome::Continued
        && (answer.guidance.is_some() || answer.confidence_boost.is_some())
    {
        return Err(WireError::invalid(
            "guidance and confidence_boost apply to options that continue the chain, not to skip or abort",
        ));
    }
    if let Some(boost) = answer.confidence_boost
        && !(boost.is_finite() && (0.0..=1.0).contains(&boost))
    {
        return Err(WireError::invalid(
            "confidence_boost must be between 0 and 1",
        ));
    }
    Ok(outcome)
}

/// What the continuation carries from its chain: the asking request's state, the answer's
/// boost, a confirmed checkpoint, and the decision it comes from.
pub fn continuation_chain(record: &DecisionRecord, answer: &DecisionAnswer) -> ChainState {
    let mut chain = record.chain.clone();
    chain.decision_id = Some(record.decision_id.clone());
    chain.decision_code = Some(record.signal.code.clone());
    chain.confidence_boost = answer.confidence_boost.unwrap_or(0.0);
    match record.decision.kind {
        DecisionKind::Checkpoint => {
            if let Some(name) = record
                .signal
                .meta
                .get("checkpoint")
                .and_then(|v| v.as_str())
                && !chain.checkpoint_passed(name)
            {
                chain.checkpoints_passed.push(name.to_string());
            }
        }
        DecisionKind::Escalation => chain.note_decision(&format!(
            "{} by {}",
            answer.option_id,
            answer.decided_by.as_deref().unwrap_or("a manager")
        )),
        DecisionKind::Model => {}
    }
    chain
}

/// The continuation: the original caller system and messages (the last user message replaced
/// by `modified_prompt`), plus the choice and any guidance, with a fresh request id and a
/// fresh tool budget.
pub fn continuation(
    record: &DecisionRecord,
    answer: &DecisionAnswer,
    id: &str,
) -> GenerationRequest {
    let mut request = record.request.clone();
    request.request_id = Some(id.to_string());
    if let Some(prompt) = &answer.modified_prompt {
        match task_message_index(&request.messages) {
            Some(i) => request.messages[i] = Message::user(prompt.clone()),
            None => request.messages.push(Message::user(prompt.clone())),
        }
    }
    let label = record
        .decision
        .options
        .iter()
        .find(|o| o.id == answer.option_id)
        .map(|o| o.label.as_str())
        .unwrap_or("");
    let mut text = format!("{DECISION_NOTE_PREFIX} {label} ({})", answer.option_id);
    if let Some(rationale) = &answer.rationale {
        text.push_str(&format!("\nRationale: {rationale}"));
    }
    text.push_str(&format!("\nThe question was: {}", record.decision.question));
    if let Some(context) = &record.decision.context {
        text.push_str(&format!("\nContext: {context}"));
    }
    text.push_str("\nProceed with the task using this decision.");
    request.messages.push(Message::user(text));
    if let Some(guidance) = &answer.guidance {
        request
            .messages
            .push(Message::user(format!("{GUIDANCE_NOTE_PREFIX} {guidance}")));
    }
    request
}
