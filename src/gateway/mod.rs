//! `genfleet gateway`: an OpenAI-compatible front door to the fleet (see docs/gateway.md).
//!
//! The gateway is a client of the bus like the console: a chat completion becomes a
//! generation request submitted to a pool (or put on its durable queue when no slot is free),
//! its events are followed through the decisions of its chain, and what the caller sees is one
//! OpenAI completion, whole or streamed as `chat.completion.chunk`s.
//!
//! It keeps nothing between requests (every request's state is on the bus), so any number of
//! gateways serve side by side behind one address.
//!
//! Architecture invariants:
//! - A caller that goes away cancels its request on every path (see [`run::CancelGuard`]).
//! - A request the gateway sends always carries a deadline (`gateway.max_request_ms`), so
//!   one whose caller and gateway both vanished still ends.

mod answer;
pub mod batches;
mod collect;
mod error;
pub mod files;
mod http;
pub mod keys;
pub mod mapping;
mod metrics;
pub mod openai;
mod page;
mod pools;
pub mod responses;
mod run;
mod stream;

pub use self::error::REQUEST_ID_HEADER;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use self::keys::Keys;
use self::metrics::Metrics;
use self::pools::Pools;
use crate::client::Client;
use crate::settings::Settings;

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
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

/// What the handlers share.
pub(crate) struct Shared {
    pub client: Client,
    pub settings: Settings,
    pub keys: Keys,
    pub pools: Pools,
    pub metrics: Metrics,
    /// The stored responses of the Responses API.
    pub responses: responses::store::Responses,
    /// The files of the Files API (batch input and output).
    pub files: files::Files,
    /// The batches of the Batch API, and the wake-up of this replica's keeper of them.
    pub batches: crate::client::batches::Batches,
    pub batch_wake: tokio::sync::Notify,
    /// This replica's id, for the leases of the batches it drives.
    pub replica: String,
    /// Cancelled when the drain after a stop ran out: open responses cancel their requests.
    pub abort: CancellationToken,
    /// Cancelled when the gateway stops taking requests.
    pub stopping: CancellationToken,
}

/// A gateway connected to NATS and listening.
pub struct Gateway {
    shared: Arc<Shared>,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl Gateway {
    /// Checks the settings and the keys, connects to NATS (failing fast) and binds `listen`.
    /// With no key configured, an address beyond loopback is refused unless
    /// `gateway.allow_unauthenticated` is set.
    pub async fn start(settings: &Settings, listen: SocketAddr) -> Result<Gateway, GatewayError> {
        settings
            .gateway
            .validate()
            .map_err(|e| GatewayError::Invalid(e.to_string()))?;
        let keys =
            Keys::load(&settings.gateway).map_err(|e| GatewayError::Invalid(e.to_string()))?;
        if keys.is_empty() && !listen.ip().is_loopback() && !settings.gateway.allow_unauthenticated
        {
            return Err(GatewayError::Invalid(format!(
                "no API key is configured (gateway.api_keys, gateway.api_keys_file), so the \
                 gateway listens on loopback only; {listen} is not: configure keys, or set \
                 gateway.allow_unauthenticated = true to let anyone who reaches it in"
            )));
        }
        let client = Client::connect(settings)
            .await
            .map_err(|e| GatewayError::Connect(e.to_string()))?;
        let responses = responses::store::Responses::open(client.nats(), settings)
            .await
            .map_err(|e| GatewayError::Connect(e.to_string()))?;
        let files = files::Files::open(client.nats(), settings)
            .await
            .map_err(|e| GatewayError::Connect(e.to_string()))?;
        let batches = crate::client::batches::Batches::open(client.nats(), settings)
            .await
            .map_err(|e| GatewayError::Connect(e.to_string()))?;
        let (listener, addr) =
            crate::serve::bind(listen)
                .await
                .map_err(|error| GatewayError::Listen {
                    addr: listen,
                    error,
                })?;
        let shared = Shared {
            pools: Pools::new(settings),
            client: client.with_timeout(Duration::from_millis(
                settings.nats.request_timeout_ms.max(1000),
            )),
            settings: settings.clone(),
            keys,
            metrics: Metrics::new(),
            responses,
            files,
            batches,
            batch_wake: tokio::sync::Notify::new(),
            replica: crate::protocol::ids::new_id(),
            abort: CancellationToken::new(),
            stopping: CancellationToken::new(),
        };
        Ok(Gateway {
            shared: Arc::new(shared),
            listener,
            addr,
        })
    }

    /// Where it listens (the port chosen when the address asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many API keys it accepts (0: every caller is let in).
    pub fn keys(&self) -> usize {
        self.shared.keys.len()
    }

    /// Serves until `shutdown` resolves; then takes no new request, lets open responses go on
    /// for `gateway.drain_ms`, and cancels the requests of those still open.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let shared = self.shared;
        let stopping = shared.stopping.clone();
        let abort = shared.abort.clone();
        let drain = Duration::from_millis(shared.settings.gateway.drain_ms);
        tokio::spawn(async move {
            shutdown.await;
            tracing::info!(
                message = "stopping: no new requests; open responses drain",
                drain_ms = drain.as_millis() as u64
            );
            stopping.cancel();
            tokio::time::sleep(drain).await;
            abort.cancel();
        });
        tokio::spawn(batches::driver::keep(shared.clone()));
        let stopped = shared.stopping.clone();
        crate::serve::serve(
            self.listener,
            http::router(
                shared.clone(),
                responses::routes()
                    .merge(files::routes(&shared.settings))
                    .merge(batches::routes()),
            ),
            async move { stopped.cancelled().await },
        )
        .await
    }
}
