//! Affinity: the turns of a conversation go back to the worker that served the earlier ones
//! while it has a free slot, and go to the pool at once when it has none (real nats-server,
//! worker processes, each with a mock backend of its own that has a prefix cache).

mod common;

use std::time::Duration;

use common::fleet::{self, Fleet, Proc};
use futures_util::StreamExt;
use genfleet::client::Client;
use genfleet::llm::mock::{MockServer, PrefixCacheSettings, Rule, Script};
use genfleet::protocol::{
    ErrorCode, GenerationRequest, GenerationResult, Message, Reason, RequestState,
};

const WORKERS: usize = 4;
const SLOTS: u32 = 4;
const CHAINS: usize = 200;
const TURNS: usize = 5;
/// Chains running at once. The chains test gives each worker this many slots, so that no
/// worker is ever full there: a worker that fills leaves its pool's submit subject, and
/// async-nats 0.51 drops a submit already on its way to a subscription being left (its caller
/// waits out its timeout). A busy preferred worker is shown by the tests after it, which fill
/// one worker on purpose with nothing else in flight.
const AT_ONCE: usize = 12;
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

/// A fleet of worker processes `w0`..`w3` with `slots` each, each on its own mock.
async fn fleet_of_four(slots: u32) -> (Fleet, Vec<MockServer>, Vec<Proc>) {
    let f = Fleet::builder()
        .worker_processes(Vec::<String>::new())
        .slots(slots)
        .client_timeout(CALL_WITHIN)
        .start()
        .await;
    let mut mocks = Vec::new();
    let mut workers = Vec::new();
    for i in 0..WORKERS {
        let mock = MockServer::start(script()).await.expect("a mock starts");
        workers.push(f.start_worker_process(
            &format!("w{i}"),
            &[("GENFLEET__LLM__BASE_URL", mock.base_url())],
        ));
        mocks.push(mock);
    }
    fleet::wait_workers(f.client.nats(), WORKERS, WAIT, f.logs()).await;
    (f, mocks, workers)
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
async fn chain(client: Client, pool: String, chain: usize) -> (usize, Vec<GenerationResult>) {
    let key = format!("chain-{chain}");
    let mut messages = Vec::new();
    let mut results = Vec::new();
    for turn in 1..=TURNS {
        messages.push(Message::user(format!("chain {chain}, turn {turn}: go on")));
        let result = client
            .run(&pool, keyed(&key, messages.clone()), WAIT)
            .await
            .unwrap_or_else(|e| panic!("{key} turn {turn} runs: {e}"));
        assert_eq!(result.reason, Reason::Stop, "{result:?}");
        messages.push(Message::assistant(result.output.clone()));
        results.push(result);
    }
    (chain, results)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_turns_go_back_to_their_worker_and_never_wait_for_it() {
    let (f, mocks, _workers) = fleet_of_four(AT_ONCE as u32).await;
    let pool = f.settings.worker.pool.clone();
    let chains: Vec<(usize, Vec<GenerationResult>)> = futures_util::stream::iter(0..CHAINS)
        .map(|i| chain(f.client.clone(), pool.clone(), i))
        .buffer_unordered(AT_ONCE)
        .collect()
        .await;

    let (mut later, mut held, mut busy) = (0, 0, 0);
    for (chain, results) in &chains {
        let key = format!("chain-{chain}");
        let first = results[0]
            .affinity
            .as_ref()
            .expect("a keyed request has a record");
        assert_eq!(first.key, key);
        assert_eq!(first.preferred_worker, None, "a new key has no worker yet");
        assert!(!first.held);
        for pair in results.windows(2) {
            let (before, turn) = (&pair[0], &pair[1]);
            let record = turn
                .affinity
                .as_ref()
                .expect("a keyed request has a record");
            later += 1;
            assert_eq!(record.key, key);
            // The submitter knew where the conversation was served last.
            assert_eq!(
                record.preferred_worker.as_deref(),
                Some(before.worker_id.as_str()),
                "{record:?}"
            );
            assert_eq!(
                record.held,
                turn.worker_id == before.worker_id,
                "{record:?}"
            );
            if record.held {
                held += 1;
                assert_eq!(record.fallback, None, "{record:?}");
            } else {
                // Not held only because its worker had no free slot, and then it went to the
                // pool at once: another worker took it, nobody waited for the busy one.
                assert_eq!(record.fallback.as_deref(), Some("busy"), "{record:?}");
                assert_ne!(turn.worker_id, before.worker_id);
                busy += 1;
            }
        }
    }
    assert_eq!(later, CHAINS * (TURNS - 1));
    assert!(
        held * 10 >= (later - busy) * 9,
        "{held} of {later} later turns held, {busy} found their worker busy"
    );
    // Every held turn found its conversation in its backend's cache.
    let hits: u64 = mocks
        .iter()
        .map(|m| m.prefix_cache_stats().expect("a cache").hits)
        .sum();
    assert!(
        hits >= held as u64,
        "{hits} prefix hits for {held} held turns"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_preferred_worker_sends_the_request_to_the_pool_at_once() {
    let (f, _mocks, _workers) = fleet_of_four(SLOTS).await;
    let client = &f.client;
    let pool = f.settings.worker.pool.clone();
    let warm = client
        .run(&pool, keyed("busy", vec![Message::user("warm up")]), WAIT)
        .await
        .expect("the first request runs");
    let preferred = warm.worker_id.clone();
    assert_eq!(client.preferred_worker("busy"), Some(preferred.clone()));

    // Slow requests of the same key fill the preferred worker's slots; the first that finds
    // it full goes elsewhere.
    let mut slow = Vec::new();
    let elsewhere = loop {
        let id = format!("slow-{}", slow.len());
        let mut request = keyed("busy", vec![Message::user("slow, please")]);
        request.request_id = Some(id.clone());
        let accepted = client
            .submit(&pool, &request)
            .await
            .expect("some worker takes it");
        assert_eq!(accepted.state, RequestState::Running, "it never waits");
        slow.push(id.clone());
        if accepted.worker_id != preferred {
            break id;
        }
        assert!(
            slow.len() <= SLOTS as usize,
            "the preferred worker took more requests than it has slots"
        );
    };
    for id in &slow {
        stop(client, id).await;
    }
    let result = fleet::terminal(client, &elsewhere, WAIT).await;
    let record = result.affinity.expect("a keyed request has a record");
    assert_eq!(record.key, "busy");
    assert_eq!(record.preferred_worker, Some(preferred.clone()));
    assert!(!record.held);
    assert_eq!(record.fallback.as_deref(), Some("busy"));
    assert_ne!(result.worker_id, preferred);
    // The ones that found it free held.
    for id in &slow[..slow.len() - 1] {
        let result = fleet::terminal(client, id, WAIT).await;
        let record = result.affinity.expect("a record");
        assert!(record.held, "{record:?}");
        assert_eq!(result.worker_id, preferred);
    }
    // A request without a key has no record and is placed as before.
    let plain = client
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

/// A request that stops at its `prod` checkpoint for a manager's answer.
fn guarded(id: &str) -> GenerationRequest {
    serde_json::from_value(serde_json::json!({
        "request_id": id,
        "messages": [{"role": "user", "content": "Deploy build 7 to production."}],
        "checkpoints": [{"name": "prod", "prompt_contains": ["production"]}]
    }))
    .expect("a valid request")
}

/// Runs a guarded request to its checkpoint, fills its worker with `busy` slow requests, then
/// answers `proceed`: the continuation, and the worker that ran the request before it.
async fn continued(f: &Fleet, id: &str, busy: usize) -> (GenerationResult, String) {
    let pool = f.settings.worker.pool.clone();
    let first = f
        .client
        .run(&pool, guarded(id), WAIT)
        .await
        .expect("the request runs");
    assert_eq!(first.reason, Reason::DecisionRequested, "{first:?}");
    let decision = first
        .signals
        .iter()
        .find_map(|s| s.decision.clone())
        .expect("a decision");
    // Slow requests keyed to the same worker take its slots.
    let mut slow = Vec::new();
    while slow.len() < busy {
        let mut request = keyed(id, vec![Message::user("slow, please")]);
        let slow_id = format!("{id}-slow-{}", slow.len());
        request.request_id = Some(slow_id.clone());
        f.client.learn_affinity(id, &first.worker_id);
        let accepted = f.client.submit(&pool, &request).await.expect("taken");
        assert_eq!(
            accepted.worker_id, first.worker_id,
            "the worker had a free slot"
        );
        slow.push(slow_id);
    }
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
    let (f, _mocks, _workers) = fleet_of_four(SLOTS).await;
    // Its worker is free: the continuation runs there, keyed by the chain's root.
    let (next, before) = continued(&f, "cp-free", 0).await;
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
    let (next, before) = continued(&f, "cp-busy", SLOTS as usize).await;
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
