//! Work the fleet never throws away: a request whose worker is killed mid-stream goes on on
//! another worker from its last checkpoint, and the caller's event stream simply continues.
//!
//! Real worker processes on a real nats-server, killed with SIGKILL; the mock model continues
//! a final assistant message deterministically (`continue_final_message`), so a resumed
//! output can be compared with the uninterrupted one.

mod common;

use std::time::{Duration, Instant};

use common::fleet::{self, Fleet, request};
use common::wait;
use futures_util::StreamExt;
use genfleet::protocol::{Event, EventBody, GenerationRequest, MoveReason, RequestState};

/// The bound on a request's run, and on the fleet's taking it up after a kill.
const SETTLE: Duration = Duration::from_secs(40);

/// Worker settings for quick detection and frequent checkpoints.
const RESUMING: [(&str, &str); 4] = [
    ("GENFLEET__WORKER__HEARTBEAT_MS", "300"),
    ("GENFLEET__WORKER__LOST_AFTER_MS", "1500"),
    ("GENFLEET__GENERATION__CHECKPOINT_MS", "200"),
    ("GENFLEET__LLM__CONTINUATION", "continue_final_message"),
];

/// `n` numbered words: every cut of the answer is told apart from any other.
fn words(n: usize) -> String {
    (0..n)
        .map(|i| format!("w{i:03}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Follows `id`'s events from now until its `finished` (see [`events_until_finished`]).
async fn follow(
    client: &genfleet::client::Client,
    id: &str,
) -> tokio::task::JoinHandle<(Vec<Event>, Option<Instant>)> {
    let events = client
        .nats()
        .subscribe(client.subjects().events(id))
        .await
        .expect("subscribed to the events");
    tokio::spawn(events_until_finished(events))
}

/// Worker processes `ids` with two slots each, on a mock running `script`.
async fn fleet_on(ids: [&str; 2], script: &str) -> Fleet {
    RESUMING
        .into_iter()
        .fold(
            Fleet::builder().default_settings().script(script),
            |builder, (key, value)| builder.worker_env(key, value),
        )
        .worker_env("RUST_LOG", "info")
        .worker_processes(ids)
        .slots(2)
        .start()
        .await
}

/// One worker process, "solo", with two slots on a mock running `script`, and the boolean
/// setting `switch` (an environment variable) on.
async fn solo(script: &str, switch: &'static str) -> Fleet {
    RESUMING
        .into_iter()
        .fold(
            Fleet::builder().default_settings().script(script),
            |builder, (key, value)| builder.worker_env(key, value),
        )
        .worker_env(switch, "true")
        .worker_env("RUST_LOG", "info")
        .worker_processes(["solo"])
        .slots(2)
        .start()
        .await
}

/// Worker processes `ids` on a mock answering `reply` a word every `delay_ms`.
async fn fleet_answering(ids: [&str; 2], reply: &str, delay_ms: u64) -> Fleet {
    fleet_on(
        ids,
        &format!("[[rules]]\nreply = \"{reply}\"\ndelay_ms = {delay_ms}\n"),
    )
    .await
}

/// Waits until `id`'s record holds a checkpoint with output, then kills (SIGKILL) the worker
/// process of `ids` that runs it. Returns that worker, the output the checkpoint seen held and
/// when the kill was.
async fn kill_after_checkpoint(
    f: &mut Fleet,
    ids: [&str; 2],
    id: &str,
) -> (String, String, Instant) {
    let nats = f.client.nats().clone();
    let (worker, output) = wait::until("a checkpoint with output", SETTLE, || async {
        let record = fleet::record(&nats, id).await;
        let live = record.as_ref().map(|r| &r["live"]);
        match live.map(|l| (&l["worker_id"], &l["progress"]["output"])) {
            Some((serde_json::Value::String(worker), serde_json::Value::String(output)))
                if !output.is_empty() =>
            {
                Ok((worker.clone(), output.clone()))
            }
            _ => Err(format!("its record: {record:?}")),
        }
    })
    .await;
    let index = ids
        .iter()
        .position(|w| *w == worker)
        .expect("one of the fleet's workers");
    f.processes[index].kill();
    (worker, output, Instant::now())
}

/// The events followed, or the workers' logs when the request did not finish.
async fn followed(
    f: &Fleet,
    ids: [&str; 2],
    following: tokio::task::JoinHandle<(Vec<Event>, Option<Instant>)>,
) -> (Vec<Event>, Option<Instant>) {
    match following.await {
        Ok(seen) => seen,
        Err(error) => {
            for worker in ids {
                let log = std::fs::read_to_string(f.logs().join(format!("{worker}.log")));
                eprintln!("--- {worker}:\n{}", log.unwrap_or_default());
            }
            panic!("the request did not finish: {error}");
        }
    }
}

/// Sequence numbers run 0, 1, 2, ... with no gap and none twice.
fn assert_gapless(seen: &[Event]) {
    let seqs: Vec<u64> = seen.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (0..seen.len() as u64).collect::<Vec<_>>(),
        "sequence numbers: {seqs:?}"
    );
}

/// The streamed text.
fn deltas(seen: &[Event]) -> String {
    seen.iter()
        .filter_map(|e| match &e.body {
            EventBody::Delta { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// The events of a request as a follower takes them, in the order they came, up to its
/// `finished`, and when its `resumed` event came. An event sent again after a move (its
/// number seen already) must be the same event; it is dropped.
async fn events_until_finished(
    mut events: async_nats::Subscriber,
) -> (Vec<Event>, Option<Instant>) {
    let mut seen = Vec::new();
    let mut resumed_at = None;
    loop {
        let message = tokio::time::timeout(SETTLE, events.next())
            .await
            .expect("the request finishes")
            .expect("the event subscription stays open");
        let event: Event = serde_json::from_slice(&message.payload).expect("an event");
        if let Some(first) = seen.iter().find(|e: &&Event| e.seq == event.seq) {
            // Sent again after a move (docs/protocol.md, Resume): as it was, and a follower
            // drops it.
            assert_eq!(first, &event, "a number sent again with other content");
            continue;
        }
        let finished = matches!(event.body, EventBody::Finished { .. });
        if matches!(event.body, EventBody::Resumed { .. }) {
            resumed_at.get_or_insert_with(Instant::now);
        }
        seen.push(event);
        if finished {
            return (seen, resumed_at);
        }
    }
}

#[tokio::test]
async fn a_streamed_request_whose_worker_is_killed_goes_on_on_another_from_its_checkpoint() {
    let reply = words(120);
    let mut f = fleet_answering(["left", "right"], &reply, 25).await;
    let client = f.client.clone();
    let id = "resume-me";
    let following = follow(&client, id).await;
    let accepted = client
        .submit("default", &request(id, "go"))
        .await
        .expect("accepted");
    let first = accepted.worker_id.clone();

    // Once its record holds a checkpoint with some output, its worker is killed.
    let (killed, checkpointed, killed_at) =
        kill_after_checkpoint(&mut f, ["left", "right"], id).await;
    assert_eq!(killed, first);
    let (seen, resumed_at) = followed(&f, ["left", "right"], following).await;
    // The caller's stream goes on without a gap and without text twice: sequence numbers run
    // 0, 1, 2, ... and the deltas join into the whole answer.
    assert_gapless(&seen);
    assert_eq!(deltas(&seen), reply, "the deltas join into the answer");
    let resumed: Vec<&Event> = seen
        .iter()
        .filter(|e| matches!(e.body, EventBody::Resumed { .. }))
        .collect();
    assert_eq!(resumed.len(), 1, "one move: {seen:?}");
    if let EventBody::Resumed {
        from_worker,
        reason,
        worker_id,
        ..
    } = &resumed[0].body
    {
        assert_eq!(
            (from_worker.as_str(), *reason),
            (first.as_str(), MoveReason::WorkerLost)
        );
        assert_ne!(worker_id, &first);
    }

    let result = fleet::take_exactly_once(&client, id).await;
    assert_eq!(result.state, RequestState::Completed, "{result:?}");
    assert_eq!(
        result.output, reply,
        "the output equals the uninterrupted run's"
    );
    assert_eq!(result.resumed.len(), 1, "{:?}", result.resumed);
    let moved = &result.resumed[0];
    assert_eq!(moved.from_worker, first);
    assert_eq!(moved.to_worker, result.worker_id);
    assert_eq!(moved.reason, MoveReason::WorkerLost);
    assert!(
        moved.at_output_bytes >= checkpointed.len(),
        "it went on from the last checkpoint ({} bytes), at least the one seen ({})",
        moved.at_output_bytes,
        checkpointed.len()
    );
    assert_eq!(result.attempt, 2);

    // The backend was asked to continue the cut turn, not to start it again.
    let requests = f.mock().requests();
    let continued: Vec<&serde_json::Value> = requests
        .iter()
        .filter(|r| r["continue_final_message"] == serde_json::json!(true))
        .collect();
    assert_eq!(continued.len(), 1, "one continuation: {requests:?}");
    let prefix = continued[0]["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string();
    assert!(
        !prefix.is_empty() && reply.starts_with(&prefix),
        "the continued prefix is a start of the answer: {prefix:?}"
    );
    // Measured, not asserted: the text the model generated twice (what the killed worker
    // received after its last checkpoint) and how soon the stream went on.
    let generated = f.mock().generated_stats().content_chars;
    eprintln!(
        "generated again: {} of {} characters; streaming again {:?} after the kill",
        generated.saturating_sub(reply.chars().count() as u64),
        reply.chars().count(),
        resumed_at.map(|at| at.duration_since(killed_at))
    );
}

#[tokio::test]
async fn a_durable_request_with_tools_whose_worker_is_killed_goes_on_without_calling_a_tool_twice()
{
    let answer = words(100);
    // The model calls `tally` first; given its result it streams the long answer.
    let script = format!(
        "[[rules]]\nwhen_last_user_contains = \"probe\"\nreply = \"ready\"\n\n\
         [[rules]]\nwhen_last_role = \"tool\"\nreply = \"{answer}\"\ndelay_ms = 25\n\n\
         [[rules]]\ntool_calls = [{{ name = \"tally\", arguments = {{}} }}]\n"
    );
    let ids = ["east", "west"];
    let mut f = fleet_on(ids, &script).await;
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = calls.clone();
    let tally = serde_json::from_value::<genfleet::tools::ToolDefinition>(serde_json::json!({
        "name": "tally", "brief": "Count the calls", "schema": {"type": "object"}
    }))
    .expect("a definition");
    let _service = genfleet::client::tool_service::ToolService::start(
        f.client.nats().clone(),
        &f.settings,
        tally,
        move |_, _| {
            let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            async move { Ok(serde_json::json!({ "calls": n })) }
        },
    )
    .await
    .expect("the tool service starts");
    let client = f.client.clone();
    // Both workers know the tool before the queued request reaches either.
    for worker in ids {
        let subject = client.subjects().worker_submit(worker, None);
        wait::until(&format!("{worker} to know the tool"), SETTLE, || {
            let client = client.clone();
            let subject = subject.clone();
            async move {
                let mut probe = GenerationRequest::user("probe");
                probe.tools = vec!["tally".into()];
                let body = serde_json::to_vec(&probe).expect("a request");
                let reply = client
                    .nats()
                    .request(subject, body.into())
                    .await
                    .map_err(|e| e.to_string())?;
                let text = String::from_utf8_lossy(&reply.payload).to_string();
                if text.contains("unknown tools") {
                    Err(text)
                } else {
                    Ok(())
                }
            }
        })
        .await;
    }
    let id = "resume-durable";
    let following = follow(&client, id).await;
    let mut asked = request(id, "tally, then tell me");
    asked.tools = vec!["tally".into()];
    client.enqueue("default", &asked).await.expect("queued");

    let (killed, _, _) = kill_after_checkpoint(&mut f, ids, id).await;
    let (seen, _) = followed(&f, ids, following).await;
    assert_gapless(&seen);
    assert_eq!(deltas(&seen), answer, "the deltas join into the answer");
    let results = seen
        .iter()
        .filter(|e| matches!(e.body, EventBody::ToolResult { .. }))
        .count();
    assert_eq!(results, 1, "one tool result was sent: {seen:?}");
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the tool ran once"
    );

    let result = fleet::take_exactly_once(&client, id).await;
    assert_eq!(result.state, RequestState::Completed, "{result:?}");
    assert_eq!(result.output, answer);
    assert_eq!(result.tool_iterations_used, 1);
    assert_eq!(result.resumed.len(), 1, "{:?}", result.resumed);
    assert_eq!(result.resumed[0].from_worker, killed);
    assert_ne!(result.worker_id, killed);
    // The queue message was acknowledged by the worker that took the request up.
    fleet::wait_queue_empty(client.nats(), "default", SETTLE).await;
}

#[tokio::test]
async fn a_drain_hands_its_running_requests_off_and_none_is_cancelled_or_restarted() {
    let reply = words(100);
    let ids = ["leaving", "staying"];
    // A short drain deadline: the requests still run when it comes.
    let f = RESUMING
        .into_iter()
        .fold(
            Fleet::builder()
                .default_settings()
                .script(&format!("[[rules]]\nreply = \"{reply}\"\ndelay_ms = 25\n")),
            |builder, (key, value)| builder.worker_env(key, value),
        )
        .worker_env("GENFLEET__WORKER__DRAIN_TIMEOUT_MS", "300")
        .worker_env("RUST_LOG", "info")
        .worker_processes(ids)
        .slots(3)
        .start()
        .await;
    let client = f.client.clone();
    let mut following = Vec::new();
    let mut asked = Vec::new();
    for n in 0..4 {
        let id = format!("drain-{n}");
        following.push(follow(&client, &id).await);
        if n % 2 == 0 {
            client
                .submit("default", &request(&id, "go"))
                .await
                .expect("accepted");
        } else {
            client
                .enqueue("default", &request(&id, "go"))
                .await
                .expect("queued");
        }
        asked.push(id);
    }
    // Once a request on the leaving worker has written a checkpoint, it is told to stop.
    let nats = client.nats().clone();
    let on_leaving: Vec<String> = wait::until(
        "requests checkpointed on the leaving worker",
        SETTLE,
        || async {
            let mut there = Vec::new();
            for id in &asked {
                if let Some(record) = fleet::record(&nats, id).await
                    && record["live"]["worker_id"] == "leaving"
                    && record["live"]["progress"].is_object()
                {
                    there.push(id.clone());
                }
            }
            if there.is_empty() {
                Err("none yet".to_string())
            } else {
                Ok(there)
            }
        },
    )
    .await;
    f.processes[0].ask_to_stop();
    for (id, following) in asked.iter().zip(following) {
        let (seen, _) = followed(&f, ids, following).await;
        assert_gapless(&seen);
        assert_eq!(
            deltas(&seen),
            reply,
            "{id}: the deltas join into the answer"
        );
        let result = fleet::take_exactly_once(&client, id).await;
        assert_eq!(
            (result.state, result.output.as_str()),
            (RequestState::Completed, reply.as_str()),
            "{id}: {result:?}"
        );
        if on_leaving.contains(id) {
            // It went on on the staying worker from its checkpoint: not cancelled, not
            // started over.
            assert_eq!(result.worker_id, "staying", "{id}: {result:?}");
            assert_eq!(result.resumed.len(), 1, "{id}: {:?}", result.resumed);
            assert_eq!(result.resumed[0].reason, MoveReason::Drained);
            assert!(
                result.resumed[0].at_output_bytes > 0,
                "{id}: {:?}",
                result.resumed
            );
        }
    }
    // Every move continued its turn: the backend was asked to continue as many times as
    // requests moved, and started no answer over.
    let moved = f.mock().generated_stats().continuations;
    assert!(moved >= on_leaving.len() as u64, "{moved} continuations");
    fleet::wait_queue_empty(client.nats(), "default", SETTLE).await;
}

#[tokio::test]
async fn a_high_request_preempts_a_low_one_which_goes_on_later_with_the_same_output() {
    let long = words(100);
    let script = format!(
        "[[rules]]\nwhen_last_user_contains = \"urgent\"\nreply = \"done at once\"\n\n\
         [[rules]]\nreply = \"{long}\"\ndelay_ms = 25\n"
    );
    let f = solo(&script, "GENFLEET__WORKER__PREEMPT").await;
    let client = f.client.clone();
    let nats = client.nats().clone();
    let mut following = Vec::new();
    let lows = ["low-0", "low-1"];
    for id in lows {
        following.push(follow(&client, id).await);
        let mut asked = request(id, "take your time");
        asked.priority = Some(genfleet::protocol::Priority::Low);
        client.submit("default", &asked).await.expect("accepted");
    }
    // Both slots run `low` work.
    for id in lows {
        wait::until(&format!("{id} to stream"), SETTLE, || async {
            match fleet::record(&nats, id).await {
                Some(record) if record["live"]["state"] == "RUNNING" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    }
    let high_following = follow(&client, "high-0").await;
    let mut urgent = request("high-0", "urgent");
    urgent.priority = Some(genfleet::protocol::Priority::High);
    client
        .submit("default", &urgent)
        .await
        .expect("a high request is accepted with every slot busy");
    let (high_seen, _) = followed(&f, ["solo", "solo"], high_following).await;
    let high = fleet::take_exactly_once(&client, "high-0").await;
    assert_eq!(high.output, "done at once", "{high:?}");
    assert_eq!(high_seen.last().map(|e| e.body.name()), Some("finished"));

    let mut preempted = 0;
    for (id, following) in lows.iter().zip(following) {
        let (seen, _) = followed(&f, ["solo", "solo"], following).await;
        assert_gapless(&seen);
        assert_eq!(deltas(&seen), long, "{id}: the deltas join into the answer");
        let result = fleet::take_exactly_once(&client, id).await;
        assert_eq!(
            (result.state, result.output.as_str()),
            (RequestState::Completed, long.as_str()),
            "{id}: the same output it would have had"
        );
        if let Some(moved) = result.resumed.first() {
            assert_eq!(moved.reason, MoveReason::Preempted, "{id}: {moved:?}");
            assert_eq!(
                (moved.from_worker.as_str(), moved.to_worker.as_str()),
                ("solo", "solo")
            );
            preempted += 1;
        }
    }
    // One slot was wanted: one `low` request gave it up (the newer one).
    assert_eq!(preempted, 1, "one low request was preempted");
}

#[tokio::test]
async fn a_structured_output_request_takes_its_cut_turn_again_instead_of_continuing_it() {
    let fields = words(60);
    let answer = format!("{{\\\"summary\\\": \\\"{fields}\\\"}}");
    let expected = format!("{{\"summary\": \"{fields}\"}}");
    // A tool first (a boundary the request checkpoints at), then the JSON answer, slowly.
    let script = format!(
        "[[rules]]\nwhen_last_user_contains = \"probe\"\nreply = \"ready\"\n\n\
         [[rules]]\nwhen_last_role = \"tool\"\nreply = \"{answer}\"\ndelay_ms = 40\n\n\
         [[rules]]\ntool_calls = [{{ name = \"tally\", arguments = {{}} }}]\n"
    );
    let ids = ["north", "south"];
    let mut f = fleet_on(ids, &script).await;
    let tally = serde_json::from_value::<genfleet::tools::ToolDefinition>(serde_json::json!({
        "name": "tally", "brief": "Count the calls", "schema": {"type": "object"}
    }))
    .expect("a definition");
    let _service = genfleet::client::tool_service::ToolService::start(
        f.client.nats().clone(),
        &f.settings,
        tally,
        // Slow enough that the request has run past its checkpoint interval at the boundary.
        |_, _| async {
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok(serde_json::json!({ "calls": 1 }))
        },
    )
    .await
    .expect("the tool service starts");
    let client = f.client.clone();
    let nats = client.nats().clone();
    let id = "resume-json";
    let following = follow(&client, id).await;
    let mut asked = request(id, "summarise as JSON");
    asked.tools = vec!["tally".into()];
    asked.options.insert(
        "response_format".into(),
        serde_json::json!({"type": "json_object"}),
    );
    let accepted = fleet::submit_when_tools_known(&client, &asked).await;
    // Once the tool's boundary is checkpointed and the JSON turn has begun, its worker dies.
    wait::until(
        "the JSON turn under way after a checkpoint",
        SETTLE,
        || async {
            let record = fleet::record(&nats, id).await;
            let checkpointed = record.as_ref().is_some_and(|r| {
                r["live"]["progress"]["conversation"]
                    .as_array()
                    .is_some_and(|c| c.len() >= 2)
            });
            let answering = f.mock().requests().len() >= 2;
            if checkpointed && answering {
                Ok(())
            } else {
                Err(format!("{record:?}"))
            }
        },
    )
    .await;
    let index = ids
        .iter()
        .position(|w| *w == accepted.worker_id)
        .expect("a worker of the fleet");
    f.processes[index].kill();

    let (seen, _) = followed(&f, ids, following).await;
    assert_gapless(&seen);
    // None of the cut turn had been sent: its text waited for the turn's end, so the turn
    // taken again repeats nothing.
    assert_eq!(deltas(&seen), expected);
    let result = fleet::take_exactly_once(&client, id).await;
    assert_eq!(result.state, RequestState::Completed, "{result:?}");
    assert_eq!(result.output, expected);
    assert_eq!(result.resumed.len(), 1, "{:?}", result.resumed);
    // Taken again from the tool boundary: the backend was never asked to continue it.
    assert_eq!(f.mock().generated_stats().continuations, 0);
    assert!(
        f.mock()
            .requests()
            .iter()
            .all(|r| r.get("continue_final_message").is_none()),
        "no continuation was asked"
    );
}

/// A worker that stored a checkpoint and died before the events it let go went out: the run
/// that takes the request up sends them again, as they were, ahead of its `resumed` event, so
/// a follower that never got them misses nothing (and one that did drops them by number). The
/// record is written as such a worker leaves it: naming a worker with no heartbeat, its
/// checkpoint cut mid-turn, holding the two deltas it let go.
#[tokio::test]
async fn the_events_a_checkpoint_let_go_are_sent_again_by_the_run_that_takes_it_up() {
    let reply = words(40);
    let f = fleet_answering(["left", "right"], &reply, 10).await;
    let client = f.client.clone();
    let id = "resent";
    let shown = "w000 w001 w002";
    let released: Vec<Event> = [(1, "w000 w001"), (2, " w002")]
        .into_iter()
        .map(|(seq, text)| Event {
            request_id: id.into(),
            seq,
            ts: "2026-11-28T00:00:00Z".into(),
            body: EventBody::Delta { text: text.into() },
        })
        .collect();
    let record = serde_json::json!({"live": {
        "request_id": id, "state": "RUNNING", "worker_id": "died-after-its-checkpoint",
        "attempt": 1, "durable": false,
        "progress": {
            "request": {"request_id": id, "messages": [{"role": "user", "content": "go"}]},
            "conversation": [], "partial": shown, "partial_visible": shown, "output": shown,
            "usage": {"prompt_tokens": 1, "completion_tokens": 3},
            "tool_iterations_used": 0, "tool_iterations_left": 4, "next_seq": 3,
            "released": released,
            "elapsed_ms": 400, "first_token_ms": 10, "root_request_id": id, "chain_position": 1
        }
    }});
    let following = follow(&client, id).await;
    let js = async_nats::jetstream::new(client.nats().clone());
    js.get_key_value("GENFLEET_RESULTS")
        .await
        .unwrap()
        .put(
            format!("res.{id}"),
            serde_json::to_vec(&record).unwrap().into(),
        )
        .await
        .unwrap();
    // Whoever asks about it finds its worker gone; a live worker takes it up.
    let _ = client.status(id).await;
    let (seen, _) = following.await.unwrap();
    // The follower subscribed after the `started` event: it sees the two deltas sent again,
    // then the move, then the rest.
    assert_eq!(seen[..2], released[..], "{seen:?}");
    assert!(
        matches!(seen[2].body, EventBody::Resumed { .. }) && seen[2].seq == 3,
        "{:?}",
        seen[2]
    );
    let seqs: Vec<u64> = seen.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seen.len() as u64).collect::<Vec<_>>());
    let result = client.result(id, true).await.unwrap();
    assert_eq!(result.state, RequestState::Completed, "{result:?}");
    assert_eq!(result.output, reply);
    assert_eq!(deltas(&seen), reply);
}

/// Fair share (`worker.preempt_fair_share`): a tenant whose durable requests fill every slot
/// of the only worker gives one up to another tenant's request, which starts without waiting
/// for a slot to free; the request that gave it goes on later with the same output.
#[tokio::test]
async fn a_tenant_under_its_share_takes_a_slot_of_the_tenant_far_over_it() {
    fair_share(true).await;
}

/// The same with interactive submits: the light tenant's submit is accepted RUNNING on the full
/// worker, whose flooding tenant's newest request writes its checkpoint and stops.
#[tokio::test]
async fn an_interactive_submit_under_its_share_takes_a_slot_of_the_tenant_far_over_it() {
    fair_share(false).await;
}

/// Requests of tenant `flood` on both slots of the only worker (and one more waiting on the
/// durable queue), then one of tenant `light`: queued on the durable queue (`durable`) or
/// submitted.
async fn fair_share(durable: bool) {
    let long = words(200);
    let script = format!(
        "[[rules]]\nwhen_last_user_contains = \"light\"\nreply = \"done at once\"\n\n\
         [[rules]]\nreply = \"{long}\"\ndelay_ms = 25\n"
    );
    let f = solo(&script, "GENFLEET__WORKER__PREEMPT_FAIR_SHARE").await;
    let flood = f.client.clone().with_tenant("flood").unwrap();
    let light = f.client.clone().with_tenant("light").unwrap();
    let nats = f.client.nats().clone();
    // Interactive submits find no slot past the two: the third is the durable queue's.
    let floods: Vec<String> = (0..if durable { 3 } else { 2 })
        .map(|i| format!("flood-{i}"))
        .collect();
    let mut following = Vec::new();
    for id in &floods {
        following.push(follow(&flood, &flood.on_bus(id)).await);
        let asked = request(id, "take your time");
        if durable {
            flood.enqueue("default", &asked).await.expect("queued");
        } else {
            flood.submit("default", &asked).await.expect("accepted");
        }
    }
    // The flooding tenant holds both slots; its third request waits in the queue.
    wait::until("the flood to hold both slots", SETTLE, || async {
        let mut running = 0;
        for id in &floods {
            if let Some(record) = fleet::record(&nats, &format!("flood.{id}")).await
                && record["live"]["state"] == "RUNNING"
            {
                running += 1;
            }
        }
        (running == 2).then_some(()).ok_or(running)
    })
    .await;
    let asked = request("light-0", "light work");
    if durable {
        light.enqueue("default", &asked).await.expect("queued");
    } else {
        let accepted = light
            .submit("default", &asked)
            .await
            .expect("a light request is accepted with every slot busy");
        // It starts at once; the flood's newest request gives its slot back as it stops.
        assert_eq!(accepted.state, RequestState::Running);
    }
    let done = fleet::terminal(&light, "light-0", SETTLE).await;
    assert_eq!(
        (done.state, done.output.as_str()),
        (RequestState::Completed, "done at once"),
        "{done:?}"
    );
    let mut preempted = Vec::new();
    for (id, following) in floods.iter().zip(following) {
        let (seen, _) = followed(&f, ["solo", "solo"], following).await;
        assert_gapless(&seen);
        assert_eq!(deltas(&seen), long, "{id}: the deltas join into the answer");
        let result = fleet::take_exactly_once(&flood, id).await;
        assert_eq!(
            (result.state, result.output.as_str()),
            (RequestState::Completed, long.as_str()),
            "{id}: the same output it would have had"
        );
        for moved in &result.resumed {
            assert_eq!(moved.reason, MoveReason::Preempted, "{id}: {moved:?}");
            preempted.push(id.clone());
        }
    }
    // One slot was wanted: one of the two running flood requests gave it up, once.
    assert_eq!(preempted.len(), 1, "{preempted:?}");
    assert_ne!(
        preempted[0], "flood-2",
        "the one still queued had no slot to give"
    );
}
