//! What a caller feels: the fleet's bus path at concurrency 1 against the fastest direct call
//! to the same backend, and the most requests per second the fleet holds while a request's p99
//! stays under a limit.
//!
//! At concurrency 1 the calls are made from one thread of their own (a current-thread runtime
//! with its own NATS connections and HTTP client), as the fastest caller would make them. On
//! the bench's multi-threaded runtime each hand-off inside the client (every chunk of a
//! streamed answer goes from the connection's task to the reader's) may wake another thread,
//! tens of microseconds a time, which costs a direct streamed call about a millisecond and
//! would flatter the fleet. The backend is called both ways, streamed (the request a worker
//! sends) and not, and the faster is the floor. The paths take turns in rounds, so a change in
//! the machine's state falls on all of them alike.
//!
//! The sweep runs the interactive load at rising concurrency on the bench's runtime (as the
//! throughput phases do) and reports each level; what the fleet holds under the limit is the
//! highest rate of a level whose p99 stayed under it with no error.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use serde::Serialize;

use super::floors;
use super::interactive::{self, LoadSpec};
use super::latency::{Samples, Summary};
use super::meter::Meter;
use super::target::Target;
use super::workload;
use crate::client::connect::ConnectPurpose;
use crate::settings::Settings;

/// Calls of each path per round at concurrency 1.
const ROUND: u64 = 50;
/// Calls of each path before the timed rounds (connections opened, caches warm).
const WARM_UP: u64 = 20;
/// The p99 the sweep's rate is held under, ms.
pub const P99_LIMIT_MS: f64 = 5.0;
/// The sweep's levels, each with the phase name its request ids carry.
const SWEEP: [(usize, &str); 6] = [
    (1, "sweep-c1"),
    (2, "sweep-c2"),
    (4, "sweep-c4"),
    (8, "sweep-c8"),
    (16, "sweep-c16"),
    (32, "sweep-c32"),
];
/// How long a write of the caller phase's bucket is kept: the bucket is deleted after the
/// phase, and one left behind by an interrupted run empties itself.
const BUCKET_TTL: Duration = Duration::from_secs(600);
/// Longest a sweep level runs (the phases' --duration-secs when shorter).
const SWEEP_LEVEL_LIMIT: Duration = Duration::from_secs(3);

/// How the caller's figures are taken.
#[derive(Debug, Clone)]
pub struct CallerSpec {
    /// Calls of each path at concurrency 1.
    pub requests: u64,
    pub reply_tokens: usize,
    /// The backend's base URL (up to `/v1`) and model, for the direct calls.
    pub backend_url: String,
    pub model: String,
    /// Highest concurrency of the sweep.
    pub sweep_up_to: usize,
    /// The sweep levels' budget: --requests, and --duration-secs capped at a few seconds.
    pub sweep_requests: Option<u64>,
    pub sweep_duration: Option<Duration>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CallerReport {
    #[serde(flatten)]
    pub at_one: AtOne,
    pub sweep: Vec<SweepLevel>,
    pub p99_limit_ms: f64,
    /// The highest requests/s of a sweep level whose p99 stayed under the limit, no error.
    pub held_requests_per_sec: Option<f64>,
    pub held_at_concurrency: Option<usize>,
}

/// Every path at concurrency 1.
#[derive(Debug, Clone, Serialize)]
pub struct AtOne {
    /// Calls of each path.
    pub requests_per_path: u64,
    pub direct_not_streamed_ms: Option<Summary>,
    pub direct_streamed_ms: Option<Summary>,
    /// `not streamed` or `streamed`: the direct call with the lower p50, the floor.
    pub fastest_direct: Option<&'static str>,
    /// Request-reply against an echo responder: one bus round trip.
    pub nats_request_reply_ms: Option<Summary>,
    /// A KV create then an update of the same key: the two JetStream writes every interactive
    /// request makes (its claim and its result), one after the other.
    pub jetstream_writes_ms: Option<Summary>,
    /// What the bus path cannot go under as the contract stands, each p50: the fastest direct
    /// call, one request-reply (the submit and its answer) and the two writes (the `finished`
    /// event's one way to the caller comes on top).
    pub bus_floor_p50_ms: Option<f64>,
    pub submit_to_accepted_ms: Option<Summary>,
    pub submit_to_first_delta_ms: Option<Summary>,
    pub submit_to_result_ms: Option<Summary>,
    /// submit→result p50 − the fastest direct call's p50.
    pub added_p50_ms: Option<f64>,
    /// submit→result p99 − the fastest direct call's p99.
    pub added_p99_ms: Option<f64>,
    /// Failed calls by path and kind.
    pub errors: BTreeMap<String, u64>,
}

/// One level of the sweep.
#[derive(Debug, Clone, Serialize)]
pub struct SweepLevel {
    pub concurrency: usize,
    pub requests_per_sec: f64,
    pub errors: u64,
    pub submit_to_result_ms: Option<Summary>,
}

/// Concurrency 1 on a thread of its own, then the sweep on `target`.
pub async fn run(
    target: &Target,
    spec: &CallerSpec,
    meter: &Meter,
    release_results: bool,
) -> anyhow::Result<CallerReport> {
    let at_one = {
        let settings = target.settings.clone();
        let pool = target.pool.clone();
        let timeout = target.timeout;
        let spec = spec.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("bench-caller".into())
            .spawn(move || {
                let measured = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("cannot build the caller's runtime")
                    .and_then(|runtime| {
                        runtime.block_on(concurrency_one(
                            settings,
                            pool,
                            timeout,
                            &spec,
                            release_results,
                        ))
                    });
                let _ = tx.send(measured);
            })
            .context("cannot start the caller's thread")?;
        rx.await.context("the caller's thread ended early")??
    };
    let sweep = sweep(target, spec, meter, release_results).await;
    let held = sweep
        .iter()
        .filter(|l| l.errors == 0 && l.submit_to_result_ms.is_some_and(|s| s.p99 <= P99_LIMIT_MS))
        .max_by(|a, b| a.requests_per_sec.total_cmp(&b.requests_per_sec))
        .map(|l| (l.requests_per_sec, l.concurrency));
    Ok(CallerReport {
        at_one,
        p99_limit_ms: P99_LIMIT_MS,
        held_requests_per_sec: held.map(|(rate, _)| rate),
        held_at_concurrency: held.map(|(_, concurrency)| concurrency),
        sweep,
    })
}

/// The paths at concurrency 1, in the order each round takes them.
#[derive(Clone, Copy)]
enum Path {
    DirectNotStreamed,
    DirectStreamed,
    RequestReply,
    Writes,
    Genfleet,
}

impl Path {
    const ALL: [Path; 5] = [
        Path::DirectNotStreamed,
        Path::DirectStreamed,
        Path::RequestReply,
        Path::Writes,
        Path::Genfleet,
    ];

    fn name(self) -> &'static str {
        match self {
            Path::DirectNotStreamed => "direct",
            Path::DirectStreamed => "direct streamed",
            Path::RequestReply => "request-reply",
            Path::Writes => "JetStream writes",
            Path::Genfleet => "genfleet",
        }
    }
}

/// What the paths call, on the caller's thread.
struct Callers {
    target: Target,
    http: reqwest::Client,
    url: String,
    streamed: bytes::Bytes,
    not_streamed: bytes::Bytes,
    echo_subject: String,
    /// A submit's size, for the request-reply and the writes.
    payload: bytes::Bytes,
    bucket: async_nats::jetstream::kv::Store,
    reply_tokens: usize,
    /// Numbers the writes' keys and genfleet's request ids.
    sent: u64,
    /// Genfleet's requests that finished, to release.
    finished: Vec<String>,
}

impl Callers {
    /// One call of `path`, its time and genfleet's steps (`path` has them) into `samples`
    /// when `timed`.
    async fn call(
        &mut self,
        path: Path,
        samples: &mut PathSamples,
        timed: bool,
    ) -> Result<(), String> {
        let at = Instant::now();
        self.sent += 1;
        match path {
            Path::DirectNotStreamed => {
                http_call(&self.http, &self.url, self.not_streamed.clone()).await?
            }
            Path::DirectStreamed => http_call(&self.http, &self.url, self.streamed.clone()).await?,
            Path::RequestReply => {
                let request = async_nats::Request::new()
                    .payload(self.payload.clone())
                    .timeout(Some(self.target.timeout));
                self.target
                    .connection(0)
                    .send_request(self.echo_subject.clone(), request)
                    .await
                    .map_err(|e| format!("request-reply: {e}"))?;
            }
            Path::Writes => {
                let key = format!("pair.{}", self.sent);
                let revision = self
                    .bucket
                    .create(&key, self.payload.clone())
                    .await
                    .map_err(|e| format!("create: {e}"))?;
                self.bucket
                    .update(&key, self.payload.clone(), revision)
                    .await
                    .map_err(|e| format!("update: {e}"))?;
            }
            Path::Genfleet => {
                let id = self.target.request_id("caller", self.sent);
                let request = workload::request(id.clone(), self.reply_tokens);
                let outcome = interactive::one_request(&self.target, 0, request).await;
                if outcome.submit_to_result.is_some() {
                    self.finished.push(id);
                }
                if timed {
                    if let Some(first) = outcome.first_delta {
                        samples.first_deltas.push(first);
                    }
                    if let Some(accepted) = outcome.accepted {
                        samples.accepted.push(accepted);
                    }
                }
                if let Some(error) = outcome.error {
                    return Err(error);
                }
            }
        }
        if timed {
            samples.samples.push(at.elapsed());
        }
        Ok(())
    }
}

/// The figures of one path at concurrency 1.
#[derive(Default)]
struct PathSamples {
    samples: Samples,
    first_deltas: Samples,
    accepted: Samples,
}

async fn concurrency_one(
    settings: Settings,
    pool: String,
    timeout: Duration,
    spec: &CallerSpec,
    release_results: bool,
) -> anyhow::Result<AtOne> {
    let target = Target::connect(settings, pool, 1, timeout).await?;
    let http = reqwest::Client::builder().timeout(timeout).build()?;
    let base = spec.backend_url.trim_end_matches('/').to_string();
    let (streamed, _) =
        floors::backend_body(&http, &base, &spec.model, spec.reply_tokens, true).await;
    let (not_streamed, _) =
        floors::backend_body(&http, &base, &spec.model, spec.reply_tokens, false).await;
    // The echo responder of the request-reply path, on its own connection.
    let responder =
        crate::client::connect::connect(&target.settings.nats, ConnectPurpose::Client).await?;
    let echo_subject = format!("_genfleet_bench.{}.caller-echo", target.run_id);
    let mut echoes = responder.subscribe(echo_subject.clone()).await?;
    responder.flush().await?;
    let echo = tokio::spawn(async move {
        while let Some(message) = echoes.next().await {
            if let Some(reply) = message.reply {
                let _ = responder.publish(reply, message.payload).await;
            }
        }
    });
    let payload = serde_json::to_vec(&workload::request(
        target.request_id("caller-echo", 0),
        spec.reply_tokens,
    ))
    .expect("requests serialize")
    .into();
    // The two writes, in a bucket made like the results bucket, deleted afterwards.
    let bucket_name = format!("genfleet_bench_caller_{}", target.run_id);
    let admin = async_nats::jetstream::new(target.connection(0).clone());
    let bucket = crate::client::streams::ensure_bucket(
        &admin,
        &bucket_name,
        1,
        BUCKET_TTL,
        target.settings.jetstream.replicas,
    )
    .await?;
    let mut callers = Callers {
        target,
        http,
        url: format!("{base}/chat/completions"),
        streamed,
        not_streamed,
        echo_subject,
        payload,
        bucket,
        reply_tokens: spec.reply_tokens,
        sent: 0,
        finished: Vec::new(),
    };

    let mut paths: [PathSamples; 5] = Default::default();
    let mut errors = BTreeMap::<String, u64>::new();
    let requests = spec.requests.max(1);
    for round in 0..=requests.div_ceil(ROUND) {
        // Round 0 warms every path up and is not timed; the last takes what is left.
        let calls = match round {
            0 => WARM_UP,
            _ => ROUND.min(requests - (round - 1) * ROUND),
        };
        for (path, samples) in Path::ALL.into_iter().zip(paths.iter_mut()) {
            for _ in 0..calls {
                if let Err(error) = callers.call(path, samples, round > 0).await {
                    *errors
                        .entry(format!("{}: {error}", path.name()))
                        .or_default() += 1;
                }
            }
        }
    }
    echo.abort();
    if let Err(error) = admin.delete_stream(format!("KV_{bucket_name}")).await {
        tracing::warn!(message = "the caller phase's bucket was not deleted", bucket = %bucket_name, %error);
    }
    let Callers {
        target, finished, ..
    } = callers;
    if release_results {
        target.release(finished).await;
    }
    target.close().await;

    let [not_streamed, streamed, nats, writes, bus] = paths;
    let direct_not_streamed_ms = not_streamed.samples.summary();
    let direct_streamed_ms = streamed.samples.summary();
    let fastest = match (&direct_not_streamed_ms, &direct_streamed_ms) {
        (Some(p), Some(s)) if s.p50 < p.p50 => Some(("streamed", *s)),
        (Some(p), _) => Some(("not streamed", *p)),
        (None, Some(s)) => Some(("streamed", *s)),
        (None, None) => None,
    };
    let submit_to_result_ms = bus.samples.summary();
    let added = |p: fn(&Summary) -> f64| {
        submit_to_result_ms
            .zip(fastest)
            .map(|(g, (_, d))| p(&g) - p(&d))
    };
    let nats_request_reply_ms = nats.samples.summary();
    let jetstream_writes_ms = writes.samples.summary();
    let bus_floor_p50_ms = match (fastest, nats_request_reply_ms, jetstream_writes_ms) {
        (Some((_, direct)), Some(nats), Some(writes)) => Some(direct.p50 + nats.p50 + writes.p50),
        _ => None,
    };
    Ok(AtOne {
        requests_per_path: requests,
        direct_not_streamed_ms,
        direct_streamed_ms,
        fastest_direct: fastest.map(|(name, _)| name),
        nats_request_reply_ms,
        jetstream_writes_ms,
        bus_floor_p50_ms,
        submit_to_accepted_ms: bus.accepted.summary(),
        submit_to_first_delta_ms: bus.first_deltas.summary(),
        added_p50_ms: added(|s| s.p50),
        added_p99_ms: added(|s| s.p99),
        submit_to_result_ms,
        errors,
    })
}

/// One direct call, read to its last byte.
async fn http_call(http: &reqwest::Client, url: &str, body: bytes::Bytes) -> Result<(), String> {
    let response = http
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("HTTP: {e}"))?;
    let status = response.status();
    response
        .bytes()
        .await
        .map_err(|e| format!("HTTP body: {e}"))?;
    if status.is_success() {
        Ok(())
    } else {
        Err(format!("HTTP {status}"))
    }
}

/// The interactive load at each level up to `spec.sweep_up_to`.
async fn sweep(
    target: &Target,
    spec: &CallerSpec,
    meter: &Meter,
    release_results: bool,
) -> Vec<SweepLevel> {
    let duration = Some(
        spec.sweep_duration
            .map_or(SWEEP_LEVEL_LIMIT, |d| d.min(SWEEP_LEVEL_LIMIT)),
    );
    let mut levels = Vec::new();
    for (concurrency, phase) in SWEEP {
        if concurrency > spec.sweep_up_to.max(1) {
            break;
        }
        let load = LoadSpec {
            phase,
            concurrency,
            reply_tokens: spec.reply_tokens,
            requests: spec.sweep_requests,
            duration,
        };
        let report = interactive::run(target, &load, meter, release_results).await;
        levels.push(SweepLevel {
            concurrency,
            requests_per_sec: report.requests_per_sec,
            errors: report.errors,
            submit_to_result_ms: report.submit_to_result_ms,
        });
    }
    levels
}
