//! Each pool's throughput and latency: the requests finished per bucket of
//! [`SERIES_BUCKET`], over the last [`SERIES_BUCKETS`].

use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::Requests;
use crate::protocol::ids::rfc3339;

/// Width of one bucket of a pool's series.
pub const SERIES_BUCKET: Duration = Duration::from_secs(10);
/// Buckets in a pool's series (5 minutes of 10 s).
pub const SERIES_BUCKETS: usize = 30;
/// Pools with a series.
const MAX_POOLS: usize = 256;

/// One bucket of a pool's series.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SeriesPoint {
    /// Requests that finished in the bucket.
    pub finished: u32,
    /// Of them, the ones that did not complete.
    pub failed: u32,
    /// Mean and highest time from acceptance to result, when any finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_latency_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_latency_ms: Option<u64>,
    #[serde(skip)]
    latency_sum: u64,
}

/// A pool's throughput and latency over the last [`SERIES_BUCKETS`] buckets, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolSeries {
    pub pool: String,
    pub points: Vec<SeriesPoint>,
}

/// The series of every pool, as the fleet view shows them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SeriesView {
    pub bucket_ms: u64,
    /// The end of the newest bucket (RFC 3339).
    pub until: String,
    pub pools: Vec<PoolSeries>,
}

fn bucket_of(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
        / SERIES_BUCKET.as_secs()
}

impl Requests {
    /// Counts one finished request in its pool's series.
    pub(super) fn count(&mut self, pool: &str, when: SystemTime, latency_ms: u64, failed: bool) {
        let bucket = bucket_of(when);
        let newest = bucket_of(SystemTime::now());
        if bucket + (SERIES_BUCKETS as u64) <= newest {
            return;
        }
        if !self.series.contains_key(pool) && self.series.len() >= MAX_POOLS {
            return;
        }
        let points = self.series.entry(pool.to_string()).or_default();
        let at = match points.iter().position(|(b, _)| *b == bucket) {
            Some(at) => at,
            None => {
                let at = points.partition_point(|(b, _)| *b < bucket);
                points.insert(at, (bucket, SeriesPoint::default()));
                at
            }
        };
        let point = &mut points[at].1;
        point.finished += 1;
        point.failed += u32::from(failed);
        point.latency_sum += latency_ms;
        point.mean_latency_ms = Some(point.latency_sum / u64::from(point.finished));
        point.max_latency_ms = Some(point.max_latency_ms.unwrap_or(0).max(latency_ms));
        while points
            .front()
            .is_some_and(|(b, _)| *b + (SERIES_BUCKETS as u64) <= newest)
        {
            points.pop_front();
        }
        self.dirty = true;
    }

    /// Every pool's series up to `now`, oldest bucket first; pools the fleet shows are there
    /// even with nothing finished.
    pub fn series(&self, now: SystemTime, pools: &[String]) -> SeriesView {
        let newest = bucket_of(now);
        let first = newest + 1 - SERIES_BUCKETS as u64;
        let mut names: std::collections::BTreeSet<&str> =
            self.series.keys().map(String::as_str).collect();
        names.extend(pools.iter().map(String::as_str));
        let pools = names
            .into_iter()
            .map(|pool| {
                let kept = self.series.get(pool);
                let points = (first..=newest)
                    .map(|b| {
                        kept.and_then(|p| p.iter().find(|(at, _)| *at == b))
                            .map(|(_, p)| *p)
                            .unwrap_or_default()
                    })
                    .collect();
                PoolSeries {
                    pool: pool.to_string(),
                    points,
                }
            })
            .collect();
        SeriesView {
            bucket_ms: SERIES_BUCKET.as_millis() as u64,
            until: rfc3339(SystemTime::UNIX_EPOCH + SERIES_BUCKET * ((newest + 1) as u32)),
            pools,
        }
    }

    /// The bucket the series end in now: the page is told when it moves on.
    pub fn series_epoch(now: SystemTime) -> u64 {
        bucket_of(now)
    }
}
