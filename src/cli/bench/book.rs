//! Every request's events, as one wildcard subscription reads them: a request is followed by
//! the bench apart from its caller, so that a second `finished` for it is seen wherever it
//! comes from, and what a follower of its events got can be checked against its result. The
//! churn phase and the fleet run count lost requests, requests finished twice and sequence
//! faults from it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::oneshot;

use crate::client::Client;
use crate::client::subjects::Subjects;
use crate::protocol::event::SEQ_AFTER_LOST;
use crate::protocol::{Event, EventBody, GenerationResult};

/// Between two looks at the stored result of a request whose `finished` event has not come.
const RESULT_POLL: Duration = Duration::from_secs(2);
/// Requests a book holds at most; the events of any more are not kept (and counted). A run is
/// bounded in time and its callers in number, so a run never comes near it.
const MAX_REQUESTS: usize = 200_000;

/// What the book saw of one request: its events with their arrival, and whom to tell of its
/// first `finished`.
#[derive(Default)]
pub struct Seen {
    pub events: Vec<(Event, Instant)>,
    /// `finished` events seen.
    pub finished: u32,
    waiter: Option<oneshot::Sender<()>>,
}

/// Every request's events, filled by one wildcard subscription ([`Book::collect`]).
#[derive(Default, Clone)]
pub struct Book(Arc<Mutex<Pages>>);

#[derive(Default)]
struct Pages {
    seen: HashMap<String, Seen>,
    /// Events of requests past [`MAX_REQUESTS`], not kept.
    overflow: u64,
}

/// The task that fills a book; it stops when dropped.
pub struct Collector(tokio::task::JoinHandle<()>);

impl Drop for Collector {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Book {
    /// Subscribes to every request's events (`<gen>.events.>`: a tenant's requests too, whose
    /// subjects carry their tenant) on `connection`, and records them until the collector is
    /// dropped. The subscription is in place when this returns.
    pub async fn collect(
        connection: &async_nats::Client,
        subjects: &Subjects,
    ) -> anyhow::Result<(Book, Collector)> {
        let mut events = connection.subscribe(subjects.events(">")).await?;
        connection.flush().await?;
        let book = Book::default();
        let filling = book.clone();
        let task = tokio::spawn(async move {
            while let Some(message) = events.next().await {
                if let Ok(event) = Event::from_json(&message.payload) {
                    filling.record(event);
                }
            }
        });
        Ok((book, Collector(task)))
    }

    /// Registers `id` before its submit; the receiver is told of its first `finished`.
    pub fn expect(&self, id: &str) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let mut pages = self.lock();
        if let Some(seen) = pages.page(id) {
            if seen.finished > 0 {
                let _ = tx.send(());
            } else {
                seen.waiter = Some(tx);
            }
        }
        rx
    }

    pub fn record(&self, event: Event) {
        let mut pages = self.lock();
        let Some(seen) = pages.page(&event.request_id) else {
            pages.overflow += 1;
            return;
        };
        if matches!(event.body, EventBody::Finished { .. }) {
            seen.finished += 1;
            if let Some(waiter) = seen.waiter.take() {
                let _ = waiter.send(());
            }
        }
        seen.events.push((event, Instant::now()));
    }

    /// What was seen of `id`, taken out of the book.
    pub fn take(&self, id: &str) -> Seen {
        self.lock().seen.remove(id).unwrap_or_default()
    }

    /// Every request the book has events of.
    pub fn ids(&self) -> Vec<String> {
        let pages = self.lock();
        pages
            .seen
            .iter()
            .filter(|(_, seen)| !seen.events.is_empty())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Whether a `finished` event of `id` was seen.
    pub fn finished(&self, id: &str) -> bool {
        self.lock()
            .seen
            .get(id)
            .is_some_and(|seen| seen.finished > 0)
    }

    /// The result `id`'s first `finished` event carried, if one came.
    pub fn result(&self, id: &str) -> Option<GenerationResult> {
        self.lock().seen.get(id).and_then(finished_result)
    }

    /// Waits for `id`'s end, at most `settle`: its first `finished` event (`finished` is the
    /// receiver [`Book::expect`] gave), or its stored result, looked at every [`RESULT_POLL`]
    /// so that a request whose `finished` event did not reach the book (the reports count
    /// them) does not hold its caller for the whole `settle`. `client` reads the result (its
    /// tenant qualifies a bare `id`); the book knows the request by its id on the bus.
    pub async fn wait_for_end(
        &self,
        client: &Client,
        id: &str,
        mut finished: oneshot::Receiver<()>,
        settle: Duration,
    ) -> Option<GenerationResult> {
        let on_bus = client.on_bus(id);
        let until = Instant::now() + settle;
        // A receiver is polled until it answers, never after.
        let mut told = false;
        while Instant::now() < until {
            if told {
                tokio::time::sleep(RESULT_POLL).await;
            } else if tokio::time::timeout(RESULT_POLL, &mut finished)
                .await
                .is_ok()
            {
                told = true;
            }
            if let Some(result) = self.result(&on_bus) {
                return Some(result);
            }
            if let Ok(result) = client.result(id, false).await {
                return Some(result);
            }
        }
        None
    }

    /// Events not kept because the book was full.
    pub fn overflow(&self) -> u64 {
        self.lock().overflow
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pages> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Pages {
    /// The page of `id`, made if there is room.
    fn page(&mut self, id: &str) -> Option<&mut Seen> {
        if !self.seen.contains_key(id) && self.seen.len() >= MAX_REQUESTS {
            return None;
        }
        Some(self.seen.entry(id.to_string()).or_default())
    }
}

/// A request with a sequence fault or a text mismatch, told for a reader.
pub fn faulty(id: &str, events: &[(Event, Instant)], result: &GenerationResult) -> String {
    let seen: Vec<String> = events
        .iter()
        .map(|(event, _)| match run_of(event) {
            Some(worker) => format!("{}:{}@{worker}", event.seq, event.body.name()),
            None => format!("{}:{}", event.seq, event.body.name()),
        })
        .collect();
    let moves: Vec<String> = result
        .resumed
        .iter()
        .map(|m| {
            format!(
                "{}→{} {:?} at {} bytes",
                m.from_worker, m.to_worker, m.reason, m.at_output_bytes
            )
        })
        .collect();
    format!(
        "{id}: events [{}]; moves [{}]; output {} chars",
        seen.join(" "),
        moves.join(", "),
        result.output.chars().count()
    )
}

/// The workers that started or took up a request at the same point of it (the same `seq`)
/// as another: runs of one request side by side, each streaming to its followers. Empty when
/// each point had one run.
pub fn runs_side_by_side(events: &[(Event, Instant)]) -> Vec<String> {
    let mut by_seq: HashMap<u64, Vec<&str>> = HashMap::new();
    for (event, _) in events {
        if let Some(worker) = run_of(event) {
            let workers = by_seq.entry(event.seq).or_default();
            if !workers.contains(&worker) {
                workers.push(worker);
            }
        }
    }
    let mut side_by_side: Vec<String> = by_seq
        .into_values()
        .filter(|workers| workers.len() > 1)
        .flatten()
        .map(str::to_string)
        .collect();
    side_by_side.sort();
    side_by_side.dedup();
    side_by_side
}

/// The worker of a `started` or `resumed` event: the run it begins.
fn run_of(event: &Event) -> Option<&str> {
    match &event.body {
        EventBody::Started { worker_id, .. } | EventBody::Resumed { worker_id, .. } => {
            Some(worker_id)
        }
        _ => None,
    }
}

/// The result the first `finished` event carried.
pub fn finished_result(seen: &Seen) -> Option<GenerationResult> {
    seen.events.iter().find_map(|(event, _)| match &event.body {
        EventBody::Finished { result } => Some((**result).clone()),
        _ => None,
    })
}

/// A request's events as a follower takes them (docs/protocol.md): an event numbered below
/// the next one expected was seen already and is dropped; a number past it is a gap (except
/// the `finished` event a live worker sends for a lost one, numbered past everything).
pub struct Followed<'a> {
    kept: Vec<&'a Event>,
    /// Numbers skipped.
    pub missing: u64,
    /// Numbers seen again with other content.
    pub conflicting: u64,
    /// Numbers seen again as they were.
    pub resent: u64,
}

impl<'a> Followed<'a> {
    pub fn of(events: &'a [(Event, Instant)]) -> Followed<'a> {
        let mut followed = Followed {
            kept: Vec::new(),
            missing: 0,
            conflicting: 0,
            resent: 0,
        };
        let mut next = 0;
        for (event, _) in events {
            if event.seq < next {
                match followed.kept.iter().find(|kept| kept.seq == event.seq) {
                    Some(kept) if *kept == event => followed.resent += 1,
                    _ => followed.conflicting += 1,
                }
                continue;
            }
            if event.seq != SEQ_AFTER_LOST {
                followed.missing += event.seq - next;
                next = event.seq + 1;
            }
            followed.kept.push(event);
        }
        followed
    }

    /// The text of the deltas kept, joined.
    pub fn deltas(&self) -> String {
        self.kept
            .iter()
            .filter_map(|event| match &event.body {
                EventBody::Delta { text } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64) -> (Event, Instant) {
        (
            Event {
                request_id: "r".into(),
                seq,
                ts: String::new(),
                body: EventBody::Delta { text: "x".into() },
            },
            Instant::now(),
        )
    }

    #[test]
    fn a_follower_counts_gaps_drops_what_was_sent_again_and_flags_conflicts() {
        // (seqs, missing, conflicting, resent); every event here has the same body, so a
        // number seen again is sent again as it was.
        for (seqs, missing, resent) in [
            (vec![], 0, 0),
            (vec![0, 1, 2], 0, 0),
            (vec![0, 2], 1, 0),
            (vec![0, 1, 1, 2], 0, 1),
            (vec![1, 1, 3], 2, 1),
            (vec![0, 1, 2, 1, 2, 3], 0, 2),
            (vec![0, 1, SEQ_AFTER_LOST], 0, 0),
        ] {
            let events: Vec<_> = seqs.iter().map(|s| event(*s)).collect();
            let followed = Followed::of(&events);
            assert_eq!(
                (followed.missing, followed.conflicting, followed.resent),
                (missing, 0, resent),
                "{seqs:?}"
            );
        }
        // The same number with other text is a conflict, and the first stands.
        let mut other = event(1);
        other.0.body = EventBody::Delta { text: "y".into() };
        let events = vec![event(0), event(1), other];
        let followed = Followed::of(&events);
        assert_eq!((followed.conflicting, followed.resent), (1, 0));
        assert_eq!(followed.deltas(), "xx");
    }

    fn resumed(seq: u64, worker: &str) -> (Event, Instant) {
        (
            Event {
                request_id: "r".into(),
                seq,
                ts: String::new(),
                body: EventBody::Resumed {
                    worker_id: worker.into(),
                    attempt: 2,
                    from_worker: "w0".into(),
                    reason: crate::protocol::MoveReason::Drained,
                    turn_restarted: false,
                },
            },
            Instant::now(),
        )
    }

    #[test]
    fn runs_that_took_a_request_up_at_the_same_point_are_told() {
        // One run after another, and the same event sent again: no runs side by side.
        let one_by_one = vec![
            event(0),
            resumed(2, "w1"),
            resumed(2, "w1"),
            resumed(5, "w2"),
        ];
        assert!(runs_side_by_side(&one_by_one).is_empty());
        // Two workers that both went on from the checkpoint at seq 2.
        let both = vec![event(0), resumed(2, "w2"), resumed(2, "w1"), event(3)];
        assert_eq!(runs_side_by_side(&both), vec!["w1", "w2"]);
    }
}
