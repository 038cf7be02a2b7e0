//! What the console knows about the fleet, in memory and bounded: the inbox (decision records
//! from the decisions bucket), the signal feed (the newest signals of the signals stream) and
//! the fleet (workers from the service API, running requests from their events).
//!
//! Pure logic, no I/O: the bus side ([`super::feed`]) applies what it reads, and every change
//! becomes an [`Update`] that the open pages receive.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

use serde::Serialize;
use serde_json::{Map, Value};

use super::requests::Requests;
use crate::protocol::decision::{Answer, DecisionRecord};
use crate::protocol::task::task_text;
use crate::protocol::text::clip_chars_counted;
use crate::protocol::{
    DecisionKind, DecisionOption, Event, EventBody, RequestState, Severity, Signal, SignalSource,
    SignalType,
};

/// Longest task prompt shown with a decision.
const PROMPT_CHARS: usize = 4000;
/// A feed signal whose `meta` is larger than this (as JSON) keeps a note instead; the inbox
/// holds the whole of a decision's meta.
const FEED_META_BYTES: usize = 4096;
/// Running requests tracked at once (from `started` events); the oldest go first.
const MAX_RUNNING: usize = 10_000;
/// Running requests listed in the fleet view (the count covers all of them).
const RUNNING_SHOWN: usize = 200;
/// Characters of a failure's detail shown in the fleet view.
const FINISHED_DETAIL_CHARS: usize = 300;
/// Recently finished requests listed in the fleet view.
const FINISHED_SHOWN: usize = 25;
/// Poll rounds a worker may miss before it leaves the fleet view.
const MISSED_ROUNDS: u32 = 3;

/// Whether a decision still waits for an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemState {
    Pending,
    Answered,
    Expired,
}

/// One decision as the inbox shows it: the question with its options and context, the
/// escalation's checks and confidence and the historical suggestions (in `meta`), the task,
/// and, once it has one, the answer and who gave it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InboxItem {
    pub decision_id: String,
    pub state: ItemState,
    pub kind: DecisionKind,
    #[serde(rename = "type")]
    pub signal_type: SignalType,
    pub code: String,
    pub severity: Severity,
    pub source: SignalSource,
    pub summary: String,
    /// When the signal was raised.
    pub raised_at: String,
    pub request_id: String,
    pub root_request_id: String,
    pub chain_position: u32,
    pub pool: String,
    pub worker_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    pub question: String,
    pub options: Vec<DecisionOption>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_option: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// The signal's `meta`: for an escalation its checks, confidence, threshold, pass rate,
    /// error history, prompt, output summary and `suggestions`; for a checkpoint its name and
    /// matched keywords.
    pub meta: Map<String, Value>,
    /// The asking request's task (its last user message), trimmed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// The asking request's `metadata`.
    pub metadata: Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer: Option<Answer>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expired_at: Option<String>,
}

impl InboxItem {
    pub fn from_record(record: DecisionRecord) -> InboxItem {
        let state = match (&record.answer, &record.expired_at) {
            (Some(_), _) => ItemState::Answered,
            (None, Some(_)) => ItemState::Expired,
            (None, None) => ItemState::Pending,
        };
        let prompt = Some(task_text(&record.request.messages))
            .filter(|p| !p.is_empty())
            .map(|p| clip_chars_counted(&p, PROMPT_CHARS));
        let signal = record.signal;
        let decision = record.decision;
        InboxItem {
            decision_id: record.decision_id,
            state,
            kind: decision.kind,
            signal_type: signal.kind,
            code: signal.code,
            severity: signal.severity,
            source: signal.source,
            summary: signal.summary,
            raised_at: signal.ts,
            request_id: record.request_id,
            root_request_id: record.root_request_id,
            chain_position: record.chain_position,
            pool: record.pool,
            worker_id: signal.worker_id,
            job_name: signal.job_name,
            question: decision.question,
            options: decision.options,
            default_option: decision.default_option,
            context: decision.context,
            expires_at: decision.expires_at,
            meta: signal.meta,
            prompt,
            metadata: record.request.metadata,
            answer: record.answer,
            expired_at: record.expired_at,
        }
    }
}

/// The decisions the console shows, at most `max`: pending ones are kept before decided ones,
/// newer before older.
#[derive(Debug)]
pub struct Inbox {
    items: HashMap<String, InboxItem>,
    max: usize,
    /// Pending decisions left out because the inbox was full of newer pending ones.
    dropped_pending: u64,
}

impl Inbox {
    pub fn new(max: usize) -> Inbox {
        Inbox {
            items: HashMap::new(),
            max: max.max(1),
            dropped_pending: 0,
        }
    }

    /// Adds or replaces an item. Returns what changed: the item (when it is new or different)
    /// and the ids of items dropped to stay within the bound.
    pub fn upsert(&mut self, item: InboxItem) -> (Option<InboxItem>, Vec<String>) {
        if self.items.get(&item.decision_id) == Some(&item) {
            return (None, Vec::new());
        }
        self.items.insert(item.decision_id.clone(), item.clone());
        let mut dropped = Vec::new();
        while self.items.len() > self.max {
            let victim = self
                .items
                .values()
                .min_by(|a, b| {
                    // Decided ones go first, then the oldest.
                    (a.state == ItemState::Pending, &a.raised_at, &a.decision_id).cmp(&(
                        b.state == ItemState::Pending,
                        &b.raised_at,
                        &b.decision_id,
                    ))
                })
                .map(|i| (i.decision_id.clone(), i.state))
                .expect("over the bound, so not empty");
            if victim.1 == ItemState::Pending {
                self.dropped_pending += 1;
            }
            self.items.remove(&victim.0);
            dropped.push(victim.0);
        }
        let kept = self.items.get(&item.decision_id).cloned();
        (kept, dropped)
    }

    pub fn remove(&mut self, decision_id: &str) -> bool {
        self.items.remove(decision_id).is_some()
    }

    /// Newest first.
    pub fn items(&self) -> Vec<&InboxItem> {
        let mut items: Vec<&InboxItem> = self.items.values().collect();
        items.sort_by(|a, b| (&b.raised_at, &b.decision_id).cmp(&(&a.raised_at, &a.decision_id)));
        items
    }

    pub fn pending(&self) -> usize {
        self.items
            .values()
            .filter(|i| i.state == ItemState::Pending)
            .count()
    }

    pub fn dropped_pending(&self) -> u64 {
        self.dropped_pending
    }
}

/// A signal in the live feed, with its stream sequence; an oversized `meta` is replaced by a
/// note (the decision, if any, has all of it in the inbox).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FeedSignal {
    pub seq: u64,
    #[serde(flatten)]
    pub signal: Signal,
}

impl FeedSignal {
    pub fn new(seq: u64, mut signal: Signal) -> FeedSignal {
        let size = serde_json::to_vec(&signal.meta).map_or(0, |v| v.len());
        if size > FEED_META_BYTES {
            let mut note = Map::new();
            note.insert(
                "trimmed".into(),
                Value::String(format!(
                    "meta of {size} bytes not kept in the feed; a decision shows all of it in the inbox"
                )),
            );
            signal.meta = note;
        }
        FeedSignal { seq, signal }
    }
}

/// The newest signals, oldest first.
#[derive(Debug)]
pub struct SignalFeed {
    signals: VecDeque<FeedSignal>,
    max: usize,
    /// The stream sequence after the last signal seen, where a restarted follower resumes.
    next_seq: Option<u64>,
}

impl SignalFeed {
    pub fn new(max: usize) -> SignalFeed {
        SignalFeed {
            signals: VecDeque::new(),
            max: max.max(1),
            next_seq: None,
        }
    }

    /// Appends a signal; `false` if it was seen before (a follower that started again).
    pub fn push(&mut self, signal: FeedSignal) -> bool {
        if self.next_seq.is_some_and(|next| signal.seq < next) {
            return false;
        }
        self.next_seq = Some(signal.seq + 1);
        self.signals.push_back(signal);
        while self.signals.len() > self.max {
            self.signals.pop_front();
        }
        true
    }

    pub fn next_seq(&self) -> Option<u64> {
        self.next_seq
    }

    pub fn max(&self) -> usize {
        self.max
    }

    pub fn signals(&self) -> impl Iterator<Item = &FeedSignal> {
        self.signals.iter()
    }
}

/// One worker as the service API describes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerView {
    pub worker_id: String,
    /// The NATS service instance id (`$SRV.STATS.genfleet.<service_id>`).
    pub service_id: String,
    pub pool: String,
    pub version: String,
    pub slots: u64,
    pub busy: u64,
    pub free: u64,
    pub draining: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started: Option<String>,
    /// False when it missed the last poll (it leaves the view after a few).
    pub answering: bool,
    /// Its counts per tenant and band (`tenant`, `band`, `waiting`, `running`, `completed`,
    /// `started`, `wait_ms_total`), as its service stats give them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<Value>,
}

impl WorkerView {
    /// From a worker's `$SRV.INFO` and `$SRV.STATS` replies (the STATS reply alone is enough,
    /// INFO adds the worker id and pool).
    pub fn from_service(stats: &Value, info: Option<&Value>) -> Option<WorkerView> {
        let service_id = stats["id"].as_str()?.to_string();
        let data = stats["endpoints"]
            .as_array()?
            .iter()
            .find(|e| e["name"] == "capacity")
            .or_else(|| stats["endpoints"].get(0))
            .map(|e| &e["data"])?;
        let meta = info.map(|i| &i["metadata"]);
        let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
        Some(WorkerView {
            worker_id: text(meta.map(|m| &m["worker_id"])).unwrap_or_else(|| service_id.clone()),
            pool: text(meta.map(|m| &m["pool"])).unwrap_or_else(|| "?".into()),
            version: text(Some(&stats["version"])).unwrap_or_default(),
            slots: data["slots"].as_u64().unwrap_or(0),
            busy: data["busy"].as_u64().unwrap_or(0),
            free: data["free"].as_u64().unwrap_or(0),
            draining: data["draining"].as_bool().unwrap_or(false),
            started: text(Some(&stats["started"])),
            tenants: data["tenants"].as_array().cloned().unwrap_or_default(),
            service_id,
            answering: true,
        })
    }
}

/// A pool's totals.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolView {
    pub pool: String,
    pub workers: usize,
    pub slots: u64,
    pub busy: u64,
    pub free: u64,
}

/// A request the console saw start (its `started` event) and not yet finish.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunningRequest {
    pub request_id: String,
    pub worker_id: String,
    pub attempt: u32,
    pub chain_position: u32,
    /// The worker's time of the `started` event.
    pub since: String,
    #[serde(skip)]
    seen: Option<Instant>,
}

/// A request whose `finished` event the console saw.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FinishedRequest {
    pub request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    pub state: String,
    pub reason: String,
    pub worker_id: String,
    pub chain_position: u32,
    pub finished_at: String,
    /// Why it ended so, for those that did not complete (its opening).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The fleet as the page shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetView {
    pub workers: Vec<WorkerView>,
    pub pools: Vec<PoolView>,
    pub slots: u64,
    pub busy: u64,
    pub free: u64,
    /// The newest running requests (at most 200) and how many there are.
    pub running: Vec<RunningRequest>,
    pub running_total: usize,
    pub finished: Vec<FinishedRequest>,
    /// When the workers last answered a poll (RFC 3339), if ever.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub polled_at: Option<String>,
}

struct WorkerEntry {
    view: WorkerView,
    missed: u32,
}

/// Workers from the service API, running and finished requests from their events.
#[derive(Default)]
pub struct Fleet {
    workers: BTreeMap<String, WorkerEntry>,
    running: HashMap<String, RunningRequest>,
    finished: VecDeque<FinishedRequest>,
    polled_at: Option<String>,
    /// Something changed since the page was last told.
    dirty: bool,
}

impl Fleet {
    /// Applies one poll round, sent at `asked`: workers that answered are updated, the others
    /// count a missed round (and leave after a few). A worker that answered with no busy slot
    /// ran none of the requests seen starting before the poll.
    pub fn apply_round(&mut self, answered: Vec<WorkerView>, asked: Instant, at: String) {
        let before = self.view();
        let mut seen = std::collections::HashSet::new();
        for view in answered {
            seen.insert(view.service_id.clone());
            self.workers
                .insert(view.service_id.clone(), WorkerEntry { view, missed: 0 });
        }
        for entry in self.workers.values_mut() {
            if !seen.contains(&entry.view.service_id) {
                entry.missed += 1;
                entry.view.answering = false;
            }
        }
        self.workers.retain(|_, e| e.missed < MISSED_ROUNDS);
        let idle: std::collections::HashSet<&str> = self
            .workers
            .values()
            .filter(|e| e.missed == 0 && e.view.busy == 0)
            .map(|e| e.view.worker_id.as_str())
            .collect();
        let known: std::collections::HashSet<&str> = self
            .workers
            .values()
            .map(|e| e.view.worker_id.as_str())
            .collect();
        self.running.retain(|_, r| {
            let before_poll = r.seen.is_some_and(|s| s < asked);
            !(before_poll
                && (idle.contains(r.worker_id.as_str()) || !known.contains(r.worker_id.as_str())))
        });
        self.polled_at = Some(at);
        let after = self.view();
        if (before.workers != after.workers)
            || before.running_total != after.running_total
            || before.running != after.running
        {
            self.dirty = true;
        }
    }

    /// Applies one event of any request: `started` and `finished` change the view.
    pub fn apply_event(&mut self, event: &Event, now: Instant) {
        match &event.body {
            EventBody::Started {
                worker_id,
                attempt,
                chain_position,
            } => {
                if self.running.len() >= MAX_RUNNING
                    && let Some(oldest) = self
                        .running
                        .values()
                        .min_by(|a, b| a.since.cmp(&b.since))
                        .map(|r| r.request_id.clone())
                {
                    self.running.remove(&oldest);
                }
                self.running.insert(
                    event.request_id.clone(),
                    RunningRequest {
                        request_id: event.request_id.clone(),
                        worker_id: worker_id.clone(),
                        attempt: *attempt,
                        chain_position: *chain_position,
                        since: event.ts.clone(),
                        seen: Some(now),
                    },
                );
                self.dirty = true;
            }
            EventBody::Finished { result } => {
                self.running.remove(&event.request_id);
                self.finished.push_front(FinishedRequest {
                    request_id: event.request_id.clone(),
                    job_name: result.job_name.clone(),
                    state: enum_name(&result.state),
                    reason: enum_name(&result.reason),
                    worker_id: result.worker_id.clone(),
                    chain_position: result.chain_position,
                    finished_at: event.ts.clone(),
                    detail: result
                        .detail
                        .as_deref()
                        .filter(|_| result.state != RequestState::Completed)
                        .map(|d| clip_chars_counted(d, FINISHED_DETAIL_CHARS)),
                });
                self.finished.truncate(FINISHED_SHOWN);
                self.dirty = true;
            }
            _ => {}
        }
    }

    /// Whether something changed since the last call (and clears it).
    pub fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    pub fn view(&self) -> FleetView {
        let mut workers: Vec<WorkerView> = self.workers.values().map(|e| e.view.clone()).collect();
        workers.sort_by(|a, b| (&a.pool, &a.worker_id).cmp(&(&b.pool, &b.worker_id)));
        let mut pools: BTreeMap<&str, PoolView> = BTreeMap::new();
        for w in &workers {
            let pool = pools.entry(w.pool.as_str()).or_insert_with(|| PoolView {
                pool: w.pool.clone(),
                workers: 0,
                slots: 0,
                busy: 0,
                free: 0,
            });
            pool.workers += 1;
            pool.slots += w.slots;
            pool.busy += w.busy;
            pool.free += w.free;
        }
        let mut running: Vec<RunningRequest> = self.running.values().cloned().collect();
        running.sort_by(|a, b| (&b.since, &b.request_id).cmp(&(&a.since, &a.request_id)));
        running.truncate(RUNNING_SHOWN);
        FleetView {
            slots: workers.iter().map(|w| w.slots).sum(),
            busy: workers.iter().map(|w| w.busy).sum(),
            free: workers.iter().map(|w| w.free).sum(),
            pools: pools.into_values().collect(),
            workers,
            running,
            running_total: self.running.len(),
            finished: self.finished.iter().cloned().collect(),
            polled_at: self.polled_at.clone(),
        }
    }
}

/// A unit enum's wire name (`COMPLETED`, `decision_requested`).
fn enum_name<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// How the console's links to the fleet are doing; `None` is fine, otherwise why not.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Links {
    pub decisions: Option<String>,
    pub signals: Option<String>,
    pub events: Option<String>,
    pub results: Option<String>,
    pub nats_connected: bool,
}

/// Everything the console knows.
pub struct State {
    pub inbox: Inbox,
    pub signals: SignalFeed,
    pub fleet: Fleet,
    pub requests: Requests,
    /// The bucket the pools' series last ended in, when the pages were told.
    pub series_epoch: u64,
    /// The results bucket's revision after the last record seen, where a restarted watch
    /// resumes.
    pub results_seq: Option<u64>,
    pub links: Links,
}

impl State {
    pub fn new(max_inbox: usize, max_signals: usize, max_requests: usize) -> State {
        State {
            inbox: Inbox::new(max_inbox),
            signals: SignalFeed::new(max_signals),
            fleet: Fleet::default(),
            requests: Requests::new(max_requests),
            series_epoch: 0,
            results_seq: None,
            links: Links::default(),
        }
    }

    /// The fleet view with each pool's throughput and latency series.
    pub fn fleet_json(&self) -> Value {
        let view = self.fleet.view();
        let pools: Vec<String> = view.pools.iter().map(|p| p.pool.clone()).collect();
        let mut value = serde_json::to_value(&view).expect("the fleet view serializes");
        value["series"] =
            serde_json::to_value(self.requests.series(std::time::SystemTime::now(), &pools))
                .expect("the series serialize");
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{DecisionAnswer, DecisionBlock, GenerationRequest, GenerationResult};
    use serde_json::json;

    fn record(id: &str, ts: &str) -> DecisionRecord {
        let decision = DecisionBlock {
            decision_id: id.into(),
            question: "Which path?".into(),
            options: vec![
                DecisionOption {
                    id: "fast".into(),
                    label: "Fast".into(),
                    pros: Some("quick".into()),
                    cons: None,
                },
                DecisionOption {
                    id: "safe".into(),
                    label: "Safe".into(),
                    pros: None,
                    cons: Some("slow".into()),
                },
            ],
            default_option: Some("safe".into()),
            context: Some("a migration".into()),
            kind: DecisionKind::Model,
            expires_at: None,
        };
        let mut request = GenerationRequest::user("Plan the migration.");
        request.metadata.insert("tenant".into(), json!("acme"));
        DecisionRecord {
            decision_id: id.into(),
            request_id: format!("r-{id}"),
            root_request_id: format!("r-{id}"),
            chain_position: 1,
            pool: "default".into(),
            decision: decision.clone(),
            signal: signal(ts, Some(decision)),
            request,
            continued_seq: 3,
            chain: Default::default(),
            tenant: None,
            answer: None,
            expired_at: None,
            traceparent: None,
        }
    }

    fn signal(ts: &str, decision: Option<DecisionBlock>) -> Signal {
        Signal {
            signal_id: format!("s-{ts}"),
            kind: SignalType::DecisionRequest,
            code: "NEEDS_MANAGER_DECISION".into(),
            source: SignalSource::Model,
            severity: Severity::Med,
            summary: "Which path?".into(),
            meta: Map::new(),
            request_id: "r".into(),
            root_request_id: "r".into(),
            job_name: Some("migrate".into()),
            worker_id: "w1".into(),
            pool: "default".into(),
            ts: ts.into(),
            decision,
        }
    }

    fn answered(mut r: DecisionRecord, by: &str) -> DecisionRecord {
        r.answer = Some(Answer {
            choice: DecisionAnswer {
                decided_by: Some(by.into()),
                ..DecisionAnswer::option("fast")
            },
            outcome: crate::protocol::DecisionOutcome::Continued,
            continuation_request_id: Some("c1".into()),
            decided_at: "2026-01-01T00:00:09.000Z".into(),
        });
        r
    }

    #[test]
    fn an_item_carries_the_decision_its_task_and_its_answer() {
        let item = InboxItem::from_record(record("d1", "2026-01-01T00:00:00.000Z"));
        assert_eq!(item.state, ItemState::Pending);
        assert_eq!(item.prompt.as_deref(), Some("Plan the migration."));
        assert_eq!(item.metadata["tenant"], "acme");
        assert_eq!(item.options[0].pros.as_deref(), Some("quick"));
        let value = serde_json::to_value(&item).unwrap();
        assert_eq!(value["type"], "decision_request");
        assert_eq!(value["kind"], "model");
        assert!(value.get("answer").is_none());
        let item = InboxItem::from_record(answered(
            record("d1", "2026-01-01T00:00:00.000Z"),
            "human:ann",
        ));
        assert_eq!(item.state, ItemState::Answered);
        assert_eq!(
            item.answer.unwrap().choice.decided_by.as_deref(),
            Some("human:ann")
        );
        let mut expired = record("d2", "2026-01-01T00:00:00.000Z");
        expired.expired_at = Some("2026-01-02T00:00:00.000Z".into());
        assert_eq!(InboxItem::from_record(expired).state, ItemState::Expired);
    }

    #[test]
    fn the_inbox_is_newest_first_and_drops_decided_items_before_pending_ones() {
        let mut inbox = Inbox::new(3);
        let item = |id: &str, second: u32| {
            InboxItem::from_record(record(id, &format!("2026-01-01T00:00:{second:02}.000Z")))
        };
        assert!(inbox.upsert(item("a", 1)).0.is_some());
        assert!(inbox.upsert(item("a", 1)).0.is_none(), "unchanged");
        inbox.upsert(item("b", 2));
        inbox.upsert(InboxItem::from_record(answered(
            record("c", "2026-01-01T00:00:03.000Z"),
            "human:ann",
        )));
        let ids = |inbox: &Inbox| {
            inbox
                .items()
                .iter()
                .map(|i| i.decision_id.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&inbox), ["c", "b", "a"]);
        // Full: the decided item goes, although it is the newest.
        let (_, dropped) = inbox.upsert(item("d", 4));
        assert_eq!(dropped, ["c"]);
        assert_eq!(ids(&inbox), ["d", "b", "a"]);
        assert_eq!((inbox.pending(), inbox.dropped_pending()), (3, 0));
        // Only pending ones left: the oldest goes, and is counted.
        let (_, dropped) = inbox.upsert(item("e", 5));
        assert_eq!(dropped, ["a"]);
        assert_eq!(inbox.dropped_pending(), 1);
        assert!(inbox.remove("e"));
        assert_eq!(ids(&inbox), ["d", "b"]);
    }

    #[test]
    fn the_feed_keeps_the_newest_signals_once_each_and_trims_large_meta() {
        let mut feed = SignalFeed::new(2);
        for seq in [5, 6, 6, 4, 7] {
            feed.push(FeedSignal::new(seq, signal("t", None)));
        }
        let seqs: Vec<u64> = feed.signals().map(|s| s.seq).collect();
        assert_eq!(seqs, [6, 7]);
        assert_eq!(feed.next_seq(), Some(8));
        let mut big = signal("t", None);
        big.meta.insert("prompt".into(), json!("x".repeat(10_000)));
        big.meta.insert("confidence".into(), json!(0.5));
        let kept = FeedSignal::new(1, big);
        assert_eq!(kept.signal.meta.len(), 1);
        assert!(
            kept.signal.meta["trimmed"]
                .as_str()
                .unwrap()
                .contains("inbox")
        );
        let value = serde_json::to_value(&kept).unwrap();
        assert_eq!(
            (value["seq"].as_u64(), value["type"].as_str()),
            (Some(1), Some("decision_request"))
        );
    }

    fn worker(service: &str, worker: &str, busy: u64) -> WorkerView {
        let stats = json!({"id": service, "version": "0.1.0", "started": "2026-01-01T00:00:00Z",
            "endpoints": [{"name": "capacity", "data": {"slots": 2, "busy": busy, "free": 2 - busy, "draining": false}}]});
        let info = json!({"id": service, "metadata": {"worker_id": worker, "pool": "default", "slots": "2"}});
        WorkerView::from_service(&stats, Some(&info)).unwrap()
    }

    fn event(id: &str, body: EventBody) -> Event {
        Event {
            request_id: id.into(),
            seq: 0,
            ts: "2026-01-01T00:00:01.000Z".into(),
            body,
        }
    }

    #[test]
    fn the_fleet_follows_polls_and_events() {
        let mut fleet = Fleet::default();
        let t0 = Instant::now();
        fleet.apply_round(
            vec![worker("s1", "w1", 0), worker("s2", "w2", 1)],
            t0,
            "t0".into(),
        );
        assert!(fleet.take_dirty());
        assert!(!fleet.take_dirty());
        let view = fleet.view();
        assert_eq!((view.slots, view.busy, view.free), (4, 1, 3));
        assert_eq!(view.pools.len(), 1);
        assert_eq!(view.pools[0].workers, 2);
        assert_eq!(view.workers[0].worker_id, "w1");

        let started = |worker: &str| EventBody::Started {
            worker_id: worker.into(),
            attempt: 1,
            chain_position: 1,
        };
        let seen = Instant::now();
        fleet.apply_event(&event("r1", started("w2")), seen);
        fleet.apply_event(&event("r2", started("w1")), seen);
        fleet.apply_event(
            &event("ignored", EventBody::Delta { text: "x".into() }),
            seen,
        );
        assert_eq!(fleet.view().running_total, 2);
        let result: GenerationResult = serde_json::from_value(json!({
            "request_id": "r1", "root_request_id": "r1", "parent_request_id": null,
            "state": "COMPLETED", "reason": "stop", "output": "", "messages": [], "signals": [],
            "signals_dropped": 0, "tool_iterations_used": 0,
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "worker_id": "w2",
            "attempt": 1, "chain_position": 1, "truncated": false,
            "timings_ms": {"queued": 0, "total": 1}
        }))
        .unwrap();
        fleet.apply_event(
            &event(
                "r1",
                EventBody::Finished {
                    result: Box::new(result),
                },
            ),
            seen,
        );
        let view = fleet.view();
        assert_eq!(view.running_total, 1);
        assert_eq!(view.finished[0].request_id, "r1");
        assert_eq!(view.finished[0].reason, "stop");
        assert_eq!(view.finished[0].detail, None);
        // A failure is listed with why.
        let mut failed: GenerationResult = serde_json::from_value(json!({
            "request_id": "r0", "root_request_id": "r0", "parent_request_id": null,
            "state": "FAILED", "reason": "backend_error", "output": "", "messages": [],
            "signals": [], "signals_dropped": 0, "tool_iterations_used": 0,
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "worker_id": "w2",
            "attempt": 1, "chain_position": 1, "truncated": false,
            "timings_ms": {"queued": 0, "total": 1}
        }))
        .unwrap();
        failed.detail = Some("out of memory ".repeat(100));
        fleet.apply_event(
            &event(
                "r0",
                EventBody::Finished {
                    result: Box::new(failed),
                },
            ),
            seen,
        );
        let view = fleet.view();
        assert_eq!(view.finished[0].reason, "backend_error");
        let detail = view.finished[0].detail.clone().unwrap();
        assert!(
            detail.starts_with("out of memory out of memory"),
            "{detail}"
        );
        assert!(
            detail.chars().count() < FINISHED_DETAIL_CHARS + 50,
            "{detail}"
        );

        // A poll asked before r2 started does not end it; one after, with w1 idle, does.
        fleet.apply_round(
            vec![worker("s1", "w1", 0), worker("s2", "w2", 0)],
            t0,
            "t1".into(),
        );
        assert_eq!(fleet.view().running_total, 1);
        let later = Instant::now();
        fleet.apply_round(vec![worker("s1", "w1", 0)], later, "t2".into());
        assert_eq!(fleet.view().running_total, 0);
        // w2 missed a round: still shown, not answering; gone after three.
        let view = fleet.view();
        assert_eq!(view.workers.len(), 2);
        assert!(!view.workers[1].answering);
        for _ in 0..2 {
            fleet.apply_round(vec![worker("s1", "w1", 0)], Instant::now(), "t".into());
        }
        assert_eq!(fleet.view().workers.len(), 1);
    }
}
