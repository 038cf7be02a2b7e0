//! After the load: every request the callers sent, and every continuation the fleet started
//! for them, counted once, by what the fleet says of it. A request is accepted when its
//! caller got an acceptance or the fleet knows it (its events were seen, or `status` finds
//! it); one the fleet never knew was refused up front, whatever its caller saw. An accepted
//! request ends in one terminal result: one with none when the run is over is lost, and one
//! with a second `finished` event finished twice.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;

use super::super::book::{Book, Followed, faulty, finished_result, runs_side_by_side};
use super::lanes::{Acceptance, Call, Kind};
use crate::client::{Client, ClientError};
use crate::protocol::{
    DecisionOutcome, ErrorCode, FinishedSummary, GenerationResult, Reason, RequestState,
    StatusReply,
};

/// Status lookups in flight at once.
const LOOKUPS: usize = 16;
/// Between two rounds of looking at the requests not yet ended.
const ROUND: Duration = Duration::from_secs(1);
/// How many ids of each kind of fault a report lists.
pub const IDS_LISTED: usize = 10;

/// A request that asked for a decision still unanswered when the run ended.
#[derive(Debug, Clone, Serialize)]
pub struct Unanswered {
    pub request_id: String,
    /// `None`: the fleet has no record of the decision.
    pub decision_id: Option<String>,
    /// `pending`, `continued` (with no continuation named), or `None`.
    pub outcome: Option<&'static str>,
    /// Whether the signals stream holds the decision's signal (what managers follow); `None`
    /// when it could not be read.
    pub signal_stored: Option<bool>,
}

/// A request the run counts.
#[derive(Debug, Clone)]
pub struct Tracked {
    pub kind: Kind,
    pub acceptance: Acceptance,
}

/// How an accepted request ended, as the fleet tells it.
#[derive(Debug, Clone)]
pub enum End {
    /// Its first `finished` event carried its result.
    Event(Box<GenerationResult>),
    /// No `finished` event reached the bench; its stored result.
    Stored(Box<GenerationResult>),
    /// No `finished` event, and its result was read already (a gateway reads and releases
    /// what it answers): the summary the fleet keeps.
    Summary(Box<FinishedSummary>),
    /// Terminal, with neither a result nor a summary left.
    Bare(RequestState),
}

impl End {
    pub fn state(&self) -> RequestState {
        match self {
            End::Event(r) | End::Stored(r) => r.state,
            End::Summary(s) => s.state,
            End::Bare(state) => *state,
        }
    }

    pub fn reason(&self) -> Option<Reason> {
        match self {
            End::Event(r) | End::Stored(r) => Some(r.reason),
            End::Summary(s) => Some(s.reason),
            End::Bare(_) => None,
        }
    }

    pub fn result(&self) -> Option<&GenerationResult> {
        match self {
            End::Event(r) | End::Stored(r) => Some(r),
            _ => None,
        }
    }

    pub fn output_chars(&self) -> Option<u64> {
        match self {
            End::Event(r) | End::Stored(r) => Some(r.output.chars().count() as u64),
            End::Summary(s) => Some(s.output_chars as u64),
            End::Bare(_) => None,
        }
    }
}

/// A request as counted.
#[derive(Debug, Clone)]
pub struct Counted {
    pub id: String,
    pub kind: Kind,
    pub accepted: bool,
    pub end: Option<End>,
    /// `finished` events seen.
    pub finished_events: u32,
    /// Its events skipped or repeated a `seq` as a follower took them.
    pub seq_fault: bool,
    /// COMPLETED, and its deltas joined differ from its output.
    pub delta_mismatch: bool,
    /// Workers that ran it side by side: each started or took it up at the same point (an
    /// empty list, one run at a time).
    pub side_by_side: Vec<String>,
    /// For people: a lost request's status after the run, a faulty one's events.
    pub told: Option<String>,
}

impl Counted {
    pub fn lost(&self) -> bool {
        self.accepted && self.end.is_none()
    }
}

/// Waits, within `bound`, until every accepted request has ended: its `finished` event was
/// seen, or `status` says it is terminal. Continuations are added as they become known (the
/// book saw their events, the lanes followed them, a decision's status names one). Requests
/// the fleet does not know are not waited for, unless their callers were told they were
/// accepted. Returns the requests whose decision was still unanswered at the end (their
/// chain waits for the decision's expiry), with their decision.
pub async fn settle(
    book: &Book,
    lookup: &Client,
    tracked: &mut BTreeMap<String, Tracked>,
    bound: Duration,
) -> Vec<Unanswered> {
    let deadline = Instant::now() + bound;
    loop {
        add_unknown(book, tracked);
        let open: Vec<String> = tracked
            .iter()
            .filter(|(id, _)| !book.finished(id))
            .map(|(id, _)| id.clone())
            .collect();
        // Requests asking for a decision: their continuation is tracked once it is named.
        let asking: Vec<String> = tracked
            .keys()
            .filter(|id| {
                book.result(id)
                    .is_some_and(|r| r.reason == Reason::DecisionRequested)
            })
            .cloned()
            .collect();
        let looked = statuses(lookup, open.iter().chain(&asking).cloned().collect()).await;
        let mut waiting = 0;
        let mut unanswered = Vec::new();
        for (id, status) in &looked {
            match status {
                Ok(status) => {
                    if let Some(next) = &status.continuation_request_id {
                        tracked.entry(next.clone()).or_insert(Tracked {
                            kind: Kind::Continuation,
                            acceptance: Acceptance::Accepted,
                        });
                    }
                    // A request that ended asking for a decision: its chain goes on until the
                    // decision is answered (and its continuation named) or ends it.
                    let asks = asking.contains(id)
                        || status
                            .finished
                            .as_ref()
                            .is_some_and(|f| f.reason == Reason::DecisionRequested);
                    let chain_open = asks
                        && match status.decision_outcome {
                            None | Some(DecisionOutcome::Pending) => true,
                            Some(DecisionOutcome::Continued) => {
                                status.continuation_request_id.is_none()
                            }
                            Some(_) => false,
                        };
                    if !status.state.is_terminal() || chain_open {
                        waiting += 1;
                    }
                    if chain_open {
                        unanswered.push(Unanswered {
                            request_id: id.clone(),
                            decision_id: status.decision_id.clone(),
                            outcome: status.decision_outcome.map(DecisionOutcome::as_str),
                            signal_stored: None,
                        });
                    }
                }
                Err(ClientError::Wire(error)) if error.code == ErrorCode::NotFound => {
                    // Known to be accepted and unknown to the fleet: waited for (the report
                    // counts it lost if it stays so); otherwise never taken.
                    if tracked
                        .get(id)
                        .is_some_and(|t| t.acceptance == Acceptance::Accepted)
                    {
                        waiting += 1;
                    }
                }
                // No answer (a node electing): asked again.
                Err(_) => waiting += 1,
            }
        }
        if waiting == 0 || Instant::now() >= deadline {
            unanswered.sort_by(|a, b| a.request_id.cmp(&b.request_id));
            return unanswered;
        }
        tokio::time::sleep(ROUND).await;
    }
}

/// Marks each unanswered decision with whether the signals stream `stream` holds its signal,
/// read once from its start (at most [`SIGNALS_READ`] messages).
pub async fn find_signals(
    connection: &async_nats::Client,
    stream: &str,
    unanswered: &mut [Unanswered],
) {
    let ids: Vec<String> = unanswered
        .iter()
        .filter_map(|u| u.decision_id.clone())
        .collect();
    if ids.is_empty() {
        return;
    }
    let found = match signals_naming(connection, stream, &ids).await {
        Ok(found) => found,
        Err(error) => {
            tracing::debug!(message = "the signals stream could not be read", %error);
            return;
        }
    };
    for u in unanswered.iter_mut() {
        u.signal_stored = u.decision_id.as_ref().map(|id| found.contains(id));
    }
}

/// Signals read at most when looking for the unanswered decisions'.
const SIGNALS_READ: u64 = 100_000;

/// Which of `ids` a message of `stream` names.
async fn signals_naming(
    connection: &async_nats::Client,
    stream: &str,
    ids: &[String],
) -> anyhow::Result<std::collections::BTreeSet<String>> {
    use async_nats::jetstream::consumer;
    let jetstream = async_nats::jetstream::new(connection.clone());
    let mut stream = jetstream.get_stream(stream).await?;
    let held = stream.info().await?.state.messages.min(SIGNALS_READ);
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            description: Some("genfleet bench: looking for unanswered decisions".into()),
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut found = std::collections::BTreeSet::new();
    for _ in 0..held {
        let Ok(Some(Ok(message))) =
            tokio::time::timeout(Duration::from_secs(5), messages.next()).await
        else {
            break;
        };
        let text = String::from_utf8_lossy(&message.payload);
        for id in ids.iter().filter(|id| text.contains(id.as_str())) {
            found.insert(id.clone());
        }
    }
    Ok(found)
}

/// Every request the book has events of that no caller sent: a continuation.
fn add_unknown(book: &Book, tracked: &mut BTreeMap<String, Tracked>) {
    for id in book.ids() {
        tracked.entry(id).or_insert(Tracked {
            kind: Kind::Continuation,
            acceptance: Acceptance::Accepted,
        });
    }
}

async fn statuses(
    lookup: &Client,
    ids: Vec<String>,
) -> HashMap<String, Result<StatusReply, ClientError>> {
    futures_util::stream::iter(ids)
        .map(|id| async move {
            let status = lookup.status(&id).await;
            (id, status)
        })
        .buffer_unordered(LOOKUPS)
        .collect()
        .await
}

/// Counts every tracked request by what the fleet says of it now. Call it once the book has
/// had its grace period: the events it holds are taken out of it.
pub async fn count(
    book: &Book,
    lookup: &Client,
    tracked: &BTreeMap<String, Tracked>,
) -> Vec<Counted> {
    futures_util::stream::iter(tracked.iter())
        .map(|(id, t)| count_one(book, lookup, id, t))
        .buffer_unordered(LOOKUPS)
        .collect()
        .await
}

async fn count_one(book: &Book, lookup: &Client, id: &str, tracked: &Tracked) -> Counted {
    let seen = book.take(id);
    let mut told = None;
    let mut known_to_fleet = !seen.events.is_empty();
    let end = match finished_result(&seen) {
        Some(result) => Some(End::Event(Box::new(result))),
        None => match lookup.result(id, false).await {
            Ok(result) => Some(End::Stored(Box::new(result))),
            Err(_) => match lookup.status(id).await {
                Ok(status) => {
                    known_to_fleet = true;
                    if status.state.is_terminal() {
                        Some(match status.finished {
                            Some(summary) => End::Summary(Box::new(summary)),
                            None => End::Bare(status.state),
                        })
                    } else {
                        told = Some(serde_json::to_string(&status).unwrap_or_default());
                        None
                    }
                }
                Err(ClientError::Wire(error)) if error.code == ErrorCode::NotFound => {
                    told = Some("status: NOT_FOUND".into());
                    None
                }
                Err(error) => {
                    known_to_fleet = true;
                    told = Some(format!("status: {error}"));
                    None
                }
            },
        },
    };
    let accepted = tracked.acceptance == Acceptance::Accepted || known_to_fleet || end.is_some();
    let followed = Followed::of(&seen.events);
    let side_by_side = runs_side_by_side(&seen.events);
    let seq_fault = followed.missing + followed.conflicting > 0;
    let delta_mismatch = match end.as_ref().and_then(End::result) {
        Some(result) if !seen.events.is_empty() => {
            result.state == RequestState::Completed && followed.deltas() != result.output
        }
        _ => false,
    };
    if (seq_fault || delta_mismatch || !side_by_side.is_empty())
        && let Some(result) = end.as_ref().and_then(End::result)
    {
        told = Some(faulty(id, &seen.events, result));
    }
    if seen.finished > 1 {
        let ends: Vec<String> = seen
            .events
            .iter()
            .filter_map(|(event, _)| match &event.body {
                crate::protocol::EventBody::Finished { result } => Some(format!(
                    "seq {} {} {} on {}",
                    event.seq,
                    result.state.as_str(),
                    result.reason.as_str(),
                    result.worker_id
                )),
                _ => None,
            })
            .collect();
        told = Some(format!("finished events: {}", ends.join("; ")));
    }
    Counted {
        id: id.to_string(),
        kind: tracked.kind,
        accepted,
        end,
        finished_events: seen.finished,
        seq_fault,
        delta_mismatch,
        side_by_side,
        told,
    }
}

/// The counts of one kind of request, or of all.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Totals {
    /// Sent by the callers (continuations: started by the fleet).
    pub sent: u64,
    pub accepted: u64,
    /// Never known to the fleet: refused, or lost on the way before anything took it.
    pub refused_up_front: u64,
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
    /// Accepted, and no terminal result after the run.
    pub lost: u64,
    pub finished_twice: u64,
    /// Ended, but no `finished` event reached the bench.
    pub finished_event_missed: u64,
    /// Events that skipped or repeated a `seq` (with other content).
    pub seq_faults: u64,
    pub delta_mismatches: u64,
    /// Run by two or more workers side by side (each took it up from the same checkpoint):
    /// its followers saw both runs' events, and the backend generated its text more than once.
    pub run_side_by_side: u64,
}

impl Totals {
    pub fn add(&mut self, c: &Counted) {
        self.sent += 1;
        if !c.accepted {
            self.refused_up_front += 1;
            return;
        }
        self.accepted += 1;
        match c.end.as_ref().map(End::state) {
            Some(RequestState::Completed) => self.completed += 1,
            Some(RequestState::Cancelled) => self.cancelled += 1,
            Some(_) => self.failed += 1,
            None => self.lost += 1,
        }
        self.finished_twice += u64::from(c.finished_events > 1);
        self.finished_event_missed += u64::from(c.end.is_some() && c.finished_events == 0);
        self.seq_faults += u64::from(c.seq_fault);
        self.delta_mismatches += u64::from(c.delta_mismatch);
        self.run_side_by_side += u64::from(!c.side_by_side.is_empty());
    }
}

/// Everything counted, by kind and in all, with the first ids of each fault.
#[derive(Debug, Clone, Serialize)]
pub struct Tally {
    pub all: Totals,
    pub by_kind: BTreeMap<Kind, Totals>,
    /// How the accepted requests that did not complete ended (`FAILED worker_lost` ...).
    pub not_completed: BTreeMap<String, u64>,
    /// The first lost requests: id, kind, and what `status` said after the run.
    pub lost: Vec<String>,
    pub finished_twice: Vec<String>,
    /// The first requests run side by side: id, the workers, its events.
    pub side_by_side: Vec<String>,
    pub faulty: Vec<String>,
    /// Accepted requests whose end is known only from the fleet's summary (their result was
    /// read and their `finished` event missed): their affinity and text are not checked.
    pub known_by_summary: u64,
}

pub fn tally(counted: &[Counted]) -> Tally {
    let mut all = Totals::default();
    let mut by_kind: BTreeMap<Kind, Totals> = BTreeMap::new();
    let mut not_completed = BTreeMap::new();
    let (mut lost, mut twice, mut faulty) = (Vec::new(), Vec::new(), Vec::new());
    let mut side_by_side = Vec::new();
    let mut known_by_summary = 0;
    for c in counted {
        all.add(c);
        by_kind.entry(c.kind).or_default().add(c);
        let told = || {
            format!(
                "{} ({}): {}",
                c.id,
                c.kind.label(),
                c.told.as_deref().unwrap_or("-")
            )
        };
        if c.lost() && lost.len() < IDS_LISTED {
            lost.push(told());
        }
        if c.finished_events > 1 && twice.len() < IDS_LISTED {
            twice.push(told());
        }
        if !c.side_by_side.is_empty() && side_by_side.len() < IDS_LISTED {
            side_by_side.push(format!("[{}] {}", c.side_by_side.join(", "), told()));
        } else if (c.seq_fault || c.delta_mismatch) && faulty.len() < IDS_LISTED {
            faulty.push(told());
        }
        if let Some(end) = &c.end {
            known_by_summary += u64::from(matches!(end, End::Summary(_) | End::Bare(_)));
            if end.state() != RequestState::Completed {
                let how = format!(
                    "{} {}",
                    end.state().as_str(),
                    end.reason().map_or("-", Reason::as_str)
                );
                *not_completed.entry(how).or_default() += 1;
            }
        }
    }
    Tally {
        all,
        by_kind,
        not_completed,
        lost,
        finished_twice: twice,
        side_by_side,
        faulty,
        known_by_summary,
    }
}

/// The requests the callers sent, by their id on the bus, with the continuations the lanes
/// followed.
pub fn tracked(calls: &[Call], continuations: &[String]) -> BTreeMap<String, Tracked> {
    let mut tracked = BTreeMap::new();
    for call in calls {
        tracked.insert(
            call.id.clone(),
            Tracked {
                kind: call.kind,
                acceptance: call.acceptance.clone(),
            },
        );
    }
    for id in continuations {
        tracked.entry(id.clone()).or_insert(Tracked {
            kind: Kind::Continuation,
            acceptance: Acceptance::Accepted,
        });
    }
    tracked
}

/// Characters of the outputs of every accepted request that ended, and how many ended
/// without their output's length being known.
pub fn output_chars(counted: &[Counted]) -> (u64, u64) {
    let mut chars = 0;
    let mut unknown = 0;
    for c in counted.iter().filter(|c| c.accepted) {
        match c.end.as_ref().and_then(End::output_chars) {
            Some(n) => chars += n,
            None => unknown += 1,
        }
    }
    (chars, unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(kind: Kind, accepted: bool, end: Option<RequestState>, finished: u32) -> Counted {
        Counted {
            id: "r".into(),
            kind,
            accepted,
            end: end.map(End::Bare),
            finished_events: finished,
            seq_fault: false,
            delta_mismatch: false,
            side_by_side: Vec::new(),
            told: None,
        }
    }

    #[test]
    fn every_request_is_counted_once_in_one_way() {
        let all = [
            counted(Kind::BusInteractive, true, Some(RequestState::Completed), 1),
            counted(Kind::BusInteractive, false, None, 0),
            counted(Kind::GatewayWhole, true, Some(RequestState::Failed), 0),
            counted(Kind::Durable, true, None, 0),
            counted(Kind::Durable, true, Some(RequestState::Completed), 2),
            counted(Kind::Continuation, true, Some(RequestState::Cancelled), 1),
        ];
        let t = tally(&all);
        assert_eq!(t.all.sent, 6);
        assert_eq!(t.all.refused_up_front, 1);
        assert_eq!(t.all.accepted, 5);
        assert_eq!(
            t.all.completed + t.all.failed + t.all.cancelled + t.all.lost,
            t.all.accepted
        );
        assert_eq!((t.all.lost, t.all.finished_twice), (1, 1));
        assert_eq!(t.all.finished_event_missed, 1);
        assert_eq!(t.by_kind[&Kind::Durable].lost, 1);
        assert_eq!(t.lost.len(), 1);
        assert_eq!(t.not_completed.get("FAILED -"), Some(&1));
        assert_eq!(t.not_completed.get("CANCELLED -"), Some(&1));
    }
}
