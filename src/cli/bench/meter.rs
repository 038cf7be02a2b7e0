//! What a phase cost: the CPU time of each watched process (from `/proc`), read before and
//! after the phase and divided by the requests it completed.

use super::procstat::{self, CpuSnapshot, ProcessUsage, Watched};

/// The processes a phase is measured on.
#[derive(Clone)]
pub struct Meter {
    pub watched: Vec<Watched>,
}

/// The counters at the start of a phase.
pub struct Start {
    cpu: CpuSnapshot,
}

/// What a phase cost in all, before it is divided by its requests.
pub struct Spent {
    processes: Vec<ProcessUsage>,
}

/// What a phase cost, in all and per completed request.
pub struct PhaseCost {
    pub processes: Vec<ProcessUsage>,
}

impl Meter {
    /// Reads the counters as a phase starts.
    pub async fn start(&self) -> Start {
        Start {
            cpu: procstat::snapshot(&self.watched),
        }
    }

    /// Reads the counters as the phase ends.
    pub async fn stop(&self, start: Start) -> Spent {
        Spent {
            processes: procstat::usage_since(&self.watched, &start.cpu),
        }
    }
}

impl Spent {
    /// The cost per request, for the `completed` requests of the phase.
    pub fn per_request(self, completed: u64) -> PhaseCost {
        let mut processes = self.processes;
        for process in &mut processes {
            process.cpu_us_per_request =
                (completed > 0).then(|| process.cpu_seconds * 1e6 / completed as f64);
        }
        PhaseCost { processes }
    }
}
