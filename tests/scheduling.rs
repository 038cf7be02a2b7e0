//! Scheduling on a real nats-server with worker processes: priority bands on the durable queue
//! and in reserved slots, fair share between tenants, per-tenant limits.

mod common;

use std::time::Duration;

use common::fleet::{self, Fleet, request};
use common::wait;
use futures_util::StreamExt;
use genfleet::client::Client;
use genfleet::protocol::{ErrorCode, GenerationRequest, Priority, RequestState};

/// `block` answers take about 30 s (cancelled long before), everything else a moment.
const SCRIPT: &str = "[[rules]]\nwhen_last_user_contains = \"block\"\n\
reply = \"a b c d e f g h i j k l m n o\"\ndelay_ms = 2000\n\n\
[[rules]]\nreply = \"done\"\ndelay_ms = 20\n";

const WITHIN: Duration = Duration::from_secs(120);

fn in_band(id: &str, band: Priority) -> GenerationRequest {
    let mut r = request(id, id);
    r.priority = Some(band);
    r
}

/// The prompts the backend was asked, in the order it was asked (the order requests started
/// on a one-slot worker).
fn started(f: &Fleet) -> Vec<String> {
    f.mock()
        .requests()
        .iter()
        .filter_map(|body| {
            body["messages"]
                .as_array()?
                .iter()
                .rev()
                .find(|m| m["role"] == "user")
                .and_then(|m| m["content"].as_str())
                .map(str::to_string)
        })
        .collect()
}

/// Submits `id` (a `block` request) until a worker runs it; it holds its slot until cancelled.
async fn block(client: &Client, id: &str) {
    let accepted =
        fleet::submit_until_accepted(client, "default", &request(id, "block"), WITHIN).await;
    assert_eq!(accepted.state, RequestState::Running);
}

async fn wait_done(client: &Client, ids: impl IntoIterator<Item = String>) {
    for id in ids {
        let r = fleet::terminal(client, &id, WITHIN).await;
        assert_eq!(r.state, RequestState::Completed, "{id}: {r:?}");
    }
}

#[tokio::test]
async fn high_requests_start_before_every_waiting_low_one() {
    let f = Fleet::builder()
        .default_settings()
        .script(SCRIPT)
        .slots(1)
        .worker_processes(["w1"])
        .start()
        .await;
    let client = &f.client;
    block(client, "blocker").await;
    for i in 0..50 {
        client
            .enqueue("default", &in_band(&format!("low-{i}"), Priority::Low))
            .await
            .unwrap();
    }
    for i in 0..5 {
        client
            .enqueue("default", &in_band(&format!("high-{i}"), Priority::High))
            .await
            .unwrap();
    }
    // A queued request shows its band and tenant.
    let status = client.status("low-7").await.unwrap();
    assert_eq!(
        (status.state, status.priority, status.tenant.as_deref()),
        (RequestState::Queued, Some(Priority::Low), Some("default"))
    );
    // Cancelled while it waits in its band, it never runs.
    client
        .enqueue("default", &in_band("low-cancelled", Priority::Low))
        .await
        .unwrap();
    let reply = client.cancel("low-cancelled").await.unwrap();
    assert_eq!(reply.state, RequestState::Cancelled);
    let r = client.result("low-cancelled", true).await.unwrap();
    assert_eq!(r.detail.as_deref(), Some("cancelled while queued"));
    client.cancel("blocker").await.unwrap();
    wait_done(
        client,
        (0..5)
            .map(|i| format!("high-{i}"))
            .chain((0..50).map(|i| format!("low-{i}"))),
    )
    .await;
    let order = started(&f);
    let last_high = order.iter().rposition(|p| p.starts_with("high-")).unwrap();
    let first_low = order.iter().position(|p| p.starts_with("low-")).unwrap();
    assert!(
        last_high < first_low,
        "a low request started before a high one: {order:?}"
    );
    // Within a band, first in, first out.
    let lows: Vec<&String> = order.iter().filter(|p| p.starts_with("low-")).collect();
    let expected: Vec<String> = (0..50).map(|i| format!("low-{i}")).collect();
    assert_eq!(lows, expected.iter().collect::<Vec<_>>());
    assert!(!order.iter().any(|p| p == "low-cancelled"), "{order:?}");
}

#[tokio::test]
async fn reserved_slots_leave_a_flood_of_low_submits_no_slot_and_take_high() {
    let f = Fleet::builder()
        .default_settings()
        .script(SCRIPT)
        .slots(2)
        .worker_env("GENFLEET__WORKER__RESERVED_SLOTS__HIGH", 1)
        .worker_processes(["w1"])
        .start()
        .await;
    let client = &f.client;
    // A flood of low submits: one takes the unreserved slot, every other one is refused.
    let mut flood = futures_util::stream::iter(0..20)
        .map(|i| async move {
            let mut r = in_band(&format!("low-{i}"), Priority::Low);
            r.messages = request("x", "block").messages;
            client.submit("default", &r).await
        })
        .buffer_unordered(10);
    let (mut running, mut refused) = (Vec::new(), 0);
    while let Some(outcome) = flood.next().await {
        match outcome {
            Ok(accepted) => running.push(accepted.request_id),
            Err(error) => {
                assert_eq!(error.code(), Some(ErrorCode::NoSlotAvailable), "{error}");
                refused += 1;
            }
        }
    }
    assert_eq!((running.len(), refused), (1, 19), "{running:?}");
    // The reserved slot is high's.
    let mut high = in_band("high-1", Priority::High);
    high.messages = request("x", "block").messages;
    let accepted = client.submit("default", &high).await.unwrap();
    assert_eq!(accepted.state, RequestState::Running);
    let status = client.status("high-1").await.unwrap();
    assert_eq!(
        (status.priority, status.worker_id.as_deref()),
        (Some(Priority::High), Some("w1"))
    );
    for id in running.iter().chain(["high-1".to_string()].iter()) {
        client.cancel(id).await.unwrap();
    }
}

#[tokio::test]
async fn a_light_tenant_is_served_beside_a_flooding_one() {
    let f = Fleet::builder()
        .default_settings()
        .script(
            "[[rules]]\nwhen_last_user_contains = \"block\"\n\
             reply = \"a b c d e f g h i j k l m n o\"\ndelay_ms = 2000\n\n\
             [[rules]]\nwhen_last_user_contains = \"slow\"\nreply = \"done\"\ndelay_ms = 100\n\n\
             [[rules]]\nreply = \"done\"\n",
        )
        .slots(4)
        .worker_processes(["w1"])
        .start()
        .await;
    let tenant_a = f.client.clone().with_tenant("tenant-a").unwrap();
    let tenant_b = f.client.clone().with_tenant("tenant-b").unwrap();
    // Every slot busy while the tenants enqueue, so the order is the scheduler's alone.
    for i in 0..4 {
        block(&f.client, &format!("blocker-{i}")).await;
    }
    let mut sent = futures_util::stream::iter(0..2000)
        .map(|i| {
            let a = tenant_a.clone();
            // Tenant A's first requests are slow, so that the backend's log (its first 256
            // starts) still holds the start of the race when B's requests are done.
            let prompt = if i < 500 {
                format!("slow a-{i}")
            } else {
                format!("a-{i}")
            };
            async move {
                a.enqueue("default", &request(&format!("a-{i}"), &prompt))
                    .await
            }
        })
        .buffer_unordered(64);
    while let Some(queued) = sent.next().await {
        queued.unwrap();
    }
    for i in 0..20 {
        tenant_b
            .enqueue("default", &request(&format!("b-{i}"), &format!("b-{i}")))
            .await
            .unwrap();
    }
    let status = f.client.status("tenant-b.b-3").await.unwrap();
    assert_eq!(status.tenant.as_deref(), Some("tenant-b"));
    f.mock().clear_requests();
    for i in 0..4 {
        f.client.cancel(&format!("blocker-{i}")).await.unwrap();
    }
    wait_done(&tenant_b, (0..20).map(|i| format!("b-{i}"))).await;
    // The backend's log holds the first 256 starts: B's were all among them.
    let order = started(&f);
    let last_b = order.iter().rposition(|p| p.starts_with("b-"));
    let b_started = order.iter().filter(|p| p.starts_with("b-")).count();
    assert_eq!(
        b_started, 20,
        "every b started within the first starts: {order:?}"
    );
    let a_before = order[..last_b.unwrap()]
        .iter()
        .filter(|p| p.contains("a-"))
        .count();
    assert!(
        a_before < 199,
        "{a_before} of tenant A's requests started before tenant B's last"
    );
    // Tenant A's backlog drains afterwards; nothing is lost.
    wait_done(&tenant_a, (1990..2000).map(|i| format!("a-{i}"))).await;
    fleet::wait_queue_empty(f.client.nats(), "default", WITHIN).await;
}

#[tokio::test]
async fn a_tenant_limit_holds_under_concurrent_submits_from_two_processes() {
    let f = Fleet::builder()
        .default_settings()
        .script(SCRIPT)
        .slots(4)
        .worker_env("GENFLEET__WORKER__TENANTS__MAX_RUNNING", 2)
        .worker_processes(["w1"])
        .start()
        .await;
    let url = f.nats.url();
    // Two processes, each submitting four requests of tenant `acme` one after another.
    let submitter = |name: &str| {
        let script = (0..4)
            .map(|i| {
                format!(
                    "\"$GENFLEET\" submit --tenant acme --json --request-id {name}-{i} block; echo \" exit=$?\""
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        std::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .env("GENFLEET", env!("CARGO_BIN_EXE_genfleet"))
            .env("GENFLEET__NATS__URL", &url)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (one, two) = (submitter("p1"), submitter("p2"));
    let outputs = tokio::task::spawn_blocking(move || {
        [
            one.wait_with_output().unwrap(),
            two.wait_with_output().unwrap(),
        ]
    })
    .await
    .unwrap();
    let text: String = outputs
        .iter()
        .map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        })
        .collect();
    let running = text.matches("\"RUNNING\"").count();
    let limited = text.matches("TENANT_LIMIT").count();
    assert_eq!((running, limited), (2, 6), "{text}");
    // Another tenant still gets a slot.
    let other = f.client.clone().with_tenant("other").unwrap();
    let accepted = other
        .submit("default", &request("other-1", "block"))
        .await
        .unwrap();
    assert_eq!(accepted.state, RequestState::Running);
    let status = f.client.status("other.other-1").await.unwrap();
    assert_eq!(status.tenant.as_deref(), Some("other"));
    // The worker's service stats count them per tenant and band (the console's fleet view).
    wait::until(
        "the stats to count two of acme's and one of other's running",
        WITHIN,
        || async {
            let reply = f
                .client
                .nats()
                .request("$SRV.STATS.genfleet", "".into())
                .await
                .unwrap();
            let stats: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
            let tenants = stats["endpoints"][0]["data"]["tenants"].clone();
            let running = |name: &str| {
                tenants
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|t| t["tenant"] == name && t["band"] == "normal")
                    .and_then(|t| t["running"].as_u64())
            };
            if running("acme") == Some(2) && running("other") == Some(1) {
                Ok(())
            } else {
                Err(format!("tenants in the stats: {tenants}"))
            }
        },
    )
    .await;
    // Clean up: the refused ones were never there, so their cancels fail.
    for id in [
        "acme.p1-0",
        "acme.p1-1",
        "acme.p1-2",
        "acme.p1-3",
        "acme.p2-0",
        "acme.p2-1",
        "acme.p2-2",
        "acme.p2-3",
        "other.other-1",
    ] {
        let _ = f.client.cancel(id).await;
    }
}

/// Polls (bounded) until `id` runs.
async fn wait_running(client: &Client, id: &str) {
    wait::until(&format!("{id} runs"), WITHIN, || async {
        client
            .status(id)
            .await
            .map(|status| status.state)
            .map_err(|e| e.to_string())
            .and_then(|state| {
                if state == RequestState::Running {
                    Ok(())
                } else {
                    Err(format!("{state:?}"))
                }
            })
    })
    .await
}

/// A fleet with one-slot worker processes, a short ack wait and `max_deliver` deliveries.
fn killable(max_deliver: i64) -> common::fleet::FleetBuilder<'static> {
    Fleet::builder()
        .default_settings()
        .script("[[rules]]\nreply = \"one two three four five six\"\ndelay_ms = 300\n")
        .slots(1)
        .settings(move |s| {
            s.jetstream.queue_ack_wait_ms = 1500;
            s.jetstream.queue_max_deliver = max_deliver;
        })
        .worker_env("GENFLEET__JETSTREAM__QUEUE_ACK_WAIT_MS", 1500)
        .worker_env("GENFLEET__JETSTREAM__QUEUE_MAX_DELIVER", max_deliver)
}

#[tokio::test]
async fn a_tenants_request_of_a_killed_worker_runs_again_on_another() {
    let mut f = killable(5).worker_processes(["doomed"]).start().await;
    let acme = f.client.clone().with_tenant("acme").unwrap();
    acme.enqueue("default", &in_band("survivor", Priority::High))
        .await
        .unwrap();
    wait_running(&acme, "survivor").await;
    f.processes[0].kill();
    let _rescuer = f.start_worker().await;
    let r = fleet::terminal(&acme, "survivor", WITHIN).await;
    assert_eq!((r.state, r.attempt), (RequestState::Completed, 2), "{r:?}");
    assert_ne!(r.worker_id, "doomed");
}

#[tokio::test]
async fn a_tenants_request_out_of_deliveries_is_stored_as_worker_lost_and_removed() {
    let mut f = killable(1).worker_processes(["doomed"]).start().await;
    let acme = f.client.clone().with_tenant("acme").unwrap();
    acme.enqueue("default", &in_band("exhausted", Priority::Low))
        .await
        .unwrap();
    wait_running(&acme, "exhausted").await;
    f.processes[0].kill();
    let _live = f.start_worker().await;
    let r = fleet::terminal(&acme, "exhausted", WITHIN).await;
    assert_eq!(r.state, RequestState::Failed, "{r:?}");
    assert!(
        r.detail
            .as_deref()
            .unwrap_or("")
            .contains("deliveries exhausted"),
        "{r:?}"
    );
    fleet::wait_queue_empty(f.client.nats(), "default", WITHIN).await;
}
