//! `genfleet worker`: one worker on the bus, started, serving and drained.
//!
//! The worker's parts are wired in [`super::wiring`]; each verb it answers has its own module:
//! [`super::submit`] (interactive requests), [`super::queue`] (the durable queue), both through
//! [`super::admission`]; [`super::finish`] (results stored, events out), [`super::lookup`]
//! (status, result, cancel), [`super::decide`] (decisions), [`super::heartbeat`] (heartbeats
//! and lost workers) and [`super::upkeep`].

use std::time::Duration;

use tokio::sync::oneshot;

use super::BusError;
use super::finish::FINISHING_AT_ONCE;
use super::heartbeat;
use super::wiring::start;
use crate::actors::Drain;
use crate::settings::Settings;

/// A running worker, started on its own thread with its own actix system (tests and embedding).
pub struct WorkerHandle {
    pub worker_id: String,
    /// Where its HTTP server (metrics, health) listens, when `http.listen` is set.
    pub http_addr: Option<std::net::SocketAddr>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), BusError>>>,
}

impl WorkerHandle {
    /// Starts a worker and waits until it serves (its stores exist and it listens).
    pub fn spawn(settings: Settings) -> Result<WorkerHandle, BusError> {
        let worker_id = settings.worker_id();
        let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let id = worker_id.clone();
        let thread = std::thread::Builder::new()
            .name(format!("genfleet-worker-{id}"))
            .spawn(move || {
                let threads = settings.worker.threads;
                actix::System::with_tokio_rt(move || runtime(threads).expect("a tokio runtime"))
                    .block_on(async move {
                        let shutdown = async {
                            let _ = shutdown_rx.await;
                        };
                        run(settings, id, shutdown, Some(ready_tx)).await
                    })
            })
            .map_err(|e| BusError::Setup(format!("cannot start the worker thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(http_addr)) => Ok(WorkerHandle {
                worker_id,
                http_addr,
                shutdown: Some(shutdown_tx),
                thread: Some(thread),
            }),
            Ok(Err(error)) => Err(error),
            // The thread ended without a word: report how.
            Err(_) => match thread.join() {
                Ok(Err(error)) => Err(error),
                Ok(Ok(())) => Err(BusError::Setup(
                    "the worker stopped before it was ready".into(),
                )),
                Err(_) => Err(BusError::Setup("the worker thread panicked".into())),
            },
        }
    }

    /// Drains and stops the worker, waiting for it.
    pub fn stop(mut self) -> Result<(), BusError> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<(), BusError> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| BusError::Setup("the worker thread panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// The runtime a worker's actix system runs on (`worker.threads`; a gateway's too,
/// `gateway.threads`). With one thread (the default) the slots, the bus and the backend's HTTP
/// connections share it: every hand-off on a request's path (a submit to its slot, each chunk
/// of the backend's stream from its connection to the slot, each event to the publisher) is a
/// task woken on the same thread, not a thread woken from sleep, which costs tens of
/// microseconds each. More threads spread the bus and the connections (the actors stay on the
/// system's own thread); 0 is one per core.
pub fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    match threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        0 => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    }
}

/// Runs a worker until `shutdown` resolves, then drains. Must run inside an actix system.
pub async fn run(
    settings: Settings,
    worker_id: String,
    shutdown: impl std::future::Future<Output = ()>,
    ready: Option<std::sync::mpsc::Sender<Result<Option<std::net::SocketAddr>, BusError>>>,
) -> Result<(), BusError> {
    // Asked to stop while starting (NATS unreachable, say): the start is dropped where it is.
    tokio::pin!(shutdown);
    let started = tokio::select! {
        biased;
        () = &mut shutdown => {
            tracing::info!(message = "stopped while starting", worker_id = %worker_id);
            if let Some(ready) = ready {
                let _ = ready.send(Err(BusError::Setup("stopped while starting".into())));
            }
            return Ok(());
        }
        started = start(settings, worker_id.clone()) => started,
    };
    let (shared, handle, tasks) = match started {
        Ok(started) => {
            if let Some(ready) = &ready {
                let _ = ready.send(Ok(started.http_addr));
            }
            (started.shared, started.handle, started.tasks)
        }
        Err(error) => {
            if let Some(ready) = ready {
                let _ = ready.send(Err(BusError::Setup(error.to_string())));
            }
            return Err(error);
        }
    };
    shutdown.await;
    // With NATS out of reach nothing can be stored, handed back or told: waiting out the drain
    // would only keep the process (and its replacement's start) waiting. Its durable requests
    // come back from the queue after `jetstream.queue_ack_wait_ms`; its interactive ones are
    // ended `worker_lost` by its peers.
    let reachable = matches!(
        shared.client.connection_state(),
        async_nats::connection::State::Connected
    );
    let deadline = if reachable {
        tracing::info!(message = "draining", worker_id = %shared.worker_id);
        Duration::from_millis(shared.settings.worker.drain_timeout_ms)
    } else {
        tracing::warn!(
            message = "NATS is out of reach: nothing can be stored or handed back, so the worker stops now without draining; its durable requests return to the queue after jetstream.queue_ack_wait_ms",
            worker_id = %shared.worker_id
        );
        Duration::ZERO
    };
    let report = shared
        .supervisor
        .send(Drain { deadline })
        .await
        .map_err(|e| BusError::Setup(format!("the supervisor stopped: {e}")))?;
    if !report.cancelled.is_empty() {
        tracing::warn!(
            message = "the drain deadline cancelled requests",
            count = report.cancelled.len()
        );
    }
    // Let the last results and events go out.
    let mut capacity = handle.capacity.clone();
    let _ = tokio::time::timeout(deadline, capacity.wait_for(|c| c.busy == 0)).await;
    // Every result being stored is stored (and its `finished` published) before the tasks stop.
    let _ = tokio::time::timeout(deadline, shared.finishing.acquire_many(FINISHING_AT_ONCE)).await;
    drop(handle);
    tokio::time::sleep(Duration::from_millis(50)).await;
    tasks.abort_all();
    // Its places in the tenants' counts, given back as its requests ended.
    let _ = tokio::time::timeout(deadline, shared.tenant_counts.write_down()).await;
    // Everything it held has ended: its peers need not wait out its heartbeat.
    heartbeat::last_beat(&shared).await;
    // Bounded: with NATS gone there is nothing to flush to.
    let _ = tokio::time::timeout(Duration::from_secs(2), shared.client.flush()).await;
    tracing::info!(message = "stopped", worker_id = %shared.worker_id);
    Ok(())
}
