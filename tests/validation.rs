//! Validation, confidence, the automatic retry, escalation and checkpoints, in the engine
//! alone (scripted backend, no broker).

mod common;

use common::{Harness, event_names, request, streamed_text};
use genfleet::engine::chain::PastAttempt;
use genfleet::engine::{ChainState, RequestContext};
use genfleet::protocol::{DecisionKind, Reason, RequestState, Signal, SignalType};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// The model answers without the word TOTAL, unless told what failed or guided.
const SCRIPT: &str = r#"
[[rules]]
when_last_user_contains = "did not pass the checks"
reply = "{{retry_reply}}"
[[rules]]
reply = "the sum is 42"
"#;

fn script(retry_reply: &str) -> String {
    SCRIPT.replace("{{retry_reply}}", retry_reply)
}

fn checked(threshold: Option<f64>) -> genfleet::protocol::GenerationRequest {
    let mut body = json!({
        "request_id": "v1",
        "messages": [{"role": "user", "content": "Sum the numbers."}],
        "validation": [
            {"kind": "contains", "text": "TOTAL", "weight": 3.0},
            {"kind": "max_chars", "max": 200}
        ]
    });
    if let Some(t) = threshold {
        body["escalation_threshold"] = json!(t);
    }
    request(body)
}

fn signals_of<'a>(signals: &'a [Signal], kind: SignalType, code: &str) -> Vec<&'a Signal> {
    signals
        .iter()
        .filter(|s| s.kind == kind && s.code == code)
        .collect()
}

#[tokio::test]
async fn output_that_passes_its_checks_completes_with_its_confidence() {
    let h = Harness::new("[[rules]]\nreply = \"TOTAL: 42\"\n").await;
    let (result, _) = h.run(checked(None)).await;
    assert_eq!(result.reason, Reason::Stop);
    let report = result.validation.expect("a validation report");
    assert_eq!((report.confidence, report.pass_rate), (1.0, 100.0));
    assert!(report.passed && !report.retried);
    assert_eq!(h.backend_requests().len(), 1);
}

#[tokio::test]
async fn the_first_attempt_retries_once_with_the_failed_checks_named() {
    let h = Harness::new(&script("TOTAL: 42")).await;
    let mut request = checked(None);
    // Both answers together are longer than this; the retry alone is not.
    request.validation = serde_json::from_value(json!([
        {"kind": "contains", "text": "TOTAL", "weight": 3.0},
        {"kind": "max_chars", "max": 20}
    ]))
    .unwrap();
    let (result, events) = h.run(request).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::Stop)
    );
    let report = result.validation.clone().unwrap();
    assert!(report.passed && report.retried);
    // The output is every turn: the first answer (streamed already) and the retry; the checks
    // judged the retry alone (its 9 chars, not the 24 of both).
    assert_eq!(result.output, "the sum is 42\n\nTOTAL: 42");
    assert_eq!(streamed_text(&events), result.output);
    let max_chars = report
        .checks
        .iter()
        .find(|c| c.kind == "max_chars")
        .unwrap();
    assert!(max_chars.passed);
    let asked = h.backend_requests();
    assert_eq!(asked.len(), 2);
    let note = asked[1]["messages"].as_array().unwrap().last().unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        note.contains("contains \"TOTAL\"") && note.contains("does not contain"),
        "{note}"
    );
    assert!(
        !note.contains("at most 200"),
        "only failed checks are named"
    );
    let retried = signals_of(&result.signals, SignalType::Issue, "LOW_CONFIDENCE");
    assert_eq!(retried.len(), 1);
    assert_eq!(retried[0].meta["confidence"], json!(0.25));
    assert!(event_names(&events).contains(&"signal"));
}

#[tokio::test]
async fn a_second_shortfall_escalates_with_the_full_context() {
    let h = Harness::new(&script("still 42")).await;
    let mut req = checked(None);
    req.job_name = Some("sums".into());
    let (result, _) = h.run(req).await;
    assert_eq!(
        (result.state, result.reason),
        (RequestState::Completed, Reason::DecisionRequested)
    );
    let escalations = signals_of(&result.signals, SignalType::Escalation, "LOW_CONFIDENCE");
    assert_eq!(escalations.len(), 1);
    let signal = escalations[0];
    let decision = signal.decision.as_ref().expect("a decision to answer");
    assert_eq!(decision.kind, DecisionKind::Escalation);
    let options: Vec<&str> = decision.options.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(options, ["retry", "skip", "abort", "modify_prompt"]);
    assert!(decision.expires_at.is_some());
    let meta = &signal.meta;
    assert_eq!(meta["confidence"], json!(0.25));
    assert_eq!(meta["threshold"], json!(0.6));
    assert_eq!(meta["pass_rate"], json!(50.0));
    assert_eq!(meta["chain_position"], json!(1));
    assert_eq!(meta["tries"], json!(2));
    assert_eq!(meta["checks"].as_array().unwrap().len(), 2);
    assert_eq!(meta["checks"][0]["passed"], json!(false));
    assert_eq!(meta["prompt"], json!("Sum the numbers."));
    assert_eq!(meta["output_summary"], json!("still 42"));
    assert_eq!(meta["suggestions"], json!([]));
    let history = meta["error_history"].as_array().unwrap();
    assert_eq!(history.len(), 2, "both tries of this request: {history:?}");
    assert_eq!(history[1]["try_in_request"], json!(2));
    assert_eq!(signal.job_name.as_deref(), Some("sums"));
    assert!(!result.validation.unwrap().passed);
}

#[tokio::test]
async fn without_auto_retry_or_later_in_a_chain_the_first_shortfall_escalates() {
    let h = Harness::with(&script("TOTAL"), |s| {
        s.escalation.auto_retry_on_first_failure = false
    })
    .await;
    let (result, _) = h.run(checked(None)).await;
    assert_eq!(result.reason, Reason::DecisionRequested);
    assert_eq!(h.backend_requests().len(), 1);

    let h = Harness::new(&script("TOTAL")).await;
    let (result, _) = h.run_at(checked(None), CancellationToken::new(), 2).await;
    assert_eq!(result.reason, Reason::DecisionRequested);
    assert_eq!(
        h.backend_requests().len(),
        1,
        "no retry past the first request"
    );
}

#[tokio::test]
async fn a_confidence_boost_lowers_the_threshold_of_the_next_attempt() {
    let h = Harness::new("[[rules]]\nreply = \"the sum is 42\"\n").await;
    let run = |boost: f64| {
        let mut context = RequestContext::new("v1", "worker-1", "default");
        context.chain_position = 2;
        context.chain = ChainState {
            confidence_boost: boost,
            ..Default::default()
        };
        h.run_in(checked(Some(0.5)), context, CancellationToken::new())
    };
    let (without, _) = run(0.0).await;
    assert_eq!(without.reason, Reason::DecisionRequested);
    let (with, _) = run(0.3).await;
    assert_eq!(with.reason, Reason::Stop);
    let report = with.validation.unwrap();
    assert_eq!((report.threshold, report.passed), (0.2, true));
}

#[tokio::test]
async fn the_error_history_carries_the_attempts_of_the_chain() {
    let h = Harness::new("[[rules]]\nreply = \"the sum is 42\"\n").await;
    let mut context = RequestContext::new("v3", "worker-1", "default");
    context.chain_position = 2;
    let mut chain = ChainState::default();
    chain.push_attempt(PastAttempt::new(
        1,
        1,
        Some(0.25),
        ["contains \"TOTAL\"".into()],
    ));
    chain.note_decision("retry by ops");
    context.chain = chain;
    let (result, _) = h
        .run_in(checked(None), context, CancellationToken::new())
        .await;
    let signal = signals_of(&result.signals, SignalType::Escalation, "LOW_CONFIDENCE")[0];
    let history = signal.meta["error_history"].as_array().unwrap();
    assert_eq!(history.len(), 2);
    assert_eq!(history[0]["decided"], json!("retry by ops"));
    assert_eq!(history[1]["chain_position"], json!(2));
}

#[tokio::test]
async fn at_the_chain_limit_an_escalation_fails_without_a_decision() {
    let h = Harness::new("[[rules]]\nreply = \"no\"\n").await;
    let (result, _) = h.run_at(checked(None), CancellationToken::new(), 5).await;
    assert_eq!(
        (result.reason, result.detail.as_deref()),
        (Reason::ToolExecutionError, Some("decision chain limit"))
    );
    let signal = signals_of(&result.signals, SignalType::Escalation, "LOW_CONFIDENCE")[0];
    assert!(signal.decision.is_none(), "nothing to answer");
}

#[tokio::test]
async fn failures_other_than_a_finished_answer_are_not_validated() {
    let h = Harness::new("[[rules]]\nstatus = 400\n").await;
    let (result, _) = h.run(checked(None)).await;
    assert_eq!(result.reason, Reason::BackendError);
    assert!(result.validation.is_none());
}

fn with_checkpoints(
    prompt: &str,
    checkpoints: serde_json::Value,
) -> genfleet::protocol::GenerationRequest {
    request(json!({
        "request_id": "c1",
        "system": "You operate the deploy pipeline.",
        "messages": [{"role": "user", "content": prompt}],
        "checkpoints": checkpoints,
    }))
}

#[tokio::test]
async fn a_checkpoint_that_needs_confirmation_stops_before_the_model_runs() {
    let h = Harness::new("[[rules]]\nreply = \"done\"\n").await;
    let checkpoints = json!([
        {"name": "never", "prompt_contains": ["nothing-like-this"]},
        {"name": "prod", "prompt_contains": ["staging", "PRODUCTION"], "message": "Deploy to production?"},
        {"name": "later", "prompt_contains": ["production"]}
    ]);
    let (result, events) = h
        .run(with_checkpoints("Ship it to Production now", checkpoints))
        .await;
    assert_eq!(result.reason, Reason::DecisionRequested);
    assert!(h.backend_requests().is_empty(), "the model never ran");
    assert_eq!(event_names(&events), ["started", "signal"]);
    let signal = signals_of(&result.signals, SignalType::DecisionRequest, "CHECKPOINT");
    assert_eq!(signal.len(), 1, "only the first matching checkpoint fires");
    let decision = signal[0].decision.as_ref().unwrap();
    assert_eq!(decision.kind, DecisionKind::Checkpoint);
    assert_eq!(decision.question, "Deploy to production?");
    let options: Vec<&str> = decision.options.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(options, ["proceed", "skip", "abort", "modify_prompt"]);
    assert_eq!(signal[0].meta["checkpoint"], json!("prod"));
    assert_eq!(signal[0].meta["matched"], json!(["PRODUCTION"]));
}

#[tokio::test]
async fn checkpoint_conditions_keywords_in_system_min_attempt_and_passed() {
    let h = Harness::new("[[rules]]\nreply = \"done\"\n").await;
    // A keyword in the caller's system prompt counts; min_attempt holds from that position.
    let checkpoints =
        json!([{"name": "pipeline", "prompt_contains": ["PIPELINE"], "min_attempt": 2}]);
    let (first, _) = h.run(with_checkpoints("hello", checkpoints.clone())).await;
    assert_eq!(
        first.reason,
        Reason::Stop,
        "min_attempt 2 does not hold at 1"
    );
    let (second, _) = h
        .run_at(
            with_checkpoints("hello", checkpoints.clone()),
            CancellationToken::new(),
            2,
        )
        .await;
    assert_eq!(second.reason, Reason::DecisionRequested);
    // Once confirmed in the chain, the same checkpoint does not fire again.
    let mut context = RequestContext::new("c1", "worker-1", "default");
    context.chain_position = 3;
    context.chain.checkpoints_passed = vec!["pipeline".into()];
    let (third, _) = h
        .run_in(
            with_checkpoints("hello", checkpoints),
            context,
            CancellationToken::new(),
        )
        .await;
    assert_eq!(third.reason, Reason::Stop);
    // No keywords: it holds for every prompt. Keywords that do not occur: it does not fire.
    let (always, _) = h.run(with_checkpoints("x", json!([{"name": "all"}]))).await;
    assert_eq!(always.reason, Reason::DecisionRequested);
    let (assistant_only, _) = h
        .run(request(json!({
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "PIPELINE"}],
            "checkpoints": [{"name": "p", "prompt_contains": ["pipeline"]}]
        })))
        .await;
    assert_eq!(
        assistant_only.reason,
        Reason::Stop,
        "only the caller system and user messages are searched"
    );
}

#[tokio::test]
async fn a_checkpoint_without_confirmation_only_signals_and_runs() {
    let h = Harness::new("[[rules]]\nreply = \"done\"\n").await;
    let (result, _) = h
        .run(with_checkpoints(
            "deploy",
            json!([{"name": "note", "prompt_contains": ["deploy"], "requires_confirmation": false}]),
        ))
        .await;
    assert_eq!(
        (result.reason, result.output.as_str()),
        (Reason::Stop, "done")
    );
    let issue = signals_of(&result.signals, SignalType::Issue, "CHECKPOINT");
    assert_eq!(issue.len(), 1);
    assert!(issue[0].decision.is_none());
}
