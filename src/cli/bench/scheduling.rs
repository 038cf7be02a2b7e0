//! Scheduling (`--local` only): what affinity is worth to a backend with a prefix cache.
//!
//! Workers of a pool of their own, each on a mock backend of its own with a prefix cache (a
//! conversation that goes on from one the backend served answers its first token after
//! `prefix_hit_ms`, any other after `prefill_ms_per_kb` per KiB of conversation), serve the
//! same multi-turn conversations twice: once with an affinity key per conversation, once
//! without. Each turn resends the conversation so far with one more question, as a chat
//! client or an agent's tool loop does. Reported for each: time to first token (as the worker
//! measured it, from the start of the generation) and the backends' prefix hit rate.

use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use serde::Serialize;

use super::latency::{Samples, Summary};
use super::local::{LocalFleet, LocalWorker};
use super::target_check::TargetCheck;
use crate::client::Client;
use crate::llm::mock::{MockServer, PrefixCacheSettings, PrefixCacheStats, Script};
use crate::protocol::{GenerationRequest, GenerationResult, Message, Reason};
use crate::settings::Settings;

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
}

#[derive(Debug, Clone, Serialize)]
pub struct SchedulingReport {
    pub spec: SchedulingSpec,
    pub with_affinity: SchedulingRun,
    pub without_affinity: SchedulingRun,
    /// Time to first token p50 without affinity ÷ with it.
    pub first_token_p50_ratio: Option<f64>,
}

/// One pass over the conversations.
#[derive(Debug, Clone, Serialize)]
pub struct SchedulingRun {
    pub affinity: bool,
    pub requests: u64,
    pub completed: u64,
    pub errors: u64,
    pub seconds: f64,
    /// From the start of each generation to its first token, every turn.
    pub first_token_ms: Option<Summary>,
    /// The same, turns after the first only (the first can find no prefix anywhere).
    pub later_first_token_ms: Option<Summary>,
    /// The backends' prefix-cache hits and misses over the pass.
    pub prefix_hits: u64,
    pub prefix_misses: u64,
    /// Hits among all requests.
    pub hit_rate: f64,
    /// Hits among the turns after the first (the only ones that can hit).
    pub later_turn_hit_rate: f64,
    /// Later turns that ran on the worker of the turn before (their affinity held).
    pub held: u64,
    /// Later turns whose worker had no free slot, sent to the pool at once.
    pub fell_back_busy: u64,
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
    let with_affinity = pass(settings, spec, &mocks, true, timeout).await?;
    let without_affinity = pass(settings, spec, &mocks, false, timeout).await?;
    for worker in workers {
        worker.stop().await;
    }
    let p50 = |run: &SchedulingRun| run.first_token_ms.map(|s| s.p50);
    let first_token_p50_ratio = match (p50(&without_affinity), p50(&with_affinity)) {
        (Some(without), Some(with)) if with > 0.0 => Some(without / with),
        _ => None,
    };
    Ok(SchedulingReport {
        spec: spec.clone(),
        with_affinity,
        without_affinity,
        first_token_p50_ratio,
    })
}

/// The conversations once, with or without affinity keys, on a client of its own.
async fn pass(
    settings: &Settings,
    spec: &SchedulingSpec,
    mocks: &[MockServer],
    affinity: bool,
    timeout: Duration,
) -> anyhow::Result<SchedulingRun> {
    let client = Client::connect(settings)
        .await
        .context("cannot connect to NATS")?;
    let before = cache_totals(mocks);
    let label = if affinity { "affinity" } else { "no-affinity" };
    let bar = super::progress::Progress::counting(
        &format!("scheduling ({label})"),
        (spec.chains * spec.turns) as u64,
    );
    // A run id keeps this pass's conversations apart from the other's in the caches.
    let run_id = crate::protocol::ids::new_id();
    let started = Instant::now();
    let chains: Vec<Vec<Result<GenerationResult, String>>> =
        futures_util::stream::iter(0..spec.chains)
            .map(|chain| {
                let client = client.clone();
                let bar = bar.clone();
                let run_id = run_id.clone();
                async move {
                    let key = affinity.then(|| format!("{run_id}-{chain}"));
                    conversation(&client, spec, &run_id, chain, key, timeout, &bar).await
                }
            })
            .buffer_unordered(spec.concurrency.max(1))
            .collect()
            .await;
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let after = cache_totals(mocks);

    let mut first_token = Samples::default();
    let mut later_first_token = Samples::default();
    let (mut completed, mut errors, mut held, mut busy) = (0, 0, 0, 0);
    for turns in &chains {
        for (turn, outcome) in turns.iter().enumerate() {
            let Ok(result) = outcome else {
                errors += 1;
                continue;
            };
            completed += 1;
            if let Some(ms) = result.timings_ms.first_token {
                first_token.push(Duration::from_millis(ms));
                if turn > 0 {
                    later_first_token.push(Duration::from_millis(ms));
                }
            }
            if turn > 0
                && let Some(record) = &result.affinity
            {
                held += u64::from(record.held);
                busy += u64::from(record.fallback.as_deref() == Some("busy"));
            }
        }
    }
    let requests = (spec.chains * spec.turns) as u64;
    let later = (spec.chains * spec.turns.saturating_sub(1)) as u64;
    let hits = after.hits.saturating_sub(before.hits);
    let misses = after.misses.saturating_sub(before.misses);
    let rate = |n: u64, of: u64| if of == 0 { 0.0 } else { n as f64 / of as f64 };
    client.nats().flush().await.ok();
    Ok(SchedulingRun {
        affinity,
        requests,
        completed,
        errors,
        seconds,
        first_token_ms: first_token.summary(),
        later_first_token_ms: later_first_token.summary(),
        prefix_hits: hits,
        prefix_misses: misses,
        hit_rate: rate(hits, hits + misses),
        // A first turn's conversation is new to every backend: every hit is a later turn's.
        later_turn_hit_rate: rate(hits, later),
        held,
        fell_back_busy: busy,
    })
}

/// The targets of docs/benchmarks.md that this phase measures.
pub fn targets(report: &SchedulingReport) -> Vec<TargetCheck> {
    let hit_rate = report.with_affinity.later_turn_hit_rate;
    let ratio = report.first_token_p50_ratio;
    vec![
        TargetCheck {
            name: "prefix hit rate with affinity",
            target: ">= 90% of later turns (prefix-cache mock, 4 workers)",
            value: Some(hit_rate * 100.0),
            unit: "%",
            met: Some(hit_rate >= 0.9),
            conditions_met: Some(report.spec.workers == 4),
        },
        TargetCheck {
            name: "time to first token p50, affinity off ÷ on",
            target: ">= 2× (prefix-cache mock, 4 workers)",
            value: ratio,
            unit: "×",
            met: ratio.map(|r| r >= 2.0),
            conditions_met: Some(report.spec.workers == 4),
        },
    ]
}

/// One conversation: each turn sends the turns before it, their answers and a new question.
/// It stops at its first failed turn (the rest count as failed too).
async fn conversation(
    client: &Client,
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
        let request = GenerationRequest {
            messages: messages.clone(),
            affinity_key: key.clone(),
            ..GenerationRequest::default()
        };
        let outcome = match client.run(POOL, request, timeout).await {
            Ok(result) if result.reason == Reason::Stop => Ok(result),
            Ok(result) => Err(format!("ended {:?}", result.reason)),
            Err(error) => Err(error.to_string()),
        };
        bar.inc(1);
        match outcome {
            Ok(result) => {
                messages.push(Message::assistant(result.output.clone()));
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
