//! Worker churn (`--mode churn`, `--local` only): streaming load while workers die.
//!
//! A private fleet of `--churn-workers` worker processes answers long streamed replies (the
//! mock echoes [`REPLY_WORDS`] numbered words, one every [`TOKEN_DELAY_MS`], so a request
//! streams for about three seconds). A closed loop of callers submits interactive requests
//! and follows each one's events to its `finished`; every `--kill-every-secs` the oldest
//! worker is killed with SIGKILL and a fresh one (a new id) takes its place, so the pool keeps
//! its size. What is measured is what the fleet promises when a worker dies: every accepted
//! request ends once, the callers' streams run on without a gap or a repeat, the text
//! streamed is the result's, little is generated twice, and the requests of a killed worker
//! go on elsewhere soon after the kill.
//!
//! All events are read on one wildcard subscription, kept open until a grace period after
//! the last request ended, so a second `finished` for a request is seen wherever it comes from.
//!
//! Then, unless `--preempt-samples 0`, preemption by band: a worker with `worker.preempt`,
//! whose slots a flood of `low` requests keeps full; the time to first token of `high`
//! requests beside the flood is compared with that on the idle worker.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;

use super::book::{Book, Followed, faulty, finished_result};
use super::latency::{Samples, Summary};
use super::local::{LocalFleet, LocalOptions};
use super::mock_stats::MockStats;
use super::report::{Table, targets_table};
use super::target::Target;
use super::target_check::TargetCheck;
use super::workload;
use crate::client::Client;
use crate::protocol::{EventBody, MoveReason, Priority, Reason, RequestState};
use crate::settings::Settings;

/// The slowest moves the report lists.
const MOVES_LISTED: usize = 3;
/// Words of each churn request's reply; with [`TOKEN_DELAY_MS`] a request streams ~3 s.
pub const REPLY_WORDS: usize = 150;
/// The mock's delay before each word.
pub const TOKEN_DELAY_MS: u64 = 20;
/// Words of a `high` request's reply in the preemption measurement: its first token is timed.
const HIGH_REPLY_WORDS: usize = 16;
/// After the last request ended, how long the event subscription stays open for a late
/// second `finished`.
const GRACE: Duration = Duration::from_secs(2);
/// The pause before a caller whose submit failed (no live worker of the pool answered, the
/// worker died before replying) submits again.
const SUBMIT_PAUSE: Duration = Duration::from_millis(100);
/// How many lost (or otherwise odd) request ids a report lists.
const IDS_LISTED: usize = 10;

#[derive(Debug, Clone)]
pub struct ChurnSpec {
    pub workers: u32,
    pub slots: u32,
    pub concurrency: usize,
    pub duration: Duration,
    pub kill_every: Duration,
    /// `worker.heartbeat_ms` and `worker.lost_after_ms` given to the workers; `None` leaves
    /// the configuration's.
    pub heartbeat_ms: Option<u64>,
    pub lost_after_ms: Option<u64>,
    /// `high` requests timed on the idle worker and beside the flood; 0 leaves preemption out.
    pub preempt_samples: u64,
    /// The longest a request may take, from its submit to its `finished`.
    pub settle: Duration,
}

/// What the churn phase measured.
#[derive(Debug, Clone, Serialize)]
pub struct ChurnReport {
    pub genfleet_version: &'static str,
    pub build: &'static str,
    pub cpus: usize,
    pub load_average_before: Option<f64>,
    pub workers: u32,
    pub slots: u32,
    pub concurrency: usize,
    pub reply_words: usize,
    pub token_delay_ms: u64,
    pub kill_every_secs: f64,
    pub heartbeat_ms: u64,
    pub lost_after_ms: u64,
    /// `configuration` (the defaults unless the configuration file says otherwise) or `flags`.
    pub heartbeat_from: &'static str,
    pub checkpoint_ms: u64,
    /// Workers killed (SIGKILL) during the run, each replaced by a new one.
    pub kills: u64,
    /// Submits sent (one per request id).
    pub requests: u64,
    /// Requests a worker accepted.
    pub accepted: u64,
    /// Submits that got no acceptance (every worker full, the worker died before replying).
    pub submit_errors: u64,
    pub submit_error_kinds: BTreeMap<String, u64>,
    /// Accepted requests that ended COMPLETED.
    pub completed: u64,
    /// ... FAILED worker_lost: their worker died before their first checkpoint.
    pub failed_worker_lost: u64,
    /// ... any other way (CANCELLED, FAILED for another reason).
    pub failed_other: u64,
    /// Accepted requests with neither a `finished` event nor a stored result after the run.
    pub lost: u64,
    /// Accepted requests whose `finished` event never came but whose result is stored.
    pub finished_event_missed: u64,
    /// The first few lost requests (with what a status lookup says of each after the run),
    /// and those whose `finished` event was missed, to look up.
    pub lost_ids: Vec<String>,
    pub lost_status: Vec<String>,
    pub finished_event_missed_ids: Vec<String>,
    /// The first few requests with a sequence fault or a text mismatch: the id, the `seq`
    /// numbers and event names in the order the callers saw them, and the moves its result
    /// lists.
    pub faulty: Vec<String>,
    /// Requests with a second `finished` event.
    pub finished_twice: u64,
    /// Requests whose events' `seq` did not run 0, 1, 2, ... as the callers saw them.
    pub requests_with_seq_faults: u64,
    pub missing_events: u64,
    /// Numbers seen again with other content (a follower keeps the first).
    pub repeated_events: u64,
    /// Events sent again as they were after a move, which a follower drops (not faults).
    pub resent_events: u64,
    /// COMPLETED requests whose deltas, joined, differ from their result's output.
    pub delta_mismatches: u64,
    /// Results that list a move for a lost worker (their worker was killed mid-stream).
    pub interrupted: u64,
    /// Such moves whose `resumed` event the caller never saw.
    pub resumed_unseen: u64,
    /// From a kill to the caller's `resumed` event, for every move off a killed worker.
    pub kill_to_resumed_ms: Option<Summary>,
    /// The slowest moves off a killed worker: the request, the two workers, and when after the
    /// kill the taker wrote the move and the caller saw its `resumed` event.
    pub slowest_moves: Vec<String>,
    /// Characters of the results' output, and of content the mock streamed over the run.
    pub output_chars: u64,
    pub generated_chars: u64,
    /// Requests that continued a final assistant message at the mock.
    pub continuations: u64,
    /// (generated − output) / output, in percent: text generated again (or for requests that
    /// failed) as a share of the text relayed.
    pub regenerated_pct: Option<f64>,
    pub load_secs: f64,
    /// COMPLETED requests per second.
    pub requests_per_sec: f64,
    pub preemption: Option<PreemptionReport>,
    pub targets: Vec<TargetCheck>,
    pub notes: Vec<String>,
}

/// Time to first token of `high` requests on a worker with `worker.preempt`.
#[derive(Debug, Clone, Serialize)]
pub struct PreemptionReport {
    pub slots: u32,
    pub samples: u64,
    pub idle_first_token_ms: Option<Summary>,
    /// Beside `low` requests holding every slot of the only worker.
    pub flooded_first_token_ms: Option<Summary>,
    /// Flooded p50 / idle p50; the target is at most 2.
    pub ratio_p50: Option<f64>,
    /// `low` requests that ended COMPLETED, and the preemptions their results list.
    pub low_completed: u64,
    pub low_preemptions: u64,
}

/// The run, beside the report's header fields.
pub struct RunInfo {
    pub load_average_before: Option<f64>,
    pub notes: Vec<String>,
}

/// What one caller did.
#[derive(Default)]
struct CallerTally {
    requests: u64,
    accepted: Vec<String>,
    submit_errors: BTreeMap<String, u64>,
}

pub async fn run(
    settings: &Settings,
    options: LocalOptions,
    spec: &ChurnSpec,
    info: RunInfo,
) -> anyhow::Result<ChurnReport> {
    let heartbeat_ms = spec.heartbeat_ms.unwrap_or(settings.worker.heartbeat_ms);
    let lost_after_ms = spec.lost_after_ms.unwrap_or(settings.worker.lost_after_ms);
    let mut worker_env = Vec::new();
    if spec.heartbeat_ms.is_some() || spec.lost_after_ms.is_some() {
        worker_env.push((
            "GENFLEET__WORKER__HEARTBEAT_MS".to_string(),
            heartbeat_ms.to_string(),
        ));
        worker_env.push((
            "GENFLEET__WORKER__LOST_AFTER_MS".to_string(),
            lost_after_ms.to_string(),
        ));
    }
    eprintln!(
        "churn: {} workers × {} slots, heartbeat {heartbeat_ms} ms, lost after {lost_after_ms} ms, \
         checkpoint every {} ms",
        spec.workers, spec.slots, settings.generation.checkpoint_ms
    );
    let mut fleet = LocalFleet::start(LocalOptions {
        workers: spec.workers,
        slots: spec.slots,
        token_delay_ms: TOKEN_DELAY_MS,
        worker_env: worker_env.clone(),
        ..options.clone()
    })
    .await?;
    let mut settings = settings.clone();
    settings.nats.url = fleet.nats_url.clone();
    let target = Target::connect(
        settings.clone(),
        options.pool.clone(),
        spec.concurrency + 1,
        spec.settle,
    )
    .await?;
    let mock = MockStats::new(&fleet.backend_url);
    mock.reset().await?;

    let (book, collector) = Book::collect(target.connection(0), &target.subjects).await?;

    eprintln!(
        "churn: {} callers for {:?}, a worker killed every {:?}",
        spec.concurrency, spec.duration, spec.kill_every
    );
    let started = Instant::now();
    let until = started + spec.duration;
    let callers: Vec<_> = (0..spec.concurrency)
        .map(|c| {
            let client = Client::new(target.connection(c + 1).clone(), target.subjects.clone());
            let ids = (target.run_id.clone(), c);
            let pool = target.pool.clone();
            let book = book.clone();
            let settle = spec.settle;
            tokio::spawn(caller(client, ids, pool, book, until, settle))
        })
        .collect();

    // The churn: the oldest worker killed, a new one started, until the load ends.
    let mut kills: HashMap<String, Instant> = HashMap::new();
    let mut next_kill = started + spec.kill_every;
    let mut replacement = spec.workers;
    while next_kill < until {
        tokio::time::sleep_until(next_kill.into()).await;
        if fleet.workers.is_empty() {
            break;
        }
        let victim = fleet.workers.remove(0);
        let victim_id = victim.worker_id.clone();
        kills.insert(victim_id.clone(), Instant::now());
        victim.kill().await;
        replacement += 1;
        let worker_id = format!("churn-worker-{replacement}");
        eprintln!("churn: killed {victim_id}, starting {worker_id}");
        let worker = fleet
            .start_worker(&worker_id, &options.pool, spec.slots)
            .await?;
        fleet.workers.push(worker);
        next_kill += spec.kill_every;
    }

    let mut tally = CallerTally::default();
    for caller in callers {
        let done = caller.await?;
        tally.requests += done.requests;
        tally.accepted.extend(done.accepted);
        for (kind, n) in done.submit_errors {
            *tally.submit_errors.entry(kind).or_default() += n;
        }
    }
    let load_secs = started.elapsed().as_secs_f64();
    // Late duplicates (a second `finished`) have the grace period to show.
    tokio::time::sleep(GRACE).await;
    drop(collector);
    let generated = mock.read().await?;

    let lookup = Client::new(target.connection(0).clone(), target.subjects.clone());
    let mut report = ChurnReport {
        genfleet_version: env!("CARGO_PKG_VERSION"),
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        load_average_before: info.load_average_before,
        workers: spec.workers,
        slots: spec.slots,
        concurrency: spec.concurrency,
        reply_words: REPLY_WORDS,
        token_delay_ms: TOKEN_DELAY_MS,
        kill_every_secs: spec.kill_every.as_secs_f64(),
        heartbeat_ms,
        lost_after_ms,
        heartbeat_from: if worker_env.is_empty() {
            "configuration"
        } else {
            "flags"
        },
        checkpoint_ms: settings.generation.checkpoint_ms,
        kills: kills.len() as u64,
        requests: tally.requests,
        accepted: tally.accepted.len() as u64,
        submit_errors: tally.submit_errors.values().sum(),
        submit_error_kinds: tally.submit_errors,
        completed: 0,
        failed_worker_lost: 0,
        failed_other: 0,
        lost: 0,
        finished_event_missed: 0,
        lost_ids: Vec::new(),
        lost_status: Vec::new(),
        finished_event_missed_ids: Vec::new(),
        faulty: Vec::new(),
        finished_twice: 0,
        requests_with_seq_faults: 0,
        missing_events: 0,
        repeated_events: 0,
        resent_events: 0,
        delta_mismatches: 0,
        interrupted: 0,
        resumed_unseen: 0,
        kill_to_resumed_ms: None,
        slowest_moves: Vec::new(),
        output_chars: 0,
        generated_chars: generated.content_chars,
        continuations: generated.continuations,
        regenerated_pct: None,
        load_secs,
        requests_per_sec: 0.0,
        preemption: None,
        targets: Vec::new(),
        notes: info.notes,
    };
    let mut kill_to_resumed = Samples::default();
    let mut slowest: Vec<(Duration, String)> = Vec::new();
    for id in &tally.accepted {
        let seen = book.take(id);
        let result = match finished_result(&seen) {
            Some(result) => Some(result),
            None => match lookup.result(id, false).await {
                Ok(result) => {
                    report.finished_event_missed += 1;
                    if report.finished_event_missed_ids.len() < IDS_LISTED {
                        report.finished_event_missed_ids.push(id.clone());
                    }
                    Some(result)
                }
                Err(_) => None,
            },
        };
        if seen.finished > 1 {
            report.finished_twice += 1;
        }
        let followed = Followed::of(&seen.events);
        let (missing, repeated) = (followed.missing, followed.conflicting);
        if missing + repeated > 0 {
            report.requests_with_seq_faults += 1;
        }
        report.missing_events += missing;
        report.repeated_events += repeated;
        report.resent_events += followed.resent;
        let Some(result) = result else {
            report.lost += 1;
            if report.lost_ids.len() < IDS_LISTED {
                report.lost_ids.push(id.clone());
            }
            continue;
        };
        report.output_chars += result.output.chars().count() as u64;
        let mismatch =
            result.state == RequestState::Completed && followed.deltas() != result.output;
        if (mismatch || missing + repeated > 0) && report.faulty.len() < IDS_LISTED {
            report.faulty.push(faulty(id, &seen.events, &result));
        }
        match (result.state, result.reason) {
            (RequestState::Completed, _) => {
                report.completed += 1;
                report.delta_mismatches += u64::from(mismatch);
            }
            (RequestState::Failed, Reason::WorkerLost) => report.failed_worker_lost += 1,
            _ => report.failed_other += 1,
        }
        let mut interrupted = false;
        for moved in result
            .resumed
            .iter()
            .filter(|m| m.reason == MoveReason::WorkerLost)
        {
            interrupted = true;
            let seen_at = seen
                .events
                .iter()
                .find_map(|(event, at)| match &event.body {
                    EventBody::Resumed {
                        from_worker,
                        reason: MoveReason::WorkerLost,
                        ..
                    } if *from_worker == moved.from_worker => Some(*at),
                    _ => None,
                });
            match (kills.get(&moved.from_worker), seen_at) {
                (Some(killed), Some(seen_at)) => {
                    let took = seen_at.saturating_duration_since(*killed);
                    kill_to_resumed.push(took);
                    // When the taker wrote the move (its clock, this machine's): the part of
                    // the wait that was finding the worker gone, and the part that was starting
                    // the request where it went.
                    let taken_up = humantime::parse_rfc3339_weak(&moved.at)
                        .ok()
                        .and_then(|at| std::time::SystemTime::now().duration_since(at).ok())
                        .and_then(|ago| Instant::now().checked_sub(ago))
                        .map(|at| at.saturating_duration_since(*killed));
                    slowest.push((
                        took,
                        format!(
                            "{}: {} → {}: kill → taken up {}, → resumed event {:.0} ms",
                            result.request_id,
                            moved.from_worker,
                            moved.to_worker,
                            taken_up.map_or("-".into(), |t| format!(
                                "{:.0} ms",
                                t.as_secs_f64() * 1000.0
                            )),
                            took.as_secs_f64() * 1000.0
                        ),
                    ));
                }
                _ => report.resumed_unseen += 1,
            }
        }
        report.interrupted += u64::from(interrupted);
    }
    for id in &report.lost_ids {
        report.lost_status.push(match lookup.status(id).await {
            Ok(status) => serde_json::to_string(&status).unwrap_or_default(),
            Err(error) => error.to_string(),
        });
    }
    report.kill_to_resumed_ms = kill_to_resumed.summary();
    slowest.sort_by_key(|(took, _)| std::cmp::Reverse(*took));
    report.slowest_moves = slowest
        .into_iter()
        .take(MOVES_LISTED)
        .map(|(_, told)| told)
        .collect();
    report.regenerated_pct = (report.output_chars > 0).then(|| {
        (report.generated_chars as f64 - report.output_chars as f64) / report.output_chars as f64
            * 100.0
    });
    report.requests_per_sec = report.completed as f64 / load_secs;
    target.close().await;
    drop(fleet);

    if spec.preempt_samples > 0 {
        report.preemption = Some(preemption(&settings, options, spec).await?);
    }
    report.targets = targets(&report);
    Ok(report)
}

/// One caller: request after request until `until`, each followed to its `finished` (at most
/// `settle`).
async fn caller(
    client: Client,
    (run_id, c): (String, usize),
    pool: String,
    book: Book,
    until: Instant,
    settle: Duration,
) -> CallerTally {
    let mut tally = CallerTally::default();
    let mut n = 0u64;
    while Instant::now() < until {
        let id = format!("{run_id}-churn-{c}-{n}");
        n += 1;
        let finished = book.expect(&id);
        tally.requests += 1;
        match client
            .submit(&pool, &workload::request(id.clone(), REPLY_WORDS))
            .await
        {
            Ok(_) => {
                book.wait_for_end(&client, &id, finished, settle).await;
                tally.accepted.push(id);
            }
            Err(error) => {
                let kind = error
                    .code()
                    .map_or_else(|| "transport".to_string(), |code| format!("{code:?}"));
                *tally.submit_errors.entry(kind).or_default() += 1;
                tokio::time::sleep(SUBMIT_PAUSE).await;
            }
        }
    }
    tally
}

/// Preemption by band on one worker with `worker.preempt`: `high` requests on it idle, then
/// beside `low` callers (two more than its slots) that keep every slot full.
async fn preemption(
    settings: &Settings,
    options: LocalOptions,
    spec: &ChurnSpec,
) -> anyhow::Result<PreemptionReport> {
    eprintln!(
        "preemption: one worker × {} slots with worker.preempt",
        spec.slots
    );
    let pool = options.pool.clone();
    let mut worker_env = options.worker_env.clone();
    worker_env.push(("GENFLEET__WORKER__PREEMPT".into(), "true".into()));
    let fleet = LocalFleet::start(LocalOptions {
        workers: 1,
        slots: spec.slots,
        token_delay_ms: TOKEN_DELAY_MS,
        worker_env,
        ..options
    })
    .await?;
    let mut settings = settings.clone();
    settings.nats.url = fleet.nats_url.clone();
    let flood = spec.slots as usize + 2;
    let target = Target::connect(settings, pool, flood + 1, spec.settle).await?;
    let high = Client::new(target.connection(0).clone(), target.subjects.clone());

    let idle = first_tokens(&high, &target, "high-idle", spec.preempt_samples).await;

    let running = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let lows: Vec<_> = (0..flood)
        .map(|c| {
            let client = Client::new(target.connection(c + 1).clone(), target.subjects.clone());
            let prefix = format!("{}-low-{c}", target.run_id);
            let pool = target.pool.clone();
            let (running, stop, settle) = (running.clone(), stop.clone(), spec.settle);
            tokio::spawn(low_caller(client, prefix, pool, running, stop, settle))
        })
        .collect();
    // The flood holds every slot before the first `high` request comes.
    let saturated = Instant::now();
    while running.load(Ordering::Relaxed) < u64::from(spec.slots)
        && saturated.elapsed() < spec.settle
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let flooded = first_tokens(&high, &target, "high-flooded", spec.preempt_samples).await;
    stop.store(true, Ordering::Relaxed);
    let (mut low_completed, mut low_preemptions) = (0, 0);
    for low in lows {
        let (completed, preemptions) = low.await?;
        low_completed += completed;
        low_preemptions += preemptions;
    }
    target.close().await;
    drop(fleet);
    let (idle, flooded) = (idle.summary(), flooded.summary());
    Ok(PreemptionReport {
        slots: spec.slots,
        samples: spec.preempt_samples,
        ratio_p50: match (idle, flooded) {
            (Some(idle), Some(flooded)) if idle.p50 > 0.0 => Some(flooded.p50 / idle.p50),
            _ => None,
        },
        idle_first_token_ms: idle,
        flooded_first_token_ms: flooded,
        low_completed,
        low_preemptions,
    })
}

/// `samples` `high` requests one after another: from each submit to its first delta.
async fn first_tokens(client: &Client, target: &Target, label: &str, samples: u64) -> Samples {
    let mut first_tokens = Samples::default();
    for n in 0..samples {
        let id = target.request_id(label, n);
        let mut request = workload::request(id.clone(), HIGH_REPLY_WORDS);
        request.priority = Some(Priority::High);
        let Ok(events) = client.follow(&id).await else {
            continue;
        };
        let mut events = Box::pin(events);
        let sent = Instant::now();
        if client.submit(&target.pool, &request).await.is_err() {
            continue;
        }
        let first = tokio::time::timeout(target.timeout, async {
            let mut first = None;
            while let Some(event) = events.next().await {
                match event.body {
                    EventBody::Delta { .. } if first.is_none() => first = Some(sent.elapsed()),
                    EventBody::Finished { .. } => break,
                    _ => {}
                }
            }
            first
        })
        .await;
        if let Ok(Some(first)) = first {
            first_tokens.push(first);
        }
    }
    first_tokens
}

/// A `low` caller of the flood: long requests one after another until `stop`; counts the
/// requests running (from `started` to `finished`). Returns the requests completed and the
/// preemptions their results list.
async fn low_caller(
    client: Client,
    prefix: String,
    pool: String,
    running: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    settle: Duration,
) -> (u64, u64) {
    let (mut completed, mut preemptions) = (0, 0);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let id = format!("{prefix}-{n}");
        n += 1;
        let mut request = workload::request(id.clone(), REPLY_WORDS);
        request.priority = Some(Priority::Low);
        let Ok(events) = client.follow(&id).await else {
            break;
        };
        let mut events = Box::pin(events);
        if client.submit(&pool, &request).await.is_err() {
            tokio::time::sleep(SUBMIT_PAUSE).await;
            continue;
        }
        let mut counted = false;
        let result = tokio::time::timeout(settle, async {
            while let Some(event) = events.next().await {
                match event.body {
                    EventBody::Started { .. } if !counted => {
                        counted = true;
                        running.fetch_add(1, Ordering::Relaxed);
                    }
                    EventBody::Finished { result } => return Some(result),
                    _ => {}
                }
            }
            None
        })
        .await;
        if counted {
            running.fetch_sub(1, Ordering::Relaxed);
        }
        if let Ok(Some(result)) = result {
            completed += u64::from(result.state == RequestState::Completed);
            preemptions += result
                .resumed
                .iter()
                .filter(|m| m.reason == MoveReason::Preempted)
                .count() as u64;
        }
    }
    (completed, preemptions)
}

/// The churn targets (docs/benchmarks.md, "Churn").
pub fn targets(r: &ChurnReport) -> Vec<TargetCheck> {
    let count = |n: u64| Some(n as f64);
    let p99 = r.kill_to_resumed_ms.map(|s| s.p99);
    let ratio = r.preemption.as_ref().and_then(|p| p.ratio_p50);
    let killed = Some(r.kills > 0);
    let mut checks = vec![
        TargetCheck {
            name: "requests lost",
            target: "0 (accepted, and no terminal result after the run)",
            value: count(r.lost),
            unit: "",
            met: Some(r.lost == 0),
            conditions_met: killed,
        },
        TargetCheck {
            name: "requests finished twice",
            target: "0",
            value: count(r.finished_twice),
            unit: "",
            met: Some(r.finished_twice == 0),
            conditions_met: killed,
        },
        TargetCheck {
            name: "event sequence gaps or repeats",
            target: "0 requests",
            value: count(r.requests_with_seq_faults),
            unit: "",
            met: Some(r.requests_with_seq_faults == 0),
            conditions_met: killed,
        },
        TargetCheck {
            name: "ended without a finished event",
            target: "0 requests (the caller's stream ends with the request)",
            value: count(r.finished_event_missed),
            unit: "",
            met: Some(r.finished_event_missed == 0),
            conditions_met: killed,
        },
        TargetCheck {
            name: "streamed text differs from the output",
            target: "0 requests",
            value: count(r.delta_mismatches),
            unit: "",
            met: Some(r.delta_mismatches == 0),
            conditions_met: killed,
        },
        TargetCheck {
            name: "text generated again",
            target: "<= 5% of the text relayed",
            value: r.regenerated_pct,
            unit: "%",
            met: r.regenerated_pct.map(|pct| pct <= 5.0),
            conditions_met: killed,
        },
        TargetCheck {
            name: "kill to the caller's resumed event p99",
            target: "<= 3 s",
            value: p99,
            unit: "ms",
            met: p99.map(|ms| ms <= 3000.0),
            conditions_met: Some(r.interrupted > 0),
        },
    ];
    if let Some(p) = &r.preemption {
        checks.push(TargetCheck {
            name: "high first token beside a low flood",
            target: "<= 2x its time on an idle worker (p50)",
            value: ratio,
            unit: "x",
            met: ratio.map(|x| x <= 2.0),
            conditions_met: Some(p.flooded_first_token_ms.is_some()),
        });
    }
    checks
}

/// The report as lines for people.
pub fn table(r: &ChurnReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "genfleet bench {} ({} build), {} CPUs, load average before: {}",
        r.genfleet_version,
        r.build,
        r.cpus,
        r.load_average_before
            .map_or("-".into(), |l| format!("{l:.2}"))
    );
    let _ = writeln!(
        out,
        "churn: {} workers × {} slots, {} callers for {:.1} s, replies of {} words at {} ms; \
         a worker killed every {:.1} s ({} kills); heartbeat {} ms, lost after {} ms ({}), \
         checkpoint every {} ms\n",
        r.workers,
        r.slots,
        r.concurrency,
        r.load_secs,
        r.reply_words,
        r.token_delay_ms,
        r.kill_every_secs,
        r.kills,
        r.heartbeat_ms,
        r.lost_after_ms,
        r.heartbeat_from,
        r.checkpoint_ms
    );
    let ms = |s: Option<Summary>, f: fn(Summary) -> f64| {
        s.map_or("-".into(), |s| format!("{:.0}", f(s)))
    };
    let mut rows = Table::new(&["figure", "value"]);
    for (name, value) in [
        ("requests submitted", r.requests.to_string()),
        ("accepted", r.accepted.to_string()),
        ("submits without acceptance", r.submit_errors.to_string()),
        ("completed", r.completed.to_string()),
        ("completed / s", format!("{:.2}", r.requests_per_sec)),
        (
            "failed worker_lost (no checkpoint yet)",
            r.failed_worker_lost.to_string(),
        ),
        ("failed otherwise", r.failed_other.to_string()),
        ("lost", r.lost.to_string()),
        (
            "finished event missed, result stored",
            r.finished_event_missed.to_string(),
        ),
        ("finished twice", r.finished_twice.to_string()),
        (
            "requests with seq gaps or repeats",
            r.requests_with_seq_faults.to_string(),
        ),
        (
            "events sent again after a move (dropped by followers)",
            r.resent_events.to_string(),
        ),
        ("delta mismatches", r.delta_mismatches.to_string()),
        ("interrupted by a kill, resumed", r.interrupted.to_string()),
        ("resumed event not seen", r.resumed_unseen.to_string()),
        ("kill → resumed p50 ms", ms(r.kill_to_resumed_ms, |s| s.p50)),
        ("kill → resumed p99 ms", ms(r.kill_to_resumed_ms, |s| s.p99)),
        ("kill → resumed max ms", ms(r.kill_to_resumed_ms, |s| s.max)),
        ("output chars", r.output_chars.to_string()),
        ("chars the mock generated", r.generated_chars.to_string()),
        ("continuations", r.continuations.to_string()),
        (
            "generated again",
            r.regenerated_pct.map_or("-".into(), |p| format!("{p:.2}%")),
        ),
    ] {
        rows.row(vec![name.to_string(), value]);
    }
    out.push_str(&rows.render());
    if !r.slowest_moves.is_empty() {
        let _ = writeln!(out, "\nslowest moves off a killed worker:");
        for told in &r.slowest_moves {
            let _ = writeln!(out, "  {told}");
        }
    }
    if let Some(p) = &r.preemption {
        let _ = writeln!(
            out,
            "\npreemption: one worker × {} slots with worker.preempt, {} high requests each way; \
             first token p50 idle {} ms, beside a low flood {} ms, ratio {}; \
             {} low requests completed, {} preemptions",
            p.slots,
            p.samples,
            ms(p.idle_first_token_ms, |s| s.p50),
            ms(p.flooded_first_token_ms, |s| s.p50),
            p.ratio_p50.map_or("-".into(), |x| format!("{x:.2}")),
            p.low_completed,
            p.low_preemptions
        );
    }
    let _ = writeln!(out, "\n{}", targets_table(&r.targets));
    for note in &r.notes {
        let _ = writeln!(out, "note: {note}");
    }
    out
}
