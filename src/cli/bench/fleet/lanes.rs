//! The fleet run's load: lanes of callers, each sending one kind of request after another
//! with a pause between, for the whole run, as two tenants and in the three priority bands
//! in turn. Every request's id is chosen by its caller before it is sent, so that the run can
//! ask the fleet about it afterwards whatever the caller saw (a broken HTTP connection, a
//! submit that timed out while a NATS node died). Each lane records what its caller saw; the
//! book ([`super::super::book::Book`]) records what the bus carried.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use serde_json::json;

use super::super::book::Book;
use super::super::workload;
use crate::client::follow::Step;
use crate::client::{Client, ClientError};
use crate::protocol::{GenerationRequest, GenerationResult, Message, Priority, RequestState};
use crate::settings::Settings;

/// The tenants the load is sent as (the gateways' API keys stand for them too).
pub const TENANTS: [&str; 2] = ["alpha", "beta"];
/// The bands, in the order a lane's requests take them.
const BANDS: [Priority; 3] = [Priority::Low, Priority::Normal, Priority::High];
/// Words of each reply (the mock echoes one word a token): an interactive request streams
/// for about `words × token delay`.
const INTERACTIVE_WORDS: usize = 30;
const STREAMED_WORDS: usize = 60;
const DURABLE_WORDS: usize = 40;
/// Words of each question of a keyed conversation (its answer echoes them).
const TURN_WORDS: usize = 16;
/// Turns of one keyed conversation before the lane starts another.
pub const TURNS: usize = 4;
/// How long a durable request's publish is tried again (with the same id, which the queue
/// keeps once) while the queue does not acknowledge it.
const ENQUEUE_RETRY_FOR: Duration = Duration::from_secs(10);
const ENQUEUE_RETRY_PAUSE: Duration = Duration::from_millis(250);

/// The kinds of request the load sends, and the continuations the fleet starts for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Submitted with the Rust client, followed on the bus.
    BusInteractive,
    /// A chat completion through a gateway, the whole answer at once.
    GatewayWhole,
    /// A chat completion through a gateway, streamed.
    GatewayStreamed,
    /// Put on the durable queue with the Rust client.
    Durable,
    /// A turn of a conversation with an affinity key, with the Rust client.
    KeyedBus,
    /// A turn of a conversation with an affinity key (`user`), through the gateways in turn.
    KeyedGateway,
    /// A request that asks a manager for a decision, followed through its continuation.
    Decision,
    /// A decision's continuation, started by the fleet once the manager answered.
    Continuation,
}

impl Kind {
    pub const ALL: [Kind; 8] = [
        Kind::BusInteractive,
        Kind::GatewayWhole,
        Kind::GatewayStreamed,
        Kind::Durable,
        Kind::KeyedBus,
        Kind::KeyedGateway,
        Kind::Decision,
        Kind::Continuation,
    ];

    /// For people.
    pub fn label(self) -> &'static str {
        match self {
            Kind::BusInteractive => "bus interactive",
            Kind::GatewayWhole => "gateway, whole",
            Kind::GatewayStreamed => "gateway, streamed",
            Kind::Durable => "durable (queue)",
            Kind::KeyedBus => "keyed turn, bus",
            Kind::KeyedGateway => "keyed turn, gateways",
            Kind::Decision => "decision chain",
            Kind::Continuation => "continuation",
        }
    }

    /// A request id's mark of its kind.
    fn mark(self) -> &'static str {
        match self {
            Kind::BusInteractive => "bi",
            Kind::GatewayWhole => "gw",
            Kind::GatewayStreamed => "gs",
            Kind::Durable => "dq",
            Kind::KeyedBus => "kb",
            Kind::KeyedGateway => "kg",
            Kind::Decision => "dc",
            Kind::Continuation => "ct",
        }
    }

    /// Whether a caller waits on it as on an answer (the chart's latency): not a queued
    /// request, nor a chain that waits on a manager.
    pub fn interactive(self) -> bool {
        !matches!(self, Kind::Durable | Kind::Decision | Kind::Continuation)
    }
}

/// The lanes of each kind the load runs.
pub const LANES: [(Kind, usize); 7] = [
    (Kind::BusInteractive, 2),
    (Kind::GatewayWhole, 2),
    (Kind::GatewayStreamed, 1),
    (Kind::Durable, 2),
    (Kind::KeyedBus, 1),
    (Kind::KeyedGateway, 1),
    (Kind::Decision, 1),
];

/// What a caller knew of its request's acceptance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acceptance {
    /// The fleet took it: a worker's acceptance, the queue's acknowledgement, a gateway's 200.
    Accepted,
    /// The fleet answered with a refusal (no slot, a tenant's limit): never started.
    Refused(String),
    /// No answer the caller could read (a timeout, a broken connection): whether the fleet
    /// took it is for the fleet to say.
    Unclear(String),
}

/// One request a caller sent, as its caller saw it.
#[derive(Debug, Clone)]
pub struct Call {
    /// Its id on the bus (`<tenant>.<id>`).
    pub id: String,
    pub kind: Kind,
    /// Seconds since the load began.
    pub submitted_s: f64,
    pub acceptance: Acceptance,
    /// When its caller saw it end (a decision chain: its last part), if it did.
    pub ended_s: Option<f64>,
    /// It ended COMPLETED as its caller saw it (a chain: its last part, `stop`).
    pub completed: bool,
    /// What went wrong for the caller, in a word or two.
    pub error: Option<String>,
}

/// A turn of a keyed conversation.
#[derive(Debug, Clone)]
pub struct Turn {
    pub id: String,
    pub key: String,
    /// From 0.
    pub turn: usize,
    pub submitted_s: f64,
}

/// What the lanes record, read once they stopped.
#[derive(Default)]
pub struct Records {
    calls: Mutex<Vec<Call>>,
    turns: Mutex<Vec<Turn>>,
    /// Continuations the decision lanes followed, by their id on the bus.
    continuations: Mutex<Vec<String>>,
    /// Requests sent and not yet seen to end by their callers.
    in_flight: AtomicI64,
}

impl Records {
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn calls(&self) -> Vec<Call> {
        lock(&self.calls).clone()
    }

    pub fn turns(&self) -> Vec<Turn> {
        lock(&self.turns).clone()
    }

    pub fn continuations(&self) -> Vec<String> {
        lock(&self.continuations).clone()
    }

    fn push(&self, call: Call) {
        lock(&self.calls).push(call);
    }

    /// Counts a request in flight until the guard drops.
    fn flight(&self) -> Flight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Flight(&self.in_flight)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct Flight<'a>(&'a AtomicI64);

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What every lane shares.
pub struct Load {
    pub settings: Settings,
    pub pool: String,
    pub book: Book,
    pub records: Arc<Records>,
    /// When the load began: every time recorded is seconds since.
    pub started: Instant,
    /// Set when the lanes are to send no more.
    pub stop: Arc<AtomicBool>,
    /// The longest a caller waits for one request (a chain: for all of it).
    pub settle: Duration,
    /// Between a caller's requests.
    pub pause: Duration,
    /// Prefix of every request id of the run.
    pub run_id: String,
    /// The gateways' OpenAI base URLs (a gateway started again keeps its own).
    pub gateways: Vec<String>,
    /// The API key of each tenant of [`TENANTS`], in order.
    pub keys: Vec<String>,
    pub http: reqwest::Client,
}

impl Load {
    fn now_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}

/// Starts every lane of [`LANES`], each with a NATS connection of its own (every node's URL,
/// so that it reconnects to another when its own dies).
pub async fn start(load: Arc<Load>) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut lanes = Vec::new();
    let mut index = 0;
    for (kind, count) in LANES {
        for lane in 0..count {
            let client = Client::connect(&load.settings)
                .await
                .context("a lane cannot connect to NATS")?;
            let load = load.clone();
            // Lanes start apart, so their requests do not come in waves.
            let stagger = Duration::from_millis(137 * index as u64);
            index += 1;
            lanes.push(tokio::spawn(async move {
                tokio::time::sleep(stagger).await;
                run_lane(&load, kind, lane, client).await;
            }));
        }
    }
    Ok(lanes)
}

/// A keyed conversation going on.
struct Conversation {
    key: String,
    tenant: usize,
    messages: Vec<Message>,
}

async fn run_lane(load: &Load, kind: Kind, lane: usize, client: Client) {
    let tenants: Vec<Client> = TENANTS
        .iter()
        .map(|t| {
            client
                .clone()
                .with_tenant(*t)
                .expect("the bench's tenant names are valid")
        })
        .collect();
    let mut conversation: Option<Conversation> = None;
    let mut chains = 0u64;
    let mut n = 0u64;
    while !load.stop.load(Ordering::Relaxed) {
        let tenant = (lane + n as usize) % TENANTS.len();
        let band = BANDS[n as usize % BANDS.len()];
        let id = format!("{}-{}{lane}-{n}", load.run_id, kind.mark());
        let client = &tenants[tenant];
        match kind {
            Kind::BusInteractive => {
                let mut request = workload::request(id, INTERACTIVE_WORDS);
                request.priority = Some(band);
                submit_and_wait(load, client, kind, request).await;
            }
            Kind::Durable => {
                let mut request = workload::request(id, DURABLE_WORDS);
                request.priority = Some(band);
                enqueue_and_wait(load, client, request).await;
            }
            Kind::GatewayWhole | Kind::GatewayStreamed => {
                let words = if kind == Kind::GatewayStreamed {
                    STREAMED_WORDS
                } else {
                    INTERACTIVE_WORDS
                };
                let messages = vec![Message::user(workload::words(words))];
                let ask = GatewayAsk {
                    kind,
                    id: &id,
                    tenant,
                    band,
                    messages: &messages,
                    words,
                    key: None,
                    gateway: lane + n as usize,
                };
                gateway_call(load, &ask).await;
            }
            Kind::KeyedBus | Kind::KeyedGateway => {
                let chat = conversation.get_or_insert_with(|| {
                    chains += 1;
                    Conversation {
                        key: format!("{}-{}{lane}-c{chains}", load.run_id, kind.mark()),
                        tenant,
                        messages: Vec::new(),
                    }
                });
                let turn = chat.messages.len() / 2;
                chat.messages
                    .push(Message::user(question(&chat.key, turn, TURN_WORDS)));
                let answer = keyed_turn(load, &tenants, kind, &id, chat, band, turn).await;
                match answer {
                    Some(answer) if turn + 1 < TURNS => {
                        chat.messages.push(Message::assistant(answer))
                    }
                    // The conversation ends after its last turn, or at a turn that failed.
                    _ => conversation = None,
                }
            }
            Kind::Decision => decision_chain(load, client, id).await,
            Kind::Continuation => unreachable!("continuations are the fleet's, not a lane's"),
        }
        n += 1;
        tokio::time::sleep(load.pause).await;
    }
}

/// A turn of a keyed conversation: sent as its lane sends, recorded with its key. Returns
/// the answer when the turn completed.
async fn keyed_turn(
    load: &Load,
    tenants: &[Client],
    kind: Kind,
    id: &str,
    chat: &Conversation,
    band: Priority,
    turn: usize,
) -> Option<String> {
    let client = &tenants[chat.tenant];
    lock(&load.records.turns).push(Turn {
        id: client.on_bus(id),
        key: chat.key.clone(),
        turn,
        submitted_s: load.now_s(),
    });
    if kind == Kind::KeyedBus {
        let request = GenerationRequest {
            request_id: Some(id.to_string()),
            messages: chat.messages.clone(),
            affinity_key: Some(chat.key.clone()),
            priority: Some(band),
            max_tokens: Some((TURN_WORDS + 16) as u32),
            ..GenerationRequest::default()
        };
        submit_and_wait(load, client, kind, request)
            .await
            .filter(|r| r.state == RequestState::Completed)
            .map(|r| r.output)
    } else {
        let ask = GatewayAsk {
            kind,
            id,
            tenant: chat.tenant,
            band,
            messages: &chat.messages,
            words: TURN_WORDS,
            key: Some(&chat.key),
            gateway: turn,
        };
        gateway_call(load, &ask).await
    }
}

/// Submits with the Rust client and waits for the end (its `finished` event, or its stored
/// result), at most the settle time. Returns the result when it ended.
async fn submit_and_wait(
    load: &Load,
    client: &Client,
    kind: Kind,
    request: GenerationRequest,
) -> Option<GenerationResult> {
    let id = request.request_id.clone().expect("the lanes name requests");
    let on_bus = client.on_bus(&id);
    let finished = load.book.expect(&on_bus);
    let _flight = load.records.flight();
    let submitted_s = load.now_s();
    let acceptance = match client.submit(&load.pool, &request).await {
        Ok(_) => Acceptance::Accepted,
        Err(error) => refusal(&error),
    };
    let result = match acceptance {
        Acceptance::Accepted => {
            load.book
                .wait_for_end(client, &id, finished, load.settle)
                .await
        }
        _ => None,
    };
    load.records.push(ended_call(
        load,
        on_bus,
        kind,
        submitted_s,
        acceptance,
        result.as_ref(),
    ));
    result
}

/// Puts a request on the durable queue (published again with the same id while the queue
/// does not acknowledge it: it keeps it once) and waits for its end.
async fn enqueue_and_wait(load: &Load, client: &Client, request: GenerationRequest) {
    let id = request.request_id.clone().expect("the lanes name requests");
    let on_bus = client.on_bus(&id);
    let finished = load.book.expect(&on_bus);
    let _flight = load.records.flight();
    let submitted_s = load.now_s();
    let trying = Instant::now();
    let acceptance = loop {
        match client.enqueue(&load.pool, &request).await {
            Ok(_) => break Acceptance::Accepted,
            Err(error @ ClientError::Wire(_)) => break refusal(&error),
            Err(error) if trying.elapsed() >= ENQUEUE_RETRY_FOR => break refusal(&error),
            Err(_) => tokio::time::sleep(ENQUEUE_RETRY_PAUSE).await,
        }
    };
    let result = match acceptance {
        Acceptance::Accepted => {
            load.book
                .wait_for_end(client, &id, finished, load.settle)
                .await
        }
        _ => None,
    };
    load.records.push(ended_call(
        load,
        on_bus,
        Kind::Durable,
        submitted_s,
        acceptance,
        result.as_ref(),
    ));
}

/// A request that asks for a decision, followed through its chain (the client's one way of
/// following a chain) to its last part.
async fn decision_chain(load: &Load, client: &Client, id: String) {
    let on_bus = client.on_bus(&id);
    let _flight = load.records.flight();
    let submitted_s = load.now_s();
    let mut call = Call {
        id: on_bus,
        kind: Kind::Decision,
        submitted_s,
        acceptance: Acceptance::Unclear("not sent".into()),
        ended_s: None,
        completed: false,
        error: None,
    };
    let mut follow = match client.follow_chain(&id, true).await {
        Ok(follow) => follow,
        Err(_) => {
            call.error = Some("cannot follow".into());
            load.records.push(call);
            return;
        }
    };
    if let Err(error) = client
        .submit(&load.pool, &workload::decision_request(id))
        .await
    {
        call.acceptance = refusal(&error);
        call.error = Some(acceptance_word(&call.acceptance));
        load.records.push(call);
        return;
    }
    call.acceptance = Acceptance::Accepted;
    let deadline = tokio::time::Instant::now() + load.settle;
    let mut last: Option<Box<GenerationResult>> = None;
    loop {
        match tokio::time::timeout_at(deadline, follow.next()).await {
            Ok(Some(Step::Continued { request_id })) => {
                lock(&load.records.continuations).push(request_id);
            }
            Ok(Some(Step::Ended(result))) => last = Some(result),
            Ok(Some(Step::ChainEnded { outcome })) => {
                call.error = Some(format!("decision {}", outcome.as_str()));
                break;
            }
            Ok(Some(Step::Lost(lost))) => {
                call.error = Some(format!("chain lost: {lost:?}"));
                break;
            }
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {
                call.error = Some("no end within the settle time".into());
                break;
            }
        }
    }
    if let Some(result) = last {
        call.ended_s = Some(load.now_s());
        call.completed = result.state == RequestState::Completed
            && result.reason != crate::protocol::Reason::DecisionRequested;
        if !call.completed && call.error.is_none() {
            call.error = Some(format!(
                "{} {}",
                result.state.as_str(),
                result.reason.as_str()
            ));
        }
    }
    load.records.push(call);
}

/// A chat completion through a gateway.
struct GatewayAsk<'a> {
    kind: Kind,
    /// The request id the caller chooses (`genfleet.request_id`).
    id: &'a str,
    /// Index into [`TENANTS`]: whose API key it sends.
    tenant: usize,
    band: Priority,
    messages: &'a [Message],
    /// Words of the answer expected.
    words: usize,
    /// The conversation's key (`user`, the affinity key).
    key: Option<&'a str>,
    /// Which gateway, modulo their number.
    gateway: usize,
}

/// Sends a chat completion through a gateway and reads the whole answer (streamed: to its
/// `[DONE]`). Returns the answer's text when it completed (streamed: `None`, its text is not
/// kept).
async fn gateway_call(load: &Load, ask: &GatewayAsk<'_>) -> Option<String> {
    let streamed = ask.kind == Kind::GatewayStreamed;
    let on_bus = format!("{}.{}", TENANTS[ask.tenant], ask.id);
    let _flight = load.records.flight();
    let submitted_s = load.now_s();
    let mut body = json!({
        "model": load.pool,
        "messages": ask.messages,
        "max_tokens": ask.words + 16,
        "stream": streamed,
        "genfleet": {"request_id": ask.id, "priority": ask.band.as_str()},
    });
    if let Some(key) = ask.key {
        body["user"] = key.into();
    }
    let url = format!(
        "{}/chat/completions",
        load.gateways[ask.gateway % load.gateways.len()]
    );
    let mut call = Call {
        id: on_bus,
        kind: ask.kind,
        submitted_s,
        acceptance: Acceptance::Unclear(String::new()),
        ended_s: None,
        completed: false,
        error: None,
    };
    let response = load
        .http
        .post(url)
        .bearer_auth(&load.keys[ask.tenant])
        .json(&body)
        .timeout(load.settle)
        .send()
        .await;
    let response = match response {
        Ok(response) => response,
        Err(error) => {
            let word = http_error_word(&error);
            call.acceptance = Acceptance::Unclear(word.clone());
            call.error = Some(word);
            load.records.push(call);
            return None;
        }
    };
    let status = response.status();
    let text = response.text().await;
    if !status.is_success() {
        let word = format!("HTTP {}", status.as_u16());
        call.acceptance = Acceptance::Unclear(word.clone());
        call.error = Some(word);
        load.records.push(call);
        return None;
    }
    call.acceptance = Acceptance::Accepted;
    let text = match text {
        Ok(text) => text,
        Err(error) => {
            call.error = Some(format!("{} (answer)", http_error_word(&error)));
            load.records.push(call);
            return None;
        }
    };
    call.ended_s = Some(load.now_s());
    let answer = if streamed {
        let clean_end = text.contains("data: [DONE]") && !text.contains("data: {\"error\"");
        clean_end.then(String::new)
    } else {
        serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .filter(|a| {
                a.pointer("/choices/0/finish_reason")
                    .and_then(|f| f.as_str())
                    == Some("stop")
            })
            .and_then(|a| {
                a.pointer("/choices/0/message/content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string)
            })
    };
    call.completed = answer.is_some();
    if !call.completed {
        call.error = Some(if streamed {
            "stream ended in an error".into()
        } else {
            "not finished `stop`".into()
        });
    }
    load.records.push(call);
    answer
}

/// A call whose caller waited for its end (`result`: `None`, it saw none).
fn ended_call(
    load: &Load,
    id: String,
    kind: Kind,
    submitted_s: f64,
    acceptance: Acceptance,
    result: Option<&GenerationResult>,
) -> Call {
    let completed = result.is_some_and(|r| r.state == RequestState::Completed);
    let error = match (&acceptance, result) {
        (Acceptance::Accepted, None) => Some("no end within the settle time".to_string()),
        (Acceptance::Accepted, Some(r)) if !completed => {
            Some(format!("{} {}", r.state.as_str(), r.reason.as_str()))
        }
        (Acceptance::Accepted, Some(_)) => None,
        (other, _) => Some(acceptance_word(other)),
    };
    Call {
        id,
        kind,
        submitted_s,
        acceptance,
        ended_s: result.map(|_| load.now_s()),
        completed,
        error,
    }
}

/// A client's error, as what it says of the request's acceptance: the fleet's refusal, or no
/// answer.
fn refusal(error: &ClientError) -> Acceptance {
    match error {
        ClientError::Wire(wire) => Acceptance::Refused(wire.code.as_str().to_string()),
        ClientError::Timeout(_) => Acceptance::Unclear("timeout".into()),
        ClientError::Transport(_) => Acceptance::Unclear("transport".into()),
    }
}

fn acceptance_word(acceptance: &Acceptance) -> String {
    match acceptance {
        Acceptance::Accepted => "accepted".into(),
        Acceptance::Refused(code) => format!("refused {code}"),
        Acceptance::Unclear(why) => format!("no answer ({why})"),
    }
}

/// An HTTP client error in a few words (no URL, no address).
fn http_error_word(error: &reqwest::Error) -> String {
    if error.is_timeout() {
        "HTTP timeout".into()
    } else if error.is_connect() {
        "HTTP connect refused".into()
    } else if error.is_body() || error.is_decode() {
        "HTTP body broke".into()
    } else {
        "HTTP transport".into()
    }
}

/// Question `turn` of the conversation `key`: `words` numbered words, unique to it.
fn question(key: &str, turn: usize, words: usize) -> String {
    let mut text = format!("{key}-q{turn}");
    for w in 1..words {
        text.push_str(&format!(" q{turn}w{w}"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn questions_have_their_words_and_are_unique() {
        let q = question("k1", 2, TURN_WORDS);
        assert_eq!(workload::count_tokens(&q), TURN_WORDS);
        assert_ne!(q, question("k1", 3, TURN_WORDS));
        assert_ne!(q, question("k2", 2, TURN_WORDS));
    }

    #[test]
    fn request_ids_fit_the_protocol() {
        for kind in Kind::ALL {
            let id = format!(
                "fl{}-{}{}-{}",
                crate::protocol::ids::new_id(),
                kind.mark(),
                9,
                u64::MAX
            );
            assert!(crate::protocol::ids::is_valid_request_id(&id), "{id}");
            assert!(
                crate::protocol::schedule::is_valid_qualified_id(&format!("{}.{id}", TENANTS[1])),
                "{id}"
            );
        }
    }
}
