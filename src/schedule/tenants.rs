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
