//! Affinity: every turn of a conversation goes to its key's worker, the first of the pool's
//! live workers ranked by rendezvous hashing of the key with their ids, whoever sends it (a
//! client that follows the heartbeats, a one-shot command that knows nothing, either of two
//! gateways); a worker leaving moves only its keys; a key's worker with no free slot, or
//! busier than the load bound allows, passes the request to the next in rank, and nobody waits
//! for it (real nats-server, worker processes, each with a mock backend of its own that has a
//! prefix cache).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::fleet::{self, Fleet, Proc};
use common::nats::free_port;
use common::process::Running;
use futures_util::StreamExt;
use genfleet::client::Client;
use genfleet::client::fleet::Following;
use genfleet::llm::mock::{MockServer, PrefixCacheSettings, Rule, Script};
use genfleet::protocol::{
    ErrorCode, EventBody, GenerationRequest, GenerationResult, Message, Reason, RequestState,
};
use genfleet::schedule::{WorkerLoad, choose, rank};

const WORKERS: usize = 4;
const SLOTS: u32 = 4;
const CHAINS: usize = 24;
const TURNS: usize = 4;
/// Chains running at once. The chains test gives each worker more slots than this, so that no
/// worker is ever full, even in a heartbeat that shows every chain running on it.
const AT_ONCE: usize = 8;
const WAIT: Duration = Duration::from_secs(60);
/// How long one call may take: the test's processes share two cores with whatever else the
/// machine runs.
const CALL_WITHIN: Duration = Duration::from_secs(30);

/// Echoes, except for `slow` requests (a 50-word reply, a word a second: they hold their slot
/// until cancelled); the prefix cache only counts, it adds no wait.
fn script() -> Script {
    Script::new(vec![
        Rule::reply("slow ".repeat(50))
            .when_last_user_contains("slow")
            .delay_ms(1000),
    ])
    .with_prefix_cache(PrefixCacheSettings {
        entries: 4096,
        prefix_hit_ms: 0,
        prefill_ms_per_kb: 0,
    })
}

/// The worker processes' ids.
fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("w{i}")).collect()
}

/// A fleet of worker processes `w0`..`w3` with `slots` each, each on its own mock, placing
/// keyed requests with `load_factor` (the test's client too), once every worker ranks all.
async fn fleet_of_four(
    slots: u32,
    load_factor: f64,
    extra: &[(&'static str, String)],
) -> (Fleet, Vec<MockServer>, Vec<Proc>) {
    let f = Fleet::builder()
        .worker_processes(Vec::<String>::new())
        .slots(slots)
        .settings(move |s| s.placement.load_factor = load_factor)
        .client_timeout(CALL_WITHIN)
        .start()
        .await;
    let mut mocks = Vec::new();
    let mut workers = Vec::new();
    for id in ids(WORKERS) {
        let mock = MockServer::start(script()).await.expect("a mock starts");
        let mut env = vec![
            ("GENFLEET__LLM__BASE_URL", mock.base_url()),
            ("GENFLEET__PLACEMENT__LOAD_FACTOR", load_factor.to_string()),
        ];
        env.extend(extra.iter().cloned());
        workers.push(f.start_worker_process(&id, &env));
        mocks.push(mock);
    }
    let all = ids(WORKERS);
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    fleet::wait_placement(f.client.nats(), &all, WAIT).await;
    // The test's client ranks from the same workers as they do.
    client_sees(&f.client, &f.settings.worker.pool, &ids(WORKERS)).await;
    (f, mocks, workers)
}

/// A client of the same fleet that follows no heartbeats: its keyed submits go to the pool,
/// whose worker places them.
fn unplaced(client: &Client) -> Client {
    client
        .clone()
        .with_placement(&genfleet::settings::PlacementSettings {
            follow_heartbeats: false,
            load_factor: 0.0,
        })
}

/// Waits until the client's view of the pool holds exactly `ids`.
async fn client_sees(client: &Client, pool: &str, ids: &[String]) {
    let fleet = client
        .follow_fleet()
        .expect("the client follows the heartbeats");
    common::wait::until("the client to see the pool's workers", WAIT, || async {
        let seen: Vec<String> = fleet.workers_of(pool).into_iter().map(|w| w.0).collect();
        (fleet.following() == Following::Ready && seen == ids).then_some(())
    })
    .await;
}

/// The key's worker among `ids`.
fn key_worker(key: &str, ids: &[String]) -> String {
    rank(key, ids.iter().map(String::as_str))[0].to_string()
}

/// Checks a keyed result ran on its key's worker among `ids`, with a record that says so.
fn assert_on_its_worker(result: &GenerationResult, key: &str, ids: &[String]) {
    let record = result
        .affinity
        .as_ref()
        .expect("a keyed request has a record");
    let expected = key_worker(key, ids);
    assert_eq!(record.key, key);
    assert_eq!(
        record.preferred_worker.as_deref(),
        Some(expected.as_str()),
        "{record:?}"
    );
    assert!(record.held && record.fallback.is_none(), "{record:?}");
    assert_eq!(result.worker_id, expected, "{key}");
}

fn keyed(key: &str, messages: Vec<Message>) -> GenerationRequest {
    GenerationRequest {
        messages,
        affinity_key: Some(key.to_string()),
        ..GenerationRequest::default()
    }
}

/// One conversation: each turn sends the previous turn's messages, its answer and a new
/// question.
async fn chain(client: Client, pool: String, key: String) -> (String, Vec<GenerationResult>) {
    let mut messages = Vec::new();
    let mut results = Vec::new();
    for turn in 1..=TURNS {
        messages.push(Message::user(format!("{key}, turn {turn}: go on")));
        let result = client
            .run(&pool, keyed(&key, messages.clone()), WAIT)
            .await
            .unwrap_or_else(|e| panic!("{key} turn {turn} runs: {e}"));
        assert_eq!(result.reason, Reason::Stop, "{result:?}");
        messages.push(Message::assistant(result.output.clone()));
        results.push(result);
    }
    (key, results)
}

/// One turn through `genfleet submit --affinity KEY --follow --json`: a process that knows
/// nothing of the fleet.
async fn one_shot(f: &Fleet, key: &str, messages: &[Message]) -> GenerationResult {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("request.json");
    std::fs::write(
        &file,
        serde_json::to_vec(&serde_json::json!({ "messages": messages })).unwrap(),
    )
    .unwrap();
    let output = common::process::genfleet_command()
        .args(["submit", "--affinity", key, "--follow", "--json", "--file"])
        .arg(&file)
        .env("GENFLEET__NATS__URL", f.nats.url())
        .output()
        .expect("genfleet submit runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("a result: {e}: {}", String::from_utf8_lossy(&output.stdout)))
}

/// A `genfleet gateway` process with no keys, on loopback (the pool is the model).
fn gateway(f: &Fleet, load_factor: f64) -> (Running, u16) {
    let port = free_port();
    let env = vec![
        ("GENFLEET__NATS__URL", f.nats.url()),
        ("GENFLEET__GATEWAY__LISTEN", format!("127.0.0.1:{port}")),
        ("GENFLEET__PLACEMENT__LOAD_FACTOR", load_factor.to_string()),
    ];
    let mut process = Running::start("gateway", &["gateway"], &env);
    process.wait_for("gateway listening on");
    (process, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sender_lands_a_key_on_its_keys_worker() {
    let (f, mocks, _workers) = fleet_of_four(AT_ONCE as u32 + 1, 0.0, &[]).await;
    let pool = f.settings.worker.pool.clone();
    let all = ids(WORKERS);
    // Every result, as its `finished` event carries it (the gateway's too).
    let mut finished = f.client.nats().subscribe("gen.events.>").await.unwrap();
    f.client.nats().flush().await.unwrap();

    // A client that follows the heartbeats sends straight to the key's worker.
    client_sees(&f.client, &pool, &all).await;
    let chains: Vec<(String, Vec<GenerationResult>)> = futures_util::stream::iter(0..CHAINS)
        .map(|i| chain(f.client.clone(), pool.clone(), format!("chain-{i}")))
        .buffer_unordered(AT_ONCE)
        .collect()
        .await;
    let mut later = 0;
    for (key, results) in &chains {
        for result in results {
            assert_on_its_worker(result, key, &all);
        }
        later += results.len() - 1;
    }

    // One-shot commands know nothing: the pool's worker that receives each places it.
    for key in ["cli-a", "cli-b", "cli-c"] {
        let mut messages = Vec::new();
        for turn in 1..=3 {
            messages.push(Message::user(format!("{key}, turn {turn}: go on")));
            let result = one_shot(&f, key, &messages).await;
            assert_on_its_worker(&result, key, &all);
            messages.push(Message::assistant(result.output.clone()));
            later += usize::from(turn > 1);
        }
    }

    // Two gateway replicas taking turns, as a Service spreads a session's requests.
    let gateways = [gateway(&f, 0.0), gateway(&f, 0.0)];
    let http = reqwest::Client::new();
    let sessions = ["gw-a", "gw-b", "gw-c"];
    for session in sessions {
        let mut messages = Vec::new();
        for turn in 1..=4 {
            messages.push(serde_json::json!({"role": "user", "content": format!("{session}, turn {turn}: go on")}));
            let (_, port) = &gateways[turn % 2];
            let answer: serde_json::Value = http
                .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
                .json(&serde_json::json!({"model": pool, "messages": messages, "user": session}))
                .send()
                .await
                .expect("the gateway answers")
                .json()
                .await
                .expect("a completion");
            let text = answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_else(|| panic!("a completion: {answer}"))
                .to_string();
            messages.push(serde_json::json!({"role": "assistant", "content": text}));
            later += usize::from(turn > 1);
        }
    }
    // The gateways' results, from their `finished` events.
    let mut through_gateways: BTreeMap<String, Vec<GenerationResult>> = BTreeMap::new();
    let wanted = sessions.len() * 4;
    let counted = tokio::time::timeout(WAIT, async {
        while through_gateways.values().map(Vec::len).sum::<usize>() < wanted {
            let message = finished.next().await.expect("events");
            let Ok(event) = serde_json::from_slice::<genfleet::protocol::Event>(&message.payload)
            else {
                continue;
            };
            if let EventBody::Finished { result } = event.body
                && let Some(record) = &result.affinity
                && sessions.contains(&record.key.as_str())
            {
                through_gateways
                    .entry(record.key.clone())
                    .or_default()
                    .push(*result);
            }
        }
    })
    .await;
    assert!(counted.is_ok(), "{through_gateways:?}");
    for (session, results) in &through_gateways {
        for result in results {
            assert_on_its_worker(result, session, &all);
        }
    }
    // Every later turn found its conversation in its backend's cache.
    let hits: u64 = mocks
        .iter()
        .map(|m| m.prefix_cache_stats().expect("a cache").hits)
        .sum();
    assert!(
        hits >= later as u64,
        "{hits} prefix hits for {later} later turns"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_leaving_moves_only_its_keys_and_one_joining_takes_only_keys_it_ranks_first() {
    let (f, mocks, mut workers) = fleet_of_four(SLOTS, 0.0, &[]).await;
    let pool = f.settings.worker.pool.clone();
    let keys: Vec<String> = (0..40).map(|i| format!("key-{i}")).collect();
    let run_all = |live: Vec<String>| {
        let client = f.client.clone();
        let pool = pool.clone();
        let keys = keys.clone();
        async move {
            let mut on = BTreeMap::new();
            for key in &keys {
                let result = client
                    .run(
                        &pool,
                        keyed(key, vec![Message::user(format!("{key}: hello"))]),
                        WAIT,
                    )
                    .await
                    .expect("it runs");
                assert_on_its_worker(&result, key, &live);
                on.insert(key.clone(), result.worker_id);
            }
            on
        }
    };
    let four = ids(WORKERS);
    let before = run_all(four.clone()).await;

    // w3 stops (a scale-in): its heartbeat goes with it.
    workers[3].terminate();
    let three = ids(3);
    fleet::wait_placement(f.client.nats(), &["w0", "w1", "w2"], WAIT).await;
    client_sees(&f.client, &pool, &three).await;
    let after = run_all(three.clone()).await;
    for key in &keys {
        if before[key] != "w3" {
            assert_eq!(
                after[key], before[key],
                "{key} moved though its worker stayed"
            );
        }
    }
    assert!(
        before.values().any(|w| w == "w3"),
        "some keys were w3's: {before:?}"
    );

    // w4 joins: the keys that move all move to it.
    let mock = MockServer::start(script()).await.expect("a mock starts");
    workers.push(f.start_worker_process(
        "w4",
        &[
            ("GENFLEET__LLM__BASE_URL", mock.base_url()),
            ("GENFLEET__PLACEMENT__LOAD_FACTOR", "0".to_string()),
        ],
    ));
    fleet::wait_placement(f.client.nats(), &["w0", "w1", "w2", "w4"], WAIT).await;
    let mut joined = three.clone();
    joined.push("w4".into());
    client_sees(&f.client, &pool, &joined).await;
    let last = run_all(joined).await;
    for key in &keys {
        if last[key] != after[key] {
            assert_eq!(last[key], "w4", "{key} moved between workers that stayed");
        }
    }
    drop(mocks);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_spills_to_the_next_in_rank_not_to_a_random_worker() {
    // Heartbeats every 100 ms, so the client soon sees each request it placed.
    let (f, _mocks, _workers) = fleet_of_four(
        SLOTS,
        2.0,
        &[("GENFLEET__WORKER__HEARTBEAT_MS", "100".to_string())],
    )
    .await;
    let pool = f.settings.worker.pool.clone();
    let all = ids(WORKERS);
    client_sees(&f.client, &pool, &all).await;
    let fleet = f.client.fleet().expect("following").clone();
    let mut busy: BTreeMap<String, u32> = all.iter().map(|w| (w.clone(), 0)).collect();
    let mut slow = Vec::new();
    for n in 0..8 {
        // The client places by what the heartbeats say: wait until they say what runs.
        common::wait::until("the heartbeats to show what runs", WAIT, || async {
            let seen: BTreeMap<String, u32> = fleet
                .workers_of(&pool)
                .into_iter()
                .map(|(id, _, busy)| (id, busy))
                .collect();
            (seen == busy).then_some(())
        })
        .await;
        let loads: Vec<WorkerLoad> = busy
            .iter()
            .map(|(id, busy)| WorkerLoad {
                worker_id: id.clone(),
                slots: SLOTS,
                busy: *busy,
            })
            .collect();
        let expected = choose("hot", &loads, 2.0).expect("a free slot");
        let mut request = keyed("hot", vec![Message::user("slow, please")]);
        request.request_id = Some(format!("hot-{n}"));
        let accepted = f.client.submit(&pool, &request).await.expect("taken");
        assert_eq!(accepted.worker_id, expected.worker, "request {n}");
        *busy.get_mut(&accepted.worker_id).unwrap() += 1;
        slow.push(request.request_id.unwrap());
    }
    // The key's worker and the next in rank share the hot key; the rest get none of it.
    let ranked = rank("hot", all.iter().map(String::as_str));
    assert_eq!(busy[ranked[0]], 4, "{busy:?}");
    assert_eq!(busy[ranked[1]], 4, "{busy:?}");
    for id in &slow {
        stop(&f.client, id).await;
    }
    for id in &slow {
        let result = fleet::terminal(&f.client, id, WAIT).await;
        let record = result.affinity.expect("a record");
        assert_eq!(record.preferred_worker.as_deref(), Some(ranked[0]));
        assert_eq!(record.held, result.worker_id == ranked[0], "{record:?}");
        if !record.held {
            // Passed over for its load, or once it was full, for want of a slot.
            assert!(
                matches!(record.fallback.as_deref(), Some("load" | "busy")),
                "{record:?}"
            );
        }
    }
}

/// Fills `worker`'s slots with slow requests sent to its own subject; their ids.
async fn fill(f: &Fleet, worker: &str, slots: u32, prefix: &str) -> Vec<String> {
    let mut slow = Vec::new();
    for n in 0..slots {
        let id = format!("{prefix}-slow-{n}");
        let mut request = GenerationRequest::user("slow, please");
        request.request_id = Some(id.clone());
        let reply = f
            .client
            .nats()
            .request(
                format!("gen.worker.{worker}.submit"),
                serde_json::to_vec(&request).unwrap().into(),
            )
            .await
            .expect("the worker answers");
        let accepted: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(accepted["worker_id"], worker, "{accepted}");
        slow.push(id);
    }
    slow
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_keys_worker_passes_the_request_on_at_once() {
    let (f, _mocks, _workers) = fleet_of_four(SLOTS, 0.0, &[]).await;
    let pool = f.settings.worker.pool.clone();
    let all = ids(WORKERS);
    let preferred = key_worker("busy", &all);
    let slow = fill(&f, &preferred, SLOTS, "busy").await;
    // However the heartbeats stand, the request runs at once elsewhere and says why.
    let result = f
        .client
        .run(&pool, keyed("busy", vec![Message::user("hello")]), WAIT)
        .await
        .expect("it runs");
    let record = result
        .affinity
        .clone()
        .expect("a keyed request has a record");
    assert_eq!(record.preferred_worker.as_deref(), Some(preferred.as_str()));
    assert!(!record.held);
    assert_eq!(record.fallback.as_deref(), Some("busy"));
    assert_ne!(result.worker_id, preferred);
    // So does a request from a client that follows nothing, through the pool's worker.
    let plain = unplaced(&f.client);
    let accepted = plain
        .submit(&pool, &keyed("busy", vec![Message::user("hello again")]))
        .await
        .expect("taken");
    assert_eq!(accepted.state, RequestState::Running, "it never waits");
    assert_ne!(accepted.worker_id, preferred);
    for id in &slow {
        stop(&f.client, id).await;
    }
    // A request without a key has no record and is placed as before.
    let plain = f
        .client
        .run(&pool, GenerationRequest::user("no key"), WAIT)
        .await
        .expect("it runs");
    assert_eq!(plain.affinity, None);
}

/// Cancels a slow request (one that ended meanwhile is as good).
async fn stop(client: &Client, id: &str) {
    if let Err(error) = client.cancel(id).await {
        assert_eq!(
            error.code(),
            Some(ErrorCode::AlreadyFinished),
            "{id}: {error}"
        );
    }
}

/// A request that stops at its `prod` checkpoint for a manager's answer; `key`: its affinity
/// key.
fn guarded(id: &str, key: Option<&str>) -> GenerationRequest {
    serde_json::from_value(serde_json::json!({
        "request_id": id,
        "messages": [{"role": "user", "content": "Deploy build 7 to production."}],
        "checkpoints": [{"name": "prod", "prompt_contains": ["production"]}],
        "affinity_key": key,
    }))
    .expect("a valid request")
}

/// Runs a guarded request to its checkpoint, fills its worker with `busy` slow requests, then
/// answers `proceed`: the continuation, and the worker that ran the request before it.
async fn continued(
    f: &Fleet,
    id: &str,
    key: Option<&str>,
    busy: usize,
) -> (GenerationResult, String) {
    let pool = f.settings.worker.pool.clone();
    let first = f
        .client
        .run(&pool, guarded(id, key), WAIT)
        .await
        .expect("the request runs");
    assert_eq!(first.reason, Reason::DecisionRequested, "{first:?}");
    let decision = first
        .signals
        .iter()
        .find_map(|s| s.decision.clone())
        .expect("a decision");
    // Slow requests take the worker's slots.
    let slow = fill(f, &first.worker_id, busy as u32, id).await;
    let reply = f
        .client
        .nats()
        .request(
            format!("decisions.{}", decision.decision_id),
            serde_json::to_vec(&serde_json::json!({"option_id": "proceed"}))
                .unwrap()
                .into(),
        )
        .await
        .expect("the answer is answered");
    let reply: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap_or_else(|| panic!("a continuation: {reply}"))
        .to_string();
    let result = fleet::wait_result(
        &f.client,
        &continuation,
        WAIT,
        fleet::RUNNING_UNCLAIMED_OR_UNANSWERED,
    )
    .await;
    for id in &slow {
        stop(&f.client, id).await;
    }
    (result, first.worker_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_goes_back_to_its_chain_worker_unless_it_is_busy() {
    let (f, _mocks, _workers) = fleet_of_four(SLOTS, 0.0, &[]).await;
    // Its worker is free: the continuation runs there, keyed by the chain's root.
    let (next, before) = continued(&f, "cp-free", None, 0).await;
    assert_eq!(
        (next.reason, next.chain_position),
        (Reason::Stop, 2),
        "{next:?}"
    );
    assert_eq!(next.root_request_id, "cp-free");
    assert_eq!(next.worker_id, before);
    let record = next.affinity.expect("a continuation has a record");
    assert_eq!(record.key, "cp-free");
    assert_eq!(record.preferred_worker, Some(before.clone()));
    assert!(record.held && record.fallback.is_none(), "{record:?}");

    // Its worker is full: the continuation goes to the queue at once and another runs it.
    let (next, before) = continued(&f, "cp-busy", None, SLOTS as usize).await;
    assert_eq!(
        (next.reason, next.chain_position),
        (Reason::Stop, 2),
        "{next:?}"
    );
    // Should the busy worker pull it (a pull sent before its slots filled), it gives it back
    // at once to a free worker, and that delivery is no attempt.
    assert_ne!(next.worker_id, before);
    assert_eq!(next.attempt, 1, "{next:?}");
    let record = next.affinity.expect("a continuation has a record");
    assert_eq!(record.key, "cp-busy");
    assert_eq!(record.preferred_worker, Some(before));
    assert!(!record.held);
    assert_eq!(record.fallback.as_deref(), Some("busy"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_continuation_goes_to_its_keys_worker() {
    let (f, _mocks, _workers) = fleet_of_four(SLOTS, 0.0, &[]).await;
    let all = ids(WORKERS);
    let (next, before) = continued(&f, "kc-1", Some("kc-session"), 0).await;
    assert_eq!(
        (next.reason, next.chain_position),
        (Reason::Stop, 2),
        "{next:?}"
    );
    // The request and its continuation both ran on the key's worker.
    assert_eq!(before, key_worker("kc-session", &all));
    assert_on_its_worker(&next, "kc-session", &all);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_worker_that_crashed_costs_its_keys_nothing_but_their_cache() {
    let (f, _mocks, mut workers) = fleet_of_four(SLOTS, 0.0, &[]).await;
    let pool = f.settings.worker.pool.clone();
    let all = ids(WORKERS);
    // Keys whose worker is w3.
    let keys: Vec<String> = (0..200)
        .map(|i| format!("crash-{i}"))
        .filter(|key| key_worker(key, &all) == "w3")
        .take(4)
        .collect();
    assert_eq!(keys.len(), 4);
    // Killed: its heartbeat stays in the bucket until `worker.lost_after_ms`, so for a while
    // the others still rank it.
    workers[3].kill();
    let following = f.client.clone();
    let plain = unplaced(&f.client);
    for (n, key) in keys.iter().enumerate() {
        for (client, how) in [(&following, "following"), (&plain, "plain")] {
            let result = client
                .run(
                    &pool,
                    keyed(key, vec![Message::user(format!("{key} {n}"))]),
                    WAIT,
                )
                .await
                .unwrap_or_else(|e| panic!("{how} {key}: {e}"));
            assert_eq!(result.reason, Reason::Stop, "{result:?}");
            assert_ne!(result.worker_id, "w3");
        }
    }
}

/// A key's worker whose own subject takes the submit and never answers (a node lost without
/// closing its connections keeps its subscriptions for minutes): the following client waits a
/// moment for it, then the pool runs the request, and the record says the key's worker was
/// passed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_worker_that_never_answers_is_passed_over_for_the_pool() {
    let (f, _mocks, _workers) = fleet_of_four(SLOTS, 0.0, &[]).await;
    let pool = f.settings.worker.pool.clone();
    let client = &f.client;
    // "ghost": a heartbeat with free slots, and a subscriber on its own submit subject that
    // never answers.
    let mut silent = client
        .nats()
        .subscribe(client.subjects().worker_submit("ghost", None))
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client.nats().clone());
    let bucket = js
        .get_key_value(genfleet::client::streams::WORKERS_BUCKET)
        .await
        .unwrap();
    let heartbeat = genfleet::client::fleet::Heartbeat {
        worker_id: "ghost".into(),
        pool: pool.clone(),
        slots: 8,
        busy: 0,
        draining: false,
        paused: false,
        ts: genfleet::protocol::ids::now_rfc3339(),
        running: Vec::new(),
        durable: Some(Vec::new()),
    };
    bucket
        .put("ghost", serde_json::to_vec(&heartbeat).unwrap().into())
        .await
        .unwrap();
    let mut with_ghost = ids(WORKERS);
    with_ghost.push("ghost".into());
    with_ghost.sort();
    client_sees(client, &pool, &with_ghost).await;
    let key = (0..500)
        .map(|i| format!("ghost-{i}"))
        .find(|key| key_worker(key, &with_ghost) == "ghost")
        .expect("a key of ghost's");
    let result = client
        .run(&pool, keyed(&key, vec![Message::user("hello")]), WAIT)
        .await
        .unwrap();
    assert_eq!(result.reason, Reason::Stop, "{result:?}");
    assert_ne!(result.worker_id, "ghost");
    let record = result.affinity.expect("a keyed request has a record");
    assert_eq!(record.preferred_worker.as_deref(), Some("ghost"));
    assert!(!record.held);
    assert_eq!(record.fallback.as_deref(), Some("busy"));
    // The submit did reach ghost's subject first.
    let reached = silent.next().await.expect("ghost's subject got the submit");
    let sent: GenerationRequest = serde_json::from_slice(&reached.payload).unwrap();
    assert_eq!(sent.request_id, Some(result.request_id.clone()));
    let _ = bucket.delete("ghost").await;
}
