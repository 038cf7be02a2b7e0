//! Escalations, checkpoints, answers, expiry and the decision history on a real nats-server
//! with the mock backend.

mod common;

use std::time::Duration;

use common::fleet::{self, Fleet};
use common::wait;
use genfleet::engine::history::{HistoryEntry, HistoryOutcome};
use genfleet::protocol::{
    DecisionBlock, DecisionOutcome, ErrorCode, Event, EventBody, GenerationRequest,
    GenerationResult, Reason, RequestState, SignalType,
};
use genfleet::settings::Settings;
use serde_json::{Value, json};

/// A fleet whose signals the test reads.
struct Watched {
    fleet: Fleet,
    signals: async_nats::Subscriber,
}

async fn fleet(script: &str, tune: impl Fn(&mut Settings)) -> Watched {
    let fleet = Fleet::builder().script(script).settings(tune).start().await;
    let signals = fleet.client.nats().subscribe("signals.>").await.unwrap();
    fleet.client.nats().flush().await.unwrap();
    Watched { fleet, signals }
}

impl Watched {
    async fn run(&self, request: GenerationRequest) -> GenerationResult {
        self.fleet
            .client
            .run("default", request, Duration::from_secs(15))
            .await
            .unwrap()
    }

    /// Answers on `decisions.<id>` and returns the raw reply.
    async fn answer(&self, decision_id: &str, body: Value) -> Value {
        let reply = self
            .fleet
            .client
            .nats()
            .request(
                format!("decisions.{decision_id}"),
                serde_json::to_vec(&body).unwrap().into(),
            )
            .await
            .unwrap();
        serde_json::from_slice(&reply.payload).unwrap()
    }

    /// The next signal on `signals.<suffix>`, skipping others.
    async fn signal(&mut self, suffix: &str) -> Value {
        let subject = format!("signals.{suffix}");
        let what = format!("a signal on {subject}");
        wait::next_matching(&what, Duration::from_secs(10), &mut self.signals, |m| {
            (m.subject.as_str() == subject)
                .then(|| serde_json::from_slice::<Value>(&m.payload).unwrap())
        })
        .await
    }

    async fn terminal(&self, id: &str) -> GenerationResult {
        let within = Duration::from_secs(15);
        fleet::wait_result(&self.fleet.client, id, within, fleet::RUNNING_OR_UNCLAIMED).await
    }

    async fn history(&self, code: &str, decision_id: &str) -> Option<HistoryEntry> {
        let js = async_nats::jetstream::new(self.fleet.client.nats().clone());
        let kv = js.get_key_value("GENFLEET_HISTORY").await.unwrap();
        let value = kv.get(format!("{code}.{decision_id}")).await.unwrap()?;
        Some(serde_json::from_slice(&value).unwrap())
    }

    /// Waits until the history entry has an outcome other than pending.
    async fn settled_history(&self, code: &str, decision_id: &str) -> HistoryEntry {
        let what = format!("the history entry of {decision_id} to settle");
        wait::until(&what, Duration::from_secs(10), || async {
            match self.history(code, decision_id).await {
                Some(entry) if entry.outcome != HistoryOutcome::Pending => Ok(entry),
                other => Err(format!("{other:?}")),
            }
        })
        .await
    }
}

fn decision_of(result: &GenerationResult, kind: SignalType, code: &str) -> DecisionBlock {
    result
        .signals
        .iter()
        .find(|s| s.kind == kind && s.code == code)
        .and_then(|s| s.decision.clone())
        .unwrap_or_else(|| panic!("no {code} decision in {:?}", result.signals))
}

/// Collects events of a request until one matches `last`.
async fn events_until(
    events: &mut (impl futures_util::Stream<Item = Event> + Unpin),
    last: &str,
) -> Vec<Event> {
    wait::collect_until(
        &format!("the {last} event"),
        Duration::from_secs(10),
        events,
        |event| event.body.name() == last,
    )
    .await
}

/// The model leaves out TOTAL unless guided or given a prompt asking for it.
const SUMS: &str = r#"
[[rules]]
when_any_message_contains = "write TOTAL"
reply = "TOTAL 42"
[[rules]]
reply = "the sum is 42"
"#;

fn checked(id: &str, prompt: &str) -> GenerationRequest {
    serde_json::from_value(json!({
        "request_id": id,
        "job_name": "sums",
        "messages": [{"role": "user", "content": prompt}],
        "validation": [
            {"kind": "contains", "text": "TOTAL", "weight": 3.0},
            {"kind": "max_chars", "max": 200}
        ]
    }))
    .unwrap()
}

#[tokio::test]
async fn an_escalation_answered_retry_with_guidance_continues_and_succeeds() {
    let mut f = fleet(SUMS, |_| {}).await;
    let first = f.run(checked("e1", "Sum the numbers.")).await;
    assert_eq!(first.reason, Reason::DecisionRequested);
    assert_eq!(
        f.fleet.mock().requests().len(),
        2,
        "one automatic retry first"
    );
    let decision = decision_of(&first, SignalType::Escalation, "LOW_CONFIDENCE");
    let published = f.signal("escalation.LOW_CONFIDENCE").await;
    assert_eq!(
        published["decision"]["decision_id"],
        decision.decision_id.as_str()
    );
    assert_eq!(published["meta"]["confidence"], json!(0.25));

    let bad = f
        .answer(
            &decision.decision_id,
            json!({"option_id": "retry", "confidence_boost": 2}),
        )
        .await;
    assert_eq!(bad["error"]["code"], "INVALID_REQUEST", "{bad}");
    let reply = f
        .answer(
            &decision.decision_id,
            json!({"option_id": "retry", "guidance": "Please write TOTAL before the number.",
                   "confidence_boost": 0.1, "decided_by": "ops", "rationale": "worth one more go"}),
        )
        .await;
    assert_eq!(reply["outcome"], "continued", "{reply}");
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let next = f.terminal(&continuation).await;
    assert_eq!(
        (
            next.state,
            next.reason,
            next.chain_position,
            next.output.as_str()
        ),
        (RequestState::Completed, Reason::Stop, 2, "TOTAL 42")
    );
    let report = next.validation.unwrap();
    assert!(report.passed);
    assert_eq!(report.threshold, 0.5, "the boost lowered the threshold");
    let asked = f.fleet.mock().requests().last().unwrap().clone();
    let messages = asked["messages"].as_array().unwrap();
    let last = messages.last().unwrap()["content"].as_str().unwrap();
    assert_eq!(
        last, "Guidance from the manager: Please write TOTAL before the number.",
        "the guidance reaches the model"
    );
    let note = messages[messages.len() - 2]["content"].as_str().unwrap();
    assert!(
        note.starts_with("Decision chosen: Run it again (retry)")
            && note.contains("worth one more go"),
        "{note}"
    );
    let status = f.fleet.client.status("e1").await.unwrap();
    assert_eq!(status.decision_outcome, Some(DecisionOutcome::Continued));
    assert_eq!(
        status.continuation_request_id.as_deref(),
        Some(continuation.as_str())
    );
    let decided = f.signal("outcome.DECIDED").await;
    assert_eq!(decided["meta"]["decided_by"], "ops");
    // The history keeps the answer, and the continuation's ending as its outcome.
    let entry = f
        .settled_history("LOW_CONFIDENCE", &decision.decision_id)
        .await;
    assert_eq!(entry.outcome, HistoryOutcome::Success);
    assert_eq!(
        (
            entry.choice.option_id.as_str(),
            entry.confidence,
            entry.pass_rate
        ),
        ("retry", Some(0.25), Some(50.0))
    );
    assert_eq!(entry.outcome_confidence, Some(1.0));
    assert_eq!(
        entry.continuation_request_id.as_deref(),
        Some(continuation.as_str())
    );
}

#[tokio::test]
async fn modify_prompt_replaces_the_task_and_a_second_shortfall_escalates_again() {
    let f = fleet(SUMS, |s| s.escalation.auto_retry_on_first_failure = false).await;
    let first = f.run(checked("m1", "Sum the numbers.")).await;
    let decision = decision_of(&first, SignalType::Escalation, "LOW_CONFIDENCE");
    let missing = f
        .answer(&decision.decision_id, json!({"option_id": "modify_prompt"}))
        .await;
    assert_eq!(missing["error"]["code"], "INVALID_REQUEST");
    assert!(
        missing["error"]["message"]
            .as_str()
            .unwrap()
            .contains("modified_prompt"),
        "{missing}"
    );
    let stray = f
        .answer(
            &decision.decision_id,
            json!({"option_id": "retry", "modified_prompt": "x"}),
        )
        .await;
    assert_eq!(stray["error"]["code"], "INVALID_REQUEST");
    let reply = f
        .answer(
            &decision.decision_id,
            json!({"option_id": "modify_prompt", "modified_prompt": "Sum the numbers and write TOTAL first."}),
        )
        .await;
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let next = f.terminal(&continuation).await;
    assert_eq!(
        (next.reason, next.output.as_str()),
        (Reason::Stop, "TOTAL 42")
    );
    let asked = f.fleet.mock().requests().last().unwrap().clone();
    let users: Vec<&str> = asked["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(users[0], "Sum the numbers and write TOTAL first.");
    assert!(!users.contains(&"Sum the numbers."), "{users:?}");

    // A plain retry falls short again: the continuation escalates at once (no automatic
    // retry past the first request), with the chain's error history.
    let second = f.run(checked("m2", "Sum the numbers.")).await;
    let decision = decision_of(&second, SignalType::Escalation, "LOW_CONFIDENCE");
    let reply = f
        .answer(
            &decision.decision_id,
            json!({"option_id": "retry", "decided_by": "ops"}),
        )
        .await;
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let next = f.terminal(&continuation).await;
    assert_eq!(
        (next.reason, next.chain_position),
        (Reason::DecisionRequested, 2)
    );
    let signal = next
        .signals
        .iter()
        .find(|s| s.code == "LOW_CONFIDENCE")
        .unwrap();
    let history = signal.meta["error_history"].as_array().unwrap();
    assert_eq!(history.len(), 2, "{history:?}");
    assert_eq!(history[0]["decided"], "retry by ops");
    assert_eq!(history[1]["chain_position"], 2);
    let entry = f
        .settled_history("LOW_CONFIDENCE", &decision.decision_id)
        .await;
    assert_eq!(entry.outcome, HistoryOutcome::Failure);
}

#[tokio::test]
async fn skip_and_abort_end_the_chain_with_a_clear_record() {
    let mut f = fleet(SUMS, |s| s.escalation.auto_retry_on_first_failure = false).await;
    for (id, option, code, outcome) in [
        ("s1", "skip", "SKIPPED", DecisionOutcome::Skipped),
        ("a1", "abort", "ABORTED", DecisionOutcome::Aborted),
    ] {
        let mut events = Box::pin(f.fleet.client.follow(id).await.unwrap());
        let first = f.run(checked(id, "Sum the numbers.")).await;
        let decision = decision_of(&first, SignalType::Escalation, "LOW_CONFIDENCE");
        let guided = f
            .answer(
                &decision.decision_id,
                json!({"option_id": option, "guidance": "x"}),
            )
            .await;
        assert_eq!(guided["error"]["code"], "INVALID_REQUEST", "{guided}");
        let reply = f
            .answer(
                &decision.decision_id,
                json!({"option_id": option, "decided_by": "lead", "rationale": "not worth it"}),
            )
            .await;
        assert_eq!(
            reply,
            json!({"decision_id": decision.decision_id, "continuation_request_id": null,
                   "outcome": outcome.as_str()})
        );
        let again = f
            .answer(&decision.decision_id, json!({"option_id": option}))
            .await;
        assert_eq!(again, reply, "the same answer again gets the same reply");
        let other = f
            .answer(&decision.decision_id, json!({"option_id": "retry"}))
            .await;
        assert_eq!(other["error"]["code"], "ALREADY_DECIDED");
        assert_eq!(other["error"]["detail"]["outcome"], outcome.as_str());

        let seen = events_until(&mut events, "chain_ended").await;
        assert_eq!(
            seen.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (0..seen.len() as u64).collect::<Vec<_>>(),
            "chain_ended follows finished, numbered on"
        );
        match &seen.last().unwrap().body {
            EventBody::ChainEnded {
                decision_id,
                outcome: ended,
                option_id,
                decided_by,
            } => {
                assert_eq!(decision_id, &decision.decision_id);
                assert_eq!(*ended, outcome);
                assert_eq!(option_id.as_deref(), Some(option));
                assert_eq!(decided_by.as_deref(), Some("lead"));
            }
            other => panic!("{other:?}"),
        }
        let signal = f.signal(&format!("outcome.{code}")).await;
        assert_eq!(signal["request_id"], id);
        assert_eq!(signal["root_request_id"], id);
        assert_eq!(signal["meta"]["rationale"], "not worth it");
        let status = f.fleet.client.status(id).await.unwrap();
        assert_eq!(status.decision_outcome, Some(outcome));
        assert_eq!(status.continuation_request_id, None);
        let entry = f
            .history("LOW_CONFIDENCE", &decision.decision_id)
            .await
            .unwrap();
        assert_eq!(
            entry.outcome,
            if option == "skip" {
                HistoryOutcome::Skipped
            } else {
                HistoryOutcome::Aborted
            }
        );
    }
    assert_eq!(
        f.fleet.mock().requests().len(),
        2,
        "nothing ran after skip or abort"
    );
}

const DEPLOY: &str = r#"
[[rules]]
reply = "deployed: {{last_user}}"
"#;

fn guarded(id: &str, prompt: &str) -> GenerationRequest {
    serde_json::from_value(json!({
        "request_id": id,
        "messages": [{"role": "user", "content": prompt}],
        "checkpoints": [{"name": "prod", "prompt_contains": ["production"], "message": "Deploy to production?"}]
    }))
    .unwrap()
}

/// Runs a guarded request to its checkpoint and answers it.
async fn ask(f: &mut Watched, id: &str, body: Value) -> (DecisionBlock, Value) {
    let first = f.run(guarded(id, "Deploy build 7 to production.")).await;
    assert_eq!(first.reason, Reason::DecisionRequested);
    let decision = decision_of(&first, SignalType::DecisionRequest, "CHECKPOINT");
    let signal = f.signal("decision_request.CHECKPOINT").await;
    assert_eq!(signal["meta"]["checkpoint"], "prod");
    let reply = f.answer(&decision.decision_id, body).await;
    (decision, reply)
}

#[tokio::test]
async fn a_checkpoint_answered_each_way() {
    let mut f = fleet(DEPLOY, |_| {}).await;
    // proceed: the continuation runs and the same checkpoint does not fire again.
    let (_, reply) = ask(
        &mut f,
        "p1",
        json!({"option_id": "proceed", "guidance": "use the canary"}),
    )
    .await;
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let next = f.terminal(&continuation).await;
    assert_eq!((next.reason, next.chain_position), (Reason::Stop, 2));
    assert!(
        next.output
            .starts_with("deployed: Guidance from the manager: use the canary")
    );
    assert!(next.signals.iter().all(|s| s.code != "CHECKPOINT"));
    // modify_prompt: the new prompt runs.
    let (_, reply) = ask(
        &mut f,
        "p2",
        json!({"option_id": "modify_prompt", "modified_prompt": "Deploy build 7 to staging."}),
    )
    .await;
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let next = f.terminal(&continuation).await;
    assert_eq!(next.reason, Reason::Stop);
    let asked = f.fleet.mock().requests().last().unwrap().clone();
    let first_user = asked["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "user")
        .unwrap()["content"]
        .clone();
    assert_eq!(first_user, "Deploy build 7 to staging.");
    let ran = f.fleet.mock().requests().len();
    // skip and abort: nothing runs.
    for (id, option) in [("p3", "skip"), ("p4", "abort")] {
        let (decision, reply) = ask(&mut f, id, json!({"option_id": option})).await;
        assert_eq!(reply["continuation_request_id"], Value::Null);
        let status = f.fleet.client.status(id).await.unwrap();
        assert_eq!(
            status.decision_id.as_deref(),
            Some(decision.decision_id.as_str())
        );
        assert_ne!(status.decision_outcome, Some(DecisionOutcome::Continued));
    }
    let (_, reply) = ask(&mut f, "p5", json!({"option_id": "retry"})).await;
    assert_eq!(reply["error"]["code"], "INVALID_OPTION", "{reply}");
    assert_eq!(f.fleet.mock().requests().len(), ran);
}

/// Escalations whose outputs hold some of A, B, C, D; the history test answers them.
const LETTERS: &str = r#"
[[rules]]
when_any_message_contains = "add C and D"
reply = "A B C D"
[[rules]]
when_any_message_contains = "[AB]"
reply = "A B"
[[rules]]
when_any_message_contains = "[A]"
reply = "A"
[[rules]]
when_any_message_contains = "[ABC]"
reply = "A B C"
"#;

fn lettered(id: &str, prompt: &str) -> GenerationRequest {
    serde_json::from_value(json!({
        "request_id": id,
        "messages": [{"role": "user", "content": prompt}],
        "escalation_threshold": 0.9,
        "validation": [
            {"kind": "contains", "text": "A"}, {"kind": "contains", "text": "B"},
            {"kind": "contains", "text": "C"}, {"kind": "contains", "text": "D"}
        ]
    }))
    .unwrap()
}

#[tokio::test]
async fn history_suggestions_surface_on_a_later_similar_escalation_in_order() {
    let f = fleet(LETTERS, |s| {
        s.escalation.auto_retry_on_first_failure = false
    })
    .await;
    let escalate = async |id: &str, prompt: &str, answer: Value| {
        let result = f.run(lettered(id, prompt)).await;
        let decision = decision_of(&result, SignalType::Escalation, "LOW_CONFIDENCE");
        let reply = f.answer(&decision.decision_id, answer).await;
        if let Some(continuation) = reply["continuation_request_id"].as_str() {
            f.terminal(continuation).await;
            f.settled_history("LOW_CONFIDENCE", &decision.decision_id)
                .await;
        }
        (decision.decision_id, result)
    };
    let task = "Count the apples in the north orchard";
    // Similar (0.5, 50 %), succeeded, similar prompt.
    let (similar_success, _) = escalate(
        "h1",
        &format!("{task} today [AB]"),
        json!({"option_id": "retry", "guidance": "add C and D"}),
    )
    .await;
    // Similar, succeeded, another task.
    let (other_success, _) = escalate(
        "h2",
        "Translate this poem into French [AB]",
        json!({"option_id": "retry", "guidance": "add C and D"}),
    )
    .await;
    // Similar, skipped.
    let (skipped, _) = escalate("h3", &format!("{task} [AB]"), json!({"option_id": "skip"})).await;
    // Too far in confidence and pass rate: never suggested.
    escalate("h4", &format!("{task} [A]"), json!({"option_id": "abort"})).await;
    escalate(
        "h5",
        &format!("{task} [ABC]"),
        json!({"option_id": "abort"}),
    )
    .await;

    let result = f.run(lettered("h6", &format!("{task} [AB]"))).await;
    let signal = result
        .signals
        .iter()
        .find(|s| s.code == "LOW_CONFIDENCE")
        .unwrap();
    let suggestions = signal.meta["suggestions"].as_array().unwrap();
    let ids: Vec<&str> = suggestions
        .iter()
        .map(|s| s["decision_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [
            similar_success.as_str(),
            other_success.as_str(),
            skipped.as_str()
        ],
        "successful first, then by prompt similarity at equal confidence: {suggestions:?}"
    );
    assert_eq!(suggestions[0]["outcome"], "success");
    assert_eq!(suggestions[0]["guidance"], "add C and D");
    assert_eq!(suggestions[2]["outcome"], "skipped");
    assert!(
        suggestions[0]["prompt_similarity"].as_f64().unwrap()
            > suggestions[1]["prompt_similarity"].as_f64().unwrap()
    );
}

const DECIDE: &str = r#"
[[rules]]
when_last_user_contains = "just answer"
reply = "ok"
[[rules]]
when_last_user_contains = "Decision chosen"
reply = "Proceeding: {{last_user}}"
[[rules]]
reply = "Two ways to go."
tool_calls = [{ name = "request_decision", arguments = { question = "Which path?", options = [{ id = "fast", label = "Fast" }, { id = "safe", label = "Safe" }], default_option = "safe" } }]
"#;

#[tokio::test]
async fn an_expired_decision_takes_its_default_or_expires_and_is_reported() {
    let mut f = fleet(DECIDE, |s| {
        s.decisions.ttl_ms = 800;
        s.escalation.default_option = "skip".into();
        s.escalation.auto_retry_on_first_failure = false;
    })
    .await;
    // A model decision with a default: answered with it by the fleet.
    let first = f
        .run(GenerationRequest {
            request_id: Some("t1".into()),
            ..GenerationRequest::user("Plan it.")
        })
        .await;
    let decision = decision_of(
        &first,
        SignalType::DecisionRequest,
        "NEEDS_MANAGER_DECISION",
    );
    let decided = f.signal("outcome.DECIDED").await;
    assert_eq!(decided["meta"]["decided_by"], "timeout");
    assert_eq!(decided["meta"]["option_id"], "safe");
    let continuation = decided["meta"]["continuation_request_id"].as_str().unwrap();
    let next = f.terminal(continuation).await;
    assert!(
        next.output.contains("Decision chosen: Safe (safe)"),
        "{}",
        next.output
    );
    let late = f
        .answer(&decision.decision_id, json!({"option_id": "fast"}))
        .await;
    assert_eq!(late["error"]["code"], "ALREADY_DECIDED");

    // An escalation whose default (from the config) is skip.
    let escalated = f
        .run(
            serde_json::from_value(json!({
                "request_id": "t2",
                "messages": [{"role": "user", "content": "just answer"}],
                "validation": [{"kind": "contains", "text": "never there"}]
            }))
            .unwrap(),
        )
        .await;
    let decision = decision_of(&escalated, SignalType::Escalation, "LOW_CONFIDENCE");
    assert_eq!(decision.default_option.as_deref(), Some("skip"));
    let skipped = f.signal("outcome.SKIPPED").await;
    assert_eq!(skipped["meta"]["decided_by"], "timeout");

    // A checkpoint without a default expires: DECISION_EXPIRED, and the answer comes too late.
    let mut events = Box::pin(f.fleet.client.follow("t3").await.unwrap());
    let guarded = f.run(guarded("t3", "to production")).await;
    let decision = decision_of(&guarded, SignalType::DecisionRequest, "CHECKPOINT");
    let expired = f.signal("outcome.DECISION_EXPIRED").await;
    assert_eq!(
        expired["meta"]["decision_id"],
        decision.decision_id.as_str()
    );
    let seen = events_until(&mut events, "chain_ended").await;
    assert!(matches!(
        seen.last().unwrap().body,
        EventBody::ChainEnded {
            outcome: DecisionOutcome::Expired,
            ..
        }
    ));
    let late = f
        .answer(&decision.decision_id, json!({"option_id": "proceed"}))
        .await;
    assert_eq!(late["error"]["code"], "NOT_FOUND");
    assert_eq!(
        f.fleet.client.status("t3").await.unwrap().decision_outcome,
        Some(DecisionOutcome::Expired)
    );
}

#[tokio::test]
async fn cancelling_a_request_that_waits_on_a_decision_expires_the_decision() {
    let mut f = fleet(DEPLOY, |_| {}).await;
    let first = f.run(guarded("w1", "to production")).await;
    let decision = decision_of(&first, SignalType::DecisionRequest, "CHECKPOINT");
    assert_eq!(
        f.fleet.client.status("w1").await.unwrap().decision_outcome,
        Some(DecisionOutcome::Pending)
    );
    let cancelled = f.fleet.client.cancel("w1").await.unwrap();
    assert_eq!(cancelled.state, RequestState::Cancelled);
    assert_eq!(
        cancelled.decision_id.as_deref(),
        Some(decision.decision_id.as_str())
    );
    let expired = f.signal("outcome.DECISION_EXPIRED").await;
    assert!(
        expired["meta"]["expired_because"]
            .as_str()
            .unwrap()
            .contains("cancelled"),
        "{expired}"
    );
    let late = f
        .answer(&decision.decision_id, json!({"option_id": "proceed"}))
        .await;
    assert_eq!(late["error"]["code"], "NOT_FOUND");
    let again = f.fleet.client.cancel("w1").await.unwrap_err();
    assert_eq!(again.code(), Some(ErrorCode::AlreadyFinished));
}

#[tokio::test]
async fn submit_follow_waits_for_the_answer_and_follows_the_continuation() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let f = fleet(DEPLOY, |_| {}).await;
    let nats_url = f.fleet.nats.url();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["submit", "--follow", "--file", "-", "--wait-secs", "30"])
        .env("GENFLEET__NATS__URL", &nats_url)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let request = serde_json::to_vec(&guarded("cli1", "Deploy to production.")).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&request).await.unwrap();
    drop(stdin);
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let decision_id = wait::within(
        "the CLI shows the decision it waits for",
        Duration::from_secs(15),
        async {
            while let Some(line) = stderr.next_line().await.unwrap() {
                if let Some(rest) = line.strip_prefix("decision ") {
                    return rest.split_whitespace().next().unwrap().to_string();
                }
            }
            panic!("the CLI ended without showing the decision");
        },
    )
    .await;
    let decide = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["decide", &decision_id, "proceed", "--guidance", "go slowly"])
        .env("GENFLEET__NATS__URL", &nats_url)
        .output()
        .await
        .unwrap();
    assert!(decide.status.success(), "{decide:?}");
    let said = String::from_utf8_lossy(&decide.stdout);
    assert!(
        said.starts_with(&format!(
            "decision {decision_id} answered: the job continues as request "
        )),
        "{said}"
    );
    let output = wait::within(
        "the CLI to end once answered",
        Duration::from_secs(20),
        child.wait_with_output(),
    )
    .await
    .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("deployed: Guidance from the manager: go slowly"),
        "{stdout}"
    );
}

/// The text of each part of a followed chain, and how the chain went: one entry per part
/// (its joined text and its result), with the continuations between them.
async fn walk(follow: &mut genfleet::client::Follow) -> Vec<(String, GenerationResult)> {
    use genfleet::client::Step;
    let mut parts = Vec::new();
    let mut text = String::new();
    let mut continued_to = None;
    wait::within(
        "the followed chain to end",
        Duration::from_secs(20),
        async {
            while let Some(step) = follow.next().await {
                match step {
                    Step::Text(piece) => text.push_str(&piece),
                    Step::Ended(result) => {
                        if let Some(next) = continued_to.take() {
                            assert_eq!(
                                result.request_id, next,
                                "a part's result follows its start"
                            );
                        }
                        parts.push((std::mem::take(&mut text), *result));
                    }
                    Step::Continued { request_id } => {
                        assert!(!parts.is_empty(), "a continuation comes after a part ended");
                        assert!(
                            text.is_empty(),
                            "no text between a part's end and its continuation"
                        );
                        continued_to = Some(request_id);
                    }
                    Step::Lost(lost) => panic!("the chain was lost: {lost:?}"),
                    Step::ChainEnded { outcome } => panic!("the chain ended {outcome:?}"),
                    _ => {}
                }
            }
        },
    )
    .await;
    parts
}

/// Requests followed on one subscription, as a batch's lines are: each follower gets its own
/// request's text, whole and once, even one that read nothing until its request ended with
/// more events than a follower holds (the rest comes from its stored result), and one that
/// takes only what ends a part (all of it from its result).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_on_one_fanout_each_get_their_own_text_whole_and_once() {
    let words: Vec<String> = (0..genfleet::client::fanout::EVENTS_HELD + 44)
        .map(|n| format!("w{n}"))
        .collect();
    let script = format!(
        "[[rules]]\nreply = \"{{{{last_user}}}} {}\"\n",
        words.join(" ")
    );
    // Every word its own event.
    let f = fleet(&script, |s| s.generation.delta_coalesce_bytes = 1).await;
    let client = &f.fleet.client;
    let fanout = client.event_fanout().await.unwrap();
    let ids = ["fan1", "fan2", "fan3"];
    // The last one takes only what ends a part, as a batch's lines do.
    let mut follows: Vec<_> = ids
        .iter()
        .map(|id| {
            let events = match *id {
                "fan3" => fanout.follow_ends(id),
                _ => fanout.follow(id),
            };
            client.follow_chain_on(id, false, events)
        })
        .collect();
    assert_eq!(fanout.followed(), ids.len());
    for id in ids {
        let request = fleet::request(id, &format!("say {id}"));
        client.enqueue("default", &request).await.unwrap();
    }
    // Nothing is read until every request ended: each follower falls behind its events.
    for id in ids {
        fleet::terminal(client, id, Duration::from_secs(30)).await;
    }
    for (id, follow) in ids.iter().zip(&mut follows) {
        let parts = walk(follow).await;
        assert_eq!(parts.len(), 1, "{id}: {parts:?}");
        let (text, result) = &parts[0];
        assert_eq!(result.request_id, *id);
        assert_eq!(result.state, RequestState::Completed, "{result:?}");
        assert_eq!(text, &result.output, "{id}: its text, whole and once");
        assert!(text.starts_with(&format!("say {id} w0 ")), "{text}");
    }
    drop(follows);
    assert_eq!(fanout.followed(), 0, "a dropped follower stops following");
    // A fan-out dropped ends the streams of the followers still holding one.
    let mut orphan = fanout.follow("never-sent");
    drop(fanout);
    let ended = wait::within(
        "an orphaned follower's stream to end",
        Duration::from_secs(20),
        futures_util::StreamExt::next(&mut orphan),
    )
    .await;
    assert!(ended.is_none(), "{ended:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn following_a_chain_gives_each_parts_text_once_through_its_decision_and_after_the_fact() {
    let mut f = fleet(DEPLOY, |_| {}).await;
    let client = &f.fleet.client;
    let mut follow = client.follow_chain("fc1", true).await.unwrap();
    client
        .submit("default", &guarded("fc1", "Deploy build 9 to production."))
        .await
        .unwrap();
    let answering = async {
        let published = f.signal("decision_request.CHECKPOINT").await;
        let decision_id = published["decision"]["decision_id"]
            .as_str()
            .unwrap()
            .to_string();
        let reply = f
            .answer(
                &decision_id,
                json!({"option_id": "proceed", "guidance": "carefully"}),
            )
            .await;
        assert_eq!(reply["outcome"], "continued", "{reply}");
    };
    let (parts, ()) = tokio::join!(walk(&mut follow), answering);
    assert_eq!(
        parts.len(),
        2,
        "the first request and its continuation: {parts:?}"
    );
    let (first_text, first) = &parts[0];
    assert_eq!(first.reason, Reason::DecisionRequested);
    assert_eq!(
        first_text, &first.output,
        "the first part's text, whole and once"
    );
    let (last_text, last) = &parts[1];
    assert_eq!(last.state, RequestState::Completed);
    assert_eq!(
        last_text, &last.output,
        "the continuation's text, whole and once"
    );
    assert!(last.output.contains("carefully"), "{}", last.output);

    // Followed after it ended, the same chain reads from what is stored: each part's text
    // from its result, once.
    let mut late = f.fleet.client.follow_chain("fc1", true).await.unwrap();
    let again = walk(&mut late).await;
    assert_eq!(again.len(), 2, "{again:?}");
    assert_eq!(again[0].0, first.output);
    assert_eq!(again[1].0, last.output);
    assert_eq!(again[1].1.request_id, last.request_id);
}

/// A follower that hears nothing asks the status after a second of silence, and each time a
/// read finds nothing new twice as long after the last: a request that runs without a word to
/// a follower of its ends only (as a batch's lines are followed), and a chain whose decision
/// waits for a person, are each asked a few times in their first seconds, not every second.
/// (A busy machine only makes the asks later, so fewer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_hears_nothing_asks_less_and_less_often() {
    let script = r#"
[[rules]]
when_last_user_contains = "quietly"
reply = "done at last"
first_token_delay_ms = 60000

[[rules]]
reply = "deployed: {{last_user}}"
"#;
    let f = fleet(script, |_| {}).await;
    let client = &f.fleet.client;
    let nats = client.nats();
    let mut asks_quiet = nats.subscribe("gen.status.quiet1").await.unwrap();
    let mut asks_pending = nats.subscribe("gen.status.pending1").await.unwrap();
    nats.flush().await.unwrap();
    let fanout = client.event_fanout().await.unwrap();
    let mut quiet = client.follow_chain_on("quiet1", false, fanout.follow_ends("quiet1"));
    let mut pending = client.follow_chain("pending1", true).await.unwrap();
    client
        .enqueue("default", &fleet::request("quiet1", "Work quietly."))
        .await
        .unwrap();
    client
        .submit(
            "default",
            &guarded("pending1", "Deploy build 11 to production."),
        )
        .await
        .unwrap();
    // The chain's first part ends asking for a decision nobody answers.
    let ended = wait::within(
        "the first part to end asking for a decision",
        Duration::from_secs(15),
        async {
            loop {
                match pending.next().await {
                    Some(genfleet::client::follow::Step::Ended(result)) => return result,
                    Some(_) => {}
                    None => panic!("the chain ended"),
                }
            }
        },
    )
    .await;
    assert_eq!(ended.reason, Reason::DecisionRequested, "{ended:?}");
    // Both followed for 7.5 s from here. The quiet one is read at once (its timer ran out
    // while nobody followed), at 1 s (it started: its only step) and then at 3 and 7 s at most
    // (8 reads in all before, one every second); the decision at 1, 3 and 7 s (7 before).
    let until = tokio::time::Instant::now() + Duration::from_millis(7_500);
    async fn steps(
        follow: &mut genfleet::client::follow::Follow,
        until: tokio::time::Instant,
    ) -> Vec<Option<genfleet::client::follow::Step>> {
        let mut steps = Vec::new();
        while let Ok(step) = tokio::time::timeout_at(until, follow.next()).await {
            steps.push(step);
        }
        steps
    }
    let (quiet_steps, pending_steps) =
        tokio::join!(steps(&mut quiet, until), steps(&mut pending, until));
    assert_eq!(
        quiet_steps,
        [Some(genfleet::client::follow::Step::Started {
            request_id: "quiet1".into()
        })]
    );
    assert_eq!(pending_steps, []);
    let count = |sub: &mut async_nats::Subscriber| {
        let mut asks = 0;
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        while let std::task::Poll::Ready(Some(_)) =
            futures_util::StreamExt::poll_next_unpin(sub, &mut cx)
        {
            asks += 1;
        }
        asks
    };
    let (quiet_asks, pending_asks) = (count(&mut asks_quiet), count(&mut asks_pending));
    assert!(
        (1..=4).contains(&quiet_asks),
        "the quiet request was asked {quiet_asks} times"
    );
    assert!(
        (1..=3).contains(&pending_asks),
        "the pending decision was asked {pending_asks} times"
    );
    client.cancel("quiet1").await.unwrap();
}
