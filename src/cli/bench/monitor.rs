//! What nats-server itself counts, read from its monitoring port (`/varz`, `/jsz`) before and
//! after a phase: the bus operations the phase cost, whichever client made them.
//!
//! What each counter counts, checked on nats-server 2.9.10 (tests/nats_counters.rs keeps it
//! true; docs/benchmarks.md has the table):
//! - `/varz` `in_msgs`: every message a client sends the server: publishes, requests and the
//!   replies clients send, acks, pull requests, direct gets. The server's replies (a KV write's
//!   acknowledgement, an API answer) count in `out_msgs` only.
//! - `/jsz` `api.total`: requests handled by the JetStream API (stream and consumer info,
//!   create, purge, delete, ...). Not a KV write, not a KV get, not a pull request, not an ack.
//! - each stream's `state.last_seq`: messages stored, so every KV create, update, put, delete
//!   and purge (a purge stores a marker) and every JetStream publish. A refused create stores
//!   nothing. It keeps counting through a stream purge; a stream made again starts at 0, so
//!   streams are told apart by their creation time too.
//! - each explicit-ack consumer's `ack_floor.consumer_seq`: deliveries acknowledged.
//! - a KV get is a direct get (`$JS.API.DIRECT.GET.<stream>`, the buckets allow it) and moves
//!   none of the JetStream counters, only `in_msgs` and `out_msgs`. The bench counts them itself
//!   by listening on that subject, on a server it started.
//!
//! The workers' heartbeats (a KV put every `worker.heartbeat_ms` per worker, whatever the load)
//! are counted apart, in `heartbeat_writes`: how many fall in a phase depends on how long it
//! ran, not on its requests.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::Value;

use crate::client::streams::WORKERS_BUCKET;

/// The subject every direct get is a request on.
const DIRECT_GET_SUBJECTS: &str = "$JS.API.DIRECT.GET.>";
/// `/jsz` with what the bench sums: every account, its streams, their consumers with their
/// configuration (the ack policy).
const JSZ_QUERY: &str = "/jsz?accounts=true&streams=true&consumers=true&config=true";
/// After a phase, the counters are read again this often until two readings agree: the last
/// writes of a phase (a summary kept in the background) land a little after its last request.
const SETTLE_POLL: Duration = Duration::from_millis(50);
const SETTLE_MAX_READS: usize = 20;

/// The monitoring port of the nats-server under load.
pub struct Monitor {
    http: reqwest::Client,
    base: String,
    direct_gets: Option<DirectGetCounter>,
}

/// Counts the direct gets the server answers by listening on their subject.
struct DirectGetCounter {
    seen: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
    client: async_nats::Client,
}

impl Monitor {
    /// The monitoring endpoints at `base` (`http://host:port`).
    pub fn new(base: &str) -> anyhow::Result<Monitor> {
        Ok(Monitor {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            base: base.trim_end_matches('/').to_string(),
            direct_gets: None,
        })
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    /// Also counts direct gets, on a connection of its own. Each one then reaches one more
    /// subscriber, the bench: one more message out of the server per get.
    pub async fn count_direct_gets(
        mut self,
        nats: &crate::settings::NatsSettings,
    ) -> anyhow::Result<Monitor> {
        let client =
            crate::client::connect::connect(nats, crate::client::connect::ConnectPurpose::Client)
                .await?;
        let mut gets = client.subscribe(DIRECT_GET_SUBJECTS).await?;
        client.flush().await?;
        let seen = Arc::new(AtomicU64::new(0));
        let counter = seen.clone();
        let task = tokio::spawn(async move {
            while gets.next().await.is_some() {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        });
        self.direct_gets = Some(DirectGetCounter { seen, task, client });
        Ok(self)
    }

    /// Stops counting and closes the connection, before the server it counts on stops.
    pub async fn close(self) {
        if let Some(counter) = self.direct_gets {
            counter.task.abort();
            let _ = tokio::time::timeout(Duration::from_secs(2), counter.client.drain()).await;
        }
    }

    /// The counters now.
    pub async fn read(&self) -> anyhow::Result<BusSnapshot> {
        let varz = self.get("/varz").await?;
        let jsz = self.get(JSZ_QUERY).await?;
        let direct_gets = self
            .direct_gets
            .as_ref()
            .map(|d| d.seen.load(Ordering::Relaxed));
        Ok(BusSnapshot::from_monitoring(&varz, &jsz, direct_gets))
    }

    /// The counters once they stop moving (or after about a second if they keep moving).
    pub async fn read_settled(&self) -> anyhow::Result<BusSnapshot> {
        let mut last = self.read().await?;
        for _ in 0..SETTLE_MAX_READS {
            tokio::time::sleep(SETTLE_POLL).await;
            let now = self.read().await?;
            if now == last {
                break;
            }
            last = now;
        }
        Ok(last)
    }

    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.base);
        self.http
            .get(&url)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .with_context(|| format!("cannot read nats-server's monitoring at {url}"))?
            .json()
            .await
            .with_context(|| format!("{url} did not answer JSON"))
    }
}

/// The server's counters at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BusSnapshot {
    in_msgs: u64,
    out_msgs: u64,
    in_bytes: u64,
    api_total: u64,
    api_errors: u64,
    /// Last sequence of each stream, by account, name and creation time (the heartbeats'
    /// bucket apart, in `heartbeat_last_seq`).
    stream_last_seq: BTreeMap<String, u64>,
    heartbeat_last_seq: BTreeMap<String, u64>,
    /// Acknowledged deliveries of each explicit-ack consumer, keyed the same way.
    consumer_acked: BTreeMap<String, u64>,
    direct_gets: Option<u64>,
}

impl BusSnapshot {
    /// From the JSON of `/varz` and of `/jsz` (with [`JSZ_QUERY`]'s options); what is missing
    /// counts as 0.
    fn from_monitoring(varz: &Value, jsz: &Value, direct_gets: Option<u64>) -> BusSnapshot {
        let number = |v: &Value, pointer: &str| v.pointer(pointer).and_then(Value::as_u64);
        let text = |v: &Value, pointer: &str| {
            v.pointer(pointer)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let list = |v: &Value, key: &str| v.get(key).and_then(Value::as_array).cloned();
        let mut snapshot = BusSnapshot {
            in_msgs: number(varz, "/in_msgs").unwrap_or(0),
            out_msgs: number(varz, "/out_msgs").unwrap_or(0),
            in_bytes: number(varz, "/in_bytes").unwrap_or(0),
            api_total: number(jsz, "/api/total").unwrap_or(0),
            api_errors: number(jsz, "/api/errors").unwrap_or(0),
            direct_gets,
            ..BusSnapshot::default()
        };
        for account in list(jsz, "account_details").unwrap_or_default() {
            let account_name = text(&account, "/name");
            for stream in list(&account, "stream_detail").unwrap_or_default() {
                let stream_key = format!(
                    "{account_name}/{}@{}",
                    text(&stream, "/name"),
                    text(&stream, "/created")
                );
                if let Some(last) = number(&stream, "/state/last_seq") {
                    let streams =
                        if text(&stream, "/name").strip_prefix("KV_") == Some(WORKERS_BUCKET) {
                            &mut snapshot.heartbeat_last_seq
                        } else {
                            &mut snapshot.stream_last_seq
                        };
                    streams.insert(stream_key.clone(), last);
                }
                for consumer in list(&stream, "consumer_detail").unwrap_or_default() {
                    if text(&consumer, "/config/ack_policy") != "explicit" {
                        continue;
                    }
                    let key = format!(
                        "{stream_key}/{}@{}",
                        text(&consumer, "/name"),
                        text(&consumer, "/created")
                    );
                    if let Some(acked) = number(&consumer, "/ack_floor/consumer_seq") {
                        snapshot.consumer_acked.insert(key, acked);
                    }
                }
            }
        }
        snapshot
    }

    /// What moved from `before` to this snapshot, per request completed in between.
    pub fn since(&self, before: &BusSnapshot, requests: u64) -> BusOps {
        // A stream or consumer made during the phase counts from 0; one deleted during it
        // counts no more (what it held is gone from the figures).
        let grown = |now: &BTreeMap<String, u64>, then: &BTreeMap<String, u64>| -> u64 {
            now.iter()
                .map(|(key, n)| n.saturating_sub(then.get(key).copied().unwrap_or(0)))
                .sum()
        };
        let api_calls = self.api_total.saturating_sub(before.api_total);
        let stored = grown(&self.stream_last_seq, &before.stream_last_seq);
        let heartbeats = grown(&self.heartbeat_last_seq, &before.heartbeat_last_seq);
        let acks = grown(&self.consumer_acked, &before.consumer_acked);
        let direct_gets = self
            .direct_gets
            .zip(before.direct_gets)
            .map(|(now, then)| now.saturating_sub(then));
        let totals = BusCounts {
            jetstream_operations: api_calls + stored + acks + direct_gets.unwrap_or(0),
            jetstream_api_calls: api_calls,
            jetstream_stored_messages: stored,
            jetstream_consumer_acks: acks,
            jetstream_direct_gets: direct_gets,
            nats_msgs_in: self.in_msgs.saturating_sub(before.in_msgs),
            nats_msgs_out: self.out_msgs.saturating_sub(before.out_msgs),
            nats_bytes_in: self.in_bytes.saturating_sub(before.in_bytes),
            heartbeat_writes: heartbeats,
        };
        BusOps {
            requests,
            jetstream_api_errors: self.api_errors.saturating_sub(before.api_errors),
            per_request: (requests > 0).then(|| totals.per(requests)),
            totals,
        }
    }
}

/// The bus operations of a phase, from nats-server's own counters.
#[derive(Debug, Clone, Serialize)]
pub struct BusOps {
    /// What the per-request figures are divided by: requests completed in the phase.
    pub requests: u64,
    pub totals: BusCounts,
    /// `totals` ÷ `requests`; absent when no request completed.
    pub per_request: Option<BusRates>,
    /// JetStream API requests answered with an error (a look-up of something absent, too).
    pub jetstream_api_errors: u64,
}

/// Bus operations counted over a phase.
#[derive(Debug, Clone, Serialize)]
pub struct BusCounts {
    /// API calls + stored messages + consumer acks + direct gets.
    pub jetstream_operations: u64,
    /// `api.total` of `/jsz`.
    pub jetstream_api_calls: u64,
    /// Messages stored in streams (KV writes included), from the streams' last sequences.
    pub jetstream_stored_messages: u64,
    /// Deliveries acknowledged on explicit-ack consumers (their ack floors).
    pub jetstream_consumer_acks: u64,
    /// KV gets (direct gets), counted only on a server the bench started.
    pub jetstream_direct_gets: Option<u64>,
    /// Messages clients sent the server (`in_msgs` of `/varz`).
    pub nats_msgs_in: u64,
    pub nats_msgs_out: u64,
    pub nats_bytes_in: u64,
    /// The workers' heartbeats stored in the phase (in no other figure but `nats_msgs_in`):
    /// a cost of the fleet's time, not of its requests, so never divided by them.
    pub heartbeat_writes: u64,
}

/// [`BusCounts`] per request.
#[derive(Debug, Clone, Serialize)]
pub struct BusRates {
    pub jetstream_operations: f64,
    pub jetstream_api_calls: f64,
    pub jetstream_stored_messages: f64,
    pub jetstream_consumer_acks: f64,
    pub jetstream_direct_gets: Option<f64>,
    pub nats_msgs_in: f64,
    pub nats_msgs_out: f64,
    pub nats_bytes_in: f64,
}

impl BusRates {
    /// Each figure with its name, in the order of the fields.
    pub fn named(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("JetStream operations", self.jetstream_operations),
            ("JetStream API calls", self.jetstream_api_calls),
            ("stored messages", self.jetstream_stored_messages),
            ("consumer acks", self.jetstream_consumer_acks),
            ("direct gets", self.jetstream_direct_gets.unwrap_or(0.0)),
            ("messages in", self.nats_msgs_in),
            ("messages out", self.nats_msgs_out),
            ("bytes in", self.nats_bytes_in),
        ]
    }
}

impl BusCounts {
    fn per(&self, requests: u64) -> BusRates {
        let per = |n: u64| n as f64 / requests as f64;
        BusRates {
            jetstream_operations: per(self.jetstream_operations),
            jetstream_api_calls: per(self.jetstream_api_calls),
            jetstream_stored_messages: per(self.jetstream_stored_messages),
            jetstream_consumer_acks: per(self.jetstream_consumer_acks),
            jetstream_direct_gets: self.jetstream_direct_gets.map(per),
            nats_msgs_in: per(self.nats_msgs_in),
            nats_msgs_out: per(self.nats_msgs_out),
            nats_bytes_in: per(self.nats_bytes_in),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `/jsz` as nats-server 2.9.10 answers it, cut to what is read: one bucket, and a queue
    /// with an explicit-ack consumer and an ordered (ack none) one.
    fn jsz(api_total: u64, kv_last: u64, queue_created: &str, acked: u64) -> Value {
        json!({
            "api": {"total": api_total, "errors": 1},
            "account_details": [{
                "name": "$G",
                "stream_detail": [
                    {"name": "KV_results", "created": "2026-11-24T16:54:59.1Z",
                     "state": {"messages": 3, "last_seq": kv_last}},
                    {"name": "KV_GENFLEET_WORKERS", "created": "2026-11-24T16:54:59.1Z",
                     "state": {"messages": 1, "last_seq": api_total * 3}},
                    {"name": "QUEUE", "created": queue_created,
                     "state": {"messages": 0, "last_seq": 7},
                     "consumer_detail": [
                        {"name": "pool", "created": "2026-11-24T16:55:00Z",
                         "config": {"ack_policy": "explicit"},
                         "ack_floor": {"consumer_seq": acked, "stream_seq": acked}},
                        {"name": "watch", "created": "2026-11-24T16:55:00Z",
                         "config": {"ack_policy": "none"},
                         "ack_floor": {"consumer_seq": 500, "stream_seq": 500}}
                     ]}
                ]
            }]
        })
    }

    fn varz(in_msgs: u64) -> Value {
        json!({"in_msgs": in_msgs, "out_msgs": in_msgs * 2, "in_bytes": in_msgs * 100})
    }

    #[test]
    fn operations_are_what_each_counter_moved() {
        let at = "2026-11-24T16:55:00Z";
        let before = BusSnapshot::from_monitoring(&varz(10), &jsz(4, 100, at, 3), Some(50));
        let after = BusSnapshot::from_monitoring(&varz(70), &jsz(9, 120, at, 13), Some(60));
        let ops = after.since(&before, 10);
        let t = &ops.totals;
        assert_eq!(
            (
                t.jetstream_api_calls,
                t.jetstream_stored_messages,
                t.jetstream_consumer_acks,
                t.jetstream_direct_gets
            ),
            (5, 20, 10, Some(10))
        );
        assert_eq!(t.jetstream_operations, 45);
        // Heartbeats apart, in no per-request figure.
        assert_eq!(t.heartbeat_writes, 15);
        assert_eq!(
            (t.nats_msgs_in, t.nats_msgs_out, t.nats_bytes_in),
            (60, 120, 6000)
        );
        let per = ops.per_request.expect("requests completed");
        assert_eq!(per.jetstream_operations, 4.5);
        assert_eq!(per.nats_msgs_in, 6.0);
        assert_eq!(ops.jetstream_api_errors, 0);
    }

    #[test]
    fn a_stream_made_again_counts_from_zero_and_nothing_counts_without_requests() {
        let before = BusSnapshot::from_monitoring(&varz(0), &jsz(0, 100, "then", 3), None);
        // The queue was deleted and made again: its 7 messages and 2 acks are new.
        let after = BusSnapshot::from_monitoring(&varz(0), &jsz(0, 100, "now", 2), None);
        let ops = after.since(&before, 0);
        assert_eq!(ops.totals.jetstream_stored_messages, 7);
        assert_eq!(ops.totals.jetstream_consumer_acks, 2);
        assert_eq!(ops.totals.jetstream_direct_gets, None);
        assert!(ops.per_request.is_none());
    }
}
