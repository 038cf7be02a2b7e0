//! Affinity on the worker's side: what a request with an affinity key says about where it was
//! sent first, turned into the `affinity` record of its result.
//!
//! There is no central router. The submitter knows which worker served a key last (the Rust
//! client keeps a bounded map of it, learnt from replies and results) and tries that worker's
//! own submit subject first, then the pool at once; it tells the worker that takes the request
//! which worker it preferred and why it fell back ([`PREFERRED_WORKER_HEADER`],
//! [`AFFINITY_FALLBACK_HEADER`]). The worker only records what happened.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::kv;
use bytes::Bytes;

use super::store::record_key;
use crate::protocol::request::{AFFINITY_FALLBACK_HEADER, PREFERRED_WORKER_HEADER};
use crate::protocol::{AffinityRecord, ErrorCode, ErrorReply, GenerationRequest};

/// The longest worker id read from a header; a longer one is ignored.
const MAX_WORKER_ID_LEN: usize = 256;
/// The fallback reasons a submitter may give; any other is ignored.
const FALLBACKS: &[&str] = &["busy"];

/// How a request reached this worker: as the submitter told it.
#[derive(Debug, Clone, Default)]
pub(super) struct Preference {
    /// The worker the submitter preferred.
    pub(super) worker: Option<String>,
    /// Why the request is not on that worker's own subject.
    pub(super) fallback: Option<String>,
}

impl Preference {
    /// A submit on this worker's own subject: it is the preferred worker.
    pub(super) fn direct(worker_id: &str) -> Preference {
        Preference {
            worker: Some(worker_id.to_string()),
            fallback: None,
        }
    }

    /// What the submitter's headers say (headers too long or unknown are ignored: they only
    /// ever feed the result's record).
    pub(super) fn from_headers(headers: Option<&HeaderMap>) -> Preference {
        let read = |name: &str| {
            headers
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().trim().to_string())
        };
        let worker = read(PREFERRED_WORKER_HEADER).filter(|w| {
            !w.is_empty()
                && w.len() <= MAX_WORKER_ID_LEN
                && !w.chars().any(|c| c.is_control() || c.is_whitespace())
        });
        let fallback = read(AFFINITY_FALLBACK_HEADER).filter(|f| FALLBACKS.contains(&f.as_str()));
        Preference { worker, fallback }
    }

    /// The result's `affinity` record, when the request has a key: its own, or for a
    /// continuation (a place past 1 in its chain) its chain's root request id.
    pub(super) fn record(
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

/// How long the chain's previous worker has to take a continuation before the queue gets it.
const OFFER_FOR: Duration = Duration::from_secs(5);

/// What became of a continuation offered to its chain's previous worker.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Offer {
    /// That worker runs it (or already did: its id is taken).
    Taken,
    /// That worker has no free slot or is gone: the queue must have it.
    Busy,
}

/// Offers a continuation to the worker that ran the request before it in its chain, on that
/// worker's own submit subject, with the chain headers the queue would carry. It is taken there
/// only while that worker has a free slot; otherwise (or when the offer goes unanswered: its
/// record then tells) it goes to the queue as any continuation does. Never waits for a busy
/// worker.
pub(super) async fn offer_continuation(
    client: &async_nats::Client,
    results: &kv::Store,
    previous_worker: &str,
    own_subject: String,
    request_id: &str,
    mut headers: HeaderMap,
    body: Bytes,
) -> Offer {
    if previous_worker.is_empty() {
        return Offer::Busy;
    }
    headers.insert(PREFERRED_WORKER_HEADER, previous_worker);
    let offer = async_nats::Request::new()
        .headers(headers)
        .payload(body)
        .timeout(Some(OFFER_FOR));
    let reply = client.send_request(own_subject, offer).await;
    match reply {
        Ok(reply) => {
            match crate::client::reply::encoding_of(&reply).decode::<ErrorReply>(&reply.payload) {
                // Accepted: the reply is no error.
                Err(_) => Offer::Taken,
                // Its id is in use: an earlier offer of the same answer started it.
                Ok(error) if error.error.code == ErrorCode::DuplicateRequestId => Offer::Taken,
                Ok(_) => Offer::Busy,
            }
        }
        Err(error) if error.kind() == async_nats::RequestErrorKind::NoResponders => Offer::Busy,
        // No answer in time: the request's record says whether it started.
        Err(_) if on_record(results, request_id).await => Offer::Taken,
        Err(_) => Offer::Busy,
    }
}

/// Whether a request was claimed somewhere and not given back (a claim given back leaves a
/// delete marker, which is no record).
pub(super) async fn on_record(results: &kv::Store, request_id: &str) -> bool {
    matches!(
        results.entry(record_key(request_id)).await,
        Ok(Some(entry)) if entry.operation == kv::Operation::Put
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, *value);
        }
        headers
    }

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
                Preference::from_headers(Some(&headers(&[
                    (PREFERRED_WORKER_HEADER, "w2"),
                    (AFFINITY_FALLBACK_HEADER, "busy"),
                ]))),
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
                Preference::from_headers(Some(&headers(&[(AFFINITY_FALLBACK_HEADER, "odd")]))),
                &plain,
                2,
                Some(AffinityRecord {
                    key: "root-1".into(),
                    preferred_worker: None,
                    held: false,
                    fallback: None,
                }),
            ),
            // A header that is no worker id is ignored.
            (
                Preference::from_headers(Some(&headers(&[(PREFERRED_WORKER_HEADER, "a b")]))),
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
