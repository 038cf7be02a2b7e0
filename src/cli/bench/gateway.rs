//! The gateway phase (`--local` only): what `genfleet gateway` adds to the bus path.
//!
//! A `genfleet gateway` process starts beside the worker(s) and the mock, and the same
//! requests (a user message the echoing mock answers with `reply_tokens` words, not streamed)
//! go three ways, at concurrency 1 and at `--concurrency`, in one run:
//! - through the gateway: `POST /v1/chat/completions` over HTTP (one reqwest client, its
//!   connections kept alive), the whole answer read;
//! - through the bus: the same request with the Rust client ([`Client`], one NATS connection
//!   as the gateway has), followed until its `finished` event, its stored result released
//!   afterwards off the timed path (as the gateway releases it);
//! - straight to the mock's `/v1/chat/completions` over HTTP (what the model call costs without
//!   genfleet);
//! - through the gateway's Responses API: `POST /v1/responses` with the same text as `input`,
//!   once with `store: false` (what the Responses mapping adds to a chat completion) and once
//!   stored (the default: the response kept in the responses bucket before it is answered).
//!
//! Then a batch ([`super::batch`]): the durable queue's drain rate and a batch's rate through
//! the Batch API, on the same fleet.
//!
//! Every answer is checked: a reply of another length counts as an error.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::json;

use super::budget::Budget;
use super::closed_loop;
use super::latency::Summary;
use super::local::{LocalFleet, LocalGateway};
use super::meter::Meter;
use super::monitor::BusOps;
use super::procstat::{ProcessUsage, Watched};
use super::report::{Table, targets_table};
use super::target_check::TargetCheck;
use super::workload;
use crate::client::Client;
use crate::protocol::{EventBody, GenerationResult, RequestState};
use crate::settings::Settings;

/// How the phase is run.
#[derive(Debug, Clone, Serialize)]
pub struct GatewaySpec {
    pub pool: String,
    /// The backend's model name, sent to the mock directly.
    pub model: String,
    pub reply_tokens: usize,
    /// The concurrencies measured (1 and `--concurrency`).
    pub levels: Vec<usize>,
    pub requests: Option<u64>,
    pub duration_secs: Option<f64>,
    /// The mock's delay before each token (the targets hold for 0).
    pub token_delay_ms: u64,
    pub workers: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct GatewayReport {
    pub genfleet_version: &'static str,
    pub build: &'static str,
    pub cpus: usize,
    pub load_average_before: Option<f64>,
    pub gateway_url: String,
    pub backend_url: String,
    pub spec: GatewaySpec,
    pub levels: Vec<GatewayLevel>,
    /// The batch against the durable drain (absent with `--batch-lines 0`).
    pub batch: Option<super::batch::BatchReport>,
    pub targets: Vec<TargetCheck>,
    pub notes: Vec<String>,
}

/// The paths at one concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct GatewayLevel {
    pub concurrency: usize,
    pub through_gateway: PathFigures,
    /// `POST /v1/responses`, `store: false`.
    pub through_responses: PathFigures,
    /// `POST /v1/responses`, stored (the default).
    pub through_responses_stored: PathFigures,
    /// Responses p50 − chat completions p50 through the gateway, ms.
    pub responses_added_p50_ms: Option<f64>,
    /// Responses p99 − chat completions p99 through the gateway, ms.
    pub responses_added_p99_ms: Option<f64>,
    /// Stored responses p50 − chat completions p50 through the gateway, ms.
    pub responses_stored_added_p50_ms: Option<f64>,
    pub through_bus: PathFigures,
    pub backend_direct: PathFigures,
    /// Gateway p50 − bus p50, ms.
    pub gateway_added_p50_ms: Option<f64>,
    /// Gateway p99 − bus p99, ms.
    pub gateway_added_p99_ms: Option<f64>,
    /// Gateway requests/s ÷ bus requests/s.
    pub gateway_throughput_vs_bus: Option<f64>,
    /// Gateway p50 − the mock called directly's p50, ms: what a caller of the gateway feels
    /// beyond calling the model server.
    pub gateway_added_over_direct_p50_ms: Option<f64>,
    /// Gateway p99 − the mock called directly's p99, ms.
    pub gateway_added_over_direct_p99_ms: Option<f64>,
}

impl GatewayLevel {
    /// Each path's figures, by the path's name.
    pub fn paths(&self) -> [(&'static str, &PathFigures); 5] {
        [
            ("gateway", &self.through_gateway),
            ("responses", &self.through_responses),
            ("responses stored", &self.through_responses_stored),
            ("bus", &self.through_bus),
            ("mock direct", &self.backend_direct),
        ]
    }
}

/// One path at one concurrency.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PathFigures {
    pub requests: u64,
    pub completed: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub duration_secs: f64,
    /// Completed requests per second.
    pub requests_per_sec: f64,
    /// From sending the request to the whole answer.
    pub latency_ms: Option<Summary>,
    /// CPU of the fleet's processes, the gateway and the bench over the path's run.
    pub processes: Vec<ProcessUsage>,
}

/// The ways a request is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Gateway,
    Responses,
    ResponsesStored,
    Bus,
    Direct,
}

/// Every path, in the order each level runs them.
const PATHS: [Path; 5] = [
    Path::Gateway,
    Path::Responses,
    Path::ResponsesStored,
    Path::Bus,
    Path::Direct,
];

impl Path {
    fn label(self) -> &'static str {
        match self {
            Path::Gateway => "gateway",
            Path::Responses => "responses",
            Path::ResponsesStored => "responses stored",
            Path::Bus => "bus",
            Path::Direct => "mock direct",
        }
    }
}

/// What the paths share: the clients and the request bodies.
struct Callers {
    http: reqwest::Client,
    bus: Client,
    gateway_url: String,
    backend_url: String,
    gateway_body: bytes::Bytes,
    responses_body: bytes::Bytes,
    responses_stored_body: bytes::Bytes,
    direct_body: bytes::Bytes,
    spec: GatewaySpec,
    run_id: String,
    /// Numbers the bus path's request ids.
    sent: AtomicU64,
    timeout: Duration,
}

impl Callers {
    /// One request on `path`: `Ok` when the whole answer came, of the asked length.
    async fn call(&self, path: Path) -> Result<(), String> {
        match path {
            Path::Gateway => {
                let url = format!("{}/chat/completions", self.gateway_url);
                self.http_call(&url, self.gateway_body.clone()).await
            }
            Path::Direct => {
                let url = format!("{}/chat/completions", self.backend_url);
                self.http_call(&url, self.direct_body.clone()).await
            }
            Path::Responses | Path::ResponsesStored => {
                let url = format!("{}/responses", self.gateway_url);
                let body = if path == Path::Responses {
                    self.responses_body.clone()
                } else {
                    self.responses_stored_body.clone()
                };
                self.http_call(&url, body).await
            }
            Path::Bus => self.bus_call().await,
        }
    }

    /// An HTTP call: its answer's text (a completion's message, or a response's message item)
    /// must be of the asked length.
    async fn http_call(&self, url: &str, body: bytes::Bytes) -> Result<(), String> {
        let response = self
            .http
            .post(url)
            .header("content-type", "application/json")
            .body(body)
            .timeout(self.timeout)
            .send()
            .await
            .map_err(|e| format!("HTTP: {e}"))?;
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| format!("HTTP body: {e}"))?;
        if !status.is_success() {
            return Err(format!("HTTP {status}"));
        }
        let answer: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|_| "an answer that is not JSON".to_string())?;
        let content = answer
            .pointer("/choices/0/message/content")
            .or_else(|| {
                let output = answer.get("output")?.as_array()?;
                let message = output.iter().find(|item| item["type"] == "message")?;
                message.pointer("/content/0/text")
            })
            .and_then(|c| c.as_str())
            .unwrap_or_default();
        self.check_length(content)
    }

    /// Follow, submit, wait for `finished`; the stored result is released off the timed path.
    async fn bus_call(&self) -> Result<(), String> {
        let n = self.sent.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{n}", self.run_id);
        let request = workload::request(id.clone(), self.spec.reply_tokens);
        let mut events = Box::pin(self.bus.follow(&id).await.map_err(|e| e.to_string())?);
        self.bus
            .submit(&self.spec.pool, &request)
            .await
            .map_err(|e| format!("submit: {e}"))?;
        let finished = tokio::time::timeout(self.timeout, async {
            while let Some(event) = events.next().await {
                if let EventBody::Finished { result } = event.body {
                    return Some(*result);
                }
            }
            None
        })
        .await;
        let result: GenerationResult = match finished {
            Ok(Some(result)) => result,
            // An event missed: the stored result says how it ended.
            _ => self
                .bus
                .result(&id, false)
                .await
                .map_err(|e| format!("no finished event, and the result: {e}"))?,
        };
        let client = self.bus.clone();
        tokio::spawn(async move {
            let _ = client.result(&id, true).await;
        });
        if result.state != RequestState::Completed {
            return Err(format!(
                "{} {}",
                result.state.as_str(),
                result.reason.as_str()
            ));
        }
        self.check_length(&result.output)
    }

    fn check_length(&self, content: &str) -> Result<(), String> {
        let words = workload::count_tokens(content);
        if words == self.spec.reply_tokens {
            Ok(())
        } else {
            Err(format!(
                "an answer of {words} words, not {}",
                self.spec.reply_tokens
            ))
        }
    }
}

pub async fn run(
    fleet: &LocalFleet,
    settings: &Settings,
    spec: &GatewaySpec,
    timeout: Duration,
) -> anyhow::Result<(LocalGateway, Vec<GatewayLevel>)> {
    eprintln!("gateway: starting genfleet gateway");
    let gateway = fleet.start_gateway(&spec.pool).await?;
    eprintln!("gateway: listening on {}", gateway.base_url);
    let text = workload::words(spec.reply_tokens);
    let max_tokens = spec.reply_tokens + 16;
    let gateway_body = serde_json::to_vec(&json!({
        "model": spec.pool,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    }))?;
    let responses = |store: bool| {
        serde_json::to_vec(&json!({
            "model": spec.pool,
            "input": text,
            "max_output_tokens": max_tokens,
            "store": store,
        }))
    };
    let responses_body = responses(false)?;
    let responses_stored_body = responses(true)?;
    let direct_body = serde_json::to_vec(&json!({
        "model": spec.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    }))?;
    let callers = Arc::new(Callers {
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(spec.levels.iter().copied().max().unwrap_or(1))
            .build()?,
        bus: Client::connect(settings)
            .await
            .context("cannot connect to NATS")?,
        gateway_url: gateway.base_url.trim_end_matches('/').to_string(),
        backend_url: fleet.backend_url.trim_end_matches('/').to_string(),
        gateway_body: gateway_body.into(),
        responses_body: responses_body.into(),
        responses_stored_body: responses_stored_body.into(),
        direct_body: direct_body.into(),
        spec: spec.clone(),
        run_id: format!("bench-gateway-{}", crate::protocol::ids::new_id()),
        sent: AtomicU64::new(0),
        timeout,
    });
    let mut watched = fleet.watched();
    if let Some(pid) = gateway.pid() {
        watched.push(Watched {
            role: "genfleet gateway".into(),
            pid,
        });
    }
    watched.push(Watched {
        role: "genfleet bench".into(),
        pid: std::process::id(),
    });
    let meter = Meter {
        watched,
        monitor: None,
    };
    // One of each first: a path that cannot answer at all fails the run here, plainly.
    for path in PATHS {
        callers
            .call(path)
            .await
            .map_err(|error| anyhow::anyhow!("{}: {error}", path.label()))
            .with_context(|| format!("the {} path does not answer", path.label()))?;
    }
    let duration = spec.duration_secs.map(Duration::from_secs_f64);
    let mut levels = Vec::new();
    for &concurrency in &spec.levels {
        let mut figures = Vec::new();
        for path in PATHS {
            // Warm-up: one request per client, so every connection is open.
            let warm = (0..concurrency as u64).map(|_| callers.call(path));
            futures_util::future::join_all(warm).await;
            let label = format!("gateway phase: {} c{concurrency}", path.label());
            figures.push(
                drive(
                    &callers,
                    path,
                    concurrency,
                    spec.requests,
                    duration,
                    &meter,
                    &label,
                )
                .await,
            );
        }
        let direct = figures.pop().unwrap_or_default();
        let bus = figures.pop().unwrap_or_default();
        let stored = figures.pop().unwrap_or_default();
        let responses = figures.pop().unwrap_or_default();
        let through = figures.pop().unwrap_or_default();
        let at = |f: &PathFigures, p: fn(&Summary) -> f64| f.latency_ms.as_ref().map(p);
        let added = |p: fn(&Summary) -> f64| at(&through, p).zip(at(&bus, p)).map(|(g, b)| g - b);
        let over_direct =
            |p: fn(&Summary) -> f64| at(&through, p).zip(at(&direct, p)).map(|(g, d)| g - d);
        let over_chat = |f: &PathFigures, p: fn(&Summary) -> f64| {
            at(f, p).zip(at(&through, p)).map(|(r, g)| r - g)
        };
        levels.push(GatewayLevel {
            concurrency,
            responses_added_p50_ms: over_chat(&responses, |s| s.p50),
            responses_added_p99_ms: over_chat(&responses, |s| s.p99),
            responses_stored_added_p50_ms: over_chat(&stored, |s| s.p50),
            through_responses: responses,
            through_responses_stored: stored,
            gateway_added_over_direct_p50_ms: over_direct(|s| s.p50),
            gateway_added_over_direct_p99_ms: over_direct(|s| s.p99),
            gateway_added_p50_ms: added(|s| s.p50),
            gateway_added_p99_ms: added(|s| s.p99),
            gateway_throughput_vs_bus: (bus.requests_per_sec > 0.0)
                .then(|| through.requests_per_sec / bus.requests_per_sec),
            through_gateway: through,
            through_bus: bus,
            backend_direct: direct,
        });
    }
    callers.bus.nats().flush().await.ok();
    Ok((gateway, levels))
}

/// `concurrency` clients sending `path` requests until the budget is spent.
#[allow(clippy::too_many_arguments)]
async fn drive(
    callers: &Callers,
    path: Path,
    concurrency: usize,
    requests: Option<u64>,
    duration: Option<Duration>,
    meter: &Meter,
    label: &str,
) -> PathFigures {
    let budget = Budget::new(requests, duration);
    let looped = closed_loop::run(label, concurrency, budget, meter, |_| callers.call(path)).await;
    let completed = looped.samples.len() as u64;
    let errors = looped.errors.len() as u64;
    PathFigures {
        requests: completed + errors,
        completed,
        errors,
        first_error: looped.errors.into_iter().next(),
        duration_secs: looped.secs,
        requests_per_sec: completed as f64 / looped.secs,
        latency_ms: looped.samples.summary(),
        processes: looped.spent.per_request(completed).processes,
    }
}

/// The targets of docs/benchmarks.md that this phase measures.
pub fn targets(spec: &GatewaySpec, levels: &[GatewayLevel]) -> Vec<TargetCheck> {
    let one = levels.iter().find(|l| l.concurrency == 1);
    let sixteen = levels.iter().find(|l| l.concurrency == 16);
    let zero_delay = spec.token_delay_ms == 0 && spec.workers == 1;
    let added = one.and_then(|l| l.gateway_added_p50_ms);
    let over_direct_p50 = one.and_then(|l| l.gateway_added_over_direct_p50_ms);
    let over_direct_p99 = one.and_then(|l| l.gateway_added_over_direct_p99_ms);
    let ratio = sixteen.and_then(|l| l.gateway_throughput_vs_bus);
    let responses = one.and_then(|l| l.responses_added_p50_ms);
    vec![
        TargetCheck {
            name: "gateway added p50 over the direct call",
            target: "<= 0.7 ms at concurrency 1 (zero-delay mock, one worker)",
            value: over_direct_p50,
            unit: "ms",
            met: over_direct_p50.map(|ms| ms <= 0.7),
            conditions_met: Some(zero_delay),
        },
        TargetCheck {
            name: "gateway added p99 over the direct call",
            target: "<= 1.5 ms at concurrency 1 (zero-delay mock, one worker)",
            value: over_direct_p99,
            unit: "ms",
            met: over_direct_p99.map(|ms| ms <= 1.5),
            conditions_met: Some(zero_delay),
        },
        TargetCheck {
            name: "gateway added p50 over the bus path",
            target: "<= 0.5 ms at concurrency 1 (zero-delay mock, one worker)",
            value: added,
            unit: "ms",
            met: added.map(|ms| ms <= 0.5),
            conditions_met: Some(zero_delay),
        },
        TargetCheck {
            name: "gateway throughput vs the bus path",
            target: ">= 95% of the bus path's requests/s at concurrency 16 (one gateway)",
            value: ratio.map(|r| r * 100.0),
            unit: "%",
            met: ratio.map(|r| r >= 0.95),
            conditions_met: Some(zero_delay && sixteen.is_some()),
        },
        TargetCheck {
            name: "responses added p50 over chat completions",
            target: "<= 0.1 ms at concurrency 1, store false (zero-delay mock, one worker)",
            value: responses,
            unit: "ms",
            met: responses.map(|ms| ms <= 0.1),
            conditions_met: Some(zero_delay),
        },
    ]
}

/// The readable form.
pub fn table(report: &GatewayReport) -> String {
    use std::fmt::Write;
    let s = &report.spec;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "genfleet bench {} ({} build), {} CPUs, load average before: {}",
        report.genfleet_version,
        report.build,
        report.cpus,
        report
            .load_average_before
            .map_or("-".into(), |l| format!("{l:.2}"))
    );
    let _ = writeln!(
        out,
        "gateway phase: {} worker(s), mock token delay {} ms, replies of {} words, not streamed; \
         gateway {}, mock {}\n",
        s.workers, s.token_delay_ms, s.reply_tokens, report.gateway_url, report.backend_url
    );
    let header = [
        "path",
        "conc",
        "requests",
        "errors",
        "req/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "added p50",
        "added p99",
        "over direct p50",
        "over direct p99",
    ];
    let mut rows = Table::new(&header);
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3}"));
    for level in &report.levels {
        for (name, f, added) in [
            (
                "HTTP → gateway → fleet → mock",
                &level.through_gateway,
                Some((
                    level.gateway_added_p50_ms,
                    level.gateway_added_p99_ms,
                    level.gateway_added_over_direct_p50_ms,
                    level.gateway_added_over_direct_p99_ms,
                )),
            ),
            (
                "HTTP → gateway /v1/responses → fleet → mock",
                &level.through_responses,
                None,
            ),
            ("the same, stored", &level.through_responses_stored, None),
            ("Rust client → bus → fleet → mock", &level.through_bus, None),
            ("HTTP → mock", &level.backend_direct, None),
        ] {
            let at = |p: fn(&Summary) -> f64| ms(f.latency_ms.as_ref().map(p));
            rows.row(vec![
                name.to_string(),
                level.concurrency.to_string(),
                f.requests.to_string(),
                f.errors.to_string(),
                format!("{:.0}", f.requests_per_sec),
                at(|s| s.p50),
                at(|s| s.p90),
                at(|s| s.p99),
                at(|s| s.max),
                added.map_or(String::new(), |a| ms(a.0)),
                added.map_or(String::new(), |a| ms(a.1)),
                added.map_or(String::new(), |a| ms(a.2)),
                added.map_or(String::new(), |a| ms(a.3)),
            ]);
        }
    }
    out.push_str(&rows.render());
    for level in &report.levels {
        let _ = writeln!(
            out,
            "concurrency {}: the gateway's requests/s are {} of the bus path's",
            level.concurrency,
            level
                .gateway_throughput_vs_bus
                .map_or("-".into(), |r| format!("{:.1}%", r * 100.0))
        );
        let _ = writeln!(
            out,
            "concurrency {}: /v1/responses adds {} ms p50 ({} ms p99) over /v1/chat/completions; \
             stored, {} ms p50",
            level.concurrency,
            ms(level.responses_added_p50_ms),
            ms(level.responses_added_p99_ms),
            ms(level.responses_stored_added_p50_ms),
        );
        for (name, f) in level.paths() {
            if let Some(error) = &f.first_error {
                let _ = writeln!(
                    out,
                    "{name} at concurrency {}: {} errors, the first: {error}",
                    level.concurrency, f.errors
                );
            }
        }
    }
    let mut cpu = Table::new(&["path", "process", "cores", "CPU µs/req"]).text_columns(2);
    for level in &report.levels {
        for (name, f) in level.paths() {
            for p in &f.processes {
                cpu.row(vec![
                    format!("{name} c{}", level.concurrency),
                    format!("{} ({})", p.role, p.pid),
                    format!("{:.2}", p.cpu_cores),
                    p.cpu_us_per_request
                        .map_or("-".into(), |us| format!("{us:.0}")),
                ]);
            }
        }
    }
    let _ = writeln!(out, "\n{}", cpu.render());
    if let Some(batch) = &report.batch {
        let _ = writeln!(
            out,
            "batch of {} lines on {} worker(s), against the durable drain of as many requests, \
             in {} round(s) (the upload took {:.2} s):",
            batch.lines,
            batch.workers,
            batch.rounds.len(),
            batch.upload_secs,
        );
        let percent = |r: Option<f64>| r.map_or("-".into(), |r| format!("{:.1}%", r * 100.0));
        for (i, round) in batch.rounds.iter().enumerate() {
            let _ = writeln!(
                out,
                "  round {}: the drain {:.0}/s in {:.2} s; the batch {} ({} completed, {} failed) \
                 {:.0} lines/s in {:.2} s: {} of the drain rate{}{}",
                i + 1,
                round.drain_per_sec,
                round.drain_secs,
                round.status,
                round.completed,
                round.failed,
                round.batch_per_sec,
                round.batch_secs,
                percent(round.batch_vs_drain),
                if i % 2 == 1 { ", the batch first" } else { "" },
                if i == batch.median_round {
                    " (the median)"
                } else {
                    ""
                },
            );
        }
        let _ = writeln!(
            out,
            "  over every round: the batch at {} of the drain rate",
            percent(batch.batch_vs_drain)
        );
        if let Some(round) = batch.median() {
            let mut cpu =
                Table::new(&["process", "drain µs/request", "batch µs/line"]).text_columns(1);
            let per = |p: &ProcessUsage| {
                p.cpu_us_per_request
                    .map_or("-".into(), |us| format!("{us:.0}"))
            };
            let sum = |ps: &[ProcessUsage]| -> f64 {
                ps.iter().filter_map(|p| p.cpu_us_per_request).sum()
            };
            for drained in &round.drain_processes {
                let batched = round
                    .batch_processes
                    .iter()
                    .find(|p| p.role == drained.role && p.pid == drained.pid);
                cpu.row(vec![
                    format!("{} ({})", drained.role, drained.pid),
                    per(drained),
                    batched.map_or("-".into(), per),
                ]);
            }
            cpu.row(vec![
                "in all".into(),
                format!("{:.0}", sum(&round.drain_processes)),
                format!("{:.0}", sum(&round.batch_processes)),
            ]);
            let _ = writeln!(out, "\nthe median round's CPU:\n{}", cpu.render());
            let rates = |ops: &Option<BusOps>| ops.as_ref().and_then(|o| o.per_request.clone());
            if let (Some(drain), Some(batched)) = (rates(&round.drain_bus), rates(&round.batch_bus))
            {
                let mut bus =
                    Table::new(&["bus, per request or line", "drain", "batch"]).text_columns(1);
                for (name, d, b) in drain
                    .named()
                    .into_iter()
                    .zip(batched.named())
                    .map(|((name, d), (_, b))| (name, d, b))
                {
                    bus.row(vec![name.to_string(), format!("{d:.2}"), format!("{b:.2}")]);
                }
                let _ = writeln!(out, "the median round's bus operations:\n{}", bus.render());
            }
        }
    }
    let _ = writeln!(out, "{}", targets_table(&report.targets));
    for note in &report.notes {
        let _ = writeln!(out, "note: {note}");
    }
    out
}
