//! The batches list: the gateway's batches (the OpenAI Batch API) of every tenant with their
//! progress, read from the batches bucket (`gateway.batches_bucket`) when a page asks, newest
//! first, at most `console.max_requests` of them.
//!
//! The console creates no bucket: until a gateway has made it, the list is empty and says
//! why. A read goes through every record (one key listing, then the records a few at a time)
//! and keeps only the newest, so what it holds is bounded whatever the number of batches; a list read in the last [`FRESH`] is served again, so however many pages
//! poll, the bucket is read at most once per [`FRESH`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{StreamExt, pin_mut};
use serde_json::{Value, json};
use tokio::sync::{Mutex, OnceCell};

use crate::client::batches::{self, Batches, Record};
use crate::settings::Settings;

/// How long a list read is served again.
pub const FRESH: Duration = Duration::from_secs(2);
/// Longest a read may take before the page is told the bucket does not answer.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The buckets, opened once they exist, and the last list read.
#[derive(Default)]
pub struct BatchList {
    opened: OnceCell<Batches>,
    last: Mutex<Option<(Instant, Arc<Value>)>>,
}

/// Why there is no list.
enum Unread {
    /// The bucket does not exist yet: no gateway has started.
    Absent,
    Failed(String),
}

impl BatchList {
    /// `{"batches", "total", "max"}` (and `note` when there is no bucket yet), or why the
    /// bucket cannot be read.
    pub async fn read(
        &self,
        nats: &async_nats::Client,
        settings: &Settings,
    ) -> Result<Arc<Value>, String> {
        // One read at a time: the pages that ask meanwhile get its answer.
        let mut last = self.last.lock().await;
        if let Some((at, list)) = last.as_ref()
            && at.elapsed() < FRESH
        {
            return Ok(list.clone());
        }
        let max = settings.console.max_requests;
        let bucket = &settings.gateway.batches_bucket;
        let read = async {
            let store = self.open(nats, settings).await?;
            newest(store, max).await.map_err(Unread::Failed)
        };
        let list = match tokio::time::timeout(READ_TIMEOUT, read).await {
            Ok(Ok((batches, total))) => json!({"batches": batches, "total": total, "max": max}),
            Ok(Err(Unread::Absent)) => json!({
                "batches": [], "total": 0, "max": max,
                "note": format!("bucket {bucket} does not exist yet: no gateway has started"),
            }),
            Ok(Err(Unread::Failed(problem))) => {
                return Err(format!("cannot read bucket {bucket}: {problem}"));
            }
            Err(_) => {
                return Err(format!(
                    "bucket {bucket} was not read within {READ_TIMEOUT:?}"
                ));
            }
        };
        let list = Arc::new(list);
        *last = Some((Instant::now(), list.clone()));
        Ok(list)
    }

    async fn open(
        &self,
        nats: &async_nats::Client,
        settings: &Settings,
    ) -> Result<&Batches, Unread> {
        self.opened
            .get_or_try_init(|| async {
                match Batches::open_existing(nats, settings).await {
                    Ok(Some(store)) => Ok(store),
                    Ok(None) => Err(Unread::Absent),
                    Err(error) => Err(Unread::Failed(error.0)),
                }
            })
            .await
    }
}

/// A batch as the list shows it, with what orders it: created, then id (both newest last).
struct Ranked {
    at: (u64, String),
    entry: Value,
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Ranked {}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

/// The newest `max` batches, newest first, and how many there are.
async fn newest(store: &Batches, max: usize) -> Result<(Vec<Value>, usize), String> {
    let records = store.records().await.map_err(|e| e.0)?;
    pin_mut!(records);
    let mut newest = Newest::new(max);
    let mut total = 0;
    while let Some(record) = records.next().await {
        newest.push(&record.map_err(|e| e.0)?);
        total += 1;
    }
    Ok((newest.into_list(), total))
}

/// The newest `max` batches of those pushed.
struct Newest {
    max: usize,
    /// The oldest kept on top, to give way to a newer one.
    kept: BinaryHeap<Reverse<Ranked>>,
}

impl Newest {
    fn new(max: usize) -> Newest {
        Newest {
            max,
            kept: BinaryHeap::new(),
        }
    }

    fn push(&mut self, record: &Record) {
        self.kept.push(Reverse(ranked(record)));
        if self.kept.len() > self.max {
            self.kept.pop();
        }
    }

    /// Newest first (ascending in `Reverse`).
    fn into_list(self) -> Vec<Value> {
        self.kept
            .into_sorted_vec()
            .into_iter()
            .map(|Reverse(r)| r.entry)
            .collect()
    }
}

fn ranked(record: &Record) -> Ranked {
    let batch = &record.batch;
    let id = batch["id"].as_str().unwrap_or_default();
    Ranked {
        at: (batch["created_at"].as_u64().unwrap_or(0), id.to_string()),
        entry: entry(record),
    }
}

/// What the list says of a batch.
pub fn entry(record: &Record) -> Value {
    let batch = &record.batch;
    json!({
        "id": batch["id"],
        "tenant": batches::tenant_token(&record.tenant),
        "status": batch["status"],
        "endpoint": batch["endpoint"],
        "created_at": batch["created_at"],
        "request_counts": batch["request_counts"],
        "output_file_id": batch["output_file_id"],
        "error_file_id": batch["error_file_id"],
        "driven_by": (!record.owner.is_empty()).then_some(&record.owner),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tenant: &str, id: &str, created_at: u64, owner: &str) -> Record {
        Record {
            batch: json!({
                "id": id, "status": "in_progress", "endpoint": "/v1/chat/completions",
                "created_at": created_at, "output_file_id": null, "error_file_id": null,
                "request_counts": {"total": 3, "completed": 1, "failed": 1},
                "metadata": {"secret": "not shown"},
            }),
            tenant: tenant.into(),
            owner: owner.into(),
            lease_until_ms: 0,
            reserved: 0,
            chunks: 0,
        }
    }

    #[test]
    fn an_entry_names_the_default_tenant_and_its_driver() {
        let shown = entry(&record("", "batch_1", 10, "gw-1"));
        assert_eq!(shown["tenant"], "default");
        assert_eq!(shown["driven_by"], "gw-1");
        assert_eq!(shown["request_counts"]["failed"], 1);
        assert!(shown.get("metadata").is_none());
        let idle = entry(&record("acme", "batch_2", 10, ""));
        assert_eq!(idle["tenant"], "acme");
        assert_eq!(idle["driven_by"], Value::Null);
    }

    #[test]
    fn the_newest_are_kept_newest_first() {
        let mut newest = Newest::new(2);
        for (id, at) in [
            ("batch_b", 5),
            ("batch_a", 9),
            ("batch_c", 1),
            ("batch_d", 9),
        ] {
            newest.push(&record("t", id, at, ""));
        }
        let ids: Vec<_> = newest
            .into_list()
            .into_iter()
            .map(|e| e["id"].clone())
            .collect();
        assert_eq!(ids, [json!("batch_d"), json!("batch_a")]);
    }
}
