//! The run second by second: requests completed, the latency of the interactive ones, and
//! the backlog (what the callers wait on, the slots busy, the queue), with the disruptions
//! marked; as a series in the report and as the chart `--plot` writes.

use serde::Serialize;

use super::super::latency::Samples;
use super::super::plot::{Chart, Marker, Panel, Series};
use super::disruptions::Disruption;
use super::lanes::Call;
use super::signals::Sample;

/// Seconds a point's latency percentiles are taken over (ending with its own): one second
/// holds too few requests for a p99.
pub const LATENCY_WINDOW_S: u32 = 5;

/// One second of the run.
#[derive(Debug, Clone, Serialize)]
pub struct Second {
    /// Seconds since the load began (the second from `t` to `t + 1`).
    pub t: u32,
    /// Requests whose callers saw them complete in this second.
    pub completed: u32,
    /// The mean of `completed` over the window ending here.
    pub completed_mean: f64,
    /// Percentiles of the interactive requests completed in the window ending here.
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// From the signals read in this second.
    pub in_flight: Option<i64>,
    pub slots_busy: Option<f64>,
    pub queue_pending: Option<f64>,
}

pub fn seconds(calls: &[Call], samples: &[Sample], until_s: f64) -> Vec<Second> {
    let last = until_s.ceil().max(1.0) as u32;
    let completed: Vec<(f64, f64, bool)> = calls
        .iter()
        .filter(|c| c.completed)
        .filter_map(|c| Some((c.ended_s?, c.ended_s? - c.submitted_s, c.kind.interactive())))
        .collect();
    let mut counts = vec![0u32; last as usize + 1];
    for (ended, _, _) in &completed {
        if let Some(n) = counts.get_mut(*ended as usize) {
            *n += 1;
        }
    }
    (0..last)
        .map(|t| {
            let from = t.saturating_sub(LATENCY_WINDOW_S - 1);
            let mut window = Samples::default();
            for (ended, latency, interactive) in &completed {
                if *interactive && (from as f64) <= *ended && *ended < (t + 1) as f64 {
                    window.push(std::time::Duration::from_secs_f64(latency.max(0.0)));
                }
            }
            let summary = window.summary();
            let in_window = &counts[from as usize..=t as usize];
            let sample = samples.iter().find(|s| s.t as u32 == t);
            Second {
                t,
                completed: counts[t as usize],
                completed_mean: in_window.iter().sum::<u32>() as f64 / in_window.len() as f64,
                p50_ms: summary.map(|s| s.p50),
                p99_ms: summary.map(|s| s.p99),
                in_flight: sample.map(|s| s.in_flight),
                slots_busy: sample.and_then(|s| s.get("genfleet_slots_busy")),
                queue_pending: sample.and_then(|s| s.get("genfleet_queue_pending")),
            }
        })
        .collect()
}

/// The chart of the run: throughput, latency and backlog over time, each disruption marked.
pub fn chart(seconds: &[Second], disruptions: &[Disruption]) -> Chart {
    let line = |name: &str, value: &dyn Fn(&Second) -> Option<f64>| Series {
        name: name.to_string(),
        points: seconds
            .iter()
            .map(|s| (f64::from(s.t) + 0.5, value(s)))
            .collect(),
    };
    Chart {
        title: "genfleet bench --mode fleet: 3-node JetStream cluster, 4 workers, 2 gateways, under churn"
            .into(),
        x_label: "seconds since the load began".into(),
        x_max: seconds.len() as f64,
        panels: vec![
            Panel {
                title: format!("completed / s ({LATENCY_WINDOW_S} s mean)"),
                series: vec![line("all requests", &|s| Some(s.completed_mean))],
            },
            Panel {
                title: format!("interactive latency, ms ({LATENCY_WINDOW_S} s window)"),
                series: vec![
                    line("p99", &|s| s.p99_ms),
                    line("p50", &|s| s.p50_ms),
                ],
            },
            Panel {
                title: "backlog".into(),
                series: vec![
                    line("in flight (callers)", &|s| s.in_flight.map(|n| n as f64)),
                    line("slots busy (sum)", &|s| s.slots_busy),
                    line("queue pending", &|s| s.queue_pending),
                ],
            },
        ],
        markers: disruptions
            .iter()
            .map(|d| Marker {
                at: d.started_s,
                until: Some(d.ended_s),
                label: d.label.clone(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::lanes::{Acceptance, Kind};
    use super::*;

    fn call(kind: Kind, submitted: f64, ended: f64) -> Call {
        Call {
            id: "r".into(),
            kind,
            submitted_s: submitted,
            acceptance: Acceptance::Accepted,
            ended_s: Some(ended),
            completed: true,
            error: None,
        }
    }

    #[test]
    fn each_second_counts_what_completed_in_it_and_its_window_latency() {
        let calls = [
            call(Kind::BusInteractive, 0.25, 1.25),
            call(Kind::GatewayWhole, 0.5, 1.5),
            call(Kind::Durable, 0.0, 1.75),
            call(Kind::BusInteractive, 2.0, 3.25),
        ];
        let s = seconds(&calls, &[], 4.0);
        assert_eq!(s.len(), 4);
        assert_eq!(
            s.iter().map(|s| s.completed).collect::<Vec<_>>(),
            vec![0, 3, 0, 1]
        );
        // The durable request counts as completed but not in the interactive latency.
        assert_eq!(s[1].p99_ms, Some(1000.0));
        assert_eq!(s[3].p99_ms, Some(1250.0), "the window reaches back");
        assert_eq!(s[0].p99_ms, None);
        assert!((s[3].completed_mean - 1.0).abs() < 1e-9);
        let chart = chart(&s, &[]);
        assert_eq!(chart.panels.len(), 3);
        assert_eq!(chart.x_max, 4.0);
    }
}
