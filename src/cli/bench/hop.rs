//! The forwarding hop (part of `--mode scheduling`, `--hop-samples`): what a keyed submit
//! costs when it reaches a worker other than its key's worker and is forwarded there, against
//! one sent straight to the key's worker.
//!
//! Workers of a pool of their own on the fleet's mock (no delay unless `--token-delay-ms`)
//! take keyed requests one at a time, each with a key of its own, from two clients on the same
//! fleet, turn about:
//! - **direct**: a client that follows the heartbeats sends each submit to its key's worker's
//!   own subject;
//! - **pool**: a client that follows nothing sends each to the pool subject, where the pool's
//!   queue group hands it to any worker: the key's worker starts it, any other forwards it to
//!   the key's worker (one hop), which answers the caller.
//!
//! Which pool submits were forwarded is seen, not guessed: an observer on a connection of its
//! own subscribes to the workers' own submit subjects, where only the direct submits and the
//! forwarded ones travel (one copy each to the observer, so both paths compared pay for it
//! alike), and a forwarded one carries `Genfleet-Forwarded-By`. The workers' `submits_placed`
//! counters, read before and after, count the same forwards.
//!
//! Reported: submit→accepted and submit→result of the direct submits, of the forwarded pool
//! submits and of the pool submits that reached their key's worker first; the hop's cost is
//! the forwarded ones' p50 less the direct ones'.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use super::latency::{Samples, Summary};
use super::local::{LocalFleet, LocalWorker};
use super::target_check::TargetCheck;
use super::workload;
use crate::client::Client;
use crate::client::fleet::Following;
use crate::client::subjects::Subjects;
use crate::protocol::request::FORWARDED_BY_HEADER;
use crate::protocol::{EventBody, RequestState};
use crate::settings::{PlacementSettings, Settings};

/// The pool of the hop's own workers.
const POOL: &str = "bench-scheduling-hop";
/// Requests of each path sent before the measured ones (connections, caches, peers' views).
const WARM_UP: u64 = 20;
/// How long the workers' heartbeats may take to reach the direct client.
const VIEW_WITHIN: Duration = Duration::from_secs(15);

#[derive(Debug, Clone, Serialize)]
pub struct HopSpec {
    pub workers: u32,
    pub slots: u32,
    /// Measured submits per path (direct, pool), one at a time.
    pub samples: u64,
    /// Reply length, in tokens.
    pub reply_tokens: usize,
    /// The fleet's mock's delay before each token (the target holds for 0).
    pub token_delay_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct HopReport {
    /// How the forwarded submits are told apart.
    pub method: &'static str,
    pub seconds: f64,
    /// Straight to the key's worker by a client that follows the heartbeats.
    pub direct: HopPath,
    /// To the pool by a client that follows nothing, received by another worker and forwarded
    /// to the key's worker.
    pub pool_forwarded: HopPath,
    /// To the pool likewise, received by the key's worker itself (no hop).
    pub pool_at_key_worker: HopPath,
    pub direct_errors: u64,
    pub pool_errors: u64,
    pub first_error: Option<String>,
    /// Direct submits seen forwarded all the same (0 when the client placed them all).
    pub direct_forwarded: u64,
    /// Measured submits accepted by a worker other than their key's (0 on an idle pool).
    pub off_key_worker: u64,
    /// Forwarded pool submits the observer saw (measured ones only).
    pub forwards_seen: u64,
    /// The workers' `submits_placed` counters over the measured submits.
    pub forwards_counted_by_workers: Option<u64>,
    /// Forwarded pool submits' submit→accepted p50 − direct submits', ms: the hop's cost.
    pub added_accepted_p50_ms: Option<f64>,
    /// The same for submit→result.
    pub added_result_p50_ms: Option<f64>,
    /// Forwarded pool submits' submit→accepted p50 − that of pool submits received by their
    /// key's worker, ms.
    pub added_accepted_p50_vs_pool_ms: Option<f64>,
}

/// One path's measured submits.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HopPath {
    pub samples: u64,
    pub submit_to_accepted_ms: Option<Summary>,
    pub submit_to_result_ms: Option<Summary>,
}

const METHOD: &str = "direct and pool submits alternate at concurrency 1 on the same workers, \
     a key of its own each; a pool submit counts as forwarded when an observer subscribed to \
     the workers' own submit subjects saw it there with Genfleet-Forwarded-By";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Direct,
    Pool,
}

/// One submit as measured.
struct Sample {
    request_id: String,
    accepted: Duration,
    result: Duration,
    worker: String,
    key_worker: String,
}

pub async fn run(
    fleet: &LocalFleet,
    settings: &Settings,
    spec: &HopSpec,
    timeout: Duration,
) -> anyhow::Result<HopReport> {
    let mut workers: Vec<LocalWorker> = Vec::new();
    for n in 1..=spec.workers {
        workers.push(
            fleet
                .start_worker(&format!("bench-hop-worker-{n}"), POOL, spec.slots)
                .await?,
        );
    }
    let measured = measure(settings, spec, &workers, timeout).await;
    for worker in workers {
        worker.stop().await;
    }
    measured
}

async fn measure(
    settings: &Settings,
    spec: &HopSpec,
    workers: &[LocalWorker],
    timeout: Duration,
) -> anyhow::Result<HopReport> {
    let ids: Vec<String> = workers.iter().map(|w| w.worker_id.clone()).collect();
    let placing = |follow_heartbeats| PlacementSettings {
        follow_heartbeats,
        ..settings.placement
    };
    let direct = Client::connect(settings)
        .await
        .context("cannot connect to NATS")?
        .with_placement(&placing(true));
    let pool = Client::connect(settings)
        .await
        .context("cannot connect to NATS")?
        .with_placement(&placing(false));
    wait_for_view(&direct, ids.len()).await?;

    // The observer: every submit on a worker's own subject, and who forwarded it.
    let observer = crate::client::connect::connect(
        &settings.nats,
        crate::client::connect::ConnectPurpose::Client,
    )
    .await
    .context("cannot connect to NATS")?;
    let subjects = Subjects::new(&settings.subjects);
    let mut own_submits = observer
        .subscribe(subjects.worker_submit("*", None))
        .await?;
    observer.flush().await?;
    let forwarded: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let watch = {
        let forwarded = forwarded.clone();
        tokio::spawn(async move {
            #[derive(Deserialize)]
            struct Named {
                request_id: Option<String>,
            }
            while let Some(message) = own_submits.next().await {
                let Some(by) = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(FORWARDED_BY_HEADER))
                    .map(|v| v.as_str().to_string())
                else {
                    continue;
                };
                if let Ok(Named {
                    request_id: Some(id),
                }) = serde_json::from_slice(&message.payload)
                {
                    forwarded
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id, by);
                }
            }
        })
    };

    let http = reqwest::Client::new();
    let run_id = crate::protocol::ids::new_id();
    let bar = super::progress::Progress::counting(
        "scheduling (forwarding hop)",
        2 * (WARM_UP + spec.samples),
    );
    let mut placed_before = None;
    let mut samples: HashMap<&str, Vec<Sample>> = HashMap::new();
    let (mut direct_errors, mut pool_errors) = (0, 0);
    let mut first_error = None;
    let started = Instant::now();
    for n in 0..WARM_UP + spec.samples {
        if n == WARM_UP {
            placed_before = placed_total(&http, workers).await;
        }
        // Turn about, each path first every other time.
        let order = if n % 2 == 0 {
            [Path::Direct, Path::Pool]
        } else {
            [Path::Pool, Path::Direct]
        };
        for path in order {
            let (client, name) = match path {
                Path::Direct => (&direct, "direct"),
                Path::Pool => (&pool, "pool"),
            };
            let id = format!("{run_id}-{name}-{n}");
            let outcome = sample(client, spec, &ids, id, timeout).await;
            bar.inc(1);
            if n < WARM_UP {
                continue;
            }
            match outcome {
                Ok(sample) => samples.entry(name).or_default().push(sample),
                Err(error) => {
                    match path {
                        Path::Direct => direct_errors += 1,
                        Path::Pool => pool_errors += 1,
                    }
                    first_error.get_or_insert(error);
                }
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let placed_after = placed_total(&http, workers).await;
    // Whatever the server had sent the observer is in once its PONG is.
    observer.flush().await.ok();
    tokio::time::sleep(Duration::from_millis(200)).await;
    watch.abort();
    let forwarded = std::mem::take(&mut *forwarded.lock().unwrap_or_else(|e| e.into_inner()));

    let direct_samples = samples.remove("direct").unwrap_or_default();
    let pool_samples = samples.remove("pool").unwrap_or_default();
    let direct_forwarded = direct_samples
        .iter()
        .filter(|s| forwarded.contains_key(&s.request_id))
        .count() as u64;
    let (hopped, at_key): (Vec<&Sample>, Vec<&Sample>) = pool_samples
        .iter()
        .partition(|s| forwarded.contains_key(&s.request_id));
    let off_key_worker = direct_samples
        .iter()
        .chain(&pool_samples)
        .filter(|s| s.worker != s.key_worker)
        .count() as u64;
    let direct_path = path_of(direct_samples.iter());
    let pool_forwarded = path_of(hopped.iter().copied());
    let pool_at_key_worker = path_of(at_key.iter().copied());
    let added = |a: &HopPath, b: &HopPath, at: fn(&HopPath) -> Option<Summary>| {
        at(a).zip(at(b)).map(|(a, b)| a.p50 - b.p50)
    };
    let accepted = |p: &HopPath| p.submit_to_accepted_ms;
    let result = |p: &HopPath| p.submit_to_result_ms;
    direct.nats().flush().await.ok();
    pool.nats().flush().await.ok();
    Ok(HopReport {
        method: METHOD,
        seconds,
        added_accepted_p50_ms: added(&pool_forwarded, &direct_path, accepted),
        added_result_p50_ms: added(&pool_forwarded, &direct_path, result),
        added_accepted_p50_vs_pool_ms: added(&pool_forwarded, &pool_at_key_worker, accepted),
        forwards_seen: hopped.len() as u64,
        forwards_counted_by_workers: placed_before
            .zip(placed_after)
            .map(|(before, after)| after.saturating_sub(before)),
        direct: direct_path,
        pool_forwarded,
        pool_at_key_worker,
        direct_errors,
        pool_errors,
        first_error,
        direct_forwarded,
        off_key_worker,
    })
}

/// Waits until the client's view of the heartbeats holds the pool's `workers`.
async fn wait_for_view(client: &Client, workers: usize) -> anyhow::Result<()> {
    let fleet = client
        .follow_fleet()
        .context("the direct client follows the heartbeats")?;
    let since = Instant::now();
    loop {
        match fleet.following() {
            Following::Ready if fleet.workers_of(POOL).len() >= workers => return Ok(()),
            Following::Unavailable(why) => {
                anyhow::bail!("the direct client cannot follow the heartbeats: {why}")
            }
            _ if since.elapsed() > VIEW_WITHIN => anyhow::bail!(
                "the direct client saw {} of the hop's {workers} workers within {VIEW_WITHIN:?}",
                fleet.workers_of(POOL).len()
            ),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// One keyed submit, followed to its result: submit→accepted and submit→result. The stored
/// result is released afterwards, off the timed path.
async fn sample(
    client: &Client,
    spec: &HopSpec,
    workers: &[String],
    request_id: String,
    timeout: Duration,
) -> Result<Sample, String> {
    // A key of its own: its key's worker is any of the pool's, alike for both paths.
    let key = request_id.clone();
    let key_worker = crate::schedule::rank(&key, workers.iter().map(String::as_str))
        .first()
        .map(|w| w.to_string())
        .unwrap_or_default();
    let mut request = workload::request(request_id.clone(), spec.reply_tokens);
    request.affinity_key = Some(key);
    let mut events = Box::pin(
        client
            .follow(&request_id)
            .await
            .map_err(|e| format!("follow: {e}"))?,
    );
    let started = Instant::now();
    let accepted = client
        .submit(POOL, &request)
        .await
        .map_err(|e| format!("submit: {e}"))?;
    let to_accepted = started.elapsed();
    let finished = tokio::time::timeout(timeout, async {
        while let Some(event) = events.next().await {
            if let EventBody::Finished { result } = event.body {
                return Some(*result);
            }
        }
        None
    })
    .await;
    let to_result = started.elapsed();
    drop(events);
    let _ = client.result(&request_id, true).await;
    match finished {
        Ok(Some(result)) if result.state == RequestState::Completed => Ok(Sample {
            request_id,
            accepted: to_accepted,
            result: to_result,
            worker: accepted.worker_id,
            key_worker,
        }),
        Ok(Some(result)) => Err(format!(
            "{} {}",
            result.state.as_str(),
            result.reason.as_str()
        )),
        _ => Err(format!("no finished event for {request_id}")),
    }
}

fn path_of<'a>(samples: impl Iterator<Item = &'a Sample>) -> HopPath {
    let (mut accepted, mut result) = (Samples::default(), Samples::default());
    for sample in samples {
        accepted.push(sample.accepted);
        result.push(sample.result);
    }
    HopPath {
        samples: accepted.len() as u64,
        submit_to_accepted_ms: accepted.summary(),
        submit_to_result_ms: result.summary(),
    }
}

/// The sum of the workers' `genfleet_submits_placed_total` (`None` when one cannot be read).
async fn placed_total(http: &reqwest::Client, workers: &[LocalWorker]) -> Option<u64> {
    let mut total = 0;
    for worker in workers {
        let text = http
            .get(format!("http://{}/metrics", worker.http_addr))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        let value = super::prometheus_text::sums(&text)
            .get("genfleet_submits_placed_total")
            .copied()?;
        total += value as u64;
    }
    Some(total)
}

/// The target of docs/benchmarks.md this measurement checks.
pub fn target(spec: &HopSpec, report: &HopReport) -> TargetCheck {
    let added = report.added_accepted_p50_ms;
    TargetCheck {
        name: "forwarding hop's added p50",
        target: "<= 0.3 ms submit→accepted, forwarded pool submit against direct (zero-delay mock, 4 workers, concurrency 1)",
        value: added,
        unit: "ms",
        met: added.map(|ms| ms <= 0.3),
        conditions_met: Some(spec.token_delay_ms == 0 && spec.workers == 4),
    }
}
