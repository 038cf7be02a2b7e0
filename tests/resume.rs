//! Work the fleet never throws away: a request whose worker is killed mid-stream goes on on
//! another worker from its last checkpoint, and the caller's event stream simply continues.
//!
//! Real worker processes on a real nats-server, killed with SIGKILL; the mock model continues
//! a final assistant message deterministically (`continue_final_message`), so a resumed
//! output can be compared with the uninterrupted one.

mod common;

use std::time::Duration;

use common::fleet::{self, Fleet, request};
use common::wait;
use futures_util::StreamExt;
use genfleet::protocol::{Event, EventBody, MoveReason, RequestState};

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

/// Worker processes `ids` with two slots each, on a mock answering `reply` a word every
/// `delay_ms`.
async fn fleet_answering(ids: [&str; 2], reply: &str, delay_ms: u64) -> Fleet {
    RESUMING
        .into_iter()
        .fold(
            Fleet::builder().default_settings().script(&format!(
                "[[rules]]\nreply = \"{reply}\"\ndelay_ms = {delay_ms}\n"
            )),
            |builder, (key, value)| builder.worker_env(key, value),
        )
        .worker_processes(ids)
        .slots(2)
        .start()
        .await
}

/// The events of a request, in the order they came, up to its `finished`.
async fn events_until_finished(mut events: async_nats::Subscriber) -> Vec<Event> {
    let mut seen = Vec::new();
    loop {
        let message = tokio::time::timeout(SETTLE, events.next())
            .await
            .expect("the request finishes")
            .expect("the event subscription stays open");
        let event: Event = serde_json::from_slice(&message.payload).expect("an event");
        let finished = matches!(event.body, EventBody::Finished { .. });
        seen.push(event);
        if finished {
            return seen;
        }
    }
}

#[tokio::test]
async fn a_streamed_request_whose_worker_is_killed_goes_on_on_another_from_its_checkpoint() {
    let reply = words(120);
    let mut f = fleet_answering(["left", "right"], &reply, 25).await;
    let client = &f.client;
    let nats = client.nats().clone();
    let id = "resume-me";
    let events = nats
        .subscribe(client.subjects().events(id))
        .await
        .expect("subscribed to the events");
    let following = tokio::spawn(events_until_finished(events));
    let accepted = client
        .submit("default", &request(id, "go"))
        .await
        .expect("accepted");
    let first = accepted.worker_id.clone();

    // Once its record holds a checkpoint with some output, its worker is killed.
    let checkpointed = wait::until("the request's first checkpoint", SETTLE, || async {
        let record = fleet::record(&nats, id).await;
        match record
            .as_ref()
            .and_then(|r| r["live"]["progress"]["output"].as_str())
        {
            Some(output) if !output.is_empty() => Ok(output.to_string()),
            _ => Err(format!("its record: {record:?}")),
        }
    })
    .await;
    let index = ["left", "right"]
        .iter()
        .position(|w| *w == first)
        .expect("one of the two");
    f.processes[index].kill();

    let seen = following.await.expect("the follower ends");
    // The caller's stream goes on without a gap and without text twice: sequence numbers run
    // 0, 1, 2, ... and the deltas join into the whole answer.
    let seqs: Vec<u64> = seen.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (0..seen.len() as u64).collect::<Vec<_>>(),
        "sequence numbers: {seqs:?}"
    );
    let streamed: String = seen
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::Delta { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(streamed, reply, "the deltas join into the answer");
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

    let result = fleet::take_exactly_once(client, id).await;
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
}
