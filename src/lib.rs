//! genfleet: a horizontally scaled fleet of LLM generation workers on NATS.
//!
//! See ARCHITECTURE.md for the bird's-eye view. Layers, each knowing only the one below:
//! `cli` → `bus` → `actors` → `engine` → (`llm`, `tools`); `protocol` is shared by all. The
//! exact rule, module by module, is the table in ARCHITECTURE.md, checked by
//! `tests/architecture.rs`.

pub mod actors;
pub mod bus;
pub mod cli;
pub mod console;
pub mod engine;
pub mod gateway;
pub mod llm;
pub mod manager;
pub mod observe;
pub mod protocol;
pub mod settings;
pub mod telemetry;
pub mod tools;
