//! The durable queue on a real nats-server: runs when a slot frees, survives a worker killed
//! mid-generation (attempt 2 on another worker), cancels while queued, refuses bad messages.

mod common;

use std::process::Command;
use std::time::Duration;

use common::fleet::{self, Fleet, FleetBuilder, request};
use common::wait;
use futures_util::StreamExt;
use genfleet::client::Client;
use genfleet::protocol::event::SEQ_AFTER_LOST;
use genfleet::protocol::{ErrorCode, Event, EventBody, GenerationRequest, Reason, RequestState};

/// One slot a worker, a short drain and a short ack wait (for worker processes too); the test
/// starts the workers unless it says otherwise.
fn fleet() -> FleetBuilder<'static> {
    Fleet::builder()
        .default_settings()
        .workers(0)
        .slots(1)
        .settings(|s| {
            s.worker.drain_timeout_ms = 300;
            s.jetstream.queue_ack_wait_ms = 1500;
        })
        .worker_env("GENFLEET__JETSTREAM__QUEUE_ACK_WAIT_MS", 1500)
}

/// Heartbeats every 200 ms and a worker lost after 1 s, for the worker processes and those in
/// this process alike.
fn fast_heartbeats(builder: FleetBuilder<'static>) -> FleetBuilder<'static> {
    builder
        .settings(|s| {
            s.worker.heartbeat_ms = 200;
            s.worker.lost_after_ms = 1000;
        })
        .worker_env("GENFLEET__WORKER__HEARTBEAT_MS", 200)
        .worker_env("GENFLEET__WORKER__LOST_AFTER_MS", 1000)
}

/// How long anything this file waits for may take: generous, a busy machine is slow, never
/// wrong.
const WITHIN: Duration = Duration::from_secs(20);

/// Answers that take 20 s: the request outlives the worker killed under it.
const LONG: &str = "[[rules]]\nreply = \"a b c d e f g h i j\"\ndelay_ms = 2000\n";

/// The fleet of `builder`, whose one worker, the process "doomed", runs the interactive
/// request `id` (to be killed under it).
async fn doomed_running(builder: FleetBuilder<'static>, id: &str) -> Fleet {
    let f = builder.worker_processes(["doomed"]).start().await;
    let accepted =
        fleet::submit_until_accepted(&f.client, "default", &req(id), Duration::from_secs(10)).await;
    assert_eq!(accepted.worker_id, "doomed");
    f
}

fn req(id: &str) -> GenerationRequest {
    request(id, "go")
}

async fn terminal(
    client: &Client,
    id: &str,
    within: Duration,
) -> genfleet::protocol::GenerationResult {
    fleet::wait_result(client, id, within, fleet::RUNNING_UNCLAIMED_OR_UNANSWERED).await
}

#[tokio::test]
async fn queued_requests_run_when_a_worker_is_there_and_duplicates_are_kept_once() {
    // Each request takes a moment (two words, 200 ms each), so q3 still waits behind q1 and q2
    // when it is cancelled.
    let f = fleet()
        .script("[[rules]]\nreply = \"durable done\"\ndelay_ms = 200\n")
        .start()
        .await;
    let client = &f.client;
    // A first worker creates the stream; stop it so requests wait.
    let first = f.start_worker().await;
    tokio::task::spawn_blocking(move || first.stop())
        .await
        .unwrap()
        .unwrap();
    // Its last pull request lives on at the server until it expires; a message published
    // before then would be delivered to it (and come back as attempt 2).
    let js = async_nats::jetstream::new(client.nats().clone());
    let queue = js.get_stream("GENFLEET_QUEUE").await.unwrap();
    wait::until(
        "the stopped worker's last pull to expire",
        WITHIN,
        || async {
            let consumer: async_nats::jetstream::consumer::PullConsumer =
                queue.get_consumer("genfleet-default").await.unwrap();
            consumer.cached_info().num_waiting == 0
        },
    )
    .await;
    // Each prompt names its request, so the backend's log tells which ran.
    let queued = |id: &str| request(id, &format!("go {id}"));
    let first = client.enqueue("default", &queued("q1")).await.unwrap();
    assert!(!first.duplicate);
    assert!(
        client
            .enqueue("default", &queued("q1"))
            .await
            .unwrap()
            .duplicate
    );
    client.enqueue("default", &queued("q2")).await.unwrap();
    client.enqueue("default", &queued("q3")).await.unwrap();
    // No worker: nobody answers status; start one and they all run, one slot at a time.
    let worker = f.start_worker().await;
    // Cancel q3 while it still waits: the worker has one slot, and q1 runs (q2 comes next).
    wait::until("q1 runs", WITHIN, || async { running(client, "q1").await }).await;
    let cancelled = client.cancel("q3").await.unwrap();
    assert_eq!(cancelled.state, RequestState::Cancelled, "{cancelled:?}");
    for id in ["q1", "q2"] {
        let r = terminal(client, id, WITHIN).await;
        assert_eq!(
            (r.state, r.output.as_str(), r.attempt),
            (RequestState::Completed, "durable done", 1),
            "{id}"
        );
    }
    let r3 = terminal(client, "q3", WITHIN).await;
    assert_eq!(
        (r3.state, r3.reason),
        (RequestState::Cancelled, Reason::Cancelled),
        "{r3:?}"
    );
    assert!(
        matches!(
            r3.detail.as_deref(),
            Some("cancelled while queued" | "cancelled while waiting for a slot")
        ),
        "{r3:?}"
    );
    // q1, sent twice, ran once; q3 never reached the backend.
    let prompts: Vec<String> = f
        .mock()
        .requests()
        .iter()
        .map(|body| body["messages"].to_string())
        .collect();
    let runs = |id: &str| {
        prompts
            .iter()
            .filter(|p| p.contains(&format!("\"go {id}\"")))
            .count()
    };
    assert_eq!(
        (runs("q1"), runs("q2"), runs("q3")),
        (1, 1, 0),
        "{prompts:#?}"
    );
    // Every message acked or removed.
    fleet::wait_queue_empty(client.nats(), "default", WITHIN).await;
    drop(worker);
}

#[tokio::test]
async fn a_queued_request_shows_queued_and_cancelling_it_means_it_never_runs() {
    let f = fleet()
        .script("[[rules]]\nreply = \"a b c d e f g h i j\"\ndelay_ms = 200\n")
        .workers(1)
        .start()
        .await;
    let client = &f.client;
    client.enqueue("default", &req("long")).await.unwrap();
    // The single slot is busy with `long`; `waiting` stays in the queue.
    wait::until("long runs", WITHIN, || async {
        running(client, "long").await
    })
    .await;
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
}

/// A worker finds a queued request by its own subjects in the worker's pool (each one found at
/// once, however long the queue), and by looking through the queue in any other pool: both say
/// QUEUED with the band and the tenant, for the default tenant and another.
#[tokio::test]
async fn a_queued_request_is_found_in_the_workers_pool_and_in_any_other() {
    use genfleet::protocol::Priority;
    // `long` holds the one slot for 20 s, far longer than the looking up takes; it is
    // cancelled at the end.
    let f = fleet().script(LONG).workers(1).start().await;
    let client = &f.client;
    client.enqueue("default", &req("long")).await.unwrap();
    // The single slot is busy with `long`: what is queued after it waits.
    wait_running(client, "long").await;
    let acme = client.clone().with_tenant("acme").unwrap();
    // Who queues it, in which pool, its id and its band; its tenant is the caller's.
    let cases = [
        (client, "default", "d-normal", Priority::Normal),
        (client, "default", "d-low", Priority::Low),
        (&acme, "default", "a-low", Priority::Low),
        (&acme, "default", "a-high", Priority::High),
        // A pool no worker serves.
        (client, "elsewhere", "e-normal", Priority::Normal),
        (&acme, "elsewhere", "e-low", Priority::Low),
    ];
    for (caller, pool, id, band) in cases {
        let mut request = req(id);
        request.priority = Some(band);
        caller.enqueue(pool, &request).await.unwrap();
        let status = caller.status(id).await.unwrap();
        let tenant = caller.tenant().unwrap_or("default");
        assert_eq!(
            (status.state, status.priority, status.tenant.as_deref()),
            (RequestState::Queued, Some(band), Some(tenant)),
            "{id} in pool {pool}"
        );
    }
    // Another tenant's id is not found, wherever it waits.
    let other = client.clone().with_tenant("other").unwrap();
    for id in ["a-low", "e-low"] {
        let error = other.status(id).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::NotFound), "{id}");
    }
    for (caller, _, id, _) in cases {
        caller.cancel(id).await.unwrap();
    }
    client.cancel("long").await.unwrap();
}

/// A durable message pulled while a slot was free, whose slot an interactive submit took before
/// it started, waits in the worker's hand: it shows QUEUED, and a cancel ends it CANCELLED
/// without it ever running (it used to answer NOT_FOUND, and the request ran later).
#[tokio::test]
async fn a_durable_request_in_hand_waiting_for_a_slot_shows_queued_and_cancelling_it_means_it_never_runs()
 {
    let f = fleet()
        .script(
            "[[rules]]\nwhen_last_user_contains = \"slow\"\nreply = \"a b c d e f g h i j\"\n\
             delay_ms = 200\n",
        )
        .workers(1)
        .start()
        .await;
    let client = &f.client;
    let worker_id = f.workers[0].worker_id.clone();
    let mut in_hand = 0;
    let mut round = 0;
    let mut waited = Vec::new();
    let (mut won, mut queued) = (0, 0);
    while in_hand == 0 || round < 5 {
        assert!(
            round < 40,
            "no round had the message in the worker's hand while the slot was taken \
             ({won} rounds the message took the slot, {queued} it waited in the queue)"
        );
        let busy = format!("busy-{round}");
        let waiting = format!("in-hand-{round}");
        round += 1;
        // The round before is over: the worker's slot is free and nothing waits for it.
        fleet::wait_worker_idle(client.nats(), &worker_id, WITHIN).await;
        // The worker hears of the message and pulls it for its free slot while the submit,
        // sent a moment later, takes that slot: who wins is the race's, so the moment is
        // swept from round to round.
        let lag = Duration::from_micros(500 * (round % 8));
        let durable = request(&waiting, &format!("slow {waiting}"));
        let (enqueued, submitted) = tokio::join!(client.enqueue("default", &durable), async {
            // Paces the race (the lag swept above), not a wait for anything.
            tokio::time::sleep(lag).await;
            client.submit("default", &request(&busy, "slow")).await
        });
        enqueued.unwrap();
        if let Err(error) = submitted {
            // The message took the slot: nothing waits this round.
            assert_eq!(error.code(), Some(ErrorCode::NoSlotAvailable), "{error}");
            won += 1;
            // Its claim may not be written yet: cancel it once it is.
            wait::until(&format!("{waiting} cancelled"), WITHIN, || async {
                match client.cancel(&waiting).await {
                    Ok(reply) => Ok(reply.state),
                    Err(e) if e.code() == Some(ErrorCode::AlreadyFinished) => {
                        Ok(RequestState::Completed)
                    }
                    Err(e) => Err(e.to_string()),
                }
            })
            .await;
            terminal(client, &waiting, WITHIN).await;
            continue;
        }
        // Its record is claimed with the state the worker's free slot promised and corrected
        // to QUEUED as soon as the Supervisor says it waits: status converges to QUEUED (a read
        // between the two writes may still say RUNNING), and never says it ended.
        wait::until(&format!("{waiting} shows QUEUED"), WITHIN, || async {
            match client.status(&waiting).await.map(|s| s.state) {
                Ok(RequestState::Queued) => Ok(()),
                Ok(RequestState::Running) => Err("RUNNING".to_string()),
                Ok(other) => panic!("{waiting} is {other:?} while it waits for the slot"),
                Err(error) => Err(error.to_string()),
            }
        })
        .await;
        let reply = client.cancel(&waiting).await.unwrap();
        assert_eq!(reply.state, RequestState::Cancelled, "{waiting}");
        let r = client.result(&waiting, true).await.unwrap();
        assert_eq!(
            (r.state, r.reason),
            (RequestState::Cancelled, Reason::Cancelled)
        );
        match r.detail.as_deref() {
            Some("cancelled while waiting for a slot") => in_hand += 1,
            Some("cancelled while queued") => queued += 1,
            other => panic!("{waiting}: detail {other:?}"),
        }
        waited.push(waiting);
        assert_eq!(
            client.cancel(&busy).await.unwrap().state,
            RequestState::Cancelled
        );
    }
    // Cancelled while they waited, none of them ever reached the backend, and the slot is
    // free again.
    let done = client
        .run("default", req("after"), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(done.state, RequestState::Completed);
    let prompts = serde_json::to_string(&f.mock().requests()).unwrap();
    for waiting in waited {
        assert!(
            !prompts.contains(&format!("\"slow {waiting}\"")),
            "{waiting} ran after it was cancelled"
        );
    }
}

#[tokio::test]
async fn a_message_whose_id_does_not_match_its_subject_is_stored_as_invalid_request() {
    // The mock echoes.
    let f = fleet().workers(1).start().await;
    let client = &f.client;
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
        let r = terminal(client, id, Duration::from_secs(10)).await;
        assert_eq!(
            (r.state, r.reason),
            (RequestState::Failed, Reason::InvalidRequest),
            "{id}"
        );
    }
}

/// Whether a worker runs `id` now.
async fn running(client: &Client, id: &str) -> bool {
    client.status(id).await.ok().map(|s| s.state) == Some(RequestState::Running)
}

/// Waits (bounded, loud) until a worker runs `id`.
async fn wait_running(client: &Client, id: &str) {
    wait::until(&format!("{id} runs"), WITHIN, || async {
        running(client, id).await
    })
    .await;
}

#[tokio::test]
async fn a_worker_killed_mid_generation_leaves_the_request_to_another_as_attempt_two() {
    // The fleet starts once the doomed worker serves, so it takes the request.
    let mut f = fleet()
        .script("[[rules]]\nreply = \"one two three four five six\"\ndelay_ms = 150\n")
        .worker_processes(["doomed"])
        .start()
        .await;
    f.client.enqueue("default", &req("survivor")).await.unwrap();
    wait_running(&f.client, "survivor").await;
    f.processes[0].kill();
    let _rescuer = f.start_worker().await;
    let r = terminal(&f.client, "survivor", Duration::from_secs(20)).await;
    assert_eq!((r.state, r.attempt), (RequestState::Completed, 2), "{r:?}");
    assert_eq!(r.output, "one two three four five six");
    assert_ne!(r.worker_id, "doomed");
}

#[tokio::test]
async fn a_drain_hands_a_running_durable_request_back_to_another_worker() {
    let f = fleet()
        .script("[[rules]]\nreply = \"p q r s t u v w\"\ndelay_ms = 150\n")
        .start()
        .await;
    let leaving = f.start_worker().await;
    let client = &f.client;
    client.enqueue("default", &req("handed")).await.unwrap();
    wait_running(client, "handed").await;
    let staying = f.start_worker().await;
    // The drain deadline (300 ms) passes before the request ends: it is handed back.
    tokio::task::spawn_blocking(move || leaving.stop())
        .await
        .unwrap()
        .unwrap();
    let r = terminal(client, "handed", Duration::from_secs(20)).await;
    assert_eq!(
        (r.state, r.attempt, r.worker_id.as_str()),
        (RequestState::Completed, 2, staying.worker_id.as_str()),
        "{r:?}"
    );
}

#[tokio::test]
async fn an_interactive_request_of_a_killed_worker_is_ended_as_worker_lost_by_a_live_one() {
    let mut f = doomed_running(
        fast_heartbeats(fleet())
            .script("[[rules]]\nreply = \"a b c d e f g h i j\"\ndelay_ms = 300\n"),
        "orphan",
    )
    .await;
    f.processes[0].kill();
    let _live = f.start_worker().await;
    let r = terminal(&f.client, "orphan", Duration::from_secs(15)).await;
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
    let mut f = doomed_running(fast_heartbeats(fleet()).script(LONG), "listed").await;
    // A live worker that follows the heartbeats (its own slot is free: it took nothing).
    let _live = f.start_worker().await;
    wait::until("doomed's heartbeat to list the request", WITHIN, || async {
        fleet::heartbeats(f.client.nats())
            .await
            .get("doomed")
            .is_some_and(|running| running.iter().any(|id| id == "listed"))
    })
    .await;
    let mut events = f
        .client
        .nats()
        .subscribe(f.client.subjects().events("listed"))
        .await
        .unwrap();
    f.processes[0].kill();
    // Read from the bucket, not through a worker: only the heartbeat's follower can end it.
    let record = wait::until("the request's record to be a result", WITHIN, || async {
        let record = fleet::record(f.client.nats(), "listed").await.unwrap();
        if record.get("live").is_none() {
            Ok(record)
        } else {
            Err(record)
        }
    })
    .await;
    assert_eq!(
        (record["state"].as_str(), record["reason"].as_str()),
        (Some("FAILED"), Some("worker_lost")),
        "{record}"
    );
    // Its followers hear of the end from the worker that ended it, numbered past whatever the
    // lost worker sent.
    let finished = tokio::time::timeout(WITHIN, async {
        while let Some(message) = events.next().await {
            let event: Event = serde_json::from_slice(&message.payload).unwrap();
            if let EventBody::Finished { result } = event.body {
                return (event.seq, *result);
            }
        }
        panic!("the events ended")
    })
    .await
    .expect("a finished event");
    assert_eq!(finished.0, SEQ_AFTER_LOST);
    assert_eq!(
        (finished.1.state, finished.1.reason),
        (RequestState::Failed, Reason::WorkerLost)
    );
}

/// The request is in no heartbeat a live worker saw (its worker's entry was gone before any
/// live worker started): whoever asks about it ends it, and the first answer says so.
#[tokio::test]
async fn a_request_no_heartbeat_shows_is_ended_by_the_first_status_that_finds_its_worker_gone() {
    // Only the doomed worker beats fast; the live one comes later with the default beat.
    let doomed = fleet()
        .script(LONG)
        .worker_env("GENFLEET__WORKER__HEARTBEAT_MS", 200)
        .worker_env("GENFLEET__WORKER__LOST_AFTER_MS", 1000);
    let mut f = doomed_running(doomed, "unlisted").await;
    f.processes[0].kill();
    let client = &f.client;
    // Its heartbeat ages out of the bucket before any other worker exists.
    wait::until("doomed's heartbeat to age out", WITHIN, || async {
        !fleet::heartbeats(client.nats())
            .await
            .contains_key("doomed")
    })
    .await;
    let _live = f.start_worker().await;
    // The first status a worker answers. One that no worker answered (seen once on a busy
    // machine, just after the worker started) changed nothing, and is asked again.
    let status = wait::until("a worker to answer the status", WITHIN, || async {
        match client.status("unlisted").await {
            Err(error) if error.code().is_some() => panic!("the status failed: {error}"),
            answer => answer.map_err(|e| e.to_string()),
        }
    })
    .await;
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
    let mut f = fleet()
        .script("[[rules]]\nreply = \"a b c d e f g h\"\ndelay_ms = 300\n")
        .settings(|s| s.jetstream.queue_max_deliver = 1)
        .worker_processes(["exhausted-worker"])
        .worker_env("GENFLEET__JETSTREAM__QUEUE_MAX_DELIVER", 1)
        .start()
        .await;
    f.client
        .enqueue("default", &req("exhausted"))
        .await
        .unwrap();
    wait_running(&f.client, "exhausted").await;
    f.processes[0].kill();
    let _live = f.start_worker().await;
    let client = &f.client;
    let r = terminal(client, "exhausted", Duration::from_secs(20)).await;
    assert_eq!(
        (r.state, r.reason),
        (RequestState::Failed, Reason::WorkerLost),
        "{r:?}"
    );
    assert!(r.detail.unwrap().contains("deliveries exhausted"));
    // The result is stored first, then the message is removed.
    fleet::wait_queue_empty(client.nats(), "default", WITHIN).await;
}

#[tokio::test]
async fn sigterm_drains_the_worker_and_it_exits_zero() {
    let mut f = fleet()
        .script("[[rules]]\nreply = \"a b c d\"\ndelay_ms = 100\n")
        .worker_processes(["terminated"])
        .start()
        .await;
    let client = &f.client;
    fleet::submit_until_accepted(client, "default", &req("last"), Duration::from_secs(10)).await;
    let mut worker = f.processes.remove(0);
    let pid = worker.pid().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::task::spawn_blocking(move || {
        wait::until_blocking("the worker to exit on SIGTERM", WITHIN, || {
            worker.child.try_wait().expect("waits for the worker")
        })
    })
    .await
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
