//! `genfleet console`: a web page where people watch the fleet and answer its decisions.
//!
//! The console is a manager on the bus and a client of the wire contract only:
//!
//! - the inbox is the decisions bucket (`GENFLEET_DECISIONS`, read with a watch): pending
//!   decision requests, escalations and checkpoints, and what became of answered ones;
//! - the signal feed is the signals stream (`signals.>`), read with an ordered consumer of its
//!   own, so it never takes a signal from `genfleet manager` instances;
//! - the fleet view polls the service API (`$SRV.INFO` and `$SRV.STATS` of `genfleet`) and
//!   follows `gen.events.>` for the requests running;
//! - a followed request is `gen.status`, `gen.result` (peeked, never released) and
//!   `gen.events.<id>`;
//! - the requests list follows the results bucket (`GENFLEET_RESULTS`, from its newest
//!   `console.max_requests` records on), the events, the signals and the decisions; a cancel
//!   goes to `gen.cancel.<id>`;
//! - the batches list reads the gateway's batches bucket (`gateway.batches_bucket`, read only)
//!   when a page asks, keeping the newest `console.max_requests`;
//! - an answer goes to `decisions.<decision_id>`, the checked path `genfleet decide` and the
//!   manager use (compare-and-set on the record: one answer wins), with `decided_by:
//!   human:<name>`.
//!
//! One axum server serves the page (HTML, CSS and JS embedded in the binary; no build step)
//! and pushes every change to open pages with server-sent events.
//!
//! Architecture invariant: memory is bounded whatever the fleet does. The inbox, the feed, the
//! requests list and the batches list have a size (`console.max_inbox`, `console.max_signals`,
//! `console.max_requests`), live streams a count
//! (`console.max_clients`), and a page that cannot keep up gets a fresh snapshot instead of
//! a growing backlog (a bounded broadcast channel; a lagging receiver starts over).

mod assets;
pub mod auth;
mod batches;
mod feed;
mod http;
pub mod requests;
pub mod state;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use async_nats::jetstream::{self, kv};
use serde_json::json;
use tokio::sync::{OnceCell, Semaphore, broadcast};
use tokio_util::sync::CancellationToken;

use self::auth::Gate;
use self::state::State;
use crate::client::Client;
use crate::settings::Settings;

/// Updates waiting for the slowest open page before it is sent a fresh snapshot instead.
const UPDATE_BACKLOG: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error("{0}")]
    Invalid(String),
    #[error("cannot connect to NATS: {0}")]
    Connect(String),
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        addr: SocketAddr,
        error: std::io::Error,
    },
}

/// How a console runs, beside its settings.
#[derive(Debug, Clone)]
pub struct ConsoleOptions {
    pub listen: SocketAddr,
    /// Refuse every answer even when `console.token` is set.
    pub read_only: bool,
}

/// One change pushed to the open pages: an SSE event name and its JSON.
#[derive(Debug, Clone)]
pub(crate) struct Push {
    pub event: &'static str,
    pub data: String,
}

impl Push {
    fn new(event: &'static str, data: &impl serde::Serialize) -> Push {
        Push {
            event,
            data: serde_json::to_string(data).expect("console data serializes"),
        }
    }
}

/// What the server and the bus side share.
pub(crate) struct Shared {
    state: Mutex<State>,
    updates: broadcast::Sender<Arc<Push>>,
    pub client: Client,
    pub jetstream: jetstream::Context,
    pub settings: Settings,
    pub gate: Gate,
    /// Live streams at once.
    pub clients: Arc<Semaphore>,
    decisions: OnceCell<kv::Store>,
    results: OnceCell<kv::Store>,
    /// The gateway's batches, read when a page asks.
    pub batches: batches::BatchList,
    pub shutdown: CancellationToken,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the state and tells the open pages, under one lock, so that a page that
    /// subscribes meanwhile sees every change exactly once: in its snapshot or after it.
    pub fn apply(&self, change: impl FnOnce(&mut State) -> Vec<Push>) {
        let mut state = self.lock();
        for push in change(&mut state) {
            // No page open: nobody to tell.
            let _ = self.updates.send(Arc::new(push));
        }
    }

    /// A snapshot of everything and a receiver of the changes after it.
    pub fn subscribe(&self) -> (Push, broadcast::Receiver<Arc<Push>>) {
        let state = self.lock();
        let receiver = self.updates.subscribe();
        (Push::new("snapshot", &self.snapshot_of(&state)), receiver)
    }

    pub fn snapshot(&self) -> serde_json::Value {
        self.snapshot_of(&self.lock())
    }

    fn snapshot_of(&self, state: &State) -> serde_json::Value {
        let signals: Vec<_> = state.signals.signals().collect();
        json!({
            "console": {
                "version": env!("CARGO_PKG_VERSION"),
                "read_only": self.gate.read_only(),
                "max_inbox": self.settings.console.max_inbox,
                "max_signals": self.settings.console.max_signals,
                "max_requests": self.settings.console.max_requests,
                "fleet_refresh_ms": self.settings.console.fleet_refresh_ms,
            },
            "inbox": {
                "items": state.inbox.items(),
                "dropped_pending": state.inbox.dropped_pending(),
            },
            "signals": signals,
            "fleet": state.fleet_json(),
            "links": state.links,
        })
    }

    /// A look at the state, under its lock.
    pub fn read<T>(&self, look: impl FnOnce(&State) -> T) -> T {
        look(&self.lock())
    }

    /// The results bucket, opened once it exists.
    pub async fn results(&self) -> Result<&kv::Store, String> {
        let name = &self.settings.jetstream.results_bucket;
        self.results
            .get_or_try_init(|| async {
                self.jetstream.get_key_value(name).await.map_err(|e| {
                    format!("cannot open bucket {name}: {e} (has a worker ever started?)")
                })
            })
            .await
    }

    /// The decisions bucket, opened once it exists.
    pub async fn decisions(&self) -> Result<&kv::Store, String> {
        self.decisions
            .get_or_try_init(|| async {
                self.jetstream
                    .get_key_value(&self.settings.decisions.bucket)
                    .await
                    .map_err(|e| {
                        format!(
                            "cannot open bucket {}: {e} (has a worker ever started?)",
                            self.settings.decisions.bucket
                        )
                    })
            })
            .await
    }
}

/// A console connected to NATS and listening.
pub struct Console {
    shared: Arc<Shared>,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl Console {
    /// Checks the settings, connects to NATS (failing fast) and binds the address.
    pub async fn start(
        settings: &Settings,
        options: ConsoleOptions,
    ) -> Result<Console, ConsoleError> {
        settings
            .console
            .validate()
            .map_err(|e| ConsoleError::Invalid(e.to_string()))?;
        let client = Client::connect(settings)
            .await
            .map_err(|e| ConsoleError::Connect(e.to_string()))?;
        let (listener, addr) =
            crate::serve::bind(options.listen)
                .await
                .map_err(|error| ConsoleError::Listen {
                    addr: options.listen,
                    error,
                })?;
        let token = (!options.read_only).then(|| settings.console.token.clone());
        let gate = Gate::new(token, options.listen.ip().is_loopback());
        let (updates, _) = broadcast::channel(UPDATE_BACKLOG);
        let shared = Shared {
            state: Mutex::new(State::new(
                settings.console.max_inbox,
                settings.console.max_signals,
                settings.console.max_requests,
            )),
            updates,
            jetstream: jetstream::new(client.nats().clone()),
            client: client.with_timeout(std::time::Duration::from_secs(10)),
            settings: settings.clone(),
            gate,
            clients: Arc::new(Semaphore::new(settings.console.max_clients)),
            decisions: OnceCell::new(),
            results: OnceCell::new(),
            batches: batches::BatchList::default(),
            shutdown: CancellationToken::new(),
        };
        Ok(Console {
            shared: Arc::new(shared),
            listener,
            addr,
        })
    }

    /// Where it listens (the port chosen when the address asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn read_only(&self) -> bool {
        self.shared.gate.read_only()
    }

    /// Follows the fleet and serves the page until `shutdown` resolves; open streams end then.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let shared = self.shared;
        let feed = tokio::spawn(feed::run(shared.clone()));
        let stop = shared.shutdown.clone();
        tokio::spawn(async move {
            shutdown.await;
            stop.cancel();
        });
        let stopped = shared.shutdown.clone();
        let served = crate::serve::serve(self.listener, http::router(shared.clone()), async move {
            stopped.cancelled().await
        })
        .await;
        shared.shutdown.cancel();
        feed.abort();
        let _ = feed.await;
        served
    }
}
