//! What the worker's tasks share, and what the bus keeps with each request.
//!
//! The Supervisor is the worker's one owner of per-request state. The bus keeps no table of
//! requests beside it: what the bus needs of a request while it is held (what it asked, its
//! claim on the request's record, its queue message) is a [`Hold`] that travels in the
//! Supervisor's record as its ticket (the worker's Supervisor is a `Supervisor<Arc<Hold>>`), is
//! read back with `Held` and `TicketOf`, and comes back whole with `Release` when the request
//! ends. A request cannot be on record in one table and
//! missing from the other.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use actix::Addr;
use async_nats::jetstream;
use tokio::sync::{Semaphore, broadcast, watch};

use super::decisions::Decisions;
use super::store::{LiveRecord, Stores};
use crate::actors::{Capacity, Held, HeldRequest, RequestChecker, Supervisor, TicketOf};
use crate::client::subjects::Subjects;
use crate::observe::Metrics;
use crate::protocol::{AffinityRecord, ChainState, GenerationRequest};
use crate::schedule::{Choice, PoolView, WorkerLoad};
use crate::settings::Settings;
use crate::telemetry::RequestTrace;

/// Shared by the worker's tasks.
pub(super) struct Shared {
    pub(super) settings: Settings,
    pub(super) worker_id: String,
    pub(super) client: async_nats::Client,
    pub(super) subjects: Subjects,
    pub(super) stores: Stores,
    pub(super) supervisor: Addr<Supervisor<Arc<Hold>>>,
    pub(super) checker: RequestChecker,
    pub(super) capacity: watch::Receiver<Capacity>,
    /// Heartbeats (`GENFLEET_WORKERS`).
    pub(super) workers: jetstream::kv::Store,
    /// The pool peers' free slots, from their heartbeats.
    pub(super) peer_slots: PeerSlots,
    pub(super) decisions: Decisions,
    /// Handlers of incoming requests running at once.
    pub(super) in_flight: Arc<Semaphore>,
    /// Requests being finished (result stored, then `finished` published) at once.
    pub(super) finishing: Arc<Semaphore>,
    /// The id of each request whose result was just stored (or given up), for cancels that
    /// answer only once the result is there.
    pub(super) stored: broadcast::Sender<String>,
    pub(super) metrics: Arc<Metrics>,
    /// What each tenant and band does, for the metrics and the service stats.
    pub(super) tenant_stats: super::tenants::TenantStats,
    /// Whether the fleet may have declared this worker lost, and the requests it stopped for
    /// that: while either holds, nothing is published for them.
    pub(super) fencing: Fencing,
    /// The pool's count of each tenant's running requests (`worker.tenants.pool_max_running`).
    pub(super) tenant_counts: Arc<super::tenant_limit::TenantCounts>,
    /// Heartbeats asked for and counted: a request's first checkpoint waits until a heartbeat
    /// lists it (see [`Listing`]).
    pub(super) listing: Arc<Listing>,
    /// The requests this worker handed off as it drained, listed in its last heartbeats.
    pub(super) handed_off: HandedOff,
}

/// The requests a draining worker handed off (each with whether it is durable): its last
/// heartbeat lists them, and its peers take them up when its entry goes.
#[derive(Default)]
pub(super) struct HandedOff(std::sync::Mutex<Vec<(String, bool)>>);

impl HandedOff {
    pub(super) fn add(&self, request_id: String, durable: bool) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((request_id, durable));
    }

    pub(super) fn has_any(&self) -> bool {
        !self.0.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// The durable ones and the interactive ones.
    pub(super) fn list(&self) -> (Vec<String>, Vec<String>) {
        let handed = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (durable, running): (Vec<_>, Vec<_>) = handed.iter().partition(|(_, d)| *d);
        (
            durable.into_iter().map(|(id, _)| id.clone()).collect(),
            running.into_iter().map(|(id, _)| id.clone()).collect(),
        )
    }
}

/// A request is taken up when its worker goes only if that worker's heartbeat listed it, so
/// its first checkpoint is written only once a heartbeat written since it started lists it:
/// a worker that dies in between leaves a listed request without a checkpoint (ended
/// `worker_lost`, as a short request is), never a checkpoint nobody finds.
#[derive(Default)]
pub(super) struct Listing {
    ask: tokio::sync::Notify,
    beats: tokio::sync::watch::Sender<u64>,
}

impl Listing {
    /// Asks for a heartbeat now and waits (at most `within`) until one begun after the ask
    /// is written; whether one was.
    pub(super) async fn beat_listing(&self, within: std::time::Duration) -> bool {
        let mut beats = self.beats.subscribe();
        let asked_at = *beats.borrow_and_update();
        self.ask.notify_one();
        // A beat under way when asked may have begun before: the one after it lists it.
        let wanted = asked_at + 2;
        tokio::time::timeout(within, beats.wait_for(|n| *n >= wanted))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Resolves when a heartbeat is asked for.
    pub(super) async fn asked(&self) {
        self.ask.notified().await;
    }

    /// A heartbeat was written.
    pub(super) fn beaten(&self) {
        self.beats.send_modify(|n| *n += 1);
    }
}

/// Fencing: a worker whose heartbeat expired (it was paused, or cut off from NATS, for
/// `worker.lost_after_ms`) may have been declared lost by its peers, which then end its
/// requests or take them over. Its first heartbeat after that puts its entry back (so no peer
/// takes it for lost from then on), then reads the record of every request it holds: those
/// whose record no longer names it are stopped without a word ([`crate::actors::Fence`]);
/// the others go on. Any result it stores replaces only a record that is still its own.
pub(super) struct Fencing {
    lost_after: std::time::Duration,
    last_beat: std::sync::Mutex<std::time::Instant>,
    fenced: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Whether `fenced` holds any request: every event asks [`Fencing::muted`], and almost
    /// always none is fenced, so the common answer costs one atomic load, no lock.
    any_fenced: AtomicBool,
}

impl Fencing {
    pub(super) fn new(lost_after: std::time::Duration) -> Fencing {
        Fencing {
            lost_after,
            last_beat: std::sync::Mutex::new(std::time::Instant::now()),
            fenced: Default::default(),
            any_fenced: AtomicBool::new(false),
        }
    }

    /// A heartbeat was written now.
    pub(super) fn beat(&self) {
        *self.last_beat.lock().expect("last beat") = std::time::Instant::now();
    }

    /// Whether this worker's last heartbeat is old enough for the fleet to have declared it
    /// lost.
    pub(super) fn stale(&self) -> bool {
        self.last_beat.lock().expect("last beat").elapsed() >= self.lost_after
    }

    /// Notes the requests a fence stopped (bounded by the slots and the waiting list).
    pub(super) fn fence(&self, ids: impl IntoIterator<Item = String>) {
        let mut fenced = self.fenced.lock().expect("fenced");
        fenced.extend(ids);
        self.any_fenced.store(!fenced.is_empty(), Ordering::Release);
    }

    /// Whether nothing may be published for this request now: the fleet took it from this
    /// worker.
    pub(super) fn muted(&self, request_id: &str) -> bool {
        self.any_fenced.load(Ordering::Acquire)
            && self.fenced.lock().expect("fenced").contains(request_id)
    }

    /// A fenced request ended: true if it was one.
    pub(super) fn ended(&self, request_id: &str) -> bool {
        if !self.any_fenced.load(Ordering::Acquire) {
            return false;
        }
        let mut fenced = self.fenced.lock().expect("fenced");
        let was = fenced.remove(request_id);
        self.any_fenced.store(!fenced.is_empty(), Ordering::Release);
        was
    }
}

/// The free slots of this worker's pool peers (not draining) as their last heartbeats told
/// them, kept by the task that follows the heartbeats: where a pool submit this worker cannot
/// start goes (see `super::submit`), and whether a pulled queue message is better handed back.
/// A peer sent a submit is counted one slot fewer until its next heartbeat, so a full worker
/// does not send a peer more than it had free.
#[derive(Default)]
pub(super) struct PeerSlots(std::sync::Mutex<PoolView>);

impl PeerSlots {
    fn view(&self) -> std::sync::MutexGuard<'_, PoolView> {
        // Every change is made whole under the lock; a panic cannot leave it torn.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A peer's heartbeat: its slots and busy slots, or `None` when it takes no work of this
    /// pool (another pool, draining, paused).
    pub(super) fn note(&self, worker: &str, load: Option<(u32, u32)>) {
        self.view().note(worker, load);
    }

    pub(super) fn forget(&self, worker: &str) {
        self.view().forget(worker);
    }

    /// Whether a peer had a free slot at its last heartbeat.
    pub(super) fn any_free(&self) -> bool {
        self.view().any_free()
    }

    /// The peer with the most free slots at its last heartbeat (less what was sent it since),
    /// counted one slot busier from now.
    pub(super) fn take(&self) -> Option<String> {
        self.view().take_most_free()
    }

    /// The first in `key`'s rank of the peers and this worker (`this`: `None` when it takes
    /// no work), free slots or not.
    pub(super) fn key_worker(&self, key: &str, this: Option<WorkerLoad>) -> Option<String> {
        let this = this.map(|w| w.worker_id);
        self.view().key_worker(key, this.as_deref())
    }

    /// Where a request with `key` goes, among the peers and this worker (`this`: its own
    /// exact load, `None` when it takes no work). A peer's count is not raised for what is sent
    /// it: keyed requests are short as often as not, and counting each until the next
    /// heartbeat would pass a key's worker over for slots it has freed; a peer that turns out
    /// full forwards the request once more.
    pub(super) fn place(
        &self,
        key: &str,
        this: Option<WorkerLoad>,
        load_factor: f64,
    ) -> Option<Choice> {
        self.view().choose(key, this, None, load_factor)
    }

    /// The peers that take work, their slots and their busy slots, summed.
    pub(super) fn totals(&self) -> (u32, u64, u64) {
        self.view().totals()
    }

    /// The pool's live workers that take work, as the heartbeats tell (this one not counted).
    pub(super) fn peers(&self) -> usize {
        self.view().len()
    }
}

/// This worker as the fleet's placement ranks it: its exact load, or `None` while it takes no
/// work (draining, paused).
pub(super) fn this_load(shared: &Shared) -> Option<WorkerLoad> {
    let capacity = *shared.capacity.borrow();
    (!capacity.draining && !capacity.paused).then(|| WorkerLoad {
        worker_id: shared.worker_id.clone(),
        slots: capacity.total,
        busy: capacity.total.saturating_sub(capacity.free()),
    })
}

/// Requests handled at once per worker; past it, messages wait in the client's bounded
/// subscription buffers.
pub(super) const MAX_IN_FLIGHT: usize = 256;

/// Runs a handler of an incoming message as its own task, at most [`MAX_IN_FLIGHT`] at once.
pub(super) async fn spawn_handler(
    shared: &Arc<Shared>,
    handler: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let Ok(permit) = shared.in_flight.clone().acquire_owned().await else {
        return;
    };
    tokio::spawn(async move {
        handler.await;
        drop(permit);
    });
}

/// A request as it was asked, and its place in its chain: a decision it raises restates it in
/// the continuation.
#[derive(Clone)]
pub(super) struct Asked {
    pub(super) request: GenerationRequest,
    pub(super) root_request_id: String,
    pub(super) chain_position: u32,
    /// What it carries from earlier in its chain.
    pub(super) chain: ChainState,
    /// Where it was sent first, for its result (requests with an affinity key).
    pub(super) affinity: Option<AffinityRecord>,
}

/// What the bus keeps with a request the Supervisor holds (its ticket).
pub(super) struct Hold {
    pub(super) asked: Asked,
    /// The live record as claimed (its state is the Supervisor's to tell).
    pub(super) live: LiveRecord,
    /// The revision of the request's record last written here: the result replaces it.
    revision: AtomicU64,
    /// A durable request's queue message, acknowledged once its result is stored.
    pub(super) message: Option<jetstream::Message>,
    /// The request's span on this worker (exported traces), ended with its stored result.
    pub(super) trace: RequestTrace,
    /// Why its caller cancelled it, when the cancel said (the result's detail).
    pub(super) cancel_reason: std::sync::Mutex<Option<String>>,
    /// Its tenant's place in the pool's count, given back when it ends (or when this drops).
    permit: std::sync::Mutex<Option<super::tenant_limit::TenantPermit>>,
    /// Its last checkpoint stored, kept in every rewrite of its live record.
    progress: std::sync::Mutex<Option<Box<crate::protocol::Progress>>>,
    /// Held while its live record is rewritten here, so that no rewrite puts an older
    /// checkpoint back over a newer one.
    pub(super) writing: tokio::sync::Mutex<()>,
}

impl Hold {
    pub(super) fn new(
        asked: Asked,
        live: LiveRecord,
        revision: u64,
        message: Option<jetstream::Message>,
        trace: RequestTrace,
    ) -> Hold {
        Hold {
            asked,
            live,
            revision: AtomicU64::new(revision),
            message,
            trace,
            cancel_reason: std::sync::Mutex::new(None),
            permit: std::sync::Mutex::new(None),
            progress: std::sync::Mutex::new(None),
            writing: tokio::sync::Mutex::new(()),
        }
    }

    /// With its tenant's place in the pool's count.
    pub(super) fn holding(self, permit: Option<super::tenant_limit::TenantPermit>) -> Hold {
        *self.permit.lock().unwrap_or_else(|e| e.into_inner()) = permit;
        self
    }

    /// Gives its tenant's place in the pool's count back: its generation ended.
    pub(super) fn give_place_back(&self) {
        drop(self.permit.lock().unwrap_or_else(|e| e.into_inner()).take());
    }

    /// Notes why the caller cancels it (the first reason given stands).
    pub(super) fn cancelled_because(&self, reason: Option<String>) {
        let mut kept = self.cancel_reason.lock().unwrap_or_else(|e| e.into_inner());
        if kept.is_none() {
            *kept = reason;
        }
    }

    /// Why the caller cancelled it, if the cancel said.
    pub(super) fn cancel_reason(&self) -> Option<String> {
        self.cancel_reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(super) fn is_durable(&self) -> bool {
        self.message.is_some()
    }

    /// Its live record as it should read now: in `state`, with its last checkpoint.
    pub(super) fn live_now(&self, state: crate::protocol::RequestState) -> LiveRecord {
        let progress = self
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        LiveRecord {
            state,
            progress: progress.or_else(|| self.live.progress.clone()),
            ..self.live.clone()
        }
    }

    /// Notes the checkpoint just stored.
    pub(super) fn keep_progress(&self, progress: Box<crate::protocol::Progress>) {
        *self.progress.lock().unwrap_or_else(|e| e.into_inner()) = Some(progress);
    }

    /// Whether a checkpoint of it was stored here.
    pub(super) fn has_progress(&self) -> bool {
        self.progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    pub(super) fn revision(&self) -> u64 {
        self.revision.load(Ordering::Acquire)
    }

    /// Notes a rewrite of the record. Only ever forward: a slow writer's older revision never
    /// replaces a newer one (a stale revision would only cost a compare-and-set retry).
    pub(super) fn wrote(&self, revision: u64) {
        self.revision.fetch_max(revision, Ordering::AcqRel);
    }
}

/// The requests the Supervisor holds, each with the bus's hold.
pub(super) async fn held_requests(shared: &Shared) -> Vec<(HeldRequest<Arc<Hold>>, Arc<Hold>)> {
    let Ok(held) = shared.supervisor.send(Held::new()).await else {
        return Vec::new();
    };
    held.into_iter()
        .filter_map(|request| {
            let hold = request.ticket.clone()?;
            Some((request, hold))
        })
        .collect()
}

/// The hold of one request the Supervisor holds.
pub(super) async fn hold_of(shared: &Shared, request_id: &str) -> Option<Arc<Hold>> {
    shared
        .supervisor
        .send(TicketOf::new(request_id))
        .await
        .ok()?
}
