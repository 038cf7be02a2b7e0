//! The batch part of the gateway phase: on the same fleet, in the same run, the durable queue's
//! drain rate (a burst of `lines` requests put on the queue at once, as the durable phase
//! measures it) and then the same requests as one batch through the gateway's Batch API: the
//! JSONL file uploaded (`POST /v1/files`), the batch created (`POST /v1/batches`) and polled
//! until it ends. The batch's rate counts from its creation to its end, its output file
//! written: what its caller waits.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use serde_json::{Value, json};

use super::durable;
use super::meter::Meter;
use super::procstat::ProcessUsage;
use super::target::Target;
use super::target_check::TargetCheck;
use super::workload;

/// How often the batch is polled (its end is seen within this).
const POLL: Duration = Duration::from_millis(10);

#[derive(Debug, Clone, Serialize)]
pub struct BatchReport {
    pub lines: u64,
    pub workers: u32,
    /// The durable queue's drain: the burst's results stored per second.
    pub drain_secs: f64,
    pub drain_per_sec: f64,
    /// The file's upload.
    pub upload_secs: f64,
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
}

/// Drains a burst of `lines`, then runs the same requests as one batch through the gateway at
/// `gateway_url` (its `/v1`).
pub async fn run(
    target: &Target,
    meter: &Meter,
    gateway_url: &str,
    lines: u64,
    reply_tokens: usize,
    workers: u32,
) -> anyhow::Result<BatchReport> {
    eprintln!("gateway phase: the durable queue's drain of {lines} requests");
    let drain = durable::run(target, lines, reply_tokens, meter, true).await?;
    eprintln!("gateway phase: a batch of {lines} lines");
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
    let batch = loop {
        tokio::time::sleep(POLL).await;
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
        if done != last_progress.1 {
            last_progress = (Instant::now(), done);
        } else if last_progress.0.elapsed() > target.timeout {
            anyhow::bail!(
                "the batch made no progress for {:?}: {batch}",
                target.timeout
            );
        }
    };
    let batch_secs = started.elapsed().as_secs_f64();
    let spent = meter.stop(cost).await;
    let completed = batch["request_counts"]["completed"].as_u64().unwrap_or(0);
    let batch_per_sec = completed as f64 / batch_secs.max(1e-9);
    Ok(BatchReport {
        lines,
        workers,
        drain_secs: drain.drain_secs,
        drain_per_sec: drain.drain_per_sec,
        upload_secs,
        batch_secs,
        batch_per_sec,
        status: batch["status"].as_str().unwrap_or_default().to_string(),
        completed,
        failed: batch["request_counts"]["failed"].as_u64().unwrap_or(0),
        batch_vs_drain: (drain.drain_per_sec > 0.0).then(|| batch_per_sec / drain.drain_per_sec),
        drain_processes: drain.processes,
        batch_processes: spent.per_request(completed).processes,
    })
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

/// The batch's target: its rate against the drain's, with two workers.
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
