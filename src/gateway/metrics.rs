//! The gateway's Prometheus metrics (documented in docs/gateway.md). Label values come from
//! bounded sets: tenants of the configuration, pools, finish reasons and error codes.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub tenant: String,
    pub pool: String,
    /// The finish reason, or the error's code.
    pub outcome: String,
    pub stream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    pub tenant: String,
}

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    client_gone: Family<TenantLabels, Counter>,
    open: Gauge,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("genfleet_gateway");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Chat completions answered, by tenant, pool, outcome (finish reason or error code) and stream",
            requests.clone(),
        );
        let client_gone = Family::<TenantLabels, Counter>::default();
        registry.register(
            "client_gone",
            "Requests cancelled because their caller went away before the end",
            client_gone.clone(),
        );
        let open = Gauge::default();
        registry.register(
            "open_responses",
            "Chat completions in progress",
            open.clone(),
        );
        Metrics {
            registry,
            requests,
            client_gone,
            open,
        }
    }

    pub fn answered(&self, tenant: &str, pool: &str, outcome: &str, stream: bool) {
        self.requests
            .get_or_create(&RequestLabels {
                tenant: tenant.into(),
                pool: pool.into(),
                outcome: outcome.into(),
                stream: stream.to_string(),
            })
            .inc();
    }

    pub fn client_gone(&self, tenant: &str) {
        self.client_gone
            .get_or_create(&TenantLabels {
                tenant: tenant.into(),
            })
            .inc();
    }

    /// Counts a response open until the returned guard drops.
    pub fn open(&self) -> OpenGuard {
        self.open.inc();
        OpenGuard(self.open.clone())
    }

    /// Chat completions in progress on this replica.
    pub fn open_responses(&self) -> i64 {
        self.open.get()
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

pub struct OpenGuard(Gauge);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
