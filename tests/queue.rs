//! The durable queue on a real nats-server: runs when a slot frees, survives a worker killed
//! mid-generation (attempt 2 on another worker), cancels while queued, refuses bad messages.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::nats::NatsServer;
use genfleet::bus::client::Client;
use genfleet::bus::worker::WorkerHandle;
use genfleet::llm::mock::{MockServer, Script};
use genfleet::protocol::{ErrorCode, GenerationRequest, Reason, RequestState};
use genfleet::settings::Settings;

fn settings(nats: &NatsServer, mock: &MockServer) -> Settings {
    let mut s = Settings::defaults();
    s.nats.url = nats.url();
    s.llm.base_url = mock.base_url();
    s.worker.slots = 1;
    s.worker.drain_timeout_ms = 300;
    s.jetstream.queue_ack_wait_ms = 1500;
    s
}

async fn spawn_worker(s: Settings) -> WorkerHandle {
    tokio::task::spawn_blocking(move || WorkerHandle::spawn(s))
        .await
        .unwrap()
        .unwrap()
}

fn req(id: &str) -> GenerationRequest {
    let mut r = GenerationRequest::user("go");
    r.request_id = Some(id.into());
    r
}

async fn terminal(
    client: &Client,
    id: &str,
    within: Duration,
) -> genfleet::protocol::GenerationResult {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match client.result(id, false).await {
            Ok(r) => return r,
            Err(e)
                if tokio::time::Instant::now() < deadline
                    && matches!(
                        e.code(),
                        Some(ErrorCode::NotReady) | Some(ErrorCode::NotFound) | None
                    ) =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{id}: {e}"),
        }
    }
}

#[tokio::test]
async fn queued_requests_run_when_a_worker_is_there_and_duplicates_are_kept_once() {
    let nats = NatsServer::start().await;
    let mock =
        MockServer::start(Script::from_toml_str("[[rules]]\nreply = \"durable done\"\n").unwrap())
            .await
            .unwrap();
    let client = Client::new(
        nats.client().await,
        genfleet::bus::subjects::Subjects::new(&Settings::defaults().subjects),
    );
    // A first worker creates the stream; stop it so requests wait.
    let first = spawn_worker(settings(&nats, &mock)).await;
    tokio::task::spawn_blocking(move || first.stop())
        .await
        .unwrap()
        .unwrap();
    // Its last pull request lives on at the server until it expires; a message published
    // before then would be delivered to it (and come back as attempt 2).
    let js = async_nats::jetstream::new(client.nats().clone());
    let queue = js.get_stream("GENFLEET_QUEUE").await.unwrap();
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        queue.get_consumer("genfleet-default").await.unwrap();
    for _ in 0..100 {
        if consumer.info().await.unwrap().num_waiting == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let queued = client.enqueue("default", &req("q1")).await.unwrap();
    assert!(!queued.duplicate);
    assert!(
        client
            .enqueue("default", &req("q1"))
            .await
            .unwrap()
            .duplicate
    );
    client.enqueue("default", &req("q2")).await.unwrap();
    client.enqueue("default", &req("q3")).await.unwrap();
    // No worker: nobody answers status; start one and they all run, one slot at a time.
    let worker = spawn_worker(settings(&nats, &mock)).await;
    // Cancel q3 while it still waits (the worker has one slot; q1 and q2 go first).
    let _ = client.cancel("q3").await;
    for id in ["q1", "q2"] {
        let r = terminal(&client, id, Duration::from_secs(10)).await;
        assert_eq!(
            (r.state, r.output.as_str(), r.attempt),
            (RequestState::Completed, "durable done", 1),
            "{id}"
        );
    }
    let r3 = terminal(&client, "q3", Duration::from_secs(10)).await;
    assert!(
        matches!(r3.reason, Reason::Cancelled | Reason::Stop),
        "{r3:?}"
    );
    let js = async_nats::jetstream::new(client.nats().clone());
    let mut stream = js.get_stream("GENFLEET_QUEUE").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        0,
        "every message acked or removed"
    );
    drop(worker);
}

#[tokio::test]
async fn a_queued_request_shows_queued_and_cancelling_it_means_it_never_runs() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(
        Script::from_toml_str("[[rules]]\nreply = \"a b c d e f g h i j\"\ndelay_ms = 200\n")
            .unwrap(),
    )
    .await
    .unwrap();
    let worker = spawn_worker(settings(&nats, &mock)).await;
    let client = Client::connect(&settings(&nats, &mock)).await.unwrap();
    client.enqueue("default", &req("long")).await.unwrap();
    // The single slot is busy with `long`; `waiting` stays in the queue.
    tokio::time::sleep(Duration::from_millis(400)).await;
    client.enqueue("default", &req("waiting")).await.unwrap();
    assert_eq!(
        client.status("waiting").await.unwrap().state,
        RequestState::Queued
    );
    let err = client.result("waiting", true).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotReady));
    let reply = client.cancel("waiting").await.unwrap();
    assert_eq!(reply.state, RequestState::Cancelled);
    let r = client.result("waiting", true).await.unwrap();
    assert_eq!(
        (r.reason, r.detail.as_deref()),
        (Reason::Cancelled, Some("cancelled while queued"))
    );
    client.cancel("long").await.unwrap();
    drop(worker);
}

/// A durable message pulled while a slot was free, whose slot an interactive submit took before
/// it started, waits in the worker's hand: it shows QUEUED, and a cancel ends it CANCELLED
/// without it ever running (it used to answer NOT_FOUND, and the request ran later).
#[tokio::test]
async fn a_durable_request_in_hand_waiting_for_a_slot_shows_queued_and_cancelling_it_means_it_never_runs()
 {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(
        Script::from_toml_str(
            "[[rules]]\nwhen_last_user_contains = \"slow\"\nreply = \"a b c d e f g h i j\"\n\
             delay_ms = 200\n",
        )
        .unwrap(),
    )
    .await
    .unwrap();
    let worker = spawn_worker(settings(&nats, &mock)).await;
    let client = Client::connect(&settings(&nats, &mock)).await.unwrap();
    wait_for_a_worker(&client).await;
    let mut in_hand = 0;
    for round in 0..5 {
        let busy = format!("busy-{round}");
        let waiting = format!("in-hand-{round}");
        // The idle worker keeps a pull open for its free slot; the submit takes the slot, and
        // the message enqueued right after is delivered to that pull.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut slow = GenerationRequest::user("slow");
        slow.request_id = Some(busy.clone());
        client.submit("default", &slow).await.unwrap();
        let mut never = GenerationRequest::user("never runs");
        never.request_id = Some(waiting.clone());
        client.enqueue("default", &never).await.unwrap();
        assert_eq!(
            client.status(&waiting).await.unwrap().state,
            RequestState::Queued,
            "{waiting}"
        );
        let reply = client.cancel(&waiting).await.unwrap();
        assert_eq!(reply.state, RequestState::Cancelled, "{waiting}");
        let r = client.result(&waiting, true).await.unwrap();
        assert_eq!(
            (r.state, r.reason),
            (RequestState::Cancelled, Reason::Cancelled)
        );
        match r.detail.as_deref() {
            Some("cancelled while waiting for a slot") => in_hand += 1,
            Some("cancelled while queued") => {}
            other => panic!("{waiting}: detail {other:?}"),
        }
        assert_eq!(
            client.cancel(&busy).await.unwrap().state,
            RequestState::Cancelled
        );
    }
    assert!(
        in_hand > 0,
        "no round had the message in the worker's hand while the slot was taken"
    );
    // None of them ever reached the backend, and the slot is free again.
    let prompts = serde_json::to_string(&mock.requests()).unwrap();
    assert!(!prompts.contains("never runs"), "a cancelled request ran");
    let done = client
        .run("default", req("after"), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(done.state, RequestState::Completed);
    drop(worker);
}

#[tokio::test]
async fn a_message_whose_id_does_not_match_its_subject_is_stored_as_invalid_request() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(Script::echo()).await.unwrap();
    let worker = spawn_worker(settings(&nats, &mock)).await;
    let client = Client::connect(&settings(&nats, &mock)).await.unwrap();
    let js = async_nats::jetstream::new(client.nats().clone());
    let body = serde_json::to_vec(&req("other")).unwrap();
    js.publish("gen.queue.default.mismatch", body.into())
        .await
        .unwrap()
        .await
        .unwrap();
    js.publish("gen.queue.default.garbled", "{not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    for id in ["mismatch", "garbled"] {
        let r = terminal(&client, id, Duration::from_secs(10)).await;
        assert_eq!(
            (r.state, r.reason),
            (RequestState::Failed, Reason::InvalidRequest),
            "{id}"
        );
    }
    drop(worker);
}

/// Waits (bounded) until some worker answers the service API.
async fn wait_for_a_worker(client: &Client) {
    for _ in 0..100 {
        if client
            .nats()
            .request("$SRV.PING.genfleet", "".into())
            .await
            .is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded) until a worker runs `id`.
async fn wait_running(client: &Client, id: &str) {
    for _ in 0..100 {
        if client.status(id).await.ok().map(|s| s.state) == Some(RequestState::Running) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A worker as its own process, so the test can kill it with SIGKILL.
struct WorkerProcess(Child);

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn worker_process(s: &Settings, id: &str) -> WorkerProcess {
    worker_process_with(s, id, &[])
}

/// A worker process with extra `GENFLEET__...` settings.
fn worker_process_with(s: &Settings, id: &str, extra: &[(&str, &str)]) -> WorkerProcess {
    let child = Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .arg("worker")
        .envs(extra.iter().copied())
        .env("GENFLEET__NATS__URL", &s.nats.url)
        .env("GENFLEET__LLM__BASE_URL", &s.llm.base_url)
        .env("GENFLEET__WORKER__SLOTS", "1")
        .env("GENFLEET__WORKER__ID", id)
        .env(
            "GENFLEET__JETSTREAM__QUEUE_ACK_WAIT_MS",
            s.jetstream.queue_ack_wait_ms.to_string(),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("genfleet worker starts");
    WorkerProcess(child)
}

#[tokio::test]
async fn a_worker_killed_mid_generation_leaves_the_request_to_another_as_attempt_two() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(
        Script::from_toml_str(
            "[[rules]]\nreply = \"one two three four five six\"\ndelay_ms = 150\n",
        )
        .unwrap(),
    )
    .await
    .unwrap();
    let s = settings(&nats, &mock);
    let mut doomed = worker_process(&s, "doomed");
    let client = Client::connect(&s).await.unwrap();
    // Wait for the doomed worker to serve before enqueueing, so it takes the request.
    wait_for_a_worker(&client).await;
    client.enqueue("default", &req("survivor")).await.unwrap();
    wait_running(&client, "survivor").await;
    doomed.0.kill().unwrap();
    doomed.0.wait().unwrap();
    let _rescuer = spawn_worker(s.clone()).await;
    let r = terminal(&client, "survivor", Duration::from_secs(20)).await;
    assert_eq!((r.state, r.attempt), (RequestState::Completed, 2), "{r:?}");
    assert_eq!(r.output, "one two three four five six");
    assert_ne!(r.worker_id, "doomed");
}

#[tokio::test]
async fn a_drain_hands_a_running_durable_request_back_to_another_worker() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(
        Script::from_toml_str("[[rules]]\nreply = \"p q r s t u v w\"\ndelay_ms = 150\n").unwrap(),
    )
    .await
    .unwrap();
    let s = settings(&nats, &mock);
    let leaving = spawn_worker(s.clone()).await;
    let client = Client::connect(&s).await.unwrap();
    client.enqueue("default", &req("handed")).await.unwrap();
    wait_running(&client, "handed").await;
    let staying = spawn_worker(s.clone()).await;
    // The drain deadline (300 ms) passes before the request ends: it is handed back.
    tokio::task::spawn_blocking(move || leaving.stop())
        .await
        .unwrap()
        .unwrap();
    let r = terminal(&client, "handed", Duration::from_secs(20)).await;
    assert_eq!(
        (r.state, r.attempt, r.worker_id.as_str()),
        (RequestState::Completed, 2, staying.worker_id.as_str()),
        "{r:?}"
    );
}

#[tokio::test]
async fn an_interactive_request_of_a_killed_worker_is_ended_as_worker_lost_by_a_live_one() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(
        Script::from_toml_str("[[rules]]\nreply = \"a b c d e f g h i j\"\ndelay_ms = 300\n")
            .unwrap(),
    )
    .await
    .unwrap();
    let mut s = settings(&nats, &mock);
    s.worker.heartbeat_ms = 200;
    s.worker.lost_after_ms = 1000;
    let mut doomed = worker_process_with(
        &s,
        "doomed",
        &[
            ("GENFLEET__WORKER__HEARTBEAT_MS", "200"),
            ("GENFLEET__WORKER__LOST_AFTER_MS", "1000"),
        ],
    );
    let client = Client::connect(&s).await.unwrap();
    let mut accepted = None;
    for _ in 0..100 {
        if let Ok(a) = client.submit("default", &req("orphan")).await {
            accepted = Some(a);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(accepted.unwrap().worker_id, "doomed");
    doomed.0.kill().unwrap();
    doomed.0.wait().unwrap();
    let _live = spawn_worker(s.clone()).await;
    let r = terminal(&client, "orphan", Duration::from_secs(15)).await;
    assert_eq!(
        (r.state, r.reason),
        (RequestState::Failed, Reason::WorkerLost),
        "{r:?}"
    );
    assert!(r.detail.unwrap().contains("doomed"));
}

/// The worker's heartbeat listed the request when it died: a live worker that followed the
/// heartbeats ends it by itself, with nobody asking about it.
#[tokio::test]
async fn a_request_the_lost_worker_listed_in_its_heartbeat_is_ended_with_nobody_asking() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(
        Script::from_toml_str("[[rules]]\nreply = \"a b c d e f g h i j\"\ndelay_ms = 2000\n")
            .unwrap(),
    )
    .await
    .unwrap();
    let mut s = settings(&nats, &mock);
    s.worker.heartbeat_ms = 200;
    s.worker.lost_after_ms = 1000;
    let fast = [
        ("GENFLEET__WORKER__HEARTBEAT_MS", "200"),
        ("GENFLEET__WORKER__LOST_AFTER_MS", "1000"),
    ];
    let mut doomed = worker_process_with(&s, "doomed", &fast);
    let client = Client::connect(&s).await.unwrap();
    let mut accepted = None;
    for _ in 0..100 {
        if let Ok(a) = client.submit("default", &req("listed")).await {
            accepted = Some(a);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(accepted.unwrap().worker_id, "doomed");
    // A live worker that follows the heartbeats (its own slot is free: it took nothing).
    let _live = spawn_worker(s.clone()).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !common::fleet::heartbeats(client.nats())
        .await
        .get("doomed")
        .is_some_and(|running| running.iter().any(|id| id == "listed"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no heartbeat listed the request"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    doomed.0.kill().unwrap();
    doomed.0.wait().unwrap();
    // Read from the bucket, not through a worker: only the heartbeat's follower can end it.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let record = loop {
        let record = common::fleet::record(client.nats(), "listed")
            .await
            .unwrap();
        if record.get("live").is_none() {
            break record;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running: {record}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (record["state"].as_str(), record["reason"].as_str()),
        (Some("FAILED"), Some("worker_lost")),
        "{record}"
    );
}

/// The request is in no heartbeat a live worker saw (its worker's entry was gone before any
/// live worker started): whoever asks about it ends it, and the first answer says so.
#[tokio::test]
async fn a_request_no_heartbeat_shows_is_ended_by_the_first_status_that_finds_its_worker_gone() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(
        Script::from_toml_str("[[rules]]\nreply = \"a b c d e f g h i j\"\ndelay_ms = 2000\n")
            .unwrap(),
    )
    .await
    .unwrap();
    let s = settings(&nats, &mock);
    let mut doomed = worker_process_with(
        &s,
        "doomed",
        &[
            ("GENFLEET__WORKER__HEARTBEAT_MS", "200"),
            ("GENFLEET__WORKER__LOST_AFTER_MS", "1000"),
        ],
    );
    let client = Client::connect(&s).await.unwrap();
    let mut accepted = None;
    for _ in 0..100 {
        if let Ok(a) = client.submit("default", &req("unlisted")).await {
            accepted = Some(a);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(accepted.unwrap().worker_id, "doomed");
    doomed.0.kill().unwrap();
    doomed.0.wait().unwrap();
    // Its heartbeat ages out of the bucket before any other worker exists.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while common::fleet::heartbeats(client.nats())
        .await
        .contains_key("doomed")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the heartbeat never aged out"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _live = spawn_worker(s.clone()).await;
    let status = client.status("unlisted").await.unwrap();
    assert_eq!(status.state, RequestState::Failed, "{status:?}");
    let finished = status.finished.expect("a finished request's summary");
    assert_eq!(finished.reason, Reason::WorkerLost, "{finished:?}");
    assert!(finished.detail.unwrap().contains("doomed"));
    let r = client.result("unlisted", true).await.unwrap();
    assert_eq!(
        (r.state, r.reason),
        (RequestState::Failed, Reason::WorkerLost)
    );
}

#[tokio::test]
async fn a_request_out_of_deliveries_is_stored_as_worker_lost_and_removed() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(
        Script::from_toml_str("[[rules]]\nreply = \"a b c d e f g h\"\ndelay_ms = 300\n").unwrap(),
    )
    .await
    .unwrap();
    let mut s = settings(&nats, &mock);
    s.jetstream.queue_max_deliver = 1;
    let mut doomed = worker_process_with(
        &s,
        "exhausted-worker",
        &[("GENFLEET__JETSTREAM__QUEUE_MAX_DELIVER", "1")],
    );
    let client = Client::connect(&s).await.unwrap();
    wait_for_a_worker(&client).await;
    client.enqueue("default", &req("exhausted")).await.unwrap();
    wait_running(&client, "exhausted").await;
    doomed.0.kill().unwrap();
    doomed.0.wait().unwrap();
    let _live = spawn_worker(s.clone()).await;
    let r = terminal(&client, "exhausted", Duration::from_secs(20)).await;
    assert_eq!(
        (r.state, r.reason),
        (RequestState::Failed, Reason::WorkerLost),
        "{r:?}"
    );
    assert!(r.detail.unwrap().contains("deliveries exhausted"));
    // The result is stored first, then the message is removed.
    let js = async_nats::jetstream::new(client.nats().clone());
    let mut stream = js.get_stream("GENFLEET_QUEUE").await.unwrap();
    let mut left = u64::MAX;
    for _ in 0..100 {
        left = stream.info().await.unwrap().state.messages;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(left, 0, "the message is removed");
}

#[tokio::test]
async fn sigterm_drains_the_worker_and_it_exits_zero() {
    let nats = NatsServer::start().await;
    let mock = MockServer::start(
        Script::from_toml_str("[[rules]]\nreply = \"a b c d\"\ndelay_ms = 100\n").unwrap(),
    )
    .await
    .unwrap();
    let s = settings(&nats, &mock);
    let mut worker = worker_process(&s, "terminated");
    let client = Client::connect(&s).await.unwrap();
    let mut accepted = false;
    for _ in 0..100 {
        if client.submit("default", &req("last")).await.is_ok() {
            accepted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(accepted);
    let pid = worker.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::task::spawn_blocking(move || {
        let status = worker.0.wait();
        (worker, status)
    })
    .await
    .unwrap()
    .1
    .unwrap();
    assert!(status.success(), "exit status {status:?}");
    // The drain let the running request finish first; the stores have its result.
    let js = async_nats::jetstream::new(client.nats().clone());
    let results = js.get_key_value("GENFLEET_RESULTS").await.unwrap();
    let stored: serde_json::Value =
        serde_json::from_slice(&results.get("res.last").await.unwrap().unwrap()).unwrap();
    assert_eq!(
        (stored["state"].as_str(), stored["output"].as_str()),
        (Some("COMPLETED"), Some("a b c d"))
    );
}
