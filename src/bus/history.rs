//! The decision history in JetStream: every answered decision with its outcome, kept in KV
//! bucket `GENFLEET_HISTORY` (key `<code>.<decision_id>`), so it survives restarts and every
//! worker reads the same one. The bucket holds at most `decisions.history_max_entries`
//! entries (the oldest go first) for `decisions.history_ttl_ms`.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;

use super::BusError;
use crate::client::streams::{Cap, ensure_capped_bucket};
use crate::engine::history::{DecisionHistory, HistoryEntry, HistoryOutcome};
use crate::protocol::ids::now_rfc3339;
use crate::protocol::{GenerationResult, Reason, RequestState};
use crate::settings::Settings;

/// How long reading the history for one escalation may take.
const READ_WAIT: Duration = Duration::from_secs(2);

/// The history could not be read or written: one variant per operation.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("cannot keep the decision in the history: {0}")]
    Keep(String),
    #[error("cannot read the history: {0}")]
    Read(String),
    #[error("cannot give the history entry its outcome: {0}")]
    SetOutcome(String),
    #[error("the history entry {0} kept changing")]
    Contended(String),
}

#[derive(Clone)]
pub struct History {
    bucket: kv::Store,
    stream: stream::Stream,
    name: String,
    scan_max: usize,
}

pub fn key(code: &str, decision_id: &str) -> String {
    format!("{code}.{decision_id}")
}

impl History {
    pub async fn open(js: &jetstream::Context, settings: &Settings) -> Result<History, BusError> {
        let d = &settings.decisions;
        let name = d.history_bucket.clone();
        // A bucket whose oldest entries give way (discard old), unlike the other buckets.
        let bucket = ensure_capped_bucket(
            js,
            &name,
            "decision history",
            Cap {
                max_entries: d.history_max_entries,
                max_age: Duration::from_millis(d.history_ttl_ms),
                replicas: settings.jetstream.replicas,
            },
        )
        .await?;
        let stream = js
            .get_stream(format!("KV_{name}"))
            .await
            .map_err(|e| BusError::Setup(format!("cannot open the history stream: {e}")))?;
        Ok(History {
            bucket,
            stream,
            name,
            scan_max: d.history_scan_max,
        })
    }

    /// Keeps an answered decision.
    pub async fn record(&self, entry: &HistoryEntry) -> Result<(), HistoryError> {
        let body = serde_json::to_vec(entry).expect("history entries serialize");
        self.bucket
            .put(key(&entry.code, &entry.decision_id), body.into())
            .await
            .map(|_| ())
            .map_err(|e| HistoryError::Keep(e.to_string()))
    }

    /// One entry.
    pub async fn get(
        &self,
        code: &str,
        decision_id: &str,
    ) -> Result<Option<HistoryEntry>, HistoryError> {
        let value = self
            .bucket
            .get(key(code, decision_id))
            .await
            .map_err(|e| HistoryError::Read(e.to_string()))?;
        Ok(value.and_then(|v| serde_json::from_slice(&v).ok()))
    }

    /// Gives a decision the outcome of the continuation it started.
    pub async fn set_outcome(
        &self,
        code: &str,
        decision_id: &str,
        result: &GenerationResult,
    ) -> Result<(), HistoryError> {
        let key = key(code, decision_id);
        for _ in 0..3 {
            let Some(entry) = self
                .bucket
                .entry(&key)
                .await
                .map_err(|e| HistoryError::SetOutcome(e.to_string()))?
                .filter(|e| e.operation == kv::Operation::Put)
            else {
                // Aged out of the history: nothing to fill in.
                return Ok(());
            };
            let Ok(mut record) = serde_json::from_slice::<HistoryEntry>(&entry.value) else {
                return Ok(());
            };
            record.outcome = outcome_of(result);
            record.continuation_request_id = Some(result.request_id.clone());
            record.outcome_confidence = result.validation.as_ref().map(|v| v.confidence);
            record.outcome_detail = Some(format!(
                "{} {}",
                result.state.as_str(),
                result.reason.as_str()
            ));
            record.outcome_at = Some(now_rfc3339());
            let body = serde_json::to_vec(&record).expect("history entries serialize");
            match self.bucket.update(&key, body.into(), entry.revision).await {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(HistoryError::SetOutcome(e.to_string())),
            }
        }
        Err(HistoryError::Contended(key))
    }

    /// Every entry of one code (the newest value of each), at most `scan_max`.
    pub async fn entries_of(&self, code: &str) -> Result<Vec<HistoryEntry>, HistoryError> {
        let store = HistoryError::Read;
        let consumer = self
            .stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: format!("$KV.{}.{code}.>", self.name),
                deliver_policy: consumer::DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await
            .map_err(|e| store(e.to_string()))?;
        let pending = consumer.cached_info().num_pending as usize;
        let wanted = pending.min(self.scan_max);
        let mut entries = Vec::with_capacity(wanted);
        if wanted == 0 {
            return Ok(entries);
        }
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| store(e.to_string()))?;
        while entries.len() < wanted {
            let Some(message) = messages.next().await else {
                break;
            };
            let message = message.map_err(|e| store(e.to_string()))?;
            if let Ok(entry) = serde_json::from_slice::<HistoryEntry>(&message.payload) {
                entries.push(entry);
            }
            if message.info().map(|i| i.pending == 0).unwrap_or(true) {
                break;
            }
        }
        Ok(entries)
    }
}

impl DecisionHistory for History {
    fn entries(&self, code: &str) -> BoxFuture<'static, Vec<HistoryEntry>> {
        let history = self.clone();
        let code = code.to_string();
        Box::pin(async move {
            match tokio::time::timeout(READ_WAIT, history.entries_of(&code)).await {
                Ok(Ok(entries)) => entries,
                Ok(Err(error)) => {
                    tracing::warn!(message = "no suggestions: the history could not be read", %error);
                    Vec::new()
                }
                Err(_) => {
                    tracing::warn!(message = "no suggestions: the history did not answer in time");
                    Vec::new()
                }
            }
        })
    }
}

/// Success: the continuation completed and its output passed its checks (or had none).
pub fn outcome_of(result: &GenerationResult) -> HistoryOutcome {
    let completed = result.state == RequestState::Completed
        && matches!(result.reason, Reason::Stop | Reason::Length);
    let checks_passed = result.validation.as_ref().is_none_or(|v| v.passed);
    if completed && checks_passed {
        HistoryOutcome::Success
    } else {
        HistoryOutcome::Failure
    }
}
