//! What each tenant and band does, as this worker sees it: requests waiting in the pool's
//! queue, running here, completed here, and how long they waited. It feeds the
//! `genfleet_tenant_*` metrics and the `tenants` of the worker's service stats, which the
//! console's fleet view shows.
//!
//! Bounded whatever the number of tenants: at most [`MAX_TENANT_LABELS`] tenants are named,
//! the rest counted under `(other)`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use crate::observe::Metrics;
use crate::observe::metrics::{MAX_TENANT_LABELS, TenantLabels};
use crate::protocol::{DEFAULT_TENANT, GenerationResult, Priority, RequestState};

/// The name the tenants past the bound are counted under.
pub const OTHER_TENANTS: &str = "(other)";

/// One tenant and band.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TenantRow {
    pub tenant: String,
    pub band: Priority,
    /// In the pool's durable queue, not yet taken by a worker.
    pub waiting: u64,
    /// Running on this worker.
    pub running: u64,
    /// Completed on this worker.
    pub completed: u64,
    /// Requests that started on this worker, and their waits summed (ms), for the mean.
    pub started: u64,
    pub wait_ms_total: u64,
}

#[derive(Clone)]
pub struct TenantStats {
    rows: Arc<Mutex<BTreeMap<(String, Priority), TenantRow>>>,
    metrics: Arc<Metrics>,
}

impl TenantStats {
    pub fn new(metrics: Arc<Metrics>) -> TenantStats {
        TenantStats {
            rows: Arc::default(),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, Priority), TenantRow>> {
        self.rows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the waiting counts (every tenant and band not given waits for nothing).
    pub fn set_waiting(&self, waiting: impl IntoIterator<Item = (String, Priority, u64)>) {
        self.set(
            waiting,
            |row| &mut row.waiting,
            &self.metrics.tenant_waiting,
        );
    }

    /// Sets the running counts (every tenant and band not given runs nothing here).
    pub fn set_running(&self, running: impl IntoIterator<Item = (String, Priority, u64)>) {
        self.set(
            running,
            |row| &mut row.running,
            &self.metrics.tenant_running,
        );
    }

    fn set(
        &self,
        counts: impl IntoIterator<Item = (String, Priority, u64)>,
        field: fn(&mut TenantRow) -> &mut u64,
        gauges: &prometheus_client::metrics::family::Family<
            TenantLabels,
            prometheus_client::metrics::gauge::Gauge,
        >,
    ) {
        let mut rows = self.lock();
        for row in rows.values_mut() {
            *field(row) = 0;
        }
        for (tenant, band, n) in counts {
            *field(row_of(&mut rows, &tenant, band)) += n;
        }
        for row in rows.values_mut() {
            gauges
                .get_or_create(&labels(&row.tenant, row.band))
                .set(*field(row) as i64);
        }
    }

    /// Counts a request that ended here.
    pub fn finished(&self, tenant: Option<&str>, band: Priority, result: &GenerationResult) {
        let tenant = tenant.unwrap_or(DEFAULT_TENANT);
        let mut rows = self.lock();
        let row = row_of(&mut rows, tenant, band);
        let labels = labels(&row.tenant, band);
        if result.state == RequestState::Completed {
            row.completed += 1;
            self.metrics.tenant_completed.get_or_create(&labels).inc();
        }
        if result.timings_ms.first_token.is_some() || result.state == RequestState::Completed {
            row.started += 1;
            row.wait_ms_total += result.timings_ms.queued;
            self.metrics
                .tenant_queue_wait
                .get_or_create(&labels)
                .observe(result.timings_ms.queued as f64 / 1000.0);
        }
    }

    /// Every tenant and band with something to show.
    pub fn rows(&self) -> Vec<TenantRow> {
        self.lock()
            .values()
            .filter(|r| r.waiting + r.running + r.completed + r.started > 0)
            .cloned()
            .collect()
    }
}

fn labels(tenant: &str, band: Priority) -> TenantLabels {
    TenantLabels {
        tenant: tenant.to_string(),
        band: band.as_str().to_string(),
    }
}

/// The row of a tenant and band, made when new; past the bound on tenants, the `(other)` row.
fn row_of<'r>(
    rows: &'r mut BTreeMap<(String, Priority), TenantRow>,
    tenant: &str,
    band: Priority,
) -> &'r mut TenantRow {
    let known = rows.keys().any(|(t, _)| t == tenant);
    let distinct = {
        let mut names: Vec<&str> = rows.keys().map(|(t, _)| t.as_str()).collect();
        names.dedup();
        names.len()
    };
    let tenant = if known || distinct < MAX_TENANT_LABELS {
        tenant
    } else {
        OTHER_TENANTS
    };
    rows.entry((tenant.to_string(), band))
        .or_insert_with(|| TenantRow {
            tenant: tenant.to_string(),
            band,
            ..TenantRow::default()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_kept_per_tenant_and_band_and_bounded() {
        let stats = TenantStats::new(Arc::new(Metrics::new()));
        stats.set_waiting([("a".to_string(), Priority::High, 3)]);
        stats.set_running([("a".to_string(), Priority::High, 1)]);
        let mut result =
            GenerationResult::empty("r", crate::protocol::Reason::Stop, String::new(), "w");
        result.state = RequestState::Completed;
        result.timings_ms.queued = 40;
        stats.finished(Some("a"), Priority::High, &result);
        stats.finished(None, Priority::Normal, &result);
        let rows = stats.rows();
        assert_eq!(rows.len(), 2, "{rows:?}");
        let a = rows.iter().find(|r| r.tenant == "a").unwrap();
        assert_eq!(
            (
                a.waiting,
                a.running,
                a.completed,
                a.started,
                a.wait_ms_total
            ),
            (3, 1, 1, 1, 40)
        );
        // A fresh count replaces the last.
        stats.set_waiting([]);
        assert_eq!(
            stats
                .rows()
                .iter()
                .find(|r| r.tenant == "a")
                .unwrap()
                .waiting,
            0
        );
        for i in 0..MAX_TENANT_LABELS + 10 {
            stats.finished(Some(&format!("t{i}")), Priority::Low, &result);
        }
        let rows = stats.rows();
        let mut names: Vec<&str> = rows.iter().map(|r| r.tenant.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), MAX_TENANT_LABELS + 1, "the rest under (other)");
        assert!(names.contains(&OTHER_TENANTS));
    }
}
