//! The worker's writes of a request's record in the results bucket (the record itself, and the
//! streams and buckets, are the client room's: `client::records`, `client::streams`).
//!
//! The request path costs two JetStream writes and no read:
//!
//! 1. the claim creates `res.<request_id>` (create-if-absent) holding the live record: which
//!    worker runs it, which attempt. An id in use anywhere in the fleet (running, or with a
//!    result or its tombstone) is refused by the create itself, with nothing to look up.
//! 2. the end replaces the live record by the terminal result, compare-and-set on the revision
//!    the claim returned. Nothing is left to purge.
//!
//! Reading the result replaces it by a small tombstone with the request's summary
//! (compare-and-set again: of concurrent readers one gets it), which stays until the bucket's
//! TTL so that a redelivered queue message does not run the request again.

use async_nats::jetstream::kv;

pub use crate::client::records::{GIVEN_BACK, LiveRecord, RequestRecord, Versioned, record_key};
pub use crate::client::streams::{Stores, ensure_bucket};
use crate::protocol::{ErrorCode, FinishedSummary, GenerationResult, RequestState, WireError};

/// A request's record could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot read the record of request {request_id}: {source}")]
    Read {
        request_id: String,
        source: kv::EntryError,
    },
    #[error("cannot write the record of request {request_id}: {reason}")]
    Write { request_id: String, reason: String },
    #[error("the record of request {request_id} kept changing under {tries} writes")]
    Contended { request_id: String, tries: u32 },
}

impl From<StoreError> for WireError {
    fn from(error: StoreError) -> WireError {
        WireError::new(ErrorCode::Internal, error.to_string())
    }
}

/// A request id could not be claimed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("request id {0} is already in use (running, queued or with a stored result)")]
    InUse(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<ClaimError> for WireError {
    fn from(error: ClaimError) -> WireError {
        match error {
            ClaimError::InUse(_) => {
                WireError::new(ErrorCode::DuplicateRequestId, error.to_string())
            }
            ClaimError::Store(error) => error.into(),
        }
    }
}

/// How a durable request's claim went.
#[derive(Debug, PartialEq, Eq)]
pub enum DurableClaim {
    /// On record as running here, at this revision.
    Claimed(u64),
    /// It already ended (result or tombstone): it must not run again.
    Ended,
    /// Its live record names this worker: a redelivery of a request that may be running here.
    OnRecordHere(u64),
    /// Another worker holds it from this very message (a redelivery): it may be taken over,
    /// at this revision, only once that worker is found lost.
    HeldBy { worker_id: String, revision: u64 },
    /// Another request holds the id: an interactive one, or a durable one claimed from
    /// another queue message. This message is a duplicate and must never run.
    Duplicate,
}

/// What a result may replace in the request's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// The live record this runner claimed (or last rewrote) at this revision, while it
    /// still names the result's worker; a record that names another (it took the request
    /// over) fences this runner off.
    Claim(u64),
    /// A durable request's live record whose claim came from this queue message (stream
    /// sequence), or nothing: for results stored on the message's behalf (refused,
    /// cancelled while queued, deliveries exhausted), which never replace another request's
    /// record.
    Message(u64),
    /// Nothing: the result is stored only where no record exists.
    Nothing,
}

/// How storing a result went.
#[derive(Debug, PartialEq, Eq)]
pub enum Stored {
    Stored,
    /// Another runner of the same request stored first; its result stands.
    AlreadyStored,
    /// The record belongs to another runner or another request (this runner was taken over,
    /// or the id is another request's): nothing was written.
    Fenced,
}

/// Compare-and-set writes tried before a record that keeps changing is given up.
const CONTENDED_TRIES: u32 = 8;

impl Stores {
    /// Claims a request id fleet-wide for a new interactive request: one create-if-absent of
    /// its record. Returns the revision to end it with.
    pub async fn claim(&self, live: &LiveRecord) -> Result<u64, ClaimError> {
        let record = RequestRecord::Live { live: live.clone() };
        match self
            .results
            .create(record_key(&live.request_id), record.encode())
            .await
        {
            Ok(revision) => Ok(revision),
            Err(error) if error.kind() == kv::CreateErrorKind::AlreadyExists => {
                Err(ClaimError::InUse(live.request_id.clone()))
            }
            Err(error) => Err(write_error(&live.request_id, error).into()),
        }
    }

    /// Claims a durable request taken from the queue (`live.queue_seq` names its message). A
    /// first delivery costs one create; a redelivery finds the record of the run before it:
    /// it takes over a record its message gave back, leaves a request that already ended, and
    /// says who holds it otherwise. A message whose id another request holds is a duplicate.
    pub async fn claim_durable(&self, live: &LiveRecord) -> Result<DurableClaim, StoreError> {
        let record = RequestRecord::Live { live: live.clone() };
        self.write_until(
            &live.request_id,
            record.encode(),
            Write::Create,
            |found| match found {
                None => Next::Write(Write::Create),
                Some((RequestRecord::Live { live: held }, revision)) => {
                    if !same_message(&held, live) {
                        Next::Answer(DurableClaim::Duplicate)
                    } else if held.worker_id == live.worker_id {
                        Next::Answer(DurableClaim::OnRecordHere(revision))
                    } else if held.worker_id == GIVEN_BACK {
                        Next::Write(Write::Update(revision))
                    } else {
                        Next::Answer(DurableClaim::HeldBy {
                            worker_id: held.worker_id,
                            revision,
                        })
                    }
                }
                Some(_) => Next::Answer(DurableClaim::Ended),
            },
            DurableClaim::Claimed,
        )
        .await
    }

    /// Takes a durable request over from a lost worker: its record is replaced if it is still
    /// at `revision` (another taker may have been first: then `None`).
    pub async fn take_over(
        &self,
        live: &LiveRecord,
        revision: u64,
    ) -> Result<Option<u64>, StoreError> {
        let record = RequestRecord::Live { live: live.clone() };
        match self
            .write(&live.request_id, record.encode(), Write::Update(revision))
            .await
        {
            Ok(revision) => Ok(Some(revision)),
            Err(Conflict::Changed) => Ok(None),
            Err(Conflict::Other(reason)) => Err(StoreError::Write {
                request_id: live.request_id.clone(),
                reason,
            }),
        }
    }

    /// Rewrites a running request's live record (its state changed, or to keep it within the
    /// bucket's TTL). `None` when the request ended meanwhile (its result stands).
    pub async fn set_live(
        &self,
        live: &LiveRecord,
        revision: u64,
    ) -> Result<Option<u64>, StoreError> {
        let record = RequestRecord::Live { live: live.clone() };
        self.write_until(
            &live.request_id,
            record.encode(),
            Write::Update(revision),
            |found| match found {
                Some((RequestRecord::Live { live: held }, now))
                    if held.worker_id == live.worker_id =>
                {
                    Next::Write(Write::Update(now))
                }
                _ => Next::Answer(None),
            },
            Some,
        )
        .await
    }

    /// Gives a claim back (the request was refused after all), if the record is still the
    /// claim's.
    pub async fn unclaim(&self, request_id: &str, revision: u64) {
        if let Err(error) = self
            .results
            .delete_expect_revision(record_key(request_id), Some(revision))
            .await
        {
            tracing::debug!(message = "a claim was not given back", %error, request_id = %request_id);
        }
    }

    /// Stores a terminal result in place of what `over` says it may replace (see [`Over`]):
    /// the first result stored wins, and a result already stored stands. A runner whose
    /// record names another worker now was taken over: it is fenced off and writes nothing.
    pub async fn store_result(
        &self,
        result: &GenerationResult,
        over: Over,
    ) -> Result<Stored, StoreError> {
        let body = RequestRecord::Result(Box::new(result.clone())).encode();
        let first = match over {
            Over::Claim(revision) => Write::Update(revision),
            Over::Message(_) | Over::Nothing => Write::Create,
        };
        self.write_until(
            &result.request_id,
            body,
            first,
            |found| match found {
                None => Next::Write(Write::Create),
                Some((RequestRecord::Live { live }, revision)) => {
                    let ours = match over {
                        Over::Claim(_) => live.worker_id == result.worker_id,
                        // A record without the sequence is an older worker's: taken as
                        // the message's.
                        Over::Message(seq) => {
                            live.durable && live.queue_seq.is_none_or(|claimed| claimed == seq)
                        }
                        Over::Nothing => false,
                    };
                    if ours {
                        Next::Write(Write::Update(revision))
                    } else {
                        Next::Answer(Stored::Fenced)
                    }
                }
                Some(_) => Next::Answer(Stored::AlreadyStored),
            },
            |_| Stored::Stored,
        )
        .await
    }

    /// Gives a durable request's record back to the queue (its message is handed back for
    /// another worker): the next delivery of the same message takes it over at once, whoever
    /// takes it. Only while the record is still this runner's (`revision`).
    pub async fn give_back(&self, live: &LiveRecord, revision: u64) -> Result<bool, StoreError> {
        let given = LiveRecord {
            state: RequestState::Queued,
            worker_id: GIVEN_BACK.to_string(),
            ..live.clone()
        };
        let record = RequestRecord::Live { live: given };
        match self
            .write(&live.request_id, record.encode(), Write::Update(revision))
            .await
        {
            Ok(_) => Ok(true),
            Err(Conflict::Changed) => Ok(false),
            Err(Conflict::Other(reason)) => Err(StoreError::Write {
                request_id: live.request_id.clone(),
                reason,
            }),
        }
    }

    /// Writes a request's record, compare-and-set, until a write lands (`landed` makes the
    /// answer from its revision) or `next` answers instead: after each write that finds the
    /// record changed, the record is read again and `next` says what to write now, or what
    /// to answer. Bounded by [`CONTENDED_TRIES`].
    async fn write_until<T>(
        &self,
        request_id: &str,
        body: bytes::Bytes,
        first: Write,
        next: impl Fn(Option<(RequestRecord, u64)>) -> Next<T>,
        landed: impl Fn(u64) -> T,
    ) -> Result<T, StoreError> {
        let mut write = first;
        for _ in 0..CONTENDED_TRIES {
            match self.write(request_id, body.clone(), write).await {
                Ok(revision) => return Ok(landed(revision)),
                Err(Conflict::Other(reason)) => {
                    return Err(StoreError::Write {
                        request_id: request_id.to_string(),
                        reason,
                    });
                }
                Err(Conflict::Changed) => {}
            }
            write = match next(self.record(request_id).await?) {
                Next::Write(write) => write,
                Next::Answer(answer) => return Ok(answer),
            };
        }
        Err(StoreError::Contended {
            request_id: request_id.to_string(),
            tries: CONTENDED_TRIES,
        })
    }

    /// One write of a request's record: a create-if-absent, or a compare-and-set.
    async fn write(
        &self,
        request_id: &str,
        body: bytes::Bytes,
        write: Write,
    ) -> Result<u64, Conflict> {
        let key = record_key(request_id);
        match write {
            Write::Create => self.results.create(key, body).await.map_err(Conflict::from),
            Write::Update(revision) => self
                .results
                .update(key, body, revision)
                .await
                .map_err(Conflict::from),
        }
    }

    /// A request's record with its revision.
    pub async fn record(
        &self,
        request_id: &str,
    ) -> Result<Option<(RequestRecord, u64)>, StoreError> {
        Ok(self
            .versioned(request_id)
            .await?
            .map(|versioned| (versioned.record, versioned.revision)))
    }

    /// A request's record with its revision and when it was written.
    pub async fn versioned(&self, request_id: &str) -> Result<Option<Versioned>, StoreError> {
        let entry = self
            .results
            .entry(record_key(request_id))
            .await
            .map_err(|source| StoreError::Read {
                request_id: request_id.to_string(),
                source,
            })?;
        Ok(entry.and_then(|entry| {
            if entry.operation != kv::Operation::Put {
                return None;
            }
            let record = serde_json::from_slice(&entry.value).ok()?;
            Some(Versioned {
                record,
                revision: entry.revision,
                written: std::time::SystemTime::from(entry.created),
            })
        }))
    }

    /// Replaces the result with its tombstone if it is still at `revision`; of concurrent
    /// readers exactly one succeeds. The tombstone keeps the request's summary.
    pub async fn release(
        &self,
        result: &GenerationResult,
        summary: &FinishedSummary,
        revision: u64,
    ) -> Result<bool, StoreError> {
        let tombstone = RequestRecord::Released {
            released: true,
            state: result.state,
            finished: Some(Box::new(summary.clone())),
        };
        match self
            .results
            .update(record_key(&result.request_id), tombstone.encode(), revision)
            .await
        {
            Ok(_) => Ok(true),
            Err(error) if error.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(false),
            Err(error) => Err(write_error(&result.request_id, error)),
        }
    }
}

#[derive(Clone, Copy)]
enum Write {
    Create,
    Update(u64),
}

/// What follows a write that found the record changed.
enum Next<T> {
    Write(Write),
    Answer(T),
}

/// A compare-and-set write that failed: the record changed, or the store failed.
enum Conflict {
    Changed,
    Other(String),
}

impl From<kv::CreateError> for Conflict {
    fn from(error: kv::CreateError) -> Conflict {
        match error.kind() {
            kv::CreateErrorKind::AlreadyExists => Conflict::Changed,
            _ => Conflict::Other(error.to_string()),
        }
    }
}

impl From<kv::UpdateError> for Conflict {
    fn from(error: kv::UpdateError) -> Conflict {
        match error.kind() {
            kv::UpdateErrorKind::WrongLastRevision => Conflict::Changed,
            _ => Conflict::Other(error.to_string()),
        }
    }
}

/// Whether a durable claim comes from the queue message that claimed the record: the same
/// stream sequence (a record without one, from a worker older than the field, is taken as
/// the same). An interactive request's record is never a queue message's.
fn same_message(held: &LiveRecord, claiming: &LiveRecord) -> bool {
    held.durable && (held.queue_seq.is_none() || held.queue_seq == claiming.queue_seq)
}

fn write_error(request_id: &str, error: impl std::fmt::Display) -> StoreError {
    StoreError::Write {
        request_id: request_id.to_string(),
        reason: error.to_string(),
    }
}
