//! What nats-server's monitoring counters count for each JetStream operation genfleet makes:
//! `genfleet bench` reads them to report bus operations per request (src/cli/bench/monitor.rs),
//! and docs/benchmarks.md states this table. Each step is one operation, with the counters read
//! before and after it.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};
use common::nats::{NatsServer, free_port};
use common::wait;
use futures_util::StreamExt;
use serde_json::Value;

/// The counters the bench reads, summed as it sums them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counters {
    /// `api.total` of `/jsz`.
    api: u64,
    /// The streams' last sequences, summed.
    stored: u64,
    /// The explicit-ack consumers' ack floors, summed.
    acked: u64,
    /// Requests on `$JS.API.DIRECT.GET.>`, counted by a subscriber of this test.
    direct_gets: u64,
    /// `in_msgs` of `/varz`.
    msgs_in: u64,
}

impl Counters {
    fn minus(self, before: Counters) -> Counters {
        Counters {
            api: self.api - before.api,
            stored: self.stored - before.stored,
            acked: self.acked - before.acked,
            direct_gets: self.direct_gets - before.direct_gets,
            msgs_in: self.msgs_in - before.msgs_in,
        }
    }

    /// Whether no counter is past its mark in `limit`.
    fn within(&self, limit: &Counters) -> bool {
        self.api <= limit.api
            && self.stored <= limit.stored
            && self.acked <= limit.acked
            && self.direct_gets <= limit.direct_gets
            && self.msgs_in <= limit.msgs_in
    }
}

struct Server {
    _nats: NatsServer,
    monitor: u16,
    direct_gets: Arc<AtomicU64>,
}

impl Server {
    async fn start() -> (Server, async_nats::Client) {
        genfleet::llm::openai::install_crypto_provider();
        let monitor = free_port();
        let nats = NatsServer::start_with_config(&format!("http: \"127.0.0.1:{monitor}\"")).await;
        let listener = nats.client().await;
        let mut gets = listener.subscribe("$JS.API.DIRECT.GET.>").await.unwrap();
        listener.flush().await.unwrap();
        let direct_gets = Arc::new(AtomicU64::new(0));
        let seen = direct_gets.clone();
        tokio::spawn(async move {
            let _listener = listener;
            while gets.next().await.is_some() {
                seen.fetch_add(1, Ordering::Relaxed);
            }
        });
        let client = nats.client().await;
        let server = Server {
            _nats: nats,
            monitor,
            direct_gets,
        };
        (server, client)
    }

    async fn read(&self, path: &str) -> Value {
        reqwest::get(format!("http://127.0.0.1:{}{path}", self.monitor))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn counters(&self) -> Counters {
        let varz = self.read("/varz").await;
        let jsz = self
            .read("/jsz?accounts=true&streams=true&consumers=true&config=true")
            .await;
        let mut counters = Counters {
            api: jsz["api"]["total"].as_u64().unwrap(),
            msgs_in: varz["in_msgs"].as_u64().unwrap(),
            direct_gets: self.direct_gets.load(Ordering::Relaxed),
            ..Counters::default()
        };
        let list = |v: &Value, key: &str| v[key].as_array().cloned().unwrap_or_default();
        for account in list(&jsz, "account_details") {
            for stream in list(&account, "stream_detail") {
                counters.stored += stream["state"]["last_seq"].as_u64().unwrap();
                for consumer in list(&stream, "consumer_detail") {
                    if consumer["config"]["ack_policy"] == "explicit" {
                        counters.acked += consumer["ack_floor"]["consumer_seq"].as_u64().unwrap();
                    }
                }
            }
        }
        counters
    }

    /// Runs `operation` and checks what moved. The counters are read until they show what
    /// docs/benchmarks.md says (the direct-get listener gets its copy a moment after the
    /// reply); a counter past its mark fails at once, as counters only grow.
    async fn check<F: std::future::Future<Output = ()>>(
        &self,
        what: &str,
        expected: Counters,
        operation: F,
    ) {
        let before = self.counters().await;
        operation.await;
        let what = format!("{what}: the counters to move as docs/benchmarks.md says, {expected:?}");
        wait::until(&what, Duration::from_secs(10), || async {
            let moved = self.counters().await.minus(before);
            assert!(
                moved.within(&expected),
                "{what}; they moved further: {moved:?}"
            );
            if moved == expected {
                Ok(())
            } else {
                Err(format!("{moved:?}"))
            }
        })
        .await;
    }
}

fn moved(api: u64, stored: u64, acked: u64, direct_gets: u64, msgs_in: u64) -> Counters {
    Counters {
        api,
        stored,
        acked,
        direct_gets,
        msgs_in,
    }
}

#[tokio::test]
async fn each_operation_moves_the_counters_the_bench_reads() {
    let (server, client) = Server::start().await;
    let js = jetstream::new(client.clone());
    // Made as the worker makes its buckets: through the stream, direct gets allowed.
    let bucket: kv::Store =
        genfleet::bus::store::ensure_bucket(&js, "counted", 1, Duration::from_secs(600), 1)
            .await
            .unwrap();

    server
        .check("reading the monitoring port", moved(0, 0, 0, 0, 0), async {
        })
        .await;
    let revision = std::sync::Mutex::new(0);
    server
        .check("KV create", moved(0, 1, 0, 0, 1), async {
            *revision.lock().unwrap() = bucket.create("k", "v1".into()).await.unwrap();
        })
        .await;
    let at = *revision.lock().unwrap();
    server
        .check("KV update", moved(0, 1, 0, 0, 1), async {
            bucket.update("k", "v2".into(), at).await.unwrap();
        })
        .await;
    server
        .check("KV get", moved(0, 0, 0, 1, 1), async {
            assert!(bucket.get("k").await.unwrap().is_some());
        })
        .await;
    server
        .check("KV entry", moved(0, 0, 0, 1, 1), async {
            assert!(bucket.entry("k").await.unwrap().is_some());
        })
        .await;
    server
        .check("KV put", moved(0, 1, 0, 0, 1), async {
            bucket.put("other", "x".into()).await.unwrap();
        })
        .await;
    // The create is refused; the client then reads the key to tell a value from a purge marker.
    server
        .check(
            "KV create of a key that has a value",
            moved(0, 0, 0, 1, 2),
            async {
                assert!(bucket.create("other", "y".into()).await.is_err());
            },
        )
        .await;
    server
        .check("KV purge", moved(0, 1, 0, 0, 1), async {
            bucket.purge("k").await.unwrap();
        })
        .await;
    server
        .check(
            "stream purge of one subject (an API call)",
            moved(1, 0, 0, 0, 1),
            async {
                bucket
                    .stream
                    .purge()
                    .filter("$KV.counted.other")
                    .await
                    .unwrap();
            },
        )
        .await;
    server
        .check("core publish", moved(0, 0, 0, 0, 1), async {
            client.publish("not.stored", "x".into()).await.unwrap();
            client.flush().await.unwrap();
        })
        .await;

    let queue = js
        .create_stream(stream::Config {
            name: "QUEUE".into(),
            subjects: vec!["queue.>".into()],
            retention: stream::RetentionPolicy::WorkQueue,
            ..Default::default()
        })
        .await
        .unwrap();
    let consumer = queue
        .create_consumer(consumer::pull::Config {
            durable_name: Some("pool".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    server
        .check("JetStream publish", moved(0, 1, 0, 0, 1), async {
            js.publish("queue.1", "m".into())
                .await
                .unwrap()
                .await
                .unwrap();
        })
        .await;
    let message = std::sync::Mutex::new(None);
    server
        .check("pull of one message", moved(0, 0, 0, 0, 1), async {
            let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
            *message.lock().unwrap() = Some(batch.next().await.unwrap().unwrap());
        })
        .await;
    let message = message.lock().unwrap().take().unwrap();
    server
        .check("ack (double)", moved(0, 0, 1, 0, 1), async {
            message.double_ack().await.unwrap();
        })
        .await;
    server
        .check(
            "stream info of a missing stream (an API error)",
            moved(1, 0, 0, 0, 1),
            async {
                assert!(js.get_stream("MISSING").await.is_err());
            },
        )
        .await;
}
