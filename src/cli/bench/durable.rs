//! Durable load: a burst of requests put on the queue at once (JetStream publishes with their
//! acknowledgements awaited), then the time until every result is stored. A result is stored
//! before its `finished` event goes out, so `finished` marks the moment; one listener follows
//! the events of the whole burst. A `finished` that core NATS lost is made up for by asking
//! for the stored result, and counted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;

use super::latency::{Samples, Summary};
use super::meter::Meter;
use super::monitor::BusOps;
use super::procstat::ProcessUsage;
use super::progress::Progress;
use super::target::Target;
use super::workload;
use crate::protocol::{Event, EventBody, GenerationResult, RequestState};

/// Publishes waiting for their acknowledgement at once.
const PUBLISHES_IN_FLIGHT: usize = 256;

#[derive(Debug, Clone, Serialize)]
pub struct DurableReport {
    pub burst: u64,
    pub reply_tokens: usize,
    /// From the first publish to the last acknowledgement.
    pub enqueue_secs: f64,
    pub enqueue_per_sec: f64,
    /// Publishes the queue did not acknowledge.
    pub enqueue_errors: u64,
    /// From the first publish to the last result stored.
    pub drain_secs: f64,
    /// Results stored per second over the drain.
    pub drain_per_sec: f64,
    pub completed: u64,
    /// Results not COMPLETED, or not stored in time.
    pub errors: u64,
    /// Requests whose `finished` event was not received (their stored result was read).
    pub missed_finished_events: u64,
    /// From a request's publish to its `finished` event (queue time included).
    pub enqueue_to_finished_ms: Option<Summary>,
    pub processes: Vec<ProcessUsage>,
    /// Bus operations per completed request (the enqueue included), from nats-server's
    /// counters.
    pub bus: Option<BusOps>,
}

/// When each request of the burst was seen finished, and how it ended.
type Finished = Option<(Instant, RequestState)>;

/// Puts a burst of `burst` requests on the queue (their ids named by `phase`, unique in the
/// run) and waits for their results.
pub async fn run(
    target: &Target,
    phase: &str,
    burst: u64,
    reply_tokens: usize,
    meter: &Meter,
    release_results: bool,
) -> anyhow::Result<DurableReport> {
    let ids: Vec<String> = (0..burst).map(|n| target.request_id(phase, n)).collect();
    let index: HashMap<String, usize> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.clone(), i))
        .collect();
    let finished: Arc<Mutex<Vec<Finished>>> = Arc::new(Mutex::new(vec![None; ids.len()]));
    let bar = Progress::counting("durable", burst);
    bar.set_message("results stored");

    // Listening before the first publish, on a connection of its own.
    let listener = crate::client::connect::connect(
        &target.settings.nats,
        crate::client::connect::ConnectPurpose::Client,
    )
    .await?;
    let mut events = listener.subscribe(target.subjects.events("*")).await?;
    listener.flush().await?;
    let (all_done_tx, all_done) = tokio::sync::oneshot::channel::<()>();
    let listen = {
        let finished = finished.clone();
        let bar = bar.clone();
        tokio::spawn(async move {
            let mut left = index.len();
            let mut all_done_tx = Some(all_done_tx);
            while let Some(message) = events.next().await {
                let Ok(event) = Event::from_json(&message.payload) else {
                    continue;
                };
                let EventBody::Finished { result } = event.body else {
                    continue;
                };
                let Some(&i) = index.get(&event.request_id) else {
                    continue;
                };
                let mut slots = finished.lock().unwrap_or_else(|e| e.into_inner());
                if slots[i].is_none() {
                    slots[i] = Some((Instant::now(), result.state));
                    left -= 1;
                    bar.inc(1);
                    if left == 0
                        && let Some(tx) = all_done_tx.take()
                    {
                        let _ = tx.send(());
                    }
                }
            }
        })
    };

    let start = meter.start().await;
    let started = Instant::now();
    let jetstream = async_nats::jetstream::new(target.connection(0).clone());
    let enqueued: Vec<Option<Instant>> = futures_util::stream::iter(ids.iter().cloned())
        .map(|id| {
            let jetstream = jetstream.clone();
            let subject = target.subjects.queue(&target.pool, &id);
            async move {
                let body = serde_json::to_vec(&workload::request(id.clone(), reply_tokens))
                    .expect("requests serialize");
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", id.as_str());
                let at = Instant::now();
                let ack = jetstream
                    .publish_with_headers(subject, headers, body.into())
                    .await;
                match ack {
                    Ok(ack) => ack.await.ok().map(|_| at),
                    Err(_) => None,
                }
            }
        })
        .buffered(PUBLISHES_IN_FLIGHT)
        .collect()
        .await;
    let enqueue_secs = started.elapsed().as_secs_f64();
    let enqueue_errors = enqueued.iter().filter(|e| e.is_none()).count() as u64;

    // Wait for the whole burst, as long as results keep coming.
    let mut all_done = all_done;
    let mut last_count = 0;
    let mut last_progress = Instant::now();
    loop {
        let count = finished
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|f| f.is_some())
            .count();
        if count as u64 + enqueue_errors >= burst {
            break;
        }
        if count != last_count {
            last_count = count;
            last_progress = Instant::now();
        } else if last_progress.elapsed() > target.timeout {
            break;
        }
        tokio::select! {
            _ = &mut all_done => break,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    let spent = meter.stop(start).await;
    listen.abort();
    bar.finish_and_clear();

    // Finished events core NATS did not deliver: the stored result says how the request ended.
    let mut slots = finished.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut missed = 0;
    for (i, slot) in slots.iter_mut().enumerate() {
        if slot.is_none()
            && enqueued[i].is_some()
            && let Some(state) = peek_state(target, &ids[i]).await
        {
            missed += 1;
            // Its time is unknown; it counts as done at the end of the drain.
            *slot = Some((Instant::now(), state));
        }
    }
    let mut latencies = Samples::default();
    let mut completed = 0;
    let mut last = started;
    for (slot, at) in slots.iter().zip(&enqueued) {
        if let (Some((done, state)), Some(at)) = (slot, at) {
            latencies.push(done.duration_since(*at));
            last = last.max(*done);
            completed += u64::from(*state == RequestState::Completed);
        }
    }
    let drain_secs = last.duration_since(started).as_secs_f64().max(1e-9);
    let cost = spent.per_request(completed);
    if release_results {
        target.release(ids).await;
    }
    Ok(DurableReport {
        burst,
        reply_tokens,
        enqueue_secs,
        enqueue_per_sec: (burst - enqueue_errors) as f64 / enqueue_secs.max(1e-9),
        enqueue_errors,
        drain_secs,
        drain_per_sec: latencies.len() as f64 / drain_secs,
        completed,
        errors: burst - completed,
        missed_finished_events: missed,
        enqueue_to_finished_ms: latencies.summary(),
        processes: cost.processes,
        bus: cost.bus,
    })
}

/// The stored result's state, read without releasing it.
async fn peek_state(target: &Target, request_id: &str) -> Option<RequestState> {
    let request = async_nats::Request::new()
        .payload(br#"{"release": false}"#.as_slice().into())
        .timeout(Some(Duration::from_secs(5)));
    let reply = target
        .connection(0)
        .send_request(target.subjects.result(request_id), request)
        .await
        .ok()?;
    serde_json::from_slice::<GenerationResult>(&reply.payload)
        .ok()
        .map(|r| r.state)
}
