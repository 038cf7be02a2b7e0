//! The fleet run's report as lines for people.

use std::fmt::Write;

use super::super::latency::Summary;
use super::super::report::{Table, targets_table};
use super::FleetReport;
use super::accounting::Totals;
use super::signals::{SCALE_UP_UTILISATION, SIGNALS, utilisation};

/// Seconds between two rows of the signals' table.
const SIGNAL_ROWS_EVERY: f64 = 10.0;

pub fn table(r: &FleetReport) -> String {
    let mut out = String::new();
    let f = &r.fleet;
    let _ = writeln!(
        out,
        "genfleet bench {} ({} build), {} CPUs, load average before: {}",
        r.genfleet_version,
        r.build,
        r.cpus,
        r.load_average_before
            .map_or("-".into(), |l| format!("{l:.2}"))
    );
    let lanes: Vec<String> = f
        .lanes
        .iter()
        .map(|(kind, n)| format!("{n} {}", kind.label()))
        .collect();
    let _ = writeln!(
        out,
        "fleet: {}-node NATS JetStream cluster (replicas {}), {} workers × {} slots \
         (drain hand-off {}), {} gateways, {}; mock token delay {} ms; heartbeat {} ms, lost \
         after {} ms, checkpoint every {} ms",
        f.nats_nodes,
        f.replicas,
        f.workers,
        f.slots,
        f.drain_handoff,
        f.gateways,
        f.manager,
        f.token_delay_ms,
        f.heartbeat_ms,
        f.lost_after_ms,
        f.checkpoint_ms
    );
    let _ = writeln!(
        out,
        "load: {:.1} s; lanes of callers: {}; tenants {}, bands low/normal/high in turn, \
         {} ms between a caller's requests\n",
        r.load_secs,
        lanes.join(", "),
        f.tenants.join(" and "),
        f.pause_ms
    );

    let mut events =
        Table::new(&["disruption", "from s", "to s", "took s", "what happened"]).text_columns(1);
    for d in &r.disruptions {
        for (i, step) in d.steps.iter().enumerate() {
            let first = i == 0;
            events.row(vec![
                if first {
                    d.label.clone()
                } else {
                    String::new()
                },
                if first {
                    format!("{:.1}", d.started_s)
                } else {
                    String::new()
                },
                if first {
                    format!("{:.1}", d.ended_s)
                } else {
                    String::new()
                },
                if first {
                    format!("{:.1}", d.ended_s - d.started_s)
                } else {
                    String::new()
                },
                step.clone(),
            ]);
        }
    }
    let _ = writeln!(out, "{}", events.render());

    let mut requests = Table::new(&[
        "requests",
        "sent",
        "accepted",
        "refused up front",
        "completed",
        "failed",
        "cancelled",
        "lost",
        "finished twice",
        "no finished event",
        "seq faults",
        "run side by side",
    ]);
    let row = |name: &str, t: &Totals| {
        vec![
            name.to_string(),
            t.sent.to_string(),
            t.accepted.to_string(),
            t.refused_up_front.to_string(),
            t.completed.to_string(),
            t.failed.to_string(),
            t.cancelled.to_string(),
            t.lost.to_string(),
            t.finished_twice.to_string(),
            t.finished_event_missed.to_string(),
            t.seq_faults.to_string(),
            t.run_side_by_side.to_string(),
        ]
    };
    for (kind, totals) in &r.requests.by_kind {
        requests.row(row(kind.label(), totals));
    }
    requests.row(row("all", &r.requests.all));
    let _ = writeln!(out, "{}", requests.render());
    if !r.requests.not_completed.is_empty() {
        let how: Vec<String> = r
            .requests
            .not_completed
            .iter()
            .map(|(how, n)| format!("{how} ×{n}"))
            .collect();
        let _ = writeln!(out, "accepted and not completed: {}", how.join(", "));
    }
    let unanswered: Vec<String> = r
        .decisions_unanswered
        .iter()
        .map(|u| {
            format!(
                "{}: decision {}, {}; {}",
                u.request_id,
                u.decision_id.as_deref().unwrap_or("(no record)"),
                u.outcome.unwrap_or("no outcome"),
                match u.signal_stored {
                    Some(true) => "its signal is in the signals stream",
                    Some(false) => "no signal of it in the signals stream: no manager could see it",
                    None => "the signals stream was not read",
                }
            )
        })
        .collect();
    for (what, ids) in [
        ("lost", &r.requests.lost),
        ("finished twice", &r.requests.finished_twice),
        (
            "run by two workers side by side (both took it up from one checkpoint)",
            &r.requests.side_by_side,
        ),
        (
            "with a sequence fault or a text mismatch",
            &r.requests.faulty,
        ),
        (
            "asked for a decision still unanswered after the run",
            &unanswered,
        ),
    ] {
        if !ids.is_empty() {
            let _ = writeln!(out, "{what}:");
            for told in ids {
                let _ = writeln!(out, "  {told}");
            }
        }
    }
    if !r.caller_errors.is_empty() {
        let _ = writeln!(
            out,
            "what the callers saw go wrong (the fleet's count is above):"
        );
        for (kind, errors) in &r.caller_errors {
            let errors: Vec<String> = errors.iter().map(|(e, n)| format!("{e} ×{n}")).collect();
            let _ = writeln!(out, "  {}: {}", kind.label(), errors.join(", "));
        }
    }
    out.push('\n');

    let mut latency = Table::new(&[
        "latency ms (completed)",
        "steady n",
        "p50",
        "p99",
        "caught n",
        "p50",
        "p99",
        "disrupted n",
        "p50",
        "p99",
        "disrupted p99 ÷ steady",
    ]);
    let cells = |s: Option<Summary>| match s {
        Some(s) => [
            s.count.to_string(),
            format!("{:.0}", s.p50),
            format!("{:.0}", s.p99),
        ],
        None => ["0".into(), "-".into(), "-".into()],
    };
    for row in &r.latency {
        let ratio = match (row.steady_ms, row.disrupted_ms) {
            (Some(steady), Some(disrupted)) if steady.p99 > 0.0 => {
                format!("{:.2}", disrupted.p99 / steady.p99)
            }
            _ => "-".into(),
        };
        let mut cols = vec![row.label.to_string()];
        cols.extend(cells(row.steady_ms));
        cols.extend(cells(row.caught_ms));
        cols.extend(cells(row.disrupted_ms));
        cols.push(ratio);
        latency.row(cols);
    }
    let _ = writeln!(
        out,
        "{}(by when each was sent: disrupted, while a disruption was in progress; caught, \
         before one that began while it ran; steady, the rest. A decision chain includes the \
         manager's answer and its continuation)\n",
        latency.render()
    );

    let g = &r.regenerated;
    let _ = writeln!(
        out,
        "text generated again: {} of {} characters the outputs hold ({}; about {} tokens), \
         {} characters generated in {} tokens; {} continuations of a cut-off answer at the mock{}",
        g.again_chars,
        g.output_chars,
        g.again_pct.map_or("-".into(), |p| format!("{p:.2}%")),
        g.again_tokens.map_or("-".into(), |t| format!("{t:.0}")),
        g.generated_chars,
        g.generated_tokens,
        g.continuations,
        if g.outputs_unknown > 0 {
            format!("; {} outputs of unknown length", g.outputs_unknown)
        } else {
            String::new()
        }
    );
    let a = &r.affinity;
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", v * 100.0));
    let _ = writeln!(
        out,
        "affinity of keyed turns: {} of {} with a record ran on their key's worker: {} \
         (steady {}, disrupted {}); elsewhere: {} busy, {} over the load bound, {} unplaced; \
         {} of {} later turns on the worker of the turn before; {} turns without a full result\n",
        a.held,
        a.recorded,
        pct(a.hit_rate),
        pct(a.hit_rate_steady),
        pct(a.hit_rate_disrupted),
        a.fallback_busy,
        a.fallback_load,
        a.unplaced,
        a.same_worker_as_turn_before,
        a.later_turns,
        a.without_result
    );

    let s = &r.signals;
    let mut header = vec!["t s", "workers", "in flight", "busy %"];
    let present: Vec<&str> = SIGNALS
        .iter()
        .map(|(name, _)| *name)
        .filter(|n| s.present.contains(n))
        .collect();
    let short: Vec<String> = present
        .iter()
        .map(|n| n.trim_start_matches("genfleet_").to_string())
        .collect();
    header.extend(short.iter().map(String::as_str));
    let mut signals = Table::new(&header);
    let mut next = 0.0;
    for sample in &r.signal_samples {
        if sample.t + 0.5 < next {
            continue;
        }
        next = (sample.t / SIGNAL_ROWS_EVERY).floor() * SIGNAL_ROWS_EVERY + SIGNAL_ROWS_EVERY;
        let mut cols = vec![
            format!("{:.0}", sample.t),
            sample.workers_read.to_string(),
            sample.in_flight.to_string(),
            utilisation(sample).map_or("-".into(), |u| format!("{:.0}", u * 100.0)),
        ];
        cols.extend(
            present
                .iter()
                .map(|n| sample.get(n).map_or("-".into(), |v| format!("{v:.0}"))),
        );
        signals.row(cols);
    }
    let _ = writeln!(
        out,
        "autoscaling signals from the workers' /metrics, every {SIGNAL_ROWS_EVERY:.0} s of the \
         {} read (slots summed over the workers, the pool's gauges the largest any reports):\n{}",
        s.samples,
        signals.render()
    );
    let _ = writeln!(
        out,
        "utilisation peak {}, mean {}; {} s at ≥ {:.0}% busy or with messages waiting in the \
         queue (most waiting: {}); {} s with fewer workers answering than at most{}\n",
        pct(s.peak_utilisation),
        pct(s.mean_utilisation),
        s.scale_up_seconds,
        SCALE_UP_UTILISATION * 100.0,
        s.max_queue_pending
            .map_or("-".into(), |v| format!("{v:.0}")),
        s.seconds_short_of_workers,
        if s.absent.is_empty() {
            String::new()
        } else {
            format!("; not served: {}", s.absent.join(", "))
        }
    );
    if let Some(plot) = &r.plot {
        let _ = writeln!(out, "chart: {plot}\n");
    }
    let _ = writeln!(out, "{}", targets_table(&r.targets));
    for note in &r.notes {
        let _ = writeln!(out, "note: {note}");
    }
    out
}
