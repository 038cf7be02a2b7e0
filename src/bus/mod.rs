//! The worker's side of the bus: the worker on NATS (queue, stores, events, signals, tools).
//! It knows the layers below it (client, actors, engine, llm, tools, observe, protocol,
//! settings) and nothing above; what it shares with callers (connecting, subjects, records,
//! message bodies) is the client room's.
//!
//! The worker's modules, one job each: `wiring` builds a worker and starts its named tasks;
//! `worker` runs and drains it; `admission` is the one path into the Supervisor, used by
//! `submit` and `queue`; `finish` stores results and publishes events, and `recorded` tells what a stored result tells (metrics, the failure signal); `lookup` answers status,
//! result and cancel; `decide` records decisions and takes answers; `heartbeat` beats and finds
//! lost workers; `upkeep` keeps held requests' records and deliveries alive; `service` is the
//! NATS service API; `tenant_limit` keeps the pool's count of each tenant's running requests.
//! `checkpoints` writes a running request's checkpoints into its record; `resume` takes a gone
//! worker's requests up from theirs. `store` owns the worker's writes of a request's record. `shared` is what they share.

mod admission;
mod affinity;
pub mod catalog;
mod checkpoints;
mod decide;
pub mod decisions;
mod finish;
pub mod heartbeat;
pub mod history;
mod lookup;
pub mod pull;
pub mod queue;
mod recorded;
mod resume;
mod service;
mod shared;
pub mod store;
mod submit;
mod tenant_limit;
pub mod tenants;
pub mod tools;
mod upkeep;
mod wiring;
pub mod worker;

pub use crate::client::BusError;
