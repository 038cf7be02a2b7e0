//! The manager's loop: pull signals from the durable consumer, log each, and hand each decision
//! to a task that reads its record, decides (rules, console, model) and answers.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, AckKind, consumer, kv};
use futures_util::StreamExt;
use tokio::sync::{Mutex, OnceCell, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::console::{ConsoleHandle, ConsoleVerdict};
use super::llm_pick::{LlmPicker, Pick};
use super::log::{Action, ActionKind, Log, LogSink};
use super::rules::{AnswerSpec, Policy, Verdict};
use super::view::DecisionView;
use super::{Deliver, ManagerError, ManagerOptions};
use crate::client::streams::Stores;
use crate::client::{Client, ClientError};
use crate::protocol::DecisionOutcome;
use crate::protocol::decision::{Answer, DecisionRecord};
use crate::protocol::ids::is_valid_name;
use crate::protocol::{DecisionAnswer, ErrorCode, Signal};
use crate::settings::Settings;

/// Signals asked for per pull.
const PULL_BATCH: usize = 32;
/// How often a failed answer (fleet unreachable) is tried again on the spot.
const DECIDE_ATTEMPTS: u32 = 3;
/// When a signal whose answer could not be delivered comes back.
const RETRY_DELAY: Duration = Duration::from_secs(10);
/// When a signal whose record could not be read comes back.
const STORE_RETRY_DELAY: Duration = Duration::from_secs(5);
/// How long decisions in progress get to hand their signals back on shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Questions put to the higher-level model at once.
const MODEL_CALLS_AT_ONCE: usize = 4;

/// The durable consumer of the managers named `name`.
pub fn consumer_name(name: &str) -> String {
    format!("genfleet-manager-{name}")
}

/// A manager connected to the fleet, its consumer open.
pub struct Manager {
    shared: Arc<Shared>,
    consumer: consumer::PullConsumer,
    consumer_name: String,
    max_in_flight: usize,
}

struct Shared {
    /// `manager:<name>`, the `decided_by` of rule answers.
    rules_by: String,
    client: Client,
    jetstream: jetstream::Context,
    bucket_name: String,
    bucket: OnceCell<kv::Store>,
    log: Log,
    policy: Policy,
    console: Option<(ConsoleHandle, String)>,
    /// The console's turn: re-reading the record, asking and answering, one decision at a time.
    console_turn: Mutex<()>,
    llm: Option<LlmPicker>,
    model_calls: Semaphore,
    keep_alive_every: Duration,
}

/// What becomes of a signal once handled.
enum Disposition {
    Ack,
    /// Deliver it again after a while (the fleet or a store did not answer).
    Retry(Duration),
    /// Shutdown: hand it back at once.
    HandBack,
}

/// A decision's record as the manager needs it.
enum RecordState {
    Pending(Box<DecisionRecord>),
    Answered(Answer),
    Expired(String),
    Missing,
    Unreadable(String),
}

impl Manager {
    /// Connects, opens (or creates) the signals stream and the durable consumer.
    pub async fn start(
        settings: &Settings,
        options: ManagerOptions,
        sink: Arc<dyn LogSink>,
    ) -> Result<Manager, ManagerError> {
        settings
            .manager
            .validate()
            .map_err(|e| ManagerError::Invalid(e.to_string()))?;
        if !is_valid_name(&options.name) {
            return Err(ManagerError::Invalid(format!(
                "manager name {:?} must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'",
                options.name
            )));
        }
        let client = Client::connect(settings)
            .await
            .map_err(|e| ManagerError::Connect(e.to_string()))?;
        let jetstream = jetstream::new(client.nats().clone());
        let stream_name = &settings.jetstream.signals_stream;
        let stream = match jetstream.get_stream(stream_name).await {
            Ok(stream) => stream,
            Err(_) => {
                // No worker ran yet: create what a worker would, as it would.
                Stores::ensure(
                    jetstream.clone(),
                    &settings.jetstream,
                    &crate::client::subjects::Subjects::new(&settings.subjects),
                )
                .await
                .map_err(|e| ManagerError::Setup(e.to_string()))?;
                jetstream.get_stream(stream_name).await.map_err(|e| {
                    ManagerError::Setup(format!("cannot open stream {stream_name}: {e}"))
                })?
            }
        };
        let max_in_flight = settings.manager.max_in_flight;
        let ack_wait = Duration::from_millis(settings.manager.ack_wait_ms);
        let name = consumer_name(&options.name);
        let wanted = match options.deliver {
            Deliver::All => consumer::DeliverPolicy::All,
            Deliver::New => consumer::DeliverPolicy::New,
        };
        let (consumer, fresh) = match stream.get_consumer::<consumer::pull::Config>(&name).await {
            Ok(consumer) => (consumer, false),
            Err(_) => {
                let config = consumer::pull::Config {
                    durable_name: Some(name.clone()),
                    description: Some(format!("genfleet managers named {}", options.name)),
                    filter_subject: format!("{}.>", settings.subjects.signals_prefix),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait,
                    deliver_policy: wanted,
                    max_ack_pending: max_in_flight as i64,
                    ..Default::default()
                };
                let consumer = stream.create_consumer(config).await.map_err(|e| {
                    ManagerError::Setup(format!("cannot create consumer {name}: {e}"))
                })?;
                (consumer, true)
            }
        };
        let log = super::log::Log::new(sink, options.json);
        let mut note = format!(
            "{} following {}.> (stream {stream_name}, consumer {name}, {})",
            options.name,
            settings.subjects.signals_prefix,
            if fresh {
                format!(
                    "new, from {}",
                    match options.deliver {
                        Deliver::All => "the oldest signal",
                        Deliver::New => "now on",
                    }
                )
            } else {
                "resuming where it stopped".to_string()
            }
        );
        note.push_str(&format!(
            "; rules: {}; console: {}; model: {}",
            options.policy.rules().len(),
            if options.console.is_some() {
                "on"
            } else {
                "off"
            },
            options.llm.as_ref().map_or("off", |l| l.model())
        ));
        log.note(&note);
        let shared = Shared {
            rules_by: format!("manager:{}", options.name),
            client,
            jetstream,
            bucket_name: settings.decisions.bucket.clone(),
            bucket: OnceCell::new(),
            log,
            policy: options.policy,
            console: options.console,
            console_turn: Mutex::new(()),
            llm: options.llm,
            model_calls: Semaphore::new(MODEL_CALLS_AT_ONCE),
            keep_alive_every: (ack_wait / 3).max(Duration::from_millis(100)),
        };
        Ok(Manager {
            shared: Arc::new(shared),
            consumer,
            consumer_name: name,
            max_in_flight,
        })
    }

    pub fn consumer_name(&self) -> &str {
        &self.consumer_name
    }

    /// Handles signals until `shutdown` resolves. Decisions still in progress then are handed
    /// back to the next manager of the same name.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ManagerError> {
        let shared = self.shared;
        let cancel = CancellationToken::new();
        let permits = Arc::new(Semaphore::new(self.max_in_flight));
        let mut tasks = JoinSet::new();
        let mut messages = None;
        tokio::pin!(shutdown);
        loop {
            while tasks.try_join_next().is_some() {}
            if messages.is_none() {
                let opened = self
                    .consumer
                    .stream()
                    .max_messages_per_batch(PULL_BATCH.min(self.max_in_flight))
                    .messages()
                    .await;
                match opened {
                    Ok(stream) => messages = Some(stream),
                    Err(error) => {
                        tracing::warn!(message = "cannot pull signals; retrying", %error);
                        tokio::select! {
                            _ = &mut shutdown => break,
                            _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        }
                    }
                }
            }
            let stream = messages.as_mut().expect("opened above");
            let next = tokio::select! {
                _ = &mut shutdown => break,
                next = stream.next() => next,
            };
            let message = match next {
                Some(Ok(message)) => message,
                Some(Err(error)) => {
                    tracing::warn!(message = "pulling signals failed; going on", %error);
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(Duration::from_millis(250)) => continue,
                    }
                }
                None => {
                    messages = None;
                    continue;
                }
            };
            let signal: Signal = match serde_json::from_slice(&message.payload) {
                Ok(signal) => signal,
                Err(error) => {
                    shared.log.action(Action::new(
                        ActionKind::Unreadable,
                        format!("{}: not a signal: {error}", message.subject),
                    ));
                    ack(&message).await;
                    continue;
                }
            };
            shared.log.signal(&signal);
            if signal.decision.is_none() {
                ack(&message).await;
                continue;
            }
            let permit = tokio::select! {
                _ = &mut shutdown => {
                    let _ = message.ack_with(AckKind::Nak(None)).await;
                    break;
                }
                permit = permits.clone().acquire_owned() => permit.expect("never closed"),
            };
            let shared = shared.clone();
            let cancel = cancel.clone();
            tasks.spawn(async move {
                let _permit = permit;
                shared.handle(message, signal, cancel).await;
            });
        }
        cancel.cancel();
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tasks.abort_all();
        }
        shared.log.note("stopped");
        Ok(())
    }
}

async fn ack(message: &jetstream::Message) {
    // Confirmed by the server, so a manager stopped right after never sees it again.
    if let Err(error) = message.double_ack().await {
        tracing::warn!(message = "cannot acknowledge a signal; it will come again", %error);
    }
}

/// Runs `work`, telling the server every `every` that the message is still being handled.
async fn keep_alive<F: Future>(
    message: &jetstream::Message,
    every: Duration,
    work: F,
) -> F::Output {
    tokio::pin!(work);
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = ticker.tick() => {
                let _ = message.ack_with(AckKind::Progress).await;
            }
        }
    }
}

impl Shared {
    async fn handle(&self, message: jetstream::Message, signal: Signal, cancel: CancellationToken) {
        let work = keep_alive(&message, self.keep_alive_every, self.decide(&signal));
        let disposition = tokio::select! {
            disposition = work => disposition,
            _ = cancel.cancelled() => Disposition::HandBack,
        };
        match disposition {
            Disposition::Ack => ack(&message).await,
            Disposition::Retry(delay) => {
                let _ = message.ack_with(AckKind::Nak(Some(delay))).await;
            }
            Disposition::HandBack => {
                let _ = message.ack_with(AckKind::Nak(None)).await;
            }
        }
    }

    async fn decide(&self, signal: &Signal) -> Disposition {
        let decision = signal.decision.as_ref().expect("only decisions come here");
        let record = match self.pending_record(signal, &decision.decision_id).await {
            Ok(record) => record,
            Err(disposition) => return disposition,
        };
        match self
            .policy
            .evaluate(signal, decision, &record.request.metadata)
        {
            Verdict::Ignore { rule } => {
                self.log.action(Action::about(
                    signal,
                    ActionKind::Ignored,
                    format!("rule {rule}: ignore"),
                ));
                return Disposition::Ack;
            }
            Verdict::Answer {
                rule,
                option_id,
                spec,
            } => return self.by_rule(signal, rule, option_id, spec.clone()).await,
            Verdict::InvalidOption {
                rule,
                option_id,
                valid,
            } => {
                self.log.action(
                    Action::about(
                        signal,
                        ActionKind::InvalidAnswer,
                        format!(
                            "rule {rule} answers {option_id:?}, which is not an option of this decision ({}); trying the next mode",
                            valid.join(", ")
                        ),
                    )
                    .option(option_id),
                );
            }
            Verdict::NoMatch => {}
        }
        if let Some((console, human)) = &self.console {
            return self.by_console(signal, console, human).await;
        }
        if let Some(llm) = &self.llm {
            let view = DecisionView::new(signal, Some(&record)).expect("a decision");
            return self.by_model(signal, llm, &view).await;
        }
        self.log.action(Action::about(
            signal,
            ActionKind::Left,
            "no rule matched; left for another manager",
        ));
        Disposition::Ack
    }

    async fn by_rule(
        &self,
        signal: &Signal,
        rule: usize,
        option_id: String,
        spec: AnswerSpec,
    ) -> Disposition {
        let decision_id = &signal.decision.as_ref().expect("a decision").decision_id;
        if let Some(after_ms) = spec.after_ms {
            // Counted from when the signal was raised, so a manager that comes late (or
            // restarts) does not wait all over again.
            let raised =
                humantime::parse_rfc3339_weak(&signal.ts).unwrap_or_else(|_| SystemTime::now());
            let due = raised + Duration::from_millis(after_ms);
            let wait = due.duration_since(SystemTime::now()).unwrap_or_default();
            if !wait.is_zero() {
                self.log.action(
                    Action::about(
                        signal,
                        ActionKind::Waiting,
                        format!(
                            "rule {rule} answers in {} ms unless someone answers first",
                            wait.as_millis()
                        ),
                    )
                    .option(&option_id)
                    .by(&self.rules_by),
                );
                tokio::time::sleep(wait).await;
                match self.record_state(decision_id).await {
                    Ok(RecordState::Pending(_)) => {}
                    Ok(state) => {
                        let detail = match &state {
                            RecordState::Answered(answer) => format!(
                                "rule {rule}: answered meanwhile by {} with {}",
                                answer.choice.decided_by.as_deref().unwrap_or("someone"),
                                answer.choice.option_id
                            ),
                            RecordState::Expired(why) => format!("rule {rule}: {why}"),
                            RecordState::Missing => {
                                format!("rule {rule}: the decision's record is gone")
                            }
                            RecordState::Unreadable(why) => format!("rule {rule}: {why}"),
                            RecordState::Pending(_) => unreachable!("matched above"),
                        };
                        self.log
                            .action(Action::about(signal, ActionKind::StoodDown, detail));
                        return Disposition::Ack;
                    }
                    Err(error) => return self.retry_later(signal, &error),
                }
            }
        }
        let answer = DecisionAnswer {
            option_id,
            rationale: spec.rationale,
            decided_by: Some(self.rules_by.clone()),
            modified_prompt: spec.modified_prompt,
            guidance: spec.guidance,
            confidence_boost: spec.confidence_boost,
        };
        self.send(signal, answer, &format!("rule {rule}")).await
    }

    async fn by_console(
        &self,
        signal: &Signal,
        console: &ConsoleHandle,
        human: &str,
    ) -> Disposition {
        let _turn = self.console_turn.lock().await;
        // Someone may have answered while earlier decisions had the console.
        let decision_id = &signal.decision.as_ref().expect("a decision").decision_id;
        let record = match self.pending_record(signal, decision_id).await {
            Ok(record) => record,
            Err(disposition) => return disposition,
        };
        let view = DecisionView::new(signal, Some(&record)).expect("a decision");
        match console.ask(view).await {
            ConsoleVerdict::Answer(answer) => {
                let answer = DecisionAnswer {
                    decided_by: Some(human.to_string()),
                    ..answer
                };
                self.send(signal, answer, "console").await
            }
            ConsoleVerdict::Skip => {
                self.log.action(Action::about(
                    signal,
                    ActionKind::Left,
                    "left unanswered at the console",
                ));
                Disposition::Ack
            }
            ConsoleVerdict::Closed(reason) => {
                self.log.action(Action::about(
                    signal,
                    ActionKind::Left,
                    format!("the console is closed ({reason}); left for another manager"),
                ));
                Disposition::Ack
            }
        }
    }

    async fn by_model(&self, signal: &Signal, llm: &LlmPicker, view: &DecisionView) -> Disposition {
        let _call = self.model_calls.acquire().await.expect("never closed");
        let decided_by = llm.decided_by();
        match llm.pick(view).await {
            Pick::Chosen { answer, attempts } => {
                let answer = DecisionAnswer {
                    decided_by: Some(decided_by),
                    ..answer
                };
                let how = if attempts == 1 {
                    format!("model {}", llm.model())
                } else {
                    format!("model {}, after {attempts} replies", llm.model())
                };
                self.send(signal, answer, &how).await
            }
            Pick::Fallback { option_id, errors } => {
                self.log.action(
                    Action::about(
                        signal,
                        ActionKind::ModelFailed,
                        format!(
                            "model {} gave no usable answer ({}); answering the default",
                            llm.model(),
                            errors.join("; ")
                        ),
                    )
                    .option(&option_id),
                );
                let answer = DecisionAnswer {
                    rationale: Some(
                        "The manager's model gave no usable answer; the default option was taken."
                            .into(),
                    ),
                    decided_by: Some(decided_by),
                    ..DecisionAnswer::option(option_id)
                };
                self.send(signal, answer, "default after unusable model replies")
                    .await
            }
            Pick::Failed { reason } => {
                self.log.action(Action::about(
                    signal,
                    ActionKind::ModelFailed,
                    format!("model {}: {reason}; left unanswered", llm.model()),
                ));
                Disposition::Ack
            }
        }
    }

    /// Answers on `decisions.<decision_id>` and logs what came of it.
    async fn send(&self, signal: &Signal, answer: DecisionAnswer, how: &str) -> Disposition {
        let decision_id = &signal.decision.as_ref().expect("a decision").decision_id;
        let decided_by = answer.decided_by.clone().unwrap_or_default();
        // What came of this answer, in the log under its option and who gave it.
        let answered = |kind: ActionKind, detail: String| {
            Action::about(signal, kind, detail)
                .option(&answer.option_id)
                .by(&decided_by)
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            let failure = match self.client.decide(decision_id, &answer).await {
                Ok(reply) => {
                    // The same option answered first by someone else is a success too: the
                    // record says whose answer it was.
                    if let Ok(RecordState::Answered(winner)) = self.record_state(decision_id).await
                        && winner.choice.decided_by.as_deref() != Some(decided_by.as_str())
                    {
                        self.log.action(
                            Action::about(
                                signal,
                                ActionKind::AlreadyAnswered,
                                format!(
                                    "{how}: {} answered the same option first",
                                    winner.choice.decided_by.as_deref().unwrap_or("someone")
                                ),
                            )
                            .option(&answer.option_id)
                            .by(winner.choice.decided_by.unwrap_or_default()),
                        );
                        return Disposition::Ack;
                    }
                    let result = match (reply.outcome, &reply.continuation_request_id) {
                        (DecisionOutcome::Continued, Some(id)) => format!("continued as {id}"),
                        (outcome, _) => outcome.as_str().to_string(),
                    };
                    self.log
                        .action(answered(ActionKind::Answered, format!("{how}; {result}")));
                    return Disposition::Ack;
                }
                Err(ClientError::Wire(error)) => match error.code {
                    ErrorCode::AlreadyDecided => {
                        let detail = &error.detail;
                        let winner = detail["decided_by"].as_str().unwrap_or("someone");
                        let option = detail["option_id"].as_str().unwrap_or("?");
                        self.log.action(answered(
                            ActionKind::AlreadyDecided,
                            format!("ALREADY_DECIDED: {how} came second; {winner} answered {option} first"),
                        ));
                        return Disposition::Ack;
                    }
                    ErrorCode::NotFound => {
                        self.log.action(answered(
                            ActionKind::Expired,
                            format!("NOT_FOUND: {} (expired or unknown)", error.message),
                        ));
                        return Disposition::Ack;
                    }
                    // The fleet's own trouble is worth another try.
                    ErrorCode::NoSlotAvailable | ErrorCode::Internal => error.to_string(),
                    _ => {
                        self.log.action(answered(
                            ActionKind::Refused,
                            format!("{how}: the fleet refused the answer: {error}"),
                        ));
                        return Disposition::Ack;
                    }
                },
                Err(error) => error.to_string(),
            };
            if attempt < DECIDE_ATTEMPTS {
                tokio::time::sleep(Duration::from_millis(500) * attempt).await;
                continue;
            }
            self.log.action(answered(
                ActionKind::RetryLater,
                format!(
                    "{how}: cannot deliver the answer ({failure}); the signal comes back in {} s",
                    RETRY_DELAY.as_secs()
                ),
            ));
            return Disposition::Retry(RETRY_DELAY);
        }
    }

    /// The decision's record while it still waits for an answer; otherwise what becomes of the
    /// signal, logged: acknowledged when the decision has ended, retried when the store did not
    /// answer.
    async fn pending_record(
        &self,
        signal: &Signal,
        decision_id: &str,
    ) -> Result<Box<DecisionRecord>, Disposition> {
        match self.record_state(decision_id).await {
            Ok(RecordState::Pending(record)) => Ok(record),
            Ok(state) => {
                self.log_not_pending(signal, state);
                Err(Disposition::Ack)
            }
            Err(error) => Err(self.retry_later(signal, &error)),
        }
    }

    /// The record could not be read: logged, and the signal comes back later.
    fn retry_later(&self, signal: &Signal, error: &str) -> Disposition {
        self.log.action(Action::about(
            signal,
            ActionKind::RetryLater,
            format!("cannot read the decision record: {error}"),
        ));
        Disposition::Retry(STORE_RETRY_DELAY)
    }

    fn log_not_pending(&self, signal: &Signal, state: RecordState) {
        let action = match state {
            RecordState::Answered(answer) => {
                let by = answer
                    .choice
                    .decided_by
                    .clone()
                    .unwrap_or_else(|| "someone".into());
                Action::about(
                    signal,
                    ActionKind::AlreadyAnswered,
                    format!(
                        "already answered by {by} with {} at {}; not answered again",
                        answer.choice.option_id, answer.decided_at
                    ),
                )
                .option(answer.choice.option_id)
                .by(by)
            }
            RecordState::Expired(why) => {
                Action::about(signal, ActionKind::Expired, format!("{why}; not answered"))
            }
            RecordState::Missing => Action::about(
                signal,
                ActionKind::Expired,
                "no record of this decision (expired or unknown); not answered",
            ),
            RecordState::Unreadable(why) => Action::about(
                signal,
                ActionKind::Unreadable,
                format!("{why}; not answered"),
            ),
            RecordState::Pending(_) => return,
        };
        self.log.action(action);
    }

    async fn bucket(&self) -> Result<&kv::Store, String> {
        self.bucket
            .get_or_try_init(|| async {
                self.jetstream
                    .get_key_value(&self.bucket_name)
                    .await
                    .map_err(|e| format!("cannot open bucket {}: {e}", self.bucket_name))
            })
            .await
    }

    /// The decision's record: pending, answered, expired or gone. `Err` when the store did
    /// not answer.
    async fn record_state(&self, decision_id: &str) -> Result<RecordState, String> {
        let bucket = self.bucket().await?;
        let entry = bucket
            .entry(decision_id)
            .await
            .map_err(|e| format!("bucket {}: {e}", self.bucket_name))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(RecordState::Missing);
        };
        let record: DecisionRecord = match serde_json::from_slice(&entry.value) {
            Ok(record) => record,
            Err(error) => {
                return Ok(RecordState::Unreadable(format!(
                    "unreadable decision record: {error}"
                )));
            }
        };
        if !record.is_pending() {
            return Ok(match (record.answer, record.expired_at) {
                (Some(answer), _) => RecordState::Answered(answer),
                (None, at) => {
                    RecordState::Expired(format!("expired at {}", at.unwrap_or_default()))
                }
            });
        }
        // Past its expiry, the fleet is about to settle it (default option or expired).
        if let Some(expires) = record.decision.expires_at.as_deref()
            && humantime::parse_rfc3339_weak(expires).is_ok_and(|t| t < SystemTime::now())
        {
            return Ok(RecordState::Expired(format!(
                "expires_at {expires} has passed"
            )));
        }
        Ok(RecordState::Pending(Box::new(record)))
    }
}
