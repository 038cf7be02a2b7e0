//! Heartbeats and lost workers. Each worker puts its heartbeat in KV bucket `GENFLEET_WORKERS`
//! (whose entries expire after `worker.lost_after_ms`); its running requests are indexed under
//! `idx.<worker_id>.<request_id>` in the results bucket. Every live worker looks for indexed
//! requests whose worker stopped beating: an interactive one is ended as FAILED `worker_lost`
//! (create-if-absent, so of several live workers one result wins); a durable one is left to the
//! queue's redelivery.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures_util::StreamExt;

use super::BusError;
use super::queue::unrun_result;
use super::store::{ensure_bucket, live_key};
use super::worker::Shared;
use crate::protocol::{Reason, RequestState};

pub const WORKERS_BUCKET: &str = "GENFLEET_WORKERS";

pub fn index_key(worker_id: &str, request_id: &str) -> String {
    format!("idx.{worker_id}.{request_id}")
}

pub async fn open(
    js: &async_nats::jetstream::Context,
    lost_after: Duration,
    replicas: usize,
) -> Result<kv::Store, BusError> {
    ensure_bucket(js, WORKERS_BUCKET, 1, lost_after, replicas).await
}

pub(super) async fn beat(shared: &Shared) -> Result<(), BusError> {
    let capacity = *shared.capacity.borrow();
    let body = serde_json::json!({
        "worker_id": shared.worker_id,
        "pool": shared.settings.worker.pool,
        "slots": capacity.total,
        "busy": capacity.busy,
        "draining": capacity.draining,
        "ts": crate::protocol::ids::now_rfc3339(),
    });
    shared
        .workers
        .put(
            &shared.worker_id,
            serde_json::to_vec(&body).expect("json").into(),
        )
        .await
        .map(|_| ())
        .map_err(|e| BusError::Store(format!("cannot write the heartbeat: {e}")))
}

/// The first heartbeat, tried again for a while: on a JetStream cluster, a bucket created a
/// moment ago (by this worker or one starting beside it) may not take writes yet.
pub(super) async fn first_beat(shared: &Shared) -> Result<(), BusError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut pause = Duration::from_millis(50);
    loop {
        match beat(shared).await {
            Ok(()) => return Ok(()),
            Err(error) if tokio::time::Instant::now() + pause < deadline => {
                tracing::debug!(message = "first heartbeat failed; trying again", %error);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(error) => return Err(error),
        }
    }
}

/// Beats, and ends the interactive requests of workers that stopped beating. The two run side
/// by side: a slow look for lost workers (a JetStream under load) must never hold up this
/// worker's own heartbeat, or its heartbeat would expire and live workers would take it for
/// lost.
pub(super) async fn run(shared: Arc<Shared>) {
    let every = Duration::from_millis(shared.settings.worker.heartbeat_ms);
    let beating = async {
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            // A heartbeat slower than the interval is left behind for the next one.
            match tokio::time::timeout(every, beat(&shared)).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(message = "heartbeat failed", %error),
                Err(_) => {
                    tracing::warn!(message = "heartbeat took longer than worker.heartbeat_ms")
                }
            }
        }
    };
    let reaping = async {
        let mut suspects = HashSet::new();
        loop {
            tokio::time::sleep(every).await;
            if let Err(error) = reap(&shared, &mut suspects).await {
                tracing::debug!(message = "looking for lost workers failed", %error);
            }
        }
    };
    tokio::join!(beating, reaping);
}

/// The workers beating now. A listing cut short by an error is an error: a worker missing
/// from it must not be taken for lost.
async fn alive(shared: &Shared) -> Result<HashSet<String>, BusError> {
    let mut keys = shared
        .workers
        .keys()
        .await
        .map_err(|e| BusError::Store(e.to_string()))?;
    let mut alive = HashSet::new();
    while let Some(key) = keys.next().await {
        alive.insert(key.map_err(|e| BusError::Store(e.to_string()))?);
    }
    Ok(alive)
}

/// Whether `worker`'s heartbeat is there, asked directly (a second look before acting).
async fn beating(shared: &Shared, worker: &str) -> Result<bool, BusError> {
    shared
        .workers
        .get(worker)
        .await
        .map(|entry| entry.is_some())
        .map_err(|e| BusError::Store(e.to_string()))
}

/// Ends the requests of workers missing from the heartbeats in two looks in a row (`suspects`
/// holds those missing at the last look), so one late heartbeat never costs a live worker its
/// requests.
async fn reap(shared: &Shared, suspects: &mut HashSet<String>) -> Result<(), BusError> {
    let alive = alive(shared).await?;
    let mut index = shared
        .stores
        .results
        .watch_with_history("idx.>")
        .await
        .map_err(|e| BusError::Store(e.to_string()))?;
    let mut orphans = Vec::new();
    while let Ok(Some(Ok(entry))) =
        tokio::time::timeout(Duration::from_millis(300), index.next()).await
    {
        let caught_up = entry.delta == 0;
        if entry.operation == kv::Operation::Put {
            let mut parts = entry.key.splitn(3, '.');
            let (_, worker, request) = (parts.next(), parts.next(), parts.next());
            if let (Some(worker), Some(request)) = (worker, request)
                && !alive.contains(worker)
            {
                orphans.push((worker.to_string(), request.to_string()));
            }
        }
        if caught_up {
            break;
        }
    }
    let missing: HashSet<String> = orphans.iter().map(|(worker, _)| worker.clone()).collect();
    let confirmed: HashSet<String> = missing.intersection(suspects).cloned().collect();
    *suspects = missing;
    for (worker, request_id) in orphans {
        if !confirmed.contains(&worker) || beating(shared, &worker).await? {
            continue;
        }
        let record = shared.stores.live(&request_id).await?;
        let purge_index = || shared.stores.drop_index(&worker, &request_id);
        match record {
            Some(record)
                if record.worker_id == worker
                    && record.state == RequestState::Running
                    && !record.durable =>
            {
                let mut result = unrun_result(
                    &request_id,
                    Reason::WorkerLost,
                    format!("worker {worker} stopped while running the request"),
                    &worker,
                );
                result.attempt = record.attempt;
                if shared.stores.store_result(&result).await? == super::store::Stored::Stored {
                    shared.recorded(&result);
                }
                let _ = shared.stores.results.purge(live_key(&request_id)).await;
                tracing::warn!(message = "ended the request of a lost worker", request_id = %request_id, lost_worker = %worker);
                purge_index().await;
            }
            // Durable: the queue redelivers it; the index goes when that run ends elsewhere.
            Some(record) if record.worker_id == worker && record.durable => purge_index().await,
            // Ended, or taken over by another worker.
            _ => purge_index().await,
        }
    }
    Ok(())
}
