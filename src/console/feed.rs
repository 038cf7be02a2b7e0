//! The console's bus side: tasks that read the fleet and apply what they read to the state.
//!
//! - the decisions bucket, watched from its current content on (`watch_with_history`);
//! - the signals stream, through an ordered (ephemeral, unacknowledged) consumer starting at
//!   the newest `console.max_signals` signals, so no manager's durable consumer loses one;
//! - the service API, polled every `console.fleet_refresh_ms`;
//! - `gen.events.>`, for the requests that start and finish and the requests list's timelines;
//! - the results bucket, from its newest `console.max_requests` records on, for the requests
//!   list.
//!
//! Each task starts over after a failure (a missing stream or bucket: the fleet has not
//! started yet) and says what is wrong in the page's link status meanwhile.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{consumer, kv};
use futures_util::StreamExt;
use tokio::task::JoinSet;

use super::requests::Requests;
use super::state::{FeedSignal, InboxItem, Links, WorkerView};
use super::{Push, Shared};
use crate::client::records::{RequestRecord, record_key};
use crate::protocol::decision::DecisionRecord;
use crate::protocol::ids::now_rfc3339;
use crate::protocol::{Event, Signal};

/// Wait before a task that failed starts over.
const RETRY: Duration = Duration::from_secs(2);
/// How often the fleet view is pushed when it changed.
const FLEET_PUSH_EVERY: Duration = Duration::from_millis(250);
/// The service API's name.
const SERVICE: &str = "genfleet";

/// Runs every task until the console shuts down.
pub async fn run(shared: Arc<Shared>) {
    let mut tasks = JoinSet::new();
    tasks.spawn(start_over(
        shared.clone(),
        "the console's decisions watch stopped",
        |l| &mut l.decisions,
        watch_decisions,
    ));
    tasks.spawn(start_over(
        shared.clone(),
        "the console's signal feed stopped",
        |l| &mut l.signals,
        follow_signals,
    ));
    tasks.spawn(poll_fleet(shared.clone()));
    tasks.spawn(push_fleet(shared.clone()));
    tasks.spawn(start_over(
        shared.clone(),
        "the console's watch of the results stopped",
        |l| &mut l.results,
        follow_results,
    ));
    tasks.spawn(start_over(
        shared.clone(),
        "the console's events subscription stopped",
        |l| &mut l.events,
        follow_events,
    ));
    shared.shutdown.cancelled().await;
    tasks.shutdown().await;
}

/// Sets one link's problem (`None`: fine) and tells the pages when it changed.
fn link(shared: &Shared, set: impl FnOnce(&mut Links)) {
    shared.apply(|state| {
        let before = state.links.clone();
        set(&mut state.links);
        if state.links == before {
            Vec::new()
        } else {
            vec![Push::new("links", &state.links)]
        }
    });
}

/// Runs `follow` again and again, [`RETRY`] apart. When it stops with a problem, its link (the
/// part of [`Links`] that `problem_of` picks) shows the problem until `follow` clears it.
async fn start_over<F, Fut>(
    shared: Arc<Shared>,
    stopped: &'static str,
    problem_of: fn(&mut Links) -> &mut Option<String>,
    follow: F,
) where
    F: Fn(Arc<Shared>) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    loop {
        if let Err(problem) = follow(shared.clone()).await {
            tracing::debug!(message = stopped, %problem);
            link(&shared, |l| *problem_of(l) = Some(problem));
        }
        tokio::time::sleep(RETRY).await;
    }
}

async fn watch_decisions(shared: Arc<Shared>) -> Result<(), String> {
    let bucket = shared.decisions().await?;
    let mut watch = bucket.watch_with_history(">").await.map_err(|e| {
        format!(
            "cannot watch bucket {}: {e}",
            shared.settings.decisions.bucket
        )
    })?;
    link(&shared, |l| l.decisions = None);
    while let Some(entry) = watch.next().await {
        let entry = entry.map_err(|e| format!("watching the decisions: {e}"))?;
        match entry.operation {
            kv::Operation::Put => match serde_json::from_slice::<DecisionRecord>(&entry.value) {
                Ok(record) => {
                    shared.apply(|state| {
                        state.requests.apply_decision(&record);
                        Vec::new()
                    });
                    let item = InboxItem::from_record(record);
                    shared.apply(|state| {
                        let (changed, dropped) = state.inbox.upsert(item);
                        let mut pushes: Vec<Push> = changed
                            .iter()
                            .map(|item| Push::new("inbox", item))
                            .collect();
                        for id in dropped {
                            pushes.push(removed(&id, state.inbox.dropped_pending()));
                        }
                        pushes
                    });
                }
                Err(error) => {
                    tracing::warn!(message = "an unreadable decision record is not shown", key = %entry.key, %error);
                }
            },
            kv::Operation::Delete | kv::Operation::Purge => shared.apply(|state| {
                if state.inbox.remove(&entry.key) {
                    vec![removed(&entry.key, state.inbox.dropped_pending())]
                } else {
                    Vec::new()
                }
            }),
        }
    }
    Err("the decisions watch ended".into())
}

fn removed(decision_id: &str, dropped_pending: u64) -> Push {
    Push::new(
        "inbox_removed",
        &serde_json::json!({"decision_id": decision_id, "dropped_pending": dropped_pending}),
    )
}

async fn follow_signals(shared: Arc<Shared>) -> Result<(), String> {
    let name = &shared.settings.jetstream.signals_stream;
    let mut stream = shared
        .jetstream
        .get_stream(name)
        .await
        .map_err(|e| format!("cannot open stream {name}: {e} (has a worker ever started?)"))?;
    let info = stream
        .info()
        .await
        .map_err(|e| format!("stream {name}: {e}"))?;
    let (first, last) = (info.state.first_sequence.max(1), info.state.last_sequence);
    let (resume, max) = {
        let state = shared.lock();
        (state.signals.next_seq(), state.signals.max() as u64)
    };
    // Where it stopped, else the newest signals the feed keeps.
    let start = resume
        .unwrap_or_else(|| (last + 1).saturating_sub(max))
        .max(first);
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            description: Some("genfleet console: the live signal feed".into()),
            filter_subject: format!("{}.>", shared.settings.subjects.signals_prefix),
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ..Default::default()
        })
        .await
        .map_err(|e| format!("cannot follow stream {name}: {e}"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| format!("cannot follow stream {name}: {e}"))?;
    link(&shared, |l| l.signals = None);
    while let Some(message) = messages.next().await {
        let message = message.map_err(|e| format!("following stream {name}: {e}"))?;
        let Ok(seq) = message.info().map(|i| i.stream_sequence) else {
            continue;
        };
        let signal = match serde_json::from_slice::<Signal>(&message.payload) {
            Ok(signal) => signal,
            Err(error) => {
                tracing::debug!(message = "not a signal; left out of the feed", subject = %message.subject, %error);
                continue;
            }
        };
        let signal = FeedSignal::new(seq, signal);
        shared.apply(|state| {
            state.requests.apply_signal(&signal.signal);
            if state.signals.push(signal.clone()) {
                vec![Push::new("signal", &signal)]
            } else {
                Vec::new()
            }
        });
    }
    Err(format!("following stream {name} ended"))
}

/// Asks every worker for its info and stats, every `console.fleet_refresh_ms`.
async fn poll_fleet(shared: Arc<Shared>) {
    let every = Duration::from_millis(shared.settings.console.fleet_refresh_ms);
    // Replies come within milliseconds on a healthy fleet; the window ends well before the
    // next round.
    let gather = (every * 2 / 3).min(Duration::from_millis(750));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let asked = Instant::now();
        match poll_once(&shared, gather).await {
            Ok(workers) => {
                shared.apply(|state| {
                    for worker in &workers {
                        state.requests.learn_worker(&worker.worker_id, &worker.pool);
                    }
                    state.fleet.apply_round(workers, asked, now_rfc3339());
                    Vec::new()
                });
            }
            Err(error) => tracing::debug!(message = "polling the fleet failed", %error),
        }
        let connected =
            shared.client.nats().connection_state() == async_nats::connection::State::Connected;
        link(&shared, |l| l.nats_connected = connected);
    }
}

async fn poll_once(shared: &Shared, gather: Duration) -> Result<Vec<WorkerView>, String> {
    let nats = shared.client.nats();
    let (stats_inbox, info_inbox) = (nats.new_inbox(), nats.new_inbox());
    let mut stats = nats
        .subscribe(stats_inbox.clone())
        .await
        .map_err(|e| e.to_string())?;
    let mut infos = nats
        .subscribe(info_inbox.clone())
        .await
        .map_err(|e| e.to_string())?;
    nats.publish_with_reply(format!("$SRV.STATS.{SERVICE}"), stats_inbox, "".into())
        .await
        .map_err(|e| e.to_string())?;
    nats.publish_with_reply(format!("$SRV.INFO.{SERVICE}"), info_inbox, "".into())
        .await
        .map_err(|e| e.to_string())?;
    let deadline = tokio::time::Instant::now() + gather;
    let mut stats_replies = Vec::new();
    let mut info_replies = std::collections::HashMap::new();
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => break,
            Some(message) = stats.next() => {
                if let Ok(value) = serde_json::from_slice::<serde_json::Value>(&message.payload) {
                    stats_replies.push(value);
                }
            }
            Some(message) = infos.next() => {
                if let Ok(value) = serde_json::from_slice::<serde_json::Value>(&message.payload)
                    && let Some(id) = value["id"].as_str()
                {
                    info_replies.insert(id.to_string(), value);
                }
            }
        }
    }
    Ok(stats_replies
        .iter()
        .filter_map(|s| {
            let info = s["id"].as_str().and_then(|id| info_replies.get(id));
            WorkerView::from_service(s, info)
        })
        .collect())
}

/// Tells the pages about the fleet when it changed, at most every 250 ms.
async fn push_fleet(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(FLEET_PUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        shared.apply(|state| {
            let mut pushes = Vec::new();
            let requests = state.requests.take_dirty();
            let epoch = Requests::series_epoch(std::time::SystemTime::now());
            let moved = std::mem::replace(&mut state.series_epoch, epoch) != epoch;
            if state.fleet.take_dirty() || requests || moved {
                pushes.push(Push::new("fleet", &state.fleet_json()));
            }
            if requests {
                pushes.push(Push::new(
                    "requests",
                    &serde_json::json!({"kept": state.requests.len()}),
                ));
            }
            pushes
        });
    }
}

async fn follow_events(shared: Arc<Shared>) -> Result<(), String> {
    // Every tenant's requests: `gen.events.<id>` and `gen.events.<tenant>.<id>`.
    let subject = shared.client.subjects().events(">");
    let mut sub = shared
        .client
        .nats()
        .subscribe(subject.clone())
        .await
        .map_err(|e| format!("cannot subscribe to {subject}: {e}"))?;
    link(&shared, |l| l.events = None);
    while let Some(message) = sub.next().await {
        if let Ok(event) = Event::from_json(&message.payload) {
            let now = Instant::now();
            shared.apply(|state| {
                state.fleet.apply_event(&event, now);
                state.requests.apply_event(&event);
                Vec::new()
            });
        }
    }
    Err(format!("the subscription to {subject} ended"))
}

/// Follows the results bucket from its newest `console.max_requests` records on: every
/// request claimed (its live record), finished (its result) and read by its caller (its
/// tombstone), whichever worker ran it and however it was submitted.
async fn follow_results(shared: Arc<Shared>) -> Result<(), String> {
    let name = &shared.settings.jetstream.results_bucket;
    let bucket = shared.results().await?;
    let status = bucket
        .status()
        .await
        .map_err(|e| format!("bucket {name}: {e}"))?;
    let (first, last) = (
        status.info.state.first_sequence.max(1),
        status.info.state.last_sequence,
    );
    let (resume, max) = {
        let state = shared.lock();
        (state.results_seq, state.requests.max() as u64)
    };
    let start = resume
        .unwrap_or_else(|| (last + 1).saturating_sub(max))
        .max(first);
    let prefix = record_key("");
    let mut watch = bucket
        .watch_from_revision(format!("{prefix}>"), start)
        .await
        .map_err(|e| format!("cannot watch bucket {name}: {e}"))?;
    link(&shared, |l| l.results = None);
    while let Some(entry) = watch.next().await {
        let entry = entry.map_err(|e| format!("watching bucket {name}: {e}"))?;
        let revision = entry.revision;
        let Some(request_id) = entry.key.strip_prefix(&prefix).map(str::to_string) else {
            continue;
        };
        let written = std::time::SystemTime::from(entry.created);
        let record = match entry.operation {
            kv::Operation::Put => serde_json::from_slice::<RequestRecord>(&entry.value).ok(),
            _ => None,
        };
        shared.apply(|state| {
            state.results_seq = Some(revision + 1);
            match record {
                Some(RequestRecord::Live { live }) => state.requests.apply_live(
                    &request_id,
                    live.state,
                    &live.worker_id,
                    live.attempt,
                    written,
                ),
                Some(RequestRecord::Result(result)) => state
                    .requests
                    .apply_result(&result, Some(crate::protocol::ids::rfc3339(written))),
                Some(RequestRecord::Released {
                    state: ended,
                    finished,
                    ..
                }) => {
                    state
                        .requests
                        .apply_released(&request_id, ended, finished.as_deref(), written)
                }
                None => {}
            }
            Vec::new()
        });
    }
    Err(format!("the watch of bucket {name} ended"))
}
