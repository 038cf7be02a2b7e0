//! The durable queue's turns: which of a pool's queues (one per band and tenant) a worker's
//! free slots pull from next.

use std::collections::HashMap;

use super::SlotPolicy;
use super::tenants::TenantLoad;
use crate::protocol::{DEFAULT_TENANT, Priority};

/// One queue: a band of a tenant (the v1 subjects apart from the banded ones of the default
/// tenant). Orders by band first, the order in which they are served.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QueueKey {
    pub band: Priority,
    pub tenant: String,
    pub v1: bool,
}

impl QueueKey {
    /// The pool's v1 queue: band `normal` of the default tenant.
    pub fn v1() -> QueueKey {
        QueueKey {
            band: Priority::Normal,
            tenant: DEFAULT_TENANT.to_string(),
            v1: true,
        }
    }
}

/// A queue to pull from, and how many messages to ask it for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pull {
    pub queue: QueueKey,
    pub take: u32,
}

/// The queues of `pending` whose tenant may start another request (not at its limit on this
/// worker, nor across the pool), in order.
fn takeable<'a>(
    policy: &SlotPolicy,
    pending: impl IntoIterator<Item = &'a QueueKey>,
    load: &TenantLoad,
) -> Vec<&'a QueueKey> {
    let mut pending: Vec<&QueueKey> = pending
        .into_iter()
        .filter(|k| !policy.tenant_limit.reached(load.of(&k.tenant)))
        .filter(|k| load.pool_room(&k.tenant) != Some(0))
        .collect();
    pending.sort();
    pending
}

/// Whose turn it is in each band: the round robin goes on after the queue served last.
#[derive(Debug, Default)]
pub struct Turns {
    served: HashMap<Priority, QueueKey>,
}

impl Turns {
    /// The pulls to try, in order, for `free` free slots, among the queues that may hold a
    /// message: the caller tries each until one brings messages, and tells [`Turns::served`]
    /// which. Bands come highest first, and only while the free slots cover a band's reserve;
    /// within a band, the tenants holding the fewest slots first (`load`), among equals the next
    /// in turn, those at their limit (on this worker, or across the pool) skipped. One message
    /// per turn, so tenants alternate; a queue alone in its band takes as many as the band may,
    /// and never more than its tenant's room in the pool.
    pub fn pulls<'a>(
        &self,
        policy: &SlotPolicy,
        free: u32,
        pending: impl IntoIterator<Item = &'a QueueKey>,
        load: &TenantLoad,
    ) -> Vec<Pull> {
        let pending = takeable(policy, pending, load);
        let mut pulls = Vec::new();
        for band in Priority::ALL {
            let reserve = policy.reserved.above(band);
            if free <= reserve {
                // Lower bands must leave even more.
                break;
            }
            let in_turn = self.in_turn(band, &pending, load);
            let alone = in_turn.len() == 1;
            let take = if alone { free - reserve } else { 1 };
            pulls.extend(in_turn.into_iter().map(|queue| {
                Pull {
                    take: load
                        .pool_room(&queue.tenant)
                        .map_or(take, |room| take.min(room)),
                    queue,
                }
            }));
        }
        pulls
    }

    /// With `worker.preempt_fair_share`, the queue a worker with every one of its `slots` busy
    /// pulls one message from anyway: the first (highest band, then by name) whose tenant is
    /// under its fair share there while another is far over it ([`super::over_share`]), so that
    /// the message takes that tenant's slot. Queues of tenants at their limit (on the worker or
    /// across the pool) are skipped, as for a free slot.
    pub fn share_pull<'a>(
        policy: &SlotPolicy,
        slots: u32,
        pending: impl IntoIterator<Item = &'a QueueKey>,
        load: &TenantLoad,
    ) -> Option<QueueKey> {
        takeable(policy, pending, load)
            .into_iter()
            .find(|k| super::over_share(slots, load.running(), &k.tenant).is_some())
            .cloned()
    }

    /// A pull from `queue` brought messages.
    pub fn served(&mut self, queue: QueueKey) {
        self.served.insert(queue.band, queue);
    }

    /// The band's queues, in turn: the tenants holding the fewest slots here first, and among
    /// equals those after the one served last first.
    fn in_turn(&self, band: Priority, pending: &[&QueueKey], load: &TenantLoad) -> Vec<QueueKey> {
        let candidates: Vec<&QueueKey> =
            pending.iter().copied().filter(|k| k.band == band).collect();
        let start = match self.served.get(&band) {
            Some(last) => candidates.iter().position(|k| *k > last).unwrap_or(0),
            None => 0,
        };
        let mut in_turn: Vec<QueueKey> = candidates[start..]
            .iter()
            .chain(candidates[..start].iter())
            .map(|k| (*k).clone())
            .collect();
        // Stable: the turn order stays among tenants running as many.
        in_turn.sort_by_key(|k| load.of(&k.tenant));
        in_turn
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::TenantLimit;
    use crate::settings::ReservedSlots;

    fn key(band: Priority, tenant: &str) -> QueueKey {
        QueueKey {
            band,
            tenant: tenant.into(),
            v1: false,
        }
    }

    #[test]
    fn a_full_worker_pulls_for_the_tenant_under_its_share_only() {
        let policy = SlotPolicy {
            reserved: ReservedSlots::default(),
            tenant_limit: TenantLimit(0),
        };
        let flood = TenantLoad::from_slots([("flood".to_string(), Priority::Normal, 4)]);
        let queues = [key(Priority::Low, "light"), key(Priority::Normal, "flood")];
        // The flooding tenant's own queue never preempts it; the light one's does.
        assert_eq!(
            Turns::share_pull(&policy, 4, &queues, &flood),
            Some(key(Priority::Low, "light"))
        );
        // Once both hold their part, nobody pulls.
        let even = TenantLoad::from_slots([
            ("flood".to_string(), Priority::Normal, 2),
            ("light".to_string(), Priority::Low, 2),
        ]);
        assert_eq!(Turns::share_pull(&policy, 4, &queues, &even), None);
        // A tenant at its limit is not pulled for.
        let limited = SlotPolicy {
            tenant_limit: TenantLimit(1),
            ..policy
        };
        let light_one = TenantLoad::from_slots([
            ("flood".to_string(), Priority::Normal, 3),
            ("light".to_string(), Priority::Low, 1),
        ]);
        assert_eq!(
            Turns::share_pull(&policy, 4, &queues, &light_one),
            Some(key(Priority::Low, "light"))
        );
        assert_eq!(Turns::share_pull(&limited, 4, &queues, &light_one), None);
    }

    #[test]
    fn bands_order_before_tenants() {
        assert!(key(Priority::High, "zz") < QueueKey::v1());
    }

    #[test]
    fn tenants_take_turns_fewest_slots_first_and_limits_skip() {
        let policy = SlotPolicy {
            reserved: ReservedSlots::default(),
            tenant_limit: TenantLimit(2),
        };
        let queues = [
            key(Priority::Normal, "a"),
            key(Priority::Normal, "b"),
            key(Priority::Normal, "c"),
            key(Priority::Low, "a"),
        ];
        let load = TenantLoad::from_slots([("c".to_string(), Priority::Normal, 1)]);
        let mut turns = Turns::default();
        let order = |turns: &Turns, load: &TenantLoad| -> Vec<(Priority, String, u32)> {
            turns
                .pulls(&policy, 4, &queues, load)
                .into_iter()
                .map(|p| (p.queue.band, p.queue.tenant, p.take))
                .collect()
        };
        let n = |t: &str| (Priority::Normal, t.to_string(), 1);
        assert_eq!(
            order(&turns, &load),
            vec![n("a"), n("b"), n("c"), (Priority::Low, "a".into(), 4)]
        );
        // After a, b's turn; c holds a slot, so it comes after those holding none.
        turns.served(key(Priority::Normal, "a"));
        assert_eq!(order(&turns, &load)[..3], [n("b"), n("a"), n("c")]);
        // A tenant at its limit is skipped in every band.
        let load = TenantLoad::from_slots([("a".to_string(), Priority::High, 2)]);
        assert_eq!(order(&turns, &load), vec![n("b"), n("c")]);
    }

    #[test]
    fn a_tenant_without_room_in_its_pool_is_skipped_and_pulls_no_more_than_its_room() {
        let policy = SlotPolicy::default();
        let queues = [key(Priority::Normal, "a"), key(Priority::Low, "b")];
        let turns = Turns::default();
        let pulls = |load: &TenantLoad| -> Vec<(String, u32)> {
            turns
                .pulls(&policy, 4, &queues, load)
                .into_iter()
                .map(|p| (p.queue.tenant, p.take))
                .collect()
        };
        let room = |a: u32, b: u32| {
            TenantLoad::default().with_pool_room([("a".to_string(), a), ("b".to_string(), b)])
        };
        assert_eq!(
            pulls(&TenantLoad::default()),
            vec![("a".into(), 4), ("b".into(), 4)]
        );
        assert_eq!(pulls(&room(2, 9)), vec![("a".into(), 2), ("b".into(), 4)]);
        assert_eq!(pulls(&room(0, 1)), vec![("b".into(), 1)]);
        assert_eq!(pulls(&room(0, 0)), vec![]);
    }

    #[test]
    fn a_band_is_pulled_only_while_the_free_slots_cover_its_reserve() {
        let policy = SlotPolicy {
            reserved: ReservedSlots { high: 1, normal: 1 },
            tenant_limit: TenantLimit::default(),
        };
        let queues = [
            key(Priority::High, "a"),
            key(Priority::Normal, "a"),
            key(Priority::Low, "a"),
        ];
        let turns = Turns::default();
        let bands = |free| -> Vec<(Priority, u32)> {
            turns
                .pulls(&policy, free, &queues, &TenantLoad::default())
                .into_iter()
                .map(|p| (p.queue.band, p.take))
                .collect()
        };
        assert_eq!(bands(1), vec![(Priority::High, 1)]);
        assert_eq!(bands(2), vec![(Priority::High, 2), (Priority::Normal, 1)]);
        assert_eq!(
            bands(3),
            vec![
                (Priority::High, 3),
                (Priority::Normal, 2),
                (Priority::Low, 1)
            ]
        );
    }
}
