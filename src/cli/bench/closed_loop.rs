//! A phase's closed loop: each of its clients sends a request, waits for its answer and sends
//! the next, until the budget is spent. Each answer is timed, and the phase's cost read around
//! the whole loop.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use super::budget::Budget;
use super::latency::Samples;
use super::meter::{Meter, Spent};
use super::progress::Progress;

/// What a closed loop measured.
pub struct Looped<E> {
    /// The time of each call that succeeded.
    pub samples: Samples,
    /// What each call that failed said.
    pub errors: Vec<E>,
    /// How long the loop ran, in seconds (never 0).
    pub secs: f64,
    pub spent: Spent,
}

/// `concurrency` clients calling `call(client)` in a loop until `budget` is spent, under a
/// progress bar named `label`.
pub async fn run<F, Fut, E>(
    label: &str,
    concurrency: usize,
    budget: Budget,
    meter: &Meter,
    call: F,
) -> Looped<E>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    let budget = Arc::new(budget);
    let progress = Progress::start(label, budget.clone());
    let start = meter.start().await;
    let started = Instant::now();
    let clients = (0..concurrency).map(|client| {
        let budget = budget.clone();
        let call = &call;
        async move {
            let mut samples = Samples::default();
            let mut errors = Vec::new();
            while budget.take().is_some() {
                let at = Instant::now();
                match call(client).await {
                    Ok(()) => samples.push(at.elapsed()),
                    Err(error) => errors.push(error),
                }
                budget.done();
            }
            (samples, errors)
        }
    });
    let results = futures_util::future::join_all(clients).await;
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let spent = meter.stop(start).await;
    progress.finish();
    let mut samples = Samples::default();
    let mut errors = Vec::new();
    for (s, e) in results {
        samples.extend(s);
        errors.extend(e);
    }
    Looped {
        samples,
        errors,
        secs,
        spent,
    }
}
