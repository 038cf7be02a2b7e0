//! A rolling upgrade of one pool, as docs/operations.md#upgrade-order states the rule: a worker
//! of the previous release (the commit in tests/data/previous-release, built by
//! scripts/previous-release.sh) serves the pool beside a worker of this release under steady
//! load, interactive and durable, then drains and is replaced by a worker of this release; then
//! a client of the previous release is served by this release's workers. Every request accepted
//! ends once (one `finished` event, one stored result, COMPLETED), none is lost, and each
//! release's worker served some of them.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fleet::{self, Fleet};
use common::wait;
use futures_util::StreamExt;
use genfleet::client::Client;
use genfleet::protocol::{Event, EventBody, GenerationRequest, RequestState};

/// Eight words, a tenth of a second apart: a request runs for about a second, so a worker
/// asked to stop has requests in hand.
const SCRIPT: &str =
    "[[rules]]\nreply = \"one two three four five six seven eight\"\ndelay_ms = 100\n";
/// Callers, each sending one interactive request at a time and queueing a durable one beside
/// it.
const CALLERS: usize = 4;
/// How long each phase may take to see what it waits for: generous, never wrong.
const PHASE: Duration = Duration::from_secs(90);
/// Requests each release's worker must have ended before its phase ends.
const SERVED_PER_PHASE: usize = 4;

/// The previous release's executable: `GENFLEET_PREVIOUS_RELEASE` (scripts/test.sh sets it), or
/// where scripts/previous-release.sh leaves it.
fn previous_release() -> PathBuf {
    if let Some(path) = std::env::var_os("GENFLEET_PREVIOUS_RELEASE") {
        return PathBuf::from(path);
    }
    let manifest = env!("CARGO_MANIFEST_DIR");
    let release = std::fs::read_to_string(format!("{manifest}/tests/data/previous-release"))
        .expect("tests/data/previous-release");
    let commit = release
        .lines()
        .find(|line| !line.starts_with('#') && !line.trim().is_empty())
        .and_then(|line| line.split_whitespace().next())
        .expect("a commit in tests/data/previous-release");
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| format!("{manifest}/target"));
    let exe = PathBuf::from(format!("{target}/previous-release/{commit}/genfleet"));
    assert!(
        exe.is_file(),
        "no build of the previous release at {}: run scripts/previous-release.sh (scripts/test.sh does)",
        exe.display()
    );
    exe
}

/// What the test saw: the `finished` events of every request, and the requests accepted.
#[derive(Default)]
struct Seen {
    /// Request id -> the workers whose `finished` event came, one entry per event.
    finished: BTreeMap<String, Vec<String>>,
    interactive: Vec<String>,
    durable: Vec<String>,
}

impl Seen {
    /// Requests that `worker` ended.
    fn ended_by(&self, worker: &str) -> usize {
        self.finished
            .values()
            .filter(|workers| workers.iter().any(|w| w == worker))
            .count()
    }
}

/// One caller: an interactive request at a time (sent again while every slot is busy, and
/// followed to its result), with a durable one queued beside each, until `stop`.
async fn caller(client: Client, n: usize, seen: Arc<Mutex<Seen>>, stop: Arc<AtomicBool>) {
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let durable = GenerationRequest {
            request_id: Some(format!("d-{n}-{i}")),
            ..GenerationRequest::user("queued")
        };
        client.enqueue("default", &durable).await.expect("enqueued");
        seen.lock().unwrap().durable.push(format!("d-{n}-{i}"));
        let interactive = GenerationRequest {
            request_id: Some(format!("i-{n}-{i}")),
            ..GenerationRequest::user("interactive")
        };
        let accepted = fleet::submit_until_accepted(&client, "default", &interactive, PHASE).await;
        seen.lock()
            .unwrap()
            .interactive
            .push(accepted.request_id.clone());
        let result = fleet::terminal(&client, &accepted.request_id, PHASE).await;
        assert_eq!(
            result.state,
            RequestState::Completed,
            "{}: {result:?}",
            accepted.request_id
        );
        i += 1;
    }
}

/// Waits until `worker` has ended [`SERVED_PER_PHASE`] requests.
async fn until_served(seen: &Arc<Mutex<Seen>>, worker: &str) {
    wait::until(&format!("{worker} to serve requests"), PHASE, || async {
        let ended = seen.lock().unwrap().ended_by(worker);
        if ended >= SERVED_PER_PHASE {
            Ok(())
        } else {
            Err(format!("{ended} ended"))
        }
    })
    .await;
}

#[tokio::test]
async fn a_pool_upgrades_from_the_previous_release_under_load() {
    let previous = previous_release();
    let fleet = Fleet::builder()
        .script(SCRIPT)
        .default_settings()
        .client_timeout(Duration::from_secs(10))
        .slots(3)
        .worker_processes(["new-1"])
        .start()
        .await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut events = fleet
        .client
        .nats()
        .subscribe(fleet.client.subjects().events(">"))
        .await
        .unwrap();
    let collector = {
        let seen = seen.clone();
        tokio::spawn(async move {
            while let Some(message) = events.next().await {
                if let Ok(Event {
                    request_id,
                    body: EventBody::Finished { result },
                    ..
                }) = serde_json::from_slice::<Event>(&message.payload)
                {
                    let mut seen = seen.lock().unwrap();
                    let workers = seen.finished.entry(request_id).or_default();
                    workers.push(result.worker_id);
                }
            }
        })
    };
    // The previous release's worker joins the pool.
    let mut old = fleet.start_worker_process_of(&previous, "old-1");
    fleet::wait_workers(fleet.client.nats(), 2, PHASE, fleet.logs()).await;

    let stop = Arc::new(AtomicBool::new(false));
    let callers: Vec<_> = (0..CALLERS)
        .map(|n| tokio::spawn(caller(fleet.client.clone(), n, seen.clone(), stop.clone())))
        .collect();
    // Both releases serve the pool side by side.
    until_served(&seen, "old-1").await;
    until_served(&seen, "new-1").await;

    // The rolling step: a worker of this release comes up, the previous one drains and goes.
    let _new = fleet.start_worker_process("new-2", &[]);
    old.ask_to_stop();
    let exited = wait::until(
        "the previous release's worker to drain and exit",
        PHASE,
        || {
            let status = old.child.try_wait().expect("the worker's status");
            async move { status.ok_or("still running") }
        },
    )
    .await;
    assert!(
        exited.success(),
        "the previous release's worker exited with {exited}"
    );
    until_served(&seen, "new-2").await;
    stop.store(true, Ordering::Relaxed);
    for caller in callers {
        caller.await.expect("a caller");
    }

    // A client of the previous release, served by this release's workers.
    // Awaited, not blocking: the mock backend runs on this test's runtime.
    let output = tokio::process::Command::new(&previous)
        .args([
            "submit",
            "--follow",
            "--wait-secs",
            "60",
            "--json",
            "--request-id",
            "old-client-1",
            "from the old client",
        ])
        .env("GENFLEET__NATS__URL", fleet.nats.url())
        .output()
        .await
        .expect("the previous release's client runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("one two three"),
        "the previous release's submit: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );

    // Every request accepted ends once, COMPLETED: the durable ones too (those the previous
    // release's worker handed back as it drained ran again elsewhere, and ended once).
    let (interactive, durable) = {
        let seen = seen.lock().unwrap();
        (seen.interactive.clone(), seen.durable.clone())
    };
    for id in durable.iter().chain(&interactive) {
        let result = fleet::terminal(&fleet.client, id, PHASE).await;
        assert_eq!(result.state, RequestState::Completed, "{id}: {result:?}");
    }
    let all: Vec<String> = durable
        .iter()
        .chain(&interactive)
        .cloned()
        .chain(["old-client-1".to_string()])
        .collect();
    wait::until("a finished event for every request", PHASE, || async {
        let seen = seen.lock().unwrap();
        let missing: Vec<&String> = all
            .iter()
            .filter(|id| !seen.finished.contains_key(*id))
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!("none yet for {missing:?}"))
        }
    })
    .await;
    // A late second `finished` would come within moments of the first; the fleet is at rest.
    fleet::wait_only_results_left(fleet.client.nats(), PHASE).await;
    collector.abort();
    let seen = seen.lock().unwrap();
    let twice: Vec<(&String, &Vec<String>)> = seen
        .finished
        .iter()
        .filter(|(_, workers)| workers.len() > 1)
        .collect();
    assert!(twice.is_empty(), "requests that finished twice: {twice:?}");
    assert!(
        seen.ended_by("old-1") >= SERVED_PER_PHASE
            && seen.ended_by("new-1") >= SERVED_PER_PHASE
            && seen.ended_by("new-2") >= SERVED_PER_PHASE,
        "each release's workers served the pool"
    );
}

/// The first release's worker read its pool's whole queue through one consumer,
/// `genfleet-<pool>` on `gen.queue.<pool>.>`; since bands and tenants, that consumer takes the
/// v1 subjects alone, beside one consumer per band and tenant (a work-queue stream refuses
/// consumers whose subjects overlap). A worker of this release that finds the wide consumer
/// remakes it narrow: the requests queued meanwhile, v1 and banded, and those the old consumer
/// had delivered and not seen acknowledged (its worker gone with them) all run, each once.
#[tokio::test]
async fn the_first_releases_queue_consumer_is_narrowed_without_losing_a_request() {
    use async_nats::jetstream::consumer;
    use genfleet::protocol::Priority;

    let f = Fleet::builder()
        .script("[[rules]]\nreply = \"durable done\"\n")
        .default_settings()
        .workers(0)
        .slots(2)
        .start()
        .await;
    // A first worker makes the streams; the pool then has none while the old consumer is put
    // back as the first release made it.
    let first = f.start_worker().await;
    tokio::task::spawn_blocking(move || first.stop())
        .await
        .unwrap()
        .unwrap();
    let js = async_nats::jetstream::new(f.client.nats().clone());
    let queue = js.get_stream("GENFLEET_QUEUE").await.unwrap();
    for name in queue.consumer_names().collect::<Vec<_>>().await {
        queue.delete_consumer(&name.unwrap()).await.unwrap();
    }
    let wide: consumer::PullConsumer = queue
        .create_consumer(consumer::pull::Config {
            durable_name: Some("genfleet-default".into()),
            filter_subject: "gen.queue.default.>".into(),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();

    // Queued under the old consumer: requests of the v1 subjects and of the bands.
    let mut ids = Vec::new();
    for i in 0..4 {
        let id = format!("v1-{i}");
        f.client
            .enqueue("default", &fleet::request(&id, &format!("go {id}")))
            .await
            .unwrap();
        ids.push(id);
    }
    for (i, band) in [Priority::High, Priority::Low].into_iter().enumerate() {
        let id = format!("banded-{i}");
        let request = GenerationRequest {
            priority: Some(band),
            ..fleet::request(&id, &format!("go {id}"))
        };
        f.client.enqueue("default", &request).await.unwrap();
        ids.push(id);
    }
    // The old release's worker took two and was gone before it acknowledged them.
    let mut taken = wide.fetch().max_messages(2).messages().await.unwrap();
    let mut held = 0;
    while let Some(message) = taken.next().await {
        message.unwrap();
        held += 1;
    }
    assert_eq!(held, 2);

    // This release's worker comes: everything runs, each request once.
    let _worker = f.start_worker().await;
    for id in &ids {
        let result = fleet::terminal(&f.client, id, PHASE).await;
        assert_eq!(
            (result.state, result.output.as_str()),
            (RequestState::Completed, "durable done"),
            "{id}: {result:?}"
        );
    }
    let info = queue
        .consumer_info("genfleet-default")
        .await
        .unwrap()
        .config
        .filter_subject
        .clone();
    assert_ne!(info, "gen.queue.default.>", "the v1 consumer was narrowed");
    let prompts: Vec<String> = f
        .mock()
        .requests()
        .iter()
        .map(|body| body["messages"].to_string())
        .collect();
    for id in &ids {
        let runs = prompts
            .iter()
            .filter(|p| p.contains(&format!("\"go {id}\"")))
            .count();
        assert_eq!(runs, 1, "{id} ran {runs} times");
    }
}
