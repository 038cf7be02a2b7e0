//! The batch part of the gateway phase: on the same fleet, in the same run, the durable queue's
//! drain rate (a burst of `lines` requests put on the queue at once, as the durable phase
//! measures it) and the same requests as one batch through the gateway's Batch API: the JSONL
//! file uploaded once (`POST /v1/files`), each batch created from it (`POST /v1/batches`) and
//! polled until it ends. The batch's rate counts from its creation to its end, its output file
//! written: what its caller waits.
//!
//! The two alternate, `rounds` times, each after the fleet went quiet (the releases of the
//! phase before done), the batch first in every other round: on a shared machine the CPU a
//! request costs moves between phases a few seconds apart, so one pair says little, and what
//! runs second in a round tends to run slower. The figure is the pooled one: every batch's
//! lines over their time, against every drain's requests over theirs; with an even number of
//! rounds each order counts as often.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use serde_json::{Value, json};

use super::durable;
use super::meter::Meter;
use super::monitor::BusOps;
use super::procstat::{self, ProcessUsage};
use super::target::Target;
use super::target_check::TargetCheck;
use super::workload;

/// The batch is polled at most this often: near its end, which is seen within this.
const POLL_MIN: Duration = Duration::from_millis(10);

/// And at least this often: while much of it is left (each poll is an HTTP request, a record
/// read and a JSON answer, on the machine the batch runs on).
const POLL_MAX: Duration = Duration::from_millis(250);

/// The first poll, before any line is known to have ended.
const POLL_FIRST: Duration = Duration::from_millis(50);

/// The wait before the next poll: a quarter of the time the lines left should take at the rate
/// seen so far, within [`POLL_MIN`] and [`POLL_MAX`]; [`POLL_FIRST`] while no line is known to
/// have ended, [`POLL_MIN`] once every line did (its files are being written).
fn next_poll(done: u64, total: u64, elapsed: Duration) -> Duration {
    if done == 0 {
        return POLL_FIRST;
    }
    if done >= total {
        return POLL_MIN;
    }
    let per_line = elapsed.as_secs_f64() / done as f64;
    let left = Duration::from_secs_f64(per_line * (total - done) as f64);
    (left / 4).clamp(POLL_MIN, POLL_MAX)
}

/// The fleet is quiet when the watched processes use less than this share of a core in all.
const QUIET_CORES: f64 = 0.2;

/// How long the fleet's use is sampled to judge it quiet, and the longest wait for quiet.
const QUIET_SAMPLE: Duration = Duration::from_millis(250);
const QUIET_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Serialize)]
pub struct BatchReport {
    pub lines: u64,
    pub workers: u32,
    /// The file's upload (once, for every round).
    pub upload_secs: f64,
    /// Each round: a drain, then a batch.
    pub rounds: Vec<BatchRound>,
    /// The round whose ratio is the median (the lower middle one of an even count).
    pub median_round: usize,
    /// Every batch's lines per second over their time ÷ every drain's requests per second.
    pub batch_vs_drain: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BatchRound {
    /// The durable queue's drain: the burst's results stored per second.
    pub drain_secs: f64,
    pub drain_per_sec: f64,
    /// From the batch's creation to its end.
    pub batch_secs: f64,
    /// Lines answered per second over the batch.
    pub batch_per_sec: f64,
    pub status: String,
    pub completed: u64,
    pub failed: u64,
    /// The batch's rate ÷ the drain rate.
    pub batch_vs_drain: Option<f64>,
    /// CPU of each process per request of the drain, and per line of the batch.
    pub drain_processes: Vec<ProcessUsage>,
    pub batch_processes: Vec<ProcessUsage>,
    /// Bus operations per request of the drain, and per line of the batch.
    pub drain_bus: Option<BusOps>,
    pub batch_bus: Option<BusOps>,
}

impl BatchReport {
    pub fn median(&self) -> Option<&BatchRound> {
        self.rounds.get(self.median_round)
    }
}

/// Drains a burst of `lines`, then runs the same requests as one batch through the gateway at
/// `gateway_url` (its `/v1`), `rounds` times.
pub async fn run(
    target: &Target,
    meter: &Meter,
    gateway_url: &str,
    lines: u64,
    reply_tokens: usize,
    workers: u32,
    rounds: u32,
) -> anyhow::Result<BatchReport> {
    let text = workload::words(reply_tokens);
    let mut jsonl = String::new();
    for n in 0..lines {
        let line = json!({
            "custom_id": format!("line-{n}"), "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": target.pool, "messages": [{"role": "user", "content": text}],
                     "max_tokens": reply_tokens + 16},
        });
        jsonl.push_str(&line.to_string());
        jsonl.push('\n');
    }
    let http = reqwest::Client::new();
    let uploaded = Instant::now();
    let file = upload(&http, gateway_url, jsonl).await?;
    let upload_secs = uploaded.elapsed().as_secs_f64();
    let mut done = Vec::new();
    for round in 1..=rounds.max(1) {
        // Every other round runs the batch first: what comes first in a round (a machine
        // quiet for a while) favours neither.
        let batch_first = round % 2 == 0;
        let mut drain = None;
        let mut batch = None;
        for batch_turn in [batch_first, !batch_first] {
            quiet(meter).await;
            if batch_turn {
                eprintln!("gateway phase, round {round}: a batch of {lines} lines");
                batch = Some(one_batch(target, meter, &http, gateway_url, &file).await?);
            } else {
                eprintln!(
                    "gateway phase, round {round}: the durable queue's drain of {lines} requests"
                );
                drain = Some(
                    durable::run(
                        target,
                        &format!("drain{round}"),
                        lines,
                        reply_tokens,
                        meter,
                        true,
                    )
                    .await?,
                );
            }
        }
        let (Some(drain), Some(batch)) = (drain, batch) else {
            unreachable!("each round runs both");
        };
        let completed = batch.counts("completed");
        let batch_per_sec = completed as f64 / batch.secs.max(1e-9);
        done.push(BatchRound {
            drain_secs: drain.drain_secs,
            drain_per_sec: drain.drain_per_sec,
            batch_secs: batch.secs,
            batch_per_sec,
            status: batch.record["status"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            completed,
            failed: batch.counts("failed"),
            batch_vs_drain: (drain.drain_per_sec > 0.0)
                .then(|| batch_per_sec / drain.drain_per_sec),
            drain_processes: drain.processes,
            batch_processes: batch.processes,
            drain_bus: drain.bus,
            batch_bus: batch.bus,
        });
    }
    Ok(BatchReport {
        lines,
        workers,
        upload_secs,
        batch_vs_drain: pooled(&done),
        median_round: median_of(&done),
        rounds: done,
    })
}

/// Every batch's lines per second over their time ÷ every drain's requests per second over
/// theirs.
fn pooled(rounds: &[BatchRound]) -> Option<f64> {
    let rate = |count: f64, secs: f64| (secs > 0.0).then(|| count / secs);
    let drained: f64 = rounds.iter().map(|r| r.drain_per_sec * r.drain_secs).sum();
    let drain = rate(drained, rounds.iter().map(|r| r.drain_secs).sum())?;
    let answered: f64 = rounds.iter().map(|r| r.completed as f64).sum();
    let batch = rate(answered, rounds.iter().map(|r| r.batch_secs).sum())?;
    (drain > 0.0).then(|| batch / drain)
}

/// The index of the round whose ratio is the median (the lower middle one of an even count;
/// a round without a ratio counts as the lowest).
fn median_of(rounds: &[BatchRound]) -> usize {
    let mut order: Vec<usize> = (0..rounds.len()).collect();
    order.sort_by(|a, b| {
        let ratio = |i: &usize| rounds[*i].batch_vs_drain.unwrap_or(f64::MIN);
        ratio(a).total_cmp(&ratio(b))
    });
    order
        .get(rounds.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(0)
}

/// One batch run to its end.
struct Batch {
    record: Value,
    secs: f64,
    processes: Vec<ProcessUsage>,
    bus: Option<BusOps>,
}

impl Batch {
    fn counts(&self, name: &str) -> u64 {
        self.record["request_counts"][name].as_u64().unwrap_or(0)
    }
}

async fn one_batch(
    target: &Target,
    meter: &Meter,
    http: &reqwest::Client,
    gateway_url: &str,
    file: &str,
) -> anyhow::Result<Batch> {
    let cost = meter.start().await;
    let started = Instant::now();
    let batch: Value = http
        .post(format!("{gateway_url}/batches"))
        .json(
            &json!({"input_file_id": file, "endpoint": "/v1/chat/completions",
                      "completion_window": "24h"}),
        )
        .send()
        .await?
        .json()
        .await?;
    let id = batch["id"]
        .as_str()
        .with_context(|| format!("the batch was not created: {batch}"))?
        .to_string();
    let mut last_progress = (Instant::now(), 0u64);
    let mut wait = POLL_FIRST;
    let record = loop {
        tokio::time::sleep(wait).await;
        let batch: Value = http
            .get(format!("{gateway_url}/batches/{id}"))
            .send()
            .await?
            .json()
            .await?;
        let status = batch["status"].as_str().unwrap_or_default();
        if matches!(status, "completed" | "failed" | "expired" | "cancelled") {
            break batch;
        }
        let done = batch["request_counts"]["completed"].as_u64().unwrap_or(0);
        let total = batch["request_counts"]["total"].as_u64().unwrap_or(0);
        wait = next_poll(done, total, started.elapsed());
        if done != last_progress.1 {
            last_progress = (Instant::now(), done);
        } else if last_progress.0.elapsed() > target.timeout {
            anyhow::bail!(
                "the batch made no progress for {:?}: {batch}",
                target.timeout
            );
        }
    };
    let secs = started.elapsed().as_secs_f64();
    let completed = record["request_counts"]["completed"].as_u64().unwrap_or(0);
    // Its results are released once it ended: the counters are read before that.
    let cost = meter.stop_at_once(cost).await.per_request(completed);
    Ok(Batch {
        record,
        secs,
        processes: cost.processes,
        bus: cost.bus,
    })
}

/// Waits until the watched processes are quiet (what the phase before left, such as a batch's
/// results released after its end, is done), up to [`QUIET_WAIT`].
async fn quiet(meter: &Meter) {
    let deadline = Instant::now() + QUIET_WAIT;
    while Instant::now() < deadline {
        let before = procstat::snapshot(&meter.watched);
        tokio::time::sleep(QUIET_SAMPLE).await;
        let cores: f64 = procstat::usage_since(&meter.watched, &before)
            .iter()
            .map(|p| p.cpu_cores)
            .sum();
        if cores < QUIET_CORES {
            return;
        }
    }
}

/// The file uploaded as `multipart/form-data`, as any client sends it; its id.
async fn upload(
    http: &reqwest::Client,
    gateway_url: &str,
    jsonl: String,
) -> anyhow::Result<String> {
    let boundary = format!("genfleet-bench-{}", crate::protocol::ids::new_id());
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"bench.jsonl\"\r\n\
         Content-Type: application/jsonl\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(jsonl.as_bytes());
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let file: Value = http
        .post(format!("{gateway_url}/files"))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(body)
        .send()
        .await?
        .json()
        .await?;
    file["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("the file was not stored: {file}"))
}

/// The batch's target: its rate against the drain's over every round, with two workers.
pub fn target(report: Option<&BatchReport>) -> TargetCheck {
    let ratio = report.and_then(|r| r.batch_vs_drain);
    TargetCheck {
        name: "batch rate vs the durable drain rate",
        target: ">= 90% of the drain rate, a batch of 10,000 lines on 2 workers",
        value: ratio.map(|r| r * 100.0),
        unit: "%",
        met: ratio.map(|r| r >= 0.9),
        conditions_met: Some(report.is_some_and(|r| r.workers == 2 && r.lines >= 10_000)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pooled_ratio_weighs_each_round_by_its_time() {
        let mut a = round(None);
        (a.drain_per_sec, a.drain_secs, a.completed, a.batch_secs) = (100.0, 1.0, 100, 2.0);
        let mut b = round(None);
        (b.drain_per_sec, b.drain_secs, b.completed, b.batch_secs) = (50.0, 2.0, 100, 2.0);
        // 200 drained in 3 s against 200 answered in 4 s.
        let ratio = pooled(&[a, b]).expect("a ratio");
        assert!((ratio - 0.75).abs() < 1e-9, "{ratio}");
        assert_eq!(pooled(&[]), None);
    }

    fn round(ratio: Option<f64>) -> BatchRound {
        BatchRound {
            drain_secs: 1.0,
            drain_per_sec: 1.0,
            batch_secs: 1.0,
            batch_per_sec: 1.0,
            status: "completed".into(),
            completed: 1,
            failed: 0,
            batch_vs_drain: ratio,
            drain_processes: Vec::new(),
            batch_processes: Vec::new(),
            drain_bus: None,
            batch_bus: None,
        }
    }

    #[test]
    fn the_median_round_is_the_middle_ratio_or_the_lower_middle_one() {
        let rounds = [Some(0.9), Some(0.7), Some(1.1)].map(round);
        assert_eq!(median_of(&rounds), 0);
        let rounds = [Some(0.9), None, Some(0.8), Some(1.0)].map(round);
        assert_eq!(median_of(&rounds), 2);
        assert_eq!(median_of(&[round(Some(0.5))]), 0);
        assert_eq!(median_of(&[]), 0);
    }

    #[test]
    fn the_batch_is_polled_less_often_while_much_of_it_is_left() {
        let second = Duration::from_secs(1);
        assert_eq!(next_poll(0, 10_000, second), POLL_FIRST);
        // 1,000 of 10,000 lines in a second: 9 s left, polled at the longest wait.
        assert_eq!(next_poll(1_000, 10_000, second), POLL_MAX);
        // 9,800 in a second: about 20 ms left, polled at the shortest.
        assert_eq!(next_poll(9_800, 10_000, second), POLL_MIN);
        // 9,000 in a second: about 111 ms left, a quarter of it.
        let wait = next_poll(9_000, 10_000, second);
        assert!(wait > Duration::from_millis(27) && wait < Duration::from_millis(28));
        // Every line ended: the files are being written.
        assert_eq!(next_poll(10_000, 10_000, second), POLL_MIN);
    }
}
