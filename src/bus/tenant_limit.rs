//! The pool-wide limit on a tenant's running requests (`worker.tenants.pool_max_running`): the
//! pool's count of each tenant in KV bucket `GENFLEET_TENANTS`, kept exact by compare-and-set.
//! What the count allows is decided in [`crate::schedule::PoolLimit`]; this file reads and
//! writes it.
//!
//! One key per pool and tenant (`<pool>.<tenant>`, the default tenant's too) holds each worker's
//! running requests of that tenant ([`TenantRunning`]). A worker starts a request of the tenant
//! only after a compare-and-set that raises its own count while the sum over the live workers
//! stays within the limit; a write that finds the entry changed reads it again and decides
//! again (at most [`CAS_TRIES`] writes). Two workers never both take the last place: the second
//! write finds the entry changed. An interactive submit takes its place before its record is
//! claimed; the durable queue takes places before it pulls a queue known to hold messages
//! (`pull::Scheduler::next`: one write for as many messages as it pulls), so a tenant at its
//! limit is passed over and its messages stay in the stream. A queue only guessed to hold some
//! is pulled first, so an idle pool writes nothing, and a message it brings that finds no
//! place left waits for one on this worker ([`TenantCounts::wait_for_place`]), spending no
//! delivery. A request's end lowers the worker's own count in the background
//! ([`TenantCounts::keep_counts`]): ends that come together are one write, and until it lands
//! the entry counts too many, never too few.
//!
//! Live: a worker whose heartbeat this worker saw within `worker.lost_after_ms`
//! ([`TenantCounts::peer_seen`], told by `heartbeat`); a listed worker with a count that it has
//! not seen is looked up in `GENFLEET_WORKERS`, whose entry is gone once the worker's heartbeat
//! expired. One that is not live is left out of the sum and dropped from the entry by the
//! write, so a worker that died holds its tenants back for `worker.lost_after_ms` at most.
//!
//! Each worker follows its pool's entries ([`TenantCounts::follow_counts`]), so a write rarely
//! needs a read before it, the durable queue skips a tenant its copy shows at the limit (and
//! tries it again as soon as an entry changes), and every
//! `worker.heartbeat_ms` the worker writes its own count again wherever an entry does not say
//! what it holds: a release that failed, a count the fleet dropped while it was taken for lost
//! (it is back; `heartbeat::fence_taken` stops what the fleet took from it, and what still runs
//! is counted again), or the count of an earlier run under the same worker id.
//!
//! A bucket that cannot be read or written fails closed: no request of the pool starts (a
//! submit is refused `INTERNAL`, a queued request stays queued). A limit that holds only while
//! the store answers is none, and closed costs little: no request can have its record claimed
//! while the same JetStream is down either. A worker whose own heartbeat is late starts none
//! of them either (the fleet may be dropping its counts).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, kv};
use futures_util::StreamExt;
use tokio::sync::{Notify, watch};

use super::BusError;
use super::store::ensure_bucket;
use crate::actors::Capacity;
use crate::protocol::schedule::TenantRunning;
use crate::protocol::{ErrorCode, WireError};
use crate::schedule::{PoolAdmission, PoolLimit, with_own_count};
use crate::settings::Settings;

pub use crate::client::streams::TENANTS_BUCKET;

/// Compare-and-set writes of one count tried before it is given up as contended. Each write
/// that finds the entry changed means another worker's landed.
const CAS_TRIES: u32 = 16;
/// Tenants whose entries a worker keeps a copy of (those it holds requests of are always kept).
const MAX_TENANTS: usize = 1024;
/// Peers whose heartbeats are remembered.
const MAX_PEERS: usize = 10_000;

/// The key of a tenant's count in its pool.
pub fn count_key(pool: &str, tenant: &str) -> String {
    format!("{pool}.{tenant}")
}

/// The buckets the counts need: their own, and the heartbeats.
pub(super) struct Buckets {
    counts: kv::Store,
    /// `GENFLEET_WORKERS`: a peer not seen lately is looked up there.
    workers: kv::Store,
}

/// The bucket, made when absent (entries never expire: a count is what it says until it is
/// written), with the heartbeats beside it.
pub(super) async fn open(
    js: &jetstream::Context,
    replicas: usize,
    workers: kv::Store,
) -> Result<Buckets, BusError> {
    let counts = ensure_bucket(js, TENANTS_BUCKET, 1, Duration::ZERO, replicas).await?;
    Ok(Buckets { counts, workers })
}

/// A tenant's request could not be counted in.
#[derive(Debug, thiserror::Error)]
pub(super) enum LimitError {
    #[error(
        "tenant {tenant} already runs {running} requests across pool {pool} (worker.tenants.pool_max_running = {limit})"
    )]
    AtLimit {
        tenant: String,
        pool: String,
        running: u32,
        limit: u32,
    },
    #[error("cannot count tenant {tenant}'s running requests in bucket {TENANTS_BUCKET}: {reason}")]
    Unavailable { tenant: String, reason: String },
}

impl From<LimitError> for WireError {
    fn from(error: LimitError) -> WireError {
        let code = match error {
            LimitError::AtLimit { .. } => ErrorCode::TenantLimit,
            LimitError::Unavailable { .. } => ErrorCode::Internal,
        };
        WireError::new(code, error.to_string())
    }
}

/// How sure a refusal must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Read the entry before refusing: a caller is told, so a copy behind the bucket must not
    /// refuse it.
    Read,
    /// The worker's copy will do: the queue's choice passes the tenant over, and tries it again
    /// as the copy changes.
    Copy,
}

/// One of a tenant's places in the pool's count, held by a request of this worker from before
/// it starts until it ends; dropped, the place is given back (in the background).
pub(super) struct TenantPermit {
    counts: Arc<TenantCounts>,
    tenant: String,
}

impl Drop for TenantPermit {
    fn drop(&mut self) {
        self.counts.release(&self.tenant);
    }
}

/// The worker's side of the pool's counts: what it holds of each tenant, its copy of their
/// entries, and which peers are live.
pub(super) struct TenantCounts {
    limit: PoolLimit,
    worker_id: String,
    pool: String,
    lost_after: Duration,
    heartbeat: Duration,
    ack_wait: Duration,
    /// `None` when no pool limit is set: nothing is counted, and nothing costs a write.
    buckets: Option<Buckets>,
    tenants: Mutex<HashMap<String, Tenant>>,
    peers: Mutex<HashMap<String, Peer>>,
    /// An entry of the copy changed.
    changed: Notify,
    /// A place was given back.
    released: Notify,
}

#[derive(Default)]
struct Tenant {
    /// Places held by this worker's requests: the truth its own count must say.
    held: u32,
    /// Pulled messages waiting here for a place.
    waiting: u32,
    /// The entry as last read, written or watched, with its revision (`None`: never written).
    copy: Option<(Option<u64>, TenantRunning)>,
    /// A place was given back and not yet written.
    dirty: bool,
    /// Writes of this tenant's entry from this worker, one at a time.
    writing: Arc<tokio::sync::Mutex<()>>,
}

impl Tenant {
    fn own_in_copy(&self, worker: &str) -> Option<u32> {
        let (_, entry) = self.copy.as_ref()?;
        Some(entry.running.get(worker).copied().unwrap_or(0))
    }

    fn idle(&self) -> bool {
        self.held == 0 && self.waiting == 0 && !self.dirty
    }
}

#[derive(Clone, Copy)]
enum Peer {
    Seen(Instant),
    Gone,
}

/// What this worker knows of a peer's liveness.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Liveness {
    Live,
    Gone,
    /// Not seen for `worker.lost_after_ms`: the bucket of heartbeats says.
    Unknown,
}

impl TenantCounts {
    pub(super) fn new(
        settings: &Settings,
        worker_id: String,
        buckets: Option<Buckets>,
    ) -> TenantCounts {
        TenantCounts {
            limit: PoolLimit(settings.worker.tenants.pool_max_running),
            worker_id,
            pool: settings.worker.pool.clone(),
            lost_after: Duration::from_millis(settings.worker.lost_after_ms),
            heartbeat: Duration::from_millis(settings.worker.heartbeat_ms),
            ack_wait: Duration::from_millis(settings.jetstream.queue_ack_wait_ms),
            buckets,
            tenants: Mutex::default(),
            peers: Mutex::default(),
            changed: Notify::new(),
            released: Notify::new(),
        }
    }

    pub(super) fn is_set(&self) -> bool {
        self.buckets.is_some() && self.limit.is_set()
    }

    fn counts_bucket(&self) -> Option<&kv::Store> {
        self.buckets
            .as_ref()
            .filter(|_| self.limit.is_set())
            .map(|b| &b.counts)
    }

    /// Whether `worker`'s heartbeat is in its bucket (`None`: it cannot be told now).
    async fn heartbeat_of(&self, worker: &str) -> Option<bool> {
        let buckets = self.buckets.as_ref()?;
        buckets.workers.get(worker).await.ok().map(|e| e.is_some())
    }

    /// Resolves when an entry of the copy changes (never, with no pool limit).
    pub(super) async fn changed(&self) {
        if self.is_set() {
            self.changed.notified().await
        } else {
            std::future::pending().await
        }
    }

    /// A peer's heartbeat came.
    pub(super) fn peer_seen(&self, worker: &str) {
        if !self.is_set() {
            return;
        }
        let mut peers = self.peers.lock().expect("peers");
        if peers.len() < MAX_PEERS || peers.contains_key(worker) {
            peers.insert(worker.to_string(), Peer::Seen(Instant::now()));
        }
    }

    /// A peer's heartbeat is gone (it stopped, or was found lost).
    pub(super) fn peer_gone(&self, worker: &str) {
        if !self.is_set() {
            return;
        }
        let mut peers = self.peers.lock().expect("peers");
        if peers.len() < MAX_PEERS || peers.contains_key(worker) {
            peers.insert(worker.to_string(), Peer::Gone);
        }
    }

    fn liveness(&self, worker: &str) -> Liveness {
        match self.peers.lock().expect("peers").get(worker) {
            Some(Peer::Seen(at)) if at.elapsed() < self.lost_after => Liveness::Live,
            Some(Peer::Gone) => Liveness::Gone,
            _ => Liveness::Unknown,
        }
    }

    /// How many more of each tenant's requests the pool may start, as this worker's copy
    /// tells (the queue's hint; the write decides). A peer not seen lately is taken for gone
    /// here, so that a dead worker's count, which only a write drops, never keeps the queue
    /// from trying.
    pub(super) fn rooms(&self) -> Vec<(String, u32)> {
        if !self.is_set() {
            return Vec::new();
        }
        let tenants = self.tenants.lock().expect("tenants");
        tenants
            .iter()
            .filter_map(|(tenant, t)| {
                let (_, entry) = t.copy.as_ref()?;
                let room = self.limit.room(entry, &self.worker_id, t.held, |id| {
                    self.liveness(id) == Liveness::Live
                })?;
                Some((tenant.clone(), room.saturating_sub(t.waiting)))
            })
            .collect()
    }

    /// The tenant's state, made when absent; past [`MAX_TENANTS`] an idle one is forgotten.
    fn with_tenant<T>(&self, tenant: &str, f: impl FnOnce(&mut Tenant) -> T) -> T {
        let mut tenants = self.tenants.lock().expect("tenants");
        if !tenants.contains_key(tenant) && tenants.len() >= MAX_TENANTS {
            let idle = tenants
                .iter()
                .find(|(_, t)| t.idle())
                .map(|(name, _)| name.clone());
            if let Some(idle) = idle {
                tenants.remove(&idle);
            }
        }
        f(tenants.entry(tenant.to_string()).or_default())
    }

    fn release(&self, tenant: &str) {
        self.with_tenant(tenant, |t| {
            t.held = t.held.saturating_sub(1);
            t.dirty = true;
        });
        self.released.notify_one();
    }

    /// Notes an entry read, written or watched at `revision`, unless the copy is newer.
    fn observe(&self, tenant: &str, revision: Option<u64>, entry: TenantRunning) {
        let mut tenants = self.tenants.lock().expect("tenants");
        let lists_me = entry.running.contains_key(&self.worker_id);
        if !tenants.contains_key(tenant) && tenants.len() >= MAX_TENANTS && !lists_me {
            return;
        }
        let t = tenants.entry(tenant.to_string()).or_default();
        let newer = match (&t.copy, revision) {
            (Some((Some(kept), _)), Some(revision)) => revision > *kept,
            (Some((Some(_), _)), None) => false,
            _ => true,
        };
        if newer {
            t.copy = Some((revision, entry));
        }
    }

    fn forget_copy(&self, tenant: &str) {
        self.with_tenant(tenant, |t| t.copy = None);
    }

    /// The tenants whose entry must be written: a place given back, or an entry whose count of
    /// this worker is not what it holds.
    fn due(&self) -> Vec<String> {
        let tenants = self.tenants.lock().expect("tenants");
        tenants
            .iter()
            .filter(|(_, t)| {
                t.dirty
                    || match t.own_in_copy(&self.worker_id) {
                        Some(own) => own != t.held,
                        None => t.held > 0,
                    }
            })
            .map(|(tenant, _)| tenant.clone())
            .collect()
    }
}

impl TenantCounts {
    /// Takes one of `tenant`'s places in the pool's count for a request about to start on this
    /// worker (`None` when no pool limit is set: nothing is counted). The permit gives it back
    /// when dropped. `late`: this worker's own heartbeat is late, and the fleet may be taking it
    /// for lost (and dropping its counts): nothing is taken then.
    pub(super) async fn take_one(
        self: &Arc<Self>,
        tenant: &str,
        refusal: Refusal,
        late: bool,
    ) -> Result<Option<TenantPermit>, LimitError> {
        Ok(self
            .take(tenant, 1, refusal, late)
            .await?
            .and_then(|mut permits| permits.pop()))
    }

    /// Takes up to `wanted` of `tenant`'s places (at least one) in one write, as
    /// [`TenantCounts::take_one`] does one.
    pub(super) async fn take(
        self: &Arc<Self>,
        tenant: &str,
        wanted: u32,
        refusal: Refusal,
        late: bool,
    ) -> Result<Option<Vec<TenantPermit>>, LimitError> {
        let Some(bucket) = self.counts_bucket() else {
            return Ok(None);
        };
        let unavailable = |reason: String| LimitError::Unavailable {
            tenant: tenant.to_string(),
            reason,
        };
        if late {
            return Err(unavailable(
                "this worker's heartbeat is late, and the fleet may be taking it for lost".into(),
            ));
        }
        let key = count_key(&self.pool, tenant);
        let writing = self.with_tenant(tenant, |t| t.writing.clone());
        let _writing = writing.lock().await;
        let mut read = false;
        for _ in 0..CAS_TRIES {
            let (revision, entry) = match self.with_tenant(tenant, |t| t.copy.clone()) {
                Some(copy) => copy,
                None => {
                    read = true;
                    self.read_entry(bucket, tenant, &key)
                        .await
                        .map_err(unavailable)?
                }
            };
            let held = self.with_tenant(tenant, |t| t.held);
            let live = self.live_workers(&entry).await;
            let admission = self
                .limit
                .admit(&entry, &self.worker_id, held, wanted, |id| {
                    live.contains(id)
                });
            match admission {
                // A refusal a caller hears is read from the bucket, not from the copy.
                PoolAdmission::AtLimit { .. } if !read && refusal == Refusal::Read => {
                    self.forget_copy(tenant);
                }
                PoolAdmission::AtLimit { running } => {
                    return Err(LimitError::AtLimit {
                        tenant: tenant.to_string(),
                        pool: self.pool.clone(),
                        running,
                        limit: self.limit.0,
                    });
                }
                PoolAdmission::Admit { next, granted } => {
                    match write(bucket, &key, &next, revision).await {
                        Ok(written) => {
                            self.with_tenant(tenant, |t| t.held += granted);
                            self.observe(tenant, Some(written), next);
                            let permit = || TenantPermit {
                                counts: self.clone(),
                                tenant: tenant.to_string(),
                            };
                            return Ok(Some((0..granted).map(|_| permit()).collect()));
                        }
                        Err(Conflict::Changed) => self.forget_copy(tenant),
                        Err(Conflict::Other(reason)) => return Err(unavailable(reason)),
                    }
                }
            }
        }
        Err(unavailable(format!(
            "the count kept changing under {CAS_TRIES} writes"
        )))
    }

    /// The place of a pulled message that found none left (it was pulled on a guess, or the
    /// count changed meanwhile), waited for before anything is written for it: the message
    /// stays with this worker, kept alive with in-progress acknowledgements (so the wait spends
    /// none of its deliveries), and tries again as the count changes. `Err` when the worker
    /// drains meanwhile: the message went back to the queue. `late` as for
    /// [`TenantCounts::take`].
    pub(super) async fn wait_for_place(
        self: &Arc<Self>,
        message: &jetstream::Message,
        tenant: &str,
        capacity: &watch::Receiver<Capacity>,
        late: impl Fn() -> bool,
    ) -> Result<Option<TenantPermit>, HandedBack> {
        if !self.is_set() {
            return Ok(None);
        }
        let every = self
            .heartbeat
            .min(self.ack_wait / 3)
            .max(Duration::from_millis(10));
        let _waiting = Waiting::start(self, tenant);
        let mut refusal = Refusal::Copy;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.take_one(tenant, refusal, late()).await {
                Ok(permit) => return Ok(permit),
                Err(error) => {
                    tracing::debug!(message = "a pulled request waits for its tenant's place in the pool", %error)
                }
            }
            if capacity.borrow().draining {
                let _ = message.ack_with(AckKind::Nak(None)).await;
                return Err(HandedBack);
            }
            refusal = tokio::select! {
                _ = &mut changed => Refusal::Copy,
                _ = tokio::time::sleep(every) => Refusal::Read,
            };
            let _ = message.ack_with(AckKind::Progress).await;
        }
    }

    /// The workers `entry` lists with a count that are live (this worker among them).
    async fn live_workers(&self, entry: &TenantRunning) -> HashSet<String> {
        let mut live = HashSet::new();
        for (worker, n) in &entry.running {
            if *n == 0 {
                continue;
            }
            let is_live = worker == &self.worker_id
                || match self.liveness(worker) {
                    Liveness::Live => true,
                    Liveness::Gone => false,
                    // The server's word; a failed read counts it (too many, never too few).
                    Liveness::Unknown => match self.heartbeat_of(worker).await {
                        Some(false) => {
                            self.peer_gone(worker);
                            false
                        }
                        Some(true) | None => true,
                    },
                };
            if is_live {
                live.insert(worker.clone());
            }
        }
        live
    }

    /// Reads a tenant's entry (an absent one is empty) into the copy.
    async fn read_entry(
        &self,
        bucket: &kv::Store,
        tenant: &str,
        key: &str,
    ) -> Result<(Option<u64>, TenantRunning), String> {
        let entry = bucket.entry(key).await.map_err(|e| e.to_string())?;
        let read = match entry {
            None => (None, TenantRunning::default()),
            Some(entry) => (Some(entry.revision), decode(&entry)?),
        };
        self.observe(tenant, read.0, read.1.clone());
        Ok(read)
    }

    /// Writes this worker's own count of a tenant as it is now (what it holds), dropping the
    /// workers that are not live: a release, or a count put back.
    async fn write_own(&self, bucket: &kv::Store, tenant: &str) -> Result<(), String> {
        let key = count_key(&self.pool, tenant);
        let writing = self.with_tenant(tenant, |t| t.writing.clone());
        let _writing = writing.lock().await;
        for _ in 0..CAS_TRIES {
            let held = self.with_tenant(tenant, |t| {
                t.dirty = false;
                t.held
            });
            let (revision, entry) = match self.with_tenant(tenant, |t| t.copy.clone()) {
                Some(copy) => copy,
                None => self.read_entry(bucket, tenant, &key).await?,
            };
            let live = self.live_workers(&entry).await;
            let next = with_own_count(&entry, &self.worker_id, held, |id| live.contains(id));
            if next == entry {
                return Ok(());
            }
            match write(bucket, &key, &next, revision).await {
                Ok(written) => {
                    self.observe(tenant, Some(written), next);
                    return Ok(());
                }
                Err(Conflict::Changed) => self.forget_copy(tenant),
                Err(Conflict::Other(reason)) => return Err(reason),
            }
        }
        Err(format!("the count kept changing under {CAS_TRIES} writes"))
    }

    /// Writes this worker's own counts where they are due: at once when a place is given back,
    /// and every `worker.heartbeat_ms` wherever an entry does not say what this worker holds. A
    /// write that fails is tried again at the next turn; meanwhile the entry counts too many.
    pub(super) async fn keep_counts(self: Arc<Self>) {
        let Some(bucket) = self.counts_bucket().cloned() else {
            return;
        };
        loop {
            tokio::select! {
                _ = self.released.notified() => {}
                _ = tokio::time::sleep(self.heartbeat) => {}
            }
            self.write_due(&bucket).await;
        }
    }

    /// Writes the counts that are due now (a worker that stops writes its releases down
    /// before it leaves: a later run under its id starts from none).
    pub(super) async fn write_down(&self) {
        if let Some(bucket) = self.counts_bucket() {
            self.write_due(bucket).await;
        }
    }

    async fn write_due(&self, bucket: &kv::Store) {
        for tenant in self.due() {
            if let Err(reason) = self.write_own(bucket, &tenant).await {
                self.with_tenant(&tenant, |t| t.dirty = true);
                tracing::warn!(message = "cannot write this worker's count of a tenant; trying again", tenant = %tenant, %reason);
            }
        }
    }

    /// Follows the pool's entries into this worker's copy, each entry's last value first.
    pub(super) async fn follow_counts(self: Arc<Self>) {
        let Some(bucket) = self.counts_bucket().cloned() else {
            return;
        };
        let prefix = format!("{}.", self.pool);
        loop {
            let mut watch = match bucket.watch_with_history(format!("{prefix}>")).await {
                Ok(watch) => watch,
                Err(error) => {
                    tracing::debug!(message = "cannot follow the tenants' counts; trying again", %error);
                    tokio::time::sleep(self.heartbeat).await;
                    continue;
                }
            };
            while let Some(entry) = watch.next().await {
                let entry = match entry {
                    Ok(entry) => entry,
                    Err(error) => {
                        tracing::debug!(message = "following the tenants' counts failed", %error);
                        break;
                    }
                };
                let Some(tenant) = entry.key.strip_prefix(&prefix) else {
                    continue;
                };
                match decode(&entry) {
                    Ok(running) => self.observe(tenant, Some(entry.revision), running),
                    Err(error) => tracing::warn!(message = "an unreadable tenant count", %error),
                }
                self.changed.notify_waiters();
            }
        }
    }
}

/// The worker began to drain while a pulled message waited for its place: the message went
/// back to the queue.
#[derive(Debug)]
pub(super) struct HandedBack;

/// A pulled message waiting here for a place: the queue's choice counts it as taken.
struct Waiting {
    counts: Arc<TenantCounts>,
    tenant: String,
}

impl Waiting {
    fn start(counts: &Arc<TenantCounts>, tenant: &str) -> Waiting {
        counts.with_tenant(tenant, |t| t.waiting += 1);
        Waiting {
            counts: counts.clone(),
            tenant: tenant.to_string(),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.counts
            .with_tenant(&self.tenant, |t| t.waiting = t.waiting.saturating_sub(1));
    }
}

fn decode(entry: &kv::Entry) -> Result<TenantRunning, String> {
    if entry.operation != kv::Operation::Put {
        return Ok(TenantRunning::default());
    }
    serde_json::from_slice(&entry.value)
        .map_err(|e| format!("the entry of {} cannot be read: {e}", entry.key))
}

/// A compare-and-set write that did not land.
enum Conflict {
    /// Another worker wrote first.
    Changed,
    Other(String),
}

/// Writes `next` over the entry read at `revision` (`None`: there was none).
async fn write(
    bucket: &kv::Store,
    key: &str,
    next: &TenantRunning,
    revision: Option<u64>,
) -> Result<u64, Conflict> {
    let body = serde_json::to_vec(next).expect("counts serialize").into();
    match revision {
        None => bucket
            .create(key, body)
            .await
            .map_err(|error| match error.kind() {
                kv::CreateErrorKind::AlreadyExists => Conflict::Changed,
                _ => Conflict::Other(error.to_string()),
            }),
        Some(revision) => {
            bucket
                .update(key, body, revision)
                .await
                .map_err(|error| match error.kind() {
                    kv::UpdateErrorKind::WrongLastRevision => Conflict::Changed,
                    _ => Conflict::Other(error.to_string()),
                })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(limit: u32) -> TenantCounts {
        let mut settings = Settings::defaults();
        settings.worker.tenants.pool_max_running = limit;
        settings.worker.pool = "p".into();
        TenantCounts::new(&settings, "me".into(), None)
    }

    fn entry(counts: &[(&str, u32)]) -> TenantRunning {
        TenantRunning {
            running: counts.iter().map(|(w, n)| (w.to_string(), *n)).collect(),
        }
    }

    #[test]
    fn keys_name_the_pool_and_the_tenant() {
        assert_eq!(count_key("gpu", "acme"), "gpu.acme");
        assert_eq!(count_key("gpu", "default"), "gpu.default");
    }

    #[test]
    fn a_newer_copy_is_never_replaced_by_an_older_read() {
        let counts = counts(2);
        counts.observe("t", Some(7), entry(&[("a", 1)]));
        counts.observe("t", Some(5), entry(&[("a", 2)]));
        counts.observe("t", None, entry(&[]));
        let copy = counts.with_tenant("t", |t| t.copy.clone());
        assert_eq!(copy, Some((Some(7), entry(&[("a", 1)]))));
    }

    #[test]
    fn a_place_given_back_or_a_count_that_is_not_this_workers_is_due() {
        let counts = counts(2);
        counts.observe("listed", Some(1), entry(&[("me", 2)]));
        counts.observe("others", Some(2), entry(&[("a", 2)]));
        counts.with_tenant("held", |t| {
            t.held = 1;
            t.copy = Some((Some(3), entry(&[("me", 1)])));
        });
        counts.with_tenant("released", |t| {
            t.held = 1;
            t.copy = Some((Some(4), entry(&[("me", 1)])));
        });
        counts.release("released");
        let mut due = counts.due();
        due.sort();
        assert_eq!(due, vec!["listed", "released"]);
    }
}
