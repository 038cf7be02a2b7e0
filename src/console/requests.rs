//! The requests list: every request the console has seen, newest first, each with its
//! timeline, and the throughput and latency of each pool.
//!
//! Pure logic, no I/O. The bus side ([`super::feed`]) applies what it reads:
//!
//! - the records of the results bucket (`res.<id>`: the live record when a worker claims a
//!   request, the result when it ends, the tombstone once its caller read it), followed from
//!   the newest `console.max_requests` on, so the list is full as soon as the console starts;
//! - the wire events of `gen.events.>` (started, each model turn, tool calls and results,
//!   signals, finished, continued, chain ended), which make the timeline;
//! - the signals stream and the decisions bucket (pool, job and tenant of the asking request,
//!   the decision asked and how it was answered);
//! - the workers the fleet view knows, for the pool a worker serves.
//!
//! A request's tenant is the one the fleet vouches for: the tenant token of its id on the bus
//! (`<tenant>.<id>`), as its result says too; never its metadata, a caller's own word. A
//! request the console did not see from its start (it began before the console was watching)
//! is `partial`: its timeline and counts hold only what the console saw.
//!
//! Architecture invariant: bounded. At most `max` requests are kept (finished ones go first,
//! then the oldest), each timeline holds at most [`TIMELINE_MAX`] entries (the count of those
//! left out is kept), and a pool's series covers [`SERIES_BUCKETS`] buckets.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::Value;

use crate::protocol::decision::DecisionRecord;
use crate::protocol::ids::rfc3339;
use crate::protocol::schedule::split_qualified;
use crate::protocol::text::clip_chars_counted;
use crate::protocol::{
    DEFAULT_TENANT, Event, EventBody, FinishedSummary, GenerationResult, RequestState, Role, Signal,
};

/// Timeline entries kept per request; past it the newest replace nothing and are counted.
pub const TIMELINE_MAX: usize = 64;
/// Characters of a tool call's arguments, a tool's result or a detail kept in a timeline.
const TEXT_CHARS: usize = 160;
/// Workers whose pool is remembered.
const MAX_WORKERS: usize = 10_000;
/// Width of one bucket of a pool's series.
pub const SERIES_BUCKET: Duration = Duration::from_secs(10);
/// Buckets in a pool's series (5 minutes of 10 s).
pub const SERIES_BUCKETS: usize = 30;
/// Pools with a series.
const MAX_POOLS: usize = 256;

/// The tenant of a request, from its id on the bus: `<tenant>.<id>` for a tenant's request, a
/// bare id for the default tenant's. The fleet vouches for it (the worker qualifies the id
/// with the tenant token of the subject the request came on); what a caller wrote in the
/// request's metadata says nothing about its tenant.
pub fn tenant_of(request_id: &str) -> &str {
    match split_qualified(request_id) {
        Some((Some(tenant), _)) => tenant,
        _ => DEFAULT_TENANT,
    }
}

/// One moment of a request's life.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelineEntry {
    /// When (RFC 3339, UTC): the worker's time for events, the server's for records.
    pub ts: String,
    /// `queued`, `started`, `turn`, `tool_call`, `tool_result`, `signal`, `decision`,
    /// `answered`, `cancel`, `finished`, `continued`, `chain_ended`, `released`.
    pub kind: &'static str,
    pub text: String,
    /// A request this moment leads to (the continuation) or comes from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    /// What makes the entry unique when it can arrive twice (from the events and from the
    /// signals stream, say).
    #[serde(skip)]
    key: Option<String>,
}

impl TimelineEntry {
    fn new(ts: &str, kind: &'static str, text: impl Into<String>) -> TimelineEntry {
        TimelineEntry {
            ts: ts.to_string(),
            kind,
            text: text.into(),
            request_id: None,
            decision_id: None,
            key: None,
        }
    }

    fn keyed(mut self, key: String) -> TimelineEntry {
        self.key = Some(key);
        self
    }
}

/// One request as the list shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestEntry {
    pub request_id: String,
    /// `QUEUED`, `RUNNING`, `COMPLETED`, `FAILED`, `CANCELLED`; absent while only a signal
    /// or a decision named the request (its record or its events not seen yet): such a
    /// request is kept for its timeline but not listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<RequestState>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    /// Its tenant: the token of its qualified id (`default` for a bare id), or the one its
    /// result says it ran as.
    pub tenant: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    pub attempt: u32,
    pub chain_position: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continuation_request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    /// When it was accepted, started and finished, as far as the console knows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accepted_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// From acceptance to result, once finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    pub turns: u32,
    pub tool_calls: u32,
    /// The console saw only part of the request's events: it began before the console was
    /// watching (no `started` event seen) and no result with its transcript told the rest.
    /// Its timeline lacks the moments before, and `turns` and `tool_calls` count only those
    /// seen.
    pub partial: bool,
    /// Its caller read the result (the fleet keeps a summary).
    pub released: bool,
    /// Timeline entries left out past [`TIMELINE_MAX`].
    pub timeline_dropped: u32,
    /// A `started` event of it came: the console saw it from its start.
    #[serde(skip)]
    seen_start: bool,
    /// Its turns and tool calls came from a result's transcript: all of them.
    #[serde(skip)]
    whole: bool,
    #[serde(skip)]
    timeline: Vec<TimelineEntry>,
    /// The last event was output: the next delta continues the same model turn.
    #[serde(skip)]
    in_turn: bool,
    /// Order of arrival at the console.
    #[serde(skip)]
    seen: u64,
}

impl RequestEntry {
    fn new(request_id: &str, seen: u64) -> RequestEntry {
        RequestEntry {
            request_id: request_id.to_string(),
            state: None,
            reason: None,
            detail: None,
            pool: None,
            job_name: None,
            tenant: tenant_of(request_id).to_string(),
            worker_id: None,
            attempt: 0,
            chain_position: 1,
            parent_request_id: None,
            continuation_request_id: None,
            decision_id: None,
            accepted_at: None,
            started_at: None,
            finished_at: None,
            latency_ms: None,
            turns: 0,
            tool_calls: 0,
            partial: false,
            released: false,
            timeline_dropped: 0,
            seen_start: false,
            whole: false,
            timeline: Vec::new(),
            in_turn: false,
            seen,
        }
    }

    fn terminal(&self) -> bool {
        self.state.is_some_and(RequestState::is_terminal)
    }

    /// Something live (a record, an event) said how it stands.
    fn known(&self) -> bool {
        self.state.is_some()
    }

    /// The entry as the list and its page show it.
    fn shown(&self) -> RequestEntry {
        let mut shown = self.clone();
        // A request still waiting for a slot has missed nothing yet: its start is to come.
        shown.partial = !self.seen_start && !self.whole && self.state != Some(RequestState::Queued);
        shown
    }

    fn push(&mut self, entry: TimelineEntry) {
        if let Some(key) = &entry.key
            && self.timeline.iter().any(|e| e.key.as_ref() == Some(key))
        {
            return;
        }
        if self.timeline.len() >= TIMELINE_MAX {
            self.timeline_dropped += 1;
            return;
        }
        self.timeline.push(entry);
    }

    fn has(&self, kind: &str) -> bool {
        self.timeline.iter().any(|e| e.kind == kind)
    }

    /// The timeline in time order (entries of one moment in the order they came).
    pub fn timeline(&self) -> Vec<TimelineEntry> {
        let mut timeline = self.timeline.clone();
        timeline.sort_by(|a, b| a.ts.cmp(&b.ts));
        timeline
    }

    fn set_place(&mut self, worker_id: &str, pool: Option<String>) {
        if !worker_id.is_empty() {
            self.worker_id = Some(worker_id.to_string());
        }
        if pool.is_some() {
            self.pool = pool;
        }
    }
}

/// One request with its timeline, for its page.
#[derive(Debug, Clone, Serialize)]
pub struct RequestDetail {
    #[serde(flatten)]
    pub entry: RequestEntry,
    pub timeline: Vec<TimelineEntry>,
}

/// What the list is asked for: each given field must match (state exactly, the others as a
/// case-insensitive part; `id` a part of the request id).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestFilter {
    pub state: Option<String>,
    pub pool: Option<String>,
    pub job: Option<String>,
    pub tenant: Option<String>,
    pub id: Option<String>,
    pub limit: Option<usize>,
}

impl RequestFilter {
    fn matches(&self, entry: &RequestEntry) -> bool {
        fn part(wanted: &Option<String>, value: Option<&str>) -> bool {
            match wanted.as_deref().map(str::trim).filter(|w| !w.is_empty()) {
                None => true,
                Some(wanted) => value.is_some_and(|v| {
                    v.to_ascii_lowercase()
                        .contains(&wanted.to_ascii_lowercase())
                }),
            }
        }
        let state = match self.state.as_deref().filter(|s| !s.is_empty()) {
            None => true,
            Some(s) => entry
                .state
                .is_some_and(|state| state.as_str().eq_ignore_ascii_case(s)),
        };
        state
            && part(&self.pool, entry.pool.as_deref())
            && part(&self.job, entry.job_name.as_deref())
            && part(&self.tenant, Some(&entry.tenant))
            && part(&self.id, Some(&entry.request_id))
    }
}

/// Rows a list answer holds at most.
pub const LIST_MAX: usize = 500;

/// A page of the list.
#[derive(Debug, Clone, Serialize)]
pub struct RequestPage {
    /// The newest matching requests, newest first.
    pub requests: Vec<RequestEntry>,
    /// How many match, and how many the console keeps.
    pub matched: usize,
    pub kept: usize,
    /// The most the console keeps (`console.max_requests`).
    pub max: usize,
    /// What the filters can take: every pool, job and tenant among the kept requests.
    pub pools: Vec<String>,
    pub jobs: Vec<String>,
    pub tenants: Vec<String>,
}

/// One bucket of a pool's series.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SeriesPoint {
    /// Requests that finished in the bucket.
    pub finished: u32,
    /// Of them, the ones that did not complete.
    pub failed: u32,
    /// Mean and highest time from acceptance to result, when any finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_latency_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_latency_ms: Option<u64>,
    #[serde(skip)]
    latency_sum: u64,
}

/// A pool's throughput and latency over the last [`SERIES_BUCKETS`] buckets, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolSeries {
    pub pool: String,
    pub points: Vec<SeriesPoint>,
}

/// The series of every pool, as the fleet view shows them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SeriesView {
    pub bucket_ms: u64,
    /// The end of the newest bucket (RFC 3339).
    pub until: String,
    pub pools: Vec<PoolSeries>,
}

/// Every request the console keeps, with the pools' series.
#[derive(Debug)]
pub struct Requests {
    entries: HashMap<String, RequestEntry>,
    /// Arrival order → request id.
    order: BTreeMap<u64, String>,
    next: u64,
    max: usize,
    /// Worker id → pool.
    pools: HashMap<String, String>,
    /// Pool → bucket index (seconds since the epoch / bucket width) → point.
    series: BTreeMap<String, VecDeque<(u64, SeriesPoint)>>,
    /// Something changed since the pages were last told.
    dirty: bool,
}

fn bucket_of(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
        / SERIES_BUCKET.as_secs()
}

fn parse_time(ts: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(ts.trim_end_matches('Z'))
        .ok()
        .or_else(|| humantime::parse_rfc3339(ts).ok())
}

fn clip(text: &str) -> String {
    clip_chars_counted(text, TEXT_CHARS)
}

fn json_text(value: &Value) -> String {
    match value {
        Value::String(s) => clip(s),
        other => clip(&other.to_string()),
    }
}

impl Requests {
    pub fn new(max: usize) -> Requests {
        Requests {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next: 0,
            max: max.max(1),
            pools: HashMap::new(),
            series: BTreeMap::new(),
            dirty: false,
        }
    }

    pub fn max(&self) -> usize {
        self.max
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether something changed since the last call (and clears it).
    pub fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    /// Remembers which pool a worker serves.
    pub fn learn_worker(&mut self, worker_id: &str, pool: &str) {
        if worker_id.is_empty() || pool.is_empty() || pool == "?" {
            return;
        }
        if self.pools.len() >= MAX_WORKERS && !self.pools.contains_key(worker_id) {
            self.pools.clear();
        }
        self.pools.insert(worker_id.to_string(), pool.to_string());
    }

    /// The entry of `request_id`, made when new (and the oldest dropped past the bound).
    fn entry(&mut self, request_id: &str) -> &mut RequestEntry {
        self.dirty = true;
        if !self.entries.contains_key(request_id) {
            while self.entries.len() >= self.max {
                self.drop_one();
            }
            self.next += 1;
            self.order.insert(self.next, request_id.to_string());
            self.entries.insert(
                request_id.to_string(),
                RequestEntry::new(request_id, self.next),
            );
        }
        self.entries.get_mut(request_id).expect("just made")
    }

    /// Drops the oldest request only named by a signal or decision, else the oldest finished
    /// one, else the oldest of all.
    fn drop_one(&mut self) {
        let oldest = |keep: fn(&RequestEntry) -> bool| {
            self.order
                .iter()
                .find(|(_, id)| self.entries.get(*id).is_none_or(keep))
        };
        let victim = oldest(|e| !e.known())
            .or_else(|| oldest(RequestEntry::terminal))
            .or_else(|| self.order.iter().next())
            .map(|(seq, id)| (*seq, id.clone()));
        if let Some((seq, id)) = victim {
            self.order.remove(&seq);
            self.entries.remove(&id);
        }
    }

    pub fn get(&self, request_id: &str) -> Option<RequestDetail> {
        self.entries.get(request_id).map(|e| RequestDetail {
            entry: e.shown(),
            timeline: e.timeline(),
        })
    }

    /// The newest requests matching `filter`, newest first.
    pub fn list(&self, filter: &RequestFilter) -> RequestPage {
        let limit = filter.limit.unwrap_or(200).clamp(1, LIST_MAX);
        let mut matched = 0;
        let mut requests = Vec::new();
        for id in self.order.values().rev() {
            let Some(entry) = self.entries.get(id) else {
                continue;
            };
            if entry.known() && filter.matches(entry) {
                matched += 1;
                if requests.len() < limit {
                    requests.push(entry.shown());
                }
            }
        }
        let distinct = |f: fn(&RequestEntry) -> Option<&String>| {
            let mut values: Vec<String> = self
                .entries
                .values()
                .filter(|e| e.known())
                .filter_map(f)
                .cloned()
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            values.truncate(200);
            values
        };
        RequestPage {
            requests,
            matched,
            kept: self.entries.values().filter(|e| e.known()).count(),
            max: self.max,
            pools: distinct(|e| e.pool.as_ref()),
            jobs: distinct(|e| e.job_name.as_ref()),
            tenants: distinct(|e| Some(&e.tenant)),
        }
    }

    /// A wire event of any request.
    pub fn apply_event(&mut self, event: &Event) {
        // Most events are output in the middle of a turn: they change nothing shown.
        if matches!(
            event.body,
            EventBody::Delta { .. } | EventBody::Reasoning { .. }
        ) && self
            .entries
            .get(&event.request_id)
            .is_some_and(|e| e.in_turn)
        {
            return;
        }
        let pool = match &event.body {
            EventBody::Started { worker_id, .. } => self.pools.get(worker_id).cloned(),
            _ => None,
        };
        let entry = self.entry(&event.request_id);
        let ts = event.ts.as_str();
        // Output, tools and signals come from a running request.
        if entry.state.is_none()
            && matches!(
                event.body,
                EventBody::Delta { .. }
                    | EventBody::Reasoning { .. }
                    | EventBody::ToolCall { .. }
                    | EventBody::ToolResult { .. }
                    | EventBody::Signal { .. }
            )
        {
            entry.state = Some(RequestState::Running);
        }
        match &event.body {
            EventBody::Started {
                worker_id,
                attempt,
                chain_position,
            } => {
                if !entry.terminal() {
                    entry.state = Some(RequestState::Running);
                }
                entry.set_place(worker_id, pool);
                entry.attempt = *attempt;
                entry.chain_position = *chain_position;
                entry.started_at = Some(event.ts.clone());
                entry.in_turn = false;
                entry.seen_start = true;
                entry.push(
                    TimelineEntry::new(
                        ts,
                        "started",
                        format!("on {worker_id} (attempt {attempt})"),
                    )
                    .keyed(format!("started-{attempt}")),
                );
            }
            EventBody::Delta { .. } | EventBody::Reasoning { .. } => {
                if !entry.in_turn {
                    entry.in_turn = true;
                    entry.turns += 1;
                    let turn = entry.turns;
                    entry.push(TimelineEntry::new(
                        ts,
                        "turn",
                        format!("turn {turn}: the model streams its answer"),
                    ));
                }
            }
            EventBody::ToolCall {
                call_id,
                name,
                arguments,
            } => {
                entry.in_turn = false;
                entry.tool_calls += 1;
                entry.push(
                    TimelineEntry::new(ts, "tool_call", format!("{name} {}", json_text(arguments)))
                        .keyed(format!("call-{call_id}")),
                );
            }
            EventBody::ToolResult {
                call_id,
                name,
                ok,
                result,
            } => {
                entry.in_turn = false;
                let what = if *ok { "from" } else { "error from" };
                entry.push(
                    TimelineEntry::new(
                        ts,
                        "tool_result",
                        format!("{what} {name} → {}", json_text(result)),
                    )
                    .keyed(format!("result-{call_id}")),
                );
            }
            EventBody::Signal { signal } => {
                entry.in_turn = false;
                signal_entries(entry, signal);
            }
            EventBody::Finished { result } => {
                let result = result.clone();
                let finished_at = Some(event.ts.clone());
                self.apply_result(&result, finished_at);
            }
            EventBody::Continued {
                continuation_request_id,
            } => {
                entry.continuation_request_id = Some(continuation_request_id.clone());
                let mut line =
                    TimelineEntry::new(ts, "continued", format!("as {continuation_request_id}"))
                        .keyed(format!("continued-{continuation_request_id}"));
                line.request_id = Some(continuation_request_id.clone());
                entry.push(line);
                let parent = event.request_id.clone();
                let next = self.entry(continuation_request_id);
                next.parent_request_id.get_or_insert(parent);
            }
            EventBody::ChainEnded {
                decision_id,
                outcome,
                option_id,
                decided_by,
            } => {
                let mut text = outcome.as_str().to_string();
                if let Some(option) = option_id {
                    text.push_str(&format!(" ({option})"));
                }
                if let Some(by) = decided_by {
                    text.push_str(&format!(" by {by}"));
                }
                let mut line = TimelineEntry::new(ts, "chain_ended", text)
                    .keyed(format!("ended-{decision_id}"));
                line.decision_id = Some(decision_id.clone());
                entry.push(line);
            }
        }
    }

    /// A request's record in the results bucket, written at `written` (the server's time).
    pub fn apply_live(
        &mut self,
        request_id: &str,
        state: RequestState,
        worker_id: &str,
        attempt: u32,
        written: SystemTime,
    ) {
        let pool = self.pools.get(worker_id).cloned();
        let entry = self.entry(request_id);
        if entry.terminal() {
            return;
        }
        entry.state = Some(state);
        entry.set_place(worker_id, pool);
        entry.attempt = attempt;
        let ts = rfc3339(written);
        if entry.accepted_at.is_none() {
            entry.accepted_at = Some(ts.clone());
        }
        if state == RequestState::Queued {
            entry.push(
                TimelineEntry::new(
                    &ts,
                    "queued",
                    format!("on {worker_id}, waiting for a free slot"),
                )
                .keyed(format!("queued-{attempt}")),
            );
        } else {
            entry.push(
                TimelineEntry::new(&ts, "queued", format!("accepted by {worker_id}"))
                    .keyed("accepted".into()),
            );
        }
    }

    /// A terminal result (from its record or its `finished` event).
    pub fn apply_result(&mut self, result: &GenerationResult, finished_at: Option<String>) {
        let pool = self.pools.get(&result.worker_id).cloned();
        let finished_at = {
            let known = self
                .entries
                .get(&result.request_id)
                .and_then(|e| e.finished_at.clone());
            known.or(finished_at)
        };
        let first = self
            .entries
            .get(&result.request_id)
            .is_none_or(|e| !e.terminal());
        let entry = self.entry(&result.request_id);
        entry.state = Some(result.state);
        entry.reason = Some(result.reason.as_str().to_string());
        entry.detail = result.detail.as_deref().map(clip);
        entry.set_place(&result.worker_id, pool);
        entry.attempt = result.attempt;
        entry.chain_position = result.chain_position;
        entry.parent_request_id = result.parent_request_id.clone();
        if result.job_name.is_some() {
            entry.job_name = result.job_name.clone();
        }
        // The tenant it ran as (its subject's token), as its id says too.
        if let Some(tenant) = &result.tenant {
            entry.tenant = tenant.clone();
        }
        entry.latency_ms = Some(result.timings_ms.total);
        entry.finished_at = finished_at.clone();
        let end = finished_at.as_deref().and_then(parse_time);
        if let Some(end) = end {
            let accepted = end - Duration::from_millis(result.timings_ms.total);
            let started = accepted + Duration::from_millis(result.timings_ms.queued);
            entry.accepted_at.get_or_insert_with(|| rfc3339(accepted));
            entry.started_at.get_or_insert_with(|| rfc3339(started));
        }
        // Seen only now (the console started later, or missed its events): the timeline
        // comes from the result.
        if !entry.has("started")
            && let Some(started) = entry.started_at.clone()
        {
            if let Some(accepted) = entry.accepted_at.clone() {
                entry.push(
                    TimelineEntry::new(&accepted, "queued", "accepted").keyed("accepted".into()),
                );
            }
            entry.push(
                TimelineEntry::new(
                    &started,
                    "started",
                    format!("on {} (attempt {})", result.worker_id, result.attempt),
                )
                .keyed(format!("started-{}", result.attempt)),
            );
            from_transcript(entry, result, &started);
            entry.whole = true;
        }
        for signal in &result.signals {
            signal_entries(entry, signal);
        }
        let ts = finished_at.unwrap_or_else(|| entry.started_at.clone().unwrap_or_default());
        let mut text = format!("{} {}", result.state.as_str(), result.reason.as_str());
        if let Some(detail) = &result.detail {
            text.push_str(&format!(": {}", clip(detail)));
        }
        text.push_str(&format!(" after {} ms", result.timings_ms.total));
        entry.push(TimelineEntry::new(&ts, "finished", text).keyed("finished".into()));
        if first && let Some(pool) = entry.pool.clone() {
            let failed = result.state != RequestState::Completed;
            let when = entry
                .finished_at
                .as_deref()
                .and_then(parse_time)
                .unwrap_or_else(SystemTime::now);
            self.count(&pool, when, result.timings_ms.total, failed);
        }
    }

    /// The tombstone left once the caller read the result.
    pub fn apply_released(
        &mut self,
        request_id: &str,
        state: RequestState,
        summary: Option<&FinishedSummary>,
        written: SystemTime,
    ) {
        let pool = summary.and_then(|s| self.pools.get(&s.worker_id).cloned());
        let known = self.entries.contains_key(request_id);
        let entry = self.entry(request_id);
        entry.state = Some(state);
        entry.released = true;
        if let Some(s) = summary {
            entry.reason = Some(s.reason.as_str().to_string());
            entry.detail = s.detail.as_deref().map(clip);
            entry.set_place(&s.worker_id, pool);
            entry.attempt = s.attempt;
            entry.chain_position = s.chain_position;
            entry.parent_request_id = s.parent_request_id.clone();
            if s.job_name.is_some() {
                entry.job_name = s.job_name.clone();
            }
            entry.latency_ms = Some(s.timings_ms.total);
            if entry.finished_at.is_none() {
                entry.finished_at = s.finished_at.clone();
            }
            if !known && let Some(done) = s.finished_at.as_deref() {
                let mut text = format!("{} {}", s.state.as_str(), s.reason.as_str());
                if let Some(detail) = &s.detail {
                    text.push_str(&format!(": {}", clip(detail)));
                }
                entry.push(TimelineEntry::new(done, "finished", text).keyed("finished".into()));
            }
        }
        entry.push(
            TimelineEntry::new(&rfc3339(written), "released", "its caller read the result")
                .keyed("released".into()),
        );
    }

    /// A signal from the signals stream.
    pub fn apply_signal(&mut self, signal: &Signal) {
        self.learn_worker(&signal.worker_id, &signal.pool);
        if signal.request_id.is_empty() {
            return;
        }
        let entry = self.entry(&signal.request_id);
        entry.pool.get_or_insert_with(|| signal.pool.clone());
        if entry.job_name.is_none() {
            entry.job_name = signal.job_name.clone();
        }
        signal_entries(entry, signal);
    }

    /// A decision record from the decisions bucket: the asking request's pool, job and tenant,
    /// the decision asked, and its answer.
    pub fn apply_decision(&mut self, record: &DecisionRecord) {
        let entry = self.entry(&record.request_id);
        entry.pool = Some(record.pool.clone());
        entry.chain_position = record.chain_position;
        if entry.job_name.is_none() {
            entry.job_name = record.request.job_name.clone();
        }
        if let Some(tenant) = &record.tenant {
            entry.tenant = tenant.clone();
        }
        entry.decision_id = Some(record.decision_id.clone());
        let mut asked = TimelineEntry::new(
            &record.signal.ts,
            "decision",
            format!(
                "asked ({}): {}",
                kind_name(&record.decision.kind),
                clip(&record.decision.question)
            ),
        )
        .keyed(format!("decision-{}", record.decision_id));
        asked.decision_id = Some(record.decision_id.clone());
        entry.push(asked);
        if let Some(answer) = &record.answer {
            let mut text = format!(
                "by {}: {} ({})",
                answer.choice.decided_by.as_deref().unwrap_or("someone"),
                answer.choice.option_id,
                answer.outcome.as_str()
            );
            if let Some(rationale) = &answer.choice.rationale {
                text.push_str(&format!(", because {}", clip(rationale)));
            }
            let mut line = TimelineEntry::new(&answer.decided_at, "answered", text)
                .keyed(format!("answered-{}", record.decision_id));
            line.decision_id = Some(record.decision_id.clone());
            line.request_id = answer.continuation_request_id.clone();
            entry.push(line);
            if let Some(next) = &answer.continuation_request_id {
                entry.continuation_request_id = Some(next.clone());
                let (pool, job, parent) = (
                    record.pool.clone(),
                    record.request.job_name.clone(),
                    record.request_id.clone(),
                );
                let next = self.entry(next);
                next.pool.get_or_insert(pool);
                if next.job_name.is_none() {
                    next.job_name = job;
                }
                next.parent_request_id.get_or_insert(parent);
                next.chain_position = next.chain_position.max(record.chain_position + 1);
            }
        } else if let Some(expired) = &record.expired_at {
            let mut line = TimelineEntry::new(expired, "answered", "expired unanswered")
                .keyed(format!("answered-{}", record.decision_id));
            line.decision_id = Some(record.decision_id.clone());
            entry.push(line);
        }
    }

    /// A cancel asked from the console at `asked_at`, and what the fleet answered.
    pub fn note_cancel(&mut self, request_id: &str, asked_at: &str, by: &str, outcome: &str) {
        if let Some(entry) = self.entries.get_mut(request_id) {
            self.dirty = true;
            entry.push(TimelineEntry::new(
                asked_at,
                "cancel",
                format!("asked by {by}: {outcome}"),
            ));
        }
    }

    /// Counts one finished request in its pool's series.
    fn count(&mut self, pool: &str, when: SystemTime, latency_ms: u64, failed: bool) {
        let bucket = bucket_of(when);
        let newest = bucket_of(SystemTime::now());
        if bucket + (SERIES_BUCKETS as u64) <= newest {
            return;
        }
        if !self.series.contains_key(pool) && self.series.len() >= MAX_POOLS {
            return;
        }
        let points = self.series.entry(pool.to_string()).or_default();
        let at = match points.iter().position(|(b, _)| *b == bucket) {
            Some(at) => at,
            None => {
                let at = points.partition_point(|(b, _)| *b < bucket);
                points.insert(at, (bucket, SeriesPoint::default()));
                at
            }
        };
        let point = &mut points[at].1;
        point.finished += 1;
        point.failed += u32::from(failed);
        point.latency_sum += latency_ms;
        point.mean_latency_ms = Some(point.latency_sum / u64::from(point.finished));
        point.max_latency_ms = Some(point.max_latency_ms.unwrap_or(0).max(latency_ms));
        while points
            .front()
            .is_some_and(|(b, _)| *b + (SERIES_BUCKETS as u64) <= newest)
        {
            points.pop_front();
        }
        self.dirty = true;
    }

    /// Every pool's series up to `now`, oldest bucket first; pools the fleet shows are there
    /// even with nothing finished.
    pub fn series(&self, now: SystemTime, pools: &[String]) -> SeriesView {
        let newest = bucket_of(now);
        let first = newest + 1 - SERIES_BUCKETS as u64;
        let mut names: std::collections::BTreeSet<&str> =
            self.series.keys().map(String::as_str).collect();
        names.extend(pools.iter().map(String::as_str));
        let pools = names
            .into_iter()
            .map(|pool| {
                let kept = self.series.get(pool);
                let points = (first..=newest)
                    .map(|b| {
                        kept.and_then(|p| p.iter().find(|(at, _)| *at == b))
                            .map(|(_, p)| *p)
                            .unwrap_or_default()
                    })
                    .collect();
                PoolSeries {
                    pool: pool.to_string(),
                    points,
                }
            })
            .collect();
        SeriesView {
            bucket_ms: SERIES_BUCKET.as_millis() as u64,
            until: rfc3339(SystemTime::UNIX_EPOCH + SERIES_BUCKET * ((newest + 1) as u32)),
            pools,
        }
    }

    /// The bucket the series end in now: the page is told when it moves on.
    pub fn series_epoch(now: SystemTime) -> u64 {
        bucket_of(now)
    }
}

fn kind_name<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// A signal's timeline entries: the signal, and the decision it asks when it carries one.
fn signal_entries(entry: &mut RequestEntry, signal: &Signal) {
    let mut line = TimelineEntry::new(
        &signal.ts,
        "signal",
        format!(
            "{}.{} ({}): {}",
            signal.kind.as_str(),
            signal.code,
            kind_name(&signal.severity),
            clip(&signal.summary)
        ),
    )
    .keyed(format!("signal-{}", signal.signal_id));
    if let Some(decision) = &signal.decision {
        line.decision_id = Some(decision.decision_id.clone());
        entry.decision_id = Some(decision.decision_id.clone());
    }
    entry.push(line);
}

/// The turns and tool calls of a request the console saw only finished, from its transcript
/// (they carry no time of their own: they are placed at its start).
fn from_transcript(entry: &mut RequestEntry, result: &GenerationResult, started: &str) {
    let mut turns = 0;
    let mut calls = 0;
    for message in &result.messages {
        match message.role {
            Role::Assistant => {
                turns += 1;
                entry.push(TimelineEntry::new(
                    started,
                    "turn",
                    format!("turn {turns} (from the transcript)"),
                ));
                for call in &message.tool_calls {
                    calls += 1;
                    entry.push(
                        TimelineEntry::new(
                            started,
                            "tool_call",
                            format!("{} {}", call.function.name, clip(&call.function.arguments)),
                        )
                        .keyed(format!("call-{}", call.id)),
                    );
                }
            }
            Role::Tool => {
                let text = message.text();
                entry.push(
                    TimelineEntry::new(started, "tool_result", format!("→ {}", clip(&text))).keyed(
                        format!(
                            "result-{}",
                            message.tool_call_id.clone().unwrap_or_default()
                        ),
                    ),
                );
            }
            _ => {}
        }
    }
    entry.turns = entry.turns.max(turns);
    entry.tool_calls = entry.tool_calls.max(calls);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(id: &str, seq: u64, second: u32, body: Value) -> Event {
        let mut value = body;
        value["request_id"] = json!(id);
        value["seq"] = json!(seq);
        value["ts"] = json!(format!("2026-01-01T00:00:{second:02}.000Z"));
        serde_json::from_value(value).unwrap()
    }

    /// A result of `id`; `tenant` is the one it ran as (its id is then `<tenant>.<...>`).
    /// Its metadata names another tenant, which the console ignores.
    fn result(id: &str, state: &str, reason: &str, tenant: Option<&str>) -> GenerationResult {
        let metadata = json!({"tenant": "mallory"});
        serde_json::from_value(json!({
            "request_id": id, "root_request_id": id, "parent_request_id": null,
            "job_name": "triage", "state": state, "reason": reason, "output": "done",
            "messages": [
                {"role": "user", "content": "Compute."},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "calculate", "arguments": "{\"a\":1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"value\":2}"},
                {"role": "assistant", "content": "done"}
            ],
            "signals": [], "signals_dropped": 0, "tool_iterations_used": 1,
            "usage": {"prompt_tokens": 1, "completion_tokens": 1}, "worker_id": "w1",
            "attempt": 1, "chain_position": 1, "truncated": false, "metadata": metadata,
            "timings_ms": {"queued": 5, "total": 1500}, "tenant": tenant
        }))
        .unwrap()
    }

    fn kinds(requests: &Requests, id: &str) -> Vec<&'static str> {
        requests
            .get(id)
            .unwrap()
            .timeline
            .iter()
            .map(|e| e.kind)
            .collect()
    }

    #[test]
    fn the_tenant_is_the_token_of_the_id_never_the_metadata() {
        assert_eq!(tenant_of("acme.job-1"), "acme");
        assert_eq!(tenant_of("job-1"), "default");
        let mut requests = Requests::new(10);
        // Its metadata says "mallory": a caller's word, not the fleet's.
        requests.apply_result(&result("r1", "COMPLETED", "stop", None), None);
        requests.apply_result(&result("acme.r2", "COMPLETED", "stop", Some("acme")), None);
        requests.apply_live(
            "globex.r3",
            RequestState::Running,
            "w1",
            1,
            SystemTime::now(),
        );
        let tenant = |id: &str| requests.get(id).unwrap().entry.tenant;
        assert_eq!(
            (tenant("r1"), tenant("acme.r2"), tenant("globex.r3")),
            ("default".into(), "acme".into(), "globex".into())
        );
        let page = requests.list(&RequestFilter::default());
        assert_eq!(page.tenants, ["acme", "default", "globex"]);
    }

    #[test]
    fn a_request_seen_from_its_middle_has_a_partial_timeline() {
        let mut requests = Requests::new(10);
        let now = SystemTime::now();
        // Seen from its start: whole.
        requests.apply_live("a", RequestState::Running, "w1", 1, now);
        requests.apply_event(&event(
            "a",
            0,
            1,
            json!({"event": "started", "worker_id": "w1", "attempt": 1, "chain_position": 1}),
        ));
        // Running when the console started: its record, then an event from its middle.
        requests.apply_live("b", RequestState::Running, "w1", 1, now);
        requests.apply_event(&event(
            "b",
            7,
            2,
            json!({"event": "delta", "text": "and so"}),
        ));
        // Waiting for a slot: it has missed nothing yet.
        requests.apply_live("c", RequestState::Queued, "w1", 1, now);
        // Read by its caller before the console started: only its tombstone.
        let summary: FinishedSummary = serde_json::from_value(json!({
            "request_id": "d", "root_request_id": "d", "state": "COMPLETED", "reason": "stop",
            "worker_id": "w1", "attempt": 1, "chain_position": 1, "tool_iterations_used": 1,
            "output_chars": 4, "output_start": "done", "prompt_start": "Compute.", "signals": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            "timings_ms": {"queued": 5, "total": 1500},
            "finished_at": "2026-01-01T00:00:09.000Z"
        }))
        .unwrap();
        requests.apply_released("d", RequestState::Completed, Some(&summary), now);
        // Finished before the console started, its result still stored: its transcript tells
        // every turn and tool call.
        requests.apply_result(&result("e", "COMPLETED", "stop", None), Some(rfc3339(now)));
        let partial = |requests: &Requests, id: &str| {
            let entry = requests.get(id).unwrap().entry;
            (entry.partial, entry.turns, entry.tool_calls)
        };
        assert_eq!(partial(&requests, "a"), (false, 0, 0));
        assert_eq!(partial(&requests, "b"), (true, 1, 0));
        assert_eq!(partial(&requests, "c"), (false, 0, 0));
        assert_eq!(partial(&requests, "d"), (true, 0, 0));
        assert_eq!(partial(&requests, "e"), (false, 2, 1));
        let listed: Vec<(String, bool)> = requests
            .list(&RequestFilter::default())
            .requests
            .into_iter()
            .map(|r| (r.request_id, r.partial))
            .collect();
        assert!(listed.contains(&("d".into(), true)), "{listed:?}");
        // The rest of b comes with its result: its transcript has it all.
        requests.apply_event(&event(
            "b",
            8,
            3,
            json!({"event": "finished", "result": serde_json::to_value(result("b", "COMPLETED", "stop", None)).unwrap()}),
        ));
        assert_eq!(partial(&requests, "b"), (false, 2, 1));
    }

    #[test]
    fn events_make_a_timeline_of_turns_tool_calls_signals_and_the_end() {
        let mut requests = Requests::new(10);
        requests.learn_worker("w1", "gpu");
        let id = "acme.r1";
        let finished = serde_json::to_value(result(id, "COMPLETED", "stop", Some("acme"))).unwrap();
        let signal = json!({"signal_id": "s1", "type": "issue", "code": "MAX_TOKENS_REACHED",
            "source": "worker", "severity": "low", "summary": "cut", "meta": {}, "request_id": id,
            "root_request_id": id, "worker_id": "w1", "pool": "gpu", "ts": "2026-01-01T00:00:07.000Z"});
        for (seq, body) in [
            json!({"event": "started", "worker_id": "w1", "attempt": 1, "chain_position": 1}),
            json!({"event": "delta", "text": "Let me"}),
            json!({"event": "delta", "text": " compute"}),
            json!({"event": "tool_call", "call_id": "c1", "name": "calculate", "arguments": {"a": 1}}),
            json!({"event": "tool_result", "call_id": "c1", "name": "calculate", "ok": true, "result": {"value": 2}}),
            json!({"event": "delta", "text": "done"}),
            json!({"event": "signal", "signal": signal.clone()}),
            json!({"event": "finished", "result": finished}),
        ]
        .into_iter()
        .enumerate()
        {
            requests.apply_event(&event(id, seq as u64, seq as u32 + 1, body));
        }
        // The same signal from the signals stream is not shown twice.
        requests.apply_signal(&serde_json::from_value(signal).unwrap());
        assert_eq!(
            kinds(&requests, id),
            [
                "started",
                "turn",
                "tool_call",
                "tool_result",
                "turn",
                "signal",
                "finished"
            ]
        );
        let detail = requests.get(id).unwrap();
        let entry = &detail.entry;
        assert_eq!(
            (
                entry.state,
                entry.pool.as_deref(),
                entry.tenant.as_str(),
                entry.job_name.as_deref()
            ),
            (
                Some(RequestState::Completed),
                Some("gpu"),
                "acme",
                Some("triage")
            )
        );
        assert_eq!(
            (entry.turns, entry.tool_calls, entry.latency_ms),
            (2, 1, Some(1500))
        );
        assert!(detail.timeline[2].text.contains("calculate"));
        assert!(
            detail.timeline[6]
                .text
                .contains("COMPLETED stop after 1500 ms")
        );
        // A finished request counts once in its pool's series, however it is seen again.
        requests.apply_result(&result(id, "COMPLETED", "stop", Some("acme")), None);
        let series = requests.series(SystemTime::now(), &["gpu".into()]);
        let gpu = series.pools.iter().find(|p| p.pool == "gpu").unwrap();
        assert_eq!(gpu.points.len(), SERIES_BUCKETS);
        let finished: u32 = gpu.points.iter().map(|p| p.finished).sum();
        assert_eq!(finished, 0, "finished in 2026-01-01, outside the window");
    }

    #[test]
    fn a_request_seen_only_finished_gets_its_timeline_from_the_result() {
        let mut requests = Requests::new(10);
        requests.learn_worker("w1", "default");
        let now = SystemTime::now();
        requests.apply_result(
            &result("r2", "FAILED", "backend_error", None),
            Some(rfc3339(now)),
        );
        assert_eq!(
            kinds(&requests, "r2"),
            [
                "queued",
                "started",
                "turn",
                "tool_call",
                "tool_result",
                "turn",
                "finished"
            ]
        );
        let entry = requests.get("r2").unwrap().entry;
        assert_eq!((entry.turns, entry.tool_calls), (2, 1));
        assert!(entry.accepted_at.unwrap() < entry.started_at.unwrap());
        let series = requests.series(now, &["default".into(), "idle".into()]);
        let names: Vec<&str> = series.pools.iter().map(|p| p.pool.as_str()).collect();
        assert_eq!(names, ["default", "idle"]);
        let last = series.pools[0].points.last().unwrap();
        assert_eq!(
            (last.finished, last.failed, last.mean_latency_ms),
            (1, 1, Some(1500))
        );
        // The caller reads it: the tombstone says so.
        requests.apply_released("r2", RequestState::Failed, None, now);
        assert!(requests.get("r2").unwrap().entry.released);
    }

    #[test]
    fn the_list_is_filtered_newest_first_and_bounded() {
        let mut requests = Requests::new(3);
        requests.learn_worker("w1", "default");
        requests.learn_worker("w2", "gpu");
        let now = SystemTime::now();
        requests.apply_live("a", RequestState::Running, "w1", 1, now);
        requests.apply_result(
            &result("acme.b", "COMPLETED", "stop", Some("acme")),
            Some(rfc3339(now)),
        );
        requests.apply_live("c", RequestState::Queued, "w2", 1, now);
        let ids = |requests: &Requests, filter: RequestFilter| -> Vec<String> {
            requests
                .list(&filter)
                .requests
                .into_iter()
                .map(|r| r.request_id)
                .collect()
        };
        assert_eq!(
            ids(&requests, RequestFilter::default()),
            ["c", "acme.b", "a"]
        );
        let by = |field: &str, value: &str| {
            serde_json::from_value::<RequestFilter>(json!({ field: value })).unwrap()
        };
        for (filter, wanted) in [
            (by("state", "running"), vec!["a"]),
            (by("state", "QUEUED"), vec!["c"]),
            (by("pool", "GP"), vec!["c"]),
            (by("job", "tria"), vec!["acme.b"]),
            (by("tenant", "acme"), vec!["acme.b"]),
            (by("tenant", "DEFAU"), vec!["c", "a"]),
            (by("id", "b"), vec!["acme.b"]),
            (by("tenant", "other"), vec![]),
        ] {
            assert_eq!(ids(&requests, filter.clone()), wanted, "{filter:?}");
        }
        let page = requests.list(&RequestFilter::default());
        assert_eq!((page.kept, page.max, page.matched), (3, 3, 3));
        assert_eq!(page.pools, ["default", "gpu"]);
        assert_eq!(page.tenants, ["acme", "default"]);
        // Full: the finished one goes first, though it is not the oldest.
        requests.apply_live("d", RequestState::Running, "w1", 1, now);
        assert_eq!(ids(&requests, RequestFilter::default()), ["d", "c", "a"]);
        assert_eq!(kinds(&requests, "c"), ["queued"]);
    }

    #[test]
    fn a_decision_and_its_answer_link_the_continuation() {
        let mut requests = Requests::new(10);
        let mut request = crate::protocol::GenerationRequest::user("Plan it.");
        request.job_name = Some("plans".into());
        // A caller's word: not the tenant.
        request.metadata.insert("tenant".into(), json!("mallory"));
        let record: DecisionRecord = serde_json::from_value(json!({
            "decision_id": "d1", "request_id": "acme.r1", "root_request_id": "acme.r1", "chain_position": 1,
            "pool": "default",
            "decision": {"decision_id": "d1", "question": "Which path?", "options": [{"id": "fast", "label": "Fast"}], "kind": "model"},
            "signal": {"signal_id": "s1", "type": "decision_request", "code": "NEEDS_MANAGER_DECISION",
                "source": "model", "severity": "med", "summary": "Which path?", "meta": {}, "request_id": "acme.r1",
                "root_request_id": "acme.r1", "worker_id": "w1", "pool": "default", "ts": "2026-01-01T00:00:01.000Z"},
            "request": request, "continued_seq": 3, "tenant": "acme",
            "answer": {"option_id": "fast", "decided_by": "human:ann", "outcome": "continued",
                "continuation_request_id": "acme.r2", "decided_at": "2026-01-01T00:00:09.000Z"}
        }))
        .unwrap();
        requests.apply_decision(&record);
        requests.apply_decision(&record);
        assert_eq!(kinds(&requests, "acme.r1"), ["decision", "answered"]);
        // Named only by a decision: kept for its timeline, listed once its record comes.
        assert_eq!(requests.list(&RequestFilter::default()).matched, 0);
        assert_eq!(requests.get("acme.r1").unwrap().entry.state, None);
        requests.apply_live("acme.r1", RequestState::Running, "w1", 1, SystemTime::now());
        let page = requests.list(&RequestFilter::default());
        assert_eq!((page.matched, page.kept), (1, 1));
        assert_eq!(page.requests[0].request_id, "acme.r1");
        let asking = requests.get("acme.r1").unwrap();
        assert_eq!(
            asking.entry.continuation_request_id.as_deref(),
            Some("acme.r2")
        );
        assert_eq!(asking.timeline[1].request_id.as_deref(), Some("acme.r2"));
        assert!(
            asking.timeline[1]
                .text
                .contains("human:ann: fast (continued)")
        );
        let next = requests.get("acme.r2").unwrap().entry;
        assert_eq!(
            (
                next.parent_request_id.as_deref(),
                next.pool.as_deref(),
                next.tenant.as_str(),
                next.chain_position
            ),
            (Some("acme.r1"), Some("default"), "acme", 2)
        );
    }
}
