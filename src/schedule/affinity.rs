//! Placement by affinity: on the submitter's side, which worker served each key last
//! ([`LastWorkers`]); on the worker's side, what a request with an affinity key says about where
//! it was sent first, turned into the `affinity` record of its result ([`Preference`]).
//!
//! There is no central router. The submitter knows which worker served a key last (the Rust
//! client keeps a bounded map of it, learnt from replies and results) and tries that worker's
//! own submit subject first, then the pool at once; it tells the worker that takes the request
//! which worker it preferred and why it fell back
//! ([`PREFERRED_WORKER_HEADER`](crate::protocol::request::PREFERRED_WORKER_HEADER),
//! [`AFFINITY_FALLBACK_HEADER`](crate::protocol::request::AFFINITY_FALLBACK_HEADER), read by the
//! bus). The worker only records what happened.

use std::sync::Mutex;

use crate::protocol::lru::BoundedLru;
use crate::protocol::{AffinityRecord, GenerationRequest};

/// Affinity keys whose last worker a client remembers, the least recently used forgotten first.
pub const AFFINITY_KEYS_KEPT: usize = 10_000;

/// On the submitter's side: which worker served each affinity key last, learnt from submit
/// replies and results, bounded ([`AFFINITY_KEYS_KEPT`]). Shared by the clones of a client.
#[derive(Debug)]
pub struct LastWorkers {
    keys: Mutex<BoundedLru<String, String>>,
}

impl Default for LastWorkers {
    fn default() -> Self {
        LastWorkers {
            keys: Mutex::new(BoundedLru::new(AFFINITY_KEYS_KEPT)),
        }
    }
}

impl LastWorkers {
    /// The worker that served `key` last, as far as this submitter knows.
    pub fn of(&self, key: &str) -> Option<String> {
        self.lock().get(&key.to_string()).cloned()
    }

    /// Notes that `worker_id` served `key`.
    pub fn learn(&self, key: &str, worker_id: &str) {
        if !worker_id.is_empty() {
            self.lock().insert(key.to_string(), worker_id.to_string());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BoundedLru<String, String>> {
        // The map is only ever changed whole under the lock; a panic cannot leave it torn.
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The longest worker id a submitter may name; a longer one is ignored.
const MAX_WORKER_ID_LEN: usize = 256;
/// The fallback reasons a submitter may give; any other is ignored.
const FALLBACKS: &[&str] = &["busy", "load"];

/// How a request reached this worker: as the submitter told it.
#[derive(Debug, Clone, Default)]
pub struct Preference {
    /// The worker the submitter preferred.
    pub worker: Option<String>,
    /// Why the request is not on that worker's own subject.
    pub fallback: Option<String>,
}

impl Preference {
    /// A submit on this worker's own subject: it is the preferred worker.
    pub fn direct(worker_id: &str) -> Preference {
        Preference {
            worker: Some(worker_id.to_string()),
            fallback: None,
        }
    }

    /// What the submitter told: a worker id too long or not one, or an unknown reason, is
    /// ignored (they only ever feed the result's record).
    pub fn told(worker: Option<&str>, fallback: Option<&str>) -> Preference {
        let worker = worker.map(str::trim).filter(|w| {
            !w.is_empty()
                && w.len() <= MAX_WORKER_ID_LEN
                && !w.chars().any(|c| c.is_control() || c.is_whitespace())
        });
        let fallback = fallback.map(str::trim).filter(|f| FALLBACKS.contains(f));
        Preference {
            worker: worker.map(str::to_string),
            fallback: fallback.map(str::to_string),
        }
    }

    /// The result's `affinity` record, when the request has a key: its own, or for a
    /// continuation (a place past 1 in its chain) its chain's root request id.
    pub fn record(
        &self,
        request: &GenerationRequest,
        root_request_id: &str,
        chain_position: u32,
        worker_id: &str,
    ) -> Option<AffinityRecord> {
        let key = request
            .affinity_key
            .clone()
            .or_else(|| (chain_position > 1).then(|| root_request_id.to_string()))?;
        let held = self.worker.as_deref() == Some(worker_id);
        Some(AffinityRecord {
            key,
            preferred_worker: self.worker.clone(),
            held,
            fallback: if held { None } else { self.fallback.clone() },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_says_where_a_keyed_request_ran() {
        let keyed = GenerationRequest {
            affinity_key: Some("chat-1".into()),
            ..GenerationRequest::user("hi")
        };
        let plain = GenerationRequest::user("hi");
        let cases: Vec<(Preference, &GenerationRequest, u32, Option<AffinityRecord>)> = vec![
            // No key, not a continuation: no record.
            (Preference::direct("w1"), &plain, 1, None),
            // On its own subject: held.
            (
                Preference::direct("w1"),
                &keyed,
                1,
                Some(AffinityRecord {
                    key: "chat-1".into(),
                    preferred_worker: Some("w1".into()),
                    held: true,
                    fallback: None,
                }),
            ),
            // Sent to the pool after the preferred worker refused: not held, busy.
            (
                Preference::told(Some("w2"), Some("busy")),
                &keyed,
                1,
                Some(AffinityRecord {
                    key: "chat-1".into(),
                    preferred_worker: Some("w2".into()),
                    held: false,
                    fallback: Some("busy".into()),
                }),
            ),
            // A continuation without a key follows its root; nothing known, nothing preferred.
            (
                Preference::told(None, Some("odd")),
                &plain,
                2,
                Some(AffinityRecord {
                    key: "root-1".into(),
                    preferred_worker: None,
                    held: false,
                    fallback: None,
                }),
            ),
            // A name that is no worker id is ignored.
            (
                Preference::told(Some("a b"), None),
                &keyed,
                1,
                Some(AffinityRecord {
                    key: "chat-1".into(),
                    preferred_worker: None,
                    held: false,
                    fallback: None,
                }),
            ),
        ];
        for (preference, request, position, expected) in cases {
            assert_eq!(
                preference.record(request, "root-1", position, "w1"),
                expected,
                "{preference:?}"
            );
        }
    }
}
