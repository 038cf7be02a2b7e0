//! Interactive load (also the streaming relay, with long replies): concurrent clients, each in
//! a loop of choose a request id, subscribe to its events, submit, read the events until
//! `finished`. Timed from sending the submit (the first one, when NO_SLOT_AVAILABLE replies
//! make the client try again) to the first `delta` and to `finished`.
//!
//! Events travel on core NATS (at most once), so each request's `seq` numbers are checked for
//! gaps and its deltas, put together, are compared with the `output` that `finished` carries:
//! a relayed delta that went missing shows in both.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use serde::Serialize;

use super::budget::Budget;
use super::latency::{Samples, Summary};
use super::meter::Meter;
use super::monitor::BusOps;
use super::procstat::ProcessUsage;
use super::progress::Progress;
use super::target::Target;
use super::workload;
use crate::protocol::Accepted;
use crate::protocol::{ErrorCode, ErrorReply, Event, EventBody, GenerationRequest, RequestState};

/// The pause before a submit refused with NO_SLOT_AVAILABLE is sent again (plus up to as much
/// jitter): short, so the refusals a run counts are what the fleet says, not what a slow
/// retry hides.
const NO_SLOT_PAUSE: Duration = Duration::from_millis(2);

/// One phase of submit-and-follow load.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// `interactive` or `streaming`: the phase's name in request ids and progress.
    pub phase: &'static str,
    pub concurrency: usize,
    pub reply_tokens: usize,
    pub requests: Option<u64>,
    pub duration: Option<Duration>,
}

/// What a phase of submit-and-follow load measured.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    pub concurrency: usize,
    pub reply_tokens: usize,
    /// Requests started (each submitted at least once).
    pub requests: u64,
    /// Requests that ended with `finished` COMPLETED.
    pub completed: u64,
    /// Requests that did not: submit refused (other than NO_SLOT_AVAILABLE), no `finished`
    /// in time, FAILED or CANCELLED results, undecodable events.
    pub errors: u64,
    pub error_kinds: BTreeMap<String, u64>,
    /// NO_SLOT_AVAILABLE replies (and no-responders) that were tried again.
    pub no_slot_replies: u64,
    /// NO_SLOT_AVAILABLE replies per submit sent.
    pub no_slot_rate: f64,
    pub duration_secs: f64,
    /// Completed requests per second.
    pub requests_per_sec: f64,
    pub submit_to_result_ms: Option<Summary>,
    pub submit_to_first_delta_ms: Option<Summary>,
    /// From sending the submit to the worker's acceptance (its reply): the part of
    /// submit→result spent before the generation starts.
    pub submit_to_accepted_ms: Option<Summary>,
    /// Tokens (words) in the delta events received.
    pub tokens_relayed: u64,
    pub tokens_per_sec: f64,
    /// Tokens the backend reported generating (`usage.completion_tokens` of the results).
    pub completion_tokens: u64,
    /// Events missing from the `seq` numbering (at-most-once delivery lost them).
    pub missing_events: u64,
    pub requests_with_gaps: u64,
    /// Requests whose deltas, put together, differ from their result's `output`.
    pub delta_mismatches: u64,
    pub processes: Vec<ProcessUsage>,
    /// Bus operations per completed request, from nats-server's counters.
    pub bus: Option<BusOps>,
}

/// How one request went.
#[derive(Debug, Default)]
pub(super) struct Outcome {
    pub accepted: Option<Duration>,
    pub submit_to_result: Option<Duration>,
    pub first_delta: Option<Duration>,
    pub no_slot: u64,
    pub submits: u64,
    pub error: Option<String>,
    pub tokens: u64,
    pub completion_tokens: u64,
    pub missing_events: u64,
    pub delta_mismatch: bool,
}

/// What one client gathered.
#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    completed: u64,
    errors: BTreeMap<String, u64>,
    no_slot: u64,
    submits: u64,
    results: Samples,
    first_deltas: Samples,
    accepted: Samples,
    tokens: u64,
    completion_tokens: u64,
    missing_events: u64,
    requests_with_gaps: u64,
    delta_mismatches: u64,
    finished_ids: Vec<String>,
}

impl Tally {
    fn add(&mut self, request_id: String, outcome: Outcome) {
        self.requests += 1;
        self.no_slot += outcome.no_slot;
        self.submits += outcome.submits;
        self.tokens += outcome.tokens;
        self.completion_tokens += outcome.completion_tokens;
        self.missing_events += outcome.missing_events;
        self.requests_with_gaps += u64::from(outcome.missing_events > 0);
        self.delta_mismatches += u64::from(outcome.delta_mismatch);
        if let Some(latency) = outcome.submit_to_result {
            self.finished_ids.push(request_id);
            self.results.push(latency);
        }
        if let Some(latency) = outcome.first_delta {
            self.first_deltas.push(latency);
        }
        if let Some(latency) = outcome.accepted {
            self.accepted.push(latency);
        }
        match outcome.error {
            None => self.completed += 1,
            Some(kind) => *self.errors.entry(kind).or_default() += 1,
        }
    }

    fn merge(&mut self, other: Tally) {
        self.requests += other.requests;
        self.completed += other.completed;
        for (kind, n) in other.errors {
            *self.errors.entry(kind).or_default() += n;
        }
        self.no_slot += other.no_slot;
        self.submits += other.submits;
        self.results.extend(other.results);
        self.first_deltas.extend(other.first_deltas);
        self.accepted.extend(other.accepted);
        self.tokens += other.tokens;
        self.completion_tokens += other.completion_tokens;
        self.missing_events += other.missing_events;
        self.requests_with_gaps += other.requests_with_gaps;
        self.delta_mismatches += other.delta_mismatches;
        self.finished_ids.extend(other.finished_ids);
    }
}

/// A few requests, one per client, to open connections and warm caches before measuring.
pub async fn warm_up(target: &Target, phase: &str, concurrency: usize, reply_tokens: usize) {
    let clients = (0..concurrency.min(target.connections.len())).map(|client| async move {
        let id = target.request_id(&format!("{phase}-warmup"), client as u64);
        let request = workload::request(id.clone(), reply_tokens);
        let outcome = one_request(target, client, request).await;
        if let Some(error) = outcome.error {
            tracing::warn!(message = "a warm-up request failed", %error);
        }
        id
    });
    let ids = futures_util::future::join_all(clients).await;
    target.release(ids).await;
}

/// Runs one phase and reports it, with what it cost as `meter` reads it.
pub async fn run(
    target: &Target,
    spec: &LoadSpec,
    meter: &Meter,
    release_results: bool,
) -> LoadReport {
    let budget = Arc::new(Budget::new(spec.requests, spec.duration));
    let progress = Progress::start(spec.phase, budget.clone());
    let start = meter.start().await;
    let started = Instant::now();
    let clients = (0..spec.concurrency).map(|client| {
        let budget = budget.clone();
        async move {
            let mut tally = Tally::default();
            while let Some(n) = budget.take() {
                let id = target.request_id(spec.phase, n);
                let request = workload::request(id.clone(), spec.reply_tokens);
                let outcome = one_request(target, client, request).await;
                tally.add(id, outcome);
                budget.done();
            }
            tally
        }
    });
    let tallies = futures_util::future::join_all(clients).await;
    let wall = started.elapsed();
    let spent = meter.stop(start).await;
    progress.finish();
    let mut tally = Tally::default();
    for t in tallies {
        tally.merge(t);
    }
    let cost = spent.per_request(tally.completed);
    let secs = wall.as_secs_f64().max(1e-9);
    let report = LoadReport {
        concurrency: spec.concurrency,
        reply_tokens: spec.reply_tokens,
        requests: tally.requests,
        completed: tally.completed,
        errors: tally.errors.values().sum(),
        error_kinds: tally.errors.clone(),
        no_slot_replies: tally.no_slot,
        no_slot_rate: if tally.submits == 0 {
            0.0
        } else {
            tally.no_slot as f64 / tally.submits as f64
        },
        duration_secs: secs,
        requests_per_sec: tally.completed as f64 / secs,
        submit_to_result_ms: tally.results.summary(),
        submit_to_first_delta_ms: tally.first_deltas.summary(),
        submit_to_accepted_ms: tally.accepted.summary(),
        tokens_relayed: tally.tokens,
        tokens_per_sec: tally.tokens as f64 / secs,
        completion_tokens: tally.completion_tokens,
        missing_events: tally.missing_events,
        requests_with_gaps: tally.requests_with_gaps,
        delta_mismatches: tally.delta_mismatches,
        processes: cost.processes,
        bus: cost.bus,
    };
    if release_results {
        target.release(tally.finished_ids).await;
    }
    report
}

/// Subscribe, submit, follow until `finished`.
pub(super) async fn one_request(
    target: &Target,
    client: usize,
    request: GenerationRequest,
) -> Outcome {
    let request_id = request.request_id.clone().unwrap_or_default();
    let mut outcome = Outcome::default();
    let nats = target.connection(client);
    // Subscribed on the connection the submit goes out on, so the server has the
    // subscription before the worker can publish the first event.
    let mut events = match nats.subscribe(target.subjects.events(&request_id)).await {
        Ok(events) => events,
        Err(error) => {
            outcome.error = Some(format!("subscribe: {error}"));
            return outcome;
        }
    };
    let body: Bytes = serde_json::to_vec(&request)
        .expect("requests serialize")
        .into();
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + target.timeout;
    if let Err(kind) = submit(target, nats, body, deadline, &mut outcome).await {
        outcome.error = Some(kind);
        return outcome;
    }
    outcome.accepted = Some(started.elapsed());
    let mut next_seq = 0u64;
    let mut text = String::new();
    loop {
        let message = match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(message)) => message,
            Ok(None) => {
                outcome.error = Some("event subscription closed".into());
                break;
            }
            Err(_) => {
                outcome.error = Some("no finished event in time".into());
                break;
            }
        };
        let Ok(event) = Event::from_json(&message.payload) else {
            outcome.error = Some("undecodable event".into());
            break;
        };
        outcome.missing_events += event.seq.saturating_sub(next_seq);
        next_seq = next_seq.max(event.seq + 1);
        match event.body {
            EventBody::Delta { text: piece } => {
                outcome.first_delta.get_or_insert_with(|| started.elapsed());
                text.push_str(&piece);
            }
            EventBody::Finished { result } => {
                outcome.submit_to_result = Some(started.elapsed());
                outcome.tokens = workload::count_tokens(&text) as u64;
                outcome.completion_tokens = result.usage.completion_tokens;
                outcome.delta_mismatch = text != result.output;
                if result.state != RequestState::Completed {
                    outcome.error = Some(format!(
                        "{} {}",
                        result.state.as_str(),
                        result.reason.as_str()
                    ));
                }
                break;
            }
            _ => {}
        }
    }
    let _ = events.unsubscribe().await;
    outcome
}

/// Sends the submit until a worker accepts it; NO_SLOT_AVAILABLE (and no responders: no
/// worker has a free slot) is counted and tried again until the deadline. The error kind
/// otherwise.
async fn submit(
    target: &Target,
    nats: &async_nats::Client,
    body: Bytes,
    deadline: tokio::time::Instant,
    outcome: &mut Outcome,
) -> Result<(), String> {
    let subject = target.subjects.submit(&target.pool);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err("NO_SLOT_AVAILABLE until the timeout".into());
        }
        outcome.submits += 1;
        let request = async_nats::Request::new()
            .payload(body.clone())
            .timeout(Some(left));
        match nats.send_request(subject.clone(), request).await {
            Ok(reply) => {
                if let Ok(error) = serde_json::from_slice::<ErrorReply>(&reply.payload) {
                    if error.error.code != ErrorCode::NoSlotAvailable {
                        return Err(error.error.code.as_str().to_string());
                    }
                } else if serde_json::from_slice::<Accepted>(&reply.payload).is_ok() {
                    return Ok(());
                } else {
                    return Err("unreadable submit reply".into());
                }
            }
            Err(error) if error.kind() == async_nats::RequestErrorKind::NoResponders => {}
            Err(error) if error.kind() == async_nats::RequestErrorKind::TimedOut => {
                return Err("submit timed out".into());
            }
            Err(error) => return Err(format!("submit: {error}")),
        }
        outcome.no_slot += 1;
        let jitter =
            Duration::from_micros(u64::from(ulid::Ulid::generate().random() as u16) % 2000);
        tokio::time::sleep(NO_SLOT_PAUSE + jitter).await;
    }
}
