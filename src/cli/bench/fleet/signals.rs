//! The autoscaling signals over the run: every second each running worker's `/metrics` is
//! read and the gauges an autoscaler would watch are summed (a worker's own slots) or maxed
//! (the pool's queue and pool-wide gauges, which every worker of the pool reports alike)
//! across the workers. A gauge no worker serves is absent from a sample, not zero.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use serde::Serialize;

use super::super::prometheus_text;
use super::disruptions::WorkerAddrs;
use super::lanes::Records;

/// How a gauge is put together across the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Across {
    /// Each worker's own: summed.
    Sum,
    /// The pool's, as each worker sees it: the largest.
    Max,
}

/// The gauges sampled, and how.
pub const SIGNALS: [(&str, Across); 7] = [
    ("genfleet_slots_total", Across::Sum),
    ("genfleet_slots_busy", Across::Sum),
    ("genfleet_queue_pending", Across::Max),
    ("genfleet_queue_ack_pending", Across::Max),
    ("genfleet_pool_slots", Across::Max),
    ("genfleet_pool_slots_busy", Across::Max),
    ("genfleet_pool_workers", Across::Max),
];

/// How long one worker's `/metrics` may take to answer.
const READ_TIMEOUT: Duration = Duration::from_millis(800);

/// One second's reading.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Seconds since the load began.
    pub t: f64,
    /// Workers whose `/metrics` answered.
    pub workers_read: u32,
    /// Each gauge of [`SIGNALS`] some worker served, put together across the workers.
    pub values: BTreeMap<&'static str, f64>,
    /// Requests the load's callers had sent and not yet seen end.
    pub in_flight: i64,
}

impl Sample {
    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.get(name).copied()
    }
}

/// Reads the signals every second until `stop`, and returns every reading.
pub async fn sample(
    addrs: WorkerAddrs,
    records: Arc<Records>,
    started: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Sample> {
    let http = reqwest::Client::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut samples = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let t = started.elapsed().as_secs_f64();
        let now: Vec<String> = addrs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        let texts = join_all(now.iter().map(|addr| read(&http, addr))).await;
        let read: Vec<BTreeMap<String, f64>> = texts
            .into_iter()
            .flatten()
            .map(|text| prometheus_text::sums(&text))
            .collect();
        samples.push(Sample {
            t,
            workers_read: read.len() as u32,
            values: across(&read),
            in_flight: records.in_flight(),
        });
    }
    samples
}

async fn read(http: &reqwest::Client, addr: &str) -> Option<String> {
    let response = http
        .get(format!("http://{addr}/metrics"))
        .timeout(READ_TIMEOUT)
        .send()
        .await
        .ok()?;
    response.error_for_status().ok()?.text().await.ok()
}

/// The gauges of [`SIGNALS`] put together across the workers' readings.
fn across(workers: &[BTreeMap<String, f64>]) -> BTreeMap<&'static str, f64> {
    let mut values = BTreeMap::new();
    for (name, how) in SIGNALS {
        let read: Vec<f64> = workers
            .iter()
            .filter_map(|w| w.get(name).copied())
            .filter(|v| v.is_finite())
            .collect();
        if read.is_empty() {
            continue;
        }
        let value = match how {
            Across::Sum => read.iter().sum(),
            Across::Max => read.iter().copied().fold(f64::MIN, f64::max),
        };
        values.insert(name, value);
    }
    values
}

/// What the signals said over the run, for a reader deciding whether an autoscaler would
/// have scaled.
#[derive(Debug, Clone, Serialize)]
pub struct SignalSummary {
    /// The gauges some worker served at some point.
    pub present: Vec<&'static str>,
    /// The gauges no worker served.
    pub absent: Vec<&'static str>,
    pub samples: usize,
    /// The busiest second: slots busy over slots total.
    pub peak_utilisation: Option<f64>,
    /// Mean utilisation over the seconds read.
    pub mean_utilisation: Option<f64>,
    /// Seconds at or over [`SCALE_UP_UTILISATION`] busy, or with messages waiting in the
    /// queue: the seconds a scale-up rule on these gauges would have fired.
    pub scale_up_seconds: usize,
    pub max_queue_pending: Option<f64>,
    /// Seconds when fewer workers answered than before a disruption (a worker stopping,
    /// starting, or cut off from NATS).
    pub seconds_short_of_workers: usize,
}

/// The utilisation a scale-up rule watches for.
pub const SCALE_UP_UTILISATION: f64 = 0.8;

pub fn summary(samples: &[Sample]) -> SignalSummary {
    let present: Vec<&'static str> = SIGNALS
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| samples.iter().any(|s| s.values.contains_key(name)))
        .collect();
    let absent = SIGNALS
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !present.contains(name))
        .collect();
    let busy: Vec<f64> = samples.iter().filter_map(utilisation).collect();
    let most_workers = samples.iter().map(|s| s.workers_read).max().unwrap_or(0);
    SignalSummary {
        present,
        absent,
        samples: samples.len(),
        peak_utilisation: busy.iter().copied().reduce(f64::max),
        mean_utilisation: (!busy.is_empty()).then(|| busy.iter().sum::<f64>() / busy.len() as f64),
        scale_up_seconds: samples
            .iter()
            .filter(|s| {
                utilisation(s).is_some_and(|u| u >= SCALE_UP_UTILISATION)
                    || s.get("genfleet_queue_pending").is_some_and(|p| p > 0.0)
            })
            .count(),
        max_queue_pending: samples
            .iter()
            .filter_map(|s| s.get("genfleet_queue_pending"))
            .reduce(f64::max),
        seconds_short_of_workers: samples
            .iter()
            .filter(|s| s.workers_read < most_workers)
            .count(),
    }
}

/// Slots busy over slots total in one reading.
pub fn utilisation(sample: &Sample) -> Option<f64> {
    let total = sample.get("genfleet_slots_total")?;
    let busy = sample.get("genfleet_slots_busy")?;
    (total > 0.0).then(|| busy / total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(values: &[(&str, f64)]) -> BTreeMap<String, f64> {
        values.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn a_workers_own_gauges_add_up_and_the_pools_do_not() {
        let a = worker(&[
            ("genfleet_slots_total", 4.0),
            ("genfleet_slots_busy", 3.0),
            ("genfleet_queue_pending", 5.0),
        ]);
        let b = worker(&[
            ("genfleet_slots_total", 4.0),
            ("genfleet_slots_busy", 1.0),
            ("genfleet_queue_pending", 6.0),
            ("genfleet_pool_slots", 8.0),
        ]);
        let values = across(&[a, b]);
        assert_eq!(values.get("genfleet_slots_total"), Some(&8.0));
        assert_eq!(values.get("genfleet_slots_busy"), Some(&4.0));
        assert_eq!(values.get("genfleet_queue_pending"), Some(&6.0));
        assert_eq!(values.get("genfleet_pool_slots"), Some(&8.0));
        assert_eq!(values.get("genfleet_pool_workers"), None);
        assert!(across(&[]).is_empty());
    }

    #[test]
    fn the_summary_counts_the_seconds_a_scale_up_would_fire() {
        let sample = |t: f64, busy: f64, pending: f64, workers_read: u32| Sample {
            t,
            workers_read,
            values: [
                ("genfleet_slots_total", 16.0),
                ("genfleet_slots_busy", busy),
                ("genfleet_queue_pending", pending),
            ]
            .into_iter()
            .collect(),
            in_flight: 0,
        };
        let samples = [
            sample(1.0, 4.0, 0.0, 4),
            sample(2.0, 14.0, 0.0, 4),
            sample(3.0, 8.0, 3.0, 3),
        ];
        let s = summary(&samples);
        assert_eq!(s.scale_up_seconds, 2);
        assert_eq!(s.seconds_short_of_workers, 1);
        assert_eq!(s.peak_utilisation, Some(14.0 / 16.0));
        assert_eq!(s.max_queue_pending, Some(3.0));
        assert_eq!(
            s.present,
            vec![
                "genfleet_slots_total",
                "genfleet_slots_busy",
                "genfleet_queue_pending"
            ]
        );
        assert_eq!(s.absent.len(), 4);
    }
}
