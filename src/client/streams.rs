//! The fleet's JetStream streams and key-value buckets: created when absent, never changed or
//! deleted (no process of the fleet touches user data), with settings that work on
//! nats-server 2.9. A worker opens them all when it starts; a manager or a tool service that
//! comes first makes what a worker would, as it would.
//!
//! Buckets are created through their stream (`KV_<bucket>`) rather than `create_key_value`,
//! whose account query fails to parse a 2.9 server's reply; `get_key_value` then opens them.

use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};

use super::BusError;
use crate::client::subjects::Subjects;
use crate::protocol::FinishedSummary;
use crate::settings::JetStreamSettings;

/// The bucket of the workers' heartbeats (`worker.<id>`), one entry per live worker.
pub const WORKERS_BUCKET: &str = "GENFLEET_WORKERS";

/// The bucket of each pool's count of a tenant's running requests (`<pool>.<tenant>`), kept
/// only where `worker.tenants.pool_max_running` is set.
pub const TENANTS_BUCKET: &str = "GENFLEET_TENANTS";

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
        subjects: &Subjects,
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
        let signals_stream = stream::Config {
            retention: stream::RetentionPolicy::Limits,
            max_age: Duration::from_millis(settings.signals_max_age_ms),
            ..fleet_stream(
                &settings.signals_stream,
                "signals for managers",
                subjects.all_signals(),
                settings.replicas,
            )
        };
        ensure_stream(&jetstream, signals_stream).await?;
        let queue_stream = stream::Config {
            retention: stream::RetentionPolicy::WorkQueue,
            duplicate_window: Duration::from_millis(settings.queue_duplicate_window_ms),
            republish: Some(queue_notices(subjects)),
            ..fleet_stream(
                &settings.queue_stream,
                "durable requests",
                subjects.all_queues(),
                settings.replicas,
            )
        };
        ensure_stream(&jetstream, queue_stream).await?;
        let mut queue = jetstream
            .get_stream(&settings.queue_stream)
            .await
            .map_err(|e| {
                BusError::Setup(format!("cannot open stream {}: {e}", settings.queue_stream))
            })?;
        // A queue stream made before the notices existed learns them.
        let config = queue.info().await.map(|info| info.config.clone());
        if let Ok(mut config) = config
            && config.republish.is_none()
        {
            config.republish = Some(queue_notices(subjects));
            jetstream.update_stream(config).await.map_err(|e| {
                BusError::Setup(format!(
                    "cannot add the queue notices to stream {}: {e}",
                    settings.queue_stream
                ))
            })?;
        }
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

    /// Keeps the summary of a result its caller just read, in the background: it is for
    /// people, and no request waits for it.
    pub fn keep_finished(&self, summary: FinishedSummary) {
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
    ensure_capped_bucket(
        js,
        &settings.finished_bucket,
        "finished requests",
        Cap {
            max_entries: settings.finished_max_entries,
            max_age: Duration::from_millis(settings.finished_ttl_ms),
            replicas: settings.replicas,
        },
    )
    .await
}

/// The key of a finished request's summary.
pub fn finished_key(request_id: &str) -> String {
    format!("fin.{request_id}")
}

/// How long set-up waits for a stream to be usable: on a JetStream cluster a stream that was
/// just created (by this worker or one starting beside it) has no leader for a moment.
const STREAM_READY_WAIT: Duration = Duration::from_secs(30);

/// The queue stream republishes the headers of each message it stores on `gen.queued.>`: a
/// worker hears of a waiting band and tenant at once, without pulling every consumer.
fn queue_notices(subjects: &Subjects) -> stream::Republish {
    stream::Republish {
        source: subjects.all_queues(),
        destination: subjects.queue_notices(),
        headers_only: true,
    }
}

pub async fn ensure_stream(
    js: &jetstream::Context,
    config: stream::Config,
) -> Result<(), BusError> {
    let name = config.name.clone();
    let deadline = tokio::time::Instant::now() + STREAM_READY_WAIT;
    let mut pause = Duration::from_millis(50);
    loop {
        let error = match js.get_stream(&name).await {
            Ok(stream) if has_leader(stream.cached_info()) => return Ok(()),
            Ok(_) => "it has no leader yet".to_string(),
            // Absent, or the cluster could not say: create it. A create that fails (another
            // worker is creating it, or the cluster's meta leader is being elected) is tried
            // again until the stream is there.
            Err(_) => match js.create_stream(config.clone()).await {
                Ok(_) => {
                    tracing::info!(message = "created stream", stream = %name);
                    continue;
                }
                Err(error) => {
                    tracing::debug!(message = "stream not created here", stream = %name, %error);
                    error.to_string()
                }
            },
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

fn has_leader(info: &stream::Info) -> bool {
    info.cluster
        .as_ref()
        .is_none_or(|cluster| cluster.name.is_none() || cluster.leader.is_some())
}

/// Opens a bucket, creating its stream first when it does not exist.
pub async fn ensure_bucket(
    js: &jetstream::Context,
    bucket: &str,
    history: i64,
    max_age: Duration,
    replicas: usize,
) -> Result<kv::Store, BusError> {
    let config = stream::Config {
        max_messages_per_subject: history,
        discard: stream::DiscardPolicy::New,
        ..bucket_stream(bucket, "key-value bucket", max_age, replicas)
    };
    open_bucket(js, bucket, config).await
}

/// How far a capped bucket may grow: at most `max_entries` entries of one value each, none
/// older than `max_age`.
pub struct Cap {
    pub max_entries: i64,
    pub max_age: Duration,
    pub replicas: usize,
}

/// A bucket whose oldest entries give way (discard old) to new ones once it is full, where
/// [`ensure_bucket`] refuses the write. `holds` says what it keeps, in its description.
pub async fn ensure_capped_bucket(
    js: &jetstream::Context,
    bucket: &str,
    holds: &str,
    cap: Cap,
) -> Result<kv::Store, BusError> {
    let config = stream::Config {
        max_messages_per_subject: 1,
        max_messages: cap.max_entries,
        discard: stream::DiscardPolicy::Old,
        ..bucket_stream(bucket, holds, cap.max_age, cap.replicas)
    };
    open_bucket(js, bucket, config).await
}

/// The stream behind a key-value bucket, as `create_key_value` would make it.
fn bucket_stream(bucket: &str, holds: &str, max_age: Duration, replicas: usize) -> stream::Config {
    stream::Config {
        max_age,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        ..fleet_stream(
            &format!("KV_{bucket}"),
            &format!("{holds} {bucket}"),
            format!("$KV.{bucket}.>"),
            replicas,
        )
    }
}

/// A stream of the fleet: its name, what it holds (described as genfleet's), the subjects it
/// captures and its replicas; the rest as the caller sets it.
fn fleet_stream(name: &str, holds: &str, subjects: String, replicas: usize) -> stream::Config {
    stream::Config {
        name: name.to_string(),
        description: Some(format!("genfleet {holds}")),
        subjects: vec![subjects],
        num_replicas: replicas,
        ..Default::default()
    }
}

/// Opens `bucket`, creating its stream from `config` when it is absent.
async fn open_bucket(
    js: &jetstream::Context,
    bucket: &str,
    config: stream::Config,
) -> Result<kv::Store, BusError> {
    if let Ok(store) = js.get_key_value(bucket).await {
        return Ok(store);
    }
    ensure_stream(js, config).await?;
    js.get_key_value(bucket)
        .await
        .map_err(|e| BusError::Setup(format!("cannot open bucket {bucket}: {e}")))
}
