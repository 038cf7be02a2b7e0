//! Affinity on the bus: the submitter's headers read (what they mean for the result's record is
//! decided in [`crate::schedule::Preference`]), and a continuation offered to the worker that
//! ran its chain before.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::kv;
use bytes::Bytes;

use super::store::record_key;
use crate::protocol::request::{AFFINITY_FALLBACK_HEADER, PREFERRED_WORKER_HEADER};
use crate::protocol::{ErrorCode, ErrorReply};
use crate::schedule::Preference;

/// How a request reached this worker, as its submitter's headers tell it (see
/// [`crate::schedule::Preference`]).
pub(super) fn preference_of(headers: Option<&HeaderMap>) -> Preference {
    let read = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.as_str());
    Preference::told(
        read(PREFERRED_WORKER_HEADER),
        read(AFFINITY_FALLBACK_HEADER),
    )
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

/// Offers a continuation to `worker` (its key's worker, or the one that ran the request before
/// it in its chain), on that worker's own submit subject, with the chain headers the queue
/// would carry. It is taken there only while that worker has a free slot; otherwise (or when the offer goes unanswered: its
/// record then tells) it goes to the queue as any continuation does. Never waits for a busy
/// worker.
pub(super) async fn offer_continuation(
    client: &async_nats::Client,
    results: &kv::Store,
    worker: &str,
    own_subject: String,
    request_id: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Offer {
    if worker.is_empty() {
        return Offer::Busy;
    }
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

    #[test]
    fn the_submitters_headers_are_read() {
        let mut headers = HeaderMap::new();
        headers.insert(PREFERRED_WORKER_HEADER, " w2 ");
        headers.insert(AFFINITY_FALLBACK_HEADER, "busy");
        let told = preference_of(Some(&headers));
        assert_eq!(
            (told.worker.as_deref(), told.fallback.as_deref()),
            (Some("w2"), Some("busy"))
        );
        let none = preference_of(None);
        assert_eq!((none.worker, none.fallback), (None, None));
    }
}
