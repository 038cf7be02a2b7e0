//! `genfleet manager` on a real nats-server, with a worker on the mock backend whose model asks
//! for a decision: rules, races between managers, restarts, waiting rules, the higher-level
//! model and the console.

mod common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use common::fleet::{self, Fleet};
use common::wait;
use futures_util::StreamExt;
use genfleet::bus::decisions::{DecisionAnswer, DecisionRecord};
use genfleet::llm::mock::{MockServer, Script};
use genfleet::manager::{LlmPicker, Manager, ManagerError, ManagerOptions, MemorySink, Policy};
use genfleet::protocol::{DecisionBlock, GenerationRequest, GenerationResult, Reason, Signal};
use genfleet::settings::Settings;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

/// How long any awaited condition may take before the test fails.
const WAIT: Duration = Duration::from_secs(15);

/// The model asks which path to take; a continuation (which carries the choice) proceeds.
const DECIDE: &str = r#"
[[rules]]
when_last_user_contains = "Decision chosen"
reply = "Proceeding: {{last_user}}"
[[rules]]
reply = "Two ways to go."
tool_calls = [{ name = "request_decision", arguments = { question = "Which path?", options = [{ id = "fast", label = "Fast", pros = "quick" }, { id = "safe", label = "Safe", cons = "slow" }], default_option = "safe", context = "a migration" } }]
"#;

async fn fleet(script: &str) -> Fleet {
    Fleet::builder()
        .script(script)
        .slots(2)
        .settings(|s| s.manager.ack_wait_ms = 2000)
        .start()
        .await
}

impl Fleet {
    /// Runs a request whose model asks for a decision; returns the decision.
    async fn raise(&self, id: &str, job: &str) -> DecisionBlock {
        let mut request = GenerationRequest::user("Plan the migration.");
        request.request_id = Some(id.into());
        request.job_name = Some(job.into());
        request
            .metadata
            .insert("tenant".into(), serde_json::json!("acme"));
        let result = self.client.run("default", request, WAIT).await.unwrap();
        assert_eq!(result.reason, Reason::DecisionRequested, "{result:?}");
        result.signals[0].decision.clone().unwrap()
    }

    async fn record(&self, decision_id: &str) -> DecisionRecord {
        let js = jetstream::new(self.client.nats().clone());
        let bucket = js.get_key_value("GENFLEET_DECISIONS").await.unwrap();
        let entry = bucket.get(decision_id).await.unwrap().unwrap();
        serde_json::from_slice(&entry).unwrap()
    }

    /// The `outcome.DECIDED` signals about one decision, read from the signals stream.
    async fn decided(&self, decision_id: &str) -> Vec<Signal> {
        let js = jetstream::new(self.client.nats().clone());
        let stream = js.get_stream("GENFLEET_SIGNALS").await.unwrap();
        let reader: consumer::PullConsumer = stream
            .create_consumer(consumer::pull::Config {
                filter_subject: "signals.outcome.DECIDED".into(),
                deliver_policy: consumer::DeliverPolicy::All,
                ack_policy: consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut batch = reader.fetch().max_messages(1000).messages().await.unwrap();
        let mut found = Vec::new();
        while let Some(message) = batch.next().await {
            let signal: Signal = serde_json::from_slice(&message.unwrap().payload).unwrap();
            if signal.meta["decision_id"] == decision_id {
                found.push(signal);
            }
        }
        found
    }

    async fn wait_terminal(&self, id: &str) -> GenerationResult {
        fleet::wait_result(&self.client, id, WAIT, fleet::RUNNING_OR_UNCLAIMED).await
    }
}

/// A manager running in this process, its log kept in memory.
struct Running {
    log: MemorySink,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), ManagerError>>,
}

async fn manager(settings: &Settings, options: ManagerOptions) -> Running {
    let log = MemorySink::default();
    let started = Manager::start(settings, options, Arc::new(log.clone()))
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(started.run(async {
        let _ = stopped.await;
    }));
    Running {
        log,
        stop: Some(stop),
        task,
    }
}

fn rules(text: &str) -> Policy {
    Policy::from_toml_str(text).unwrap()
}

impl Running {
    /// Waits for a log line that mentions `decision_id` and holds `needle`.
    async fn wait_line(&self, decision_id: &str, needle: &str) -> String {
        let what = format!("a line with {needle:?} about {decision_id}");
        wait::until(&what, WAIT, || async {
            let lines = self.log.lines();
            match lines
                .iter()
                .find(|l| l.contains(decision_id) && l.contains(needle))
            {
                Some(line) => Ok(line.clone()),
                None => Err(format!("the log:\n{}", lines.join("\n"))),
            }
        })
        .await
    }

    /// The action lines about one decision.
    fn actions(&self, decision_id: &str) -> Vec<String> {
        self.log
            .lines()
            .into_iter()
            .filter(|l| l.contains(" action ") && l.contains(&format!("decision={decision_id}")))
            .collect()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        wait::within("the manager stops", WAIT, self.task)
            .await
            .unwrap()
            .unwrap();
    }
}

#[tokio::test]
async fn a_rule_answers_a_model_decision_and_the_continuation_runs() {
    let f = fleet(DECIDE).await;
    let m = manager(
        &f.settings,
        ManagerOptions::new(
            "ops",
            rules(
                r#"
[[rule]]
job_name = "nightly-*"
action = "ignore"
[[rule]]
code = "NEEDS_MANAGER_DECISION"
job_name = "migrate-*"
metadata = { tenant = "acme" }
answer = "fast"
rationale = "the deadline"
"#,
            ),
        ),
    )
    .await;
    let decision = f.raise("orig", "migrate-db").await;
    let id = decision.decision_id.as_str();
    // The signal line shows the decision.
    let signal_line = m
        .wait_line(id, "decision_request.NEEDS_MANAGER_DECISION")
        .await;
    assert!(
        signal_line.contains("job=migrate-db request=orig")
            && signal_line.contains("options=[fast \"Fast\", safe \"Safe\"] default=safe"),
        "{signal_line}"
    );
    let line = m.wait_line(id, "action answered").await;
    assert!(
        line.contains("option=fast by=manager:ops: rule 2; continued as "),
        "{line}"
    );
    let record = f.record(id).await;
    let answer = record.answer.expect("answered");
    assert_eq!(
        (
            answer.choice.option_id.as_str(),
            answer.choice.decided_by.as_deref()
        ),
        ("fast", Some("manager:ops"))
    );
    let continuation = answer.continuation_request_id.unwrap();
    assert!(line.ends_with(&continuation), "{line}");
    let next = f.wait_terminal(&continuation).await;
    assert_eq!(next.reason, Reason::Stop, "{next:?}");
    assert_eq!(
        (next.parent_request_id.as_deref(), next.chain_position),
        (Some("orig"), 2)
    );
    assert!(
        next.output.contains("Decision chosen: Fast (fast)")
            && next.output.contains("the deadline"),
        "{}",
        next.output
    );
    // The outcome signal is logged too, and the decision was answered once.
    m.wait_line("", "outcome.DECIDED").await;
    assert_eq!(f.decided(id).await.len(), 1);
    assert_eq!(m.actions(id).len(), 1, "{:?}", m.actions(id));
    m.stop().await;
}

#[tokio::test]
async fn of_two_managers_racing_on_one_decision_exactly_one_answer_wins() {
    let f = fleet(DECIDE).await;
    let a = manager(
        &f.settings,
        ManagerOptions::new("a", rules("[[rule]]\nanswer = \"fast\"\n")),
    )
    .await;
    let b = manager(
        &f.settings,
        ManagerOptions::new("b", rules("[[rule]]\nanswer = \"safe\"\n")),
    )
    .await;
    let decision = f.raise("race", "race").await;
    let id = decision.decision_id.as_str();
    // Each manager sees the decision and does one thing about it.
    a.wait_line(id, " action ").await;
    b.wait_line(id, " action ").await;
    let (a_lines, b_lines) = (a.actions(id), b.actions(id));
    assert_eq!(
        (a_lines.len(), b_lines.len()),
        (1, 1),
        "{a_lines:?} {b_lines:?}"
    );
    let won = |lines: &[String]| lines[0].contains("action answered");
    let lost = |lines: &[String]| {
        lines[0].contains("ALREADY_DECIDED") || lines[0].contains("action already_answered")
    };
    let (winner, loser) = match (won(&a_lines), won(&b_lines)) {
        (true, false) => ("manager:a", &b_lines),
        (false, true) => ("manager:b", &a_lines),
        _ => panic!("exactly one answer wins: {a_lines:?} {b_lines:?}"),
    };
    assert!(lost(loser), "{loser:?}");
    let record = f.record(id).await;
    let answer = record.answer.unwrap();
    assert_eq!(answer.choice.decided_by.as_deref(), Some(winner));
    let decided = f.decided(id).await;
    assert_eq!(decided.len(), 1, "{decided:?}");
    assert_eq!(decided[0].meta["decided_by"], winner);
    let next = f
        .wait_terminal(answer.continuation_request_id.as_deref().unwrap())
        .await;
    assert_eq!(next.chain_position, 2);
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn a_restarted_manager_answers_only_what_came_while_it_was_down() {
    let f = fleet(DECIDE).await;
    let policy = "[[rule]]\nanswer = \"fast\"\n";
    let first = manager(&f.settings, ManagerOptions::new("r", rules(policy))).await;
    let d1 = f.raise("before", "job").await;
    first.wait_line(&d1.decision_id, "action answered").await;
    first.wait_line("", "outcome.DECIDED").await;
    let answered_first = f.record(&d1.decision_id).await.answer.unwrap();
    first.stop().await;
    // Everything it saw was acknowledged before it stopped.
    let js = jetstream::new(f.client.nats().clone());
    let mut consumer: consumer::PullConsumer = js
        .get_stream("GENFLEET_SIGNALS")
        .await
        .unwrap()
        .get_consumer("genfleet-manager-r")
        .await
        .unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(
        (
            info.num_ack_pending,
            info.num_pending,
            info.delivered.stream_sequence
        ),
        (0, 0, 2),
        "{info:?}"
    );

    let d2 = f.raise("while-down", "job").await;
    assert!(f.record(&d2.decision_id).await.answer.is_none());
    let again = manager(&f.settings, ManagerOptions::new("r", rules(policy))).await;
    let line = again.wait_line(&d2.decision_id, "action answered").await;
    assert!(line.contains("by=manager:r"), "{line}");
    assert!(
        again.actions(&d1.decision_id).is_empty(),
        "the first decision was handled before the restart: {:?}",
        again.actions(&d1.decision_id)
    );
    assert_eq!(
        f.record(&d1.decision_id).await.answer.unwrap(),
        answered_first
    );
    assert_eq!(f.decided(&d1.decision_id).await.len(), 1);
    assert_eq!(f.decided(&d2.decision_id).await.len(), 1);
    again.stop().await;

    // A manager of another name reads the whole stream: it finds both decisions answered in
    // their records and answers neither again.
    let late = manager(
        &f.settings,
        ManagerOptions::new("late", rules("[[rule]]\nanswer = \"safe\"\n")),
    )
    .await;
    for d in [&d1, &d2] {
        let line = late.wait_line(&d.decision_id, " action ").await;
        assert!(
            line.contains("action already_answered") && line.contains("by=manager:r"),
            "{line}"
        );
        assert_eq!(late.actions(&d.decision_id).len(), 1);
        assert_eq!(f.decided(&d.decision_id).await.len(), 1);
    }
    late.stop().await;
}

#[tokio::test]
async fn a_waiting_rule_answers_the_default_later_and_stands_down_for_a_human() {
    let f = fleet(DECIDE).await;
    let m = manager(
        &f.settings,
        ManagerOptions::new(
            "patient",
            rules("[[rule]]\nanswer = \"default\"\nafter_ms = 1500\nrationale = \"nobody objected\"\n"),
        ),
    )
    .await;
    // Nobody answers: the default, once the time is up.
    let d1 = f.raise("slow", "job").await;
    let waiting = m.wait_line(&d1.decision_id, "action waiting").await;
    assert!(
        waiting.contains("option=safe by=manager:patient"),
        "{waiting}"
    );
    assert!(
        f.record(&d1.decision_id).await.answer.is_none(),
        "not before the time"
    );
    m.wait_line(&d1.decision_id, "action answered").await;
    let record = f.record(&d1.decision_id).await;
    let answer = record.answer.unwrap();
    assert_eq!(
        (
            answer.choice.option_id.as_str(),
            answer.choice.decided_by.as_deref(),
            answer.choice.rationale.as_deref()
        ),
        ("safe", Some("manager:patient"), Some("nobody objected"))
    );
    let raised = humantime::parse_rfc3339_weak(&record.signal.ts).unwrap();
    let decided = humantime::parse_rfc3339_weak(&answer.decided_at).unwrap();
    assert!(
        decided.duration_since(raised).unwrap() >= Duration::from_millis(1500),
        "answered {:?} after the signal",
        decided.duration_since(raised)
    );

    // A human answers first: the rule stands down.
    let d2 = f.raise("human-first", "job").await;
    m.wait_line(&d2.decision_id, "action waiting").await;
    let reply = f
        .client
        .decide(
            &d2.decision_id,
            &DecisionAnswer {
                option_id: "fast".into(),
                rationale: None,
                decided_by: Some("human:test".into()),
                modified_prompt: None,
                guidance: None,
                confidence_boost: None,
            },
        )
        .await
        .unwrap();
    let line = m.wait_line(&d2.decision_id, "action stood_down").await;
    assert!(
        line.contains("answered meanwhile by human:test with fast"),
        "{line}"
    );
    let answer = f.record(&d2.decision_id).await.answer.unwrap();
    assert_eq!(answer.choice.decided_by.as_deref(), Some("human:test"));
    assert_eq!(
        answer.continuation_request_id,
        reply.continuation_request_id
    );
    assert_eq!(f.decided(&d2.decision_id).await.len(), 1);
    assert_eq!(
        m.actions(&d2.decision_id).len(),
        2,
        "waiting, then stood down"
    );
    m.stop().await;
}

#[tokio::test]
async fn the_model_picks_an_option_and_an_invalid_first_reply_is_asked_again() {
    let f = fleet(DECIDE).await;
    let boss = MockServer::start(
        Script::from_toml_str(
            r#"
model = "boss"
[[rules]]
when_last_user_contains = "could not be used"
reply = "Sorry. ```json\n{\"option_id\": \"fast\", \"rationale\": \"speed matters\"}\n```"
[[rules]]
reply = "I would say {\"option_id\": \"warp\", \"rationale\": \"fastest\"} of course."
"#,
        )
        .unwrap(),
    )
    .await
    .unwrap();
    let mut settings = f.settings.clone();
    settings.manager.llm_base_url = boss.base_url();
    settings.manager.llm_model = "boss".into();
    settings.manager.llm_api_key = "sk-manager-secret".into();
    let mut options = ManagerOptions::new("brain", Policy::empty());
    options.llm = Some(LlmPicker::from_settings(&settings).unwrap());
    let m = manager(&settings, options).await;
    let decision = f.raise("ask-boss", "job").await;
    let line = m.wait_line(&decision.decision_id, "action answered").await;
    assert!(
        line.contains("option=fast by=llm:boss: model boss, after 2 replies; continued as"),
        "{line}"
    );
    let answer = f.record(&decision.decision_id).await.answer.unwrap();
    assert_eq!(
        (
            answer.choice.option_id.as_str(),
            answer.choice.decided_by.as_deref(),
            answer.choice.rationale.as_deref()
        ),
        ("fast", Some("llm:boss"), Some("speed matters"))
    );
    let asked = boss.requests();
    assert_eq!(asked.len(), 2, "{asked:?}");
    let first = asked[0]["messages"].as_array().unwrap();
    assert!(
        first[0]["content"]
            .as_str()
            .unwrap()
            .contains("manager of a fleet")
    );
    let question = first[1]["content"].as_str().unwrap();
    for needle in [
        "Which path?",
        "1. fast: Fast",
        "pros: quick",
        "2. safe: Safe  [default]",
        "Context: a migration",
        "option_id",
    ] {
        assert!(question.contains(needle), "{needle:?} in {question}");
    }
    let second = asked[1]["messages"].as_array().unwrap();
    let correction = second.last().unwrap()["content"].as_str().unwrap();
    assert!(
        correction.contains("\"warp\" is not one of the option ids (fast, safe)"),
        "{correction}"
    );
    assert!(
        !m.log.lines().join("\n").contains("sk-manager-secret"),
        "the key is never logged"
    );
    m.stop().await;
}

/// Without guidance the model leaves out TOTAL, which the request's validation wants.
const SUMS: &str = r#"
[[rules]]
when_any_message_contains = "write TOTAL"
reply = "TOTAL 42"
[[rules]]
reply = "the sum is 42"
"#;

#[tokio::test]
async fn escalations_and_checkpoints_are_answered_from_their_own_options() {
    let f = fleet(SUMS).await;
    let m = manager(
        &f.settings,
        ManagerOptions::new(
            "fleet-ops",
            rules(
                r#"
[[rule]]
type = "escalation"
code = "LOW_CONFIDENCE"
kind = "escalation"
answer = "retry"
rationale = "worth one more go"
guidance = "Please write TOTAL before the number."
confidence_boost = 0.1
[[rule]]
kind = "checkpoint"
code = "CHECKPOINT"
answer = "proceed"
"#,
            ),
        ),
    )
    .await;
    let checked: GenerationRequest = serde_json::from_value(serde_json::json!({
        "request_id": "sums",
        "messages": [{"role": "user", "content": "Sum the numbers."}],
        "validation": [{"kind": "contains", "text": "TOTAL", "weight": 3.0}, {"kind": "max_chars", "max": 200}]
    }))
    .unwrap();
    let first = f.client.run("default", checked, WAIT).await.unwrap();
    let escalation = first
        .signals
        .iter()
        .find_map(|s| s.decision.clone().filter(|_| s.code == "LOW_CONFIDENCE"))
        .unwrap_or_else(|| panic!("an escalation: {first:?}"));
    let line = m
        .wait_line(&escalation.decision_id, "action answered")
        .await;
    assert!(line.contains("option=retry by=manager:fleet-ops"), "{line}");
    let answer = f.record(&escalation.decision_id).await.answer.unwrap();
    assert_eq!(
        (
            answer.choice.guidance.as_deref(),
            answer.choice.confidence_boost
        ),
        (Some("Please write TOTAL before the number."), Some(0.1))
    );
    let next = f
        .wait_terminal(answer.continuation_request_id.as_deref().unwrap())
        .await;
    assert_eq!(next.output, "TOTAL 42", "{next:?}");

    let guarded: GenerationRequest = serde_json::from_value(serde_json::json!({
        "request_id": "deploy",
        "messages": [{"role": "user", "content": "Deploy build 7 to production."}],
        "checkpoints": [{"name": "prod", "prompt_contains": ["production"], "requires_confirmation": true}]
    }))
    .unwrap();
    let first = f.client.run("default", guarded, WAIT).await.unwrap();
    let checkpoint = first
        .signals
        .iter()
        .find_map(|s| s.decision.clone().filter(|_| s.code == "CHECKPOINT"))
        .unwrap_or_else(|| panic!("a checkpoint: {first:?}"));
    let line = m
        .wait_line(&checkpoint.decision_id, "action answered")
        .await;
    assert!(
        line.contains("option=proceed by=manager:fleet-ops"),
        "{line}"
    );
    let answer = f.record(&checkpoint.decision_id).await.answer.unwrap();
    let next = f
        .wait_terminal(answer.continuation_request_id.as_deref().unwrap())
        .await;
    assert_eq!(
        next.reason,
        Reason::Stop,
        "the checkpoint does not fire again: {next:?}"
    );
    m.stop().await;
}

/// The binary's standard output, gathered line by line as it comes.
#[derive(Clone, Default)]
struct Output(Arc<Mutex<String>>);

impl Output {
    fn text(&self) -> String {
        self.0.lock().unwrap().clone()
    }

    async fn wait_for(&self, needle: &str) {
        wait::until(&format!("{needle:?} in the output"), WAIT, || async {
            let text = self.text();
            if text.contains(needle) {
                Ok(())
            } else {
                Err(format!("the output:\n{text}"))
            }
        })
        .await
    }
}

#[tokio::test]
async fn a_person_answers_at_the_console_and_sigterm_stops_the_manager() {
    let f = fleet(DECIDE).await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["manager", "--interactive", "--name", "console"])
        .env("GENFLEET__NATS__URL", f.nats.url())
        .env("USER", "tester")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let output = Output::default();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let gathered = output.clone();
    tokio::spawn(async move {
        let mut line = String::new();
        while stdout.read_line(&mut line).await.unwrap_or(0) > 0 {
            gathered.0.lock().unwrap().push_str(&line);
            line.clear();
        }
    });
    output
        .wait_for("manager: console following signals.>")
        .await;
    // The answer is typed ahead; the console reads it when it asks.
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"2\nsafer for prod\n").await.unwrap();
    stdin.flush().await.unwrap();
    let d1 = f.raise("typed", "job").await;
    let answer = wait::until_showing(
        "the typed answer to be recorded",
        WAIT,
        || async { f.record(&d1.decision_id).await.answer },
        || format!("the output:\n{}", output.text()),
    )
    .await;
    assert_eq!(
        (
            answer.choice.option_id.as_str(),
            answer.choice.decided_by.as_deref(),
            answer.choice.rationale.as_deref()
        ),
        ("safe", Some("human:tester"), Some("safer for prod"))
    );
    let next = f
        .wait_terminal(answer.continuation_request_id.as_deref().unwrap())
        .await;
    assert!(
        next.output.contains("Decision chosen: Safe (safe)"),
        "{}",
        next.output
    );
    output.wait_for("action answered").await;
    let text = output.text();
    let heading = format!("Decision {} (model decision", d1.decision_id);
    for needle in [
        heading.as_str(),
        "1. fast: Fast",
        "pros: quick",
        "2. safe: Safe  [default]",
        "Choose 1-2 or an option id (Enter: safe; s: leave it unanswered)",
        "option=safe by=human:tester: console; continued as",
    ] {
        assert!(text.contains(needle), "{needle:?} in:\n{text}");
    }

    // A second decision waits at the console; SIGTERM ends the manager all the same.
    let d2 = f.raise("waiting", "job").await;
    output
        .wait_for(&format!("Decision {} (model decision", d2.decision_id))
        .await;
    let pid = child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = wait::within("the manager exits on SIGTERM", WAIT, child.wait())
        .await
        .unwrap();
    let mut stderr = String::new();
    let _ = tokio::io::AsyncReadExt::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr)
        .await;
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(f.record(&d2.decision_id).await.answer.is_none());
    drop(stdin);
}

#[tokio::test]
async fn the_command_line_documents_its_flags_and_refuses_a_bad_policy_in_one_line() {
    let help = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["manager", "--help"])
        .output()
        .await
        .unwrap();
    assert!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--name",
        "--deliver",
        "--rules",
        "--interactive",
        "--llm",
        "--json",
        "--config",
    ] {
        assert!(help.contains(flag), "{flag} in:\n{help}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.toml");
    std::fs::write(&path, "[[rule]]\nanswer = \"a\"\n[[rule]]\nanswr = \"b\"\n").unwrap();
    let refused = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["manager", "--rules"])
        .arg(&path)
        .output()
        .await
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("rule 2") && stderr.contains("answr") && stderr.lines().count() == 1,
        "{stderr}"
    );
    let refused = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["manager", "--name", "a.b"])
        .output()
        .await
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("a.b"));
}
