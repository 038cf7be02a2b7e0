//! `genfleet worker`: one worker on the bus. It subscribes to its pool's submit subject only
//! while a slot is free, answers status, result and cancel for any request of the fleet from
//! the shared stores, publishes events and signals, and drains on shutdown.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::Addr;
use futures_util::StreamExt;
use serde::Deserialize;
use tokio::sync::{Semaphore, mpsc, oneshot, watch};

use super::decisions::{ChainMark, DecisionAnswer, DecisionOutcome, DecisionRecord, Decisions};
use super::reply::{decode, guarded, respond};
use super::store::{LiveRecord, Stored, StoredResult, Stores};
use super::subjects::Subjects;
use super::tools::BusToolRunner;
use super::{BusError, connect, queue};
use crate::actors::{
    Cancel, CancelReply, Capacity, Drain, Placement, Submit, Supervisor, SupervisorConfig,
    SupervisorHandle,
};
use crate::engine::{DefaultBios, Engine, EngineConfig};
use crate::llm::OpenAiBackend;
use crate::observe::{MeteredBackend, Metrics, Readiness};
use crate::protocol::{
    ErrorCode, Event, EventBody, FinishedSummary, GenerationRequest, GenerationResult, Reason,
    RequestState, Severity, Signal, SignalSource, SignalType, WireError,
};
use crate::settings::Settings;

/// Requests handled at once per subscription; past it, messages wait in the client's bounded
/// subscription buffer.
const MAX_IN_FLIGHT: usize = 256;
/// How long status and result wait for the stores (callers commonly wait 5-10 s).
const STORE_WAIT: Duration = Duration::from_secs(4);
/// Events waiting to be published before generations wait for the publisher.
const EVENT_BUFFER: usize = 4096;
/// Requests whose results are being stored at once (see [`publish_events`]).
const FINISHING_AT_ONCE: u32 = 64;
/// Notices of stored results kept for cancels waiting on them; a cancel that falls behind looks
/// in the store instead.
const STORED_NOTICES: usize = 1024;
/// How long a finished request's result is tried to be stored before it is given up (a
/// durable one then goes back to the queue).
const STORE_RESULT_FOR: Duration = Duration::from_secs(60);
/// Room left in a NATS message for what goes around a result: the event's or the stored
/// record's fields, headers, a reply's error envelope.
const RESULT_ENVELOPE_BYTES: usize = 4096;

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
                actix::System::with_tokio_rt(|| {
                    tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .enable_all()
                        .build()
                        .expect("a tokio runtime")
                })
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

/// Shared by the worker's tasks.
pub(super) struct Shared {
    pub(super) settings: Settings,
    pub(super) worker_id: String,
    pub(super) client: async_nats::Client,
    pub(super) subjects: Subjects,
    pub(super) stores: Stores,
    pub(super) supervisor: Addr<Supervisor>,
    pub(super) capacity: watch::Receiver<Capacity>,
    pub(super) workers: async_nats::jetstream::kv::Store,
    decisions: Decisions,
    /// What each request running here asked, and its place in its chain: a decision it raises
    /// restates it in the continuation.
    asked: Mutex<HashMap<String, Asked>>,
    /// Requests running here, for the refresh of their records.
    running: Mutex<HashMap<String, LiveRecord>>,
    /// The queue messages of durable requests running here, until their result is stored.
    durable: Mutex<HashMap<String, async_nats::jetstream::Message>>,
    /// Requests a caller cancelled (so a drain's cancellation, which hands a durable request
    /// back, is told apart).
    cancelled_by_callers: Mutex<HashSet<String>>,
    /// Durable requests in hand that the supervisor has not yet taken: from the moment one is on
    /// record here until it starts (it may wait for a slot an interactive submit took between
    /// the pull and the start). A cancel marks them, so they end CANCELLED without running.
    waiting: Mutex<HashMap<String, WaitingForSlot>>,
    in_flight: Arc<Semaphore>,
    /// Requests being finished (result stored, then `finished` published) at once.
    finishing: Arc<Semaphore>,
    /// The id of each request whose result was just stored (or given up), for cancels that
    /// answer only once the result is there.
    pub(super) stored: tokio::sync::broadcast::Sender<String>,
    pub(super) metrics: Arc<Metrics>,
}

/// A durable request in hand, not yet started.
#[derive(Default)]
pub(super) struct WaitingForSlot {
    /// A caller cancelled it.
    pub(super) cancelled: bool,
    /// Wakes its wait when it is cancelled.
    pub(super) wake: Arc<tokio::sync::Notify>,
}

/// A running request as it was asked.
#[derive(Clone)]
pub(super) struct Asked {
    pub(super) request: GenerationRequest,
    pub(super) root_request_id: String,
    pub(super) chain_position: u32,
    /// What it carries from earlier in its chain.
    pub(super) chain: crate::engine::ChainState,
}

impl Shared {
    /// What follows a result stored here first (by whichever path): its metrics, its summary
    /// for people and, when it failed, `signals.outcome.FAILED` for managers.
    pub(super) fn recorded(&self, result: &GenerationResult) {
        self.metrics.observe_result(result);
        self.stores.keep_finished(result);
        if result.state == RequestState::Failed {
            let signal = failure_signal(result, &self.settings.worker.pool);
            let subject = self.subjects.signal(signal.kind, &signal.code);
            let body = serde_json::to_vec(&signal).expect("signals serialize");
            let jetstream = self.stores.jetstream.clone();
            tokio::spawn(async move {
                let published = match jetstream.publish(subject, body.into()).await {
                    Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                    Err(error) => Err(error.to_string()),
                };
                if let Err(error) = published {
                    tracing::warn!(message = "a failure signal was not stored in its stream", %error, request_id = %signal.request_id);
                }
            });
        }
    }

    pub(super) fn lock_asked(&self) -> std::sync::MutexGuard<'_, HashMap<String, Asked>> {
        self.asked.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock_running(&self) -> std::sync::MutexGuard<'_, HashMap<String, LiveRecord>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock_durable(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, async_nats::jetstream::Message>> {
        self.durable.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock_waiting(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, WaitingForSlot>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock_cancelled(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.cancelled_by_callers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
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
        Ok((shared, handle, tasks, http_addr)) => {
            if let Some(ready) = &ready {
                let _ = ready.send(Ok(http_addr));
            }
            (shared, handle, tasks)
        }
        Err(error) => {
            if let Some(ready) = ready {
                let _ = ready.send(Err(BusError::Setup(error.to_string())));
            }
            return Err(error);
        }
    };
    shutdown.await;
    tracing::info!(message = "draining", worker_id = %shared.worker_id);
    let deadline = Duration::from_millis(shared.settings.worker.drain_timeout_ms);
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
    for task in tasks {
        task.abort();
    }
    // Bounded: with NATS gone there is nothing to flush to.
    let _ = tokio::time::timeout(Duration::from_secs(2), shared.client.flush()).await;
    tracing::info!(message = "stopped", worker_id = %shared.worker_id);
    Ok(())
}

type Started = (
    Arc<Shared>,
    SupervisorHandle,
    Vec<tokio::task::JoinHandle<()>>,
    Option<std::net::SocketAddr>,
);

async fn start(settings: Settings, worker_id: String) -> Result<Started, BusError> {
    // The HTTP server comes first, so /healthz answers while the worker waits for NATS.
    let metrics = Arc::new(Metrics::new());
    metrics.slots_total.set(i64::from(settings.worker.slots));
    let readiness = Arc::new(Readiness::default());
    let (http_addr, http_task) = match settings.http.listen.as_str() {
        "" => (None, None),
        listen => {
            let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
                BusError::Setup(format!("cannot listen on {listen} (http.listen): {e}"))
            })?;
            let addr = listener.local_addr().ok();
            let task = tokio::spawn(crate::observe::serve(
                listener,
                metrics.clone(),
                readiness.clone(),
            ));
            (addr, Some(task))
        }
    };
    match start_serving(settings, worker_id, metrics, readiness).await {
        Ok((shared, handle, mut tasks)) => {
            tasks.extend(http_task);
            Ok((shared, handle, tasks, http_addr))
        }
        Err(error) => {
            if let Some(task) = http_task {
                task.abort();
            }
            Err(error)
        }
    }
}

type Serving = (
    Arc<Shared>,
    SupervisorHandle,
    Vec<tokio::task::JoinHandle<()>>,
);

async fn start_serving(
    settings: Settings,
    worker_id: String,
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
) -> Result<Serving, BusError> {
    let client = connect::connect(&settings.nats, connect::ConnectPurpose::Worker)
        .await
        .map_err(|e| BusError::Setup(e.to_string()))?;
    let jetstream = async_nats::jetstream::new(client.clone());
    let stores = Stores::ensure(jetstream, &settings.jetstream, &settings.subjects).await?;
    let decisions = Decisions::open(
        &stores.jetstream,
        &settings,
        stores.results.clone(),
        metrics.clone(),
    )
    .await?;
    let workers = super::heartbeat::open(
        &stores.jetstream,
        Duration::from_millis(settings.worker.lost_after_ms),
        settings.jetstream.replicas,
    )
    .await?;
    let subjects = Subjects::new(&settings.subjects);
    let backend = OpenAiBackend::new(&settings.llm).map_err(|e| BusError::Setup(e.to_string()))?;
    let runner = BusToolRunner::new(client.clone(), subjects.clone()).with_metrics(metrics.clone());
    let engine = Engine::new(
        EngineConfig::from_settings(&settings),
        Arc::new(MeteredBackend::new(
            Arc::new(backend.clone()),
            metrics.clone(),
        )),
        Arc::new(runner),
        Arc::new(DefaultBios),
    )
    .with_history(Arc::new(decisions.history().clone()));
    let engine = Arc::new(engine);
    let tools_task =
        super::catalog::follow_tools(&stores.jetstream, &settings, engine.clone()).await?;
    let (events_tx, events_rx) = mpsc::channel(EVENT_BUFFER);
    let handle = Supervisor::start(
        SupervisorConfig::from_settings(&settings, worker_id.clone()),
        engine,
        Some(events_tx),
    );
    let shared = Arc::new(Shared {
        worker_id: worker_id.clone(),
        client: client.clone(),
        subjects: subjects.clone(),
        stores,
        supervisor: handle.addr.clone(),
        capacity: handle.capacity.clone(),
        workers,
        decisions,
        asked: Mutex::new(HashMap::new()),
        running: Mutex::new(HashMap::new()),
        durable: Mutex::new(HashMap::new()),
        cancelled_by_callers: Mutex::new(HashSet::new()),
        waiting: Mutex::new(HashMap::new()),
        in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        finishing: Arc::new(Semaphore::new(FINISHING_AT_ONCE as usize)),
        stored: tokio::sync::broadcast::channel(STORED_NOTICES).0,
        metrics: metrics.clone(),
        settings,
    });
    let mut tasks = vec![tools_task];
    // On record as alive before taking any request, so no live worker takes it for lost.
    super::heartbeat::first_beat(&shared).await?;
    tasks.push(tokio::spawn(super::heartbeat::run(shared.clone())));
    tasks.push(tokio::spawn(publish_events(shared.clone(), events_rx)));
    // Subscribed (and the server told) before the worker says it is ready, so the first
    // submit after start finds it.
    let submits = client
        .queue_subscribe(
            subjects.submit(&shared.settings.worker.pool),
            subjects.submit_group(&shared.settings.worker.pool),
        )
        .await
        .map_err(|e| BusError::Setup(format!("cannot subscribe to submits: {e}")))?;
    tasks.push(tokio::spawn(serve_submits(
        shared.clone(),
        handle.capacity.clone(),
        Some(submits),
    )));
    let consumer = queue::pool_consumer(&shared).await?;
    tasks.push(tokio::spawn(queue::serve_queue(
        shared.clone(),
        consumer,
        handle.capacity.clone(),
    )));
    tasks.push(tokio::spawn(queue::keep_alive(shared.clone())));
    queue::watch_exhausted(shared.clone()).await?;
    for verb in ["status", "result", "cancel"] {
        let subject = subjects.any(verb);
        let sub = client
            .queue_subscribe(subject.clone(), subjects.any_group().to_string())
            .await
            .map_err(|e| BusError::Setup(format!("cannot subscribe to {subject}: {e}")))?;
        tasks.push(tokio::spawn(serve_any(shared.clone(), verb, sub)));
    }
    let answers = client
        .queue_subscribe(subjects.decision("*"), "genfleet-decisions".to_string())
        .await
        .map_err(|e| BusError::Setup(e.to_string()))?;
    tasks.push(tokio::spawn(serve_decisions(shared.clone(), answers)));
    let own_cancel = client
        .subscribe(subjects.worker_cancel(&worker_id))
        .await
        .map_err(|e| BusError::Setup(e.to_string()))?;
    tasks.push(tokio::spawn(serve_own_cancels(shared.clone(), own_cancel)));
    tasks.push(tokio::spawn(refresh_records(shared.clone())));
    let sweeper = shared.clone();
    tasks.push(tokio::spawn(async move {
        sweeper
            .decisions
            .sweep(sweeper.client.clone(), sweeper.worker_id.clone())
            .await
    }));
    tasks.push(tokio::spawn(probe_backend(
        shared.clone(),
        backend,
        readiness.backend_up.clone(),
    )));
    tasks.push(tokio::spawn(watch_capacity(
        metrics.clone(),
        handle.capacity.clone(),
    )));
    tasks.push(tokio::spawn(queue::measure_lag(shared.clone())));
    readiness.started(client.clone(), handle.capacity.clone());
    let service = start_service(&shared, handle.capacity.clone()).await?;
    tasks.push(tokio::spawn(async move {
        // The service lives as long as this task; it is stopped with the worker.
        let _service = service;
        std::future::pending::<()>().await;
    }));
    client
        .flush()
        .await
        .map_err(|e| BusError::Setup(format!("cannot reach NATS: {e}")))?;
    tracing::info!(
        message = "worker ready",
        worker_id = %worker_id,
        pool = %shared.settings.worker.pool,
        slots = shared.settings.worker.slots
    );
    Ok((shared, handle, tasks))
}

/// Checks every `http.backend_probe_ms` that the backend answers, for `/readyz`.
async fn probe_backend(shared: Arc<Shared>, backend: OpenAiBackend, up: Arc<AtomicBool>) {
    let every = Duration::from_millis(shared.settings.http.backend_probe_ms.max(100));
    let mut was_up = None;
    loop {
        let result = backend.probe(Duration::from_secs(5)).await;
        let now_up = result.is_ok();
        up.store(now_up, Ordering::Relaxed);
        shared.metrics.backend_up.set(i64::from(now_up));
        if was_up != Some(now_up) {
            match result {
                Ok(()) => tracing::info!(message = "the backend answers"),
                Err(error) => tracing::warn!(message = "the backend does not answer", %error),
            }
            was_up = Some(now_up);
        }
        tokio::time::sleep(every).await;
    }
}

/// Mirrors the supervisor's capacity into the slot gauges.
async fn watch_capacity(metrics: Arc<Metrics>, mut capacity: watch::Receiver<Capacity>) {
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

/// Registers with the NATS service API so `$SRV.PING/INFO/STATS` find this worker; the stats
/// carry its slots.
async fn start_service(
    shared: &Arc<Shared>,
    capacity: watch::Receiver<Capacity>,
) -> Result<async_nats::service::Service, BusError> {
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
        .stats_handler(move |_endpoint, _stats| {
            let c = *capacity.borrow();
            serde_json::json!({"slots": c.total, "busy": c.busy, "free": c.free(), "draining": c.draining})
        })
        .start("genfleet", env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| BusError::Setup(format!("cannot register the service: {e}")))?;
    // One endpoint per worker, so STATS has a place for the slot data; it answers with the
    // worker's capacity.
    let mut endpoint = service
        .endpoint_builder()
        .name("capacity")
        .queue_group(format!("genfleet-capacity-{}", shared.worker_id))
        .add(format!(
            "{}.worker.{}.capacity",
            shared.settings.subjects.gen_prefix, shared.worker_id
        ))
        .await
        .map_err(|e| BusError::Setup(format!("cannot add the service endpoint: {e}")))?;
    let supervisor = shared.supervisor.clone();
    tokio::spawn(async move {
        while let Some(request) = endpoint.next().await {
            let stats = supervisor.send(crate::actors::Stats).await;
            let body = match stats {
                Ok(stats) => serde_json::to_vec(&stats).unwrap_or_default(),
                Err(_) => b"{}".to_vec(),
            };
            let _ = request.respond(Ok(body.into())).await;
        }
    });
    Ok(service)
}

/// Subscribes to the pool's submit subject only while a slot is free. Leaving the queue group
/// drains the subscription: every submit that reached this worker is answered.
async fn serve_submits(
    shared: Arc<Shared>,
    mut capacity: watch::Receiver<Capacity>,
    mut first: Option<async_nats::Subscriber>,
) {
    let subject = shared.subjects.submit(&shared.settings.worker.pool);
    let group = shared.subjects.submit_group(&shared.settings.worker.pool);
    loop {
        if capacity.wait_for(|c| c.free() > 0).await.is_err() {
            return;
        }
        let subscribed = match first.take() {
            Some(sub) => Ok(sub),
            None => {
                shared
                    .client
                    .queue_subscribe(subject.clone(), group.clone())
                    .await
            }
        };
        let mut sub = match subscribed {
            Ok(sub) => sub,
            Err(error) => {
                tracing::error!(message = "cannot subscribe to submits; retrying", %error);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            tokio::select! {
                message = sub.next() => match message {
                    Some(message) => spawn_handler(&shared, handle_submit(shared.clone(), message)).await,
                    None => break,
                },
                changed = capacity.changed() => {
                    if changed.is_err() || capacity.borrow().free() == 0 {
                        // Drain, not unsubscribe: a submit the server routed here before it saw the UNSUB
                        // still arrives and is answered.
                        let _ = sub.drain().await;
                        while let Some(message) = sub.next().await {
                            spawn_handler(&shared, handle_submit(shared.clone(), message)).await;
                        }
                        break;
                    }
                }
            }
        }
    }
}

/// Runs a handler as its own task, at most [`MAX_IN_FLIGHT`] at once per worker.
async fn spawn_handler(
    shared: &Arc<Shared>,
    handler: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let Ok(permit) = shared.in_flight.clone().acquire_owned().await else {
        return;
    };
    tokio::spawn(async move {
        handler.await;
        drop(permit);
    });
}

async fn handle_submit(shared: Arc<Shared>, message: async_nats::Message) {
    let reply = guarded(submit(&shared, &message)).await;
    respond(&shared.client, &message, reply).await;
}

async fn submit(
    shared: &Shared,
    message: &async_nats::Message,
) -> Result<crate::actors::Accepted, WireError> {
    let mut request: GenerationRequest = decode(message, shared.settings.limits.max_request_bytes)?;
    // The id is fixed here so what was asked is on record before the generation can raise a
    // decision about it.
    let request_id = request
        .request_id
        .get_or_insert_with(crate::protocol::ids::new_id)
        .clone();
    // Refused before anything is written for it (the supervisor checks again, with the tools).
    request.validate(&crate::actors::request_limits(&shared.settings))?;
    let record = LiveRecord {
        request_id: request_id.clone(),
        state: RequestState::Running,
        worker_id: shared.worker_id.clone(),
        attempt: 1,
        durable: false,
    };
    if !shared.stores.claim(&record).await.map_err(store_error)? {
        return Err(WireError::new(
            ErrorCode::DuplicateRequestId,
            format!(
                "request id {request_id} is already in use (running, queued or with a stored result)"
            ),
        ));
    }
    let asked = Asked {
        request: request.clone(),
        root_request_id: request_id.clone(),
        chain_position: 1,
        chain: Default::default(),
    };
    let known = shared.lock_asked().insert(request_id.clone(), asked);
    // Running before it can finish: a generation that ends before the supervisor's answer
    // arrives must find its record here to take it away.
    shared
        .lock_running()
        .insert(record.request_id.clone(), record.clone());
    let submitted = shared
        .supervisor
        .send(Submit {
            request,
            placement: Placement {
                traceparent: super::tools::traceparent_of(message),
                ..Placement::default()
            },
        })
        .await
        .map_err(|_| WireError::new(ErrorCode::Internal, "the worker is stopping"))
        .and_then(|r| r);
    let accepted = match submitted {
        Ok(accepted) => accepted,
        Err(error) => {
            // Refused: put back whatever ran under this id before (a duplicate).
            match known {
                Some(previous) => shared.lock_asked().insert(request_id.clone(), previous),
                None => shared.lock_asked().remove(&request_id),
            };
            shared.lock_running().remove(&request_id);
            shared.stores.unclaim(&record).await;
            return Err(error);
        }
    };
    Ok(accepted)
}

/// Publishes events in order; a `finished` event goes out only after its result is stored, and
/// signals also go to their own subjects (captured by the signals stream).
///
/// `finished` is the last event a request sends through here, so finishing it (storing the
/// result, settling its queue message, then publishing) runs as a task of its own: the store
/// round trips of one request do not hold up the events of all the others. At most
/// [`FINISHING_AT_ONCE`] run at once; past that this loop waits, and so do the generations.
async fn publish_events(shared: Arc<Shared>, mut events: mpsc::Receiver<Event>) {
    while let Some(event) = events.recv().await {
        match &event.body {
            EventBody::Finished { .. } => {
                let Ok(permit) = shared.finishing.clone().acquire_owned().await else {
                    return;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    finish(&shared, event).await;
                    drop(permit);
                });
                continue;
            }
            EventBody::Signal { signal } => {
                shared.metrics.observe_signal(signal.kind, &signal.code);
                if let Some(decision) = &signal.decision {
                    record_decision(&shared, signal, decision, event.seq).await;
                }
                publish_signal(&shared, signal).await
            }
            _ => {}
        }
        publish_event(&shared, &event).await;
    }
}

/// Stores a request's result, settles its queue message, then publishes its `finished` event.
async fn finish(shared: &Shared, mut event: Event) {
    let EventBody::Finished { result } = &mut event.body else {
        return;
    };
    // One NATS message must hold the result: in the bucket, in a `gen.result` reply and in the
    // `finished` event, each with a little envelope around it.
    let max_bytes = shared
        .client
        .max_payload()
        .saturating_sub(RESULT_ENVELOPE_BYTES);
    if result.fit_within(max_bytes) {
        tracing::warn!(message = "the result was larger than the server's max_payload; its messages were trimmed", request_id = %result.request_id, max_bytes);
    }
    let result = &*result;
    let id = &result.request_id;
    shared.lock_running().remove(id);
    let asked = shared.lock_asked().remove(id);
    let by_caller = shared.lock_cancelled().remove(id);
    let durable = shared.lock_durable().contains_key(id);
    if durable && result.reason == Reason::Cancelled && !by_caller {
        // A drain cancelled it: hand it back for another worker, store nothing.
        queue::settle(shared, id, true).await;
        release_local(shared, id).await;
        tracing::info!(message = "handed a durable request back to the queue", request_id = %id);
        return;
    }
    let stored = store_result(shared, result).await;
    let _ = shared.stored.send(id.clone());
    match stored {
        Some(Stored::Stored) => shared.recorded(result),
        _ => shared.metrics.observe_result(result),
    }
    // A durable request whose result could not be stored goes back to the queue to run again,
    // rather than be acknowledged and lost.
    queue::settle(shared, id, stored.is_none()).await;
    release_local(shared, id).await;
    if let Some(chain) = asked.map(|a| a.chain) {
        record_outcome(shared, &chain, result).await;
    }
    publish_event(shared, &event).await;
}

async fn publish_event(shared: &Shared, event: &Event) {
    let subject = shared.subjects.events(&event.request_id);
    let body = serde_json::to_vec(event).expect("events serialize");
    if let Err(error) = shared.client.publish(subject, body.into()).await {
        tracing::warn!(message = "could not publish an event", %error, request_id = %event.request_id);
    }
}

/// The shared store holds the result now: the supervisor's in-memory copy goes, so a worker's
/// memory does not grow with the results it ran.
async fn release_local(shared: &Shared, request_id: &str) {
    let _ = shared
        .supervisor
        .send(crate::actors::GetResult {
            request_id: request_id.to_string(),
            release: true,
        })
        .await;
}

/// Stores a result, trying again for up to [`STORE_RESULT_FOR`] (NATS reconnecting, a bucket
/// electing a leader). `None` when it gave up.
async fn store_result(
    shared: &Shared,
    result: &crate::protocol::GenerationResult,
) -> Option<Stored> {
    let mut delay = Duration::from_millis(50);
    let started = tokio::time::Instant::now();
    let mut attempt = 0;
    loop {
        attempt += 1;
        match shared.stores.store_result(result).await {
            Ok(Stored::Stored) => return Some(Stored::Stored),
            Ok(Stored::AlreadyStored) => {
                tracing::warn!(message = "another runner stored this request's result first; this one is discarded", request_id = %result.request_id);
                return Some(Stored::AlreadyStored);
            }
            Err(error) if started.elapsed() + delay < STORE_RESULT_FOR => {
                tracing::warn!(message = "storing a result failed; retrying", %error, attempt, request_id = %result.request_id);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(error) => {
                tracing::error!(message = "gave up storing a result", %error, attempt, request_id = %result.request_id);
                return None;
            }
        }
    }
}

/// Characters of a failure's detail its signal carries.
const FAILURE_DETAIL_CHARS: usize = 1000;

/// `signals.outcome.FAILED`: a request ended FAILED, with its reason, detail and place in its
/// job, for managers and the console.
fn failure_signal(result: &GenerationResult, pool: &str) -> Signal {
    use crate::protocol::finished::opening;
    let detail = result
        .detail
        .as_deref()
        .map(|d| opening(d, FAILURE_DETAIL_CHARS));
    let mut meta = serde_json::Map::new();
    meta.insert("reason".into(), result.reason.as_str().into());
    meta.insert("detail".into(), detail.clone().into());
    meta.insert("attempt".into(), result.attempt.into());
    meta.insert("chain_position".into(), result.chain_position.into());
    meta.insert(
        "parent_request_id".into(),
        result.parent_request_id.clone().into(),
    );
    let summary = match &detail {
        Some(detail) => format!(
            "request failed: {}: {}",
            result.reason.as_str(),
            opening(detail, 200)
        ),
        None => format!("request failed: {}", result.reason.as_str()),
    };
    Signal {
        signal_id: crate::protocol::ids::new_id(),
        kind: SignalType::Outcome,
        code: "FAILED".into(),
        source: SignalSource::Worker,
        severity: Severity::High,
        summary,
        meta,
        request_id: result.request_id.clone(),
        root_request_id: result.root_request_id.clone(),
        job_name: result.job_name.clone(),
        worker_id: result.worker_id.clone(),
        pool: pool.to_string(),
        ts: crate::protocol::ids::now_rfc3339(),
        decision: None,
    }
}

async fn publish_signal(shared: &Shared, signal: &Signal) {
    let subject = shared.subjects.signal(signal.kind, &signal.code);
    let body = serde_json::to_vec(signal).expect("signals serialize");
    let jetstream = &shared.stores.jetstream;
    let published = match jetstream.publish(subject, body.into()).await {
        Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
        Err(error) => Err(error.to_string()),
    };
    if let Err(error) = published {
        tracing::warn!(message = "a signal was not stored in its stream", %error, request_id = %signal.request_id);
    }
}

/// Keeps the records of running requests alive within the bucket's TTL.
async fn refresh_records(shared: Arc<Shared>) {
    let every = Duration::from_millis(shared.settings.jetstream.running_refresh_ms);
    loop {
        tokio::time::sleep(every).await;
        let records: Vec<LiveRecord> = shared.lock_running().values().cloned().collect();
        for record in records {
            let _ = shared.stores.put_live(&record).await;
            if !shared.lock_running().contains_key(&record.request_id) {
                // It finished meanwhile, and the refresh may have written its records again
                // after the finish took them away: take them away once its result is stored.
                tokio::spawn(take_back_refreshed(shared.clone(), record));
            }
        }
    }
}

/// Removes the records a refresh wrote for a request that had just finished, once its result
/// is stored (bounded: a result that never comes leaves the records to the bucket's TTL).
pub(super) async fn take_back_refreshed(shared: Arc<Shared>, record: LiveRecord) {
    for _ in 0..50 {
        if let Ok(Some(_)) = shared.stores.stored(&record.request_id).await {
            let ours = shared
                .stores
                .live(&record.request_id)
                .await
                .ok()
                .flatten()
                .is_some_and(|live| live.worker_id == record.worker_id);
            shared.stores.take_back(&record, ours).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn serve_any(shared: Arc<Shared>, verb: &'static str, mut sub: async_nats::Subscriber) {
    while let Some(message) = sub.next().await {
        let shared2 = shared.clone();
        spawn_handler(&shared, async move {
            let request_id = Subjects::request_id_of(&message.subject).to_string();
            match verb {
                "status" => {
                    let reply = guarded(bounded(status(&shared2, &request_id))).await;
                    respond(&shared2.client, &message, reply).await;
                }
                "result" => {
                    let reply = guarded(bounded(result(&shared2, &request_id, &message))).await;
                    respond(&shared2.client, &message, reply).await;
                }
                _ => {
                    let reply = guarded(cancel(&shared2, &request_id)).await;
                    respond(&shared2.client, &message, reply).await;
                }
            }
        })
        .await;
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
pub struct StatusReply {
    pub request_id: String,
    pub state: RequestState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Set once a decision this request raised was answered with an option that continues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation_request_id: Option<String>,
    /// The decision this request raised, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    /// What became of it: pending, continued, skipped, aborted or expired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_outcome: Option<DecisionOutcome>,
    /// A finished request's summary (how it ended, why, its figures and openings), kept for
    /// people after its result is read, for `jetstream.finished_ttl_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<FinishedSummary>,
}

impl StatusReply {
    fn new(request_id: &str, state: RequestState) -> StatusReply {
        StatusReply {
            request_id: request_id.into(),
            state,
            worker_id: None,
            attempt: None,
            continuation_request_id: None,
            decision_id: None,
            decision_outcome: None,
            finished: None,
        }
    }

    fn with_finished(mut self, summary: FinishedSummary) -> StatusReply {
        self.finished = Some(summary);
        self
    }
}

/// Reads of the stores answer within [`STORE_WAIT`]: a caller waiting on a stuck store gets
/// INTERNAL in time rather than no answer.
async fn bounded<T>(
    read: impl std::future::Future<Output = Result<T, WireError>>,
) -> Result<T, WireError> {
    tokio::time::timeout(STORE_WAIT, read)
        .await
        .unwrap_or_else(|_| {
            Err(WireError::new(
                ErrorCode::Internal,
                "the stores did not answer in time",
            ))
        })
}

/// What became of the decision this request raised, if any.
async fn decision_mark(shared: &Shared, request_id: &str) -> Option<ChainMark> {
    shared.decisions.mark_of(request_id).await
}

/// A continuation's ending is its decision's outcome in the history.
async fn record_outcome(
    shared: &Shared,
    chain: &crate::engine::ChainState,
    result: &crate::protocol::GenerationResult,
) {
    let (Some(decision_id), Some(code)) = (&chain.decision_id, &chain.decision_code) else {
        return;
    };
    if let Err(error) = shared
        .decisions
        .history()
        .set_outcome(code, decision_id, result)
        .await
    {
        tracing::warn!(message = "the decision's outcome was not written to the history", %error, decision_id = %decision_id);
    }
}

fn store_error(error: BusError) -> WireError {
    WireError::new(ErrorCode::Internal, error.to_string())
}

fn not_found(request_id: &str) -> WireError {
    WireError::new(
        ErrorCode::NotFound,
        format!("request {request_id} is not known (or its result was already read)"),
    )
}

async fn status(shared: &Shared, request_id: &str) -> Result<StatusReply, WireError> {
    match status_once(shared, request_id).await {
        // The result is stored before the live record goes: a read of the result just before
        // it was stored and of the live record just after it went finds neither. A second look
        // sees the result.
        Err(error) if error.code == ErrorCode::NotFound => status_once(shared, request_id).await,
        other => other,
    }
}

async fn status_once(shared: &Shared, request_id: &str) -> Result<StatusReply, WireError> {
    if !crate::protocol::ids::is_valid_request_id(request_id) {
        return Err(WireError::invalid(
            "the subject does not end in a valid request id",
        ));
    }
    let stored = shared
        .stores
        .stored(request_id)
        .await
        .map_err(store_error)?;
    if let Some((stored, _)) = stored {
        let (mark, kept) = tokio::join!(
            decision_mark(shared, request_id),
            shared.stores.finished_summary(request_id)
        );
        let (state, worker_id, attempt, finished) = match stored {
            StoredResult::Result(result) => {
                // Kept a moment after the result is stored: until then, made from the result.
                let finished = kept.or_else(|| Some(FinishedSummary::of(&result, None)));
                (
                    result.state,
                    Some(result.worker_id),
                    Some(result.attempt),
                    finished,
                )
            }
            StoredResult::Released { state, .. } => (state, None, None, kept),
        };
        return Ok(StatusReply {
            request_id: request_id.into(),
            state,
            worker_id,
            attempt,
            continuation_request_id: mark
                .as_ref()
                .and_then(|m| m.continuation_request_id.clone()),
            decision_id: mark.as_ref().map(|m| m.decision_id.clone()),
            decision_outcome: mark.map(|m| m.outcome),
            finished,
        });
    }
    if let Some(record) = shared.stores.live(request_id).await.map_err(store_error)? {
        return Ok(StatusReply {
            worker_id: Some(record.worker_id),
            attempt: Some(record.attempt),
            ..StatusReply::new(request_id, record.state)
        });
    }
    if queue::find_queued(shared, request_id)
        .await
        .map_err(store_error)?
        .is_some()
    {
        return Ok(StatusReply::new(request_id, RequestState::Queued));
    }
    // Its result (and the marker that outlives a read) aged out: the summary kept for people
    // still says how it ended.
    match shared.stores.finished_summary(request_id).await {
        Some(summary) => Ok(StatusReply {
            worker_id: Some(summary.worker_id.clone()),
            attempt: Some(summary.attempt),
            ..StatusReply::new(request_id, summary.state)
        }
        .with_finished(summary)),
        None => Err(not_found(request_id)),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultOptions {
    #[serde(default = "yes")]
    release: bool,
}

fn yes() -> bool {
    true
}

async fn result(
    shared: &Shared,
    request_id: &str,
    message: &async_nats::Message,
) -> Result<crate::protocol::GenerationResult, WireError> {
    if !crate::protocol::ids::is_valid_request_id(request_id) {
        return Err(WireError::invalid(
            "the subject does not end in a valid request id",
        ));
    }
    let options: ResultOptions = if message.payload.is_empty() {
        ResultOptions { release: true }
    } else {
        decode(message, 4096)?
    };
    result_once(shared, request_id, options, false).await
}

async fn result_once(
    shared: &Shared,
    request_id: &str,
    options: ResultOptions,
    retried: bool,
) -> Result<crate::protocol::GenerationResult, WireError> {
    match shared
        .stores
        .stored(request_id)
        .await
        .map_err(store_error)?
    {
        Some((StoredResult::Result(result), revision)) => {
            if !options.release {
                return Ok(*result);
            }
            if shared
                .stores
                .release(request_id, result.state, revision)
                .await
                .map_err(store_error)?
            {
                Ok(*result)
            } else {
                Err(not_found(request_id))
            }
        }
        Some((StoredResult::Released { .. }, _)) => Err(not_found(request_id)),
        None => match status(shared, request_id).await {
            // Stored between the two reads: read it again.
            Ok(status) if status.state.is_terminal() && !retried => {
                Box::pin(result_once(shared, request_id, options, true)).await
            }
            Ok(status) => Err(WireError::new(
                ErrorCode::NotReady,
                format!("request {request_id} is {}", status.state.as_str()),
            )
            .with_detail(serde_json::json!({"state": status.state}))),
            Err(error) => Err(error),
        },
    }
}

async fn cancel(shared: &Shared, request_id: &str) -> Result<CancelReply, WireError> {
    if !crate::protocol::ids::is_valid_request_id(request_id) {
        return Err(WireError::invalid(
            "the subject does not end in a valid request id",
        ));
    }
    if let Some((stored, _)) = shared
        .stores
        .stored(request_id)
        .await
        .map_err(store_error)?
    {
        let state = match stored {
            StoredResult::Result(result) => result.state,
            StoredResult::Released { state, .. } => state,
        };
        // A request waiting on a decision: cancelling it expires the decision.
        if let Some(mark) = decision_mark(shared, request_id).await
            && mark.outcome == DecisionOutcome::Pending
            && let Some(record) = shared
                .decisions
                .expire(
                    &shared.client,
                    &shared.worker_id,
                    &mark.decision_id,
                    "the caller cancelled the request that raised it",
                )
                .await
                .map_err(store_error)?
        {
            return Ok(CancelReply {
                request_id: request_id.into(),
                state: RequestState::Cancelled,
                decision_id: Some(record.decision_id),
            });
        }
        return Err(WireError::new(
            ErrorCode::AlreadyFinished,
            format!("request {request_id} already ended"),
        )
        .with_detail(serde_json::json!({"state": state})));
    }
    let Some(record) = shared.stores.live(request_id).await.map_err(store_error)? else {
        if let Some(sequence) = queue::find_queued(shared, request_id)
            .await
            .map_err(store_error)?
            && queue::cancel_queued(shared, request_id, sequence)
                .await
                .map_err(store_error)?
        {
            return Ok(CancelReply {
                request_id: request_id.into(),
                state: RequestState::Cancelled,
                decision_id: None,
            });
        }
        return Err(not_found(request_id));
    };
    if record.worker_id == shared.worker_id {
        return cancel_here(shared, request_id).await;
    }
    // Another worker runs it: forward and relay its answer.
    let wait =
        Duration::from_millis(shared.settings.worker.cancel_wait_ms) + Duration::from_secs(2);
    let subject = shared.subjects.worker_cancel(&record.worker_id);
    let reply = tokio::time::timeout(
        wait,
        shared
            .client
            .request(subject, request_id.to_string().into()),
    )
    .await;
    match reply {
        Ok(Ok(message)) => {
            if let Ok(reply) = serde_json::from_slice::<CancelReply>(&message.payload) {
                return Ok(reply);
            }
            match serde_json::from_slice::<crate::protocol::ErrorReply>(&message.payload) {
                Ok(error) => Err(error.into()),
                Err(_) => Err(WireError::new(
                    ErrorCode::Internal,
                    "the running worker sent an unreadable answer",
                )),
            }
        }
        Ok(Err(error)) => Err(WireError::new(
            ErrorCode::Internal,
            format!("worker {} does not answer: {error}", record.worker_id),
        )),
        Err(_) => Err(WireError::new(
            ErrorCode::Internal,
            format!("worker {} did not answer in time", record.worker_id),
        )),
    }
}

async fn cancel_here(shared: &Shared, request_id: &str) -> Result<CancelReply, WireError> {
    // Marked before the cancel goes in, so its `finished` (which may come first) sees it.
    shared.lock_cancelled().insert(request_id.to_string());
    // Listening before the cancel goes in, so the notice of the stored result is not missed.
    let mut stored = shared.stored.subscribe();
    // A durable request in hand still waiting for a slot is not known to the supervisor: marked,
    // it ends CANCELLED without running (or, if it starts meanwhile, is cancelled as it starts).
    let waiting = shared
        .lock_waiting()
        .get_mut(request_id)
        .map(|waiting| {
            waiting.cancelled = true;
            waiting.wake.notify_one();
        })
        .is_some();
    let reply = shared
        .supervisor
        .send(Cancel {
            request_id: request_id.to_string(),
        })
        .await
        .map_err(|_| WireError::new(ErrorCode::Internal, "the worker is stopping"))
        .and_then(|r| r);
    let reply = match reply {
        Err(error) if waiting && error.code == ErrorCode::NotFound => Ok(CancelReply {
            request_id: request_id.to_string(),
            state: RequestState::Cancelled,
            decision_id: None,
        }),
        reply => reply,
    };
    if reply.is_err() {
        // Nothing was cancelled, so no `finished` will clear the mark: a caller must not be
        // able to grow this set with cancels of requests that are not running here.
        shared.lock_cancelled().remove(request_id);
        return reply;
    }
    // The reply comes once the result is stored (bounded), so a caller's next `result` finds
    // it.
    let wait = Duration::from_millis(shared.settings.worker.cancel_wait_ms);
    let _ = tokio::time::timeout(wait, async {
        loop {
            match stored.recv().await {
                Ok(id) if id == request_id => return,
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    if let Ok(Some(_)) = shared.stores.stored(request_id).await {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    })
    .await;
    reply
}

async fn serve_own_cancels(shared: Arc<Shared>, mut sub: async_nats::Subscriber) {
    while let Some(message) = sub.next().await {
        let shared2 = shared.clone();
        spawn_handler(&shared, async move {
            let request_id = String::from_utf8_lossy(&message.payload).to_string();
            let reply = guarded(cancel_here(&shared2, &request_id)).await;
            respond(&shared2.client, &message, reply).await;
        })
        .await;
    }
}

/// Stores a pending decision before its signal goes out, so a fast manager finds it.
async fn record_decision(
    shared: &Shared,
    signal: &Signal,
    decision: &crate::protocol::DecisionBlock,
    seq: u64,
) {
    let Some(asked) = shared.lock_asked().get(&signal.request_id).cloned() else {
        tracing::warn!(message = "a decision for a request not running here was not recorded", request_id = %signal.request_id);
        return;
    };
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
        answer: None,
        expired_at: None,
    };
    if let Err(error) = shared.decisions.record(&record).await {
        tracing::error!(message = "could not store a pending decision", %error, decision_id = %record.decision_id);
    }
}

async fn serve_decisions(shared: Arc<Shared>, mut sub: async_nats::Subscriber) {
    while let Some(message) = sub.next().await {
        let shared2 = shared.clone();
        spawn_handler(&shared, async move {
            let decision_id = Subjects::request_id_of(&message.subject).to_string();
            let reply = guarded(answer_decision(&shared2, &decision_id, &message)).await;
            respond(&shared2.client, &message, reply).await;
        })
        .await;
    }
}

async fn answer_decision(
    shared: &Shared,
    decision_id: &str,
    message: &async_nats::Message,
) -> Result<super::decisions::DecisionReply, WireError> {
    let answer: DecisionAnswer = decode(message, 64 * 1024)?;
    let (reply, _) = shared
        .decisions
        .answer(&shared.client, &shared.worker_id, decision_id, answer)
        .await?;
    Ok(reply)
}
