//! What a phase cost: the CPU time of each watched process (from `/proc`) and the bus
//! operations nats-server counted (from its monitoring port, when the bench can read it), read
//! before and after the phase and divided by the requests it completed.

use std::sync::Arc;

use super::monitor::{BusOps, BusSnapshot, Monitor};
use super::procstat::{self, CpuSnapshot, ProcessUsage, Watched};

/// The processes and the server a phase is measured on.
#[derive(Clone)]
pub struct Meter {
    pub watched: Vec<Watched>,
    pub monitor: Option<Arc<Monitor>>,
}

/// The counters at the start of a phase.
pub struct Start {
    cpu: CpuSnapshot,
    bus: Option<BusSnapshot>,
}

/// What a phase cost in all, before it is divided by its requests.
pub struct Spent {
    processes: Vec<ProcessUsage>,
    bus: Option<(BusSnapshot, BusSnapshot)>,
}

/// What a phase cost, in all and per completed request.
pub struct PhaseCost {
    pub processes: Vec<ProcessUsage>,
    pub bus: Option<BusOps>,
}

impl Meter {
    /// Reads the counters as a phase starts: the server's first, once they settle (the last
    /// writes of what ran before, a warm-up's, land a little after it ended), the CPU times
    /// last, so the CPU window holds the phase alone.
    pub async fn start(&self) -> Start {
        let bus = self.read_bus(true).await;
        Start {
            cpu: procstat::snapshot(&self.watched),
            bus,
        }
    }

    /// Reads the counters as the phase ends: the CPU times at once, the server's once its
    /// counters settle.
    pub async fn stop(&self, start: Start) -> Spent {
        self.stop_reading(start, true).await
    }

    /// [`Meter::stop`] with the server's counters read at once, not once they settle: for a
    /// phase whose end is followed at once by work it must not count (a batch's results,
    /// released once it ended).
    pub async fn stop_at_once(&self, start: Start) -> Spent {
        self.stop_reading(start, false).await
    }

    async fn stop_reading(&self, start: Start, settled: bool) -> Spent {
        let processes = procstat::usage_since(&self.watched, &start.cpu);
        let bus = match start.bus {
            Some(before) => self.read_bus(settled).await.map(|after| (before, after)),
            None => None,
        };
        Spent { processes, bus }
    }

    /// The server's counters, once they settle or (`settled` false) as they are.
    async fn read_bus(&self, settled: bool) -> Option<BusSnapshot> {
        let monitor = self.monitor.as_ref()?;
        let read = if settled {
            monitor.read_settled().await
        } else {
            monitor.read().await
        };
        read.map_err(|error| {
            tracing::warn!(message = "no bus figures for this phase", error = %format!("{error:#}"));
        })
        .ok()
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
        PhaseCost {
            processes,
            bus: self
                .bus
                .map(|(before, after)| after.since(&before, completed)),
        }
    }
}
