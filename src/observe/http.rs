//! The worker's HTTP server on `http.listen`: `/metrics` (Prometheus text), `/healthz` (the
//! process is up), `/readyz` (it can take work: connected to NATS, the backend answers, not
//! draining) and `/scaling` (the pool's backlog and busy slots as JSON, for an autoscaler).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::sync::watch;

use super::Metrics;
use super::metrics::{POOL_SIGNALS_STALE_AFTER, PoolSignals};

/// What readiness needs to know of the worker's slots. The slots belong to the actors, above
/// this layer; the layer that wires both (the worker) implements this for the capacity it
/// watches, so observe never names the actors.
pub trait Draining {
    /// The worker is giving its work back and takes no more.
    fn draining(&self) -> bool;
}

/// What `/readyz` looks at. The server starts before the worker reaches NATS (so liveness
/// holds while it waits); until the worker is started it is not ready.
pub struct Readiness {
    started: OnceLock<Started>,
    /// Set by the backend probe.
    pub backend_up: Arc<AtomicBool>,
}

struct Started {
    nats: async_nats::Client,
    /// Reads the latest capacity the worker announced.
    draining: Box<dyn Fn() -> bool + Send + Sync>,
}

impl Default for Readiness {
    fn default() -> Self {
        Readiness {
            started: OnceLock::new(),
            backend_up: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl Readiness {
    /// The worker is connected and has its slots.
    pub fn started<C>(&self, nats: async_nats::Client, capacity: watch::Receiver<C>)
    where
        C: Draining + Send + Sync + 'static,
    {
        let draining = Box::new(move || capacity.borrow().draining());
        let _ = self.started.set(Started { nats, draining });
    }

    /// Ready, or why not.
    pub fn check(&self) -> Result<(), String> {
        let Some(started) = self.started.get() else {
            return Err("starting (waiting for NATS and the stores)".into());
        };
        if (started.draining)() {
            return Err("draining".into());
        }
        if started.nats.connection_state() != async_nats::connection::State::Connected {
            return Err("not connected to NATS".into());
        }
        if !self.backend_up.load(Ordering::Relaxed) {
            return Err("the backend does not answer".into());
        }
        Ok(())
    }
}

struct Served {
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
}

/// Serves until the task is aborted.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
) {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/scaling", get(scaling))
        .with_state(Arc::new(Served { metrics, readiness }));
    if let Err(error) = crate::serve::serve(listener, app, std::future::pending()).await {
        tracing::error!(message = "the HTTP server stopped", %error);
    }
}

async fn metrics_text(State(served): State<Arc<Served>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        served.metrics.encode(),
    )
}

#[derive(serde::Serialize)]
struct Measured {
    #[serde(flatten)]
    signals: PoolSignals,
    /// How long ago the worker measured them.
    age_ms: u64,
}

/// The pool's scaling signals as JSON (KEDA's metrics-api scaler reads one field of it); 503
/// before the first measurement and when the last one is older than
/// [`POOL_SIGNALS_STALE_AFTER`].
async fn scaling(State(served): State<Arc<Served>>) -> axum::response::Response {
    match served.metrics.pool_signals() {
        Some((signals, age)) if age <= POOL_SIGNALS_STALE_AFTER => axum::Json(Measured {
            signals,
            age_ms: age.as_millis() as u64,
        })
        .into_response(),
        Some((_, age)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the pool was last measured {} s ago (NATS unreachable?)\n",
                age.as_secs()
            ),
        )
            .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the pool is not measured yet\n".to_string(),
        )
            .into_response(),
    }
}

async fn ready(State(served): State<Arc<Served>>) -> impl IntoResponse {
    match served.readiness.check() {
        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}
