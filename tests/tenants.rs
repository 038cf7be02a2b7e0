//! A tenant adversary (issue 32): every attack an earlier adversarial run found, tried again on
//! real nats-servers, real workers and the mock backend, and refused, with the victim's request
//! ending with its own output.
//!
//! - On a single-tenant fleet with no permissions: a queued copy of a running request's id
//!   never replaces its result (finding 1), and a worker paused past `worker.lost_after_ms`
//!   and resumed publishes no `finished` event that contradicts a stored result (finding 5).
//! - With the shipped config/nats/permissions.conf and two tenant users, `acme` (the
//!   attacker) and `bob` (the victim), each with its own reply prefix: acme can neither follow,
//!   read, cancel nor replace bob's request, its own request with bob's bare id is a separate
//!   request, a copy of bob's id on acme's own queue is acme's own request, and chain headers
//!   naming bob's decision are dropped (findings 3 and 4).
//! - The gateway with two API keys, one per tenant: the same caller-chosen `request_id` under
//!   the two keys is two completions, and a caller hanging up ends only its own (finding 2).
//!
//! The attacker talks raw NATS, as any program could. A request of a tenant other than
//! `default` is known on the bus as `<tenant>.<id>` (see docs/protocol.md). What is asserted
//! holds whatever the timing: conditions are polled with generous limits, durations are never
//! asserted.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fleet::{self, Fleet, Proc, request};
use common::nats::{NatsServer, free_port};
use common::process::Running;
use futures_util::{FutureExt, StreamExt};
use genfleet::protocol::RequestState;
use genfleet::settings::Settings;
use serde_json::{Value, json};
use tokio::time::Instant;

/// Generous: a busy machine is slow, never wrong.
const WITHIN: Duration = Duration::from_secs(60);

/// What a slow answer says after the caller's own words: 26 chunks, each after a pause, so a
/// request runs for several seconds (the words differ, so no loop is detected).
const TAIL: &str = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima \
                    mike november oscar papa quebec romeo sierra tango uniform victor whiskey \
                    xray yankee zulu";

/// The mock backend: every answer starts with the caller's last user message, so an output
/// tells whose request it is. `slow` answers take several seconds, `glacial` ones longer still
/// (the paused worker's requests outlive the set-up around them). `decide` raises a model
/// decision; its continuation says `continued`.
const SCRIPT: &str = r#"
[[rules]]
when_last_user_contains = "Decision chosen"
reply = "continued"

[[rules]]
when_last_user_contains = "decide"
reply = "Two ways."
tool_calls = [{ name = "request_decision", arguments = { question = "Which path?", options = [{ id = "fast", label = "Fast" }, { id = "safe", label = "Safe" }] } }]

[[rules]]
when_last_user_contains = "slow"
reply = "{{last_user}} | TAIL"
delay_ms = 200

[[rules]]
when_last_user_contains = "glacial"
reply = "{{last_user}} | TAIL"
delay_ms = 500

[[rules]]
reply = "{{last_user}} | done"
"#;

fn script() -> String {
    SCRIPT.replace("TAIL", TAIL)
}

/// The output of a `slow` prompt.
fn slow_output(prompt: &str) -> String {
    format!("{prompt} | {TAIL}")
}

/// The output of any other prompt.
fn fast_output(prompt: &str) -> String {
    format!("{prompt} | done")
}

/// A request body with a caller-chosen id.
fn body(id: &str, prompt: &str) -> Value {
    json!({"request_id": id, "messages": [{"role": "user", "content": prompt}]})
}

/// The error code of a reply, if it is an error reply.
fn code(reply: &Value) -> Option<&str> {
    reply.get("error")?.get("code")?.as_str()
}

/// A request with `headers` and a JSON body; the JSON reply (an error reply too), asked again
/// while no worker answers yet or every worker is full.
async fn ask(
    nats: &async_nats::Client,
    subject: &str,
    headers: async_nats::HeaderMap,
    body: &Value,
) -> Value {
    let payload: bytes::Bytes = serde_json::to_vec(body).unwrap().into();
    let deadline = Instant::now() + WITHIN;
    loop {
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            nats.request_with_headers(subject.to_string(), headers.clone(), payload.clone()),
        )
        .await;
        match reply {
            Ok(Ok(message)) => {
                let value: Value = serde_json::from_slice(&message.payload).unwrap_or_else(|e| {
                    panic!(
                        "{subject}: unreadable reply {:?}: {e}",
                        String::from_utf8_lossy(&message.payload)
                    )
                });
                if code(&value) == Some("NO_SLOT_AVAILABLE") && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                return value;
            }
            Ok(Err(error))
                if Instant::now() < deadline
                    && matches!(
                        error.kind(),
                        async_nats::RequestErrorKind::NoResponders
                            | async_nats::RequestErrorKind::TimedOut
                    ) =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Ok(Err(error)) => panic!("{subject}: {error}"),
            Err(_) if Instant::now() < deadline => {}
            Err(_) => panic!("{subject}: no reply within {WITHIN:?}"),
        }
    }
}

/// `ask` with no headers.
async fn ask_plain(nats: &async_nats::Client, subject: &str, body: &Value) -> Value {
    ask(nats, subject, async_nats::HeaderMap::new(), body).await
}

/// Submits on `subject` and checks the acceptance names `expected_id`; returns the worker.
async fn submit_accepted(
    nats: &async_nats::Client,
    subject: &str,
    headers: async_nats::HeaderMap,
    body: &Value,
    expected_id: &str,
) -> String {
    let reply = ask(nats, subject, headers, body).await;
    assert_eq!(
        (
            code(&reply),
            reply["request_id"].as_str(),
            reply["state"].as_str()
        ),
        (None, Some(expected_id), Some("RUNNING")),
        "submit on {subject}: {reply}"
    );
    reply["worker_id"].as_str().unwrap().to_string()
}

/// The stored result of `id` (as the bus knows it), peeked through the workers, polled while
/// it is not ready or not claimed yet.
async fn result_of(nats: &async_nats::Client, id: &str) -> Value {
    let subject = format!("gen.result.{id}");
    let deadline = Instant::now() + WITHIN;
    loop {
        let reply = ask_plain(nats, &subject, &json!({"release": false})).await;
        match code(&reply) {
            None => return reply,
            Some("NOT_READY" | "NOT_FOUND") if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Some(_) => panic!("{id}: no result within {WITHIN:?}: {reply}"),
        }
    }
}

/// Puts `body` on a queue subject with JetStream and `Nats-Msg-Id: msg_id`; returns the
/// stream's acknowledgement.
async fn enqueue_raw(
    nats: &async_nats::Client,
    subject: &str,
    msg_id: &str,
    body: &Value,
) -> async_nats::jetstream::publish::PublishAck {
    enqueue_bytes(nats, subject, msg_id, serde_json::to_vec(body).unwrap()).await
}

/// `enqueue_raw` with any payload.
async fn enqueue_bytes(
    nats: &async_nats::Client,
    subject: &str,
    msg_id: &str,
    payload: Vec<u8>,
) -> async_nats::jetstream::publish::PublishAck {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg_id);
    let js = async_nats::jetstream::new(nats.clone());
    js.publish_with_headers(subject.to_string(), headers, payload.into())
        .await
        .unwrap_or_else(|e| panic!("{subject}: {e}"))
        .await
        .unwrap_or_else(|e| panic!("{subject}: the stream did not take it: {e}"))
}

/// An entry of a KV bucket, read as the admin: its revision and its JSON.
async fn kv_entry(nats: &async_nats::Client, bucket: &str, key: &str) -> Option<(u64, Value)> {
    let js = async_nats::jetstream::new(nats.clone());
    let kv = js
        .get_key_value(bucket)
        .await
        .unwrap_or_else(|e| panic!("bucket {bucket}: {e}"));
    let entry = kv
        .entry(key)
        .await
        .unwrap_or_else(|e| panic!("{bucket} {key}: {e}"))?;
    if entry.operation != async_nats::jetstream::kv::Operation::Put {
        return None;
    }
    Some((
        entry.revision,
        serde_json::from_slice(&entry.value).unwrap_or(Value::Null),
    ))
}

/// The keys of a KV bucket, read as the admin.
async fn kv_keys(nats: &async_nats::Client, bucket: &str) -> Vec<String> {
    let js = async_nats::jetstream::new(nats.clone());
    let Ok(kv) = js.get_key_value(bucket).await else {
        return Vec::new();
    };
    let Ok(keys) = kv.keys().await else {
        return Vec::new();
    };
    keys.filter_map(|k| std::future::ready(k.ok()))
        .collect()
        .await
}

/// Waits (bounded) until `check` holds.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WITHIN;
    while !check().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every message on a subject (events), as it comes: its subject and its JSON.
struct Seen {
    messages: Arc<Mutex<Vec<(String, Value)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Seen {
    async fn start(nats: &async_nats::Client, subject: &str) -> Seen {
        let mut sub = nats.subscribe(subject.to_string()).await.unwrap();
        nats.flush().await.unwrap();
        let messages = Arc::new(Mutex::new(Vec::new()));
        let into = messages.clone();
        let task = tokio::spawn(async move {
            while let Some(message) = sub.next().await {
                let value = serde_json::from_slice(&message.payload).unwrap_or(Value::Null);
                into.lock()
                    .unwrap()
                    .push((message.subject.to_string(), value));
            }
        });
        Seen { messages, task }
    }

    fn all(&self) -> Vec<(String, Value)> {
        self.messages.lock().unwrap().clone()
    }

    /// The events of request `id`, with the subject each came on.
    fn of(&self, id: &str) -> Vec<(String, Value)> {
        self.all()
            .into_iter()
            .filter(|(_, event)| event["request_id"] == id)
            .collect()
    }

    /// The results the `finished` events of `id` carried.
    fn finished(&self, id: &str) -> Vec<Value> {
        self.of(id)
            .into_iter()
            .filter(|(_, event)| event["event"] == "finished")
            .map(|(_, event)| event["result"].clone())
            .collect()
    }
}

impl Drop for Seen {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A `finished` event says what the stored result says.
fn same_ending(event_result: &Value, stored: &Value) -> bool {
    [
        "request_id",
        "state",
        "reason",
        "worker_id",
        "attempt",
        "output",
    ]
    .iter()
    .all(|field| event_result[field] == stored[field])
}

/// The chat completion bodies the mock received, as one text.
fn backend_saw(f: &Fleet) -> String {
    serde_json::to_string(&f.mock().requests()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// A single tenant, no permissions.
// ---------------------------------------------------------------------------------------------

/// Finding 1: a copy of a running interactive request's id put on the durable queue (the v1
/// subject with `Nats-Msg-Id` = the id, the same with another `Nats-Msg-Id`, and the default
/// tenant's banded subject) is a duplicate: it never runs, and the victim's stored result is
/// its own (COMPLETED, its output, its worker, attempt 1). Malformed messages on the victim's
/// subject (a body that is no request, a body naming another id) do not end it either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_copy_of_a_running_requests_id_never_replaces_its_result() {
    let f = Fleet::builder()
        .script(&script())
        .slots(4)
        .worker_processes(["w1", "w2"])
        .start()
        .await;
    let nats = f.client.nats().clone();
    let events = Seen::start(&nats, "gen.events.>").await;
    let victims: Vec<String> = (1..=3).map(|n| format!("victim-{n}")).collect();
    let mut ran_on = BTreeMap::new();
    for id in &victims {
        let accepted = fleet::submit_until_accepted(
            &f.client,
            "default",
            &request(id, &format!("slow {id} speaks")),
            WITHIN,
        )
        .await;
        assert_eq!(accepted.request_id, *id);
        ran_on.insert(id.clone(), accepted.worker_id);
    }
    let client = &f.client;
    for id in &victims {
        // Running, or (on a very slow machine) already ended: the copies come either way.
        eventually(&format!("{id} runs"), || async move {
            client
                .status(id)
                .await
                .is_ok_and(|s| s.state == RequestState::Running || s.state.is_terminal())
        })
        .await;
    }
    // The copies, each with the attacker's own prompt; and malformed ones on the victim's
    // subject (a body that is not a request, a body naming another id), which must not end
    // the victim's request as invalid either.
    for id in &victims {
        let copy = |n: usize| {
            serde_json::to_vec(&body(id, &format!("slow attacker copy {n} of {id}"))).unwrap()
        };
        let copies = [
            (format!("gen.queue.default.{id}"), id.clone(), copy(0)),
            (
                format!("gen.queue.default.{id}"),
                format!("{id}-again"),
                copy(1),
            ),
            (
                format!("gen.queue.default.high.default.{id}"),
                format!("{id}-high"),
                copy(2),
            ),
            (
                format!("gen.queue.default.{id}"),
                format!("{id}-garbled"),
                b"{not json".to_vec(),
            ),
            (
                format!("gen.queue.default.{id}"),
                format!("{id}-mismatch"),
                serde_json::to_vec(&body(
                    &format!("{id}-other"),
                    "slow attacker copy mismatched",
                ))
                .unwrap(),
            ),
        ];
        for (subject, msg_id, payload) in copies {
            let ack = enqueue_bytes(&nats, &subject, &msg_id, payload).await;
            assert!(
                !ack.duplicate,
                "{subject} ({msg_id}): the stream kept it (the victim is not on the queue)"
            );
        }
    }
    // Every copy is taken off the queue (refused as a duplicate, never run).
    fleet::wait_queue_empty(&nats, "default", WITHIN).await;
    for id in &victims {
        if f.client.status(id).await.map(|s| s.state).ok() != Some(RequestState::Running) {
            eprintln!("note: {id} had ended before its copies left the queue");
        }
    }
    for id in &victims {
        let prompt = format!("slow {id} speaks");
        let result = result_of(&nats, id).await;
        assert_eq!(
            (
                result["state"].as_str(),
                result["reason"].as_str(),
                result["output"].as_str(),
                result["worker_id"].as_str(),
                result["attempt"].as_u64(),
            ),
            (
                Some("COMPLETED"),
                Some("stop"),
                Some(slow_output(&prompt).as_str()),
                Some(ran_on[id].as_str()),
                Some(1),
            ),
            "{id}: the stored result is the victim's own: {result}"
        );
        // The record (read from the bucket, not through a worker) says the same.
        let stored = fleet::record(&nats, id).await.expect("a record");
        assert_eq!(stored["output"], result["output"], "{id}: {stored}");
    }
    // The backend served the victims only.
    let saw = backend_saw(&f);
    assert!(
        !saw.contains("attacker copy"),
        "a copy ran on the backend: {saw}"
    );
    // One finished event per victim, saying what was stored.
    let (seen, ids) = (&events, &victims);
    eventually("every victim's finished event", || async move {
        ids.iter().all(|id| !seen.finished(id).is_empty())
    })
    .await;
    for id in &victims {
        let finished = events.finished(id);
        let stored = fleet::record(&nats, id).await.unwrap();
        assert_eq!(finished.len(), 1, "{id}: {finished:?}");
        assert!(same_ending(&finished[0], &stored), "{id}: {finished:?}");
    }
}

/// The `ts` of a worker's heartbeat, if it has one.
async fn heartbeat_ts(nats: &async_nats::Client, worker: &str) -> Option<String> {
    let (_, beat) = kv_entry(nats, "GENFLEET_WORKERS", worker).await?;
    beat["ts"].as_str().map(String::from)
}

/// The result stored for `id`, read from the results bucket (not through the workers: a
/// request to `gen.result.*` may go to the stopped one), polled until the record is a result.
/// Each look also asks `gen.status.<id>` (briefly, its answer unused): a status that finds the
/// request's worker lost ends it, should no live worker have ended it from the heartbeats.
async fn stored_result(nats: &async_nats::Client, id: &str, logs: &Path) -> Value {
    let deadline = Instant::now() + WITHIN;
    let mut asked = Vec::new();
    loop {
        let record = fleet::record(nats, id).await;
        if let Some(result) = &record
            && result.get("live").is_none()
            && result.get("state").is_some()
        {
            return result.clone();
        }
        if Instant::now() >= deadline {
            let mut all = String::new();
            for entry in std::fs::read_dir(logs).unwrap().flatten() {
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                all.push_str(&format!("--- {}\n{text}\n", entry.path().display()));
            }
            panic!(
                "{id}: no result stored within {WITHIN:?}; its record: {record:?}; the status \
                 answers: {asked:?}; the workers' logs:\n{all}"
            );
        }
        let status = tokio::time::timeout(
            Duration::from_secs(2),
            nats.request(format!("gen.status.{id}"), "{}".into()),
        )
        .await;
        asked.push(match status {
            Ok(Ok(reply)) => String::from_utf8_lossy(&reply.payload).into_owned(),
            Ok(Err(error)) => error.to_string(),
            Err(_) => "no answer within 2 s".into(),
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `kill -<signal> <pid>`.
/// Sends SIGCONT to a process when dropped.
struct Continued(u32);

impl Drop for Continued {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT".to_string(), self.0.to_string()])
            .status();
    }
}

fn signal(process: &Proc, signal: &str) {
    let sent = Command::new("kill")
        .args([format!("-{signal}"), process.pid().to_string()])
        .status()
        .expect("kill runs");
    assert!(sent.success(), "kill -{signal} {}", process.name);
}

/// Finding 5: a worker stopped (SIGSTOP) past `worker.lost_after_ms` while it ran interactive
/// and durable requests, then resumed (SIGCONT), publishes no `finished` event that
/// contradicts a stored result, and no request gets two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_worker_resumed_after_it_was_declared_lost_contradicts_no_stored_result() {
    let mut f = Fleet::builder()
        .script(&script())
        .slots(4)
        .settings(|s| {
            s.worker.heartbeat_ms = 500;
            s.worker.lost_after_ms = 3000;
            s.jetstream.queue_ack_wait_ms = 5000;
        })
        .worker_env("GENFLEET__WORKER__HEARTBEAT_MS", 500)
        .worker_env("GENFLEET__WORKER__LOST_AFTER_MS", 3000)
        // Redelivered only once the paused worker's heartbeat is gone.
        .worker_env("GENFLEET__JETSTREAM__QUEUE_ACK_WAIT_MS", 5000)
        .worker_processes(["paused"])
        .start()
        .await;
    let nats = f.client.nats().clone();
    let events = Seen::start(&nats, "gen.events.>").await;
    let interactive = ["paused-i1", "paused-i2"];
    let durable = ["paused-d1", "paused-d2"];
    for id in interactive {
        let accepted = fleet::submit_until_accepted(
            &f.client,
            "default",
            &request(id, &format!("glacial {id}")),
            WITHIN,
        )
        .await;
        assert_eq!(accepted.worker_id, "paused");
    }
    for id in durable {
        f.client
            .enqueue("default", &request(id, &format!("glacial {id}")))
            .await
            .unwrap();
    }
    let client = &f.client;
    for id in interactive.iter().chain(&durable) {
        eventually(
            &format!("{id} runs on the worker to be paused"),
            || async move {
                client.status(id).await.ok().is_some_and(|s| {
                    s.state == RequestState::Running && s.worker_id.as_deref() == Some("paused")
                })
            },
        )
        .await;
    }
    // The heartbeat lists the interactive requests, so a live worker ends them on its own.
    let bus = &nats;
    eventually(
        "the heartbeat lists the interactive requests",
        || async move {
            kv_entry(bus, "GENFLEET_WORKERS", "paused")
                .await
                .is_some_and(|(_, beat)| {
                    interactive.iter().all(|id| {
                        beat["running"]
                            .as_array()
                            .is_some_and(|r| r.iter().any(|r| r == id))
                    })
                })
        },
    )
    .await;
    let _live = f.start_worker_process("live", &[]);
    fleet::wait_workers(&nats, 2, WITHIN, f.logs()).await;
    // One more heartbeat of the worker to be paused, for the live worker to follow.
    let last_beat = heartbeat_ts(&nats, "paused").await;
    let bus = &nats;
    let last = &last_beat;
    eventually(
        "another heartbeat of the worker to be paused",
        || async move { heartbeat_ts(bus, "paused").await != *last },
    )
    .await;

    signal(&f.processes[0], "STOP");
    // Whatever happens from here, the stopped worker is continued (a stopped process would
    // never take the harness's SIGTERM, and the test would hang instead of failing).
    let _continue = Continued(f.processes[0].pid());
    let bus = &nats;
    // The worker's own key, read directly: listing the bucket's keys while its entries expire
    // can wait for ever.
    eventually("the paused worker's heartbeat is gone", || async move {
        tokio::time::timeout(
            Duration::from_secs(5),
            kv_entry(bus, "GENFLEET_WORKERS", "paused"),
        )
        .await
        .is_ok_and(|entry| entry.is_none())
    })
    .await;
    let mut stored = BTreeMap::new();
    for id in interactive.iter().chain(&durable) {
        let result = stored_result(&nats, id, f.logs()).await;
        stored.insert(id.to_string(), result);
    }
    signal(&f.processes[0], "CONT");

    // The resumed worker lets go of its requests (or exits).
    let deadline = Instant::now() + WITHIN;
    loop {
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            nats.request("gen.worker.paused.capacity", "".into()),
        )
        .await;
        if let Ok(Ok(reply)) = &answer
            && let Ok(stats) = serde_json::from_slice::<Value>(&reply.payload)
            && stats["running"] == 0
            && stats["capacity"]["busy"] == 0
        {
            break;
        }
        if !f.processes[0].running() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the resumed worker still holds requests: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Not a synchronisation: a window in which a late, contradicting event would show.
    tokio::time::sleep(Duration::from_secs(3)).await;

    for id in interactive.iter().chain(&durable) {
        let now = fleet::record(&nats, id).await.expect("a record");
        let before = &stored[*id];
        assert_eq!(
            (
                &now["state"],
                &now["reason"],
                &now["worker_id"],
                &now["output"]
            ),
            (
                &before["state"],
                &before["reason"],
                &before["worker_id"],
                &before["output"]
            ),
            "{id}: the stored result changed after the worker resumed: {before} -> {now}"
        );
        let finished = events.finished(id);
        assert!(
            finished.len() <= 1,
            "{id}: {} finished events: {finished:#?}",
            finished.len()
        );
        for event in &finished {
            assert!(
                same_ending(event, &now),
                "{id}: a finished event contradicts the stored result\n event: {event}\n stored: {now}"
            );
        }
    }
    for id in interactive {
        let r = &stored[id];
        // A request that wrote a checkpoint went on on the live worker from it; one that had
        // none ended worker_lost.
        let taken_up = r["resumed"]
            .as_array()
            .is_some_and(|moves| moves.iter().any(|m| m["from_worker"] == "paused"));
        if taken_up {
            assert_eq!(
                (
                    r["state"].as_str(),
                    r["worker_id"].as_str(),
                    r["output"].as_str()
                ),
                (
                    Some("COMPLETED"),
                    Some("live"),
                    Some(slow_output(&format!("glacial {id}")).as_str())
                ),
                "{id} went on on the live worker from its checkpoint: {r}"
            );
        } else {
            assert_eq!(
                (r["state"].as_str(), r["reason"].as_str()),
                (Some("FAILED"), Some("worker_lost")),
                "{id} ended on the lost worker as worker_lost (unless it ended before the pause): {r}"
            );
        }
    }
    for id in durable {
        let r = &stored[id];
        assert_eq!(
            (r["state"].as_str(), r["output"].as_str()),
            (
                Some("COMPLETED"),
                Some(slow_output(&format!("glacial {id}")).as_str())
            ),
            "{id}: a durable request is run again, not lost: {r}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Two tenants with the shipped permissions.
// ---------------------------------------------------------------------------------------------

/// config/nats/permissions.conf as shipped.
fn shipped_permissions() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config/nats/permissions.conf");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The shipped file's block for tenant `acme`, copied for `tenant` as the file says to.
fn tenant_block(shipped: &str, tenant: &str) -> String {
    let start = shipped
        .find("GENFLEET_TENANT_ACME = {")
        .expect("permissions.conf has the block GENFLEET_TENANT_ACME");
    let open = start + shipped[start..].find('{').unwrap();
    let mut depth = 0;
    let mut end = None;
    for (i, c) in shipped[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    end = Some(open + i + 1);
                    break;
                }
            }
            _ => {}
        }
    }
    let block = &shipped[start..end.expect("the block's braces balance")];
    block
        .replace("ACME", &tenant.to_uppercase())
        .replace("acme", tenant)
}

/// The shipped file, a copy of its tenant block for `bob`, and the users: a worker, the
/// tenants `acme` and `bob`, an admin for the test's own checks, and a user for each other
/// role the file defines (nats-server refuses a variable no one uses).
fn tenants_config() -> String {
    let shipped = shipped_permissions();
    let bob = tenant_block(&shipped, "bob");
    let others: String = shipped
        .lines()
        .filter_map(|line| line.strip_suffix(" = {"))
        .filter(|name| {
            name.starts_with("GENFLEET_")
                && !["GENFLEET_WORKER", "GENFLEET_TENANT_ACME"].contains(name)
        })
        .map(|name| {
            format!(
                "    {{ user: role-{}, password: unused-{name}, permissions: ${name} }}\n",
                name.to_lowercase()
            )
        })
        .collect();
    format!(
        r#"
{shipped}

{bob}

authorization {{
  users = [
    {{ user: worker, password: wpass, permissions: $GENFLEET_WORKER }}
    {{ user: acme, password: acpass, permissions: $GENFLEET_TENANT_ACME }}
    {{ user: bob, password: bobpass, permissions: $GENFLEET_TENANT_BOB }}
    {{ user: admin, password: apass }}
{others}  ]
}}
"#
    )
}

fn as_user(s: &mut Settings, user: &str, password: &str) {
    s.nats.user = user.into();
    s.nats.password = password.into();
}

/// Two workers (three slots each) as user `worker`; the fleet's client is the admin.
async fn tenants_fleet() -> Fleet {
    Fleet::builder()
        .nats_config(tenants_config())
        .script(&script())
        .workers(2)
        .slots(3)
        .settings(|s| as_user(s, "worker", "wpass"))
        .client_settings(|s| as_user(s, "admin", "apass"))
        .start()
        .await
}

/// A raw connection as a tenant's user, on its own reply prefix `_INBOX_<user>`, with the
/// server errors it receives.
struct Caller {
    nats: async_nats::Client,
    errors: Arc<Mutex<Vec<String>>>,
    user: String,
}

impl Caller {
    async fn connect(server: &NatsServer, user: &str, password: &str) -> Caller {
        let errors = Arc::new(Mutex::new(Vec::new()));
        let seen = errors.clone();
        let nats = async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
            .custom_inbox_prefix(format!("_INBOX_{user}"))
            .event_callback(move |event| {
                let seen = seen.clone();
                async move {
                    if let async_nats::Event::ServerError(error) = event {
                        seen.lock().unwrap().push(error.to_string());
                    }
                }
            })
            .connect(server.url())
            .await
            .unwrap_or_else(|e| panic!("{user} connects: {e}"));
        Caller {
            nats,
            errors,
            user: user.into(),
        }
    }

    /// Waits (bounded) for the server's permissions violation of `kind` (`Publish` or
    /// `Subscription`) naming exactly `subject`.
    async fn refused(&self, kind: &str, subject: &str) {
        let wanted = format!("Permissions Violation for {kind} to \"{subject}\"");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self
                .errors
                .lock()
                .unwrap()
                .iter()
                .any(|e| e.contains(&wanted))
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "{}: {kind} on {subject} was not refused; errors seen: {:?}",
            self.user,
            self.errors.lock().unwrap()
        );
    }

    /// Publishes (with a reply subject, as a request would) and expects the server to refuse.
    async fn publish_refused(&self, subject: &str, payload: &str) {
        let inbox = self.nats.new_inbox();
        self.nats
            .publish_with_reply(subject.to_string(), inbox, payload.to_string().into())
            .await
            .unwrap();
        self.nats.flush().await.unwrap();
        self.refused("Publish", subject).await;
    }

    /// Subscribes and expects the server to refuse; the subscription is returned so that the
    /// test can check later that nothing came through it.
    async fn subscribe_refused(&self, subject: &str) -> async_nats::Subscriber {
        let sub = self.nats.subscribe(subject.to_string()).await.unwrap();
        self.nats.flush().await.unwrap();
        self.refused("Subscription", subject).await;
        sub
    }

    /// Every server error it received.
    fn errors(&self) -> Vec<String> {
        self.errors.lock().unwrap().clone()
    }
}

/// Nothing came through a refused subscription.
fn heard_nothing(what: &str, sub: &mut async_nats::Subscriber) {
    if let Some(Some(message)) = sub.next().now_or_never() {
        panic!(
            "{what}: a refused subscription delivered {} {:?}",
            message.subject,
            String::from_utf8_lossy(&message.payload)
        );
    }
}

/// Finding 3: acme can follow, read, cancel or release nothing of bob's, nor read the
/// buckets; its own request with bob's bare id is a separate request; bob's request ends with
/// its own output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_reaches_nothing_of_another_tenants_request_with_the_shipped_permissions() {
    let f = tenants_fleet().await;
    let admin = f.client.nats().clone();
    let acme = Caller::connect(&f.nats, "acme", "acpass").await;
    let bob = Caller::connect(&f.nats, "bob", "bobpass").await;
    let worker = f.workers[0].worker_id.clone();
    const X: &str = "shared-id-x";
    let bob_prompt = "glacial bob secret sauce";

    // Bob follows his own events (allowed) and runs X.
    let bob_events = Seen::start(&bob.nats, &format!("gen.events.bob.{X}")).await;
    let acme_own_events = Seen::start(&acme.nats, "gen.events.acme.*").await;
    let admin_events = Seen::start(&admin, "gen.events.>").await;
    submit_accepted(
        &bob.nats,
        "gen.submit.default.bob",
        async_nats::HeaderMap::new(),
        &body(X, bob_prompt),
        &format!("bob.{X}"),
    )
    .await;
    let bob_nats = &bob.nats;
    // Running, or (on a very slow machine) already ended: the attacks come either way.
    eventually("bob's request runs", || async move {
        let status = ask_plain(bob_nats, &format!("gen.status.bob.{X}"), &json!({})).await;
        ["RUNNING", "COMPLETED"].contains(&status["state"].as_str().unwrap_or_default())
    })
    .await;

    // Bob's bare id in acme's own namespace is not bob's request.
    for verb in ["status", "result", "cancel"] {
        let reply = ask_plain(&acme.nats, &format!("gen.{verb}.acme.{X}"), &json!({})).await;
        assert_eq!(
            code(&reply),
            Some("NOT_FOUND"),
            "acme's {verb} of acme.{X} reached bob's request: {reply}"
        );
    }
    // A dot in a tenant's id is refused: it cannot name another tenant's request.
    let dotted = ask_plain(
        &acme.nats,
        "gen.submit.default.acme",
        &body(&format!("bob.{X}"), "acme dotted id"),
    )
    .await;
    assert_eq!(code(&dotted), Some("INVALID_REQUEST"), "{dotted}");

    // Acme's own request with the same bare id: a separate request, with its own output,
    // accepted while bob's runs.
    let acme_prompt = "acme own words";
    submit_accepted(
        &acme.nats,
        "gen.submit.default.acme",
        async_nats::HeaderMap::new(),
        &body(X, acme_prompt),
        &format!("acme.{X}"),
    )
    .await;

    // Following: bob's events, every tenant's, the default tenant's; the inboxes.
    let mut overheard = Vec::new();
    for subject in [
        format!("gen.events.bob.{X}"),
        "gen.events.bob.*".to_string(),
        "gen.events.>".to_string(),
        "gen.events.*".to_string(),
        "gen.events.*.*".to_string(),
        "_INBOX.>".to_string(),
        "_INBOX_bob.>".to_string(),
        ">".to_string(),
        // Taking others' requests to read their reply subjects.
        "gen.status.>".to_string(),
        "gen.result.bob.*".to_string(),
        "gen.submit.>".to_string(),
        "signals.>".to_string(),
        "$KV.GENFLEET_RESULTS.>".to_string(),
    ] {
        let sub = acme.subscribe_refused(&subject).await;
        overheard.push((subject, sub));
    }

    // Reading, releasing, cancelling bob's request; the default tenant's subjects; acting as
    // bob or as a worker; answering decisions; writing to bob's inbox.
    for subject in [
        format!("gen.status.bob.{X}"),
        format!("gen.result.bob.{X}"),
        format!("gen.cancel.bob.{X}"),
        format!("gen.status.{X}"),
        format!("gen.result.{X}"),
        format!("gen.cancel.{X}"),
        "gen.submit.default.bob".to_string(),
        "gen.submit.default".to_string(),
        format!("gen.queue.default.normal.bob.{X}"),
        format!("gen.queue.default.{X}"),
        format!("gen.worker.{worker}.submit.bob"),
        format!("gen.worker.{worker}.submit"),
        format!("gen.worker.{worker}.cancel"),
        "decisions.01JDECISIONBYATENANT000000".to_string(),
        "_INBOX_bob.forged".to_string(),
    ] {
        acme.publish_refused(&subject, "{}").await;
    }
    // The buckets and the queue's stream, through the JetStream API.
    for subject in [
        "$JS.API.STREAM.INFO.KV_GENFLEET_RESULTS".to_string(),
        format!("$JS.API.DIRECT.GET.KV_GENFLEET_RESULTS.$KV.GENFLEET_RESULTS.res.bob.{X}"),
        "$JS.API.STREAM.MSG.GET.KV_GENFLEET_RESULTS".to_string(),
        "$JS.API.STREAM.INFO.KV_GENFLEET_DECISIONS".to_string(),
        "$JS.API.STREAM.MSG.GET.KV_GENFLEET_DECISIONS".to_string(),
        "$JS.API.STREAM.INFO.KV_GENFLEET_HISTORY".to_string(),
        "$JS.API.STREAM.MSG.GET.KV_GENFLEET_HISTORY".to_string(),
        "$JS.API.STREAM.MSG.GET.GENFLEET_QUEUE".to_string(),
        "$JS.API.CONSUMER.CREATE.GENFLEET_QUEUE".to_string(),
        format!("$KV.GENFLEET_RESULTS.res.bob.{X}"),
    ] {
        acme.publish_refused(&subject, "").await;
    }
    let js = async_nats::jetstream::new(acme.nats.clone());
    let buckets = ["GENFLEET_RESULTS", "GENFLEET_DECISIONS", "GENFLEET_HISTORY"];
    let opened = futures_util::future::join_all(
        buckets.map(|bucket| tokio::time::timeout(WITHIN, js.get_key_value(bucket))),
    )
    .await;
    for (bucket, opened) in buckets.iter().zip(opened) {
        assert!(
            matches!(opened, Err(_) | Ok(Err(_))),
            "acme opened the bucket {bucket}"
        );
    }

    let acme_result = result_of(&acme.nats, &format!("acme.{X}")).await;
    assert_eq!(
        (
            acme_result["request_id"].as_str(),
            acme_result["state"].as_str(),
            acme_result["output"].as_str()
        ),
        (
            Some(format!("acme.{X}").as_str()),
            Some("COMPLETED"),
            Some(fast_output(acme_prompt).as_str())
        ),
        "{acme_result}"
    );
    // Acme cancels and releases its own: bob's goes on.
    let cancel = ask_plain(&acme.nats, &format!("gen.cancel.acme.{X}"), &json!({})).await;
    assert_eq!(code(&cancel), Some("ALREADY_FINISHED"), "{cancel}");
    let taken = ask_plain(&acme.nats, &format!("gen.result.acme.{X}"), &json!({})).await;
    assert_eq!(
        taken["output"].as_str(),
        Some(fast_output(acme_prompt).as_str()),
        "{taken}"
    );

    // Bob's request ends with its own output, and its result is still there for him.
    let bob_result = result_of(&bob.nats, &format!("bob.{X}")).await;
    assert_eq!(
        (
            bob_result["request_id"].as_str(),
            bob_result["state"].as_str(),
            bob_result["reason"].as_str(),
            bob_result["output"].as_str(),
            bob_result["attempt"].as_u64()
        ),
        (
            Some(format!("bob.{X}").as_str()),
            Some("COMPLETED"),
            Some("stop"),
            Some(slow_output(bob_prompt).as_str()),
            Some(1)
        ),
        "{bob_result}"
    );
    // Both are kept under their own keys.
    let keys = fleet::result_keys(&admin).await;
    let res = keys.get("res").cloned().unwrap_or_default();
    for key in [format!("res.acme.{X}"), format!("res.bob.{X}")] {
        assert!(res.contains(&key), "{key} not in {res:?}");
    }
    let bob_stored = fleet::record(&admin, &format!("bob.{X}")).await.unwrap();
    assert_eq!(bob_stored["output"], bob_result["output"], "{bob_stored}");

    // Bob's events: his own subject and id, one finished, the stored result.
    let seen = &bob_events;
    eventually("bob's finished event", || async move {
        !seen.finished(&format!("bob.{X}")).is_empty()
    })
    .await;
    let his = bob_events.all();
    assert!(
        his.iter()
            .all(|(subject, event)| *subject == format!("gen.events.bob.{X}")
                && event["request_id"] == format!("bob.{X}")),
        "{his:#?}"
    );
    let finished = bob_events.finished(&format!("bob.{X}"));
    assert_eq!(finished.len(), 1, "{finished:#?}");
    assert!(same_ending(&finished[0], &bob_result), "{finished:#?}");
    // Acme's events are acme's only; nothing of bob's came to acme.
    for (subject, event) in acme_own_events.all() {
        assert!(
            subject.starts_with("gen.events.acme.")
                && event["request_id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("acme.")),
            "acme heard {subject}: {event}"
        );
        assert!(!event.to_string().contains("secret sauce"), "{event}");
    }
    for (what, sub) in &mut overheard {
        heard_nothing(what, sub);
    }
    // The events went where the spec says: bob's on gen.events.bob.X, acme's on
    // gen.events.acme.X.
    for (subject, event) in admin_events.all() {
        if let Some(id) = event["request_id"].as_str() {
            assert_eq!(subject, format!("gen.events.{id}"), "{event}");
        }
    }
    assert!(
        acme.errors()
            .iter()
            .all(|e| e.contains("Permissions Violation")),
        "{:?}",
        acme.errors()
    );
    assert!(
        bob.errors().is_empty(),
        "bob was refused: {:?}",
        bob.errors()
    );
}

/// Finding 1 across tenants: acme puts a copy of bob's bare id on its own queue subject while
/// bob's request runs. It is acme's own request (`acme.<id>`), with its own output; bob's
/// result is unchanged, and a copy whose body names bob's request never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_another_tenants_id_on_a_tenants_own_queue_is_its_own_request() {
    let f = tenants_fleet().await;
    let admin = f.client.nats().clone();
    let acme = Caller::connect(&f.nats, "acme", "acpass").await;
    let bob = Caller::connect(&f.nats, "bob", "bobpass").await;
    let events = Seen::start(&admin, "gen.events.>").await;
    const X: &str = "queued-twice";
    let bob_prompt = "slow bob queued words";
    let worker = submit_accepted(
        &bob.nats,
        "gen.submit.default.bob",
        async_nats::HeaderMap::new(),
        &body(X, bob_prompt),
        &format!("bob.{X}"),
    )
    .await;
    let bob_nats = &bob.nats;
    // Running, or (on a very slow machine) already ended: the attacks come either way.
    eventually("bob's request runs", || async move {
        let status = ask_plain(bob_nats, &format!("gen.status.bob.{X}"), &json!({})).await;
        ["RUNNING", "COMPLETED"].contains(&status["state"].as_str().unwrap_or_default())
    })
    .await;

    // The copy on acme's own queue: acme.X, acme's own prompt.
    let acme_prompt = "slow acme copy words";
    let ack = enqueue_raw(
        &acme.nats,
        &format!("gen.queue.default.normal.acme.{X}"),
        &format!("acme.{X}"),
        &body(X, acme_prompt),
    )
    .await;
    assert!(!ack.duplicate);
    // Copies whose body names bob's request (a dot: invalid) on acme's subjects, one with
    // bob's message id.
    let invalid_prompt = "slow acme names bob's request";
    for (id, msg_id) in [
        ("naming-bob-1", format!("bob.{X}")),
        ("naming-bob-2", "acme.naming-bob-2".to_string()),
    ] {
        enqueue_raw(
            &acme.nats,
            &format!("gen.queue.default.normal.acme.{id}"),
            &msg_id,
            &body(&format!("bob.{X}"), invalid_prompt),
        )
        .await;
    }
    // And bob's own queue subject, which acme may not use.
    acme.publish_refused(&format!("gen.queue.default.normal.bob.{X}"), "{}")
        .await;

    let acme_result = result_of(&acme.nats, &format!("acme.{X}")).await;
    assert_eq!(
        (
            acme_result["request_id"].as_str(),
            acme_result["state"].as_str(),
            acme_result["output"].as_str()
        ),
        (
            Some(format!("acme.{X}").as_str()),
            Some("COMPLETED"),
            Some(slow_output(acme_prompt).as_str())
        ),
        "{acme_result}"
    );
    let bob_result = result_of(&bob.nats, &format!("bob.{X}")).await;
    assert_eq!(
        (
            bob_result["request_id"].as_str(),
            bob_result["state"].as_str(),
            bob_result["output"].as_str(),
            bob_result["worker_id"].as_str(),
            bob_result["attempt"].as_u64()
        ),
        (
            Some(format!("bob.{X}").as_str()),
            Some("COMPLETED"),
            Some(slow_output(bob_prompt).as_str()),
            Some(worker.as_str()),
            Some(1)
        ),
        "{bob_result}"
    );
    // Every message left the queue; the one naming bob's request never ran.
    let js = async_nats::jetstream::new(admin.clone());
    eventually("the queue is empty", || {
        let js = js.clone();
        async move {
            let mut stream = js.get_stream("GENFLEET_QUEUE").await.unwrap();
            stream.info().await.unwrap().state.messages == 0
        }
    })
    .await;
    for id in ["naming-bob-1", "naming-bob-2"] {
        let refused = result_of(&acme.nats, &format!("acme.{id}")).await;
        assert_eq!(
            (refused["state"].as_str(), refused["reason"].as_str()),
            (Some("FAILED"), Some("invalid_request")),
            "{refused}"
        );
    }
    let saw = backend_saw(&f);
    assert!(
        !saw.contains("names bob"),
        "a copy naming bob's request ran: {saw}"
    );
    let seen = &events;
    eventually("bob's finished event", || async move {
        !seen.finished(&format!("bob.{X}")).is_empty()
    })
    .await;
    let finished = events.finished(&format!("bob.{X}"));
    assert_eq!(finished.len(), 1, "{finished:#?}");
    assert!(same_ending(&finished[0], &bob_result), "{finished:#?}");
}

/// A decision of bob's chain: raised, answered by the admin (as a manager would), its
/// continuation ended and its history entry settled. Returns the decision id.
async fn bobs_answered_decision(admin: &async_nats::Client, bob: &Caller) -> String {
    submit_accepted(
        &bob.nats,
        "gen.submit.default.bob",
        async_nats::HeaderMap::new(),
        &body("bob-asks", "bob asks us to decide"),
        "bob.bob-asks",
    )
    .await;
    let asked = result_of(&bob.nats, "bob.bob-asks").await;
    assert_eq!(asked["reason"], "decision_requested", "{asked}");
    let decision_id = asked["signals"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|s| s["decision"]["decision_id"].as_str())
        .unwrap_or_else(|| panic!("no decision in {asked}"))
        .to_string();
    let reply = ask_plain(
        admin,
        &format!("decisions.{decision_id}"),
        &json!({"option_id": "fast", "decided_by": "test"}),
    )
    .await;
    assert_eq!(reply["outcome"], "continued", "{reply}");
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let next = result_of(admin, &continuation).await;
    assert_eq!(
        (next["output"].as_str(), next["chain_position"].as_u64()),
        (Some("continued"), Some(2)),
        "{next}"
    );
    let id = decision_id.as_str();
    eventually(
        "the history entry of bob's decision settles",
        || async move {
            match history_of(admin, id).await {
                Some((_, _, entry)) => entry["outcome"] != "pending",
                None => false,
            }
        },
    )
    .await;
    decision_id
}

/// The history entry of a decision: its key, revision and JSON.
async fn history_of(admin: &async_nats::Client, decision_id: &str) -> Option<(String, u64, Value)> {
    let key = kv_keys(admin, "GENFLEET_HISTORY")
        .await
        .into_iter()
        .find(|key| key.ends_with(&format!(".{decision_id}")))?;
    let (revision, entry) = kv_entry(admin, "GENFLEET_HISTORY", &key).await?;
    Some((key, revision, entry))
}

/// What of a decision record an answer and its continuation fix.
fn decided_part(record: &Value) -> Value {
    json!({
        "decision_id": record["decision_id"],
        "request_id": record["request_id"],
        "root_request_id": record["root_request_id"],
        "chain_position": record["chain_position"],
        "tenant": record["tenant"],
        "chain": record["chain"],
        "answer": record["answer"],
        "expired_at": record["expired_at"],
    })
}

/// Finding 4: chain headers from acme naming a real decision of bob's, on a worker's own
/// subject, on the pool's subject and on acme's queue subject (with the bare id of bob's
/// continuation too), are dropped: acme's requests run unchained, and bob's decision record
/// and history entry are unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_chain_headers_naming_another_tenants_decision_are_dropped() {
    let f = tenants_fleet().await;
    let admin = f.client.nats().clone();
    let acme = Caller::connect(&f.nats, "acme", "acpass").await;
    let bob = Caller::connect(&f.nats, "bob", "bobpass").await;
    let decision_id = bobs_answered_decision(&admin, &bob).await;
    let (_, record) = kv_entry(&admin, "GENFLEET_DECISIONS", &decision_id)
        .await
        .expect("bob's decision record");
    let (history_key, _, history) = history_of(&admin, &decision_id)
        .await
        .expect("bob's history entry");
    let continuation = record["answer"]["continuation_request_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no continuation in {record}"))
        .to_string();
    let continuation_bare = continuation.rsplit('.').next().unwrap().to_string();
    let code_of_decision = history["code"].as_str().unwrap_or_default().to_string();

    let forged = |position: &str| {
        let mut headers = async_nats::HeaderMap::new();
        let state = json!({
            "decision_id": decision_id,
            "decision_code": code_of_decision,
            "checkpoints_passed": ["prod"],
            "confidence_boost": 0.5,
        });
        headers.insert("Genfleet-Chain-State", state.to_string().as_str());
        headers.insert(
            "Genfleet-Root-Request-Id",
            record["root_request_id"].as_str().unwrap_or("bob.bob-asks"),
        );
        headers.insert(
            "Genfleet-Parent-Request-Id",
            record["request_id"].as_str().unwrap_or("bob.bob-asks"),
        );
        headers.insert("Genfleet-Chain-Position", position);
        headers
    };

    // On a worker's own subject, and on the pool's.
    let worker = f.workers[0].worker_id.clone();
    submit_accepted(
        &acme.nats,
        &format!("gen.worker.{worker}.submit.acme"),
        forged("2"),
        &body("forged-direct", "acme forged direct"),
        "acme.forged-direct",
    )
    .await;
    submit_accepted(
        &acme.nats,
        "gen.submit.default.acme",
        forged("3"),
        &body("forged-pool", "acme forged pool"),
        "acme.forged-pool",
    )
    .await;
    // On acme's queue subject, with the bare id of bob's continuation, and with another id.
    for id in [continuation_bare.as_str(), "forged-queued"] {
        let mut headers = forged("2");
        headers.insert("Nats-Msg-Id", format!("acme.{id}").as_str());
        let js = async_nats::jetstream::new(acme.nats.clone());
        js.publish_with_headers(
            format!("gen.queue.default.normal.acme.{id}"),
            headers,
            serde_json::to_vec(&body(id, &format!("acme forged queued {id}")))
                .unwrap()
                .into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    for (id, prompt) in [
        (
            "forged-direct".to_string(),
            "acme forged direct".to_string(),
        ),
        ("forged-pool".to_string(), "acme forged pool".to_string()),
        (
            continuation_bare.clone(),
            format!("acme forged queued {continuation_bare}"),
        ),
        (
            "forged-queued".to_string(),
            "acme forged queued forged-queued".to_string(),
        ),
    ] {
        let qualified = format!("acme.{id}");
        let r = result_of(&acme.nats, &qualified).await;
        assert_eq!(
            (
                r["request_id"].as_str(),
                r["state"].as_str(),
                r["output"].as_str(),
                r["chain_position"].as_u64(),
                r.get("parent_request_id").filter(|p| !p.is_null()),
                r["root_request_id"].as_str(),
            ),
            (
                Some(qualified.as_str()),
                Some("COMPLETED"),
                Some(fast_output(&prompt).as_str()),
                Some(1),
                None,
                Some(qualified.as_str()),
            ),
            "{qualified} ran in bob's chain: {r}"
        );
    }
    // Bob's continuation is still bob's.
    let next = result_of(&admin, &continuation).await;
    assert_eq!(
        (next["output"].as_str(), next["chain_position"].as_u64()),
        (Some("continued"), Some(2)),
        "{next}"
    );

    // Bob's decision and its history entry are as they were.
    let (_, record_after) = kv_entry(&admin, "GENFLEET_DECISIONS", &decision_id)
        .await
        .expect("bob's decision record");
    assert_eq!(
        decided_part(&record_after),
        decided_part(&record),
        "bob's decision record changed"
    );
    let (_, history_after) = kv_entry(&admin, "GENFLEET_HISTORY", &history_key)
        .await
        .expect("bob's history entry");
    assert_eq!(history_after, history, "bob's history entry changed");
    assert!(
        acme.errors().is_empty(),
        "acme was refused: {:?}",
        acme.errors()
    );
}

/// JetStream's duplicate window is the whole queue stream's, and no permission covers a header:
/// acme can publish on its own queue subject with `Nats-Msg-Id: bob.<id>` first, and bob's own
/// publish of `<id>` within the window is then acknowledged as a duplicate and not stored. The
/// fleet cannot refuse that header, so the client does not let it pass for a queued request:
/// bob's enqueue fails with DUPLICATE_REQUEST_ID naming what happened, nothing runs as bob's,
/// acme's message runs as acme's own request, and bob's request sent again under another id
/// runs with bob's own output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_id_squatted_by_another_tenant_is_refused_to_the_caller_not_lost() {
    let f = tenants_fleet().await;
    let acme = Caller::connect(&f.nats, "acme", "acpass").await;
    const W: &str = "bobs-durable";
    enqueue_raw(
        &acme.nats,
        "gen.queue.default.normal.acme.squatter",
        &format!("bob.{W}"),
        &body("squatter", "acme squats"),
    )
    .await;
    let mut settings = Settings::defaults();
    settings.nats.url = f.nats.url();
    as_user(&mut settings, "bob", "bobpass");
    settings.nats.inbox_prefix = "_INBOX_bob".into();
    let bob = genfleet::client::Client::connect(&settings)
        .await
        .unwrap()
        .with_tenant("bob")
        .unwrap();
    let bob_prompt = "bob durable words";
    let squatted = bob
        .enqueue("default", &request(W, bob_prompt))
        .await
        .expect_err("a publish the stream took for another's duplicate is no queued request");
    assert_eq!(
        squatted.code(),
        Some(genfleet::protocol::ErrorCode::DuplicateRequestId),
        "{squatted}"
    );
    assert!(
        squatted
            .to_string()
            .contains("another publisher used this id"),
        "{squatted}"
    );
    // Acme's message ran as acme's own request, with acme's words.
    let squatter = result_of(&acme.nats, "acme.squatter").await;
    assert_eq!(
        squatter["output"].as_str(),
        Some(fast_output("acme squats").as_str()),
        "{squatter}"
    );
    // Nothing runs as bob's W.
    let status = bob.status(W).await.expect_err("no request bob.W");
    assert_eq!(
        status.code(),
        Some(genfleet::protocol::ErrorCode::NotFound),
        "{status}"
    );
    // Sent again under another id, bob's request runs with bob's words.
    let queued = bob
        .enqueue("default", &request("bobs-durable-2", bob_prompt))
        .await
        .unwrap();
    assert_eq!(queued.request_id, "bob.bobs-durable-2");
    let r = fleet::terminal(&bob, "bobs-durable-2", WITHIN).await;
    assert_eq!(r.state, RequestState::Completed, "{r:?}");
    assert_eq!(r.output, fast_output(bob_prompt));
}

// ---------------------------------------------------------------------------------------------
// The gateway with two API keys.
// ---------------------------------------------------------------------------------------------

const KEY_ACME: &str = "sk-tenant-acme-0123456789";
const KEY_BOB: &str = "sk-tenant-bob-9876543210";

/// A `genfleet gateway` process in front of the fleet, with one key per tenant.
struct Gateway {
    _process: Running,
    port: u16,
    _config: tempfile::TempDir,
}

impl Gateway {
    async fn start(fleet: &Fleet) -> Gateway {
        let port = free_port();
        let config = tempfile::tempdir().unwrap();
        let path = config.path().join("gateway.toml");
        std::fs::write(
            &path,
            format!(
                "[[gateway.api_keys]]\nsha256 = \"{}\"\ntenant = \"acme\"\n\n\
                 [[gateway.api_keys]]\nsha256 = \"{}\"\ntenant = \"bob\"\n",
                genfleet::gateway::keys::hash_hex(KEY_ACME),
                genfleet::gateway::keys::hash_hex(KEY_BOB),
            ),
        )
        .unwrap();
        let env: Vec<(String, String)> = vec![
            ("GENFLEET__NATS__URL".into(), fleet.nats.url()),
            (
                "GENFLEET__GATEWAY__LISTEN".into(),
                format!("127.0.0.1:{port}"),
            ),
        ];
        let config_path = path.to_string_lossy().into_owned();
        let process = tokio::task::spawn_blocking(move || {
            let mut process =
                Running::start("gateway", &["--config", &config_path, "gateway"], &env);
            process.wait_for("gateway listening on");
            process
        })
        .await
        .unwrap();
        Gateway {
            _process: process,
            port,
            _config: config,
        }
    }

    fn chat(&self, key: &str, body: Value) -> reqwest::RequestBuilder {
        reqwest::Client::new()
            .post(format!(
                "http://127.0.0.1:{}/v1/chat/completions",
                self.port
            ))
            .bearer_auth(key)
            .json(&body)
    }
}

fn completion(prompt: &str, stream: bool, genfleet: Value) -> Value {
    json!({"model": "default", "stream": stream,
           "messages": [{"role": "user", "content": prompt}], "genfleet": genfleet})
}

/// The `data:` payloads of an SSE response, as they come.
fn sse_data(response: reqwest::Response) -> impl futures_util::Stream<Item = String> {
    let mut buffer = String::new();
    response
        .bytes_stream()
        .take_while(|chunk| std::future::ready(chunk.is_ok()))
        .filter_map(|chunk| std::future::ready(chunk.ok()))
        .flat_map(move |bytes: bytes::Bytes| {
            buffer.push_str(&String::from_utf8_lossy(&bytes));
            let mut out = Vec::new();
            while let Some(end) = buffer.find("\n\n") {
                let frame: String = buffer.drain(..end + 2).collect();
                for line in frame.lines() {
                    if let Some(data) = line.strip_prefix("data: ") {
                        out.push(data.to_string());
                    }
                }
            }
            futures_util::stream::iter(out)
        })
}

/// A streamed completion read to its end: its text, its finish reason, whether `[DONE]` came,
/// and any error frame.
#[derive(Debug, Default)]
struct Streamed {
    text: String,
    finish: Option<String>,
    done: bool,
    error: Option<Value>,
}

async fn read_stream(frames: &mut (impl futures_util::Stream<Item = String> + Unpin)) -> Streamed {
    let mut out = Streamed::default();
    while let Some(frame) = frames.next().await {
        if frame == "[DONE]" {
            out.done = true;
            break;
        }
        let chunk: Value = serde_json::from_str(&frame).unwrap_or(Value::Null);
        if let Some(error) = chunk.get("error") {
            out.error = Some(error.clone());
            continue;
        }
        let choice = &chunk["choices"][0];
        out.text
            .push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        if let Some(reason) = choice["finish_reason"].as_str() {
            out.finish = Some(reason.to_string());
        }
    }
    out
}

/// Reads frames until some content came; returns the content so far.
async fn first_content(frames: &mut (impl futures_util::Stream<Item = String> + Unpin)) -> String {
    let mut text = String::new();
    while text.is_empty() {
        let frame = frames
            .next()
            .await
            .expect("the stream ended before any content");
        let chunk: Value = serde_json::from_str(&frame).unwrap_or(Value::Null);
        assert!(chunk.get("error").is_none(), "{chunk}");
        text.push_str(
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default(),
        );
    }
    text
}

/// Finding 2: key A (tenant acme) sending, durably, the `request_id` key B (tenant bob) is
/// streaming gets its own completion, not B's; A hanging up mid-way ends only A's request, and
/// B's stream ends with B's own output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_request_id_under_two_gateway_keys_is_two_separate_completions() {
    let f = Fleet::builder().script(&script()).slots(4).start().await;
    let gateway = Gateway::start(&f).await;
    let admin = f.client.nats().clone();

    // Round 1: B streams X; A sends X durably, streams a little, and hangs up.
    const X: &str = "gw-shared-x";
    let bob_prompt = "slow bob gateway words";
    let acme_prompt = "slow acme gateway words";
    let response = gateway
        .chat(
            KEY_BOB,
            completion(bob_prompt, true, json!({"request_id": X})),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut bob_frames = Box::pin(sse_data(response));
    let bob_start = tokio::time::timeout(WITHIN, first_content(&mut bob_frames))
        .await
        .expect("bob's stream starts");
    assert!(
        slow_output(bob_prompt).starts_with(&bob_start),
        "bob's stream began with {bob_start:?}"
    );
    let response = gateway
        .chat(
            KEY_ACME,
            completion(acme_prompt, true, json!({"request_id": X, "durable": true})),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut acme_frames = Box::pin(sse_data(response));
    let acme_start = tokio::time::timeout(WITHIN, first_content(&mut acme_frames))
        .await
        .expect("acme's stream starts");
    assert!(
        slow_output(acme_prompt).starts_with(&acme_start),
        "acme's stream began with {acme_start:?}, not its own words"
    );
    drop(acme_frames);
    let rest = tokio::time::timeout(WITHIN, read_stream(&mut bob_frames))
        .await
        .expect("bob's stream ends");
    assert!(rest.done && rest.error.is_none(), "{rest:?}");
    assert_eq!(rest.finish.as_deref(), Some("stop"), "{rest:?}");
    assert_eq!(
        format!("{bob_start}{}", rest.text),
        slow_output(bob_prompt),
        "bob's stream carried other words"
    );
    let status = ask_plain(&admin, &format!("gen.status.bob.{X}"), &json!({})).await;
    assert_eq!(status["state"], "COMPLETED", "{status}");

    // Round 2: B streams Y; A sends Y durably and waits for the whole completion.
    const Y: &str = "gw-shared-y";
    let response = gateway
        .chat(
            KEY_BOB,
            completion(bob_prompt, true, json!({"request_id": Y})),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut bob_frames = Box::pin(sse_data(response));
    let bob_start = tokio::time::timeout(WITHIN, first_content(&mut bob_frames))
        .await
        .expect("bob's second stream starts");
    let acme_whole = tokio::time::timeout(
        WITHIN,
        gateway
            .chat(
                KEY_ACME,
                completion(
                    acme_prompt,
                    false,
                    json!({"request_id": Y, "durable": true}),
                ),
            )
            .send(),
    )
    .await
    .expect("acme's completion comes")
    .unwrap();
    assert_eq!(acme_whole.status(), 200);
    let acme_body: Value = acme_whole.json().await.unwrap();
    assert_eq!(
        acme_body["choices"][0]["message"]["content"].as_str(),
        Some(slow_output(acme_prompt).as_str()),
        "{acme_body}"
    );
    let rest = tokio::time::timeout(WITHIN, read_stream(&mut bob_frames))
        .await
        .expect("bob's second stream ends");
    assert!(rest.done && rest.error.is_none(), "{rest:?}");
    assert_eq!(
        format!("{bob_start}{}", rest.text),
        slow_output(bob_prompt),
        "bob's second stream carried other words"
    );
    let status = ask_plain(&admin, &format!("gen.status.bob.{Y}"), &json!({})).await;
    assert_eq!(status["state"], "COMPLETED", "{status}");
}

/// Placement sends a keyed submit between workers, and a caller may forge the placement
/// headers (`Genfleet-Forwarded-By`, `Genfleet-Preferred-Worker`, `Genfleet-Affinity-Fallback`):
/// wherever the submit goes, it stays the tenant's whose subject it came on, under its
/// qualified id, and the keyed ones land on their key's worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_and_forged_placement_headers_keep_a_submit_in_its_tenant() {
    let f = tenants_fleet().await;
    let admin = f.client.nats().clone();
    let ids: Vec<&str> = f.workers.iter().map(|w| w.worker_id.as_str()).collect();
    fleet::wait_placement(&admin, &ids, WITHIN).await;
    let acme = Caller::connect(&f.nats, "acme", "acpass").await;
    // Keys whose worker is each of the two, so that about half the submits are sent on.
    let keys: Vec<String> = ids
        .iter()
        .flat_map(|worker| {
            (0..200)
                .map(|i| format!("acme-key-{i}"))
                .filter(|key| genfleet::schedule::rank(key, ids.iter().copied())[0] == *worker)
                .take(3)
        })
        .collect();
    assert_eq!(keys.len(), 6);
    for (n, key) in keys.iter().enumerate() {
        let id = format!("placed-{n}");
        let mut request = body(&id, "placed for acme");
        request["affinity_key"] = json!(key);
        let worker = submit_accepted(
            &acme.nats,
            "gen.submit.default.acme",
            async_nats::HeaderMap::new(),
            &request,
            &format!("acme.{id}"),
        )
        .await;
        assert_eq!(
            worker,
            genfleet::schedule::rank(key, ids.iter().copied())[0],
            "{key}"
        );
        let result = result_of(&admin, &format!("acme.{id}")).await;
        assert_eq!(
            (result["request_id"].as_str(), result["tenant"].as_str()),
            (Some(format!("acme.{id}").as_str()), Some("acme")),
            "{result}"
        );
    }
    // Forged: said to be sent on twice already (so started where it lands), naming a worker
    // and a reason of its own choosing.
    for (n, subject) in [
        "gen.submit.default.acme".to_string(),
        format!("gen.worker.{}.submit.acme", ids[1]),
    ]
    .iter()
    .enumerate()
    {
        let id = format!("forged-placement-{n}");
        let mut headers = async_nats::HeaderMap::new();
        headers.append("Genfleet-Forwarded-By", ids[0]);
        headers.append("Genfleet-Forwarded-By", "bob-worker");
        headers.insert("Genfleet-Preferred-Worker", "bob-worker");
        headers.insert("Genfleet-Affinity-Fallback", "load");
        let mut request = body(&id, "forged placement");
        request["affinity_key"] = json!("bob-session");
        submit_accepted(
            &acme.nats,
            subject,
            headers,
            &request,
            &format!("acme.{id}"),
        )
        .await;
        let result = result_of(&admin, &format!("acme.{id}")).await;
        assert_eq!(
            (result["request_id"].as_str(), result["tenant"].as_str()),
            (Some(format!("acme.{id}").as_str()), Some("acme")),
            "{result}"
        );
    }
}
