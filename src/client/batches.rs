//! Batches as every gateway replica reads them: a record per batch in `gateway.batches_bucket`
//! (the batch object, and which replica drives it until when), and the lines' outcomes in the
//! bucket of the same name with `_LINES` after it, in chunks: the lines that ended since the
//! chunk before, each chunk written once and counted in the record.
//!
//! Architecture invariant: a batch belongs to its tenant. Its keys are `<tenant>.<batch id>`
//! and `<tenant>.<batch id>.<chunk>`, built from the caller's own tenant, so another tenant's id
//! is a 404 exactly as an unknown one.

use std::time::Duration;

use async_nats::jetstream::kv;
use futures_util::{Stream, StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::client::BusError;
use crate::settings::Settings;

/// Longest batch id read from a path: `batch_` and a ULID are 32 characters.
const MAX_ID_LEN: usize = 64;

/// Line outcomes read at once.
const READ_AHEAD: usize = 64;

/// A batch's record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// The batch object as `GET /v1/batches/{id}` serves it.
    pub batch: Value,
    /// The tenant it belongs to ("" for the default tenant).
    pub tenant: String,
    /// The replica driving it ("" when none), and until when (ms since the epoch) its lease
    /// holds: another replica takes the batch over once it ran out.
    pub owner: String,
    pub lease_until_ms: u64,
    /// Lines below this one (by their place in the file) may have been sent: one that was
    /// taken over looks its request up before sending it again.
    pub reserved: usize,
    /// The chunks of outcomes kept (`<tenant>.<id>.<n>` in the lines bucket, `n` from 1).
    #[serde(default)]
    pub chunks: usize,
}

impl Record {
    pub fn status(&self) -> &str {
        self.batch["status"].as_str().unwrap_or("")
    }

    pub fn is_final(&self) -> bool {
        matches!(
            self.status(),
            "completed" | "failed" | "expired" | "cancelled"
        )
    }
}

/// One line's outcome: its line of the output or of the error file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LineOutcome {
    /// The line of the output file (`false`: of the error file).
    pub ok: bool,
    pub line: Value,
}

/// One line's outcome as its driver holds it: its line number, whether it goes to the output
/// file (`false`: the error file), and its line of that file as JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct KeptLine {
    pub number: usize,
    pub ok: bool,
    pub text: String,
}

/// A chunk as it is stored: `[[<number>, {"ok": <ok>, "line": <line>}], ...]`, read back as
/// `(usize, LineOutcome)` pairs. The lines' texts go in as they are (each is JSON already),
/// not parsed and written again.
fn chunk_body(outcomes: &[KeptLine]) -> Vec<u8> {
    let mut body =
        Vec::with_capacity(outcomes.iter().map(|o| o.text.len() + 32).sum::<usize>() + 2);
    body.push(b'[');
    for (i, outcome) in outcomes.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(
            format!("[{},{{\"ok\":{},\"line\":", outcome.number, outcome.ok).as_bytes(),
        );
        body.extend_from_slice(outcome.text.as_bytes());
        body.extend_from_slice(b"}]");
    }
    body.push(b']');
    body
}

/// A record as read, with its revision.
pub struct Read {
    pub record: Record,
    pub revision: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("the batches bucket: {0}")]
pub struct BatchesError(pub String);

fn err(error: impl std::fmt::Display) -> BatchesError {
    BatchesError(error.to_string())
}

/// The batches' buckets.
#[derive(Clone)]
pub struct Batches {
    records: kv::Store,
    lines: kv::Store,
}

impl Batches {
    pub async fn open(nats: &async_nats::Client, settings: &Settings) -> Result<Self, BusError> {
        let jetstream = async_nats::jetstream::new(nats.clone());
        let bucket = &settings.gateway.batches_bucket;
        let ttl = Duration::from_millis(settings.gateway.batches_ttl_ms);
        let replicas = settings.jetstream.replicas;
        let open = |name: String| {
            let jetstream = jetstream.clone();
            async move {
                crate::client::streams::ensure_bucket(&jetstream, &name, 1, ttl, replicas).await
            }
        };
        Ok(Batches {
            records: open(bucket.clone()).await?,
            lines: open(format!("{bucket}_LINES")).await?,
        })
    }

    /// Opens the buckets as a gateway made them, creating nothing, for a reader that must not
    /// create them (the console): `Ok(None)` while they do not exist (no gateway has started).
    pub async fn open_existing(
        nats: &async_nats::Client,
        settings: &Settings,
    ) -> Result<Option<Self>, BatchesError> {
        let jetstream = async_nats::jetstream::new(nats.clone());
        let open = |name: String| {
            let jetstream = jetstream.clone();
            async move {
                match jetstream.get_key_value(&name).await {
                    Ok(store) => Ok(Some(store)),
                    Err(error) if is_absent(&error) => Ok(None),
                    Err(error) => Err(BatchesError(format!("cannot open bucket {name}: {error}"))),
                }
            }
        };
        let bucket = &settings.gateway.batches_bucket;
        let (Some(records), Some(lines)) = (
            open(bucket.clone()).await?,
            open(format!("{bucket}_LINES")).await?,
        ) else {
            return Ok(None);
        };
        Ok(Some(Batches { records, lines }))
    }

    pub async fn get(&self, tenant: &str, id: &str) -> Result<Option<Read>, BatchesError> {
        let Some(key) = key(tenant, id) else {
            return Ok(None);
        };
        self.get_key(&key).await
    }

    async fn get_key(&self, key: &str) -> Result<Option<Read>, BatchesError> {
        let Some(entry) = self.records.entry(key).await.map_err(err)? else {
            return Ok(None);
        };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let record = serde_json::from_slice(&entry.value)
            .map_err(|e| BatchesError(format!("a batch record cannot be read: {e}")))?;
        Ok(Some(Read {
            record,
            revision: entry.revision,
        }))
    }

    /// Writes a new batch's record; `Ok(false)` when its key is taken.
    pub async fn create(&self, record: &Record) -> Result<bool, BatchesError> {
        let key = own_key(record)?;
        let body = serde_json::to_vec(record).expect("records serialize");
        match self.records.create(key, body.into()).await {
            Ok(_) => Ok(true),
            Err(error) if error.kind() == kv::CreateErrorKind::AlreadyExists => Ok(false),
            Err(error) => Err(err(error)),
        }
    }

    /// Writes a record over the revision read; `Ok(None)` when it changed since, else the new
    /// revision.
    pub async fn update(
        &self,
        record: &Record,
        revision: u64,
    ) -> Result<Option<u64>, BatchesError> {
        let key = own_key(record)?;
        let body = serde_json::to_vec(record).expect("records serialize");
        match self.records.update(key, body.into(), revision).await {
            Ok(revision) => Ok(Some(revision)),
            Err(error) if error.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(error) => Err(err(error)),
        }
    }

    /// Every batch's key (`<tenant>.<id>`), of every tenant.
    pub async fn keys(&self) -> Result<Vec<String>, BatchesError> {
        let keys = self.records.keys().await.map_err(err)?;
        keys.try_collect().await.map_err(err)
    }

    /// The record of a key [`Batches::keys`] gave.
    pub async fn get_by_key(&self, key: &str) -> Result<Option<Read>, BatchesError> {
        self.get_key(key).await
    }

    /// Every batch's record, of every tenant, in no particular order, read `READ_AHEAD` at a
    /// time; a batch removed meanwhile is left out. Nothing is kept: the reader decides what
    /// to hold.
    pub async fn records(
        &self,
    ) -> Result<impl Stream<Item = Result<Record, BatchesError>> + '_, BatchesError> {
        let keys = self.records.keys().await.map_err(err)?;
        Ok(keys
            .map(move |key| async move {
                let key = key.map_err(err)?;
                Ok(self.get_key(&key).await?.map(|read| read.record))
            })
            .buffer_unordered(READ_AHEAD)
            .try_filter_map(|record| async move { Ok(record) }))
    }

    /// The tenant's batches, newest first.
    pub async fn list(&self, tenant: &str) -> Result<Vec<Record>, BatchesError> {
        let prefix = format!("{}.", tenant_token(tenant));
        let mut records = Vec::new();
        for key in self.keys().await? {
            if key.starts_with(&prefix)
                && let Some(read) = self.get_key(&key).await?
            {
                records.push(read.record);
            }
        }
        records.sort_by(|a, b| {
            let at = |r: &Record| (r.batch["created_at"].as_u64(), r.batch["id"].to_string());
            at(b).cmp(&at(a))
        });
        Ok(records)
    }

    /// Keeps chunk `chunk` of a batch's outcomes (the lines that ended since the chunk
    /// before), each with its line number. Writing a chunk again replaces it.
    pub async fn put_chunk(
        &self,
        tenant: &str,
        id: &str,
        chunk: usize,
        outcomes: &[KeptLine],
    ) -> Result<(), BatchesError> {
        let key = chunk_key(tenant, id, chunk)?;
        self.lines
            .put(key, chunk_body(outcomes).into())
            .await
            .map_err(err)?;
        Ok(())
    }

    /// Every outcome of chunks `1..=chunks`, each with its line number.
    pub async fn outcomes(
        &self,
        tenant: &str,
        id: &str,
        chunks: usize,
    ) -> Result<Vec<(usize, LineOutcome)>, BatchesError> {
        let keys = (1..=chunks)
            .map(|chunk| chunk_key(tenant, id, chunk))
            .collect::<Result<Vec<_>, _>>()?;
        let read: Vec<Vec<(usize, LineOutcome)>> = futures_util::stream::iter(keys)
            .map(|key| async move {
                match self.lines.get(&key).await.map_err(err)? {
                    Some(body) => serde_json::from_slice(&body).map_err(|e| {
                        BatchesError(format!("the outcomes of {key} cannot be read: {e}"))
                    }),
                    None => Err(BatchesError(format!("the outcomes of {key} are gone"))),
                }
            })
            .buffered(READ_AHEAD)
            .try_collect()
            .await?;
        Ok(read.into_iter().flatten().collect())
    }
}

/// Whether opening a bucket failed because it does not exist (JetStream's "stream not
/// found"), rather than for want of an answer or a permission.
fn is_absent(error: &async_nats::jetstream::context::KeyValueError) -> bool {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::{GetStreamError, GetStreamErrorKind, KeyValueErrorKind};
    error.kind() == KeyValueErrorKind::GetBucket
        && std::error::Error::source(error)
            .and_then(|source| source.downcast_ref::<GetStreamError>())
            .is_some_and(|source| {
                matches!(source.kind(), GetStreamErrorKind::JetStream(e)
                    if e.error_code() == ErrorCode::STREAM_NOT_FOUND)
            })
}

/// A tenant's name as its batches' keys spell it: "default" for the default tenant ("").
pub fn tenant_token(tenant: &str) -> &str {
    if tenant.is_empty() { "default" } else { tenant }
}

fn own_key(record: &Record) -> Result<String, BatchesError> {
    let id = record.batch["id"].as_str().unwrap_or_default();
    key(&record.tenant, id).ok_or_else(|| BatchesError(format!("{id:?} is not a batch id")))
}

fn chunk_key(tenant: &str, id: &str, chunk: usize) -> Result<String, BatchesError> {
    key(tenant, id)
        .map(|key| format!("{key}.{chunk}"))
        .ok_or_else(|| BatchesError(format!("{id:?} is not a batch id")))
}

/// The key of a tenant's batch: `None` for an id no batch has.
pub fn key(tenant: &str, id: &str) -> Option<String> {
    let valid = id.len() <= MAX_ID_LEN
        && id.strip_prefix("batch_").is_some_and(|rest| {
            !rest.is_empty() && rest.chars().all(|c| c.is_ascii_alphanumeric())
        });
    valid.then(|| format!("{}.{id}", tenant_token(tenant)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_the_tenant_s_and_only_a_batch_id_makes_one() {
        assert_eq!(key("t", "batch_01AB").as_deref(), Some("t.batch_01AB"));
        assert_eq!(key("", "batch_01AB").as_deref(), Some("default.batch_01AB"));
        for bad in [
            "",
            "batch_",
            "batch_*",
            "batch_a.b",
            "t.batch_1",
            "batch_a>",
        ] {
            assert_eq!(key("t", bad), None, "{bad:?}");
        }
        assert_eq!(chunk_key("t", "batch_01AB", 7).unwrap(), "t.batch_01AB.7");
    }

    #[test]
    fn a_chunk_written_from_texts_reads_back_as_its_outcomes() {
        let kept = [
            KeptLine {
                number: 3,
                ok: true,
                text: r#"{"id":"batch_req_1-3","custom_id":"a \"quoted\" one","error":null}"#
                    .into(),
            },
            KeptLine {
                number: 1,
                ok: false,
                text: r#"{"id":"batch_req_1-1","error":{"code":"invalid_json","line":1}}"#.into(),
            },
        ];
        let read: Vec<(usize, LineOutcome)> = serde_json::from_slice(&chunk_body(&kept)).unwrap();
        assert_eq!(read.len(), 2);
        for ((number, outcome), kept) in read.iter().zip(&kept) {
            assert_eq!((*number, outcome.ok), (kept.number, kept.ok));
            assert_eq!(
                outcome.line,
                serde_json::from_str::<Value>(&kept.text).unwrap()
            );
        }
        let none: Vec<(usize, LineOutcome)> = serde_json::from_slice(&chunk_body(&[])).unwrap();
        assert!(none.is_empty());
    }
}
