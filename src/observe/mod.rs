//! What a worker tells operators: Prometheus metrics, liveness and readiness over HTTP.

pub mod backend;
pub mod http;
pub mod metrics;

pub use backend::MeteredBackend;
pub use http::{Draining, Readiness, serve};
pub use metrics::Metrics;
