//! What runs on a worker, by tenant and band, and the per-tenant limit read against it.

use std::collections::HashMap;

use crate::protocol::{DEFAULT_TENANT, Priority};

/// The tenant and band of each taken slot, by request id, from the slot's start until its
/// release (so at most `slots` entries). The Supervisor keeps it; what it says goes to the
/// bus as the slots each tenant holds ([`Slots::by_tenant_and_band`]).
#[derive(Debug, Default)]
pub struct Slots(HashMap<String, (String, Priority)>);

impl Slots {
    /// A slot is taken by a request of `tenant` (`None`: the default tenant) in `band`.
    pub fn take(&mut self, request_id: &str, tenant: Option<&str>, band: Priority) {
        self.0.insert(
            request_id.to_string(),
            (tenant_name(tenant).to_string(), band),
        );
    }

    /// The request's slot is free.
    pub fn free(&mut self, request_id: &str) {
        self.0.remove(request_id);
    }

    /// The slots a tenant holds.
    pub fn of(&self, tenant: Option<&str>) -> u32 {
        let tenant = tenant_name(tenant);
        self.0.values().filter(|(t, _)| t == tenant).count() as u32
    }

    /// The slots each tenant holds, by band (those holding none are left out).
    pub fn by_tenant_and_band(&self) -> Vec<(String, Priority, u32)> {
        let mut counts: HashMap<(&str, Priority), u32> = HashMap::new();
        for (tenant, band) in self.0.values() {
            *counts.entry((tenant.as_str(), *band)).or_default() += 1;
        }
        counts
            .into_iter()
            .map(|((tenant, band), n)| (tenant.to_string(), band, n))
            .collect()
    }
}

/// The slots each tenant holds on a worker, over its bands, and how many more of a tenant's
/// requests its pool may start where `worker.tenants.pool_max_running` is set: what the fair
/// share and the limits of the durable queue's choice are read against.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantLoad {
    running: HashMap<String, u32>,
    pool_room: HashMap<String, u32>,
}

impl TenantLoad {
    /// From the slots each tenant holds by band ([`Slots::by_tenant_and_band`]).
    pub fn from_slots(slots: impl IntoIterator<Item = (String, Priority, u32)>) -> TenantLoad {
        let mut running: HashMap<String, u32> = HashMap::new();
        for (tenant, _, n) in slots {
            *running.entry(tenant).or_default() += n;
        }
        TenantLoad {
            running,
            pool_room: HashMap::new(),
        }
    }

    /// With how many more requests of each tenant the pool may start (tenants left out: as
    /// many as the slots take).
    pub fn with_pool_room(mut self, room: impl IntoIterator<Item = (String, u32)>) -> TenantLoad {
        self.pool_room.extend(room);
        self
    }

    /// The slots each tenant holds.
    pub fn running(&self) -> &HashMap<String, u32> {
        &self.running
    }

    /// The slots `tenant` holds.
    pub fn of(&self, tenant: &str) -> u32 {
        self.running.get(tenant).copied().unwrap_or(0)
    }

    /// How many more of `tenant`'s requests the pool may start (`None`: no pool limit known).
    pub fn pool_room(&self, tenant: &str) -> Option<u32> {
        self.pool_room.get(tenant).copied()
    }
}

/// Running requests of one tenant on a worker at most (`worker.tenants.max_running`; 0: no
/// limit). A tenant at its limit is refused an interactive slot, waits in the Supervisor, or
/// has its queues skipped: its messages stay on the queue, for this worker later or for
/// another.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantLimit(pub u32);

impl TenantLimit {
    /// Whether a tenant holding `running` slots may start no more.
    pub fn reached(self, running: u32) -> bool {
        self.0 > 0 && running >= self.0
    }
}

/// Fair-share preemption (`worker.preempt_fair_share`): the tenant that gives a slot up to a
/// request of `tenant` finding every one of a worker's `slots` busy, if any. `counts` holds
/// what each tenant has there: its running requests that are not leaving already, and for
/// `tenant` its requests waiting for a slot too.
///
/// A worker's fair share is an equal part of its slots for each tenant that has work there
/// (the ones in `counts`, and `tenant`). `tenant` takes a slot only while it has less than
/// its part (rounded down: where there are more tenants than slots, nobody takes), from the
/// tenant that has the most (the first by name among equals), and only when that one has
/// more than its part (rounded up) and at least two more than `tenant`: the move leaves it
/// no poorer than the taker, so a slot never goes back and forth.
pub fn over_share(slots: u32, counts: &HashMap<String, u32>, tenant: &str) -> Option<String> {
    let mine = counts.get(tenant).copied().unwrap_or(0);
    let tenants = counts.len() as u32 + u32::from(!counts.contains_key(tenant));
    if tenants < 2 || mine >= slots / tenants {
        return None;
    }
    let (richest, most) = counts
        .iter()
        .filter(|(name, _)| name.as_str() != tenant)
        .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))?;
    (*most > slots.div_ceil(tenants) && *most >= mine + 2).then(|| richest.clone())
}

/// The name of a tenant (`None`: the default tenant).
pub fn tenant_name(tenant: Option<&str>) -> &str {
    tenant.unwrap_or(DEFAULT_TENANT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_counted_per_tenant_and_band_until_freed() {
        let mut slots = Slots::default();
        slots.take("a", None, Priority::High);
        slots.take("b", Some("acme"), Priority::Normal);
        slots.take("c", Some("acme"), Priority::Low);
        assert_eq!(slots.of(Some(DEFAULT_TENANT)), 1);
        assert_eq!(slots.of(Some("acme")), 2);
        let load = TenantLoad::from_slots(slots.by_tenant_and_band());
        assert_eq!(
            (load.of("acme"), load.of(DEFAULT_TENANT), load.of("x")),
            (2, 1, 0)
        );
        slots.free("b");
        assert_eq!(slots.of(Some("acme")), 1);
    }

    #[test]
    fn a_tenant_under_its_share_takes_a_slot_from_the_one_far_over_it_until_both_hold_theirs() {
        // (slots, what each tenant has, the taker, who gives a slot up)
        type Case<'a> = (u32, &'a [(&'a str, u32)], &'a str, Option<&'a str>);
        let cases: &[Case] = &[
            // Alone on the worker, or asking for itself: nobody to take from.
            (4, &[("flood", 4)], "flood", None),
            (4, &[("flood", 1)], "flood", None),
            // Four slots, two tenants: a part of two each, reached one slot at a time.
            (4, &[("flood", 4)], "light", Some("flood")),
            (4, &[("light", 0), ("flood", 4)], "light", Some("flood")),
            (4, &[("light", 1), ("flood", 3)], "light", Some("flood")),
            (4, &[("light", 2), ("flood", 2)], "light", None),
            // Holding its part already (its waiting requests count).
            (8, &[("light", 4), ("flood", 4)], "light", None),
            // Over its part, but only one more than the taker would have: no back and forth.
            (3, &[("light", 1), ("flood", 2)], "light", None),
            // More tenants than slots: no part to claim.
            (2, &[("a", 1), ("b", 1)], "c", None),
            // The one with the most gives, the first by name among equals.
            (9, &[("a", 4), ("b", 4), ("c", 1)], "c", Some("a")),
            (9, &[("a", 2), ("b", 6), ("c", 1)], "c", Some("b")),
        ];
        for (slots, pairs, taker, expected) in cases {
            let counts: HashMap<String, u32> =
                pairs.iter().map(|(t, n)| (t.to_string(), *n)).collect();
            assert_eq!(
                over_share(*slots, &counts, taker).as_deref(),
                *expected,
                "{slots} slots, {pairs:?}, for {taker}"
            );
        }
    }

    #[test]
    fn a_limit_of_zero_is_none() {
        let cases = [
            (0, 0, false),
            (0, 99, false),
            (2, 1, false),
            (2, 2, true),
            (2, 3, true),
        ];
        for (limit, running, reached) in cases {
            assert_eq!(
                TenantLimit(limit).reached(running),
                reached,
                "{limit} {running}"
            );
        }
    }
}
