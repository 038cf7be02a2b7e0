//! The client room: everything a process that is not a worker needs to use the fleet, and the
//! vocabulary of the bus that workers share with it. The CLI, the gateway, the console and the
//! manager use this room and nothing of the worker's side (`bus`).
//!
//! - `connect`: one NATS connection from `[nats]` settings;
//! - `subjects`: every subject genfleet uses, built from the configured prefixes;
//! - `reply`: the bodies and headers of requests and replies on the bus (JSON or MessagePack);
//! - `streams` and `records`: the fleet's streams and buckets, and a request's record as every
//!   process reads it;
//! - `batches`: the gateway's batches and their lines' outcomes, as the gateway writes them and
//!   the console reads them;
//! - `caller`: [`Client`], submitting, queueing, placing, cancelling and deciding;
//! - `follow`: one stream of a request's events through its whole decision chain, to its last
//!   continuation;
//! - `fanout`: one subscription to a tenant's events, handed to many requests' followers (a
//!   batch's lines);
//! - `tool_service`: serving a tool to the fleet (registered in the tools bucket, answering
//!   `tools.<name>`).

pub mod batches;
pub mod caller;
pub mod connect;
pub mod fanout;
pub mod fleet;
pub mod follow;
pub mod records;
pub(crate) mod reply;
pub mod streams;
pub mod subjects;
pub mod tool_service;

pub use caller::{Client, ClientError, Queued};
pub use follow::{Follow, Lost, Step};

/// A failure to set up what the fleet needs on the bus (a stream, a bucket, a connection).
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("{0}")]
    Setup(String),
}
