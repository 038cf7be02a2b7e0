//! Scheduling: which request a free slot takes, decided here and nowhere else. Pure code (no
//! NATS, no actix, no tokio): the worker's bus side feeds it what waits and what runs, and the
//! Supervisor and the queue ask it; the pulls, notices and scans of the durable queue are the
//! bus's (`bus::pull`).
//!
//! How a free slot is chosen:
//!
//! 1. An interactive submit takes a free slot at once when its band's reserve and its tenant's
//!    limit allow and nothing waits in the Supervisor; a durable request that finds none waits
//!    there (at most `slots` of them), and a freed slot goes to the oldest waiting request of
//!    the highest band that fits ([`SlotPolicy::next_waiting`]).
//! 2. The durable queue holds every band and tenant of a pool under its own subjects, each with
//!    its own consumer ([`QueueKey`]); for each free slot the worker chooses among them
//!    ([`Turns::pulls`]):
//!    - the highest band first: a slot only looks at `normal` when no `high` queue has a
//!      message, and never takes a band whose reserve (`worker.reserved_slots`) the free slots
//!      do not cover ([`SlotPolicy::band_fits`]);
//!    - within a band, the tenant running the fewest requests on this worker first, and among
//!      equals the next in turn (round robin, one message each): deficit round robin by
//!      running slots, so a tenant with a backlog of thousands cannot keep another tenant
//!      waiting for more than the next free slot;
//!    - within a tenant, FIFO (the consumer's order), with redelivery, max deliveries and
//!      in-progress acks as for any message of the queue;
//!    - a tenant at its limit on this worker (`worker.tenants.max_running`, [`TenantLimit`]) is
//!      skipped: its messages stay on the queue, for this worker later or for another;
//!    - so is a tenant at its limit across the pool (`worker.tenants.pool_max_running`,
//!      [`PoolLimit`]) as this worker's copy of the pool's count tells, and a tenant near it
//!      pulls no more than its room ([`TenantLoad::pool_room`]).
//! 3. What runs is counted per tenant and band from a slot's start to its release
//!    ([`Slots`], kept by the Supervisor); the queue's choice reads it as a [`TenantLoad`].
//! 4. A request with an affinity key goes to its key's worker: the first of the pool's live
//!    workers ranked by rendezvous hashing of the key with their ids, passed over when it has no
//!    free slot or is busier than the bounded load allows ([`choose`]). Every party ranks
//!    alike; the worker that takes the request records whether it was the key's
//!    ([`Preference`]).
//! 5. Where `worker.tenants.pool_max_running` is set, a worker starts a tenant's request only
//!    when its write of the pool's count of that tenant (which leaves out the workers that are
//!    not live) keeps the sum within the limit ([`PoolLimit::admit`]).
//!
//! The wire vocabulary of scheduling (the [`Priority`] band, tenant names, a request's id
//! qualified by its tenant) lives in `protocol::schedule`, since it crosses the bus; it is
//! re-exported here.

mod affinity;
mod placement;
mod pool_limit;
mod queues;
mod tenants;

pub use crate::protocol::schedule::{
    DEFAULT_TENANT, Priority, is_valid_tenant, qualified_id, split_qualified,
};
pub use affinity::Preference;
pub use placement::{
    Choice, DEFAULT_LOAD_FACTOR, PassedOver, PoolView, WorkerLoad, choose, rank, score,
};
pub use pool_limit::{PoolAdmission, PoolLimit, total_running, with_own_count};
pub use queues::{Pull, QueueKey, Turns};
pub use tenants::{Slots, TenantLimit, TenantLoad, over_share, tenant_name};

use crate::settings::{ReservedSlots, Settings};

/// What a worker's slots may be taken by: the reserve each band leaves to the bands above it,
/// and how many slots one tenant may hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotPolicy {
    pub reserved: ReservedSlots,
    pub tenant_limit: TenantLimit,
}

impl SlotPolicy {
    pub fn from_settings(settings: &Settings) -> SlotPolicy {
        SlotPolicy {
            reserved: settings.worker.reserved_slots,
            tenant_limit: TenantLimit(settings.worker.tenants.max_running),
        }
    }

    /// Whether `free` free slots leave a request of `band` one: more than the bands above it
    /// keep.
    pub fn band_fits(&self, free: u32, band: Priority) -> bool {
        free > self.reserved.above(band)
    }

    /// Whether `tenant` (`None`: the default tenant) holds as many slots as it may.
    pub fn at_tenant_limit(&self, slots: &Slots, tenant: Option<&str>) -> bool {
        self.tenant_limit.reached(slots.of(tenant))
    }

    /// Which of the requests waiting for a slot takes one of `free` free slots now: the oldest
    /// of the highest band, each only where its band's reserve and its tenant's limit allow.
    /// `waiting` gives each its place in line, its band and its tenant; the answer is a place.
    pub fn next_waiting<'a>(
        &self,
        free: u32,
        slots: &Slots,
        waiting: impl IntoIterator<Item = (usize, Priority, Option<&'a str>)>,
    ) -> Option<usize> {
        waiting
            .into_iter()
            .filter(|(_, band, _)| self.band_fits(free, *band))
            .filter(|(_, _, tenant)| !self.at_tenant_limit(slots, *tenant))
            .min_by_key(|(place, band, _)| (*band, *place))
            .map(|(place, _, _)| place)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_of_the_highest_band_that_fits_starts_next() {
        let policy = SlotPolicy {
            reserved: ReservedSlots { high: 1, normal: 0 },
            tenant_limit: TenantLimit(1),
        };
        let mut slots = Slots::default();
        slots.take("r", Some("busy"), Priority::Low);
        let waiting = [
            (0, Priority::Low, None),
            (1, Priority::Normal, Some("busy")),
            (2, Priority::Normal, None),
            (3, Priority::High, None),
            (4, Priority::Normal, None),
        ];
        // Two free: the high request first.
        assert_eq!(policy.next_waiting(2, &slots, waiting), Some(3));
        // One free: high's reserve keeps it from the rest; the tenant at its limit waits.
        assert_eq!(policy.next_waiting(1, &slots, waiting[..3].to_vec()), None);
        assert_eq!(
            policy.next_waiting(2, &slots, waiting[..3].to_vec()),
            Some(2)
        );
    }
}
