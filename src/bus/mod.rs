//! The bus layer: the worker on NATS (subjects, stores, events, signals, tools) and the client
//! API the CLI and tests use. It knows the layers below it (actors, engine, llm, tools,
//! observe, protocol, settings) and nothing above.
//!
//! The worker's modules, one job each: `wiring` builds a worker and starts its named tasks;
//! `worker` runs and drains it; `admission` is the one path into the Supervisor, used by
//! `submit` and `queue`; `finish` stores results and publishes events; `lookup` answers status,
//! result and cancel; `decide` records decisions and takes answers; `heartbeat` beats and finds
//! lost workers; `upkeep` keeps held requests' records and deliveries alive; `service` is the
//! NATS service API. `store` owns the request's record in JetStream and `subjects` every
//! subject. `shared` is what they share.

mod admission;
mod affinity;
pub mod catalog;
pub mod client;
pub mod connect;
mod decide;
pub mod decisions;
mod finish;
pub mod heartbeat;
pub mod history;
mod lookup;
pub mod queue;
pub(crate) mod reply;
pub mod schedule;
mod service;
mod shared;
pub mod store;
pub mod subjects;
mod submit;
pub mod tenants;
pub mod tool_service;
pub mod tools;
mod upkeep;
mod wiring;
pub mod worker;

/// A failure of the bus layer itself (not of a request).
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("{0}")]
    Setup(String),
}
