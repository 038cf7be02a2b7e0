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
//!
//! One file per view: `list.rs` (the list and its filters), `timeline.rs` (what each record,
//! event, signal and decision adds to a request) and `series.rs` (the pools' throughput and
//! latency); this file holds the requests kept and what the three share.

mod list;
mod series;
mod timeline;

pub use list::{LIST_MAX, RequestFilter, RequestPage};
pub use series::{PoolSeries, SERIES_BUCKET, SERIES_BUCKETS, SeriesPoint, SeriesView};

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::Serialize;

use crate::protocol::schedule::split_qualified;
use crate::protocol::{DEFAULT_TENANT, RequestState};

/// Timeline entries kept per request; past it the newest replace nothing and are counted.
pub const TIMELINE_MAX: usize = 64;
/// Workers whose pool is remembered.
const MAX_WORKERS: usize = 10_000;

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
}

/// What the tests of the three views build their requests from.
#[cfg(test)]
mod fixtures {
    use serde_json::{Value, json};

    use super::Requests;
    use crate::protocol::{Event, GenerationResult};

    pub fn event(id: &str, seq: u64, second: u32, body: Value) -> Event {
        let mut value = body;
        value["request_id"] = json!(id);
        value["seq"] = json!(seq);
        value["ts"] = json!(format!("2026-01-01T00:00:{second:02}.000Z"));
        serde_json::from_value(value).unwrap()
    }

    /// A result of `id`; `tenant` is the one it ran as (its id is then `<tenant>.<...>`).
    /// Its metadata names another tenant, which the console ignores.
    pub fn result(id: &str, state: &str, reason: &str, tenant: Option<&str>) -> GenerationResult {
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

    pub fn kinds(requests: &Requests, id: &str) -> Vec<&'static str> {
        requests
            .get(id)
            .unwrap()
            .timeline
            .iter()
            .map(|e| e.kind)
            .collect()
    }
}
