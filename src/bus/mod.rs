//! The bus layer: the worker on NATS (subjects, stores, events, signals, tools) and the client
//! API the CLI and tests use. It knows the actor layer below it and nothing above.

pub mod catalog;
pub mod client;
pub mod connect;
pub mod decisions;
pub mod heartbeat;
pub mod history;
pub mod queue;
pub(crate) mod reply;
pub mod store;
pub mod subjects;
pub mod tool_service;
pub mod tools;
pub mod worker;

/// A failure of the bus layer itself (not of a request).
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("{0}")]
    Setup(String),
    #[error("{0}")]
    Store(String),
}
