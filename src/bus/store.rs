//! JetStream streams and key-value buckets: created on start when absent, never changed or
//! deleted (a worker must not touch user data), with settings that work on nats-server 2.9.
//!
//! Buckets are created through their stream (`KV_<bucket>`) rather than `create_key_value`,
//! whose account query fails to parse a 2.9 server's reply; `get_key_value` then opens them.

use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};
use serde::{Deserialize, Serialize};

use super::BusError;
use crate::protocol::ids::now_rfc3339;
use crate::protocol::{FinishedSummary, GenerationResult, RequestState};
use crate::settings::{JetStreamSettings, SubjectSettings};

/// The streams and buckets a worker uses.
#[derive(Clone)]
pub struct Stores {
    pub jetstream: jetstream::Context,
    pub results: kv::Store,
    pub queue: stream::Stream,
    /// Summaries of finished requests, for people.
    pub finished: kv::Store,
}

impl Stores {
    pub async fn ensure(
        jetstream: jetstream::Context,
        settings: &JetStreamSettings,
        subjects: &SubjectSettings,
    ) -> Result<Stores, BusError> {
        let ttl = Duration::from_millis(settings.results_ttl_ms);
        let results = ensure_bucket(
            &jetstream,
            &settings.results_bucket,
            1,
            ttl,
            settings.replicas,
        )
        .await?;
        ensure_stream(
            &jetstream,
            stream::Config {
                name: settings.signals_stream.clone(),
                description: Some("genfleet signals for managers".into()),
                subjects: vec![format!("{}.>", subjects.signals_prefix)],
                retention: stream::RetentionPolicy::Limits,
                max_age: Duration::from_millis(settings.signals_max_age_ms),
                num_replicas: settings.replicas,
                ..Default::default()
            },
        )
        .await?;
        ensure_stream(
            &jetstream,
            stream::Config {
                name: settings.queue_stream.clone(),
                description: Some("genfleet durable requests".into()),
                subjects: vec![format!("{}.queue.>", subjects.gen_prefix)],
                retention: stream::RetentionPolicy::WorkQueue,
                duplicate_window: Duration::from_millis(settings.queue_duplicate_window_ms),
                num_replicas: settings.replicas,
                ..Default::default()
            },
        )
        .await?;
        let queue = jetstream
            .get_stream(&settings.queue_stream)
            .await
            .map_err(|e| {
                BusError::Setup(format!("cannot open stream {}: {e}", settings.queue_stream))
            })?;
        let finished = ensure_finished_bucket(&jetstream, settings).await?;
        Ok(Stores {
            jetstream,
            results,
            queue,
            finished,
        })
    }

    /// The summary kept for a finished request, if any (a store that cannot be read is as if
    /// none were kept: the summary is for people, never needed to answer).
    pub async fn finished_summary(&self, request_id: &str) -> Option<FinishedSummary> {
        match self.finished.get(finished_key(request_id)).await {
            Ok(Some(body)) => serde_json::from_slice(&body).ok(),
            Ok(None) => None,
            Err(error) => {
                tracing::debug!(message = "cannot read a finished summary", %error, request_id = %request_id);
                None
            }
        }
    }

    /// Keeps the summary of a result just stored, in the background: it is for people, and the
    /// request's path does not wait for it.
    pub fn keep_finished(&self, result: &GenerationResult) {
        let summary = FinishedSummary::of(result, Some(now_rfc3339()));
        let body = serde_json::to_vec(&summary).expect("summaries serialize");
        let bucket = self.finished.clone();
        tokio::spawn(async move {
            if let Err(error) = bucket
                .put(finished_key(&summary.request_id), body.into())
                .await
            {
                tracing::warn!(message = "a finished request's summary was not kept", %error, request_id = %summary.request_id);
            }
        });
    }
}

/// The bucket of finished requests' summaries: unlike the others, its oldest entries give way
/// (discard old) once it holds `finished_max_entries`.
async fn ensure_finished_bucket(
    js: &jetstream::Context,
    settings: &JetStreamSettings,
) -> Result<kv::Store, BusError> {
    let name = &settings.finished_bucket;
    if let Ok(store) = js.get_key_value(name).await {
        return Ok(store);
    }
    ensure_stream(
        js,
        stream::Config {
            name: format!("KV_{name}"),
            description: Some(format!("genfleet finished requests {name}")),
            subjects: vec![format!("$KV.{name}.>")],
            max_messages_per_subject: 1,
            max_messages: settings.finished_max_entries,
            max_age: Duration::from_millis(settings.finished_ttl_ms),
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: stream::DiscardPolicy::Old,
            num_replicas: settings.replicas,
            ..Default::default()
        },
    )
    .await?;
    js.get_key_value(name)
        .await
        .map_err(|e| BusError::Setup(format!("cannot open bucket {name}: {e}")))
}

/// The key of a finished request's summary.
pub fn finished_key(request_id: &str) -> String {
    format!("fin.{request_id}")
}

/// How long set-up waits for a stream to be usable: on a JetStream cluster a stream that was
/// just created (by this worker or one starting beside it) has no leader for a moment.
const STREAM_READY_WAIT: Duration = Duration::from_secs(30);

pub(super) async fn ensure_stream(
    js: &jetstream::Context,
    config: stream::Config,
) -> Result<(), BusError> {
    let name = config.name.clone();
    if let Ok(stream) = js.get_stream(&name).await
        && has_leader(stream.cached_info())
    {
        return Ok(());
    }
    match js.create_stream(config).await {
        Ok(_) => tracing::info!(message = "created stream", stream = %name),
        // Another worker created it meanwhile (or is creating it): wait for it below.
        Err(error) => {
            tracing::debug!(message = "stream not created here", stream = %name, %error)
        }
    }
    wait_ready(js, &name).await
}

fn has_leader(info: &stream::Info) -> bool {
    info.cluster
        .as_ref()
        .is_none_or(|cluster| cluster.name.is_none() || cluster.leader.is_some())
}

/// Waits (bounded) until the stream answers with a leader.
async fn wait_ready(js: &jetstream::Context, name: &str) -> Result<(), BusError> {
    let deadline = tokio::time::Instant::now() + STREAM_READY_WAIT;
    let mut pause = Duration::from_millis(50);
    loop {
        let error = match js.get_stream(name).await {
            Ok(stream) if has_leader(stream.cached_info()) => return Ok(()),
            Ok(_) => "it has no leader yet".to_string(),
            Err(error) => error.to_string(),
        };
        if tokio::time::Instant::now() + pause > deadline {
            return Err(BusError::Setup(format!(
                "stream {name} is not usable after {}s: {error}",
                STREAM_READY_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// Opens a bucket, creating its stream first when it does not exist.
pub async fn ensure_bucket(
    js: &jetstream::Context,
    bucket: &str,
    history: i64,
    max_age: Duration,
    replicas: usize,
) -> Result<kv::Store, BusError> {
    if let Ok(store) = js.get_key_value(bucket).await {
        return Ok(store);
    }
    ensure_stream(
        js,
        stream::Config {
            name: format!("KV_{bucket}"),
            description: Some(format!("genfleet key-value bucket {bucket}")),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: history,
            max_age,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: stream::DiscardPolicy::New,
            num_replicas: replicas,
            ..Default::default()
        },
    )
    .await?;
    js.get_key_value(bucket)
        .await
        .map_err(|e| BusError::Setup(format!("cannot open bucket {bucket}: {e}")))
}

/// A request's live record (`req.<id>`): where it runs, refreshed while it runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveRecord {
    pub request_id: String,
    pub state: RequestState,
    pub worker_id: String,
    pub attempt: u32,
    #[serde(default)]
    pub durable: bool,
}

/// What `res.<id>` holds: the result until it is read, then a small tombstone that keeps
/// redeliveries from running the request again until the bucket's TTL drops it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StoredResult {
    Released { released: bool, state: RequestState },
    Result(Box<GenerationResult>),
}

pub fn live_key(request_id: &str) -> String {
    format!("req.{request_id}")
}

pub fn result_key(request_id: &str) -> String {
    format!("res.{request_id}")
}

/// How storing a result went.
#[derive(Debug, PartialEq, Eq)]
pub enum Stored {
    Stored,
    /// Another runner of the same request stored first; its result stands.
    AlreadyStored,
}

impl Stores {
    /// Stores a terminal result create-if-absent: of two runners of one request, the first
    /// result stored wins.
    pub async fn store_result(&self, result: &GenerationResult) -> Result<Stored, BusError> {
        let body = serde_json::to_vec(&StoredResult::Result(Box::new(result.clone())))
            .expect("results serialize");
        match self
            .results
            .create(result_key(&result.request_id), body.into())
            .await
        {
            Ok(_) => {
                // Two independent writes: one round trip instead of two.
                let _ = tokio::join!(
                    self.results.purge(live_key(&result.request_id)),
                    self.drop_index(&result.worker_id, &result.request_id)
                );
                Ok(Stored::Stored)
            }
            Err(error) if error.kind() == kv::CreateErrorKind::AlreadyExists => {
                // This runner's records go too; the stored result stands.
                self.drop_index(&result.worker_id, &result.request_id).await;
                if self
                    .live(&result.request_id)
                    .await?
                    .is_some_and(|r| r.worker_id == result.worker_id)
                {
                    let _ = self.results.purge(live_key(&result.request_id)).await;
                }
                Ok(Stored::AlreadyStored)
            }
            Err(error) => Err(BusError::Store(format!("cannot store the result: {error}"))),
        }
    }

    pub async fn put_live(&self, record: &LiveRecord) -> Result<(), BusError> {
        let body = serde_json::to_vec(record).expect("records serialize");
        let index = super::heartbeat::index_key(&record.worker_id, &record.request_id);
        // Two independent writes: one round trip instead of two.
        let (indexed, written) = tokio::join!(
            self.results.put(index, bytes::Bytes::new()),
            self.results.put(live_key(&record.request_id), body.into())
        );
        indexed.map_err(|e| BusError::Store(format!("cannot index the request record: {e}")))?;
        written
            .map(|_| ())
            .map_err(|e| BusError::Store(format!("cannot write the request record: {e}")))
    }

    /// Claims a request id fleet-wide for a new interactive request: the live record is created
    /// only if no other is there, and refused if the id already has a result (or tombstone).
    /// Returns false for an id in use.
    pub async fn claim(&self, record: &LiveRecord) -> Result<bool, BusError> {
        let body = serde_json::to_vec(record).expect("records serialize");
        match self
            .results
            .create(live_key(&record.request_id), body.into())
            .await
        {
            Ok(_) => {}
            Err(error) if error.kind() == kv::CreateErrorKind::AlreadyExists => return Ok(false),
            Err(error) => {
                return Err(BusError::Store(format!(
                    "cannot record the request: {error}"
                )));
            }
        }
        // The index is written while the result is looked for (one round trip instead of
        // two); a refused claim takes both back.
        let index = super::heartbeat::index_key(&record.worker_id, &record.request_id);
        let (stored, indexed) = tokio::join!(
            self.stored(&record.request_id),
            self.results.put(index, bytes::Bytes::new())
        );
        match stored {
            Ok(None) => {}
            Ok(Some(_)) => {
                self.unclaim(record).await;
                return Ok(false);
            }
            Err(error) => {
                self.unclaim(record).await;
                return Err(error);
            }
        }
        indexed.map_err(|e| BusError::Store(format!("cannot index the request record: {e}")))?;
        Ok(true)
    }

    /// Gives a claim back (the request was refused after all).
    pub async fn unclaim(&self, record: &LiveRecord) {
        self.take_back(record, true).await;
    }

    /// Removes the worker's index entry of a request and, with `live`, its live record.
    pub async fn take_back(&self, record: &LiveRecord, live: bool) {
        let index = self.drop_index(&record.worker_id, &record.request_id);
        if live {
            let _ = tokio::join!(self.results.purge(live_key(&record.request_id)), index);
        } else {
            index.await;
        }
    }

    /// Removes a worker's index entry of a request, leaving nothing behind. A KV purge would
    /// leave a marker per request until the bucket's TTL, and every worker's look for lost
    /// workers reads the whole index: its cost would grow with every request run in the last
    /// `results_ttl_ms` instead of with those running. Best effort: an entry left behind is
    /// found and removed by that look once its worker is gone.
    pub async fn drop_index(&self, worker_id: &str, request_id: &str) {
        let subject = format!(
            "{}{}",
            self.results.prefix,
            super::heartbeat::index_key(worker_id, request_id)
        );
        if let Err(error) = self.results.stream.purge().filter(subject).await {
            tracing::debug!(message = "cannot remove an index entry", %request_id, %error);
        }
    }

    pub async fn live(&self, request_id: &str) -> Result<Option<LiveRecord>, BusError> {
        let entry = self
            .results
            .get(live_key(request_id))
            .await
            .map_err(|e| BusError::Store(e.to_string()))?;
        Ok(entry.and_then(|bytes| serde_json::from_slice(&bytes).ok()))
    }

    /// The stored result (or its tombstone) with its revision.
    pub async fn stored(&self, request_id: &str) -> Result<Option<(StoredResult, u64)>, BusError> {
        let entry = self
            .results
            .entry(result_key(request_id))
            .await
            .map_err(|e| BusError::Store(e.to_string()))?;
        Ok(entry.and_then(|entry| {
            if entry.operation != kv::Operation::Put {
                return None;
            }
            serde_json::from_slice(&entry.value)
                .ok()
                .map(|v| (v, entry.revision))
        }))
    }

    /// Replaces the result with its tombstone if it is still at `revision`; of concurrent
    /// readers exactly one succeeds.
    pub async fn release(
        &self,
        request_id: &str,
        state: RequestState,
        revision: u64,
    ) -> Result<bool, BusError> {
        let body = serde_json::to_vec(&StoredResult::Released {
            released: true,
            state,
        })
        .expect("tombstones serialize");
        match self
            .results
            .update(result_key(request_id), body.into(), revision)
            .await
        {
            Ok(_) => Ok(true),
            Err(error) if error.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(false),
            Err(error) => Err(BusError::Store(format!(
                "cannot release the result: {error}"
            ))),
        }
    }
}
