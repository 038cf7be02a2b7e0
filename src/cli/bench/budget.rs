//! How much load a phase generates: a number of requests, a duration, or both (whichever ends
//! first). Shared by the concurrent clients of a phase, each taking one request at a time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Budget {
    limit: Option<u64>,
    deadline: Option<Instant>,
    duration: Option<Duration>,
    started: Instant,
    taken: AtomicU64,
    done: AtomicU64,
}

impl Budget {
    /// Starts now. At least one of `requests` and `duration` should be set; with neither the
    /// budget never ends.
    pub fn new(requests: Option<u64>, duration: Option<Duration>) -> Budget {
        let started = Instant::now();
        Budget {
            limit: requests,
            deadline: duration.map(|d| started + d),
            duration,
            started,
            taken: AtomicU64::new(0),
            done: AtomicU64::new(0),
        }
    }

    /// Takes one request from the budget: its number, or `None` when the budget is spent.
    pub fn take(&self) -> Option<u64> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        let n = self.taken.fetch_add(1, Ordering::Relaxed);
        match self.limit {
            Some(limit) if n >= limit => None,
            _ => Some(n),
        }
    }

    /// Marks one request as finished (for the progress display).
    pub fn done(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }

    pub fn finished(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    pub fn duration(&self) -> Option<Duration> {
        self.duration
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_budget_hands_out_each_number_once() {
        let budget = Budget::new(Some(3), None);
        let taken: Vec<_> = std::iter::from_fn(|| budget.take()).collect();
        assert_eq!(taken, vec![0, 1, 2]);
        assert_eq!(budget.take(), None);
    }

    #[test]
    fn a_duration_budget_ends_at_its_deadline() {
        let budget = Budget::new(None, Some(Duration::ZERO));
        assert_eq!(budget.take(), None);
        let budget = Budget::new(Some(10), Some(Duration::from_secs(3600)));
        assert_eq!(budget.take(), Some(0));
    }
}
