//! What a worker tells the fleet and its operators besides requests: the NATS service API
//! (`$SRV.PING/INFO/STATS.genfleet`) with its `capacity` endpoint, the backend probe behind
//! `/readyz`, and the slot gauges.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;

use super::BusError;
use super::shared::Shared;
use crate::actors::{Pause, Stats};
use crate::llm::OpenAiBackend;
use crate::observe::Metrics;
use crate::protocol::Capacity;

/// Registers with the NATS service API so `$SRV.PING/INFO/STATS` find this worker; the stats
/// carry its slots. The service lives as long as the returned value.
pub(super) async fn register(
    shared: &Arc<Shared>,
    capacity: watch::Receiver<Capacity>,
) -> Result<
    (
        async_nats::service::Service,
        async_nats::service::endpoint::Endpoint,
    ),
    BusError,
> {
    use async_nats::service::ServiceExt;
    let metadata = HashMap::from([
        ("pool".to_string(), shared.settings.worker.pool.clone()),
        (
            "slots".to_string(),
            shared.settings.worker.slots.to_string(),
        ),
        ("worker_id".to_string(), shared.worker_id.clone()),
    ]);
    let service = shared
        .client
        .service_builder()
        .description("genfleet generation worker")
        .metadata(metadata)
        .stats_handler({
            let tenants = shared.tenant_stats.clone();
            let shared = shared.clone();
            move |_endpoint, _stats| {
                let c = *capacity.borrow();
                serde_json::json!({
                    "slots": c.total, "busy": c.busy, "free": c.free(), "draining": c.draining,
                    "tenants": tenants.rows(),
                    // The pool's other live workers taking work that its placement ranks.
                    "peers": shared.peer_slots.peers(),
                    "worker_id": shared.worker_id,
                })
            }
        })
        .start("genfleet", env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| BusError::Setup(format!("cannot register the service: {e}")))?;
    // One endpoint per worker, so STATS has a place for the slot data; it answers with the
    // worker's capacity.
    let endpoint = service
        .endpoint_builder()
        .name("capacity")
        .queue_group(shared.subjects.capacity_group(&shared.worker_id))
        .add(shared.subjects.worker_capacity(&shared.worker_id))
        .await
        .map_err(|e| BusError::Setup(format!("cannot add the service endpoint: {e}")))?;
    Ok((service, endpoint))
}

/// Answers the `capacity` endpoint with the Supervisor's counts, for as long as the service
/// lives.
pub(super) async fn serve_capacity(
    shared: Arc<Shared>,
    service: async_nats::service::Service,
    mut endpoint: async_nats::service::endpoint::Endpoint,
) {
    let _service = service;
    while let Some(request) = endpoint.next().await {
        let stats = shared.supervisor.send(Stats).await;
        let body = match stats {
            Ok(stats) => serde_json::to_vec(&stats).unwrap_or_default(),
            Err(_) => b"{}".to_vec(),
        };
        let _ = request.respond(Ok(body.into())).await;
    }
}

/// Checks every `http.backend_probe_ms` that the backend answers, for `/readyz` and for the
/// work the worker takes: it starts paused (no free slot: submits go to its peers, the queue
/// waits) and takes work from the first answer on; a backend that stops answering pauses it
/// again, while what runs goes on. While the backend is down the probe is tried every second,
/// so the worker takes work soon after it comes back.
pub(super) async fn probe_backend(
    shared: Arc<Shared>,
    backend: OpenAiBackend,
    up: Arc<AtomicBool>,
    was_up: bool,
) {
    let every = Duration::from_millis(shared.settings.http.backend_probe_ms.max(100));
    let url = shared.settings.llm.base_url.clone();
    // The first probe ran as the worker started (and paused it if the backend did not answer).
    let mut was_up = Some(was_up);
    let first = if was_up == Some(true) {
        every
    } else {
        every.min(Duration::from_secs(1))
    };
    tokio::time::sleep(first).await;
    loop {
        let result = backend.probe(Duration::from_secs(5)).await;
        let now_up = result.is_ok();
        up.store(now_up, Ordering::Relaxed);
        shared.metrics.backend_up.set(i64::from(now_up));
        if was_up != Some(now_up) {
            let _ = shared.supervisor.send(Pause(!now_up)).await;
            match result {
                Ok(()) => {
                    tracing::info!(message = "the backend answers: taking work", backend = %url)
                }
                Err(error) => tracing::warn!(
                    message = "the backend does not answer: taking no new work until it does",
                    backend = %url,
                    %error
                ),
            }
            was_up = Some(now_up);
        }
        let pause = if now_up {
            every
        } else {
            every.min(Duration::from_secs(1))
        };
        tokio::time::sleep(pause).await;
    }
}

/// Mirrors the Supervisor's capacity into the slot gauges.
pub(super) async fn slot_gauges(metrics: Arc<Metrics>, mut capacity: watch::Receiver<Capacity>) {
    loop {
        {
            let now = capacity.borrow_and_update();
            metrics.slots_total.set(i64::from(now.total));
            metrics.slots_busy.set(i64::from(now.busy));
            metrics.draining.set(i64::from(now.draining));
        }
        if capacity.changed().await.is_err() {
            return;
        }
    }
}
