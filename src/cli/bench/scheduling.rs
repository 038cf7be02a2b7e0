//! Scheduling (`--local` only): what affinity is worth to a backend with a prefix cache, as
//! the fleet's users meet it.
//!
//! Workers of a pool of their own, each on a mock backend of its own with a prefix cache (a
//! conversation that goes on from one the backend served answers its first token after
//! `prefix_hit_ms`, any other after `prefill_ms_per_kb` per KiB of conversation), serve the
//! same multi-turn conversations in four passes:
//! - **affinity**: an affinity key per conversation, every turn sent by one long-lived client
//!   that follows the workers' heartbeats and sends each turn straight to its key's worker;
//! - **no affinity**: the same conversations without keys;
//! - **forgetful clients**: keyed, each turn sent by a new client (connect, submit, follow to
//!   the result, drop) that follows nothing, as a one-shot command would: it sends to the pool,
//!   and the pool's worker that receives the submit places it;
//! - **two gateways**: keyed through two `genfleet gateway` processes, turn n of a
//!   conversation to gateway n % 2, as OpenAI chat completions whose `user` is the key; where
//!   each turn ran and its time to first token are read from the `finished` events.
//!
//! Each turn resends the conversation so far with one more question, as a chat client or an
//! agent's tool loop does. Reported for each pass: time to first token (as the worker measured
//! it, from the start of the generation), the backends' prefix hit rate, and the later turns
//! that ran on their key's worker. Beside the passes, [`super::hop`] measures what the hop of a
//! pool submit to its key's worker costs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::json;
use tokio::sync::Notify;

use super::hop::{self, HopReport, HopSpec};
use super::latency::{Samples, Summary};
use super::local::{LocalFleet, LocalGateway, LocalWorker};
use super::target_check::TargetCheck;
use crate::client::Client;
use crate::llm::mock::{MockServer, PrefixCacheSettings, PrefixCacheStats, Script};
use crate::protocol::{Event, EventBody, GenerationRequest, GenerationResult, Message, Reason};
use crate::settings::{PlacementSettings, Settings};

/// The pool of the phase's own workers.
const POOL: &str = "bench-scheduling";

#[derive(Debug, Clone, Serialize)]
pub struct SchedulingSpec {
    pub workers: u32,
    pub slots: u32,
    /// Conversations, each of `turns` requests.
    pub chains: usize,
    pub turns: usize,
    /// Conversations running at once.
    pub concurrency: usize,
    /// Bytes of each turn's question (the mock echoes it as the answer).
    pub turn_bytes: usize,
    pub prefix_hit_ms: u64,
    pub prefill_ms_per_kb: u64,
    /// The forwarding hop's measurement (`None`: not measured).
    pub hop: Option<HopSpec>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SchedulingReport {
    pub spec: SchedulingSpec,
    /// Keyed, one long-lived client that follows the heartbeats.
    pub with_affinity: SchedulingRun,
    pub without_affinity: SchedulingRun,
    /// Time to first token p50 without affinity ÷ with it.
    pub first_token_p50_ratio: Option<f64>,
    /// Keyed, a new client per turn that follows nothing: the pool's worker places each turn.
    /// `None`: the pass did not run.
    pub forgetful_clients: Option<SchedulingRun>,
    /// Keyed through two gateway processes, turn n to gateway n % 2. `None`: the pass did not
    /// run.
    pub two_gateways: Option<SchedulingRun>,
    /// What a keyed pool submit forwarded to its key's worker costs against one sent there
    /// directly. `None`: not measured.
    pub forwarding_hop: Option<HopReport>,
}

/// One pass over the conversations.
#[derive(Debug, Clone, Serialize)]
pub struct SchedulingRun {
    /// `affinity`, `no_affinity`, `forgetful_clients` or `two_gateways`.
    pub pass: &'static str,
    /// Who sent the turns, and how.
    pub sender: &'static str,
    pub affinity: bool,
    pub requests: u64,
    pub completed: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub seconds: f64,
    /// From the start of each generation to its first token, every turn.
    pub first_token_ms: Option<Summary>,
    /// The same, turns after the first only (the first can find no prefix anywhere).
    pub later_first_token_ms: Option<Summary>,
    /// Time to first token p50 of the pass without affinity ÷ this pass's.
    pub first_token_p50_vs_no_affinity: Option<f64>,
    /// The backends' prefix-cache hits and misses over the pass.
    pub prefix_hits: u64,
    pub prefix_misses: u64,
    /// Hits among all requests.
    pub hit_rate: f64,
    /// Hits among the turns after the first (the only ones that can hit).
    pub later_turn_hit_rate: f64,
    /// Later turns that ran on their key's worker as their placer saw it (the result's
    /// `affinity.held`).
    pub held: u64,
    /// `held` among the later turns.
    pub held_rate: f64,
    /// Later turns that ran on the worker of the turn before (with or without a key).
    pub same_worker: u64,
    /// Later turns whose key's worker had no free slot: they ran on another (`fallback: busy`).
    pub fell_back_busy: u64,
    /// Later turns whose key's worker was over the load bound (`fallback: load`).
    pub fell_back_load: u64,
}

/// The passes, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Affinity,
    NoAffinity,
    Forgetful,
    Gateways,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Affinity => "affinity",
            Pass::NoAffinity => "no_affinity",
            Pass::Forgetful => "forgetful_clients",
            Pass::Gateways => "two_gateways",
        }
    }

    fn sender(self) -> &'static str {
        match self {
            Pass::Affinity => {
                "one long-lived client following the heartbeats: each turn straight to its key's worker"
            }
            Pass::NoAffinity => "one long-lived client, no affinity keys",
            Pass::Forgetful => {
                "a new client per turn, following nothing: each turn to the pool, placed by the worker that receives it"
            }
            Pass::Gateways => {
                "two genfleet gateway processes, turn n to gateway n % 2, OpenAI chat completions with user = the key"
            }
        }
    }

    fn keyed(self) -> bool {
        self != Pass::NoAffinity
    }
}

pub async fn run(
    fleet: &LocalFleet,
    settings: &Settings,
    spec: &SchedulingSpec,
    timeout: Duration,
) -> anyhow::Result<SchedulingReport> {
    let cache = PrefixCacheSettings {
        entries: 4096,
        prefix_hit_ms: spec.prefix_hit_ms,
        prefill_ms_per_kb: spec.prefill_ms_per_kb,
    };
    let mut mocks = Vec::new();
    let mut workers: Vec<LocalWorker> = Vec::new();
    for n in 1..=spec.workers {
        let mock = MockServer::start(Script::echo().with_prefix_cache(cache))
            .await
            .context("cannot start a mock backend with a prefix cache")?;
        let worker = fleet
            .start_worker_at(
                &format!("bench-scheduling-worker-{n}"),
                POOL,
                spec.slots,
                &mock.base_url(),
            )
            .await?;
        mocks.push(mock);
        workers.push(worker);
    }
    let passes = async {
        let mut runs = Vec::new();
        for kind in [Pass::Affinity, Pass::NoAffinity, Pass::Forgetful] {
            runs.push(pass(settings, spec, &mocks, kind, None, timeout).await?);
        }
        eprintln!("scheduling: starting two genfleet gateway processes");
        let gateways = [
            fleet.start_gateway_named(POOL, "gateway-1").await?,
            fleet.start_gateway_named(POOL, "gateway-2").await?,
        ];
        runs.push(
            pass(
                settings,
                spec,
                &mocks,
                Pass::Gateways,
                Some(&gateways),
                timeout,
            )
            .await?,
        );
        anyhow::Ok(runs)
    }
    .await;
    for worker in workers {
        worker.stop().await;
    }
    let mut runs = passes?.into_iter();
    let (Some(mut with_affinity), Some(without_affinity), forgetful_clients, two_gateways) =
        (runs.next(), runs.next(), runs.next(), runs.next())
    else {
        anyhow::bail!("the scheduling passes ran");
    };
    let forwarding_hop = match &spec.hop {
        Some(hop_spec) => Some(hop::run(fleet, settings, hop_spec, timeout).await?),
        None => None,
    };
    let p50 = |run: &SchedulingRun| run.first_token_ms.map(|s| s.p50);
    let against_off = |run: &SchedulingRun| match (p50(&without_affinity), p50(run)) {
        (Some(without), Some(with)) if with > 0.0 => Some(without / with),
        _ => None,
    };
    let first_token_p50_ratio = against_off(&with_affinity);
    with_affinity.first_token_p50_vs_no_affinity = first_token_p50_ratio;
    let keyed = |run: Option<SchedulingRun>| {
        run.map(|mut run| {
            run.first_token_p50_vs_no_affinity = against_off(&run);
            run
        })
    };
    Ok(SchedulingReport {
        spec: spec.clone(),
        forgetful_clients: keyed(forgetful_clients),
        two_gateways: keyed(two_gateways),
        with_affinity,
        without_affinity,
        first_token_p50_ratio,
        forwarding_hop,
    })
}

/// How a pass sends a conversation's turns.
#[derive(Clone)]
enum Sender {
    /// One client shared by every conversation of the pass.
    Client(Box<Client>),
    /// A new client for each turn, connected with these settings.
    Forgetful(Arc<Settings>),
    /// Through the gateways, turn n to gateway n % 2.
    Gateways(Arc<Gateways>),
}

/// The gateways of a pass, the HTTP client that calls them, and the `finished` events that
/// say where each of their requests ran.
struct Gateways {
    http: reqwest::Client,
    /// Their OpenAI base URLs.
    urls: Vec<String>,
    finished: Arc<FinishedResults>,
}

/// The results of the pass's `finished` events, by request id, until a turn takes its own.
#[derive(Default)]
struct FinishedResults {
    results: Mutex<HashMap<String, GenerationResult>>,
    arrived: Notify,
}

impl FinishedResults {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, GenerationResult>> {
        self.results.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, result: GenerationResult) {
        self.lock().insert(result.request_id.clone(), result);
        self.arrived.notify_waiters();
    }

    /// The result of `request_id`, once its event came (within `wait`).
    async fn take(&self, request_id: &str, wait: Duration) -> Option<GenerationResult> {
        tokio::time::timeout(wait, async {
            loop {
                let arrived = self.arrived.notified();
                tokio::pin!(arrived);
                // Registered before looking, so an event that comes in between is not missed.
                arrived.as_mut().enable();
                if let Some(result) = self.lock().remove(request_id) {
                    return result;
                }
                arrived.await;
            }
        })
        .await
        .ok()
    }
}

/// The conversations once, sent as `kind` says.
async fn pass(
    settings: &Settings,
    spec: &SchedulingSpec,
    mocks: &[MockServer],
    kind: Pass,
    gateways: Option<&[LocalGateway]>,
    timeout: Duration,
) -> anyhow::Result<SchedulingRun> {
    // A run id keeps this pass's conversations apart from the others' in the caches.
    let run_id = crate::protocol::ids::new_id();
    let mut listener = None;
    let sender = match kind {
        Pass::Affinity | Pass::NoAffinity => Sender::Client(Box::new(
            Client::connect(settings)
                .await
                .context("cannot connect to NATS")?,
        )),
        Pass::Forgetful => {
            let mut forgetful = settings.clone();
            forgetful.placement = PlacementSettings {
                follow_heartbeats: false,
                ..settings.placement
            };
            Sender::Forgetful(Arc::new(forgetful))
        }
        Pass::Gateways => {
            let gateways = gateways.context("the gateways pass has its gateways")?;
            let finished = Arc::new(FinishedResults::default());
            listener = Some(listen_finished(settings, &run_id, finished.clone()).await?);
            Sender::Gateways(Arc::new(Gateways {
                http: reqwest::Client::builder()
                    .pool_max_idle_per_host(spec.concurrency.max(1))
                    .build()?,
                urls: gateways
                    .iter()
                    .map(|g| g.base_url.trim_end_matches('/').to_string())
                    .collect(),
                finished,
            }))
        }
    };
    let before = cache_totals(mocks);
    let bar = super::progress::Progress::counting(
        &format!("scheduling ({})", kind.name().replace('_', " ")),
        (spec.chains * spec.turns) as u64,
    );
    let started = Instant::now();
    let chains: Vec<Vec<Result<GenerationResult, String>>> =
        futures_util::stream::iter(0..spec.chains)
            .map(|chain| {
                let sender = sender.clone();
                let bar = bar.clone();
                let run_id = run_id.clone();
                async move {
                    let key = kind.keyed().then(|| format!("{run_id}-{chain}"));
                    conversation(&sender, spec, &run_id, chain, key, timeout, &bar).await
                }
            })
            .buffer_unordered(spec.concurrency.max(1))
            .collect()
            .await;
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let after = cache_totals(mocks);
    if let Some((connection, task)) = listener {
        task.abort();
        drop(connection);
    }
    if let Sender::Client(client) = &sender {
        client.nats().flush().await.ok();
    }

    let mut first_token = Samples::default();
    let mut later_first_token = Samples::default();
    let (mut completed, mut errors, mut held, mut busy, mut load, mut same_worker) =
        (0, 0, 0, 0, 0, 0);
    let mut first_error = None;
    for turns in &chains {
        let mut worker_before: Option<&str> = None;
        for (turn, outcome) in turns.iter().enumerate() {
            let result = match outcome {
                Ok(result) => result,
                Err(error) => {
                    errors += 1;
                    first_error.get_or_insert_with(|| error.clone());
                    worker_before = None;
                    continue;
                }
            };
            completed += 1;
            if let Some(ms) = result.timings_ms.first_token {
                first_token.push(Duration::from_millis(ms));
                if turn > 0 {
                    later_first_token.push(Duration::from_millis(ms));
                }
            }
            if turn > 0 {
                same_worker += u64::from(worker_before == Some(result.worker_id.as_str()));
                if let Some(record) = &result.affinity {
                    held += u64::from(record.held);
                    busy += u64::from(record.fallback.as_deref() == Some("busy"));
                    load += u64::from(record.fallback.as_deref() == Some("load"));
                }
            }
            worker_before = Some(result.worker_id.as_str());
        }
    }
    let requests = (spec.chains * spec.turns) as u64;
    let later = (spec.chains * spec.turns.saturating_sub(1)) as u64;
    let hits = after.hits.saturating_sub(before.hits);
    let misses = after.misses.saturating_sub(before.misses);
    let rate = |n: u64, of: u64| if of == 0 { 0.0 } else { n as f64 / of as f64 };
    Ok(SchedulingRun {
        pass: kind.name(),
        sender: kind.sender(),
        affinity: kind.keyed(),
        requests,
        completed,
        errors,
        first_error,
        seconds,
        first_token_ms: first_token.summary(),
        later_first_token_ms: later_first_token.summary(),
        first_token_p50_vs_no_affinity: None,
        prefix_hits: hits,
        prefix_misses: misses,
        hit_rate: rate(hits, hits + misses),
        // A first turn's conversation is new to every backend: every hit is a later turn's.
        later_turn_hit_rate: rate(hits, later),
        held,
        held_rate: rate(held, later),
        same_worker,
        fell_back_busy: busy,
        fell_back_load: load,
    })
}

/// Listens, on a connection of its own, to every request's events and keeps the results of
/// the `finished` events of this pass's conversations (their keys start with `run_id`).
async fn listen_finished(
    settings: &Settings,
    run_id: &str,
    finished: Arc<FinishedResults>,
) -> anyhow::Result<(async_nats::Client, tokio::task::JoinHandle<()>)> {
    let connection = crate::client::connect::connect(
        &settings.nats,
        crate::client::connect::ConnectPurpose::Client,
    )
    .await
    .context("cannot connect to NATS")?;
    let subjects = crate::client::subjects::Subjects::new(&settings.subjects);
    let mut events = connection.subscribe(subjects.events("*")).await?;
    connection.flush().await?;
    let run_id = run_id.to_string();
    let task = tokio::spawn(async move {
        while let Some(message) = events.next().await {
            let Ok(event) = Event::from_json(&message.payload) else {
                continue;
            };
            let EventBody::Finished { result } = event.body else {
                continue;
            };
            if result
                .affinity
                .as_ref()
                .is_some_and(|a| a.key.starts_with(&run_id))
            {
                finished.put(*result);
            }
        }
    });
    Ok((connection, task))
}

/// The targets of docs/benchmarks.md that this phase measures.
pub fn targets(report: &SchedulingReport) -> Vec<TargetCheck> {
    let four_workers = Some(report.spec.workers == 4);
    let hit_rate = |name: &'static str, target: &'static str, run: Option<&SchedulingRun>| {
        let rate = run.map(|r| r.later_turn_hit_rate);
        TargetCheck {
            name,
            target,
            value: rate.map(|r| r * 100.0),
            unit: "%",
            met: rate.map(|r| r >= 0.9),
            conditions_met: four_workers,
        }
    };
    let ratio = report.first_token_p50_ratio;
    let mut checks = vec![
        hit_rate(
            "prefix hit rate with affinity",
            ">= 90% of later turns (prefix-cache mock, 4 workers)",
            Some(&report.with_affinity),
        ),
        hit_rate(
            "prefix hit rate, forgetful clients",
            ">= 90% of later turns, a new client per turn placed by the pool's worker (4 workers)",
            report.forgetful_clients.as_ref(),
        ),
        hit_rate(
            "prefix hit rate, two gateways",
            ">= 90% of later turns, turns alternating between two gateway processes (4 workers)",
            report.two_gateways.as_ref(),
        ),
        TargetCheck {
            name: "time to first token p50, affinity off ÷ on",
            target: ">= 2× (prefix-cache mock, 4 workers)",
            value: ratio,
            unit: "×",
            met: ratio.map(|r| r >= 2.0),
            conditions_met: four_workers,
        },
    ];
    if let (Some(spec), Some(hop)) = (&report.spec.hop, &report.forwarding_hop) {
        checks.push(hop::target(spec, hop));
    }
    checks
}

/// One conversation: each turn sends the turns before it, their answers and a new question.
/// It stops at its first failed turn (the rest count as failed too).
async fn conversation(
    sender: &Sender,
    spec: &SchedulingSpec,
    run_id: &str,
    chain: usize,
    key: Option<String>,
    timeout: Duration,
    bar: &indicatif::ProgressBar,
) -> Vec<Result<GenerationResult, String>> {
    let mut messages = Vec::new();
    let mut outcomes = Vec::new();
    for turn in 1..=spec.turns {
        messages.push(Message::user(question(
            run_id,
            chain,
            turn,
            spec.turn_bytes,
        )));
        let outcome = send_turn(sender, turn - 1, &messages, key.as_deref(), timeout).await;
        bar.inc(1);
        match outcome {
            Ok((result, answer)) => {
                messages.push(Message::assistant(answer));
                outcomes.push(Ok(result));
            }
            Err(error) => {
                outcomes.extend((turn..=spec.turns).map(|_| Err(error.clone())));
                break;
            }
        }
    }
    outcomes
}

/// One turn (`index` from 0) as the pass sends it: its result, and the answer the caller got.
async fn send_turn(
    sender: &Sender,
    index: usize,
    messages: &[Message],
    key: Option<&str>,
    timeout: Duration,
) -> Result<(GenerationResult, String), String> {
    let request = || GenerationRequest {
        messages: messages.to_vec(),
        affinity_key: key.map(str::to_string),
        ..GenerationRequest::default()
    };
    let result = match sender {
        Sender::Client(client) => client.run(POOL, request(), timeout).await,
        Sender::Forgetful(settings) => {
            // Connected for this turn alone, dropped (and disconnected) after it.
            let client = Client::connect(settings)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            client.run(POOL, request(), timeout).await
        }
        Sender::Gateways(gateways) => {
            return gateway_turn(gateways, index, messages, key, timeout).await;
        }
    };
    match result {
        Ok(result) if result.reason == Reason::Stop => {
            let answer = result.output.clone();
            Ok((result, answer))
        }
        Ok(result) => Err(format!("ended {:?}", result.reason)),
        Err(error) => Err(error.to_string()),
    }
}

/// A turn through gateway `index % 2`: a chat completion, not streamed; the request's result
/// is the `finished` event of the id the gateway's answer names.
async fn gateway_turn(
    gateways: &Gateways,
    index: usize,
    messages: &[Message],
    key: Option<&str>,
    timeout: Duration,
) -> Result<(GenerationResult, String), String> {
    let url = format!(
        "{}/chat/completions",
        gateways.urls[index % gateways.urls.len()]
    );
    let mut body = json!({"model": POOL, "messages": messages});
    if let Some(key) = key {
        body["user"] = key.into();
    }
    let body = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
    let response = gateways
        .http
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| format!("HTTP: {e}"))?;
    let status = response.status();
    let request_id = response
        .headers()
        .get(crate::gateway::REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bytes = response
        .bytes()
        .await
        .map_err(|e| format!("HTTP body: {e}"))?;
    if !status.is_success() {
        return Err(format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    let answer: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| "an answer that is not JSON".to_string())?;
    let content = answer
        .pointer("/choices/0/message/content")
        .and_then(|c| c.as_str())
        .unwrap_or_default()
        .to_string();
    let finish = answer
        .pointer("/choices/0/finish_reason")
        .and_then(|c| c.as_str())
        .unwrap_or_default();
    if finish != "stop" {
        return Err(format!("finish_reason {finish:?}"));
    }
    let request_id = request_id.ok_or_else(|| "an answer without its request id".to_string())?;
    let result = gateways
        .finished
        .take(&request_id, timeout)
        .await
        .ok_or_else(|| format!("no finished event for {request_id}"))?;
    Ok((result, content))
}

/// A question of about `bytes` bytes, unique to its pass, conversation and turn.
fn question(run_id: &str, chain: usize, turn: usize, bytes: usize) -> String {
    let mut text = format!("Conversation {run_id}-{chain}, question {turn}:");
    let mut word = 0;
    while text.len() < bytes {
        text.push_str(&format!(" w{word}"));
        word += 1;
    }
    text
}

fn cache_totals(mocks: &[MockServer]) -> PrefixCacheStats {
    let mut total = PrefixCacheStats::default();
    for stats in mocks.iter().filter_map(MockServer::prefix_cache_stats) {
        total.hits += stats.hits;
        total.misses += stats.misses;
        total.entries += stats.entries;
        total.capacity += stats.capacity;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn questions_have_their_size_and_are_unique() {
        let a = question("r", 1, 2, 1024);
        assert!((1024..1040).contains(&a.len()), "{}", a.len());
        assert_ne!(a, question("r", 1, 3, 1024));
        assert_ne!(a, question("r", 2, 2, 1024));
    }
}
