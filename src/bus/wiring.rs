//! The worker's wiring: its connection, stores, engine and Supervisor, then its long-running
//! tasks, each started here under its name. Building the worker is kept apart from running it
//! (the verbs live in their own modules), so this file is the one place that shows everything
//! a worker runs.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::decisions::Decisions;
use super::finish::FINISHING_AT_ONCE;
use super::lookup::Lookup;
use super::shared::{Hold, MAX_IN_FLIGHT, Shared};
use super::store::Stores;
use super::tools::BusToolRunner;
use super::{
    BusError, decide, finish, heartbeat, lookup, pull, queue, service, submit, tenant_limit, upkeep,
};
use crate::actors::{Supervisor, SupervisorConfig, SupervisorHandle};
use crate::client::connect;
use crate::client::subjects::Subjects;
use crate::engine::{DefaultBios, Engine, EngineConfig};
use crate::llm::OpenAiBackend;
use crate::observe::{MeteredBackend, Metrics, Readiness};
use crate::settings::Settings;

/// Events waiting to be published before generations wait for the publisher.
const EVENT_BUFFER: usize = 4096;
/// Notices of stored results kept for cancels waiting on them; a cancel that falls behind looks
/// in the store instead.
const STORED_NOTICES: usize = 1024;

/// The worker's long-running tasks, by name.
pub(super) struct Tasks(Vec<(&'static str, tokio::task::JoinHandle<()>)>);

impl Tasks {
    fn new() -> Tasks {
        Tasks(Vec::new())
    }

    /// Starts a task. One that ends while the worker runs is a bug or a lost subscription: it
    /// says so, by name.
    fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        let handle = tokio::spawn(async move {
            task.await;
            tracing::warn!(message = "a worker task ended", task = name);
        });
        self.0.push((name, handle));
    }

    pub(super) fn abort_all(self) {
        for (_, task) in self.0 {
            task.abort();
        }
    }
}

/// A worker that serves.
pub(super) struct Started {
    pub(super) shared: Arc<Shared>,
    pub(super) handle: SupervisorHandle<Arc<Hold>>,
    pub(super) tasks: Tasks,
    /// Where its HTTP server (metrics, health) listens, when `http.listen` is set.
    pub(super) http_addr: Option<std::net::SocketAddr>,
}

pub(super) async fn start(settings: Settings, worker_id: String) -> Result<Started, BusError> {
    // The HTTP server comes first, so /healthz answers while the worker waits for NATS.
    let metrics = Arc::new(Metrics::new());
    metrics.slots_total.set(i64::from(settings.worker.slots));
    let readiness = Arc::new(Readiness::default());
    let mut tasks = Tasks::new();
    let http_addr = match settings.http.listen.as_str() {
        "" => None,
        listen => {
            let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
                BusError::Setup(format!("cannot listen on {listen} (http.listen): {e}"))
            })?;
            let addr = listener.local_addr().ok();
            tasks.spawn(
                "http",
                crate::observe::serve(listener, metrics.clone(), readiness.clone()),
            );
            addr
        }
    };
    match serve(settings, worker_id, metrics, readiness, &mut tasks).await {
        Ok((shared, handle)) => Ok(Started {
            shared,
            handle,
            tasks,
            http_addr,
        }),
        Err(error) => {
            tasks.abort_all();
            Err(error)
        }
    }
}

async fn serve(
    settings: Settings,
    worker_id: String,
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
    tasks: &mut Tasks,
) -> Result<(Arc<Shared>, SupervisorHandle<Arc<Hold>>), BusError> {
    let client = connect::connect(&settings.nats, connect::ConnectPurpose::Worker)
        .await
        .map_err(|e| BusError::Setup(e.to_string()))?;
    let subjects = Subjects::new(&settings.subjects);
    let jetstream = async_nats::jetstream::new(client.clone());
    let stores = Stores::ensure(jetstream, &settings.jetstream, &subjects).await?;
    let decisions = Decisions::open(
        &stores.jetstream,
        &settings,
        stores.results.clone(),
        metrics.clone(),
    )
    .await?;
    let workers = heartbeat::open(
        &stores.jetstream,
        Duration::from_millis(settings.worker.lost_after_ms),
        settings.jetstream.replicas,
    )
    .await?;
    // The tenants' counts cost a bucket (and writes) only where a pool limit is set.
    let tenant_buckets = match settings.worker.tenants.pool_max_running {
        0 => None,
        _ => Some(
            tenant_limit::open(
                &stores.jetstream,
                settings.jetstream.replicas,
                workers.clone(),
            )
            .await?,
        ),
    };
    let tenant_counts = Arc::new(tenant_limit::TenantCounts::new(
        &settings,
        worker_id.clone(),
        tenant_buckets,
    ));
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
    let follow_tools =
        super::catalog::follow_tools(&stores.jetstream, &settings, engine.clone()).await?;
    tasks.0.push(("tool catalog", follow_tools));
    let (events_tx, events_rx) = mpsc::channel(EVENT_BUFFER);
    let handle = Supervisor::start(
        SupervisorConfig::from_settings(&settings, worker_id.clone()),
        engine,
        Some(events_tx),
    );
    // No work until the backend answers (the backend probe below takes the pause off): a
    // worker whose model server is down would fail every request it took at once.
    let backend_up = match backend.probe(Duration::from_secs(5)).await {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(
                message = "waiting for the backend to answer before taking work",
                backend = %settings.llm.base_url,
                %error
            );
            handle
                .addr
                .send(crate::actors::Pause(true))
                .await
                .map_err(|e| BusError::Setup(format!("the supervisor stopped: {e}")))?;
            false
        }
    };
    readiness
        .backend_up
        .store(backend_up, std::sync::atomic::Ordering::Relaxed);
    metrics.backend_up.set(i64::from(backend_up));
    let shared = Arc::new(Shared {
        worker_id: worker_id.clone(),
        client: client.clone(),
        subjects: subjects.clone(),
        stores,
        supervisor: handle.addr.clone(),
        checker: handle.checker.clone(),
        capacity: handle.capacity.clone(),
        workers,
        peer_slots: Default::default(),
        decisions,
        in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
        finishing: Arc::new(tokio::sync::Semaphore::new(FINISHING_AT_ONCE as usize)),
        stored: tokio::sync::broadcast::channel(STORED_NOTICES).0,
        metrics: metrics.clone(),
        tenant_stats: super::tenants::TenantStats::new(metrics.clone()),
        listing: Default::default(),
        handed_off: Default::default(),
        fencing: super::shared::Fencing::new(std::time::Duration::from_millis(
            settings.worker.lost_after_ms,
        )),
        tenant_counts,
        settings,
    });
    // Keyed continuations of this pool go where the fleet's rule puts their key.
    let placing = Arc::downgrade(&shared);
    shared.decisions.place_with(Box::new(move |pool, key| {
        let shared = placing.upgrade()?;
        if pool != shared.settings.worker.pool {
            return None;
        }
        let this = super::shared::this_load(&shared);
        shared
            .peer_slots
            .place(key, this, shared.settings.placement.load_factor)
    }));
    // On record as alive before taking any request, so no live worker takes it for lost.
    heartbeat::first_beat(&shared).await?;
    tasks.spawn("heartbeat", heartbeat::run(shared.clone()));
    if shared.tenant_counts.is_set() {
        tasks.spawn(
            "tenant counts",
            shared.tenant_counts.clone().follow_counts(),
        );
        tasks.spawn(
            "tenant count writes",
            shared.tenant_counts.clone().keep_counts(),
        );
    }
    tasks.spawn("events", finish::publish_events(shared.clone(), events_rx));
    // Subscribed (and the server told) before the worker says it is ready, so the first
    // submit after start finds it.
    for (name, route) in [
        ("submits", submit::Route::Pool),
        ("own submits", submit::Route::Own),
    ] {
        let first = route
            .subscribe(&shared)
            .await
            .map_err(|e| BusError::Setup(format!("cannot subscribe to submits: {e}")))?;
        tasks.spawn(
            name,
            submit::serve_submits(shared.clone(), handle.capacity.clone(), Some(first), route),
        );
    }
    let heard = Arc::new(pull::Heard::default());
    let notices = pull::notices(&shared).await?;
    let scheduler = pull::Scheduler::open(shared.clone(), heard.clone()).await?;
    tasks.spawn(
        "queue notices",
        pull::hear_notices(shared.clone(), heard.clone(), notices),
    );
    tasks.spawn("queue scan", pull::scan(shared.clone(), heard));
    tasks.spawn(
        "queue",
        queue::serve_queue(shared.clone(), scheduler, handle.capacity.clone()),
    );
    let exhausted = queue::exhausted_advisories(&shared).await?;
    tasks.spawn(
        "exhausted deliveries",
        queue::serve_exhausted(shared.clone(), exhausted),
    );
    // The default tenant's requests (`gen.<verb>.<id>`) and every other tenant's
    // (`gen.<verb>.<tenant>.<id>`), each subject answered by one worker of the fleet.
    for verb in Lookup::ALL {
        for (subject, name) in [
            (subjects.any(verb.verb()), verb.verb()),
            (subjects.any_tenant(verb.verb()), verb.tenants_task()),
        ] {
            let sub = client
                .queue_subscribe(subject.clone(), subjects.any_group().to_string())
                .await
                .map_err(|e| BusError::Setup(format!("cannot subscribe to {subject}: {e}")))?;
            tasks.spawn(name, lookup::serve(shared.clone(), verb, sub));
        }
    }
    let forwarded = client
        .subscribe(subjects.worker_cancel(&worker_id))
        .await
        .map_err(|e| BusError::Setup(format!("cannot subscribe to forwarded cancels: {e}")))?;
    tasks.spawn(
        "forwarded cancels",
        lookup::serve_forwarded_cancels(shared.clone(), forwarded),
    );
    let answers = client
        .queue_subscribe(
            subjects.decision("*"),
            subjects.decisions_group().to_string(),
        )
        .await
        .map_err(|e| BusError::Setup(format!("cannot subscribe to decisions: {e}")))?;
    tasks.spawn(
        "decision answers",
        decide::serve_answers(shared.clone(), answers),
    );
    let sweeper = shared.clone();
    tasks.spawn("decision expiry", async move {
        sweeper
            .decisions
            .sweep(sweeper.client.clone(), sweeper.worker_id.clone())
            .await
    });
    tasks.spawn("record refresh", upkeep::refresh_records(shared.clone()));
    tasks.spawn(
        "delivery keep-alive",
        upkeep::keep_deliveries(shared.clone()),
    );
    tasks.spawn(
        "backend probe",
        service::probe_backend(
            shared.clone(),
            backend,
            readiness.backend_up.clone(),
            backend_up,
        ),
    );
    tasks.spawn(
        "slot gauges",
        service::slot_gauges(metrics.clone(), handle.capacity.clone()),
    );
    tasks.spawn("queue lag", queue::measure_lag(shared.clone()));
    readiness.started(client.clone(), handle.capacity.clone());
    let (service, endpoint) = service::register(&shared, handle.capacity.clone()).await?;
    tasks.spawn(
        "service API",
        service::serve_capacity(shared.clone(), service, endpoint),
    );
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
    Ok((shared, handle))
}
