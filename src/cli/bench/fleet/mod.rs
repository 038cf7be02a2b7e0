//! The fleet run (`--mode fleet`, `--local` only): every piece of genfleet together on one
//! machine, on loopback, under steady mixed load while the fleet is disrupted in turn.
//!
//! - **The fleet**: a 3-node NATS JetStream cluster (the fleet's streams and buckets with 3
//!   replicas), 4 worker processes, 2 `genfleet gateway` processes (API keys for two
//!   tenants), a `genfleet manager` answering decisions by a rule, and the mock backend. Every
//!   process is given every node's URL, so it reconnects to another when its own dies.
//! - **The load** ([`lanes`]): for the whole run, lanes of callers send interactive requests
//!   over the bus and through both gateways (whole and streamed), durable requests, keyed
//!   conversations (over the bus, and through the gateways in turn) and requests that ask a
//!   manager for a decision and go on in a continuation; as two tenants, in the three bands
//!   in turn, each caller pausing between requests so that two cores are not saturated.
//! - **The churn** ([`disruptions`]), with quiet spells between: a rolling restart of every
//!   worker (SIGTERM, its requests handed off at once, a replacement with a new id ready
//!   before the next), a NATS node killed and started again on its ports and store, a
//!   gateway killed and started again on its address.
//! - **What it reports**: every accepted request ending exactly once ([`accounting`]: lost
//!   and finished twice, the targets), text generated again (the mock's counters against the
//!   outputs), the keyed turns' affinity hit rate ([`affinity`]), latency in steady state
//!   against during a disruption, the autoscaling signals read every second from each
//!   worker's `/metrics` ([`signals`]), and a chart of throughput, latency and backlog with
//!   the disruptions marked ([`timeline`], written as SVG to `--plot`).
//!
//! Every request's events are read on one wildcard subscription through a node that is never
//! killed, so a second `finished` is seen wherever it comes from.

mod accounting;
mod affinity;
mod disruptions;
mod lanes;
mod signals;
mod table;
mod timeline;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use super::book::Book;
use super::churn::RunInfo;
use super::latency::{Samples, Summary};
use super::local::{GatewayOptions, LocalFleet, LocalManager, LocalOptions};
use super::mock_stats::MockStats;
use super::target_check::TargetCheck;
use crate::client::Client;
use crate::client::connect::{self, ConnectPurpose};
use crate::client::subjects::Subjects;
use crate::settings::Settings;

pub use table::table;

use accounting::Tally;
use affinity::AffinityFigures;
use disruptions::{Churn, Disruption, Schedule, WorkerAddrs};
use lanes::{Call, Kind, Load, Records, TENANTS};
use signals::{Sample, SignalSummary};
use timeline::Second;

pub const NATS_NODES: usize = 3;
pub const WORKERS: u32 = 4;
pub const SLOTS: u32 = 4;
pub const GATEWAYS: usize = 2;
/// The mock's delay before each word: an interactive request streams for about 0.6 s.
pub const TOKEN_DELAY_MS: u64 = 20;
/// The node the bench reads every request's events through: never killed.
const SPARED_NODE: usize = 0;
/// The manager's name (its durable consumer is `genfleet-manager-<name>`).
const MANAGER: &str = "bench-fleet";
/// Its rules: every decision a model asks for is answered with the option it recommends.
const MANAGER_RULES: &str = "[[rule]]\ntype = \"decision_request\"\nanswer = \"default\"\n\
rationale = \"The bench's manager takes the option the model recommends.\"\n";
/// How long the manager may take to be following the signals.
const MANAGER_START: Duration = Duration::from_secs(30);
/// After every request ended, how long the event subscription stays open for a late second
/// `finished`.
const GRACE: Duration = Duration::from_secs(2);

/// How the run is made.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// The run's length: the load, with the disruptions spread over it.
    pub secs: f64,
    /// The longest a request may take, and the longest the run waits for the last ones.
    pub settle: Duration,
    /// Between a caller's requests.
    pub pause: Duration,
    /// Where the chart goes.
    pub plot: PathBuf,
}

/// What the fleet run measured.
#[derive(Debug, Clone, Serialize)]
pub struct FleetReport {
    pub genfleet_version: &'static str,
    pub build: &'static str,
    pub cpus: usize,
    pub load_average_before: Option<f64>,
    pub fleet: FleetShape,
    pub schedule: Schedule,
    /// From the first request to the last caller's stop.
    pub load_secs: f64,
    pub disruptions: Vec<Disruption>,
    /// Every request the callers sent and every continuation, counted once.
    pub requests: Tally,
    /// Requests that asked for a decision still unanswered when the run ended (their chains
    /// wait for the decision's expiry): the request, its decision, its outcome, and whether
    /// the managers could have seen it (its signal in the signals stream).
    pub decisions_unanswered: Vec<accounting::Unanswered>,
    /// What went wrong for the callers, by kind of request (what they saw, not what the fleet
    /// did: a gateway killed breaks its callers' connections while their requests run on).
    pub caller_errors: BTreeMap<Kind, BTreeMap<String, u64>>,
    /// Submit (or send) to the end the caller saw, of requests that completed, by kind:
    /// those sent while no disruption was in progress, and those sent during one.
    pub latency: Vec<LatencyRow>,
    pub regenerated: Regenerated,
    pub affinity: AffinityFigures,
    pub signals: SignalSummary,
    pub signal_samples: Vec<Sample>,
    pub seconds: Vec<Second>,
    /// The chart's file, when it was written.
    pub plot: Option<String>,
    pub targets: Vec<TargetCheck>,
    pub notes: Vec<String>,
}

/// The fleet the run started.
#[derive(Debug, Clone, Serialize)]
pub struct FleetShape {
    pub nats_nodes: usize,
    pub replicas: usize,
    pub workers: u32,
    pub slots: u32,
    pub gateways: usize,
    pub manager: &'static str,
    pub token_delay_ms: u64,
    /// `worker.drain_handoff` of the workers.
    pub drain_handoff: &'static str,
    pub heartbeat_ms: u64,
    pub lost_after_ms: u64,
    pub checkpoint_ms: u64,
    pub tenants: Vec<&'static str>,
    /// Lanes of each kind.
    pub lanes: BTreeMap<Kind, usize>,
    pub pause_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LatencyRow {
    pub kind: Option<Kind>,
    /// `all interactive` when `kind` is none.
    pub label: &'static str,
    /// Sent and ended with no disruption in progress.
    pub steady_ms: Option<Summary>,
    /// Sent with no disruption in progress, and still running when one began.
    pub caught_ms: Option<Summary>,
    /// Sent while a disruption was in progress.
    pub disrupted_ms: Option<Summary>,
}

/// Text the mock generated against the text the results hold.
#[derive(Debug, Clone, Serialize)]
pub struct Regenerated {
    pub generated_chars: u64,
    /// The mock's chunks: one a token.
    pub generated_tokens: u64,
    pub output_chars: u64,
    /// Ended requests whose output's length is not known (not counted in `output_chars`).
    pub outputs_unknown: u64,
    /// Requests that continued a final assistant message at the mock (a resume).
    pub continuations: u64,
    pub again_chars: i64,
    pub again_pct: Option<f64>,
    /// `again_chars` in tokens, at the run's characters per token.
    pub again_tokens: Option<f64>,
}

pub async fn run(
    settings: &Settings,
    options: LocalOptions,
    spec: &FleetSpec,
    info: RunInfo,
) -> anyhow::Result<FleetReport> {
    let mut worker_env = options.worker_env.clone();
    worker_env.push(("GENFLEET__WORKER__DRAIN_HANDOFF".into(), "at_once".into()));
    eprintln!(
        "fleet: starting {NATS_NODES} NATS nodes (JetStream, replicas {NATS_NODES}), the mock, \
         {WORKERS} workers × {SLOTS} slots"
    );
    let mut fleet = LocalFleet::start(LocalOptions {
        workers: WORKERS,
        slots: SLOTS,
        token_delay_ms: TOKEN_DELAY_MS,
        worker_env,
        nats_nodes: NATS_NODES,
        ..options.clone()
    })
    .await?;
    let keys: Vec<String> = TENANTS
        .iter()
        .map(|_| format!("gf-bench-{}", crate::protocol::ids::new_id()))
        .collect();
    let keys_file = fleet.dir().join("gateway-keys.txt");
    let lines: String = keys
        .iter()
        .zip(TENANTS)
        .map(|(key, tenant)| format!("{} {tenant}\n", crate::gateway::keys::hash_hex(key)))
        .collect();
    std::fs::write(&keys_file, lines).context("cannot write the gateways' keys")?;
    let gateway_env = vec![(
        "GENFLEET__GATEWAY__API_KEYS_FILE".to_string(),
        keys_file.display().to_string(),
    )];
    let mut gateways = Vec::new();
    for n in 1..=GATEWAYS {
        gateways.push(
            fleet
                .start_gateway_with(&GatewayOptions {
                    pool: &options.pool,
                    name: &format!("gateway-{n}"),
                    listen: None,
                    env: gateway_env.clone(),
                })
                .await?,
        );
    }
    let rules = fleet.dir().join("manager-rules.toml");
    std::fs::write(&rules, MANAGER_RULES).context("cannot write the manager's rules")?;
    let mut manager = fleet.start_manager(MANAGER, &rules)?;
    let mut settings = settings.clone();
    settings.nats.url = fleet.nats_url.clone();
    settings.jetstream.replicas = NATS_NODES;
    wait_for_manager(&settings, &mut manager).await?;
    eprintln!(
        "fleet: {GATEWAYS} gateways and manager {MANAGER} up; NATS {}",
        fleet.nats_url
    );

    let mut watching = settings.clone();
    watching.nats.url = fleet.nats_node_urls()[SPARED_NODE].clone();
    let watcher = connect::connect(&watching.nats, ConnectPurpose::Client)
        .await
        .context("cannot connect to NATS")?;
    let subjects = Subjects::new(&settings.subjects);
    let (book, collector) = Book::collect(&watcher, &subjects).await?;
    let mock = MockStats::new(&fleet.backend_url);
    mock.reset().await?;

    let records = Arc::new(Records::default());
    let addrs: WorkerAddrs = Arc::new(Mutex::new(
        fleet.workers.iter().map(|w| w.http_addr.clone()).collect(),
    ));
    let stop_load = Arc::new(AtomicBool::new(false));
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let sampler = AbortOnDrop::new(tokio::spawn(signals::sample(
        addrs.clone(),
        records.clone(),
        started,
        stop_sampling.clone(),
    )));
    let load = Arc::new(Load {
        settings: settings.clone(),
        pool: options.pool.clone(),
        book: book.clone(),
        records: records.clone(),
        started,
        stop: stop_load.clone(),
        settle: spec.settle,
        pause: spec.pause,
        run_id: format!("fl{}", crate::protocol::ids::new_id()),
        gateways: gateways
            .iter()
            .map(|g| g.base_url.trim_end_matches('/').to_string())
            .collect(),
        keys,
        http: reqwest::Client::new(),
    });
    let lanes: Vec<AbortOnDrop<()>> = lanes::start(load)
        .await?
        .into_iter()
        .map(AbortOnDrop::new)
        .collect();
    let schedule = Schedule::over(spec.secs);
    eprintln!(
        "fleet: {} lanes of callers for about {:.0} s; disruptions from {:.0} s",
        lanes.len(),
        schedule.load_s,
        schedule.rolling_restart_at_s
    );
    let disruptions = Churn {
        fleet: &mut fleet,
        gateways: &mut gateways,
        gateway_env,
        pool: options.pool.clone(),
        slots: SLOTS,
        addrs,
        started,
        spared_node: SPARED_NODE,
        jetstream: settings.jetstream.clone(),
    }
    .run(&schedule)
    .await?;
    let last_end = disruptions.last().map_or(0.0, |d| d.ended_s);
    let end_at = schedule.load_s.max(last_end + schedule.quiet_s);
    tokio::time::sleep_until((started + Duration::from_secs_f64(end_at)).into()).await;
    stop_load.store(true, Ordering::Relaxed);
    eprintln!(
        "fleet: load stopped at {:.1} s; waiting for the callers",
        started.elapsed().as_secs_f64()
    );
    for lane in lanes {
        lane.join().await?;
    }
    let load_secs = started.elapsed().as_secs_f64();

    eprintln!("fleet: waiting for every accepted request to end");
    let lookup = Client::connect(&settings).await?;
    let calls = records.calls();
    let mut tracked = accounting::tracked(&calls, &records.continuations());
    let mut decisions_unanswered =
        accounting::settle(&book, &lookup, &mut tracked, spec.settle).await;
    accounting::find_signals(
        lookup.nats(),
        &settings.jetstream.signals_stream,
        &mut decisions_unanswered,
    )
    .await;
    // Late duplicates (a second `finished`) have the grace period to show.
    tokio::time::sleep(GRACE).await;
    stop_sampling.store(true, Ordering::Relaxed);
    let samples = sampler.join().await?;
    let counted = accounting::count(&book, &lookup, &tracked).await;
    let overflow = book.overflow();
    drop(collector);
    let generated = mock.read().await?;
    let run_secs = started.elapsed().as_secs_f64();
    // The bench's own connections close before the servers go.
    drop(lookup);
    watcher.drain().await.ok();
    drop(manager);
    drop(gateways);
    drop(fleet);

    let requests = accounting::tally(&counted);
    let (output_chars, outputs_unknown) = accounting::output_chars(&counted);
    let again_chars = generated.content_chars as i64 - output_chars as i64;
    let regenerated = Regenerated {
        generated_chars: generated.content_chars,
        generated_tokens: generated.content_chunks,
        output_chars,
        outputs_unknown,
        continuations: generated.continuations,
        again_chars,
        again_pct: (output_chars > 0).then(|| again_chars as f64 / output_chars as f64 * 100.0),
        again_tokens: (generated.content_chars > 0).then(|| {
            again_chars as f64 * generated.content_chunks as f64 / generated.content_chars as f64
        }),
    };
    let seconds = timeline::seconds(&calls, &samples, run_secs);
    let plot = write_plot(&spec.plot, &seconds, &disruptions);
    let mut notes = info.notes;
    if let Err(error) = &plot {
        notes.push(format!("the chart was not written: {error:#}"));
    }
    if overflow > 0 {
        notes.push(format!(
            "{overflow} events were not kept: the book of requests was full"
        ));
    }
    let signal_summary = signals::summary(&samples);
    if !signal_summary.absent.is_empty() {
        notes.push(format!(
            "the workers served none of {}: those signals are absent, not zero",
            signal_summary.absent.join(", ")
        ));
    }
    let mut report = FleetReport {
        genfleet_version: env!("CARGO_PKG_VERSION"),
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        load_average_before: info.load_average_before,
        fleet: FleetShape {
            nats_nodes: NATS_NODES,
            replicas: NATS_NODES,
            workers: WORKERS,
            slots: SLOTS,
            gateways: GATEWAYS,
            manager: "genfleet manager answering every decision request with its default",
            token_delay_ms: TOKEN_DELAY_MS,
            drain_handoff: "at_once",
            heartbeat_ms: settings.worker.heartbeat_ms,
            lost_after_ms: settings.worker.lost_after_ms,
            checkpoint_ms: settings.generation.checkpoint_ms,
            tenants: TENANTS.to_vec(),
            lanes: lanes::LANES.into_iter().collect(),
            pause_ms: spec.pause.as_millis() as u64,
        },
        schedule,
        load_secs,
        affinity: affinity::figures(&records.turns(), &counted, &disruptions),
        latency: latency_rows(&calls, &disruptions),
        caller_errors: caller_errors(&calls),
        disruptions,
        requests,
        decisions_unanswered,
        regenerated,
        signals: signal_summary,
        signal_samples: samples,
        seconds,
        plot: plot.ok().map(|p| p.display().to_string()),
        targets: Vec::new(),
        notes,
    };
    report.targets = targets(&report);
    Ok(report)
}

/// Waits until the manager follows the signals (its durable consumer exists), at most
/// [`MANAGER_START`]; fails at once if it exited.
async fn wait_for_manager(settings: &Settings, manager: &mut LocalManager) -> anyhow::Result<()> {
    let client = connect::connect(&settings.nats, ConnectPurpose::Client).await?;
    let jetstream = async_nats::jetstream::new(client);
    let consumer = format!("genfleet-manager-{MANAGER}");
    let started = Instant::now();
    loop {
        anyhow::ensure!(
            manager.running(),
            "genfleet manager exited at start (its log is manager's in the fleet's directory)"
        );
        if let Ok(stream) = jetstream
            .get_stream(&settings.jetstream.signals_stream)
            .await
            && stream.consumer_info(&consumer).await.is_ok()
        {
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < MANAGER_START,
            "genfleet manager did not follow the signals within {MANAGER_START:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A task aborted when dropped (an error or Ctrl-C ends the run), joined otherwise.
struct AbortOnDrop<T>(Option<tokio::task::JoinHandle<T>>);

impl<T> AbortOnDrop<T> {
    fn new(task: tokio::task::JoinHandle<T>) -> AbortOnDrop<T> {
        AbortOnDrop(Some(task))
    }

    async fn join(mut self) -> anyhow::Result<T> {
        let task = self.0.take().context("a task is joined once")?;
        Ok(task.await?)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

fn write_plot(
    path: &std::path::Path,
    seconds: &[Second],
    disruptions: &[Disruption],
) -> anyhow::Result<PathBuf> {
    let svg = super::plot::svg(&timeline::chart(seconds, disruptions));
    std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()))
}

/// Latency of the completed requests by kind: those sent while a disruption was in
/// progress, those sent before one that began while they ran, and the rest (steady).
fn latency_rows(calls: &[Call], disruptions: &[Disruption]) -> Vec<LatencyRow> {
    let split = |keep: &dyn Fn(&Call) -> bool| {
        let mut windows: [Samples; 3] = Default::default();
        for call in calls.iter().filter(|c| c.completed && keep(c)) {
            let Some(ended) = call.ended_s else { continue };
            let took = Duration::from_secs_f64((ended - call.submitted_s).max(0.0));
            let window = if disruptions.iter().any(|d| d.covers(call.submitted_s)) {
                2
            } else if disruptions
                .iter()
                .any(|d| call.submitted_s < d.started_s && d.started_s <= ended)
            {
                1
            } else {
                0
            };
            windows[window].push(took);
        }
        windows.map(|w| w.summary())
    };
    let row = |kind: Option<Kind>, label: &'static str, keep: &dyn Fn(&Call) -> bool| {
        let [steady_ms, caught_ms, disrupted_ms] = split(keep);
        LatencyRow {
            kind,
            label,
            steady_ms,
            caught_ms,
            disrupted_ms,
        }
    };
    let mut rows: Vec<LatencyRow> = Kind::ALL
        .into_iter()
        .filter(|k| *k != Kind::Continuation)
        .map(|kind| row(Some(kind), kind.label(), &|c| c.kind == kind))
        .collect();
    rows.push(row(None, "all interactive", &|c| c.kind.interactive()));
    rows
}

fn caller_errors(calls: &[Call]) -> BTreeMap<Kind, BTreeMap<String, u64>> {
    let mut errors: BTreeMap<Kind, BTreeMap<String, u64>> = BTreeMap::new();
    for call in calls {
        if let Some(error) = &call.error {
            *errors
                .entry(call.kind)
                .or_default()
                .entry(error.clone())
                .or_default() += 1;
        }
    }
    errors
}

/// The fleet run's targets (docs/benchmarks.md, "The whole fleet under churn").
fn targets(r: &FleetReport) -> Vec<TargetCheck> {
    let disrupted = Some(r.disruptions.len() == 3 && r.requests.all.accepted > 0);
    vec![
        TargetCheck {
            name: "requests lost",
            target: "0 (accepted, and no terminal result after the run)",
            value: Some(r.requests.all.lost as f64),
            unit: "",
            met: Some(r.requests.all.lost == 0),
            conditions_met: disrupted,
        },
        TargetCheck {
            name: "requests finished twice",
            target: "0",
            value: Some(r.requests.all.finished_twice as f64),
            unit: "",
            met: Some(r.requests.all.finished_twice == 0),
            conditions_met: disrupted,
        },
    ]
}
