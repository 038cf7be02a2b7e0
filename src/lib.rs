//! genfleet: a horizontally scaled fleet of LLM generation workers on NATS.
//!
//! See ARCHITECTURE.md for the bird's-eye view. Data flows one way: each module imports only
//! modules below it, as the table in ARCHITECTURE.md says module by module (checked by
//! `tests/architecture.rs`).

pub mod actors;
pub mod bus;
pub mod cli;
pub mod client;
pub mod console;
pub mod engine;
pub mod gateway;
pub mod llm;
pub mod manager;
pub mod observe;
pub mod protocol;
pub mod schedule;
pub mod serve;
pub mod settings;
pub mod telemetry;
pub mod tools;
