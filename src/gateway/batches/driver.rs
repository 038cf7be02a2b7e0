//! Batches driven to their end: one replica at a time drives a batch, under a lease in its
//! record, and any other takes it over once the lease ran out (that replica stopped or died).
//!
//! Each replica's keeper looks at the batches every [`TICK`] and takes those that are not
//! final and whose lease ran out. The driver sends the lines as durable requests in band
//! `low`, at most `gateway.batch_window` at once, each with an id made of the batch's and its
//! line number, follows each to its end (every line's events on one subscription, an
//! [`EventFanout`]), and keeps each line's outcome in the lines bucket
//! before releasing its result. Every tick it renews its lease and writes its counts, and
//! reads whether the batch was cancelled or expired. Once every line ended it writes the output
//! and error files, and the batch's end.
//!
//! Architecture invariants:
//! - Nothing runs twice: a line's request id is the same for every driver. Lines the record
//!   says may have been sent (below `reserved`, written before they are) are looked up before
//!   they are sent again; one that exists is followed, not sent.
//! - Nothing accepted is lost: a line's outcome is kept before its result is released, so a
//!   driver that dies between the two leaves a result the next one reads.
//!
//! The lines' results are released once the batch ended (or its driver stopped, however): kept
//! in their outcomes, they are only housekeeping, which waits rather than take the fleet from
//! the lines still to run. Those of a driver that died age out of the results bucket
//! (`jetstream.results_ttl_ms`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde_json::json;
use serde_json::value::RawValue;

use super::lines::{self, Line};
use crate::client::batches::{KeptLine, LineOutcome, Record};
use crate::client::fanout::FannedEvents;
use crate::client::{Client, ClientError};
use crate::gateway::Shared;
use crate::gateway::collect::{Collected, Collector};
use crate::gateway::error::ApiError;
use crate::gateway::mapping::{Ending, Mapped};
use crate::gateway::openai::{Completion, parse_request};
use crate::gateway::responses::wire::{self, Outcome};
use crate::gateway::responses::{Job, prepare_job};
use crate::gateway::run::enqueue;
use crate::protocol::{ErrorCode, Priority};

/// How often a keeper looks for batches to take, and a driver renews its lease.
pub const TICK: Duration = Duration::from_secs(1);

/// How long a lease holds without being renewed.
pub const LEASE: Duration = Duration::from_secs(10);

/// Most batches one replica drives at once (each holds its input in memory, and its lines'
/// answers as they end): the others wait for a replica with room.
pub const MAX_DRIVEN: usize = 4;

/// Lines whose outcomes are kept together as one chunk, at the most (a chunk is also kept
/// every tick).
const CHUNK_LINES: usize = 256;

/// The window is topped up once this part of it ended.
const REFILL_PART: usize = 8;

/// Results released at once, once the batch ended.
const RELEASES_AT_ONCE: usize = 64;

/// Why a driver stops when another replica took its batch over.
const LOST: &str = "another replica drives the batch now";

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// This replica's keeper: takes the batches whose lease ran out and drives them, until the
/// gateway stops.
pub(crate) async fn keep(shared: Arc<Shared>) {
    let mut driving: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut ended: HashSet<String> = HashSet::new();
    loop {
        tokio::select! {
            _ = shared.stopping.cancelled() => return,
            _ = tokio::time::sleep(TICK) => {}
            _ = shared.batch_wake.notified() => {}
        }
        driving.retain(|_, task| !task.is_finished());
        let keys = match shared.batches.keys().await {
            Ok(keys) => keys,
            Err(error) => {
                tracing::warn!(message = "the batches cannot be listed", %error);
                continue;
            }
        };
        for key in keys {
            if driving.len() >= MAX_DRIVEN {
                break;
            }
            if driving.contains_key(&key) || ended.contains(&key) {
                continue;
            }
            let Ok(Some(read)) = shared.batches.get_by_key(&key).await else {
                continue;
            };
            if read.record.is_final() {
                ended.insert(key);
                continue;
            }
            let now = now_ms();
            if read.record.owner != shared.replica && read.record.lease_until_ms > now {
                continue;
            }
            let mut record = read.record;
            record.owner = shared.replica.clone();
            record.lease_until_ms = now + LEASE.as_millis() as u64;
            if let Ok(Some(revision)) = shared.batches.update(&record, read.revision).await {
                tracing::info!(message = "driving a batch", batch = %key);
                let task = tokio::spawn(drive(shared.clone(), record, revision));
                driving.insert(key, task);
            }
        }
    }
}

/// Why a batch stopped sending lines before its end.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stop {
    Cancelled,
    Expired,
}

struct Driver {
    shared: Arc<Shared>,
    client: Client,
    record: Record,
    revision: u64,
    id: String,
    tenant: String,
    endpoint: String,
    lines: Vec<Arc<Line>>,
    line_run: Arc<LineRun>,
    /// Requests whose outcomes are kept: their stored results are released at the end.
    kept_results: Vec<String>,
    /// The output or error file's line of each line this driver kept the outcome of, by line
    /// number: the files are written from them, unless an earlier driver kept some.
    kept_lines: HashMap<usize, (bool, String)>,
    /// The chunks of outcomes kept before this driver took the batch.
    inherited_chunks: usize,
    completed: u64,
    failed: u64,
    stop: Option<Stop>,
}

/// Whether a batch was asked to stop (cancelled) or ran out of time (expired) at `now`
/// (seconds since the epoch).
fn stop_of(record: &Record, now: u64) -> Option<Stop> {
    if record.status() == "cancelling" {
        return Some(Stop::Cancelled);
    }
    let expires_at = record.batch["expires_at"].as_u64().unwrap_or(u64::MAX);
    (now >= expires_at).then_some(Stop::Expired)
}

/// What renewing the lease found.
enum Renewed {
    Held,
    /// Another replica holds the batch now (or it is gone): this driver stops.
    Lost,
}

async fn drive(shared: Arc<Shared>, record: Record, revision: u64) {
    let id = record.batch["id"].as_str().unwrap_or_default().to_string();
    let tenant = record.tenant.clone();
    let client = if tenant.is_empty() {
        shared.client.clone()
    } else {
        match shared.client.clone().with_tenant(&tenant) {
            Ok(client) => client,
            Err(error) => {
                tracing::warn!(message = "a batch's tenant is not valid", %error, batch = %id);
                return;
            }
        }
    };
    let endpoint = record.batch["endpoint"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let line_run = Arc::new(LineRun {
        shared: shared.clone(),
        client: client.clone(),
        tenant: tenant.clone(),
        batch_id: id.clone(),
        endpoint: endpoint.clone(),
        expires_at: record.batch["expires_at"].as_u64().unwrap_or(0),
    });
    let mut driver = Driver {
        shared,
        client,
        record,
        revision,
        id,
        tenant,
        endpoint,
        lines: Vec::new(),
        line_run,
        kept_results: Vec::new(),
        kept_lines: HashMap::new(),
        inherited_chunks: 0,
        completed: 0,
        failed: 0,
        stop: None,
    };
    if let Err(error) = driver.run().await {
        tracing::warn!(message = "a batch's driver stopped", error = %error, batch = %driver.id);
    }
    // However it stopped: what it kept no longer needs its stored results.
    driver.release_kept();
}

impl Driver {
    async fn run(&mut self) -> Result<(), String> {
        let file_id = self.record.batch["input_file_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let input = match self.shared.files.read(&self.tenant, &file_id).await {
            Ok(Some(input)) => input,
            Ok(None) => {
                return self
                    .fail("invalid_file", &format!("the input file {file_id} is gone"))
                    .await;
            }
            Err(error) => return Err(error.to_string()),
        };
        self.lines = lines::parse(&input, &self.endpoint)
            .into_iter()
            .map(Arc::new)
            .collect();
        drop(input);
        if self.lines.is_empty() {
            return self.fail("empty_file", "the input file has no line").await;
        }
        if self.record.status() == "validating" {
            let now = (now_ms() / 1000).into();
            self.record.batch["status"] = "in_progress".into();
            self.record.batch["in_progress_at"] = now;
            self.record.batch["request_counts"]["total"] = self.lines.len().into();
            self.write().await?;
        }
        tracing::info!(message = "a batch's lines are read", batch = %self.id, lines = self.lines.len());
        // What ended under an earlier driver.
        self.inherited_chunks = self.record.chunks;
        let kept = self.kept().await?;
        let mut pending = Vec::new();
        for place in 0..self.lines.len() {
            match kept.get(&self.lines[place].number) {
                Some(outcome) => self.count(outcome.ok),
                None => pending.push(place),
            }
        }
        drop(kept);
        let mut unkept = Unkept::default();
        // The lines' events, on one subscription for the whole batch.
        let fanout = self
            .client
            .event_fanout()
            .await
            .map_err(|e| format!("cannot follow the lines' events: {e}"))?;
        self.stop = self.stop_asked();
        let reserved = self.record.reserved;
        let window = self.shared.settings.gateway.batch_window.max(1);
        // The window is topped up once an eighth of it ended, not line by line: the lines sent
        // together go out in one write, and the queue's acknowledgements come back together.
        let top_up_at = window - (window / REFILL_PART).max(1);
        let mut next = 0;
        let mut in_flight = FuturesUnordered::new();
        let mut running: HashSet<String> = HashSet::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let top_up = in_flight.len() <= top_up_at;
            while top_up && self.stop.is_none() && next < pending.len() && in_flight.len() < window
            {
                let place = pending[next];
                if place >= self.record.reserved {
                    // Written before the lines are sent: a driver taking over looks them up.
                    self.record.reserved = (place + window).min(self.lines.len());
                    self.write().await?;
                }
                let line = self.lines[place].clone();
                let request_id = format!("{}-{}", self.id, line.number);
                let bus_id = self.client.on_bus(&request_id);
                running.insert(bus_id.clone());
                // Followed from before it is sent; its text comes whole, from its result.
                let events = fanout.follow_ends(&bus_id);
                let line_run = self.line_run.clone();
                in_flight.push(async move {
                    let ran = line_run
                        .run(&line, request_id, &bus_id, place < reserved, events)
                        .await;
                    (bus_id, ran)
                });
                next += 1;
            }
            if in_flight.is_empty() && (next == pending.len() || self.stop.is_some()) {
                break;
            }
            tokio::select! {
                ended = in_flight.next() => {
                    let Some((bus_id, ran)) = ended else { continue };
                    running.remove(&bus_id);
                    match ran {
                        Some(ran) => {
                            self.count(ran.kept.ok);
                            unkept.outcomes.push(ran.kept);
                            unkept.results.extend(ran.release);
                            if unkept.outcomes.len() >= CHUNK_LINES {
                                self.keep(&mut unkept).await?;
                            }
                        }
                        // The bus went away: another driver picks the line up.
                        None => return Err("the bus connection closed".into()),
                    }
                }
                _ = tick.tick() => {
                    self.keep(&mut unkept).await?;
                    if let Renewed::Lost = self.renew().await? {
                        tracing::info!(message = "another replica drives the batch now", batch = %self.id);
                        return Ok(());
                    }
                    if self.stop.is_none() {
                        self.stop = self.stop_asked();
                        if let Some(stop) = self.stop {
                            tracing::info!(message = "a batch stops", batch = %self.id, ?stop);
                            for request_id in &running {
                                let _ = self.shared.client.cancel_because(request_id, "its batch was cancelled or expired").await;
                            }
                        }
                    }
                }
                _ = self.shared.stopping.cancelled() => {
                    // Another replica takes it over at once; the lines running go on.
                    let _ = self.keep(&mut unkept).await;
                    self.record.owner.clear();
                    self.record.lease_until_ms = 0;
                    let _ = self.shared.batches.update(&self.record, self.revision).await;
                    return Ok(());
                }
            }
        }
        self.keep(&mut unkept).await?;
        self.finish().await
    }

    /// The outcomes kept so far, by line number.
    async fn kept(&self) -> Result<HashMap<usize, LineOutcome>, String> {
        let outcomes = self
            .shared
            .batches
            .outcomes(&self.tenant, &self.id, self.record.chunks)
            .await
            .map_err(|e| e.to_string())?;
        Ok(outcomes.into_iter().collect())
    }

    /// Keeps the outcomes of the lines that ended as the next chunk and counts it in the
    /// record; only then may their results be released ([`Driver::release_kept`]): a driver
    /// that dies before leaves them for the next one to read.
    async fn keep(&mut self, unkept: &mut Unkept) -> Result<(), String> {
        if unkept.outcomes.is_empty() {
            return Ok(());
        }
        let chunk = self.record.chunks + 1;
        self.shared
            .batches
            .put_chunk(&self.tenant, &self.id, chunk, &unkept.outcomes)
            .await
            .map_err(|e| e.to_string())?;
        self.record.chunks = chunk;
        self.write().await?;
        self.kept_lines.extend(
            unkept
                .outcomes
                .drain(..)
                .map(|kept| (kept.number, (kept.ok, kept.text))),
        );
        self.kept_results.append(&mut unkept.results);
        Ok(())
    }

    /// Releases the stored results of the lines whose outcomes are kept, in the background.
    fn release_kept(&mut self) {
        let releases = std::mem::take(&mut self.kept_results);
        if releases.is_empty() {
            return;
        }
        let client = self.shared.client.clone();
        tokio::spawn(async move {
            futures_util::stream::iter(releases)
                .for_each_concurrent(RELEASES_AT_ONCE, |request_id| {
                    let client = client.clone();
                    async move {
                        let _ = client.result(&request_id, true).await;
                    }
                })
                .await;
        });
    }

    fn count(&mut self, ok: bool) {
        if ok {
            self.completed += 1;
        } else {
            self.failed += 1;
        }
    }

    fn stop_asked(&self) -> Option<Stop> {
        stop_of(&self.record, now_ms() / 1000)
    }

    /// Writes the record (with the counts) over the revision held. Another write came first
    /// when the revision moved on: a cancel (taken in while the batch runs) or another
    /// replica's take-over (then this driver stops).
    async fn write(&mut self) -> Result<(), String> {
        for _ in 0..8 {
            self.record.batch["request_counts"]["completed"] = self.completed.into();
            self.record.batch["request_counts"]["failed"] = self.failed.into();
            match self
                .shared
                .batches
                .update(&self.record, self.revision)
                .await
            {
                Ok(Some(revision)) => {
                    self.revision = revision;
                    return Ok(());
                }
                Ok(None) => {}
                Err(error) => return Err(error.to_string()),
            }
            let read = match self.shared.batches.get(&self.tenant, &self.id).await {
                Ok(Some(read)) => read,
                Ok(None) => return Err("the batch is gone".into()),
                Err(error) => return Err(error.to_string()),
            };
            if read.record.owner != self.shared.replica {
                return Err(LOST.into());
            }
            let running = matches!(self.record.status(), "validating" | "in_progress");
            if read.record.status() == "cancelling" && running {
                self.record.batch["status"] = "cancelling".into();
                self.record.batch["cancelling_at"] = read.record.batch["cancelling_at"].clone();
            }
            self.revision = read.revision;
        }
        Err("the batch's record kept changing".into())
    }

    /// Renews the lease (and writes the counts, and takes in a cancel).
    async fn renew(&mut self) -> Result<Renewed, String> {
        self.record.lease_until_ms = now_ms() + LEASE.as_millis() as u64;
        match self.write().await {
            Ok(()) => Ok(Renewed::Held),
            Err(error) if error == LOST => Ok(Renewed::Lost),
            Err(error) => Err(error),
        }
    }

    async fn fail(&mut self, code: &str, message: &str) -> Result<(), String> {
        let now = now_ms() / 1000;
        self.record.batch["status"] = "failed".into();
        self.record.batch["failed_at"] = now.into();
        self.record.batch["errors"] = json!({"object": "list", "data": [
            {"code": code, "message": message, "param": "input_file_id", "line": null}
        ]});
        self.write().await
    }

    /// Writes the output and error files, and the batch's end.
    async fn finish(&mut self) -> Result<(), String> {
        let now = now_ms() / 1000;
        self.record.batch["status"] = "finalizing".into();
        self.record.batch["finalizing_at"] = now.into();
        self.write().await?;
        // Every outcome was kept by this driver (it holds their lines), or some by an earlier
        // one (they are all read back).
        let mut outcomes: HashMap<usize, (bool, String)> = match self.inherited_chunks {
            0 => std::mem::take(&mut self.kept_lines),
            _ => self
                .kept()
                .await?
                .into_iter()
                .map(|(number, outcome)| (number, (outcome.ok, outcome.line.to_string())))
                .collect(),
        };
        tracing::info!(message = "writing a batch's files", batch = %self.id, lines = outcomes.len());
        // Each file's room made once (a batch's output runs to megabytes).
        let room = |of_ok: bool| -> usize {
            outcomes
                .values()
                .filter(|(ok, _)| *ok == of_ok)
                .map(|(_, text)| text.len() + 1)
                .sum()
        };
        let (mut output, mut errors) = (
            Vec::with_capacity(room(true)),
            Vec::with_capacity(room(false)),
        );
        let (mut completed, mut failed) = (0u64, 0u64);
        for line in &self.lines {
            let (ok, text) = match outcomes.remove(&line.number) {
                Some(kept) => kept,
                None if self.stop == Some(Stop::Expired) => {
                    let error = lines::LineError {
                        code: "batch_expired",
                        message: format!(
                            "line {}: the batch expired before this line ran",
                            line.number
                        ),
                    };
                    (
                        false,
                        lines::not_a_request(&self.id, line, &error).to_string(),
                    )
                }
                None => continue,
            };
            let (file, count) = if ok {
                (&mut output, &mut completed)
            } else {
                (&mut errors, &mut failed)
            };
            file.extend_from_slice(text.as_bytes());
            file.push(b'\n');
            *count += 1;
        }
        for (bytes, key, name) in [
            (output, "output_file_id", "output"),
            (errors, "error_file_id", "error"),
        ] {
            if bytes.is_empty() {
                continue;
            }
            let filename = format!("{}_{name}.jsonl", self.id);
            let file = self
                .shared
                .files
                .put(&self.tenant, "batch_output", &filename, &bytes)
                .await
                .map_err(|e| e.to_string())?;
            self.record.batch[key] = file.id.into();
        }
        self.completed = completed;
        self.failed = failed;
        let now = now_ms() / 1000;
        let (status, at) = match self.stop {
            None => ("completed", "completed_at"),
            Some(Stop::Cancelled) => ("cancelled", "cancelled_at"),
            Some(Stop::Expired) => ("expired", "expired_at"),
        };
        self.record.batch["status"] = status.into();
        self.record.batch[at] = now.into();
        self.record.owner.clear();
        self.record.lease_until_ms = 0;
        self.write().await?;
        tracing::info!(message = "a batch ended", batch = %self.id, status, completed, failed);
        Ok(())
    }
}

/// Outcomes of lines that ended, not kept yet, and the requests whose results to release once
/// they are.
#[derive(Default)]
struct Unkept {
    outcomes: Vec<KeptLine>,
    results: Vec<String>,
}

/// A line's outcome, and the request whose stored result to release once it is kept.
struct Ran {
    kept: KeptLine,
    release: Option<String>,
}

/// What one line's run needs.
/// What every line of a batch runs with, shared by them.
struct LineRun {
    shared: Arc<Shared>,
    /// The batch's tenant's client.
    client: Client,
    tenant: String,
    batch_id: String,
    endpoint: String,
    expires_at: u64,
}

/// How a line's answer is written.
enum Answerer {
    Chat { model: String },
    Response(Box<Job>),
}

impl LineRun {
    fn refused(&self, line: &Line, error: &ApiError) -> Ran {
        Ran {
            kept: KeptLine {
                number: line.number,
                ok: false,
                text: lines::answered(
                    &self.batch_id,
                    line,
                    error.status(),
                    None,
                    &error.body_value(),
                ),
            },
            release: None,
        }
    }

    /// Runs one line to its end (`bus_id`: its request id on the bus); `None` when the bus
    /// went away before its end was known.
    async fn run(
        &self,
        line: &Line,
        request_id: String,
        bus_id: &str,
        maybe_sent: bool,
        events: FannedEvents,
    ) -> Option<Ran> {
        let body = match &line.body {
            Ok(body) => body,
            Err(error) => {
                return Some(Ran {
                    kept: KeptLine {
                        number: line.number,
                        ok: false,
                        text: lines::not_a_request(&self.batch_id, line, error).to_string(),
                    },
                    release: None,
                });
            }
        };
        let (mut mapped, answerer) = match self.map(body).await {
            Ok(mapped) => mapped,
            Err(error) => return Some(self.refused(line, &error)),
        };
        mapped.request.request_id = Some(request_id.clone());
        mapped.request.priority = Some(Priority::Low);
        mapped.durable = true;
        // A line may wait in the queue behind the rest of the window: it runs until the batch
        // expires, not gateway.max_request_ms.
        let left = (self.expires_at * 1000).saturating_sub(now_ms()).max(1);
        mapped.request.deadline_ms = Some(left);
        let client = &self.client;
        let mut follow = client.follow_chain_on(bus_id, mapped.follow_decisions, events);
        let known = maybe_sent
            && match client.status(bus_id).await {
                Ok(_) => true,
                Err(ClientError::Wire(error)) if error.code == ErrorCode::NotFound => false,
                Err(_) => return None,
            };
        if !known {
            match enqueue(client, &mapped).await {
                Ok(_) => {}
                // Sent by an earlier driver within the queue's duplicate window: followed.
                Err(ClientError::Wire(error)) if error.code == ErrorCode::DuplicateRequestId => {}
                Err(ClientError::Wire(error)) => {
                    let error =
                        ApiError::not_started(crate::gateway::run::StartError::Refused(error), 0);
                    return Some(self.refused(line, &error));
                }
                Err(_) => return None,
            }
        }
        let mut collector = Collector::new(mapped.follow_decisions);
        let (ending, message, release) = loop {
            match collector.take(follow.next().await?) {
                Collected::Going => {}
                Collected::Abandoned => return None,
                Collected::Ended {
                    ending,
                    message,
                    release,
                } => break (ending, message, release),
            }
        };
        let caller_id = request_id.as_str();
        let line_out = match (&ending, answerer) {
            (Ending::Error { status, kind, code }, _) => {
                let error = ApiError::new(*status, kind, code, message);
                lines::answered(
                    &self.batch_id,
                    line,
                    *status,
                    Some(caller_id),
                    &error.body_value(),
                )
            }
            (Ending::Finish(finish), Answerer::Chat { model }) => {
                let produced = &mut collector.produced;
                let completion = Completion::new(
                    format!("chatcmpl-{caller_id}"),
                    now_ms() / 1000,
                    model,
                    std::mem::take(&mut produced.text),
                    std::mem::take(&mut produced.reasoning),
                    std::mem::take(&mut produced.tool_calls),
                    finish,
                    collector.usage,
                );
                lines::answered(&self.batch_id, line, 200, Some(caller_id), &completion)
            }
            (Ending::Finish(_), Answerer::Response(job)) => {
                let outcome = Outcome::of(&ending, message);
                let object = job
                    .finish(&outcome, &collector.produced, collector.usage, bus_id)
                    .await;
                lines::answered(&self.batch_id, line, 200, Some(caller_id), &object)
            }
        };
        let ok = matches!(ending, Ending::Finish(_));
        Some(Ran {
            kept: KeptLine {
                number: line.number,
                ok,
                text: line_out,
            },
            release,
        })
    }

    /// A line's body as the request it runs as.
    async fn map(&self, body: &RawValue) -> Result<(Mapped, Answerer), ApiError> {
        let bytes = body.get().as_bytes();
        let whole = |param: &str| {
            ApiError::new(
                400,
                "invalid_request_error",
                "invalid_request",
                format!("{param}: a batch line is answered whole, in the output file"),
            )
            .with_param(param)
        };
        if self.endpoint == "/v1/responses" {
            let request = wire::parse(bytes).map_err(ApiError::bad)?;
            if request.stream == Some(true) {
                return Err(whole("stream"));
            }
            if request.background == Some(true) {
                return Err(whole("background"));
            }
            let (mapped, job) = prepare_job(&self.shared, &self.tenant, request)
                .await
                .map_err(|e| *e)?;
            return Ok((mapped, Answerer::Response(Box::new(job))));
        }
        let chat = parse_request(bytes).map_err(ApiError::bad)?;
        if chat.stream == Some(true) {
            return Err(whole("stream"));
        }
        let model = chat.model.clone();
        let mapped = crate::gateway::http::map_chat(&self.shared, &self.tenant, chat)
            .await
            .map_err(|e| *e)?;
        Ok((mapped, Answerer::Chat { model }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(status: &str, expires_at: u64) -> Record {
        Record {
            batch: json!({"id": "batch_01T", "status": status, "expires_at": expires_at}),
            tenant: String::new(),
            owner: String::new(),
            lease_until_ms: 0,
            reserved: 0,
            chunks: 0,
        }
    }

    #[test]
    fn a_batch_stops_when_cancelled_or_once_its_window_ran_out() {
        assert_eq!(stop_of(&record("in_progress", 100), 99), None);
        assert_eq!(
            stop_of(&record("in_progress", 100), 100),
            Some(Stop::Expired)
        );
        assert_eq!(
            stop_of(&record("cancelling", 100), 0),
            Some(Stop::Cancelled)
        );
        assert_eq!(
            stop_of(&record("cancelling", 100), 200),
            Some(Stop::Cancelled)
        );
        assert_eq!(stop_of(&record("validating", 100), 5), None);
    }
}
