//! Faults under load, on real processes and real nats-servers on loopback: a worker killed with
//! SIGKILL mid-generation, nats-server restarted, a node of a 3-node JetStream cluster killed,
//! the backend killed mid-stream and brought back, tool services that error, hang or vanish.
//! Each test ends by checking the fleet came back to rest: every accepted request has exactly
//! one terminal result, every slot is free, no message or record is left behind.

mod common;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::fleet::{self, Fleet, FleetBuilder, request};
use common::nats::{NatsServer, free_port};
use common::wait;
use genfleet::client::Client;
use genfleet::llm::mock::{MockServer, Script};
use genfleet::protocol::{EventBody, Reason, RequestState};
use genfleet::settings::Settings;

/// The bound on waiting for a fleet to finish its work after a fault.
const SETTLE: Duration = Duration::from_secs(30);

/// Worker settings for fast fault detection: a short ack wait (redelivery of a dead worker's
/// messages) and short heartbeats (its records reaped).
const FAST_FAULTS: [(&str, &str); 4] = [
    ("GENFLEET__JETSTREAM__QUEUE_ACK_WAIT_MS", "1500"),
    ("GENFLEET__WORKER__HEARTBEAT_MS", "300"),
    ("GENFLEET__WORKER__LOST_AFTER_MS", "1500"),
    ("GENFLEET__WORKER__DRAIN_TIMEOUT_MS", "500"),
];

/// A fleet of worker processes with fast fault detection, and a client whose requests time
/// out in 3 s.
fn fast_faults() -> FleetBuilder<'static> {
    FAST_FAULTS.into_iter().fold(
        Fleet::builder()
            .default_settings()
            .settings(|s| s.nats.request_timeout_ms = 3_000),
        |builder, (key, value)| builder.worker_env(key, value),
    )
}

/// A script whose every answer is `reply`, a word every `delay_ms`.
fn replying(reply: &str, delay_ms: u64) -> String {
    format!("[[rules]]\nreply = \"{reply}\"\ndelay_ms = {delay_ms}\n")
}

/// Two worker processes with four slots each, on a mock answering `reply` slowly.
async fn two_workers(ids: [&str; 2], reply: &str, delay_ms: u64) -> Fleet {
    fast_faults()
        .script(&replying(reply, delay_ms))
        .worker_processes(ids)
        .slots(4)
        .start()
        .await
}

/// Which worker each of `ids` runs on right now.
async fn running_on(client: &Client, ids: &[String]) -> BTreeMap<String, String> {
    let mut on = BTreeMap::new();
    for id in ids {
        if let Ok(status) = client.status(id).await
            && status.state == RequestState::Running
            && let Some(worker) = status.worker_id
        {
            on.insert(id.clone(), worker);
        }
    }
    on
}

#[tokio::test]
async fn a_worker_killed_under_durable_load_loses_no_request_and_each_ends_once() {
    let reply = "alpha beta gamma delta epsilon zeta eta theta iota kappa";
    let mut f = two_workers(["doomed", "steady"], reply, 40).await;
    let client = &f.client;

    let ids: Vec<String> = (0..40).map(|i| format!("burst-{i:02}")).collect();
    for id in &ids {
        assert!(
            !client
                .enqueue("default", &request(id, "go"))
                .await
                .unwrap()
                .duplicate
        );
    }
    // Kill the doomed worker while it runs requests of its own.
    let interrupted: Vec<String> = wait::until(
        "the doomed worker to run requests of its own",
        SETTLE,
        || async {
            let on_doomed: Vec<String> = running_on(client, &ids)
                .await
                .into_iter()
                .filter(|(_, worker)| worker == "doomed")
                .map(|(id, _)| id)
                .collect();
            if on_doomed.len() >= 2 {
                Ok(on_doomed)
            } else {
                Err(format!("running on it: {on_doomed:?}"))
            }
        },
    )
    .await;
    let fault_at = std::time::Instant::now();
    f.processes[0].kill();
    let _rescuer = f.start_worker_process("rescuer", &[]);

    // What holds whatever the timing: a request the killed worker was running when it died is
    // finished by another worker on a later attempt. (A request seen running on it a moment
    // before the kill may have finished in that moment, stored by the killed worker itself.)
    let mut rescued = 0;
    for id in &ids {
        let r = fleet::terminal(client, id, SETTLE).await;
        assert_eq!(
            (r.state, r.output.as_str()),
            (RequestState::Completed, reply),
            "{id}: {r:?}"
        );
        if interrupted.contains(id) && r.worker_id != "doomed" {
            assert!(r.attempt >= 2, "{id} was interrupted: {r:?}");
            rescued += 1;
        }
        assert!(r.attempt >= 1, "{id}: {r:?}");
    }
    eprintln!(
        "{rescued} of the {} requests seen running on the killed worker were finished by another",
        interrupted.len()
    );
    for id in &ids {
        fleet::take_exactly_once(client, id).await;
    }
    // Measured, not asserted: how long the fleet took to finish everything after the fault.
    eprintln!("all work done {:?} after the fault", fault_at.elapsed());
    // The doomed worker's records go once a live worker sees it stopped beating.
    fleet::wait_at_rest(client.nats(), "default", 2, SETTLE).await;
}

#[tokio::test]
async fn a_nats_restart_under_mixed_load_loses_no_accepted_request_and_leaks_no_slot() {
    let reply = "one two three four five six seven eight";
    let mut f = two_workers(["w1", "w2"], reply, 60).await;
    let client = &f.client;

    // Interactive requests running, and durable ones running and waiting, when the server
    // dies.
    let mut accepted = Vec::new();
    for i in 0..6 {
        let id = format!("int-{i}");
        if client.submit("default", &request(&id, "go")).await.is_ok() {
            accepted.push(id);
        }
    }
    assert!(!accepted.is_empty());
    let durable: Vec<String> = (0..16).map(|i| format!("dur-{i:02}")).collect();
    for id in &durable {
        client.enqueue("default", &request(id, "go")).await.unwrap();
    }
    wait::until("durable requests to run", SETTLE, || async {
        !running_on(client, &durable).await.is_empty()
    })
    .await;
    let fault_at = std::time::Instant::now();
    f.nats.kill().await;
    // The server is gone for as long as it takes its clients to notice.
    wait::until("the client to see the server gone", SETTLE, || async {
        client.nats().connection_state() != async_nats::connection::State::Connected
    })
    .await;
    f.nats.restart().await;

    for id in durable.iter().chain(&accepted) {
        let r = fleet::terminal(client, id, SETTLE).await;
        assert_eq!(
            (r.state, r.output.as_str()),
            (RequestState::Completed, reply),
            "{id}: {r:?}"
        );
    }
    for id in durable.iter().chain(&accepted) {
        fleet::take_exactly_once(client, id).await;
    }
    // The fleet serves new work after the restart.
    let after = client
        .run("default", request("after", "go"), SETTLE)
        .await
        .unwrap();
    assert_eq!(after.output, reply);
    // Measured, not asserted: how long the fleet took to finish everything after the fault.
    eprintln!("all work done {:?} after the fault", fault_at.elapsed());
    fleet::wait_at_rest(client.nats(), "default", 2, SETTLE).await;
}

/// Three nats-servers clustered on loopback, JetStream on each; `replicas = 3` for genfleet's
/// streams and buckets.
struct Cluster {
    nodes: Vec<NatsServer>,
}

impl Cluster {
    async fn start() -> Cluster {
        let routes: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let route_urls = routes
            .iter()
            .map(|p| format!("\"nats-route://127.0.0.1:{p}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let mut nodes = Vec::new();
        for port in &routes {
            let conf = format!(
                "cluster {{\n  name: \"genfleet-test\"\n  listen: \"127.0.0.1:{port}\"\n  routes: [{route_urls}]\n}}\n"
            );
            nodes.push(NatsServer::start_with_config(&conf).await);
        }
        Cluster { nodes }
    }

    /// Waits (bounded) until JetStream answers through the cluster (a meta leader is elected).
    async fn wait_jetstream(&self) {
        let nats = self.nodes[0].client().await;
        let js = async_nats::jetstream::new(nats);
        wait::until("the cluster's JetStream to come up", SETTLE, || async {
            // "stream not found" is JetStream's own answer: its meta leader is elected.
            match js.get_stream("ABSENT").await {
                Err(error) if error.to_string().contains("not found") => Ok(()),
                Err(error) => Err(error.to_string()),
                Ok(_) => Err("a stream named ABSENT".to_string()),
            }
        })
        .await;
    }
}

#[tokio::test]
async fn a_cluster_node_killed_under_load_leaves_the_fleet_running() {
    let mut cluster = Cluster::start().await;
    cluster.wait_jetstream().await;
    let reply = "north east south west";
    let mock = MockServer::start(Script::from_toml_str(&replying(reply, 50)).unwrap())
        .await
        .unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut env: Vec<(&str, String)> = vec![
        ("GENFLEET__LLM__BASE_URL", mock.base_url()),
        ("GENFLEET__WORKER__SLOTS", "4".into()),
        ("GENFLEET__JETSTREAM__REPLICAS", "3".into()),
    ];
    env.extend(FAST_FAULTS.map(|(key, value)| (key, value.to_string())));
    // Every process knows all three nodes and reconnects to another when its node dies.
    let urls: Vec<String> = cluster.nodes.iter().map(|n| n.url()).collect();
    let all = urls.join(",");
    let _w1 = fleet::worker("w1", &all, &env, logs.path());
    let _w2 = fleet::worker("w2", &all, &env, logs.path());
    let mut settings = Settings::defaults();
    settings.nats.url = all.clone();
    settings.nats.request_timeout_ms = 5_000;
    let client = &Client::connect(&settings).await.unwrap();
    fleet::wait_workers(client.nats(), 2, SETTLE, logs.path()).await;
    let js = async_nats::jetstream::new(client.nats().clone());
    let queue = js
        .get_stream("GENFLEET_QUEUE")
        .await
        .unwrap()
        .cached_info()
        .clone();
    assert_eq!(queue.config.num_replicas, 3);
    // The node leading the queue stream is the one to kill (server names carry their port).
    let leader = queue
        .cluster
        .and_then(|c| c.leader)
        .expect("the queue stream has a leader");
    let victim = cluster
        .nodes
        .iter()
        .position(|n| leader.starts_with(&format!("genfleet-test-{}-", n.port())))
        .expect("the leader is one of the nodes");

    let ids: Vec<String> = (0..24).map(|i| format!("ha-{i:02}")).collect();
    for id in &ids[..12] {
        client.enqueue("default", &request(id, "go")).await.unwrap();
    }
    // Under load when the node goes: the first requests run.
    wait::until("the first requests to run", SETTLE, || async {
        !running_on(client, &ids[..12]).await.is_empty()
    })
    .await;
    let fault_at = std::time::Instant::now();
    cluster.nodes[victim].kill().await;
    for id in &ids[12..] {
        // A leader election can make a publish fail for a moment; a client publishes again.
        let tries = Cell::new(0);
        let show_nodes = || {
            cluster
                .nodes
                .iter()
                .map(|node| format!("--- node {}:\n{}", node.port(), node.log_text()))
                .collect::<Vec<_>>()
                .join("\n")
        };
        wait::until_showing(
            &format!("the queue to take {id}"),
            SETTLE,
            || async {
                let sent = client.enqueue("default", &request(id, "go")).await;
                if let Err(error) = &sent
                    && tries.get() == 0
                {
                    eprintln!("enqueue {id} again: {error}");
                }
                tries.set(tries.get() + 1);
                sent.map_err(|e| e.to_string())
            },
            show_nodes,
        )
        .await;
        if tries.get() > 1 {
            eprintln!(
                "enqueue {id} taken after {} tries, {:?} after the fault",
                tries.get() - 1,
                fault_at.elapsed()
            );
        }
    }
    // Until the results bucket has a new leader a worker cannot record a new request: the
    // submit fails with a clear error and a client tries again.
    let tries = Cell::new(0);
    let interactive = wait::until("an interactive request to be taken", SETTLE, || async {
        let sent = client
            .run(
                "default",
                request(&format!("ha-interactive-{}", tries.get()), "go"),
                SETTLE,
            )
            .await;
        if let Err(error) = &sent
            && tries.get() == 0
        {
            eprintln!("submit again: {error}");
        }
        tries.set(tries.get() + 1);
        sent.map_err(|e| e.to_string())
    })
    .await;
    eprintln!(
        "a submit taken after {} tries, {:?} after the fault",
        tries.get() - 1,
        fault_at.elapsed()
    );
    assert_eq!(interactive.output, reply);
    for id in &ids {
        let r = fleet::terminal(client, id, SETTLE).await;
        assert_eq!(
            (r.state, r.output.as_str()),
            (RequestState::Completed, reply),
            "{id}: {r:?}"
        );
        fleet::take_exactly_once(client, id).await;
    }
    // Measured, not asserted: how long the fleet took to finish everything after the fault.
    eprintln!("all work done {:?} after the fault", fault_at.elapsed());
    fleet::wait_at_rest(client.nats(), "default", 2, SETTLE).await;
}

#[tokio::test]
async fn the_backend_killed_mid_stream_fails_with_partial_output_and_its_return_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("slow.toml");
    let reply = "w01 w02 w03 w04 w05 w06 w07 w08 w09 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20";
    std::fs::write(&script, replying(reply, 100)).unwrap();
    let (mut backend, base_url) = fleet::mock_llm("127.0.0.1:0", &script);
    let listen = base_url
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .to_string();
    let f = fast_faults()
        .backend_url(base_url)
        .worker_processes(["w"])
        .slots(4)
        // Calls that find the backend down are retried long enough to see it come back.
        .worker_env("GENFLEET__LLM__RETRIES", 8)
        .worker_env("GENFLEET__LLM__RETRY_BACKOFF_MS", 200)
        .start()
        .await;
    let client = &f.client;

    let mut streaming = Box::pin(client.follow("streaming").await.unwrap());
    let mut streaming_durable = Box::pin(client.follow("streaming-durable").await.unwrap());
    client
        .submit("default", &request("streaming", "go"))
        .await
        .unwrap();
    client
        .enqueue("default", &request("streaming-durable", "go"))
        .await
        .unwrap();
    // Killed mid-stream: both have streamed words (of twenty, one every 100 ms).
    for (id, events) in [
        ("streaming", &mut streaming),
        ("streaming-durable", &mut streaming_durable),
    ] {
        wait::next_matching(&format!("the first delta of {id}"), SETTLE, events, |e| {
            matches!(e.body, EventBody::Delta { .. }).then_some(())
        })
        .await;
    }
    let fault_at = std::time::Instant::now();
    backend.kill();
    for id in ["streaming", "streaming-durable"] {
        let r = fleet::terminal(client, id, SETTLE).await;
        assert_eq!(
            (r.state, r.reason),
            (RequestState::Failed, Reason::BackendError),
            "{id}: {r:?}"
        );
        assert!(
            !r.output.is_empty() && reply.starts_with(&r.output) && r.output.len() < reply.len(),
            "{id}: the partial output is kept: {:?}",
            r.output
        );
        // A durable request that failed on the backend is a result, not a lost delivery.
        assert_eq!(r.attempt, 1, "{id}: {r:?}");
    }
    // With the backend down, a new request waits out the retries ...
    client
        .enqueue("default", &request("while-down", "go"))
        .await
        .unwrap();
    let log = f.logs().join("w.log");
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    wait::until_showing(
        "the worker to find the backend down and retry",
        SETTLE,
        || async {
            // The only call since the kill: the streams that broke are not retried.
            read_log().contains("backend call failed; retrying")
        },
        || format!("the worker's log:\n{}", read_log()),
    )
    .await;
    // ... and completes once the backend is back on its address.
    let (_backend, _) = fleet::mock_llm(&listen, &script);
    let r = fleet::terminal(client, "while-down", SETTLE).await;
    assert_eq!(
        (r.state, r.output.as_str()),
        (RequestState::Completed, reply),
        "{r:?}"
    );
    // Measured, not asserted: how long the fleet took to finish everything after the fault.
    eprintln!("all work done {:?} after the fault", fault_at.elapsed());
    fleet::wait_queue_empty(client.nats(), "default", SETTLE).await;
    fleet::wait_all_slots_free(client.nats(), 1, SETTLE).await;
    for id in ["streaming", "streaming-durable", "while-down"] {
        fleet::take_exactly_once(client, id).await;
    }
    fleet::wait_only_results_left(client.nats(), SETTLE).await;
}

#[tokio::test]
async fn tool_services_that_error_hang_or_vanish_end_requests_cleanly() {
    // Each tool is called once; after its result the model says what it got.
    let script = r#"
[[rules]]
when_last_role = "tool"
reply = "tool said: {{last_message}}"

[[rules]]
when_last_user_contains = "use grumpy"
tool_calls = [{ name = "grumpy", arguments = {} }]

[[rules]]
when_last_user_contains = "use sleepy"
reply = "Calling sleepy."
tool_calls = [{ name = "sleepy", arguments = {} }]

[[rules]]
when_last_user_contains = "use ghost"
reply = "Calling ghost."
tool_calls = [{ name = "ghost", arguments = {} }]
"#;
    let f = fast_faults()
        .script(script)
        .worker_processes(["w"])
        .slots(2)
        .start()
        .await;
    let client = &f.client;

    let definition = |name: &str, timeout_ms: u64| {
        serde_json::from_value::<genfleet::tools::ToolDefinition>(serde_json::json!({
            "name": name, "brief": "Answer the test", "schema": {"type": "object"},
            "timeout_ms": timeout_ms
        }))
        .unwrap()
    };
    let service_settings = &f.settings;
    let _grumpy = genfleet::client::tool_service::ToolService::start(
        f.nats.client().await,
        service_settings,
        definition("grumpy", 2_000),
        |_, _| async { Err(serde_json::json!({"code": "REFUSED", "message": "not today"})) },
    )
    .await
    .unwrap();
    let _sleepy = genfleet::client::tool_service::ToolService::start(
        f.nats.client().await,
        service_settings,
        definition("sleepy", 300),
        |_, _| async {
            // Never answers within the call's timeout (300 ms).
            std::future::pending::<()>().await;
            Ok(serde_json::json!("too late"))
        },
    )
    .await
    .unwrap();
    // The ghost registers, takes a call and its process goes away without answering.
    let ghost_connection = f.nats.client().await;
    let ghost_calls = Arc::new(AtomicUsize::new(0));
    let ghost = genfleet::client::tool_service::ToolService::start(
        ghost_connection.clone(),
        service_settings,
        definition("ghost", 1_500),
        {
            let ghost_calls = ghost_calls.clone();
            move |_, _| {
                ghost_calls.fetch_add(1, Ordering::SeqCst);
                async {
                    // Never answers: the service goes away first.
                    std::future::pending::<()>().await;
                    Ok(serde_json::json!("never"))
                }
            }
        },
    )
    .await
    .unwrap();

    let run = |id: &str, text: &str, tool: &str| {
        let mut r = request(id, text);
        r.tools = vec![tool.to_string()];
        async move { fleet::run_when_tools_known(client, &r, SETTLE).await }
    };
    // An error reply goes back to the model, which reacts.
    let grumpy = run("t-grumpy", "use grumpy", "grumpy").await;
    assert_eq!(grumpy.reason, Reason::Stop, "{grumpy:?}");
    assert!(grumpy.output.contains("not today"), "{grumpy:?}");
    // A tool that never answers times out: FAILED, output kept.
    let sleepy = run("t-sleepy", "use sleepy", "sleepy").await;
    assert_eq!(sleepy.reason, Reason::ToolExecutionError, "{sleepy:?}");
    assert!(
        sleepy
            .detail
            .as_deref()
            .unwrap_or_default()
            .contains("timed out"),
        "{sleepy:?}"
    );
    assert_eq!(sleepy.output, "Calling sleepy.");
    // A service that vanishes mid-call (the call has reached it): the call times out.
    let mut ghost_request = request("t-ghost", "use ghost");
    ghost_request.tools = vec!["ghost".into()];
    fleet::submit_when_tools_known(client, &ghost_request).await;
    wait::until("the ghost to have the call", SETTLE, || async {
        ghost_calls.load(Ordering::SeqCst) > 0
    })
    .await;
    drop(ghost);
    drop(ghost_connection);
    let vanished = fleet::terminal(client, "t-ghost", SETTLE).await;
    assert_eq!(vanished.reason, Reason::ToolExecutionError, "{vanished:?}");
    assert_eq!(
        vanished.detail.as_deref(),
        Some("tool `ghost` timed out after 1500 ms"),
        "the call was out when the service went: {vanished:?}"
    );
    assert_eq!(ghost_calls.load(Ordering::SeqCst), 1);
    // Its registration is still there, but nobody serves it: the next call fails on "no
    // responders", not on its timeout.
    let gone = run("t-ghost-2", "use ghost", "ghost").await;
    assert_eq!(gone.reason, Reason::ToolExecutionError, "{gone:?}");
    let detail = gone.detail.as_deref().unwrap_or_default();
    assert!(
        detail.contains("no tool service answers") && !detail.contains("timed out"),
        "no responders is not a timeout: {gone:?}"
    );
    fleet::wait_all_slots_free(client.nats(), 1, SETTLE).await;
    fleet::wait_only_results_left(client.nats(), SETTLE).await;
}
