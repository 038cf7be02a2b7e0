//! Heartbeats and lost workers.
//!
//! Each worker puts its heartbeat in KV bucket `GENFLEET_WORKERS` (key: its id) every
//! `worker.heartbeat_ms`; the bucket drops an entry `worker.lost_after_ms` after its last write,
//! so an entry that is gone is a worker that stopped beating, as the server judges it (no two
//! workers' clocks are compared). The heartbeat lists the interactive requests running on the
//! worker: that list is the fleet's index of who runs what, carried where it costs nothing per
//! request.
//!
//! Every live worker follows the heartbeats. A peer is gone when its heartbeat has not come for
//! `worker.lost_after_ms` and its entry is gone, or sooner, when its heartbeat is a tenth of an
//! interval late and the server has had no subscriber on the peer's own `capacity` subject at
//! every probe for a second (probed four times a second): its connection is closed, and stayed
//! closed longer than a live worker takes to reconnect, so the process died. A live worker that
//! lost its connection longer than that all the same (its NATS node died and it found another
//! late) checks its requests' records as it reconnects, and stops those the fleet took. The interactive
//! requests a gone peer last listed are taken up by a live worker from their last checkpoint
//! (see `resume`), and those with none are ended FAILED `worker_lost`, each by a
//! compare-and-set on its record, so of all the live workers that act one wins. Durable requests are left to the queue, which redelivers
//! them. A request that started after its worker's last heartbeat is in no list: whoever asks
//! about it (status, result, cancel) finds its worker gone and ends it the same way
//! ([`end_if_lost`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use futures_util::StreamExt;

use super::BusError;
use super::shared::{Shared, held_requests};
use super::store::{LiveRecord, Over, RequestRecord, StoreError, Stored, ensure_bucket};
use crate::protocol::event::SEQ_AFTER_LOST;
use crate::protocol::{GenerationResult, MoveReason, Reason, RequestState};

pub use crate::client::streams::WORKERS_BUCKET;

/// Request ids followed across all peers' heartbeats; past it, a list is cut (its requests are
/// still found lost by whoever asks about them).
const MAX_FOLLOWED_REQUESTS: usize = 65_536;
/// How many heartbeat intervals late a peer may be and still be placed on.
const PLACED_WHILE_LATE_BY: u32 = 3;
/// Peers followed at most (a fleet larger than this is followed in part).
const MAX_PEERS: usize = 10_000;
/// How long a probe of a late peer's own subject waits for its answer.
const PROBE_WAIT: Duration = Duration::from_secs(1);
/// How long a worker with no free slot lets its peers take a gone worker's requests first, when
/// one of them has a free slot (when none has, waiting helps no one).
const FULL_WORKER_WAITS: Duration = Duration::from_millis(500);
/// How long a late peer's own subject must have had no subscriber, at every probe, before the
/// peer is taken for gone: longer than a live worker whose NATS node died takes to reconnect to
/// another, so a reconnect is not taken for a death.
const ABSENT_FOR: Duration = Duration::from_secs(1);
/// How often the peers are looked at (for late and lost ones), at most: a killed worker's
/// requests wait for the first look after its heartbeat is late.
const LOOK_AT_MOST_EVERY: Duration = Duration::from_millis(250);

/// A heartbeat could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    #[error("cannot write the heartbeat: {0}")]
    Write(#[source] kv::PutError),
    #[error("cannot read the heartbeat of worker {worker}: {source}")]
    Read {
        worker: String,
        source: kv::EntryError,
    },
}

impl From<HeartbeatError> for BusError {
    fn from(error: HeartbeatError) -> BusError {
        BusError::Setup(error.to_string())
    }
}

pub use crate::client::fleet::Heartbeat;

pub async fn open(
    js: &async_nats::jetstream::Context,
    lost_after: Duration,
    replicas: usize,
) -> Result<kv::Store, BusError> {
    ensure_bucket(js, WORKERS_BUCKET, 1, lost_after, replicas).await
}

pub(super) async fn beat(shared: &Shared) -> Result<(), HeartbeatError> {
    let capacity = *shared.capacity.borrow();
    let held = held_requests(shared).await;
    let (handed_durable, handed_running) = shared.handed_off.list();
    let running = held
        .iter()
        .filter(|(held, hold)| held.state == RequestState::Running && !hold.is_durable())
        .map(|(held, _)| held.request_id.clone())
        .chain(handed_running)
        .collect();
    let durable = held
        .iter()
        .filter(|(held, hold)| !held.state.is_terminal() && hold.is_durable())
        .map(|(held, _)| held.request_id.clone())
        .chain(handed_durable)
        .collect();
    let heartbeat = Heartbeat {
        worker_id: shared.worker_id.clone(),
        pool: shared.settings.worker.pool.clone(),
        slots: capacity.total,
        busy: capacity.busy,
        draining: capacity.draining,
        paused: capacity.paused,
        ts: crate::protocol::ids::now_rfc3339(),
        running,
        durable: Some(durable),
    };
    shared
        .workers
        .put(
            &shared.worker_id,
            serde_json::to_vec(&heartbeat)
                .expect("heartbeats serialize")
                .into(),
        )
        .await
        .map(|_| shared.fencing.beat())
        .map_err(HeartbeatError::Write)
}

/// After the first heartbeat that follows one older than `worker.lost_after_ms` (the worker
/// was paused, or cut off from NATS): its peers may have declared it lost meanwhile and ended
/// or taken over what it held. Its entry is back, so no peer takes it for lost from now on;
/// every request whose record no longer names this worker is stopped without a word (its
/// end stores nothing over the record, publishes nothing, and leaves a durable message to
/// the worker that took it). Requests still on record here go on.
async fn fence_taken(shared: &Shared) {
    let mut taken = Vec::new();
    for (held, _) in held_requests(shared).await {
        if held.state.is_terminal() {
            continue;
        }
        match shared.stores.record(&held.request_id).await {
            Ok(Some((RequestRecord::Live { live }, _))) if live.worker_id == shared.worker_id => {}
            // Another worker's, given back, ended, or gone: no longer this worker's.
            Ok(_) => taken.push(held.request_id),
            // Cannot be told now: the end's compare-and-set still guards the record.
            Err(_) => {}
        }
    }
    if taken.is_empty() {
        return;
    }
    // Muted first, so nothing more goes out for them while they stop.
    shared.fencing.fence(taken.clone());
    let Ok(fenced) = shared
        .supervisor
        .send(crate::actors::Fence(taken.clone()))
        .await
    else {
        return;
    };
    // Those that ended meanwhile have nothing more to mute.
    for id in taken.iter().filter(|id| !fenced.contains(id)) {
        shared.fencing.ended(id);
    }
    tracing::warn!(
        message = "this worker's heartbeat had expired and the fleet took some of its requests: they are stopped",
        requests = fenced.len()
    );
    shared.metrics.fenced.inc_by(fenced.len() as u64);
}

/// The first heartbeat, tried again for a while: on a JetStream cluster, a bucket created a
/// moment ago (by this worker or one starting beside it) may not take writes yet.
pub(super) async fn first_beat(shared: &Shared) -> Result<(), BusError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut pause = Duration::from_millis(50);
    loop {
        match beat(shared).await {
            Ok(()) => return Ok(()),
            Err(error) if tokio::time::Instant::now() + pause < deadline => {
                tracing::debug!(message = "first heartbeat failed; trying again", %error);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Takes this worker's heartbeat away as it stops, so its peers do not wait out
/// `worker.lost_after_ms` to see it gone. It ran everything it held to its end, or handed it
/// off: a last heartbeat then lists what it handed off, and its peers take those up as they
/// see its entry go.
pub(super) async fn last_beat(shared: &Shared) {
    if shared.handed_off.has_any() {
        let _ = tokio::time::timeout(Duration::from_secs(2), beat(shared)).await;
    }
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        shared.workers.delete(&shared.worker_id),
    )
    .await;
}

/// Beats, and ends the interactive requests of workers that stopped beating. The two run side
/// by side: a slow look for lost workers (a JetStream under load) must never hold up this
/// worker's own heartbeat, or its heartbeat would expire and live workers would take it for
/// lost.
pub(super) async fn run(shared: Arc<Shared>) {
    let every = Duration::from_millis(shared.settings.worker.heartbeat_ms);
    let beating = async {
        let mut connected = shared.client.statistics().connects.load(Ordering::Relaxed);
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                // A request's first checkpoint waits for a heartbeat that lists it (one beat
                // answers every request that asked meanwhile).
                _ = shared.listing.asked() => {}
            }
            // After a reconnect too: while this worker was cut off, its peers may have taken
            // it for gone.
            let connects = shared.client.statistics().connects.load(Ordering::Relaxed);
            let stale = shared.fencing.stale() || connects != connected;
            connected = connects;
            // A heartbeat slower than the interval is left behind for the next one.
            match tokio::time::timeout(every, beat(&shared)).await {
                Ok(Ok(())) if stale => {
                    shared.listing.beaten();
                    fence_taken(&shared).await
                }
                Ok(Ok(())) => shared.listing.beaten(),
                Ok(Err(error)) => tracing::warn!(message = "heartbeat failed", %error),
                Err(_) => {
                    tracing::warn!(message = "heartbeat took longer than worker.heartbeat_ms")
                }
            }
        }
    };
    tokio::join!(beating, follow_peers(&shared, every));
}

/// A peer as its heartbeats tell it.
struct Peer {
    /// The requests it holds: interactive ones running, durable ones running or waiting.
    running: Vec<String>,
    /// When its last heartbeat reached this worker.
    seen: Instant,
    /// When it was last probed for being late.
    probed: Option<Instant>,
    /// Since when every probe found no subscriber on its own subject.
    absent_since: Option<Instant>,
}

/// Follows the peers' heartbeats and ends the requests of those that stop beating.
async fn follow_peers(shared: &Shared, every: Duration) {
    let lost_after = Duration::from_millis(shared.settings.worker.lost_after_ms);
    let mut peers: HashMap<String, Peer> = HashMap::new();
    loop {
        // Each worker's last heartbeat first, then every new one.
        let mut watch = match shared.workers.watch_with_history(">").await {
            Ok(watch) => watch,
            Err(error) => {
                tracing::debug!(message = "cannot follow the heartbeats; trying again", %error);
                tokio::time::sleep(every).await;
                continue;
            }
        };
        let mut look = tokio::time::interval(every.min(LOOK_AT_MOST_EVERY));
        look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => {
                        if let Some((worker, held)) = note(shared, &mut peers, entry, lost_after) {
                            take_up_all(shared, &worker, held, MoveReason::Drained).await;
                        }
                    }
                    Some(Err(error)) => {
                        tracing::debug!(message = "following the heartbeats failed", %error);
                        break;
                    }
                    None => break,
                },
                _ = look.tick() => {
                    // A peer three heartbeats late takes no keyed request until it beats again
                    // (a worker that crashed keeps its entry until `lost_after`).
                    for (id, peer) in &peers {
                        if peer.seen.elapsed() >= every * PLACED_WHILE_LATE_BY {
                            shared.peer_slots.forget(id);
                        }
                    }
                    let gone = probe_late(shared, &mut peers, every).await;
                    if let Err(error) = reap(shared, &mut peers, lost_after, &gone).await {
                        tracing::debug!(message = "looking for lost workers failed", %error);
                    }
                }
            }
        }
    }
}

/// Notes a peer's heartbeat. A peer that stopped and said so (its entry deleted) is returned
/// with what it last listed: what it did not end it handed off, to be taken up.
fn note(
    shared: &Shared,
    peers: &mut HashMap<String, Peer>,
    entry: kv::Entry,
    lost_after: Duration,
) -> Option<(String, Vec<String>)> {
    if entry.key == shared.worker_id {
        return None;
    }
    if entry.operation != kv::Operation::Put {
        let gone = peers.remove(&entry.key);
        shared.peer_slots.forget(&entry.key);
        shared.tenant_counts.peer_gone(&entry.key);
        return gone
            .filter(|peer| !peer.running.is_empty())
            .map(|peer| (entry.key, peer.running));
    }
    let Ok(heartbeat) = serde_json::from_slice::<Heartbeat>(&entry.value) else {
        return None;
    };
    shared.tenant_counts.peer_seen(&entry.key);
    if !peers.contains_key(&entry.key) && peers.len() >= MAX_PEERS {
        return None;
    }
    shared
        .peer_slots
        .note(&entry.key, heartbeat.load_in(&shared.settings.worker.pool));
    let followed: usize = peers
        .iter()
        .filter(|(id, _)| **id != entry.key)
        .map(|(_, peer)| peer.running.len())
        .sum();
    // Interactive and durable alike: each is taken up from its checkpoint if its worker goes.
    let mut running = heartbeat.running;
    running.extend(heartbeat.durable.unwrap_or_default());
    running.truncate(MAX_FOLLOWED_REQUESTS.saturating_sub(followed));
    peers.insert(
        entry.key,
        Peer {
            running,
            seen: beaten_at(&heartbeat.ts, lost_after),
            probed: None,
            absent_since: None,
        },
    );
    None
}

/// When a heartbeat stamped `ts` (by its worker's clock) was written, on this worker's
/// monotonic clock: now less its age, at most `lost_after` (a clock ahead, or a stamp that
/// cannot be read, counts as now). A worker that starts reads its peers' last heartbeats from
/// the bucket's history: dated so, the heartbeat of a peer that died before this worker
/// started is late as soon as it is, not an interval after this worker read it. Clocks that
/// disagree only make a peer late sooner or later here, which costs a probe of its connection,
/// never a false alarm.
fn beaten_at(ts: &str, lost_after: Duration) -> Instant {
    let now = Instant::now();
    let age = humantime::parse_rfc3339_weak(ts)
        .ok()
        .and_then(|at| std::time::SystemTime::now().duration_since(at).ok())
        .unwrap_or_default()
        .min(lost_after);
    now.checked_sub(age).unwrap_or(now)
}

/// Takes up what a peer that stopped handed off (each request whose record still names it and
/// holds a checkpoint; one of the live workers wins each).
async fn take_up_all(shared: &Shared, worker: &str, held: Vec<String>, reason: MoveReason) {
    let mut waited = false;
    for request_id in held {
        make_way(shared, &mut waited).await;
        match super::resume::take_up(shared, &request_id, worker, reason).await {
            Ok(outcome) => {
                tracing::debug!(message = "a stopped peer's request", request_id = %request_id, ?outcome)
            }
            Err(error) => {
                tracing::debug!(message = "cannot take up a stopped peer's request", %error, request_id = %request_id)
            }
        }
    }
}

/// Before a gone worker's next request is taken up here: once this worker has no free slot
/// left (the requests it took so far took them) while a peer has one, it lets its peers take
/// the rest first, once ([`FULL_WORKER_WAITS`]); what they did not take it takes after, to wait
/// here for a slot.
async fn make_way(shared: &Shared, waited: &mut bool) {
    if !*waited && shared.capacity.borrow().free() == 0 && shared.peer_slots.any_free() {
        *waited = true;
        tokio::time::sleep(FULL_WORKER_WAITS).await;
    }
}

/// The late peers (a heartbeat a tenth of an interval overdue) whose connection is gone: the
/// server has had no subscriber on the peer's own `capacity` subject at every probe for
/// [`ABSENT_FOR`]. A live worker keeps that subscription while it is connected, so "no
/// responders" is the server's word that the connection is closed, not a guess from a clock;
/// lasting longer than a reconnect takes, it is a process that died. A peer that answers, or
/// is only slow (the probe times out), starts over, is probed again an interval later, and is
/// left to `worker.lost_after_ms` if it stays late. Late peers are probed side by side.
async fn probe_late(
    shared: &Shared,
    peers: &mut HashMap<String, Peer>,
    every: Duration,
) -> Vec<String> {
    let late: Vec<String> = peers
        .iter_mut()
        .filter(|(_, peer)| {
            // A peer found absent is probed at every look; one that answered, again after an
            // interval (a live peer that is only late, or whose clock is behind).
            let again = if peer.absent_since.is_some() {
                LOOK_AT_MOST_EVERY / 2
            } else {
                every
            };
            peer.seen.elapsed() >= every + every / 10
                && !peer.running.is_empty()
                && peer.probed.is_none_or(|at| at.elapsed() >= again)
        })
        .map(|(id, peer)| {
            peer.probed = Some(Instant::now());
            id.clone()
        })
        .collect();
    let probes = late.into_iter().map(|worker| async move {
        let asked = shared.client.request(
            shared.subjects.worker_capacity(&worker),
            bytes::Bytes::new(),
        );
        let absent = matches!(
            tokio::time::timeout(PROBE_WAIT, asked).await,
            Ok(Err(error)) if error.kind() == async_nats::RequestErrorKind::NoResponders
        );
        (worker, absent)
    });
    let mut gone = Vec::new();
    for (worker, absent) in futures_util::future::join_all(probes).await {
        let Some(peer) = peers.get_mut(&worker) else {
            continue;
        };
        if !absent {
            peer.absent_since = None;
            continue;
        }
        let since = *peer.absent_since.get_or_insert_with(Instant::now);
        if since.elapsed() >= ABSENT_FOR {
            tracing::info!(message = "a late peer's connection is gone: taking it for lost", worker = %worker);
            gone.push(worker);
        }
    }
    gone
}

/// Takes up or ends the requests of the peers found gone: those whose heartbeat has not come
/// for `lost_after` and whose entry is gone from the bucket, and those `probed` gone.
async fn reap(
    shared: &Shared,
    peers: &mut HashMap<String, Peer>,
    lost_after: Duration,
    probed: &[String],
) -> Result<(), HeartbeatError> {
    let silent: Vec<String> = peers
        .iter()
        .filter(|(id, peer)| peer.seen.elapsed() >= lost_after || probed.contains(id))
        .map(|(id, _)| id.clone())
        .collect();
    for worker in silent {
        if !probed.contains(&worker) && beating(shared, &worker).await? {
            // Late here, but the server still has a heartbeat younger than `lost_after`.
            if let Some(peer) = peers.get_mut(&worker) {
                peer.seen = Instant::now();
            }
            continue;
        }
        shared.peer_slots.forget(&worker);
        shared.tenant_counts.peer_gone(&worker);
        let Some(peer) = peers.remove(&worker) else {
            continue;
        };
        tracing::info!(message = "a peer is gone; taking up or ending what it held", worker = %worker, requests = peer.running.len());
        let mut waited = false;
        for request_id in peer.running {
            make_way(shared, &mut waited).await;
            match super::resume::take_up(shared, &request_id, &worker, MoveReason::WorkerLost).await
            {
                Ok(super::resume::TakenUp::NoCheckpoint) => {}
                Ok(_) => continue,
                Err(error) => {
                    tracing::debug!(message = "cannot take up a lost worker's request", %error, request_id = %request_id);
                    continue;
                }
            }
            if let Err(error) = end_lost(shared, &request_id, &worker).await {
                tracing::debug!(message = "cannot end a lost worker's request", %error, request_id = %request_id);
            }
        }
    }
    Ok(())
}

/// Whether `worker` still holds the durable request `request_id`, as its heartbeats tell:
/// `Lost` when its heartbeat is gone, `Released` when a heartbeat written after `since` (a
/// revision of its entry) no longer lists it, `Holds` otherwise (or when that cannot be told).
pub(super) async fn holds(
    shared: &Shared,
    worker: &str,
    request_id: &str,
    since: &mut Option<u64>,
) -> Holding {
    let entry = match shared.workers.entry(worker).await {
        Ok(entry) => entry,
        Err(_) => return Holding::Holds,
    };
    let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
        return Holding::Lost;
    };
    let first = *since.get_or_insert(entry.revision);
    if entry.revision <= first {
        return Holding::Holds;
    }
    match serde_json::from_slice::<Heartbeat>(&entry.value) {
        Ok(Heartbeat {
            durable: Some(durable),
            ..
        }) if !durable.iter().any(|id| id == request_id) => Holding::Released,
        _ => Holding::Holds,
    }
}

/// What a worker's heartbeats tell of a durable request it is on record for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holding {
    Holds,
    Released,
    Lost,
}

/// Whether `worker`'s heartbeat is in the bucket (younger than `worker.lost_after_ms`).
pub(super) async fn beating(shared: &Shared, worker: &str) -> Result<bool, HeartbeatError> {
    shared
        .workers
        .get(worker)
        .await
        .map(|entry| entry.is_some())
        .map_err(|source| HeartbeatError::Read {
            worker: worker.to_string(),
            source,
        })
}

/// Ends an interactive request of a lost worker as FAILED `worker_lost`, if its record still
/// says that worker runs it. The result stored, if this call stored it.
async fn end_lost(
    shared: &Shared,
    request_id: &str,
    worker: &str,
) -> Result<Option<GenerationResult>, StoreError> {
    let Some((RequestRecord::Live { live }, revision)) = shared.stores.record(request_id).await?
    else {
        return Ok(None);
    };
    end_live(shared, &live, revision, worker).await
}

async fn end_live(
    shared: &Shared,
    live: &LiveRecord,
    revision: u64,
    worker: &str,
) -> Result<Option<GenerationResult>, StoreError> {
    if live.worker_id != worker || live.durable {
        return Ok(None);
    }
    if live.progress.is_some() {
        // It goes on here from its last checkpoint instead.
        super::resume::take_up_record(shared, live.clone(), revision, MoveReason::WorkerLost)
            .await?;
        return Ok(None);
    }
    let mut result = GenerationResult::empty(
        &live.request_id,
        Reason::WorkerLost,
        format!("worker {worker} stopped while running the request"),
        worker,
    );
    result.attempt = live.attempt;
    if shared
        .stores
        .store_result(&result, Over::Claim(revision))
        .await?
        != Stored::Stored
    {
        return Ok(None);
    }
    super::recorded::recorded(shared, &result);
    // Its followers hear of the end too (numbered past whatever the lost worker sent).
    super::recorded::publish_finished(shared, &result, SEQ_AFTER_LOST).await;
    tracing::warn!(message = "ended the request of a lost worker", request_id = %live.request_id, lost_worker = %worker);
    Ok(Some(result))
}

/// A live record read by whoever asks about a request: when it names another worker whose
/// heartbeat is gone and the request is interactive, the request is ended FAILED
/// `worker_lost` here, and its result returned.
pub(super) async fn end_if_lost(
    shared: &Shared,
    live: &LiveRecord,
    revision: u64,
) -> Result<Option<GenerationResult>, StoreError> {
    if live.durable || live.worker_id == shared.worker_id {
        return Ok(None);
    }
    match beating(shared, &live.worker_id).await {
        Ok(false) => end_live(shared, live, revision, &live.worker_id.clone()).await,
        // Beating, or unknown: it is not taken for lost on a failed read.
        _ => Ok(None),
    }
}
