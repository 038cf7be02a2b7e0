//! The pool-wide limit on a tenant's running requests (`worker.tenants.pool_max_running`), on a
//! real nats-server with worker processes sharing one mock backend. What runs at once is read
//! from the mock: it counts a generation open from its request until its last frame is handed
//! out, before the worker can read it (so before the worker gives the tenant's place back),
//! and the most open at once is kept by the mock as it happens, so no moment is missed.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::fleet::{self, Fleet, request};
use common::wait;
use futures_util::StreamExt;
use genfleet::client::{Client, ClientError};
use genfleet::protocol::{ErrorCode, RequestState};

/// `block` answers take about 30 s (cancelled long before); every other answer is five tokens
/// 40 ms apart.
const SCRIPT: &str = "[[rules]]\nwhen_last_user_contains = \"block\"\n\
reply = \"a b c d e f g h i j k l m n o\"\ndelay_ms = 2000\n\n\
[[rules]]\nreply = \"one two three four five\"\ndelay_ms = 40\n";

const WITHIN: Duration = Duration::from_secs(120);
const POOL_LIMIT: &str = "GENFLEET__WORKER__TENANTS__POOL_MAX_RUNNING";

/// The pool's count of `tenant` in bucket GENFLEET_TENANTS, by worker (empty when absent).
async fn pool_count(nats: &async_nats::Client, tenant: &str) -> BTreeMap<String, u64> {
    let js = async_nats::jetstream::new(nats.clone());
    wait::until("the tenants' counts", WITHIN, || async {
        let kv = js
            .get_key_value("GENFLEET_TENANTS")
            .await
            .map_err(|e| e.to_string())?;
        let entry = kv
            .get(format!("default.{tenant}"))
            .await
            .map_err(|e| e.to_string())?;
        let Some(entry) = entry else {
            return Ok(BTreeMap::new());
        };
        let value: serde_json::Value = serde_json::from_slice(&entry).map_err(|e| e.to_string())?;
        Ok::<_, String>(
            value["running"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(worker, n)| (worker.clone(), n.as_u64().unwrap_or(0)))
                .collect(),
        )
    })
    .await
}

/// Waits (bounded) until the pool counts none of `tenant`'s requests.
async fn wait_count_zero(nats: &async_nats::Client, tenant: &str) {
    wait::until(
        &format!("the pool's count of {tenant} to come back to 0"),
        WITHIN,
        || async {
            let count = pool_count(nats, tenant).await;
            if count.values().sum::<u64>() == 0 {
                Ok(())
            } else {
                Err(format!("{count:?}"))
            }
        },
    )
    .await
}

/// How many times the backend was asked each prompt.
fn asked(f: &Fleet) -> BTreeMap<String, usize> {
    let mut asked = BTreeMap::new();
    for body in f.mock().requests() {
        let prompt = body["messages"]
            .as_array()
            .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
            .and_then(|m| m["content"].as_str())
            .unwrap_or_default()
            .to_string();
        *asked.entry(prompt).or_insert(0) += 1;
    }
    asked
}

/// A refusal of the pool limit, as the caller hears it.
fn pool_refusal(error: &ClientError) -> bool {
    error.code() == Some(ErrorCode::TenantLimit)
        && error
            .to_string()
            .contains("worker.tenants.pool_max_running")
}

#[tokio::test]
async fn a_flood_from_three_clients_never_runs_more_than_the_pool_limit_at_once() {
    const LIMIT: u64 = 3;
    let f = Fleet::builder()
        .default_settings()
        .script(SCRIPT)
        .slots(8)
        .worker_env(POOL_LIMIT, LIMIT)
        .worker_processes(["w1", "w2", "w3"])
        .start()
        .await;
    // Three clients, each with a connection of its own, each sending 40 submits of tenant
    // `acme`, 20 at a time, each sent again (a moment later) while it is refused.
    let mut clients = Vec::new();
    for _ in 0..3 {
        let client = Client::connect(&f.settings)
            .await
            .unwrap()
            .with_timeout(Duration::from_secs(30))
            .with_tenant("acme")
            .unwrap();
        clients.push(client);
    }
    f.mock().reset_most_open_streams();
    let floods = clients.iter().enumerate().map(|(c, client)| async move {
        futures_util::stream::iter(0..40)
            .map(|i| async move {
                let id = format!("c{c}-{i}");
                let mut refused = 0;
                loop {
                    match client.submit("default", &request(&id, &id)).await {
                        Ok(reply) => return (id, reply, refused),
                        Err(error) => {
                            assert!(pool_refusal(&error), "{id}: refused otherwise: {error}");
                            refused += 1;
                        }
                    }
                    // Paces the tries, as a caller told to retry later would.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .buffer_unordered(20)
            .collect::<Vec<_>>()
            .await
    });
    let outcomes: Vec<_> = futures_util::future::join_all(floods)
        .await
        .into_iter()
        .flatten()
        .collect();
    let mut accepted = Vec::new();
    let mut refused = 0;
    for (id, reply, refusals) in outcomes {
        assert_eq!(reply.state, RequestState::Running, "{id}: {reply:?}");
        accepted.push(id);
        refused += refusals;
    }
    let acme = clients[0].clone();
    for id in &accepted {
        let r = fleet::terminal(&acme, id, WITHIN).await;
        assert_eq!((r.state, r.attempt), (RequestState::Completed, 1), "{r:?}");
    }
    let most = f.mock().most_open_streams();
    println!(
        "pool limit {LIMIT}: at most {most} of tenant acme's requests ran at once; {} accepted, {refused} submits refused TENANT_LIMIT",
        accepted.len()
    );
    assert!((1..=LIMIT).contains(&most), "{most} ran at once");
    assert_eq!(accepted.len(), 120);
    // Each accepted request reached the backend once, and no refused one ever did.
    let asked = asked(&f);
    for id in &accepted {
        assert_eq!(asked.get(id), Some(&1), "{id}: {asked:?}");
    }
    assert_eq!(asked.values().sum::<usize>(), accepted.len(), "{asked:?}");
    // The count comes back to 0, and exactly the limit of new requests run again.
    wait_count_zero(f.client.nats(), "acme").await;
    let mut blockers = Vec::new();
    for i in 0..LIMIT {
        let id = format!("after-{i}");
        let accepted = acme
            .submit("default", &request(&id, "block"))
            .await
            .unwrap();
        assert_eq!(accepted.state, RequestState::Running);
        blockers.push(id);
    }
    let over = acme
        .submit("default", &request("after-over", "block"))
        .await;
    assert!(
        matches!(&over, Err(error) if pool_refusal(error)),
        "{over:?}"
    );
    // Another tenant is not held back by acme's limit.
    let other = f.client.clone().with_tenant("other").unwrap();
    let accepted = other
        .submit("default", &request("o-1", "o-1"))
        .await
        .unwrap();
    assert_eq!(accepted.state, RequestState::Running);
    for id in &blockers {
        acme.cancel(id).await.unwrap();
    }
    wait_count_zero(f.client.nats(), "acme").await;
    // What a compare-and-set of a count costs (the extra write a limited request waits for
    // before it starts; the one that gives its place back is off its path).
    let js = async_nats::jetstream::new(f.client.nats().clone());
    let kv = js.get_key_value("GENFLEET_TENANTS").await.unwrap();
    let mut revision = kv.put("default.timing", "{}".into()).await.unwrap();
    let mut took = Vec::new();
    for _ in 0..200 {
        let started = Instant::now();
        revision = kv
            .update("default.timing", "{\"running\":{}}".into(), revision)
            .await
            .unwrap();
        took.push(started.elapsed());
    }
    took.sort();
    println!(
        "a count's compare-and-set: p50 {:?}, p99 {:?} (200 writes)",
        took[100], took[197]
    );
}

#[tokio::test]
async fn a_durable_flood_over_the_pool_limit_all_runs_never_more_than_the_limit_at_once() {
    const LIMIT: u64 = 2;
    let f = Fleet::builder()
        .default_settings()
        .script(SCRIPT)
        .slots(2)
        .worker_env(POOL_LIMIT, LIMIT)
        .worker_processes(["w1", "w2", "w3"])
        .start()
        .await;
    let acme = f.client.clone().with_tenant("acme").unwrap();
    f.mock().reset_most_open_streams();
    let ids: Vec<String> = (0..30).map(|i| format!("q-{i}")).collect();
    let mut sent = futures_util::stream::iter(ids.iter())
        .map(|id| {
            let acme = acme.clone();
            async move { acme.enqueue("default", &request(id, id)).await }
        })
        .buffer_unordered(10);
    while let Some(queued) = sent.next().await {
        queued.unwrap();
    }
    // Every one runs, once, and waiting for its tenant's place spent none of its deliveries.
    for id in &ids {
        let r = fleet::terminal(&acme, id, WITHIN).await;
        assert_eq!((r.state, r.attempt), (RequestState::Completed, 1), "{r:?}");
    }
    let most = f.mock().most_open_streams();
    println!("pool limit {LIMIT}: at most {most} of 30 queued requests ran at once");
    assert!((1..=LIMIT).contains(&most), "{most} ran at once");
    let asked = asked(&f);
    for id in &ids {
        assert_eq!(asked.get(id), Some(&1), "{id}: {asked:?}");
    }
    wait_count_zero(f.client.nats(), "acme").await;
    fleet::wait_queue_empty(f.client.nats(), "default", WITHIN).await;
    // An idle pool writes no count: the workers try every queue they know each second, and
    // an empty one costs no place. Two heartbeats of each worker span several such tries.
    let js = async_nats::jetstream::new(f.client.nats().clone());
    let last = |stream: &'static str| {
        let js = js.clone();
        async move {
            let mut stream = js.get_stream(stream).await.unwrap();
            stream.info().await.unwrap().state.last_sequence
        }
    };
    let counts_before = last("KV_GENFLEET_TENANTS").await;
    let beats_before = last("KV_GENFLEET_WORKERS").await;
    wait::until("two heartbeats of each worker", WITHIN, || async {
        match last("KV_GENFLEET_WORKERS").await - beats_before {
            beats if beats >= 6 => Ok(()),
            beats => Err(format!("{beats} heartbeats")),
        }
    })
    .await;
    assert_eq!(last("KV_GENFLEET_TENANTS").await, counts_before);
}

#[tokio::test]
async fn requests_queued_while_no_worker_ran_wait_for_their_places_on_the_workers_that_pull_them() {
    const LIMIT: u64 = 2;
    let f = Fleet::builder()
        .default_settings()
        .script(SCRIPT)
        .slots(2)
        .settings(|s| s.worker.tenants.pool_max_running = LIMIT as u32)
        .workers(0)
        .start()
        .await;
    // A worker makes the queue, and leaves; what is queued then is heard of by no worker, so
    // the workers that start next pull it on a guess, before they take its places: those
    // that find none left keep their messages until a place frees.
    f.start_worker().await.stop().unwrap();
    let ids: Vec<String> = (0..20).map(|i| format!("early-{i}")).collect();
    for id in &ids {
        f.client.enqueue("default", &request(id, id)).await.unwrap();
    }
    f.mock().reset_most_open_streams();
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(f.start_worker().await);
    }
    for id in &ids {
        let r = fleet::terminal(&f.client, id, WITHIN).await;
        assert_eq!((r.state, r.attempt), (RequestState::Completed, 1), "{r:?}");
    }
    let most = f.mock().most_open_streams();
    println!(
        "pool limit {LIMIT}: at most {most} of 20 requests queued before the workers ran at once"
    );
    assert!((1..=LIMIT).contains(&most), "{most} ran at once");
    let asked = asked(&f);
    for id in &ids {
        assert_eq!(asked.get(id), Some(&1), "{id}: {asked:?}");
    }
    wait_count_zero(f.client.nats(), "default").await;
    fleet::wait_queue_empty(f.client.nats(), "default", WITHIN).await;
}

#[tokio::test]
async fn a_killed_workers_count_holds_its_tenant_back_only_until_it_is_lost() {
    let mut f = Fleet::builder()
        .default_settings()
        .script(SCRIPT)
        .slots(4)
        .settings(|s| {
            s.worker.heartbeat_ms = 300;
            s.worker.lost_after_ms = 1500;
        })
        .worker_env(POOL_LIMIT, 2)
        .worker_env("GENFLEET__WORKER__HEARTBEAT_MS", 300)
        .worker_env("GENFLEET__WORKER__LOST_AFTER_MS", 1500)
        .worker_processes(["doomed"])
        .start()
        .await;
    let acme = f.client.clone().with_tenant("acme").unwrap();
    for id in ["held-1", "held-2"] {
        let accepted = acme.submit("default", &request(id, "block")).await.unwrap();
        assert_eq!(
            (accepted.state, accepted.worker_id.as_str()),
            (RequestState::Running, "doomed")
        );
    }
    let _survivor = f.start_worker_process("survivor", &[]);
    fleet::wait_workers(f.client.nats(), 2, WITHIN, f.logs()).await;
    // The doomed worker is live: its two count, wherever the submit lands.
    for i in 0..4 {
        let over = acme
            .submit("default", &request(&format!("over-{i}"), "block"))
            .await;
        assert!(
            matches!(&over, Err(error) if pool_refusal(error)),
            "{over:?}"
        );
    }
    assert_eq!(pool_count(f.client.nats(), "acme").await["doomed"], 2);
    f.processes[0].kill();
    // Once its heartbeat is gone, its count no longer holds acme back.
    let tries = std::sync::atomic::AtomicU32::new(0);
    let id = wait::until(
        "a request of acme to run after the kill",
        WITHIN,
        || async {
            let id = format!("after-{}", tries.fetch_add(1, Ordering::Relaxed));
            match acme.submit("default", &request(&id, "block")).await {
                Ok(accepted) => Ok(accepted),
                Err(error) if pool_refusal(&error) => Err(error.to_string()),
                Err(error) => panic!("refused otherwise: {error}"),
            }
        },
    )
    .await;
    assert_eq!(
        (id.state, id.worker_id.as_str()),
        (RequestState::Running, "survivor")
    );
    // The write that let it in dropped the lost worker's count.
    let count = pool_count(f.client.nats(), "acme").await;
    assert_eq!(count, BTreeMap::from([("survivor".to_string(), 1)]));
    acme.cancel(&id.request_id).await.unwrap();
}

#[tokio::test]
async fn a_worker_restarted_under_its_id_does_not_keep_its_earlier_runs_count() {
    // Its heartbeat never expires in this test: only the restarted worker can drop the count.
    let mut f = Fleet::builder()
        .default_settings()
        .script(SCRIPT)
        .slots(4)
        .worker_env(POOL_LIMIT, 2)
        .worker_env("GENFLEET__WORKER__LOST_AFTER_MS", 600_000)
        .worker_processes(["w1"])
        .start()
        .await;
    let acme = f.client.clone().with_tenant("acme").unwrap();
    for id in ["before-1", "before-2"] {
        let accepted = acme.submit("default", &request(id, "block")).await.unwrap();
        assert_eq!(accepted.state, RequestState::Running);
    }
    assert_eq!(pool_count(f.client.nats(), "acme").await["w1"], 2);
    f.processes[0].kill();
    let _again = f.start_worker_process("w1", &[]);
    fleet::wait_workers(f.client.nats(), 1, WITHIN, f.logs()).await;
    // The new run holds none of acme's requests, and says so.
    wait_count_zero(f.client.nats(), "acme").await;
    for id in ["after-1", "after-2"] {
        let accepted = acme.submit("default", &request(id, "block")).await.unwrap();
        assert_eq!(accepted.state, RequestState::Running);
    }
    for id in ["after-1", "after-2"] {
        acme.cancel(id).await.unwrap();
    }
}
