//! Latency samples and their percentiles. Samples are kept whole and sorted once at the end:
//! a run holds at most a few hundred thousand, so exact percentiles cost less than a
//! histogram dependency would.

use std::time::Duration;

use serde::Serialize;

/// Latencies of one kind (e.g. submit→result) gathered over a phase.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    micros: Vec<u64>,
}

impl Samples {
    pub fn push(&mut self, latency: Duration) {
        self.micros
            .push(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
    }

    pub fn extend(&mut self, other: Samples) {
        self.micros.extend(other.micros);
    }

    pub fn len(&self) -> usize {
        self.micros.len()
    }

    /// p50, p90, p99 and max in milliseconds (nearest-rank), or `None` without samples.
    pub fn summary(&self) -> Option<Summary> {
        if self.micros.is_empty() {
            return None;
        }
        let mut sorted = self.micros.clone();
        sorted.sort_unstable();
        let rank = |p: f64| {
            // Nearest rank: the smallest sample with at least p of them at or below it.
            let index = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
            ms(sorted[index])
        };
        let total: u64 = sorted.iter().sum();
        Some(Summary {
            count: sorted.len(),
            mean: ms(total / sorted.len() as u64),
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: ms(*sorted.last().expect("not empty")),
        })
    }
}

fn ms(micros: u64) -> f64 {
    micros as f64 / 1000.0
}

/// Percentiles of a set of latencies, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(micros: &[u64], expected: (f64, f64, f64, f64)) {
        let mut samples = Samples::default();
        for m in micros {
            samples.push(Duration::from_micros(*m));
        }
        let s = samples.summary().expect("samples");
        assert_eq!((s.p50, s.p90, s.p99, s.max), expected, "{micros:?}");
    }

    #[test]
    fn nearest_rank_percentiles() {
        check(&[5000], (5.0, 5.0, 5.0, 5.0));
        check(&[1000, 2000], (1.0, 2.0, 2.0, 2.0));
        let hundred: Vec<u64> = (1..=100).rev().map(|i| i * 1000).collect();
        check(&hundred, (50.0, 90.0, 99.0, 100.0));
    }

    #[test]
    fn no_samples_no_summary() {
        assert_eq!(Samples::default().summary(), None);
    }
}
