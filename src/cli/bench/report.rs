//! What a run reports: one JSON object (`--json`), or the same as readable tables.

use std::fmt::Write;

use serde::Serialize;

use super::caller::CallerReport;
use super::durable::DurableReport;
use super::floors::FloorReport;
use super::interactive::LoadReport;
use super::latency::Summary;
use super::memory::MemoryReport;
use super::monitor::BusOps;
use super::procstat::ProcessUsage;
use super::real::RealReport;
use super::scheduling::SchedulingReport;
use super::target_check::TargetCheck;

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub genfleet_version: &'static str,
    /// `release` or `debug`: figures worth quoting come from release builds.
    pub build: &'static str,
    pub cpus: usize,
    /// The machine's 1-minute load average before the run (other work skews figures).
    pub load_average_before: Option<f64>,
    pub fleet: FleetInfo,
    pub floors: Floors,
    /// The load phases on this build's workers.
    #[serde(flatten)]
    pub this: Phases,
    /// The same phases on the workers of another build (`--baseline`), and the two side by
    /// side.
    pub baseline: Option<BaselineReport>,
    pub memory: Option<MemoryReport>,
    /// The real model server, direct and through one worker.
    pub real_backend: Option<RealReport>,
    /// Conversations on prefix-cache backends, with affinity and without, and the forwarding
    /// hop.
    pub scheduling: Option<SchedulingReport>,
    pub ratios: Ratios,
    pub targets: Vec<TargetCheck>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FleetInfo {
    pub local: bool,
    pub nats_url: String,
    pub backend_url: String,
    pub pool: String,
    /// `--local` only: what the bench started.
    pub workers: Option<u32>,
    pub slots: Option<u32>,
    pub token_delay_ms: Option<u64>,
    /// Where the backend runs, relative to the load generator.
    pub backend: String,
    /// Where worker CPU and memory figures come from, or why there are none.
    pub worker_stats: String,
    /// The nats-server monitoring endpoint the bus figures are read from.
    pub nats_monitor: Option<String>,
    /// What the bus figures count, or why there are none.
    pub bus_stats: String,
}

/// The load phases of one build.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Phases {
    pub interactive: Option<LoadReport>,
    /// What a caller feels: concurrency 1 against the fastest direct call, and the rate held
    /// under a p99 limit.
    pub caller: Option<CallerReport>,
    pub durable: Option<DurableReport>,
    pub streaming: Option<LoadReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BaselineReport {
    /// The executable the baseline's workers ran.
    pub binary: String,
    /// How the runs of the two builds were ordered and kept apart.
    pub order: &'static str,
    #[serde(flatten)]
    pub phases: Phases,
    /// Each figure of both builds, and this build's over the baseline's.
    pub comparison: Vec<Comparison>,
}

/// One figure of a phase, measured on both builds.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub phase: &'static str,
    pub figure: &'static str,
    pub baseline: Option<f64>,
    pub this_build: Option<f64>,
    /// this build ÷ baseline.
    pub ratio: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Floors {
    /// Plain NATS request-reply against an echo responder, interactive request size.
    pub nats_request_reply: Option<FloorReport>,
    /// The backend called directly with the interactive request.
    pub backend_http: Option<FloorReport>,
    /// The same request, not streamed.
    pub backend_http_not_streamed: Option<FloorReport>,
    /// KV create-then-update pairs (the writes of a lean request) on the same server.
    pub jetstream_writes: Option<FloorReport>,
    /// The backend called directly with the streaming request.
    pub backend_http_streaming: Option<FloorReport>,
}

/// genfleet over its floors, from the same run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Ratios {
    /// Interactive requests/s ÷ NATS request-reply/s.
    pub throughput_vs_nats: Option<f64>,
    /// Interactive p50 submit→result ÷ NATS request-reply p50.
    pub p50_vs_nats: Option<f64>,
    /// Interactive p50 submit→result ÷ the fastest direct backend call's p50.
    pub p50_vs_backend: Option<f64>,
    /// Interactive p50 submit→result − the fastest direct backend call's p50 (streamed or
    /// not, whichever was faster), ms.
    pub added_latency_p50_ms: Option<f64>,
    /// The same at concurrency 1, each call from one client thread.
    pub added_latency_p50_c1_ms: Option<f64>,
    /// submit→result p99 − the fastest direct call's p99 at concurrency 1, ms.
    pub added_latency_p99_c1_ms: Option<f64>,
    /// The most interactive requests/s held with p99 submit→result under 5 ms.
    pub held_under_p99_5ms_per_sec: Option<f64>,
    /// Streaming tokens/s relayed ÷ tokens/s of the backend called directly.
    pub streaming_tokens_vs_backend: Option<f64>,
}

pub fn ratios(
    floors: &Floors,
    interactive: Option<&LoadReport>,
    caller: Option<&CallerReport>,
    streaming: Option<&LoadReport>,
) -> Ratios {
    let p50 = |s: &Option<Summary>| s.as_ref().map(|s| s.p50);
    let nats = floors.nats_request_reply.as_ref();
    // The fastest direct call: streamed (as the worker asks) or not.
    let backend = [&floors.backend_http, &floors.backend_http_not_streamed]
        .into_iter()
        .flatten()
        .filter(|b| b.latency_ms.is_some())
        .min_by(|a, b| {
            p50(&a.latency_ms)
                .unwrap_or(f64::MAX)
                .total_cmp(&p50(&b.latency_ms).unwrap_or(f64::MAX))
        });
    let genfleet_p50 = interactive.and_then(|i| p50(&i.submit_to_result_ms));
    Ratios {
        throughput_vs_nats: divide(
            interactive.map(|i| i.requests_per_sec),
            nats.map(|n| n.requests_per_sec),
        ),
        p50_vs_nats: divide(genfleet_p50, nats.and_then(|n| p50(&n.latency_ms))),
        p50_vs_backend: divide(genfleet_p50, backend.and_then(|b| p50(&b.latency_ms))),
        added_latency_p50_ms: genfleet_p50
            .zip(backend.and_then(|b| p50(&b.latency_ms)))
            .map(|(g, b)| g - b),
        added_latency_p50_c1_ms: caller.and_then(|c| c.at_one.added_p50_ms),
        added_latency_p99_c1_ms: caller.and_then(|c| c.at_one.added_p99_ms),
        held_under_p99_5ms_per_sec: caller.and_then(|c| c.held_requests_per_sec),
        streaming_tokens_vs_backend: divide(
            streaming.map(|s| s.tokens_per_sec),
            floors
                .backend_http_streaming
                .as_ref()
                .and_then(|b| b.tokens_per_sec),
        ),
    }
}

/// Both builds' figures of each phase the two ran, side by side.
pub fn compare(baseline: &Phases, this: &Phases) -> Vec<Comparison> {
    let mut rows = Vec::new();
    let mut side_by_side = |phase: &'static str, a: Figures, b: Figures| {
        for ((figure, baseline), (_, this_build)) in a.into_iter().zip(b) {
            rows.push(Comparison {
                phase,
                figure,
                baseline,
                this_build,
                ratio: divide(this_build, baseline),
            });
        }
    };
    for (phase, a, b) in [
        ("interactive", &baseline.interactive, &this.interactive),
        ("streaming", &baseline.streaming, &this.streaming),
    ] {
        if let (Some(a), Some(b)) = (a, b) {
            side_by_side(phase, load_figures(a), load_figures(b));
        }
    }
    if let (Some(a), Some(b)) = (&baseline.caller, &this.caller) {
        side_by_side("caller", caller_figures(a), caller_figures(b));
    }
    if let (Some(a), Some(b)) = (&baseline.durable, &this.durable) {
        side_by_side("durable", durable_figures(a), durable_figures(b));
    }
    rows
}

/// Named figures of one phase, in the order they are compared.
type Figures = Vec<(&'static str, Option<f64>)>;

fn load_figures(r: &LoadReport) -> Figures {
    let mut figures = vec![
        ("requests/s", Some(r.requests_per_sec)),
        ("submit→result p50 ms", r.submit_to_result_ms.map(|s| s.p50)),
        ("submit→result p99 ms", r.submit_to_result_ms.map(|s| s.p99)),
        (
            "submit→accepted p50 ms",
            r.submit_to_accepted_ms.map(|s| s.p50),
        ),
    ];
    figures.extend(cost_figures(r.bus.as_ref(), &r.processes));
    figures
}

fn caller_figures(c: &CallerReport) -> Figures {
    vec![
        (
            "c1 submit→result p50 ms",
            c.at_one.submit_to_result_ms.map(|s| s.p50),
        ),
        (
            "c1 submit→result p99 ms",
            c.at_one.submit_to_result_ms.map(|s| s.p99),
        ),
        ("c1 added p50 ms", c.at_one.added_p50_ms),
        ("c1 added p99 ms", c.at_one.added_p99_ms),
        ("held under p99 5 ms, req/s", c.held_requests_per_sec),
    ]
}

fn durable_figures(d: &DurableReport) -> Figures {
    let mut figures = vec![
        ("results/s", Some(d.drain_per_sec)),
        (
            "enqueue→finished p50 ms",
            d.enqueue_to_finished_ms.map(|s| s.p50),
        ),
    ];
    figures.extend(cost_figures(d.bus.as_ref(), &d.processes));
    figures
}

/// What a completed request cost: bus operations, and CPU by process.
fn cost_figures(bus: Option<&BusOps>, processes: &[ProcessUsage]) -> Figures {
    let per = bus.and_then(|b| b.per_request.as_ref());
    let cpu = |role: fn(&str) -> bool| cpu_per_request(processes, role);
    vec![
        ("JetStream ops/request", per.map(|p| p.jetstream_operations)),
        (
            "JetStream API calls/request",
            per.map(|p| p.jetstream_api_calls),
        ),
        (
            "JetStream stored messages/request",
            per.map(|p| p.jetstream_stored_messages),
        ),
        (
            "JetStream direct gets/request",
            per.and_then(|p| p.jetstream_direct_gets),
        ),
        (
            "JetStream consumer acks/request",
            per.map(|p| p.jetstream_consumer_acks),
        ),
        ("NATS msgs in/request", per.map(|p| p.nats_msgs_in)),
        (
            "worker CPU µs/request",
            cpu(|role| role.starts_with("worker ")),
        ),
        (
            "nats-server CPU µs/request",
            cpu(|role| role == "nats-server"),
        ),
        ("all processes CPU µs/request", cpu(|_| true)),
    ]
}

/// The CPU µs per request of the processes whose role `role` picks, summed; `None` when no
/// such process was measured.
pub fn cpu_per_request(processes: &[ProcessUsage], role: fn(&str) -> bool) -> Option<f64> {
    let of: Vec<f64> = processes
        .iter()
        .filter(|p| role(&p.role))
        .filter_map(|p| p.cpu_us_per_request)
        .collect();
    (!of.is_empty()).then(|| of.iter().sum())
}

fn divide(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

impl Report {
    /// The builds' load phases, each with the prefix its rows carry: the baseline's first.
    fn runs(&self) -> Vec<(&'static str, &Phases)> {
        let mut runs = Vec::new();
        if let Some(b) = &self.baseline {
            runs.push(("baseline ", &b.phases));
        }
        runs.push(("", &self.this));
        runs
    }

    /// What each floor and phase cost, by the name its rows carry.
    fn costs(&self) -> Vec<(String, &[ProcessUsage], &Option<BusOps>)> {
        let mut costs: Vec<_> = self
            .floors
            .named()
            .into_iter()
            .map(|(name, r)| (name.to_string(), r.processes.as_slice(), &r.bus))
            .collect();
        for (prefix, phases) in self.runs() {
            for (name, r) in phases.loads() {
                costs.push((format!("{prefix}{name}"), &r.processes, &r.bus));
            }
            if let Some(d) = &phases.durable {
                costs.push((format!("{prefix}durable"), &d.processes, &d.bus));
            }
        }
        costs
    }

    /// The readable form: one table per phase, then the ratios and the targets.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let f = &self.fleet;
        let _ = writeln!(
            out,
            "genfleet bench {} ({} build), {} CPUs, load average before: {}",
            self.genfleet_version,
            self.build,
            self.cpus,
            opt(self.load_average_before, 2)
        );
        let _ = writeln!(
            out,
            "fleet: {}, NATS {}, pool {}, backend {} ({})",
            if f.local {
                "local (--local)"
            } else {
                "running"
            },
            f.nats_url,
            f.pool,
            f.backend_url,
            f.backend
        );
        if f.local {
            let _ = writeln!(
                out,
                "       {} worker process(es) × {} slots, mock token delay {} ms",
                f.workers.unwrap_or(0),
                f.slots.unwrap_or(0),
                f.token_delay_ms.unwrap_or(0)
            );
        }
        let _ = writeln!(out, "worker CPU/RSS: {}", f.worker_stats);
        let _ = writeln!(out, "bus operations: {}", f.bus_stats);
        if let Some(b) = &self.baseline {
            let _ = writeln!(out, "baseline: {} ({})", b.binary, b.order);
        }
        let runs = self.runs();

        let mut latency = Table::new(&[
            "phase", "conc", "requests", "errors", "req/s", "p50 ms", "p90 ms", "p99 ms", "max ms",
        ]);
        for (name, r) in self.floors.named() {
            latency.row(latency_row(
                name,
                r.concurrency,
                r.requests,
                r.errors,
                r.requests_per_sec,
                &r.latency_ms,
            ));
        }
        for (prefix, phases) in &runs {
            for (name, r) in phases.loads() {
                for (step, summary) in [
                    ("submit→result", &r.submit_to_result_ms),
                    ("submit→1st delta", &r.submit_to_first_delta_ms),
                    ("submit→accepted", &r.submit_to_accepted_ms),
                ] {
                    latency.row(latency_row(
                        &format!("{prefix}{name} {step}"),
                        r.concurrency,
                        r.requests,
                        r.errors,
                        r.requests_per_sec,
                        summary,
                    ));
                }
            }
            if let Some(d) = &phases.durable {
                latency.row(latency_row(
                    &format!("{prefix}durable enqueue→finished"),
                    0,
                    d.burst,
                    d.errors,
                    d.drain_per_sec,
                    &d.enqueue_to_finished_ms,
                ));
            }
        }
        let _ = writeln!(out, "\n{}", latency.render());
        for (prefix, phases) in &runs {
            if let Some(c) = &phases.caller {
                out.push_str(&caller_table(prefix, c));
            }
        }

        let mut relay = Table::new(&[
            "phase",
            "tokens/s",
            "tokens",
            "missing events",
            "req. with gaps",
            "delta≠output",
            "NO_SLOT replies",
            "NO_SLOT rate",
        ]);
        for (prefix, phases) in &runs {
            for (name, r) in phases.loads() {
                relay.row(vec![
                    format!("{prefix}{name}"),
                    format!("{:.0}", r.tokens_per_sec),
                    r.tokens_relayed.to_string(),
                    r.missing_events.to_string(),
                    r.requests_with_gaps.to_string(),
                    r.delta_mismatches.to_string(),
                    r.no_slot_replies.to_string(),
                    format!("{:.4}", r.no_slot_rate),
                ]);
            }
        }
        if let Some(b) = &self.floors.backend_http_streaming {
            relay.row(vec![
                "floor: backend HTTP (stream)".into(),
                opt(b.tokens_per_sec, 0),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
        if !relay.rows.is_empty() {
            let _ = writeln!(out, "{}", relay.render());
        }
        for (prefix, phases) in &runs {
            for (name, r) in phases.loads() {
                if !r.error_kinds.is_empty() {
                    let kinds: Vec<String> = r
                        .error_kinds
                        .iter()
                        .map(|(k, n)| format!("{k} ×{n}"))
                        .collect();
                    let _ = writeln!(out, "{prefix}{name} errors: {}", kinds.join(", "));
                }
            }
            if let Some(d) = &phases.durable {
                let _ = writeln!(
                    out,
                    "{prefix}durable: {} enqueued in {:.2} s ({:.0}/s, {} refused), all stored after {:.2} s: \
                     {:.0} results/s, {} completed, {} errors, {} finished events missed\n",
                    d.burst,
                    d.enqueue_secs,
                    d.enqueue_per_sec,
                    d.enqueue_errors,
                    d.drain_secs,
                    d.drain_per_sec,
                    d.completed,
                    d.errors,
                    d.missed_finished_events
                );
            }
        }

        if let Some(r) = &self.real_backend {
            out.push_str(&real_table(r));
        }
        if let Some(r) = &self.scheduling {
            out.push_str(&scheduling_table(r));
        }

        let mut bus = Table::new(&[
            "phase",
            "requests",
            "JS ops/req",
            "API calls",
            "stored",
            "direct gets",
            "acks",
            "NATS msgs in/req",
            "API errors",
        ]);
        let mut bus_row = |phase: &str, ops: &Option<BusOps>| {
            if let Some(ops) = ops {
                let per = ops.per_request.as_ref();
                let at = |f: fn(&super::monitor::BusRates) -> f64| opt(per.map(f), 2);
                bus.row(vec![
                    phase.to_string(),
                    ops.requests.to_string(),
                    at(|p| p.jetstream_operations),
                    at(|p| p.jetstream_api_calls),
                    at(|p| p.jetstream_stored_messages),
                    opt(per.and_then(|p| p.jetstream_direct_gets), 2),
                    at(|p| p.jetstream_consumer_acks),
                    at(|p| p.nats_msgs_in),
                    ops.jetstream_api_errors.to_string(),
                ]);
            }
        };
        for (phase, _, ops) in self.costs() {
            bus_row(&phase, ops);
        }
        if !bus.rows.is_empty() {
            let _ = writeln!(
                out,
                "bus operations per request (API calls, stored, direct gets and acks make the JetStream operations)\n{}",
                bus.render()
            );
        }

        let mut cpu = Table::new(&[
            "phase",
            "process",
            "CPU s",
            "cores",
            "CPU µs/req",
            "RSS MiB",
            "peak RSS MiB",
        ])
        .text_columns(2);
        let mut cpu_rows = |phase: &str, processes: &[ProcessUsage]| {
            for p in processes {
                cpu.row(vec![
                    phase.to_string(),
                    format!("{} ({})", p.role, p.pid),
                    format!("{:.2}", p.cpu_seconds),
                    format!("{:.2}", p.cpu_cores),
                    opt(p.cpu_us_per_request, 0),
                    opt(p.rss_mib, 1),
                    opt(p.peak_rss_mib, 1),
                ]);
            }
        };
        for (phase, processes, _) in self.costs() {
            cpu_rows(&phase, processes);
        }
        if !cpu.rows.is_empty() {
            let _ = writeln!(out, "{}", cpu.render());
        }
        if let Some(b) = &self.baseline {
            let mut side =
                Table::new(&["phase", "figure", "baseline", "this build", "ratio"]).text_columns(2);
            for c in &b.comparison {
                side.row(vec![
                    c.phase.to_string(),
                    c.figure.to_string(),
                    opt(c.baseline, 2),
                    opt(c.this_build, 2),
                    opt(c.ratio, 3),
                ]);
            }
            let _ = writeln!(
                out,
                "this build beside the baseline (ratio: this build ÷ baseline)\n{}",
                side.render()
            );
        }
        if let Some(m) = &self.memory {
            let _ = writeln!(
                out,
                "memory: worker with {} slots: {:.1} MiB idle, {:.1} MiB with {} requests running \
                 ({} B of conversation text each): {:.1} KiB per running request beyond its text\n",
                m.slots,
                m.idle_rss_mib,
                m.running_rss_mib,
                m.running,
                m.conversation_bytes,
                m.per_request_kib
            );
        }

        let r = &self.ratios;
        let _ = writeln!(
            out,
            "ratios (genfleet / floor): throughput {} of NATS request-reply; p50 {}× NATS, {}× backend; \
             added latency p50 {} ms (concurrency 1: p50 {} ms, p99 {} ms); held under p99 5 ms: {} req/s; \
             streaming tokens/s {} of the backend's",
            pct(r.throughput_vs_nats),
            opt(r.p50_vs_nats, 1),
            opt(r.p50_vs_backend, 2),
            opt(r.added_latency_p50_ms, 3),
            opt(r.added_latency_p50_c1_ms, 3),
            opt(r.added_latency_p99_c1_ms, 3),
            opt(r.held_under_p99_5ms_per_sec, 0),
            pct(r.streaming_tokens_vs_backend)
        );
        let _ = writeln!(out, "\n{}", targets_table(&self.targets));
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        out
    }
}

impl Floors {
    /// The floors measured, each with the name its rows carry.
    fn named(&self) -> Vec<(&'static str, &FloorReport)> {
        [
            ("floor: NATS request-reply", &self.nats_request_reply),
            ("floor: backend HTTP", &self.backend_http),
            (
                "floor: backend HTTP (not streamed)",
                &self.backend_http_not_streamed,
            ),
            ("floor: JetStream writes", &self.jetstream_writes),
            ("floor: backend HTTP (stream)", &self.backend_http_streaming),
        ]
        .into_iter()
        .filter_map(|(name, r)| Some((name, r.as_ref()?)))
        .collect()
    }
}

impl Phases {
    /// The submit-and-follow phases run, by name.
    fn loads(&self) -> Vec<(&'static str, &LoadReport)> {
        [
            ("interactive", &self.interactive),
            ("streaming", &self.streaming),
        ]
        .into_iter()
        .filter_map(|(name, r)| Some((name, r.as_ref()?)))
        .collect()
    }
}

/// What a caller feels: concurrency 1 against the fastest direct call, then the sweep.
fn caller_table(prefix: &str, c: &CallerReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{prefix}what a caller feels, concurrency 1: {} calls of each path, in turns from one client thread",
        c.at_one.requests_per_path
    );
    let mut rows = Table::new(&["path", "calls", "p50 ms", "p90 ms", "p99 ms", "max ms"]);
    for (name, summary) in [
        (
            "backend directly, not streamed",
            &c.at_one.direct_not_streamed_ms,
        ),
        ("backend directly, streamed", &c.at_one.direct_streamed_ms),
        ("NATS request-reply", &c.at_one.nats_request_reply_ms),
        ("JetStream create + update", &c.at_one.jetstream_writes_ms),
        ("genfleet submit→accepted", &c.at_one.submit_to_accepted_ms),
        (
            "genfleet submit→1st delta",
            &c.at_one.submit_to_first_delta_ms,
        ),
        ("genfleet submit→result", &c.at_one.submit_to_result_ms),
    ] {
        let at = |p: fn(&Summary) -> f64| opt(summary.as_ref().map(p), 3);
        rows.row(vec![
            name.to_string(),
            summary.map_or("0".into(), |s| s.count.to_string()),
            at(|s| s.p50),
            at(|s| s.p90),
            at(|s| s.p99),
            at(|s| s.max),
        ]);
    }
    out.push_str(&rows.render());
    let _ = writeln!(
        out,
        "added over the fastest direct call ({}): p50 {} ms, p99 {} ms; the bus path's floor \
         (that call + one request-reply + the two writes, p50s): {} ms",
        c.at_one.fastest_direct.unwrap_or("-"),
        opt(c.at_one.added_p50_ms, 3),
        opt(c.at_one.added_p99_ms, 3),
        opt(c.at_one.bus_floor_p50_ms, 3)
    );
    for (kind, n) in &c.at_one.errors {
        let _ = writeln!(out, "errors: {kind} ×{n}");
    }
    let mut sweep = Table::new(&["concurrency", "req/s", "errors", "p50 ms", "p99 ms"]);
    for level in &c.sweep {
        let at = |p: fn(&Summary) -> f64| opt(level.submit_to_result_ms.as_ref().map(p), 3);
        sweep.row(vec![
            level.concurrency.to_string(),
            format!("{:.0}", level.requests_per_sec),
            level.errors.to_string(),
            at(|s| s.p50),
            at(|s| s.p99),
        ]);
    }
    if !sweep.rows.is_empty() {
        let _ = writeln!(
            out,
            "\n{prefix}interactive at rising concurrency (submit→result)\n{}",
            sweep.render()
        );
        let _ = writeln!(
            out,
            "held with p99 under {} ms: {}\n",
            c.p99_limit_ms,
            match (c.held_requests_per_sec, c.held_at_concurrency) {
                (Some(rate), Some(at)) => format!("{rate:.0} requests/s (concurrency {at})"),
                _ => "no level".into(),
            }
        );
    }
    out
}

/// The real model server, direct and through genfleet.
fn real_table(r: &RealReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "real backend: {} with {}, {} tokens per request",
        r.server, r.model, r.tokens_per_request
    );
    let mut real = Table::new(&[
        "path",
        "conc",
        "requests",
        "errors",
        "tokens/s",
        "1st token p50 ms",
        "p90 ms",
        "ratio",
        "added p50 ms",
    ]);
    for level in &r.levels {
        for (name, f, ratio, added) in [
            ("direct client", &level.direct, None, None),
            (
                "through genfleet",
                &level.through_genfleet,
                level.tokens_per_sec_ratio,
                level.added_first_token_p50_ms,
            ),
        ] {
            real.row(vec![
                name.to_string(),
                level.concurrency.to_string(),
                f.requests.to_string(),
                f.errors.to_string(),
                format!("{:.1}", f.tokens_per_sec),
                opt(f.first_token_ms.map(|s| s.p50), 2),
                opt(f.first_token_ms.map(|s| s.p90), 2),
                ratio.map_or(String::new(), |r| format!("{:.1}%", r * 100.0)),
                opt(added, 2),
            ]);
        }
    }
    let _ = writeln!(out, "{}", real.render());
    for level in &r.levels {
        for (name, f) in [
            ("direct", &level.direct),
            ("genfleet", &level.through_genfleet),
        ] {
            if let Some(error) = &f.first_error {
                let _ = writeln!(
                    out,
                    "real backend {name} at concurrency {}: {} errors, the first: {error}",
                    level.concurrency, f.errors
                );
            }
        }
    }
    out
}

fn latency_row(
    name: &str,
    concurrency: usize,
    requests: u64,
    errors: u64,
    rate: f64,
    summary: &Option<Summary>,
) -> Vec<String> {
    let at = |f: fn(&Summary) -> f64| {
        summary
            .as_ref()
            .map(|s| format!("{:.3}", f(s)))
            .unwrap_or_else(|| "-".into())
    };
    vec![
        name.to_string(),
        if concurrency == 0 {
            "-".into()
        } else {
            concurrency.to_string()
        },
        requests.to_string(),
        errors.to_string(),
        format!("{rate:.0}"),
        at(|s| s.p50),
        at(|s| s.p90),
        at(|s| s.p99),
        at(|s| s.max),
    ]
}

/// The scheduling phase: each pass's time to first token and prefix hits, and the forwarding
/// hop.
fn scheduling_table(r: &SchedulingReport) -> String {
    let s = &r.spec;
    let mut table = Table::new(&[
        "scheduling",
        "requests",
        "errors",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "later TTFT p50",
        "off ÷ this p50",
        "hit rate",
        "later-turn hits",
        "held",
        "same worker",
        "busy",
        "load",
    ]);
    let later = (s.chains * s.turns.saturating_sub(1)) as u64;
    let passes = [
        ("affinity on, one client", Some(&r.with_affinity)),
        ("affinity off", Some(&r.without_affinity)),
        ("forgetful clients", r.forgetful_clients.as_ref()),
        ("two gateways", r.two_gateways.as_ref()),
    ];
    let mut absent = Vec::new();
    for (name, run) in passes {
        let Some(run) = run else {
            absent.push(name);
            continue;
        };
        table.row(vec![
            name.into(),
            run.requests.to_string(),
            run.errors.to_string(),
            opt(run.first_token_ms.map(|t| t.p50), 1),
            opt(run.first_token_ms.map(|t| t.p99), 1),
            opt(run.later_first_token_ms.map(|t| t.p50), 1),
            opt(run.first_token_p50_vs_no_affinity, 1),
            pct(Some(run.hit_rate)),
            pct(Some(run.later_turn_hit_rate)),
            format!("{}/{later}", run.held),
            format!("{}/{later}", run.same_worker),
            run.fell_back_busy.to_string(),
            run.fell_back_load.to_string(),
        ]);
    }
    let mut out = format!(
        "scheduling: {} workers × {} slots, each on its own prefix-cache mock (hit {} ms, miss {} ms/KiB); \
         {} conversations × {} turns of {} B questions, {} at once; TTFT p50 off ÷ on: {}\n{}",
        s.workers,
        s.slots,
        s.prefix_hit_ms,
        s.prefill_ms_per_kb,
        s.chains,
        s.turns,
        s.turn_bytes,
        s.concurrency,
        opt(r.first_token_p50_ratio, 1),
        table.render()
    );
    for name in absent {
        let _ = writeln!(out, "{name}: not run");
    }
    for (name, run) in passes {
        if let Some(error) = run.and_then(|run| run.first_error.as_ref()) {
            let _ = writeln!(out, "{name}: the first error: {error}");
        }
    }
    if let (Some(spec), Some(hop)) = (&s.hop, &r.forwarding_hop) {
        let mut rows = Table::new(&[
            "forwarding hop",
            "submits",
            "accepted p50",
            "p90",
            "p99",
            "result p50",
            "p90",
            "p99",
        ]);
        for (name, path) in [
            ("direct to the key's worker", &hop.direct),
            ("pool, forwarded", &hop.pool_forwarded),
            ("pool, at the key's worker", &hop.pool_at_key_worker),
        ] {
            let at =
                |summary: Option<Summary>, p: fn(&Summary) -> f64| opt(summary.as_ref().map(p), 3);
            rows.row(vec![
                name.into(),
                path.samples.to_string(),
                at(path.submit_to_accepted_ms, |s| s.p50),
                at(path.submit_to_accepted_ms, |s| s.p90),
                at(path.submit_to_accepted_ms, |s| s.p99),
                at(path.submit_to_result_ms, |s| s.p50),
                at(path.submit_to_result_ms, |s| s.p90),
                at(path.submit_to_result_ms, |s| s.p99),
            ]);
        }
        let _ = write!(
            out,
            "\nforwarding hop: {} workers × {} slots on the fleet's mock (token delay {} ms), \
             {}-token replies, concurrency 1, {} submits a path (ms)\n{}",
            spec.workers,
            spec.slots,
            spec.token_delay_ms,
            spec.reply_tokens,
            spec.samples,
            rows.render()
        );
        let _ = writeln!(
            out,
            "the hop adds, p50: {} ms to submit→accepted, {} ms to submit→result (against direct); \
             {} ms to submit→accepted against pool submits at the key's worker",
            opt(hop.added_accepted_p50_ms, 3),
            opt(hop.added_result_p50_ms, 3),
            opt(hop.added_accepted_p50_vs_pool_ms, 3),
        );
        let _ = writeln!(
            out,
            "forwards: {} seen on the workers' own subjects, {} counted by the workers \
             (submits_placed); direct submits forwarded: {}; accepted off their key's worker: {}; \
             errors: {} direct, {} pool",
            hop.forwards_seen,
            hop.forwards_counted_by_workers
                .map_or("-".into(), |n| n.to_string()),
            hop.direct_forwarded,
            hop.off_key_worker,
            hop.direct_errors,
            hop.pool_errors,
        );
        if let Some(error) = &hop.first_error {
            let _ = writeln!(out, "forwarding hop: the first error: {error}");
        }
    }
    out.push('\n');
    out
}

fn opt(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.decimals$}"))
}

fn pct(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0))
}

pub(super) fn yes_no(value: Option<bool>) -> String {
    match value {
        Some(true) => "yes".into(),
        Some(false) => "no".into(),
        None => "-".into(),
    }
}

/// The targets a run measured, one row each.
pub(super) fn targets_table(checks: &[TargetCheck]) -> String {
    let mut targets =
        Table::new(&["target", "goal", "value", "met", "run had its conditions"]).text_columns(2);
    for t in checks {
        targets.row(vec![
            t.name.to_string(),
            t.target.to_string(),
            t.value
                .map_or("not measured".into(), |v| format!("{v:.2} {}", t.unit)),
            yes_no(t.met),
            yes_no(t.conditions_met),
        ]);
    }
    targets.render()
}

/// A plain-text table: columns as wide as their widest cell, text columns left-aligned and
/// figures right-aligned.
pub(super) struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    /// The first this many columns are text.
    text_columns: usize,
}

impl Table {
    pub(super) fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
            text_columns: 1,
        }
    }

    pub(super) fn text_columns(mut self, n: usize) -> Table {
        self.text_columns = n;
        self
    }

    pub(super) fn row(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    pub(super) fn render(&self) -> String {
        let width = |i: usize| {
            std::iter::once(&self.header)
                .chain(&self.rows)
                .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..self.header.len()).map(width).collect();
        let line = |row: &[String]| {
            let cells: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let pad = widths[i].saturating_sub(c.chars().count());
                    if i < self.text_columns {
                        format!("{c}{}", " ".repeat(pad))
                    } else {
                        format!("{}{c}", " ".repeat(pad))
                    }
                })
                .collect();
            cells.join("  ").trim_end().to_string()
        };
        let mut out = line(&self.header) + "\n";
        let total: usize = widths.iter().sum::<usize>() + 2 * widths.len().saturating_sub(1);
        out.push_str(&"-".repeat(total));
        out.push('\n');
        for row in &self.rows {
            out.push_str(&line(row));
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_their_columns() {
        let mut table = Table::new(&["phase", "req/s"]);
        table.row(vec!["interactive".into(), "1200".into()]);
        table.row(vec!["x".into(), "7".into()]);
        assert_eq!(
            table.render(),
            "phase        req/s\n------------------\ninteractive   1200\nx                7\n"
        );
    }
}
