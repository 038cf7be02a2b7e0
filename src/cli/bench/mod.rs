//! `genfleet bench`: a load generator over NATS, against a running fleet or a private one it
//! starts itself (`--local`: nats-server, worker processes, the mock backend).
//!
//! Phases (`--mode`): interactive submits at a fixed concurrency, a durable burst on the
//! queue, a streaming relay of long replies, and (`--local` only) the memory of a worker with
//! many slots, a real model server behind a worker against the same client calling it
//! directly (`real-backend`, when `scripts/real-backend.sh` has installed one), and multi-turn
//! conversations on workers whose backends have a prefix cache, with affinity (sent by one
//! client, by a new client per turn, through two gateways) and without, beside the cost of
//! the hop a keyed pool submit takes to its key's worker (`scheduling`), and `genfleet gateway` beside the bus path and the mock called directly
//! (`gateway`, run on its own). In the same
//! run it measures the floors genfleet is compared with: plain NATS request-reply against an
//! echo responder, JetStream writes as a lean request would make them, and the backend called
//! directly over HTTP.
//! Each phase reports what a request cost: CPU time per process and, from
//! nats-server's own counters, bus operations. With `--baseline` the load phases also run on
//! the workers of another build, side by side.
//! The result is a set of tables, or one JSON object with `--json`; docs/benchmarks.md
//! explains the figures and holds the project's own.

mod batch;
mod book;
mod budget;
mod caller;
mod churn;
mod closed_loop;
mod durable;
mod fairness;
mod fleet;
mod floors;
mod gateway;
mod hop;
mod interactive;
mod latency;
mod local;
mod memory;
mod meter;
mod mock_stats;
mod monitor;
mod plot;
mod procstat;
mod progress;
mod prometheus_text;
mod real;
mod report;
mod scheduling;
mod target;
mod target_check;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};

use crate::settings::Settings;
use local::{Build, LocalFleet, LocalOptions};
use meter::Meter;
use monitor::Monitor;
use procstat::Watched;
use report::{BaselineReport, FleetInfo, Floors, Phases, Report};
use target::Target;
use target_check::TargetCheck;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Start a private fleet for the run: nats-server on a free port, the mock backend and
    /// --workers worker processes; all stopped at the end. Without it the fleet the
    /// configuration names is loaded (its backend must be the echoing mock, e.g.
    /// `genfleet mock-llm`, for replies of the asked length).
    #[arg(long)]
    pub local: bool,
    /// Which phases to run; `all` runs memory only with --local.
    #[arg(long, value_enum, default_value_t = Mode::All)]
    pub mode: Mode,
    /// Concurrent clients (each with its own NATS connection) in the interactive phase and
    /// the floors.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Concurrent clients in the streaming phase [default: --concurrency].
    #[arg(long)]
    pub stream_concurrency: Option<usize>,
    /// Length of each timed phase [default: 10, unless --requests is given].
    #[arg(long, value_name = "SECS")]
    pub duration_secs: Option<u64>,
    /// Requests per phase (and the durable burst); with --duration-secs, whichever ends first.
    #[arg(long, value_name = "N")]
    pub requests: Option<u64>,
    /// Durable burst size when --requests is not given.
    #[arg(long, default_value_t = 2000)]
    pub burst: u64,
    /// Gateway mode: lines of the batch run through the Batch API, and of the durable drain
    /// it is compared with [default: --requests, else 10000].
    #[arg(long, value_name = "N")]
    pub batch_lines: Option<u64>,
    /// Gateway mode: rounds of the durable drain and the batch, the batch first in every other
    /// one (the batch's figure pools every round; an even number weighs both orders alike).
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub batch_rounds: u32,
    /// Interactive phase: calls of each path at concurrency 1 (the bus path, the backend called
    /// directly streamed and not, NATS request-reply, the two JetStream writes), made in turns
    /// from one client thread [default: --requests, else 1000].
    #[arg(long, value_name = "N")]
    pub caller_requests: Option<u64>,
    /// --local: worker processes.
    #[arg(long, default_value_t = 1)]
    pub workers: u32,
    /// --local: slots per worker.
    #[arg(long, default_value_t = 64)]
    pub slots: u32,
    /// --local: the mock backend's delay before each token.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub token_delay_ms: u64,
    /// Reply length of interactive and durable requests, in tokens.
    #[arg(long, default_value_t = 32)]
    pub reply_tokens: usize,
    /// Reply length of streaming requests, in tokens.
    #[arg(long, default_value_t = 2000)]
    pub stream_tokens: usize,
    /// The pool to load [default: worker.pool of the configuration].
    #[arg(long)]
    pub pool: Option<String>,
    /// The backend to call directly for the floor [default: the local mock, else llm.base_url].
    #[arg(long, value_name = "URL")]
    pub backend_url: Option<String>,
    /// A worker process of a running fleet, on this machine, whose CPU and memory to report
    /// (repeatable).
    #[arg(long = "worker-pid", value_name = "PID")]
    pub worker_pids: Vec<u32>,
    /// Memory phase: slots of the worker measured.
    #[arg(long, default_value_t = 256)]
    pub memory_slots: u32,
    /// Memory phase: requests kept running while it is measured.
    #[arg(long, default_value_t = 128)]
    pub memory_requests: u32,
    /// Memory phase: size of each running request's user message.
    #[arg(long, default_value_t = 4096, value_name = "BYTES")]
    pub memory_prompt_bytes: usize,
    /// Longest wait for one request's `finished` event (and for progress of a durable burst).
    #[arg(long, default_value_t = 60, value_name = "SECS")]
    pub timeout_secs: u64,
    /// --local: the nats-server binary [default: nats-server on PATH, /usr/sbin, /usr/local/bin].
    #[arg(long, value_name = "PATH")]
    pub nats_server: Option<PathBuf>,
    /// Real-backend phase: the llama.cpp `llama-server` binary [default: $GENFLEET_REAL_SERVER,
    /// as `scripts/real-backend.sh` prints it].
    #[arg(long, value_name = "PATH")]
    pub real_server: Option<PathBuf>,
    /// Real-backend phase: the GGUF model [default: $GENFLEET_REAL_MODEL].
    #[arg(long, value_name = "PATH")]
    pub real_model: Option<PathBuf>,
    /// Real-backend phase: completion tokens per request.
    #[arg(long, default_value_t = 128)]
    pub real_tokens: u32,
    /// Real-backend phase: requests per path (direct and through genfleet) at each
    /// concurrency (1 and 4).
    #[arg(long, default_value_t = 12)]
    pub real_requests: u64,
    /// nats-server's monitoring endpoint of a fleet the bench did not start (e.g.
    /// http://127.0.0.1:8222), for the bus operations per request; without it they are not
    /// reported. --local reads its own server's.
    #[arg(long, value_name = "URL")]
    pub nats_monitor: Option<String>,
    /// --local: another genfleet executable to compare this build with. Each load phase runs
    /// on fresh workers of the baseline (`PATH worker`), then on fresh workers of this build,
    /// against the same nats-server and mock; both are reported side by side.
    #[arg(long, value_name = "PATH")]
    pub baseline: Option<PathBuf>,
    /// Scheduling phase: workers, each on a mock backend of its own with a prefix cache.
    #[arg(long, default_value_t = 4)]
    pub scheduling_workers: u32,
    /// Scheduling phase: slots per worker.
    #[arg(long, default_value_t = 4)]
    pub scheduling_slots: u32,
    /// Scheduling phase: conversations (run once in each pass: one client with affinity,
    /// without, forgetful clients, two gateways); --requests, when given, bounds the turns of
    /// each pass.
    #[arg(long, default_value_t = 64)]
    pub scheduling_chains: usize,
    /// Scheduling phase: turns per conversation.
    #[arg(long, default_value_t = 5)]
    pub scheduling_turns: usize,
    /// Scheduling phase: conversations running at once.
    #[arg(long, default_value_t = 8)]
    pub scheduling_concurrency: usize,
    /// Scheduling phase: bytes of each turn's question (the mock echoes it).
    #[arg(long, default_value_t = 1024, value_name = "BYTES")]
    pub scheduling_turn_bytes: usize,
    /// Scheduling phase: the mocks' time to first token on a prefix-cache hit.
    #[arg(long, default_value_t = 5, value_name = "MS")]
    pub prefix_hit_ms: u64,
    /// Scheduling phase: the mocks' time to first token on a miss, per KiB of conversation.
    #[arg(long, default_value_t = 20, value_name = "MS")]
    pub prefill_ms_per_kb: u64,
    /// Scheduling phase: keyed submits of each path (straight to the key's worker, to the
    /// pool) in the measurement of the forwarding hop, one at a time on the fleet's mock; 0
    /// leaves it out. --requests, when given, bounds it.
    #[arg(long, default_value_t = 3000, value_name = "N")]
    pub hop_samples: u64,
    /// Churn phase: how long the callers keep submitting.
    #[arg(long, default_value_t = 30, value_name = "SECS")]
    pub churn_seconds: u64,
    /// Churn phase: concurrent callers, each following its requests' events.
    #[arg(long, default_value_t = 8)]
    pub churn_concurrency: usize,
    /// Churn phase: worker processes (the pool's size, kept as they are killed).
    #[arg(long, default_value_t = 3)]
    pub churn_workers: u32,
    /// Churn phase: slots per worker.
    #[arg(long, default_value_t = 4)]
    pub churn_slots: u32,
    /// Churn phase: between two kills (SIGKILL of the oldest worker, a new one started).
    #[arg(long, default_value_t = 6, value_name = "SECS")]
    pub kill_every_secs: u64,
    /// Churn phase: the workers' worker.heartbeat_ms [default: the configuration's].
    #[arg(long, value_name = "MS")]
    pub churn_heartbeat_ms: Option<u64>,
    /// Churn phase: the workers' worker.lost_after_ms [default: the configuration's].
    #[arg(long, value_name = "MS")]
    pub churn_lost_after_ms: Option<u64>,
    /// Churn phase: `high` requests timed on an idle worker with worker.preempt and beside a
    /// flood of `low` ones; 0 leaves the preemption measurement out.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub preempt_samples: u64,
    /// Fleet run: its length, the load's; the disruptions are spread over it (a rolling
    /// restart from 15%, a NATS node killed at 42%, a gateway killed at 70%).
    #[arg(long, default_value_t = 165, value_name = "SECS")]
    pub fleet_secs: u64,
    /// Fleet run: between two requests of one of its callers (the load's rate).
    #[arg(long, default_value_t = 400, value_name = "MS")]
    pub fleet_pause_ms: u64,
    /// Fleet run: where its chart goes (SVG: throughput, latency and backlog over time, the
    /// disruptions marked).
    #[arg(long, default_value = "fleet.svg", value_name = "PATH")]
    pub plot: PathBuf,
    /// Fairness phase: between two of the light tenant's requests (keep its requests at once
    /// under its share of the slots for its wait to say what fair share does).
    #[arg(long, default_value_t = 20, value_name = "MS")]
    pub light_every_ms: u64,
    /// With --local: the workers run with worker.preempt_fair_share (the fairness phase
    /// measures the light tenant's wait with it).
    #[arg(long)]
    pub fair_preempt: bool,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    Interactive,
    Durable,
    Streaming,
    Memory,
    RealBackend,
    Scheduling,
    /// Fair share between tenants on the durable queue, and the cost of priority and tenants
    /// on the interactive path; run on its own (not part of `all`).
    Fairness,
    /// HTTP through `genfleet gateway`, the same requests through the bus with the Rust
    /// client, and straight to the mock, at concurrency 1 and --concurrency; `--local` only,
    /// run on its own (not part of `all`).
    Gateway,
    /// Streaming load while workers are killed (SIGKILL) and replaced, then preemption by
    /// band; `--local` only, run on its own (not part of `all`).
    Churn,
    /// The whole fleet under churn: a 3-node JetStream cluster (replicas 3), 4 workers, 2
    /// gateways, a manager and the mock under steady mixed load (bus and HTTP, streamed and
    /// not, durable, two tenants, three bands, keyed conversations, decisions) while the
    /// workers restart one by one, a NATS node is killed and a gateway is killed; reports
    /// lost and twice-finished requests, text generated again, affinity, latency under churn
    /// against steady, the autoscaling signals, and a chart (--plot); `--local` only, run on
    /// its own (not part of `all`), --fleet-secs long.
    Fleet,
    All,
}

impl Mode {
    fn runs(self, phase: Mode) -> bool {
        self == phase || self == Mode::All
    }
}

pub async fn run(
    settings: Settings,
    config: Option<PathBuf>,
    args: BenchArgs,
) -> anyhow::Result<()> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    // reqwest is built without a bundled TLS provider; the process-wide one goes in first.
    crate::llm::openai::install_crypto_provider();
    anyhow::ensure!(
        args.local
            || !matches!(
                args.mode,
                Mode::Memory
                    | Mode::RealBackend
                    | Mode::Scheduling
                    | Mode::Gateway
                    | Mode::Churn
                    | Mode::Fleet
            ),
        "--mode memory, real-backend, scheduling, gateway, churn and fleet need --local (the bench starts the workers it measures)"
    );
    anyhow::ensure!(
        args.scheduling_chains > 0 && args.scheduling_turns > 0,
        "--scheduling-chains and --scheduling-turns must be at least 1"
    );
    anyhow::ensure!(
        args.mode != Mode::RealBackend
            || real::RealSpec::locate(args.real_server.clone(), args.real_model.clone()).is_some(),
        "--mode real-backend needs the model server and model: --real-server and --real-model, \
         or GENFLEET_REAL_SERVER and GENFLEET_REAL_MODEL (eval \"$(scripts/real-backend.sh)\" installs \
         them and sets both)"
    );
    anyhow::ensure!(
        !(args.local && args.nats_monitor.is_some()),
        "--nats-monitor is for a fleet the bench did not start; --local reads its own server's"
    );
    anyhow::ensure!(
        !args.fair_preempt || args.local,
        "--fair-preempt needs --local (it is a setting of the workers the bench starts)"
    );
    if let Some(baseline) = &args.baseline {
        anyhow::ensure!(
            args.local,
            "--baseline needs --local (the bench starts the workers of both builds)"
        );
        anyhow::ensure!(
            baseline.is_file(),
            "--baseline {}: no such file",
            baseline.display()
        );
    }
    // Installed first: Ctrl-C at any point ends the run, and dropping it stops the fleet.
    let interrupted = super::shutdown_signal();
    tokio::select! {
        outcome = bench(settings, config, &args) => outcome,
        _ = interrupted => anyhow::bail!("interrupted; everything the bench started is stopped"),
    }
}

async fn bench(
    mut settings: Settings,
    config: Option<PathBuf>,
    args: &BenchArgs,
) -> anyhow::Result<()> {
    let load_average_before = procstat::load_average();
    let pool = args
        .pool
        .clone()
        .unwrap_or_else(|| settings.worker.pool.clone());
    if args.mode == Mode::Churn {
        return churn_phase(&settings, config, args, pool, load_average_before).await;
    }
    if args.mode == Mode::Fleet {
        return fleet_run(&settings, config, args, pool, load_average_before).await;
    }
    let mut fleet = if args.local {
        eprintln!(
            "starting a local fleet: nats-server, genfleet mock-llm, {} worker(s) × {} slots",
            args.workers, args.slots
        );
        let fleet = LocalFleet::start(LocalOptions {
            nats_server: args.nats_server.clone(),
            config,
            pool: pool.clone(),
            workers: args.workers.max(1),
            slots: args.slots.max(1),
            token_delay_ms: args.token_delay_ms,
            worker_env: if args.fair_preempt {
                vec![(
                    "GENFLEET__WORKER__PREEMPT_FAIR_SHARE".to_string(),
                    "true".to_string(),
                )]
            } else {
                Vec::new()
            },
            nats_nodes: 1,
        })
        .await?;
        eprintln!(
            "local fleet ready: NATS {}, backend {}",
            fleet.nats_url, fleet.backend_url
        );
        settings.nats.url = fleet.nats_url.clone();
        Some(fleet)
    } else {
        None
    };
    let backend_url = args
        .backend_url
        .clone()
        .or_else(|| fleet.as_ref().map(|f| f.backend_url.clone()))
        .unwrap_or_else(|| settings.llm.base_url.clone());
    let model = settings.llm.model.clone();
    let stream_concurrency = args.stream_concurrency.unwrap_or(args.concurrency).max(1);
    let duration = match (args.duration_secs, args.requests) {
        (Some(secs), _) => Some(Duration::from_secs(secs)),
        (None, Some(_)) => None,
        (None, None) => Some(Duration::from_secs(10)),
    };
    let requests = args.requests;
    let target = Target::connect(
        settings.clone(),
        pool.clone(),
        args.concurrency.max(stream_concurrency),
        Duration::from_secs(args.timeout_secs),
    )
    .await?;

    if args.mode == Mode::Fairness {
        let spec = fairness::FairnessSpec {
            light: 20,
            light_every: Duration::from_millis(args.light_every_ms.max(1)),
            flood: requests.unwrap_or(args.burst),
            reply_tokens: args.reply_tokens,
            concurrency: args.concurrency,
            turn: duration.unwrap_or(Duration::from_secs(10)),
            turns: 2,
        };
        let report = fairness::run(&target, &spec).await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            println!("{}", fairness::table(&report));
        }
        target.close().await;
        drop(fleet);
        return Ok(());
    }
    if args.mode == Mode::Gateway
        && let Some(fleet) = fleet.take()
    {
        target.close().await;
        // The fleet stops when this returns, whatever the outcome.
        return gateway_phase(&fleet, &settings, args, pool, load_average_before).await;
    }
    let monitor = match (&fleet, &args.nats_monitor) {
        (Some(fleet), _) => Some(
            Monitor::new(&fleet.monitor_url)?
                .count_direct_gets(&settings.nats)
                .await?,
        ),
        (None, Some(url)) => Some(Monitor::new(url)?),
        (None, None) => None,
    };
    if let Some(monitor) = &monitor {
        monitor.read().await.with_context(|| {
            format!(
                "nats-server's monitoring at {} gives no usable /varz and /jsz",
                monitor.url()
            )
        })?;
    }
    let monitor = monitor.map(Arc::new);
    let release = fleet.is_none();
    let mut floors = Floors::default();
    // One run of each load phase per build: this build alone, or the baseline's first.
    let builds: Vec<Option<Build>> = match &args.baseline {
        Some(path) => vec![Some(Build::baseline(path.clone())), Some(Build::this()?)],
        None => vec![None],
    };
    let mut runs: Vec<Phases> = vec![Phases::default(); builds.len()];

    for phase in [Mode::Interactive, Mode::Durable, Mode::Streaming] {
        if !args.mode.runs(phase) {
            continue;
        }
        let (name, concurrency, reply_tokens) = match phase {
            Mode::Streaming => ("streaming", stream_concurrency, args.stream_tokens),
            Mode::Durable => ("durable", args.concurrency, args.reply_tokens),
            _ => ("interactive", args.concurrency, args.reply_tokens),
        };
        // The phase's load; its floors get the same.
        let spec = interactive::LoadSpec {
            phase: name,
            concurrency,
            reply_tokens,
            requests,
            duration,
        };
        let meter = meter_of(fleet.as_ref(), &args.worker_pids, &monitor);
        if phase != Mode::Durable {
            interactive::warm_up(&target, name, concurrency, reply_tokens).await;
        }
        match phase {
            Mode::Interactive => {
                floors.nats_request_reply =
                    Some(floors::nats_request_reply(&target, &spec, &meter).await?);
                floors.backend_http =
                    Some(floors::backend_http(&backend_url, &model, &spec, &meter, true).await?);
                floors.backend_http_not_streamed =
                    Some(floors::backend_http(&backend_url, &model, &spec, &meter, false).await?);
                floors.jetstream_writes =
                    Some(floors::jetstream_writes(&target, &spec, &meter).await?);
            }
            Mode::Streaming => {
                floors.backend_http_streaming =
                    Some(floors::backend_http(&backend_url, &model, &spec, &meter, true).await?);
            }
            _ => {}
        }
        for (build, run) in builds.iter().zip(runs.iter_mut()) {
            let meter = match (build, fleet.as_mut()) {
                (Some(build), Some(fleet)) => {
                    eprintln!("{name}: fresh workers of {}", build.name);
                    fleet.replace_workers(build).await?;
                    interactive::warm_up(&target, name, concurrency, reply_tokens).await;
                    meter_of(Some(fleet), &args.worker_pids, &monitor)
                }
                _ => meter.clone(),
            };
            match phase {
                Mode::Durable => {
                    let burst = requests.unwrap_or(args.burst);
                    run.durable = Some(
                        durable::run(&target, "durable", burst, reply_tokens, &meter, release)
                            .await?,
                    );
                }
                Mode::Streaming => {
                    run.streaming = Some(interactive::run(&target, &spec, &meter, release).await);
                }
                _ => {
                    run.interactive = Some(interactive::run(&target, &spec, &meter, release).await);
                    let caller = caller::CallerSpec {
                        requests: args.caller_requests.or(args.requests).unwrap_or(1000),
                        reply_tokens,
                        backend_url: backend_url.clone(),
                        model: model.clone(),
                        sweep_up_to: (2 * concurrency).max(1),
                        sweep_requests: requests,
                        sweep_duration: duration,
                    };
                    run.caller = Some(caller::run(&target, &caller, &meter, release).await?);
                }
            }
        }
    }
    let this = runs.pop().unwrap_or_default();
    let baseline = args.baseline.as_ref().map(|path| {
        let phases = runs.pop().unwrap_or_default();
        BaselineReport {
            binary: path.display().to_string(),
            order: BASELINE_ORDER,
            comparison: report::compare(&phases, &this),
            phases,
        }
    });
    let mut memory_report = None;
    let mut real_report = None;
    let mut scheduling_report = None;
    if let Some(fleet) = &fleet
        && args.mode.runs(Mode::Memory)
    {
        let spec = memory::MemorySpec {
            slots: args.memory_slots,
            running: args.memory_requests.min(args.memory_slots),
            prompt_bytes: args.memory_prompt_bytes,
        };
        memory_report = Some(memory::run(fleet, &target, &spec).await?);
    }
    if let Some(fleet) = &fleet
        && args.mode.runs(Mode::Scheduling)
    {
        let spec = scheduling::SchedulingSpec {
            workers: args.scheduling_workers.max(1),
            slots: args.scheduling_slots.max(1),
            // --requests bounds every phase: here the conversations of each pass.
            chains: args.requests.map_or(args.scheduling_chains, |n| {
                (n as usize / args.scheduling_turns).clamp(1, args.scheduling_chains)
            }),
            turns: args.scheduling_turns,
            concurrency: args.scheduling_concurrency.max(1),
            turn_bytes: args.scheduling_turn_bytes,
            prefix_hit_ms: args.prefix_hit_ms,
            prefill_ms_per_kb: args.prefill_ms_per_kb,
            hop: {
                let samples = args
                    .requests
                    .map_or(args.hop_samples, |n| n.min(args.hop_samples));
                (samples > 0).then(|| hop::HopSpec {
                    workers: args.scheduling_workers.max(1),
                    slots: args.scheduling_slots.max(1),
                    samples,
                    reply_tokens: args.reply_tokens,
                    token_delay_ms: args.token_delay_ms,
                })
            },
        };
        scheduling_report = Some(
            scheduling::run(
                fleet,
                &settings,
                &spec,
                Duration::from_secs(args.timeout_secs),
            )
            .await?,
        );
    }
    let real_paths = real::RealSpec::locate(args.real_server.clone(), args.real_model.clone());
    if let Some(fleet) = &fleet
        && args.mode.runs(Mode::RealBackend)
        && let Some((server, model)) = real_paths.clone()
    {
        let spec = real::RealSpec {
            server,
            model,
            template: real::RealSpec::template(),
            tokens: args.real_tokens.max(1),
            requests: args.real_requests.max(1),
            levels: vec![1, 4],
        };
        real_report = Some(
            real::run(
                fleet,
                &settings,
                &spec,
                Duration::from_secs(args.timeout_secs),
            )
            .await?,
        );
    }

    let ratios = report::ratios(
        &floors,
        this.interactive.as_ref(),
        this.caller.as_ref(),
        this.streaming.as_ref(),
    );
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut notes = run_notes(load_average_before, cpus);
    notes.push(
        "the NATS floor's echo responder and all clients run inside the bench process".into(),
    );
    if fleet.is_none() && args.mode.runs(Mode::Memory) {
        notes.push("memory is measured only with --local".into());
    }
    if fleet.is_none() && args.mode.runs(Mode::Scheduling) {
        notes.push("scheduling is measured only with --local".into());
    }
    if args.baseline.is_some() && scheduling_report.is_some() {
        notes.push(
            "the scheduling phase ran on this build's workers and gateways only, not on the \
             baseline's"
                .into(),
        );
    }
    if args.mode == Mode::All && real_paths.is_none() {
        notes.push(
            "no real-backend phase: eval \"$(scripts/real-backend.sh)\" installs a model server \
             and sets GENFLEET_REAL_SERVER and GENFLEET_REAL_MODEL"
                .into(),
        );
    }
    let worker_stats = if fleet.is_some() {
        "read from /proc of the worker processes the bench started".to_string()
    } else if args.worker_pids.is_empty() {
        "not available for a fleet the bench did not start; pass --worker-pid PID for workers on this machine".to_string()
    } else {
        "read from /proc of the --worker-pid processes".to_string()
    };
    let bus_stats = match (&fleet, &monitor) {
        (Some(_), _) => "read from the monitoring port of the bench's nats-server (direct gets counted by the bench)",
        (None, Some(_)) => "read from --nats-monitor (direct gets not counted; other clients of the server count too)",
        (None, None) => "not available for a fleet the bench did not start; pass --nats-monitor URL",
    }
    .to_string();
    let conditions = Conditions {
        local: fleet.is_some(),
        concurrency: args.concurrency,
        workers: args.workers,
        slots: args.slots,
        token_delay_ms: args.token_delay_ms,
        memory_slots: args.memory_slots,
    };
    let mut targets = targets(
        &conditions,
        &ratios,
        this.interactive.as_ref(),
        this.streaming.as_ref(),
        memory_report.as_ref(),
        real_report.as_ref(),
    );
    if let Some(report) = &scheduling_report {
        targets.extend(scheduling::targets(report));
    }
    let report = Report {
        genfleet_version: env!("CARGO_PKG_VERSION"),
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        cpus,
        load_average_before,
        fleet: FleetInfo {
            local: fleet.is_some(),
            nats_url: settings.nats.url.clone(),
            backend_url,
            pool,
            workers: fleet.as_ref().map(|f| f.workers.len() as u32),
            slots: fleet.as_ref().map(|_| args.slots),
            token_delay_ms: fleet.as_ref().map(|_| args.token_delay_ms),
            backend: if fleet.is_some() {
                "a separate process (genfleet mock-llm) started by the bench".into()
            } else {
                "not started by the bench".into()
            },
            worker_stats,
            nats_monitor: monitor.as_ref().map(|m| m.url().to_string()),
            bus_stats,
        },
        floors,
        this,
        baseline,
        memory: memory_report,
        real_backend: real_report,
        scheduling: scheduling_report,
        ratios,
        targets,
        notes,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.to_table());
    }
    // Closed before the fleet stops, so no client sees its server go away.
    target.close().await;
    if let Some(monitor) = monitor.and_then(Arc::into_inner) {
        monitor.close().await;
    }
    drop(fleet);
    nothing_completed(&report)
}

/// The churn phase on its own, on fleets of its own: run, report, and fail the run when no
/// request completed.
async fn churn_phase(
    settings: &Settings,
    config: Option<PathBuf>,
    args: &BenchArgs,
    pool: String,
    load_average_before: Option<f64>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.churn_workers >= 2 && args.churn_concurrency > 0 && args.kill_every_secs > 0,
        "--mode churn needs --churn-workers of at least 2 (a request of a killed worker goes on \
         on another), --churn-concurrency and --kill-every-secs of at least 1"
    );
    let spec = churn::ChurnSpec {
        workers: args.churn_workers,
        slots: args.churn_slots.max(1),
        concurrency: args.churn_concurrency,
        duration: Duration::from_secs(args.churn_seconds),
        kill_every: Duration::from_secs(args.kill_every_secs),
        heartbeat_ms: args.churn_heartbeat_ms,
        lost_after_ms: args.churn_lost_after_ms,
        preempt_samples: args.preempt_samples,
        settle: Duration::from_secs(args.timeout_secs),
    };
    let options = LocalOptions {
        nats_server: args.nats_server.clone(),
        config,
        pool,
        workers: spec.workers,
        slots: spec.slots,
        token_delay_ms: churn::TOKEN_DELAY_MS,
        worker_env: Vec::new(),
        nats_nodes: 1,
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut notes = run_notes(load_average_before, cpus);
    notes.push(
        "the callers run inside the bench process; nats-server, the mock and each worker are \
         processes of their own"
            .into(),
    );
    let info = churn::RunInfo {
        load_average_before,
        notes,
    };
    let report = churn::run(settings, options, &spec, info).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", churn::table(&report));
    }
    anyhow::ensure!(
        report.completed > 0,
        "no request of the churn phase completed: {:?}",
        report.submit_error_kinds
    );
    Ok(())
}

/// The fleet run on its own, on a fleet of its own: run, report, and fail the run when no
/// request completed.
async fn fleet_run(
    settings: &Settings,
    config: Option<PathBuf>,
    args: &BenchArgs,
    pool: String,
    load_average_before: Option<f64>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.fleet_secs >= 30,
        "--fleet-secs must be at least 30 (three disruptions with quiet spells between)"
    );
    let spec = fleet::FleetSpec {
        secs: args.fleet_secs as f64,
        settle: Duration::from_secs(args.timeout_secs),
        pause: Duration::from_millis(args.fleet_pause_ms),
        plot: args.plot.clone(),
    };
    let options = LocalOptions {
        nats_server: args.nats_server.clone(),
        config,
        pool,
        workers: fleet::WORKERS,
        slots: fleet::SLOTS,
        token_delay_ms: fleet::TOKEN_DELAY_MS,
        worker_env: Vec::new(),
        nats_nodes: fleet::NATS_NODES,
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut notes = run_notes(load_average_before, cpus);
    notes.push(
        "the callers run inside the bench process; every nats-server, worker, gateway, the \
         manager and the mock are processes of their own"
            .into(),
    );
    let info = churn::RunInfo {
        load_average_before,
        notes,
    };
    let report = fleet::run(settings, options, &spec, info).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", fleet::table(&report));
    }
    anyhow::ensure!(
        report.requests.all.completed > 0,
        "no request of the fleet run completed: {:?}",
        report.caller_errors
    );
    Ok(())
}

/// The gateway phase on its own: run, report, and fail the run when a path completed nothing.
async fn gateway_phase(
    fleet: &LocalFleet,
    settings: &Settings,
    args: &BenchArgs,
    pool: String,
    load_average_before: Option<f64>,
) -> anyhow::Result<()> {
    let duration_secs = match (args.duration_secs, args.requests) {
        (Some(secs), _) => Some(secs as f64),
        (None, Some(_)) => None,
        (None, None) => Some(10.0),
    };
    let mut levels = vec![1, args.concurrency];
    levels.dedup();
    let spec = gateway::GatewaySpec {
        pool,
        model: settings.llm.model.clone(),
        reply_tokens: args.reply_tokens,
        levels,
        requests: args.requests,
        duration_secs,
        token_delay_ms: args.token_delay_ms,
        workers: args.workers,
    };
    let (gateway, levels) = gateway::run(
        fleet,
        settings,
        &spec,
        Duration::from_secs(args.timeout_secs),
    )
    .await?;
    let lines = args.batch_lines.or(args.requests).unwrap_or(10_000);
    let batch = if lines > 0 {
        let target = Target::connect(
            settings.clone(),
            spec.pool.clone(),
            1,
            Duration::from_secs(args.timeout_secs),
        )
        .await?;
        let mut watched = fleet.watched();
        if let Some(pid) = gateway.pid() {
            watched.push(procstat::Watched {
                role: "genfleet gateway".into(),
                pid,
            });
        }
        // The drain's publisher and listener run here: its CPU counts as the gateway's does.
        watched.push(procstat::Watched {
            role: "genfleet bench".into(),
            pid: std::process::id(),
        });
        let monitor = Monitor::new(&fleet.monitor_url)?
            .count_direct_gets(&settings.nats)
            .await?;
        let meter = meter::Meter {
            watched,
            monitor: Some(Arc::new(monitor)),
        };
        let url = gateway.base_url.trim_end_matches('/');
        let report = batch::run(
            &target,
            &meter,
            url,
            lines,
            args.reply_tokens,
            args.workers,
            args.batch_rounds,
        )
        .await?;
        target.close().await;
        Some(report)
    } else {
        None
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut notes = run_notes(load_average_before, cpus);
    notes.push(
        "the HTTP clients and the bus client run inside the bench process; the gateway, the \
         worker(s), the mock and nats-server are processes of their own"
            .into(),
    );
    let mut targets = gateway::targets(&spec, &levels);
    targets.push(batch::target(batch.as_ref()));
    let report = gateway::GatewayReport {
        genfleet_version: env!("CARGO_PKG_VERSION"),
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        cpus,
        load_average_before,
        gateway_url: gateway.base_url.clone(),
        backend_url: fleet.backend_url.clone(),
        targets,
        spec,
        levels,
        batch,
        notes,
    };
    drop(gateway);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", gateway::table(&report));
    }
    for level in &report.levels {
        for (path, figures) in level.paths() {
            anyhow::ensure!(
                figures.completed > 0 || figures.requests == 0,
                "no request of the gateway phase's {path} path completed at concurrency {}: {}",
                level.concurrency,
                figures
                    .first_error
                    .as_deref()
                    .unwrap_or("no error recorded")
            );
        }
    }
    if let Some(batch) = &report.batch {
        for (i, round) in batch.rounds.iter().enumerate() {
            anyhow::ensure!(
                round.status == "completed" && round.completed == batch.lines,
                "the gateway phase's batch of round {} ended {} with {} of {} lines completed",
                i + 1,
                round.status,
                round.completed,
                batch.lines
            );
        }
    }
    Ok(())
}

/// A phase in which no request completed is a failed run, whatever the figures say.
fn nothing_completed(report: &Report) -> anyhow::Result<()> {
    let mut runs = vec![("", &report.this)];
    if let Some(baseline) = &report.baseline {
        runs.push(("baseline ", &baseline.phases));
    }
    for (build, phases) in runs {
        for (phase, completed, requests) in [
            (
                "interactive",
                phases.interactive.as_ref().map(|r| r.completed),
                phases.interactive.as_ref().map(|r| r.requests),
            ),
            (
                "streaming",
                phases.streaming.as_ref().map(|r| r.completed),
                phases.streaming.as_ref().map(|r| r.requests),
            ),
            (
                "durable",
                phases.durable.as_ref().map(|r| r.completed),
                phases.durable.as_ref().map(|r| r.burst),
            ),
        ] {
            if completed == Some(0) && requests.unwrap_or(0) > 0 {
                anyhow::bail!(
                    "no request of the {build}{phase} phase completed (see the errors above)"
                );
            }
        }
    }
    Ok(())
}

/// How `--baseline` runs are ordered, as the report says it.
const BASELINE_ORDER: &str = "each load phase on the baseline's workers, then on this build's; \
     before each run the workers are stopped and waited for, every stream of the private \
     nats-server is deleted, and fresh workers start and warm up";

/// What a phase is measured on: the fleet's processes (--local), the --worker-pid ones and the
/// bench itself, and the server's counters when they can be read.
fn meter_of(
    fleet: Option<&LocalFleet>,
    worker_pids: &[u32],
    monitor: &Option<Arc<Monitor>>,
) -> Meter {
    let mut watched: Vec<Watched> = fleet.map(LocalFleet::watched).unwrap_or_default();
    for (i, pid) in worker_pids.iter().enumerate() {
        watched.insert(
            i,
            Watched {
                role: format!("worker (pid {pid})"),
                pid: *pid,
            },
        );
    }
    watched.push(Watched {
        role: "genfleet bench".into(),
        pid: std::process::id(),
    });
    Meter {
        watched,
        monitor: monitor.clone(),
    }
}

/// What the run was, for judging whether a target's conditions held.
struct Conditions {
    local: bool,
    concurrency: usize,
    workers: u32,
    slots: u32,
    token_delay_ms: u64,
    memory_slots: u32,
}

/// The project's targets (docs/benchmarks.md), as this run measured them.
fn targets(
    run: &Conditions,
    ratios: &report::Ratios,
    interactive: Option<&interactive::LoadReport>,
    streaming: Option<&interactive::LoadReport>,
    memory: Option<&memory::MemoryReport>,
    real: Option<&real::RealReport>,
) -> Vec<TargetCheck> {
    let local = |holds: bool| if run.local { Some(holds) } else { None };
    // The worker processes' CPU per completed interactive request, summed.
    let worker_cpu_us = interactive
        .and_then(|i| report::cpu_per_request(&i.processes, |role| role.starts_with("worker ")));
    let zero_delay_one_worker = run.token_delay_ms == 0 && run.workers == 1;
    // The real backend's worst level: the lowest ratio and the largest added time.
    let real_levels = real.map(|r| r.levels.as_slice()).unwrap_or_default();
    let worst_ratio = real_levels
        .iter()
        .filter_map(|l| l.tokens_per_sec_ratio)
        .reduce(f64::min);
    let worst_added = real_levels
        .iter()
        .filter_map(|l| l.added_first_token_p50_ms)
        .reduce(f64::max);
    let mut checks = vec![
        TargetCheck {
            name: "added latency p50",
            target: "< 1 ms at concurrency 16, zero-delay mock",
            value: ratios.added_latency_p50_ms,
            unit: "ms",
            met: ratios.added_latency_p50_ms.map(|v| v < 1.0),
            conditions_met: local(run.concurrency == 16 && run.token_delay_ms == 0),
        },
        TargetCheck {
            name: "added latency p50, concurrency 1",
            target: "<= 0.5 ms over the fastest direct call, zero-delay mock",
            value: ratios.added_latency_p50_c1_ms,
            unit: "ms",
            met: ratios.added_latency_p50_c1_ms.map(|v| v <= 0.5),
            conditions_met: local(run.token_delay_ms == 0),
        },
        TargetCheck {
            name: "added latency p99, concurrency 1",
            target: "<= 1.5 ms over the fastest direct call, zero-delay mock",
            value: ratios.added_latency_p99_c1_ms,
            unit: "ms",
            met: ratios.added_latency_p99_c1_ms.map(|v| v <= 1.5),
            conditions_met: local(run.token_delay_ms == 0),
        },
        TargetCheck {
            name: "throughput vs NATS request-reply",
            target: ">= 12% at concurrency 16 (zero-delay mock, one worker, 64 slots)",
            value: ratios.throughput_vs_nats.map(|r| r * 100.0),
            unit: "%",
            met: ratios.throughput_vs_nats.map(|r| r >= 0.12),
            conditions_met: local(
                zero_delay_one_worker && run.slots == 64 && run.concurrency == 16,
            ),
        },
        TargetCheck {
            name: "worker CPU per interactive request",
            target: "<= 200 µs (zero-delay mock, one worker)",
            value: worker_cpu_us,
            unit: "µs",
            met: worker_cpu_us.map(|us| us <= 200.0),
            conditions_met: local(zero_delay_one_worker),
        },
        TargetCheck {
            name: "streaming relay",
            target: ">= 100000 tokens/s through one worker, no delta dropped",
            value: streaming.map(|s| s.tokens_per_sec),
            unit: "tokens/s",
            met: streaming.map(|s| {
                s.tokens_per_sec >= 100_000.0 && s.missing_events == 0 && s.delta_mismatches == 0
            }),
            conditions_met: local(zero_delay_one_worker),
        },
        TargetCheck {
            name: "idle worker RSS",
            target: "< 40 MiB with 256 slots",
            value: memory.map(|m| m.idle_rss_mib),
            unit: "MiB",
            met: memory.map(|m| m.idle_rss_mib < 40.0),
            conditions_met: memory.map(|_| run.memory_slots == 256),
        },
        TargetCheck {
            name: "memory per running request",
            target: "< 256 KiB beyond its conversation text",
            value: memory.map(|m| m.per_request_kib),
            unit: "KiB",
            met: memory.map(|m| m.per_request_kib < 256.0),
            conditions_met: memory.map(|_| true),
        },
    ];
    if real.is_some() {
        checks.push(TargetCheck {
            name: "real backend tokens/s through genfleet",
            target: ">= 97% of the direct client's, at concurrency 1 and 4",
            value: worst_ratio.map(|r| r * 100.0),
            unit: "%",
            met: worst_ratio.map(|r| r >= 0.97),
            conditions_met: Some(true),
        });
        checks.push(TargetCheck {
            name: "real backend added time to first token p50",
            target: "<= 2 ms more than the direct client's, at concurrency 1 and 4",
            value: worst_added,
            unit: "ms",
            met: worst_added.map(|ms| ms <= 2.0),
            conditions_met: Some(true),
        });
    }
    checks
}

/// What a report says of the run itself whatever its mode: a debug build, a machine busy
/// before it started.
fn run_notes(load_average_before: Option<f64>, cpus: usize) -> Vec<String> {
    let mut notes = Vec::new();
    if cfg!(debug_assertions) {
        notes.push(
            "a debug build: quote figures from a release build (cargo build --release)".into(),
        );
    }
    if let Some(load) = load_average_before
        && load > 0.5 * cpus as f64
    {
        notes.push(format!(
            "the machine was busy before the run (load average {load:.2} on {cpus} CPUs): measure again when it is quiet"
        ));
    }
    notes
}
