//! The worker's Prometheus metrics. Names and labels are documented in docs/operations.md; label
//! values come from bounded sets (states, reasons, signal codes, registered tool names).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde::Serialize;

use crate::protocol::{GenerationResult, SignalType};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub state: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SignalLabels {
    pub r#type: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabels {
    pub tool: String,
    /// ok, error_reply, timeout or failed.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

/// A tenant and a priority band. Tenant names are bounded (1-32 characters of
/// `[A-Za-z0-9_-]`) and a worker labels at most [`MAX_TENANT_LABELS`] of them; the rest are
/// counted under `(other)`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    pub tenant: String,
    pub band: String,
}

/// Distinct tenants a worker's metrics name at most.
pub const MAX_TENANT_LABELS: usize = 256;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

/// The pool as a whole, as one worker measured it: what an autoscaler scales the pool on
/// (`GET /scaling`, and the `genfleet_pool_*` gauges). Every worker of a pool measures the same
/// pool, so asking any one of them is enough.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolSignals {
    pub pool: String,
    /// Live workers of the pool that take work (not draining, not paused), this one included.
    pub workers: u32,
    /// Their slots, and how many of those run a request (interactive or durable).
    pub slots: u64,
    pub slots_busy: u64,
    /// Requests of the pool's durable queue, every band and tenant: not yet taken by a worker,
    /// and taken and not yet finished.
    pub queue_waiting: u64,
    pub queue_running: u64,
    /// `queue_waiting + queue_running`.
    pub backlog: u64,
    /// The slots the pool would use now if it had them: `slots_busy + queue_waiting`.
    pub wanted_slots: u64,
}

impl PoolSignals {
    pub fn new(
        pool: &str,
        workers: u32,
        slots: u64,
        busy: u64,
        waiting: u64,
        running: u64,
    ) -> Self {
        PoolSignals {
            pool: pool.to_string(),
            workers,
            slots,
            slots_busy: busy.min(slots),
            queue_waiting: waiting,
            queue_running: running,
            backlog: waiting + running,
            wanted_slots: busy.min(slots) + waiting,
        }
    }
}

/// Past this age the pool's signals are not served (the worker cannot reach NATS): an
/// autoscaler falls back to what it is told to do without them.
pub const POOL_SIGNALS_STALE_AFTER: Duration = Duration::from_secs(30);

pub struct Metrics {
    registry: Registry,
    pool_signals: Mutex<Option<(PoolSignals, Instant)>>,
    pub slots_total: Gauge,
    pub slots_busy: Gauge,
    pub draining: Gauge,
    pub requests: Family<ResultLabels, Counter>,
    pub queue_pending: Gauge,
    pub queue_ack_pending: Gauge,
    pub signals: Family<SignalLabels, Counter>,
    pub decisions_pending: Gauge,
    pub decisions: Family<OutcomeLabels, Counter>,
    pub queue_wait: Histogram,
    pub first_token: Histogram,
    pub request_seconds: Histogram,
    pub tool_calls: Family<ToolLabels, Histogram>,
    pub backend_errors: Family<KindLabels, Counter>,
    pub backend_up: Gauge,
    pub tenant_waiting: Family<TenantLabels, Gauge>,
    pub tenant_running: Family<TenantLabels, Gauge>,
    pub tenant_completed: Family<TenantLabels, Counter>,
    pub tenant_queue_wait: Family<TenantLabels, Histogram>,
    pub submits_forwarded: Counter,
    pub submits_placed: Counter,
    pub queue_duplicates: Counter,
    pub fenced: Counter,
    pub chain_headers_dropped: Counter,
    /// Requests this worker took up from another worker's checkpoint.
    pub resumed: Counter,
    /// Requests preempted here by a request of a higher band.
    pub preempted: Counter,
    /// Interactive submits answered NO_SLOT_AVAILABLE by this worker.
    pub submits_refused: Counter,
    /// The pool as a whole (the same on every worker of the pool): what an autoscaler reads.
    pub pool_workers: Gauge,
    pub pool_slots: Gauge,
    pub pool_slots_busy: Gauge,
    pub pool_backlog: Gauge,
}

/// Seconds, from 5 ms to about 20 minutes.
fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.005, 2.5, 14)
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("genfleet");
        let slots_total = Gauge::default();
        registry.register("slots_total", "Slots of this worker", slots_total.clone());
        let slots_busy = Gauge::default();
        registry.register("slots_busy", "Slots running a request", slots_busy.clone());
        let draining = Gauge::default();
        registry.register(
            "draining",
            "1 while the worker drains before it stops",
            draining.clone(),
        );
        let requests = Family::<ResultLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests that ended on this worker, by state and reason",
            requests.clone(),
        );
        let queue_pending = Gauge::default();
        registry.register(
            "queue_pending",
            "Messages of this pool's durable queue not yet delivered to a worker",
            queue_pending.clone(),
        );
        let queue_ack_pending = Gauge::default();
        registry.register(
            "queue_ack_pending",
            "Messages of this pool's durable queue delivered and not yet acknowledged",
            queue_ack_pending.clone(),
        );
        let signals = Family::<SignalLabels, Counter>::default();
        registry.register(
            "signals",
            "Signals this worker published, by type and code",
            signals.clone(),
        );
        let decisions_pending = Gauge::default();
        registry.register(
            "decisions_pending",
            "Decisions awaiting an answer in the fleet (as this worker sees the bucket)",
            decisions_pending.clone(),
        );
        let decisions = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "decisions",
            "Decisions this worker answered or expired, by outcome",
            decisions.clone(),
        );
        let queue_wait = Histogram::new(latency_buckets());
        registry.register(
            "queue_wait_seconds",
            "From acceptance until the generation started",
            queue_wait.clone(),
        );
        let first_token = Histogram::new(latency_buckets());
        registry.register(
            "first_token_seconds",
            "From the start of the generation until the first token",
            first_token.clone(),
        );
        let request_seconds = Histogram::new(latency_buckets());
        registry.register(
            "request_seconds",
            "From acceptance until the result",
            request_seconds.clone(),
        );
        let tool_calls = Family::<ToolLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register(
            "tool_call_seconds",
            "Tool calls through tool services, by tool and outcome",
            tool_calls.clone(),
        );
        let backend_errors = Family::<KindLabels, Counter>::default();
        registry.register(
            "backend_errors",
            "Failed backend calls, by kind (http, transport, idle, stream_broken, protocol, tools_rejected)",
            backend_errors.clone(),
        );
        let backend_up = Gauge::default();
        registry.register(
            "backend_up",
            "1 when the last probe of the backend got an HTTP answer",
            backend_up.clone(),
        );
        let tenant_waiting = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "tenant_waiting",
            "Requests of the pool's durable queue waiting, by tenant and band",
            tenant_waiting.clone(),
        );
        let tenant_running = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "tenant_running",
            "Requests running on this worker, by tenant and band",
            tenant_running.clone(),
        );
        let tenant_completed = Family::<TenantLabels, Counter>::default();
        registry.register(
            "tenant_completed",
            "Requests this worker completed, by tenant and band",
            tenant_completed.clone(),
        );
        let tenant_queue_wait = Family::<TenantLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register(
            "tenant_queue_wait_seconds",
            "From acceptance until the generation started, by tenant and band",
            tenant_queue_wait.clone(),
        );
        let submits_forwarded = Counter::default();
        registry.register(
            "submits_forwarded",
            "Pool submits this worker could not start and sent to a peer with a free slot",
            submits_forwarded.clone(),
        );
        let submits_placed = Counter::default();
        registry.register(
            "submits_placed",
            "Keyed pool submits this worker sent to their key's worker (docs/protocol.md#affinity)",
            submits_placed.clone(),
        );
        let queue_duplicates = Counter::default();
        registry.register(
            "queue_duplicates",
            "Queue messages removed unrun because another request held their request id",
            queue_duplicates.clone(),
        );
        let fenced = Counter::default();
        registry.register(
            "fenced_requests",
            "Requests this worker stopped without a word because the fleet had declared it lost or another worker had taken them over",
            fenced.clone(),
        );
        let resumed = Counter::default();
        registry.register(
            "resumed_requests",
            "Requests this worker took up from their last checkpoint after their worker was lost, drained or preempted",
            resumed.clone(),
        );
        let preempted = Counter::default();
        registry.register(
            "preempted_requests",
            "Requests that gave their slot to a request of a higher band here (worker.preempt), to go on from their checkpoint later",
            preempted.clone(),
        );
        let chain_headers_dropped = Counter::default();
        registry.register(
            "chain_headers_dropped",
            "Requests whose continuation headers no decision record vouched for: run as requests of their own",
            chain_headers_dropped.clone(),
        );
        let submits_refused = Counter::default();
        registry.register(
            "submits_refused",
            "Interactive submits this worker answered NO_SLOT_AVAILABLE (no slot free in the pool)",
            submits_refused.clone(),
        );
        let pool_workers = Gauge::default();
        registry.register(
            "pool_workers",
            "Live workers of this worker's pool that take work, this one included, as their heartbeats tell",
            pool_workers.clone(),
        );
        let pool_slots = Gauge::default();
        registry.register(
            "pool_slots",
            "Slots of the pool's live workers that take work, as their heartbeats tell",
            pool_slots.clone(),
        );
        let pool_slots_busy = Gauge::default();
        registry.register(
            "pool_slots_busy",
            "Busy slots of the pool's live workers (interactive and durable requests), as their heartbeats tell",
            pool_slots_busy.clone(),
        );
        let pool_backlog = Gauge::default();
        registry.register(
            "pool_backlog",
            "Requests of the pool's durable queue waiting or running, every band and tenant counted",
            pool_backlog.clone(),
        );
        Metrics {
            registry,
            pool_signals: Mutex::new(None),
            submits_refused,
            pool_workers,
            pool_slots,
            pool_slots_busy,
            pool_backlog,
            resumed,
            preempted,
            chain_headers_dropped,
            submits_forwarded,
            submits_placed,
            queue_duplicates,
            fenced,
            tenant_waiting,
            tenant_running,
            tenant_completed,
            tenant_queue_wait,
            slots_total,
            slots_busy,
            draining,
            requests,
            queue_pending,
            queue_ack_pending,
            signals,
            decisions_pending,
            decisions,
            queue_wait,
            first_token,
            request_seconds,
            tool_calls,
            backend_errors,
            backend_up,
        }
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }

    /// The pool as this worker measured it just now.
    pub fn set_pool_signals(&self, signals: PoolSignals) {
        self.pool_workers.set(i64::from(signals.workers));
        self.pool_slots.set(signals.slots as i64);
        self.pool_slots_busy.set(signals.slots_busy as i64);
        self.pool_backlog.set(signals.backlog as i64);
        *self.pool_signals.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((signals, Instant::now()));
    }

    /// The pool's signals as last measured, and how long ago; `None` before the first
    /// measurement.
    pub fn pool_signals(&self) -> Option<(PoolSignals, Duration)> {
        self.pool_signals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(signals, at)| (signals.clone(), at.elapsed()))
    }

    /// Counts an ended request and its timings.
    pub fn observe_result(&self, result: &GenerationResult) {
        self.requests
            .get_or_create(&ResultLabels {
                state: result.state.as_str().to_string(),
                reason: result.reason.as_str().to_string(),
            })
            .inc();
        let seconds = |ms: u64| Duration::from_millis(ms).as_secs_f64();
        self.queue_wait.observe(seconds(result.timings_ms.queued));
        if let Some(ms) = result.timings_ms.first_token {
            self.first_token.observe(seconds(ms));
        }
        self.request_seconds
            .observe(seconds(result.timings_ms.total));
    }

    pub fn observe_signal(&self, kind: SignalType, code: &str) {
        self.signals
            .get_or_create(&SignalLabels {
                r#type: kind.as_str().to_string(),
                code: code.to_string(),
            })
            .inc();
    }

    pub fn observe_decision(&self, outcome: &str) {
        self.decisions
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    pub fn observe_tool_call(&self, tool: &str, outcome: &str, took: Duration) {
        self.tool_calls
            .get_or_create(&ToolLabels {
                tool: tool.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn observe_backend_error(&self, kind: &str) {
        self.backend_errors
            .get_or_create(&KindLabels {
                kind: kind.to_string(),
            })
            .inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Reason;

    #[test]
    fn the_exposition_carries_every_family_with_its_labels() {
        let metrics = Metrics::new();
        metrics.slots_total.set(4);
        let mut result = GenerationResult::empty("r", Reason::Stop, "x".into(), "w");
        result.timings_ms.total = 1500;
        metrics.observe_result(&result);
        metrics.observe_signal(SignalType::Escalation, "LOW_CONFIDENCE");
        metrics.observe_tool_call("calculate", "ok", Duration::from_millis(20));
        metrics.observe_backend_error("http");
        let text = metrics.encode();
        for line in [
            "genfleet_slots_total 4",
            "genfleet_requests_total{state=\"COMPLETED\",reason=\"stop\"} 1",
            "genfleet_signals_total{type=\"escalation\",code=\"LOW_CONFIDENCE\"} 1",
            "genfleet_backend_errors_total{kind=\"http\"} 1",
            "genfleet_request_seconds_count 1",
            "genfleet_tool_call_seconds_count{tool=\"calculate\",outcome=\"ok\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }
}
