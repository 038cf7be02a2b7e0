//! The soak: two worker processes under mixed traffic for a bounded time (interactive and
//! durable completions, cancels, decisions and their continuations, tool calls, loops, bad
//! input of every kind), then checks that the fleet is back at rest and nothing was lost:
//! every request accounted for with the outcome it should have, every slot free, no message in
//! the queue, no record left but results, workers alive, and their memory flat.
//!
//! `GENFLEET_SOAK_SECS` sets the traffic time (default 300 s, as in CI; longer runs by hand,
//! e.g. 1800).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::fleet::{self, Fleet, request};
use genfleet::client::Client;
use genfleet::protocol::DecisionAnswer;
use genfleet::protocol::{ErrorCode, Reason, RequestState};

const SCRIPT: &str = r#"
[[rules]]
when_last_user_contains = "Decision chosen"
reply = "continued after the decision"

[[rules]]
when_last_role = "tool"
reply = "calculated: {{last_message}}"

[[rules]]
when_last_user_contains = "decide"
reply = "Two ways to go."
tool_calls = [{ name = "request_decision", arguments = { question = "Which path?", options = [{ id = "fast", label = "Fast" }, { id = "safe", label = "Safe" }], default_option = "safe" } }]

[[rules]]
when_last_user_contains = "calc"
tool_calls = [{ name = "calculate", arguments = { operation = "add", a = 2, b = 3 } }]

[[rules]]
when_last_user_contains = "loop"
reply = "the quick brown fox jumps over the dog!\n"
repeat = 40

[[rules]]
when_last_user_contains = "slow"
reply = "s01 s02 s03 s04 s05 s06 s07 s08 s09 s10 s11 s12 s13 s14 s15 s16"
delay_ms = 25

[[rules]]
reply = "quick done"
"#;

const SLOTS: u64 = 8;
const WORKERS: usize = 2;
/// Traffic generators running at once.
const CALLERS: usize = 6;
/// The most a worker's RSS may grow from the end of the warm-up to the end of the traffic, and
/// to the end of the reads of the results and the checks after it.
const RSS_GROWTH_BOUND_KIB: u64 = 24 * 1024;

#[derive(Default)]
struct Counts {
    by_kind: [AtomicU64; 8],
}

const KINDS: [&str; 8] = [
    "interactive",
    "durable",
    "cancel",
    "decision",
    "tool",
    "loop",
    "bad input",
    "bad durable",
];

/// What a request enqueued during the soak must end as.
enum Durable {
    Completed(String),
    InvalidRequest(String),
}

struct Soak {
    client: Client,
    counts: Counts,
    /// Submits refused because every slot was busy.
    full: AtomicU64,
    durable: std::sync::Mutex<Vec<Durable>>,
}

impl Soak {
    async fn one(&self, caller: usize, n: u64) {
        match self.try_one(caller, n).await {
            Outcome::Done => {}
            Outcome::Full => {
                self.full.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    async fn try_one(&self, caller: usize, n: u64) -> Outcome {
        let id = format!("soak-{caller}-{n}");
        let kind = (caller + n as usize) % 8;
        let wait = Duration::from_secs(30);
        match kind {
            0 => {
                let r = self
                    .client
                    .run("default", request(&id, "hello"), wait)
                    .await
                    .map_err(|e| full_or_panic(&id, e));
                let Ok(r) = r else { return Outcome::Full };
                assert_eq!(
                    (r.reason, r.output.as_str()),
                    (Reason::Stop, "quick done"),
                    "{id}"
                );
            }
            1 => {
                self.client
                    .enqueue("default", &request(&id, "hello"))
                    .await
                    .unwrap_or_else(|e| panic!("{id}: {e}"));
                self.durable.lock().unwrap().push(Durable::Completed(id));
            }
            2 => {
                let submitted = self
                    .client
                    .submit("default", &request(&id, "slow"))
                    .await
                    .map_err(|e| full_or_panic(&id, e));
                if submitted.is_err() {
                    return Outcome::Full;
                }
                // Paces the load: the cancel lands at a varied moment of the generation (or
                // after its end, which the match below accepts), not after anything in
                // particular.
                tokio::time::sleep(Duration::from_millis(40 + n % 200)).await;
                match self.client.cancel(&id).await {
                    Ok(_) => {}
                    Err(e) if e.code() == Some(ErrorCode::AlreadyFinished) => {}
                    Err(e) => panic!("{id}: cancel: {e}"),
                }
                let r = self
                    .client
                    .result(&id, true)
                    .await
                    .unwrap_or_else(|e| panic!("{id}: {e}"));
                assert!(
                    matches!(r.state, RequestState::Cancelled | RequestState::Completed),
                    "{id}: {r:?}"
                );
            }
            3 => {
                let first = self
                    .client
                    .run("default", request(&id, "decide"), wait)
                    .await
                    .map_err(|e| full_or_panic(&id, e));
                let Ok(first) = first else {
                    return Outcome::Full;
                };
                assert_eq!(first.reason, Reason::DecisionRequested, "{id}: {first:?}");
                let decision = first.signals[0].decision.clone().expect("a decision block");
                let reply = self
                    .client
                    .decide(
                        &decision.decision_id,
                        &DecisionAnswer {
                            option_id: "fast".into(),
                            rationale: Some("soak".into()),
                            decided_by: Some("soak".into()),
                            modified_prompt: None,
                            guidance: None,
                            confidence_boost: None,
                        },
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{id}: decide: {e}"));
                let next = reply.continuation_request_id.expect("a continuation");
                let r = fleet::terminal(&self.client, &next, wait).await;
                assert_eq!(r.output, "continued after the decision", "{next}");
                fleet::take_exactly_once(&self.client, &next).await;
            }
            4 => {
                let mut r = request(&id, "calc");
                r.tools = vec!["calculate".into()];
                let r = self
                    .client
                    .run("default", r, wait)
                    .await
                    .map_err(|e| full_or_panic(&id, e));
                let Ok(r) = r else { return Outcome::Full };
                assert_eq!(r.reason, Reason::Stop, "{id}: {r:?}");
                assert!(
                    r.output.starts_with("calculated:") && r.output.contains('5'),
                    "{id}: {r:?}"
                );
            }
            5 => {
                let r = self
                    .client
                    .run("default", request(&id, "loop"), wait)
                    .await
                    .map_err(|e| full_or_panic(&id, e));
                let Ok(r) = r else { return Outcome::Full };
                assert_eq!(r.reason, Reason::LoopDetected, "{id}: {r:?}");
            }
            6 => {
                // A request without messages, a body that is not JSON, an id that is not one
                // subject token: each a clear INVALID_REQUEST reply.
                let mut empty = request(&id, "x");
                empty.messages.clear();
                let e = self.client.submit("default", &empty).await.unwrap_err();
                assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{id}: {e}");
                let reply = self
                    .client
                    .nats()
                    .request("gen.submit.default", "{not json".into())
                    .await
                    .unwrap();
                assert!(
                    String::from_utf8_lossy(&reply.payload).contains("INVALID_REQUEST"),
                    "{id}"
                );
                let e = self
                    .client
                    .submit("default", &request(&format!("{id}.x y"), "x"))
                    .await
                    .unwrap_err();
                assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{id}: {e}");
            }
            _ => {
                // Garbage on the durable queue: stored as FAILED invalid_request.
                let js = async_nats::jetstream::new(self.client.nats().clone());
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", id.as_str());
                js.publish_with_headers(format!("gen.queue.default.{id}"), headers, "[1, 2".into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                self.durable
                    .lock()
                    .unwrap()
                    .push(Durable::InvalidRequest(id));
            }
        }
        self.counts.by_kind[kind].fetch_add(1, Ordering::Relaxed);
        Outcome::Done
    }
}

enum Outcome {
    Done,
    /// Refused with NO_SLOT_AVAILABLE: every slot was busy (a backlog of durable requests can
    /// fill them); nothing was accepted, so nothing can be lost.
    Full,
}

/// NO_SLOT_AVAILABLE is an answer a caller must expect; any other error fails the soak.
fn full_or_panic(id: &str, error: genfleet::client::ClientError) {
    assert_eq!(
        error.code(),
        Some(ErrorCode::NoSlotAvailable),
        "{id}: {error}"
    );
}

fn soak_time() -> Duration {
    let secs = std::env::var("GENFLEET_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    Duration::from_secs(secs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_traffic_for_minutes_leaves_the_fleet_at_rest_with_nothing_lost() {
    let soak_time = soak_time();
    let mut f = Fleet::builder()
        .script(SCRIPT)
        .default_settings()
        .worker_processes((0..WORKERS).map(|i| format!("soak-w{i}")))
        .slots(SLOTS as u32)
        // Records of running requests refreshed far more often than by default (30 s), so a
        // refresh meets requests that are just finishing many times in a soak.
        .worker_env("GENFLEET__JETSTREAM__RUNNING_REFRESH_MS", 100)
        .calculator()
        .start()
        .await;
    let workers = &mut f.processes;
    fleet::wait_all_slots_free(f.client.nats(), WORKERS, Duration::from_secs(20)).await;

    let soak = Arc::new(Soak {
        client: f.client.clone(),
        counts: Counts::default(),
        full: AtomicU64::new(0),
        durable: Default::default(),
    });
    let started = Instant::now();
    let warm_up = soak_time / 5;
    let callers: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let soak = soak.clone();
            tokio::spawn(async move {
                let mut n = 0;
                while started.elapsed() < soak_time {
                    soak.one(caller, n).await;
                    n += 1;
                }
            })
        })
        .collect();
    // Memory of each worker, sampled through the soak.
    let mut samples: Vec<(Duration, Vec<u64>)> = Vec::new();
    while started.elapsed() < soak_time {
        // Paces the samples through the soak; not a wait for anything.
        tokio::time::sleep(Duration::from_secs(2).min(soak_time / 10)).await;
        samples.push((
            started.elapsed(),
            workers.iter().map(|w| w.rss_kib()).collect(),
        ));
    }
    for caller in callers {
        caller.await.expect("a caller failed");
    }
    let traffic = started.elapsed();
    let after_traffic: Vec<u64> = workers.iter().map(|w| w.rss_kib()).collect();

    // Every durable request ends as it should, exactly once.
    let durable: Vec<Durable> = std::mem::take(&mut *soak.durable.lock().unwrap());
    for expected in &durable {
        let (id, reason) = match expected {
            Durable::Completed(id) => (id, Reason::Stop),
            Durable::InvalidRequest(id) => (id, Reason::InvalidRequest),
        };
        let r = fleet::terminal(&soak.client, id, Duration::from_secs(60)).await;
        assert_eq!(r.reason, reason, "{id}: {r:?}");
        fleet::take_exactly_once(&soak.client, id).await;
    }
    let after_reads: Vec<u64> = workers.iter().map(|w| w.rss_kib()).collect();
    eprintln!(
        "soak: RSS KiB after the traffic {after_traffic:?}, after reading {} durable results {after_reads:?}",
        durable.len()
    );
    let nats_client = soak.client.nats();
    fleet::wait_at_rest(nats_client, "default", WORKERS, Duration::from_secs(30)).await;
    // No decision is left waiting.
    let js = async_nats::jetstream::new(nats_client.clone());
    let decisions = js.get_key_value("GENFLEET_DECISIONS").await.unwrap();
    let mut keys = decisions.keys().await.unwrap();
    use futures_util::StreamExt;
    while let Some(Ok(key)) = keys.next().await {
        let entry = decisions.get(&key).await.unwrap().unwrap_or_default();
        let record: serde_json::Value = serde_json::from_slice(&entry).unwrap_or_default();
        assert_ne!(record["state"], "pending", "{key} still waits: {record}");
    }
    for worker in workers.iter_mut() {
        assert!(worker.running(), "{} died", worker.name);
    }

    let counts: BTreeMap<&str, u64> = KINDS
        .iter()
        .zip(&soak.counts.by_kind)
        .map(|(kind, n)| (*kind, n.load(Ordering::Relaxed)))
        .collect();
    let total: u64 = counts.values().sum();
    let full = soak.full.load(Ordering::Relaxed);
    eprintln!(
        "soak: {total} operations in {traffic:.1?}: {counts:?}; {full} submits refused with NO_SLOT_AVAILABLE"
    );
    for (kind, n) in &counts {
        assert!(*n > 0, "no {kind} operation ran");
    }
    // Memory under the traffic: what each worker grew from the end of the warm-up to the
    // end of the traffic (the largest sample of its last fifth).
    let after_warm_up = samples
        .iter()
        .find(|(at, _)| *at >= warm_up)
        .map(|(_, rss)| rss.clone())
        .expect("a sample after the warm-up");
    let late = soak_time - soak_time / 5;
    let end_of_traffic: Vec<u64> = (0..WORKERS)
        .map(|i| {
            samples
                .iter()
                .filter(|(at, _)| *at >= late)
                .map(|(_, rss)| rss[i])
                .max()
                .unwrap_or(after_traffic[i])
        })
        .collect();
    let peak: Vec<u64> = (0..WORKERS)
        .map(|i| samples.iter().map(|(_, rss)| rss[i]).max().unwrap_or(0))
        .collect();
    let at_rest = workers.iter().map(|w| w.rss_kib()).collect::<Vec<_>>();
    eprintln!(
        "soak: worker RSS KiB after warm-up {after_warm_up:?}, end of traffic {end_of_traffic:?}, \
         peak {peak:?}, at rest after the checks {at_rest:?}"
    );
    for i in 0..WORKERS {
        assert!(
            end_of_traffic[i] <= after_warm_up[i] + RSS_GROWTH_BOUND_KIB,
            "worker {i} grew from {} KiB to {} KiB under the traffic",
            after_warm_up[i],
            end_of_traffic[i]
        );
        assert!(
            at_rest[i] <= after_warm_up[i] + RSS_GROWTH_BOUND_KIB,
            "worker {i} grew from {} KiB to {} KiB by the end of the reads of the results",
            after_warm_up[i],
            at_rest[i]
        );
    }
}
