//! Memory of a worker (`--local` only): the resident set of a fresh worker with many slots,
//! then with requests running in them (the mock answers them slowly, so they stay running
//! while the worker is read). What each running request adds is the growth divided by their
//! number, less the request's own conversation text.

use std::time::Duration;

use serde::Serialize;

use super::local::LocalFleet;
use super::procstat;
use super::target::Target;
use super::workload;
use crate::protocol::{ErrorCode, ErrorReply};

/// How long the worker settles before it is read: after start (heartbeat, first backend probe)
/// and after the requests started (each has its backend stream open and some tokens in).
const SETTLE: Duration = Duration::from_millis(1500);

#[derive(Debug, Clone)]
pub struct MemorySpec {
    pub slots: u32,
    pub running: u32,
    pub prompt_bytes: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    pub slots: u32,
    /// Resident set of the fresh worker, MiB.
    pub idle_rss_mib: f64,
    /// Requests running when the worker was read again.
    pub running: u32,
    pub running_rss_mib: f64,
    /// Bytes of conversation text each request carries (its user message).
    pub conversation_bytes: usize,
    /// (running − idle) / running − conversation text, KiB.
    pub per_request_kib: f64,
    pub peak_rss_mib: f64,
}

pub async fn run(
    fleet: &LocalFleet,
    target: &Target,
    spec: &MemorySpec,
) -> anyhow::Result<MemoryReport> {
    let pool = "bench-memory";
    let worker = fleet
        .start_worker("bench-memory-worker", pool, spec.slots)
        .await?;
    let pid = worker
        .pid()
        .ok_or_else(|| anyhow::anyhow!("the memory worker has no pid"))?;
    tokio::time::sleep(SETTLE).await;
    let idle = procstat::memory(pid)
        .ok_or_else(|| anyhow::anyhow!("cannot read the worker's memory from /proc"))?;

    let bar = super::progress::Progress::counting("memory", u64::from(spec.running));
    bar.set_message("requests running");
    let subject = target.subjects.submit(pool);
    let conversation_bytes = workload::held_request(String::new(), spec.prompt_bytes).messages[0]
        .text()
        .len();
    let submits = (0..spec.running).map(|n| {
        let request =
            workload::held_request(target.request_id("memory", u64::from(n)), spec.prompt_bytes);
        let body = serde_json::to_vec(&request).expect("requests serialize");
        let nats = target.connection(n as usize).clone();
        let subject = subject.clone();
        let bar = bar.clone();
        async move {
            let request = async_nats::Request::new()
                .payload(body.into())
                .timeout(Some(Duration::from_secs(10)));
            let reply = nats.send_request(subject, request).await?;
            if let Ok(error) = serde_json::from_slice::<ErrorReply>(&reply.payload) {
                anyhow::ensure!(
                    error.error.code != ErrorCode::NoSlotAvailable,
                    "the memory worker has fewer free slots than requests asked to run"
                );
                anyhow::bail!("a held request was refused: {}", error.error.message);
            }
            bar.inc(1);
            Ok(())
        }
    });
    let submitted: Vec<anyhow::Result<()>> = futures_util::future::join_all(submits).await;
    bar.finish_and_clear();
    submitted.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    tokio::time::sleep(SETTLE).await;
    let running = procstat::memory(pid)
        .ok_or_else(|| anyhow::anyhow!("cannot read the worker's memory from /proc"))?;
    drop(worker);

    let growth_kib = running.rss_kib.saturating_sub(idle.rss_kib) as f64;
    let per_request_kib =
        growth_kib / f64::from(spec.running.max(1)) - conversation_bytes as f64 / 1024.0;
    Ok(MemoryReport {
        slots: spec.slots,
        idle_rss_mib: procstat::kib_to_mib(idle.rss_kib),
        running: spec.running,
        running_rss_mib: procstat::kib_to_mib(running.rss_kib),
        conversation_bytes,
        per_request_kib,
        peak_rss_mib: procstat::kib_to_mib(running.peak_rss_kib),
    })
}
