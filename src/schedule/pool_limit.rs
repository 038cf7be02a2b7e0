//! The pool-wide limit on a tenant's running requests (`worker.tenants.pool_max_running`), read
//! against the count the pool's workers keep of that tenant ([`TenantRunning`]): whether a
//! worker may start one more, what it writes when it does, and how many more the pool may
//! start. Pure: which workers are live, and the compare-and-set that makes each write exact,
//! are the bus's (`bus::tenant_limit`).
//!
//! Each worker writes only its own count, and only what is true of itself: the requests of the
//! tenant it holds, plus the one it is about to start. The sum is read over the workers that
//! are live (their heartbeat is in the bucket); one that is not is left out of the sum and
//! dropped from the entry by the next write, so the count of a worker that died never holds
//! its tenant back. Since every write is a compare-and-set on the revision the sum was read
//! at, two workers never both take the last place: one of them reads again and finds none.

use crate::protocol::schedule::TenantRunning;

/// Running requests of one tenant across a pool at most (0: no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolLimit(pub u32);

/// What a worker may do about more requests of a tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolAdmission {
    /// Within the limit: write `next` (its own count `granted` higher, workers not live
    /// dropped), and start that many requests once the write lands.
    Admit { next: TenantRunning, granted: u32 },
    /// The live workers already run `running` of the tenant's requests, the limit or more.
    AtLimit { running: u32 },
}

impl PoolLimit {
    pub fn is_set(self) -> bool {
        self.0 > 0
    }

    /// How many of `wanted` more requests `worker`, holding `held` of the tenant's, may
    /// start (as many as the limit leaves, at least one), read against `entry` with `live`
    /// saying which other workers are live.
    pub fn admit(
        self,
        entry: &TenantRunning,
        worker: &str,
        held: u32,
        wanted: u32,
        live: impl Fn(&str) -> bool,
    ) -> PoolAdmission {
        let mut next = with_own_count(entry, worker, held, live);
        let running = total_running(&next);
        let room = if self.is_set() {
            self.0.saturating_sub(running)
        } else {
            u32::MAX
        };
        let granted = wanted.max(1).min(room);
        if granted == 0 {
            return PoolAdmission::AtLimit { running };
        }
        next.running
            .insert(worker.to_string(), held.saturating_add(granted));
        PoolAdmission::Admit { next, granted }
    }

    /// How many more of the tenant's requests the pool may start, as `entry` tells it
    /// (`None`: no limit).
    pub fn room(
        self,
        entry: &TenantRunning,
        worker: &str,
        held: u32,
        live: impl Fn(&str) -> bool,
    ) -> Option<u32> {
        self.is_set().then(|| {
            self.0
                .saturating_sub(total_running(&with_own_count(entry, worker, held, live)))
        })
    }
}

/// The entry as `worker` writes it when it holds `held` of the tenant's requests: its own
/// count set to that, and the workers that are not live (or run none) left out. A release, or
/// a worker putting its count back after the fleet dropped it, writes this whatever the sum.
pub fn with_own_count(
    entry: &TenantRunning,
    worker: &str,
    held: u32,
    live: impl Fn(&str) -> bool,
) -> TenantRunning {
    let mut running: std::collections::BTreeMap<String, u32> = entry
        .running
        .iter()
        .filter(|(id, n)| **n > 0 && id.as_str() != worker && live(id))
        .map(|(id, n)| (id.clone(), *n))
        .collect();
    if held > 0 {
        running.insert(worker.to_string(), held);
    }
    TenantRunning { running }
}

/// The tenant's running requests over every worker the entry lists.
pub fn total_running(entry: &TenantRunning) -> u32 {
    entry
        .running
        .values()
        .fold(0u32, |sum, n| sum.saturating_add(*n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(counts: &[(&str, u32)]) -> TenantRunning {
        TenantRunning {
            running: counts.iter().map(|(w, n)| (w.to_string(), *n)).collect(),
        }
    }

    /// One case: limit, the entry read, the writer's own count, how many it wants, the
    /// workers that are not live; what it may do.
    fn check(
        limit: u32,
        read: &[(&str, u32)],
        (held, wanted): (u32, u32),
        gone: &[&str],
        expected: PoolAdmission,
    ) {
        let live = |id: &str| !gone.contains(&id);
        assert_eq!(
            PoolLimit(limit).admit(&entry(read), "me", held, wanted, live),
            expected,
            "limit {limit}, read {read:?}, held {held}, wanted {wanted}, gone {gone:?}"
        );
    }

    fn admit(counts: &[(&str, u32)], granted: u32) -> PoolAdmission {
        PoolAdmission::Admit {
            next: entry(counts),
            granted,
        }
    }

    #[test]
    fn places_are_granted_only_while_the_live_sum_stays_within_the_limit() {
        use PoolAdmission::AtLimit;
        // An absent entry, the first request.
        check(2, &[], (0, 1), &[], admit(&[("me", 1)], 1));
        check(
            2,
            &[("a", 1)],
            (0, 1),
            &[],
            admit(&[("a", 1), ("me", 1)], 1),
        );
        check(
            2,
            &[("a", 1), ("me", 1)],
            (1, 1),
            &[],
            AtLimit { running: 2 },
        );
        check(
            3,
            &[("a", 2), ("b", 1)],
            (0, 1),
            &[],
            AtLimit { running: 3 },
        );
        // As many as the limit leaves, never more, and always at least one asked for.
        check(
            5,
            &[("a", 2)],
            (1, 4),
            &[],
            admit(&[("a", 2), ("me", 3)], 2),
        );
        check(
            5,
            &[("a", 2)],
            (0, 0),
            &[],
            admit(&[("a", 2), ("me", 1)], 1),
        );
        // A worker that is not live is not summed, and the write drops it.
        check(2, &[("a", 2)], (0, 1), &["a"], admit(&[("me", 1)], 1));
        check(
            3,
            &[("a", 2), ("b", 5)],
            (0, 1),
            &["b"],
            admit(&[("a", 2), ("me", 1)], 1),
        );
        // The writer's own count is what it holds, whatever the entry says: a release not
        // written yet, or a count of an earlier run under the same id.
        check(2, &[("me", 2)], (0, 1), &[], admit(&[("me", 1)], 1));
        check(2, &[("me", 0)], (1, 1), &[], admit(&[("me", 2)], 1));
        // Its own count is never taken for a dead worker's.
        check(1, &[("me", 1)], (1, 1), &["me"], AtLimit { running: 1 });
        // Workers running none are left out of the write.
        check(
            4,
            &[("a", 0), ("b", 1)],
            (0, 1),
            &[],
            admit(&[("b", 1), ("me", 1)], 1),
        );
        // No limit: all of them.
        check(
            0,
            &[("a", 9)],
            (3, 2),
            &[],
            admit(&[("a", 9), ("me", 5)], 2),
        );
    }

    #[test]
    fn room_is_the_limit_less_the_live_sum() {
        let read = entry(&[("a", 2), ("b", 1), ("me", 3)]);
        let all = |_: &str| true;
        assert_eq!(PoolLimit(0).room(&read, "me", 0, all), None);
        assert_eq!(PoolLimit(5).room(&read, "me", 0, all), Some(2));
        assert_eq!(PoolLimit(5).room(&read, "me", 1, all), Some(1));
        assert_eq!(PoolLimit(5).room(&read, "me", 1, |id| id != "a"), Some(3));
        assert_eq!(PoolLimit(2).room(&read, "me", 3, all), Some(0));
    }

    #[test]
    fn a_release_or_a_count_put_back_is_written_whatever_the_sum() {
        let read = entry(&[("a", 4), ("gone", 1)]);
        let live = |id: &str| id != "gone";
        assert_eq!(
            with_own_count(&read, "me", 2, live),
            entry(&[("a", 4), ("me", 2)])
        );
        assert_eq!(with_own_count(&read, "a", 0, live), entry(&[]));
        assert_eq!(
            total_running(&entry(&[("a", u32::MAX), ("b", 1)])),
            u32::MAX
        );
    }
}
