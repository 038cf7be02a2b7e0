//! Pulling from the durable queue: the consumers, the pulls, the notices and the scans. Which
//! queue a free slot takes is decided in [`crate::schedule`]; this file asks it and pulls.
//!
//! The queue stream holds every band and tenant of a pool under its own subjects
//! (`gen.queue.<pool>.<band>.<tenant>.<id>`, and the v1 `gen.queue.<pool>.<id>`, which is band
//! `normal` of the default tenant). Each band and tenant has its own durable pull consumer
//! (`genfleet-<pool>=<band>=<tenant>`; the v1 subjects keep `genfleet-<pool>`), whose filters
//! never overlap, as a work-queue stream requires. nats-server 2.9 has no consumer with several
//! filters, so the choice between them is made in each worker, for each free slot.
//!
//! A worker learns which bands and tenants have waiting requests from the queue's notices (the
//! stream republishes the headers of each message it stores on `gen.queued.<pool>.>`, and the
//! worker keeps the set of queues heard of, not the notices), from a
//! scan of the stream's subjects when it starts and every [`SCAN_EVERY`] (notices are not
//! durable), and tries every queue it knows once a second in case a notice was missed. What it
//! keeps is bounded: at most [`MAX_QUEUES`] queues, the idle ones forgotten first; an idle
//! consumer is removed by the server after [`IDLE_CONSUMER`] and made again when its tenant
//! comes back (the stream keeps the messages meanwhile).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures_util::StreamExt;

use super::BusError;
use super::shared::Shared;
use super::tenant_limit::{Refusal, TenantPermit};
use crate::protocol::Priority;
use crate::schedule::{Pull, QueueKey, SlotPolicy, TenantLoad, Turns};

/// Queues a worker keeps track of at most.
pub(super) const MAX_QUEUES: usize = 1024;

/// How often a worker scans the stream's subjects for bands and tenants it missed.
pub(super) const SCAN_EVERY: Duration = Duration::from_secs(30);

/// How long a band and tenant's consumer lives unused before the server removes it.
const IDLE_CONSUMER: Duration = Duration::from_secs(3600);

/// The durable consumer of a pool's v1 queue.
pub fn consumer_name(pool: &str) -> String {
    format!("genfleet-{pool}")
}

/// The durable consumer of a queue (`=` never appears in a pool, band or tenant name, so the
/// names of two queues never meet).
pub(super) fn queue_consumer_name(pool: &str, key: &QueueKey) -> String {
    if key.v1 {
        consumer_name(pool)
    } else {
        format!("genfleet-{pool}={}={}", key.band, key.tenant)
    }
}

/// True when `name` is the consumer of one of `pool`'s queues.
pub fn is_pool_consumer(pool: &str, name: &str) -> bool {
    let own = consumer_name(pool);
    name == own
        || name
            .strip_prefix(&own)
            .is_some_and(|rest| rest.starts_with('='))
}

/// The queue whose consumer `name` is, if it is one of `pool`'s.
pub(super) fn queue_of_consumer(pool: &str, name: &str) -> Option<QueueKey> {
    let own = consumer_name(pool);
    if name == own {
        return Some(QueueKey::v1());
    }
    let rest = name.strip_prefix(&own)?.strip_prefix('=')?;
    let (band, tenant) = rest.split_once('=')?;
    Some(QueueKey {
        band: Priority::from_token(band)?,
        tenant: tenant.to_string(),
        v1: false,
    })
}

struct Queue {
    consumer: consumer::PullConsumer,
    /// A message may wait: heard of, or not yet found empty since the last tick.
    maybe_pending: bool,
    /// A message is known to wait: a notice or a scan told of one, or the last pull brought
    /// some (not only the tick's guess). Where a pool limit is set, the tenant's places are
    /// taken before such a queue is pulled.
    heard: bool,
}

pub(super) struct Scheduler {
    shared: Arc<Shared>,
    queues: BTreeMap<QueueKey, Queue>,
    /// Whose turn it is in each band.
    turns: Turns,
    heard: Arc<Heard>,
}

impl Scheduler {
    /// The scheduler with the pool's v1 queue; `heard` brings the queues the notices and scans
    /// find.
    pub(super) async fn open(
        shared: Arc<Shared>,
        heard: Arc<Heard>,
    ) -> Result<Scheduler, BusError> {
        let mut scheduler = Scheduler {
            shared,
            queues: BTreeMap::new(),
            turns: Turns::default(),
            heard,
        };
        let v1 = open_consumer(&scheduler.shared, &QueueKey::v1()).await?;
        scheduler.queues.insert(
            QueueKey::v1(),
            Queue {
                consumer: v1,
                maybe_pending: true,
                heard: false,
            },
        );
        Ok(scheduler)
    }

    /// Takes in the queues heard of since the last call.
    pub(super) async fn absorb(&mut self) {
        for key in self.heard.take() {
            self.learn(key).await;
        }
    }

    /// Waits until a queue is heard of (or `within` passes), then takes it in.
    pub(super) async fn wait_heard(&mut self, within: Duration) {
        self.until_heard(within).await;
        self.absorb().await;
    }

    /// Waits until a queue is heard of, or `within` passes, taking nothing in: safe to cancel
    /// (in a `select!`), as what was heard stays for the next [`Self::absorb`]. A wait that
    /// took the queues in and was cancelled halfway would forget them until the next scan.
    pub(super) async fn until_heard(&self, within: Duration) {
        let _ = tokio::time::timeout(within, self.heard.notify.notified()).await;
    }

    async fn learn(&mut self, key: QueueKey) {
        if let Some(queue) = self.queues.get_mut(&key) {
            queue.maybe_pending = true;
            queue.heard = true;
            return;
        }
        if self.queues.len() >= MAX_QUEUES {
            // Forget an idle queue (never the v1 one); a later notice brings it back.
            let idle = self
                .queues
                .iter()
                .find(|(k, q)| !q.maybe_pending && !k.v1)
                .map(|(k, _)| k.clone());
            match idle {
                Some(idle) => {
                    self.queues.remove(&idle);
                }
                None => {
                    tracing::warn!(message = "too many queues with waiting requests; one waits for the next scan", band = %key.band, tenant = %key.tenant);
                    return;
                }
            }
        }
        match open_consumer(&self.shared, &key).await {
            Ok(consumer) => {
                self.queues.insert(
                    key,
                    Queue {
                        consumer,
                        maybe_pending: true,
                        heard: true,
                    },
                );
            }
            Err(error) => {
                tracing::warn!(message = "cannot open a queue's consumer", %error, band = %key.band, tenant = %key.tenant)
            }
        }
    }

    /// Every queue may have a message again (once a second, in case a notice was missed).
    pub(super) fn try_all(&mut self) {
        for queue in self.queues.values_mut() {
            queue.maybe_pending = true;
        }
    }

    /// True when some queue may hold a message.
    pub(super) fn any_pending(&self) -> bool {
        self.queues.values().any(|q| q.maybe_pending)
    }

    /// The next messages for `free` free slots, from the first queue in turn that has any
    /// (see [`Turns::pulls`]). Empty when no queue it may take from has a message.
    ///
    /// Where `worker.tenants.pool_max_running` is set each message comes with its tenant's
    /// place in the pool's count. A queue known to hold messages has its places taken before
    /// the pull (one write for as many as it pulls), so a tenant at its pool limit is passed
    /// over and its messages stay in the stream. A queue tried on the tick's guess is pulled
    /// first, so that an empty one costs no write, and what it brings takes its places after;
    /// one that finds none left waits for it (`TenantCounts::wait_for_place`).
    pub(super) async fn next(
        &mut self,
        free: u32,
        load: &TenantLoad,
    ) -> Vec<(jetstream::Message, Option<TenantPermit>)> {
        let policy = SlotPolicy::from_settings(&self.shared.settings);
        let pending = self
            .queues
            .iter()
            .filter(|(_, q)| q.maybe_pending)
            .map(|(k, _)| k);
        let counts = &self.shared.tenant_counts;
        for Pull { queue: key, take } in self.turns.pulls(&policy, free, pending, load) {
            let Some(queue) = self.queues.get_mut(&key) else {
                continue;
            };
            let late = || self.shared.fencing.stale();
            let mut places = None;
            if queue.heard {
                match counts.take(&key.tenant, take, Refusal::Copy, late()).await {
                    Ok(taken) => places = taken,
                    Err(error) => {
                        tracing::debug!(message = "a tenant's queue passed over", %error);
                        continue;
                    }
                }
            }
            let take = places.as_ref().map_or(take, |p| p.len() as u32);
            let messages = fetch(&queue.consumer, take as usize).await;
            if messages.is_empty() {
                // Places taken for it go back as they drop.
                queue.maybe_pending = false;
                queue.heard = false;
                continue;
            }
            if !queue.heard && counts.is_set() {
                let wanted = messages.len() as u32;
                places = counts
                    .take(&key.tenant, wanted, Refusal::Copy, late())
                    .await
                    .unwrap_or_default();
            }
            queue.heard = true;
            self.turns.served(key);
            return messages
                .into_iter()
                .map(|message| (message, places.as_mut().and_then(Vec::pop)))
                .collect();
        }
        Vec::new()
    }
}

impl Scheduler {
    /// With `worker.preempt_fair_share` and every one of the worker's `slots` busy: one
    /// message of a queue whose tenant is under its fair share here while another is far over
    /// it ([`Turns::share_pull`]), to take that tenant's slot. Empty when none is known to wait.
    pub(super) async fn next_for_share(
        &mut self,
        slots: u32,
        load: &TenantLoad,
    ) -> Vec<(jetstream::Message, Option<TenantPermit>)> {
        let policy = SlotPolicy::from_settings(&self.shared.settings);
        let known = self
            .queues
            .iter()
            .filter(|(_, q)| q.maybe_pending && q.heard)
            .map(|(k, _)| k);
        let Some(key) = Turns::share_pull(&policy, slots, known, load) else {
            return Vec::new();
        };
        let Some(queue) = self.queues.get_mut(&key) else {
            return Vec::new();
        };
        let late = self.shared.fencing.stale();
        let mut place = match self
            .shared
            .tenant_counts
            .take(&key.tenant, 1, Refusal::Copy, late)
            .await
        {
            Ok(place) => place,
            Err(error) => {
                tracing::debug!(message = "a tenant's queue passed over", %error);
                return Vec::new();
            }
        };
        let messages = fetch(&queue.consumer, 1).await;
        if messages.is_empty() {
            queue.maybe_pending = false;
            queue.heard = false;
            return Vec::new();
        }
        messages
            .into_iter()
            .map(|message| (message, place.as_mut().and_then(Vec::pop)))
            .collect()
    }
}

/// How long one pull may take: a pull whose answer is lost (its server died, a leader is
/// being elected) must not hold the scheduler. A message delivered to a pull given up is
/// redelivered after the ack wait.
const PULL_FOR: Duration = Duration::from_secs(2);

/// The messages a queue has now, up to `max` (none when it is empty or cannot be read).
async fn fetch(consumer: &consumer::PullConsumer, max: usize) -> Vec<jetstream::Message> {
    let mut messages = Vec::new();
    let pulled = tokio::time::timeout(PULL_FOR, async {
        // No wait: an empty queue answers at once (a pull that waited would hold the slot's
        // turn from every other queue).
        let batch = consumer.fetch().max_messages(max).messages().await;
        let mut batch = match batch {
            Ok(batch) => batch,
            Err(error) => {
                tracing::warn!(message = "pulling from the queue failed", %error);
                return;
            }
        };
        while let Some(message) = batch.next().await {
            match message {
                Ok(message) => messages.push(message),
                Err(error) => tracing::debug!(message = "queue pull ended", %error),
            }
        }
    })
    .await;
    if pulled.is_err() {
        tracing::warn!(message = "a pull from the queue got no answer in time");
    }
    messages
}

/// Opens (or makes) the durable consumer of a queue.
async fn open_consumer(
    shared: &Shared,
    key: &QueueKey,
) -> Result<consumer::PullConsumer, BusError> {
    let pool = &shared.settings.worker.pool;
    let js = &shared.settings.jetstream;
    let name = queue_consumer_name(pool, key);
    let (filter, description, inactive) = if key.v1 {
        (
            shared.subjects.pool_queue(pool),
            format!("genfleet workers of pool {pool}"),
            Duration::ZERO,
        )
    } else {
        (
            shared.subjects.band_queue(pool, key.band, &key.tenant),
            format!(
                "genfleet workers of pool {pool}: band {}, tenant {}",
                key.band, key.tenant
            ),
            IDLE_CONSUMER,
        )
    };
    let config = consumer::pull::Config {
        durable_name: Some(name.clone()),
        description: Some(description),
        filter_subject: filter.clone(),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_millis(js.queue_ack_wait_ms),
        max_deliver: js.queue_max_deliver,
        inactive_threshold: inactive,
        ..Default::default()
    };
    let queue = &shared.stores.queue;
    if key.v1 {
        // The v1 consumer once took the pool's whole queue (`gen.queue.<pool>.>`), which
        // overlaps every banded queue: it is remade with the v1 subjects alone. Messages it
        // had delivered come again from the new one; their claims keep them from running
        // twice.
        if let Ok(info) = queue.consumer_info(&name).await
            && info.config.filter_subject != filter
        {
            tracing::info!(message = "narrowing the pool's v1 queue consumer", consumer = %name, filter = %filter);
            let _ = queue.delete_consumer(&name).await;
        }
    }
    queue
        .get_or_create_consumer(&name, config)
        .await
        .map_err(|e| BusError::Setup(format!("cannot open the queue consumer {name}: {e}")))
}

/// The queues heard of and not yet taken in by the scheduler: a set, so a flood of one
/// tenant's notices is one entry and never crowds out another tenant's.
#[derive(Default)]
pub(super) struct Heard {
    keys: std::sync::Mutex<HashSet<QueueKey>>,
    notify: tokio::sync::Notify,
}

impl Heard {
    /// Notes a queue (at most [`MAX_QUEUES`] wait to be taken in; past that the next scan
    /// brings the rest).
    fn note(&self, key: QueueKey) {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if keys.len() < MAX_QUEUES || keys.contains(&key) {
            keys.insert(key);
        }
        drop(keys);
        self.notify.notify_one();
    }

    fn take(&self) -> HashSet<QueueKey> {
        std::mem::take(&mut *self.keys.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Hears the pool's queue notices.
pub(super) async fn hear_notices(
    shared: Arc<Shared>,
    heard: Arc<Heard>,
    mut sub: async_nats::Subscriber,
) {
    while let Some(message) = sub.next().await {
        if let Some(queued) = shared.subjects.parse_queued(&message.subject) {
            heard.note(QueueKey {
                band: queued.band,
                tenant: queued.tenant,
                v1: queued.v1,
            });
        }
    }
}

/// Subscribes to the pool's queue notices.
pub(super) async fn notices(shared: &Shared) -> Result<async_nats::Subscriber, BusError> {
    shared
        .client
        .subscribe(shared.subjects.pool_notices(&shared.settings.worker.pool))
        .await
        .map_err(|e| BusError::Setup(format!("cannot follow the queue's notices: {e}")))
}

/// Scans the stream's banded subjects of the pool when the worker starts and every
/// [`SCAN_EVERY`]: the queues of requests stored while no worker heard their notices.
pub(super) async fn scan(shared: Arc<Shared>, heard: Arc<Heard>) {
    loop {
        let mut found = HashSet::new();
        let filter = shared.subjects.banded_queues(&shared.settings.worker.pool);
        match shared.stores.queue.info_with_subjects(filter).await {
            Ok(mut subjects) => {
                while let Some(Ok((subject, _))) = subjects.next().await {
                    let Some(queued) = shared.subjects.parse_queued(&subject) else {
                        continue;
                    };
                    let key = QueueKey {
                        band: queued.band,
                        tenant: queued.tenant,
                        v1: queued.v1,
                    };
                    if found.len() < MAX_QUEUES && found.insert(key.clone()) {
                        heard.note(key);
                    }
                }
            }
            Err(error) => tracing::debug!(message = "cannot scan the queue's subjects", %error),
        }
        tokio::time::sleep(SCAN_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumer_names_keep_pools_apart() {
        let key = QueueKey {
            band: Priority::High,
            tenant: "acme".into(),
            v1: false,
        };
        assert_eq!(queue_consumer_name("p", &key), "genfleet-p=high=acme");
        assert_eq!(queue_consumer_name("p", &QueueKey::v1()), "genfleet-p");
        assert!(is_pool_consumer("p", "genfleet-p"));
        assert!(is_pool_consumer("p", "genfleet-p=low=x"));
        assert!(!is_pool_consumer("p", "genfleet-p2"));
        assert!(!is_pool_consumer("p", "genfleet-p-x=low=y"));
        assert_eq!(queue_of_consumer("p", "genfleet-p=high=acme"), Some(key));
        assert_eq!(queue_of_consumer("p", "genfleet-p"), Some(QueueKey::v1()));
        assert_eq!(queue_of_consumer("p", "genfleet-q=high=acme"), None);
    }
}
