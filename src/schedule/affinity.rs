//! What a request with an affinity key says about where it was meant to run, turned into the
//! `affinity` record of its result ([`Preference`]).
//!
//! Where it goes is the fleet's rule ([`super::placement`]): whoever places it (its submitter,
//! or the worker that received it on the pool's subject) tells the worker that takes it which
//! worker was the key's and why it is not that one
//! ([`PREFERRED_WORKER_HEADER`](crate::protocol::request::PREFERRED_WORKER_HEADER),
//! [`AFFINITY_FALLBACK_HEADER`](crate::protocol::request::AFFINITY_FALLBACK_HEADER), read by the
//! bus). The worker only records what happened.

use crate::protocol::{AffinityRecord, GenerationRequest};

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
