//! The Rust client of the wire contract, used by the CLI and the tests: submit, follow events,
//! status, result, cancel.

use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::client::connect::{self, ConnectPurpose};
use crate::client::fleet::Fleet;
use crate::client::reply::encode_reply;
use crate::client::subjects::Subjects;
use crate::protocol::StatusReply;
use crate::protocol::codec::CONTENT_TYPE_HEADER;
use crate::protocol::decision::DecisionReply;
use crate::protocol::request::{AFFINITY_FALLBACK_HEADER, PREFERRED_WORKER_HEADER};
use crate::protocol::{Accepted, CancelReply};
use crate::protocol::{
    DecisionAnswer, Encoding, ErrorCode, ErrorReply, Event, EventBody, GenerationRequest,
    GenerationResult, WireError,
};
use crate::schedule::{Choice, DEFAULT_LOAD_FACTOR};
use crate::settings::{PlacementSettings, Settings};

/// How often a submit refused with NO_SLOT_AVAILABLE is tried again (another worker of the pool
/// may be free by then).
const SUBMIT_RETRIES: u32 = 3;

/// How long a submit sent straight to a worker's own subject waits for its answer before it goes
/// to the pool. A worker answers its own subject at once (it starts the request or refuses it);
/// one that does not is taken for gone: a process killed a moment ago whose connection the
/// server has not closed yet, or a node lost without closing its connections, whose
/// subscriptions stay until the server's pings give up on it, minutes later.
const DIRECT_SUBMIT_WAIT: Duration = Duration::from_secs(2);

/// How long the first worker's answer to `$SRV.INFO` is waited for (a busy worker answers
/// late; with no worker at all this is the whole wait).
const POOLS_FIRST_ANSWER: Duration = Duration::from_secs(1);
/// After an answer, how long the next is waited for before the gathering ends.
const POOLS_NEXT_ANSWER: Duration = Duration::from_millis(100);

/// A submit refusal that stands for "no responders": no worker of the pool is connected.
fn is_no_responders(error: &WireError) -> bool {
    error.code == ErrorCode::NoSlotAvailable && error.detail["no_responders"] == true
}

/// How a client places keyed requests.
#[derive(Clone)]
struct Placement {
    follow: bool,
    load_factor: f64,
    fleet: Arc<std::sync::OnceLock<Arc<Fleet>>>,
}

impl Default for Placement {
    fn default() -> Self {
        Placement {
            follow: true,
            load_factor: DEFAULT_LOAD_FACTOR,
            fleet: Arc::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The fleet answered with an error reply.
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("{0}")]
    Transport(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl ClientError {
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Wire(error) => Some(error.code),
            _ => None,
        }
    }
}

/// A request the queue accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Queued {
    pub request_id: String,
    /// It was published before, within the duplicate window, and kept once.
    pub duplicate: bool,
}

#[derive(Clone)]
pub struct Client {
    nats: async_nats::Client,
    subjects: Subjects,
    encoding: Encoding,
    timeout: Duration,
    /// Where keyed requests go: the heartbeats followed, shared by the client's clones.
    placement: Placement,
    /// The tenant whose subjects it uses (`None`: the default tenant's v1 subjects).
    tenant: Option<String>,
    /// The JetStream context its enqueues publish through, made at the first and shared by
    /// the client's clones (each context starts a task of its own that waits for acks).
    jetstream: Arc<std::sync::OnceLock<async_nats::jetstream::Context>>,
}

/// Refuses an id that could never name a request (or decision) before anything is sent: the
/// reply would otherwise be silence on a subject no worker serves.
fn check_id(what: &str, id: &str) -> Result<(), ClientError> {
    if crate::protocol::ids::is_valid_request_id(id) {
        return Ok(());
    }
    if what == "request" && crate::protocol::schedule::is_valid_qualified_id(id) {
        // `<tenant>.<id>`: a tenant's request as the bus knows it.
        return Ok(());
    }
    let why = if id.is_empty() {
        "it is empty".to_string()
    } else if id.len() > crate::protocol::ids::MAX_REQUEST_ID_LEN {
        format!(
            "it is longer than {} characters",
            crate::protocol::ids::MAX_REQUEST_ID_LEN
        )
    } else {
        if what == "request" {
            "only letters, digits, '_' and '-' are allowed, or <tenant>.<id> for a tenant's request"
                .to_string()
        } else {
            "only letters, digits, '_' and '-' are allowed".to_string()
        }
    };
    Err(ClientError::Wire(WireError::invalid(format!(
        "{id:?} is not a valid {what} id: {why}"
    ))))
}

impl Client {
    /// Connects as the settings say (failing fast when NATS is unreachable).
    pub async fn connect(settings: &Settings) -> Result<Client, ClientError> {
        let nats = connect::connect(&settings.nats, ConnectPurpose::Client)
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        Ok(
            Client::new(nats, Subjects::new(&settings.subjects))
                .with_placement(&settings.placement),
        )
    }

    /// Places keyed requests as `settings` say: the load factor, and whether to follow the
    /// heartbeats at all.
    pub fn with_placement(mut self, settings: &PlacementSettings) -> Client {
        self.placement = Placement {
            follow: settings.follow_heartbeats,
            load_factor: settings.load_factor,
            fleet: Arc::default(),
        };
        self
    }

    pub fn new(nats: async_nats::Client, subjects: Subjects) -> Client {
        Client {
            nats,
            subjects,
            encoding: Encoding::Json,
            timeout: Duration::from_secs(15),
            placement: Placement::default(),
            tenant: None,
            jetstream: Arc::default(),
        }
    }

    /// Requests in MessagePack instead of JSON.
    pub fn with_encoding(mut self, encoding: Encoding) -> Client {
        self.encoding = encoding;
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    /// Submits and enqueues as `tenant`: on `gen.submit.<pool>.<tenant>` and
    /// `gen.queue.<pool>.<band>.<tenant>.<id>`, which the server allows only to the NATS users
    /// granted that tenant.
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Result<Client, ClientError> {
        let tenant = tenant.into();
        if !crate::protocol::schedule::is_valid_tenant(&tenant) {
            return Err(ClientError::Wire(WireError::invalid(format!(
                "tenant {tenant:?} must be 1-{} characters of A-Z, a-z, 0-9, '_' or '-'",
                crate::protocol::schedule::MAX_TENANT_LEN
            ))));
        }
        self.tenant = Some(tenant);
        Ok(self)
    }

    /// The tenant it submits as (`None`: the default tenant).
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// A request's id on the bus: a bare id this client's tenant chose becomes
    /// `<tenant>.<id>`; an id already qualified (as every reply gives it) stays as it is.
    pub fn on_bus(&self, request_id: &str) -> String {
        if request_id.contains('.') {
            request_id.to_string()
        } else {
            crate::protocol::schedule::qualified_id(self.tenant.as_deref(), request_id)
        }
    }

    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    async fn call<B: Serialize, R: DeserializeOwned>(
        &self,
        subject: String,
        body: &B,
    ) -> Result<R, ClientError> {
        let is_submit = subject.starts_with(&self.subjects.submit(""));
        self.call_with(subject, body, async_nats::HeaderMap::new(), is_submit)
            .await
    }

    /// A question about one request (its status, result or cancel), sent to whichever worker
    /// answers on its subject.
    async fn ask<R: DeserializeOwned>(
        &self,
        verb: fn(&Subjects, &str) -> String,
        request_id: &str,
        body: serde_json::Value,
    ) -> Result<R, ClientError> {
        check_id("request", request_id)?;
        self.call(verb(&self.subjects, &self.on_bus(request_id)), &body)
            .await
    }

    /// A request with `extra` headers; `is_submit`: answered only by workers with a free slot.
    async fn call_with<B: Serialize, R: DeserializeOwned>(
        &self,
        subject: String,
        body: &B,
        extra: async_nats::HeaderMap,
        is_submit: bool,
    ) -> Result<R, ClientError> {
        self.call_within(subject, body, extra, is_submit, self.timeout)
            .await
    }

    /// [`Client::call_with`], waiting at most `wait` for the answer.
    async fn call_within<B: Serialize, R: DeserializeOwned>(
        &self,
        subject: String,
        body: &B,
        extra: async_nats::HeaderMap,
        is_submit: bool,
        wait: Duration,
    ) -> Result<R, ClientError> {
        let (mut headers, payload) = encode_reply::<&B>(self.encoding, &Ok(body));
        if self.encoding == Encoding::MsgPack {
            headers.insert(CONTENT_TYPE_HEADER, self.encoding.content_type());
        }
        trace_context(&mut headers);
        for (name, values) in extra.iter() {
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
        let request = async_nats::Request::new()
            .headers(headers)
            .payload(payload)
            .timeout(Some(wait));
        let reply = self
            .nats
            .send_request(subject.clone(), request)
            .await
            .map_err(|error| match error.kind() {
                // A submit on a pool with no worker connected, or on the own subject of a worker
                // that is gone (or a peer a full worker forwarded it to that stopped just then).
                async_nats::RequestErrorKind::NoResponders if is_submit => ClientError::Wire(
                    WireError::new(
                        ErrorCode::NoSlotAvailable,
                        "no worker answers (none of the pool is connected, or the worker is gone)",
                    )
                    .with_detail(serde_json::json!({ "no_responders": true })),
                ),
                async_nats::RequestErrorKind::NoResponders => ClientError::Transport(format!(
                    "no worker answers on {subject}: is a genfleet worker connected?"
                )),
                async_nats::RequestErrorKind::TimedOut => ClientError::Timeout(wait),
                _ => ClientError::Transport(error.to_string()),
            })?;
        let encoding = crate::client::reply::encoding_of(&reply);
        if let Ok(error) = encoding.decode::<ErrorReply>(&reply.payload) {
            return Err(ClientError::Wire(error.into()));
        }
        encoding
            .decode::<R>(&reply.payload)
            .map_err(|e| ClientError::Transport(format!("unreadable reply: {}", e.message)))
    }

    /// Starts a request on a worker of `pool` with one try: NO_SLOT_AVAILABLE as soon as no
    /// worker of the pool has a free slot (the gateway then queues the request instead).
    pub async fn submit_once(
        &self,
        pool: &str,
        request: &GenerationRequest,
    ) -> Result<Accepted, ClientError> {
        self.submit_tries(pool, request, 0).await
    }

    /// Starts a request on a worker of `pool`, retrying a few times with jitter when every
    /// worker that answered was full.
    ///
    /// A request with an `affinity_key` goes to its key's worker ([`Client::place`]): straight
    /// to that worker's own subject once this client follows the heartbeats, and when that
    /// worker has no free slot (or is gone) to the pool at once, never waiting for it; to the
    /// pool, whose worker places it, before.
    pub async fn submit(
        &self,
        pool: &str,
        request: &GenerationRequest,
    ) -> Result<Accepted, ClientError> {
        self.submit_tries(pool, request, SUBMIT_RETRIES).await
    }

    /// A submit (its affinity first, then the pool), tried again up to `retries` times while
    /// every worker that answered was full.
    async fn submit_tries(
        &self,
        pool: &str,
        request: &GenerationRequest,
        retries: u32,
    ) -> Result<Accepted, ClientError> {
        let mut headers = async_nats::HeaderMap::new();
        // The worker chosen for the key, when its own subject did not answer in time: it may
        // have started the request all the same.
        let mut unanswered = None;
        let mut named;
        let mut request = request;
        if let Some(choice) = request
            .affinity_key
            .as_deref()
            .and_then(|key| self.place(pool, key))
        {
            if request.request_id.is_none() {
                // Named here, so that a worker that starts it but answers late is found by it.
                named = request.clone();
                named.request_id = Some(crate::protocol::ids::new_id());
                request = &named;
            }
            // Straight to the worker the fleet's rule chose; the pool if it has no slot after
            // all (or is gone), telling the pool's worker not to place it again.
            headers.insert(PREFERRED_WORKER_HEADER, choice.key_worker.as_str());
            if let Some(passed_over) = choice.passed_over {
                headers.insert(AFFINITY_FALLBACK_HEADER, passed_over.as_str());
            }
            let direct = self
                .subjects
                .worker_submit(&choice.worker, self.tenant.as_deref());
            let wait = self.timeout.min(DIRECT_SUBMIT_WAIT);
            match self
                .call_within(direct, request, headers.clone(), true, wait)
                .await
            {
                Err(ClientError::Wire(error)) if error.code == ErrorCode::NoSlotAvailable => {
                    headers.insert(AFFINITY_FALLBACK_HEADER, "busy");
                }
                Err(ClientError::Timeout(_)) => {
                    headers.insert(AFFINITY_FALLBACK_HEADER, "busy");
                    unanswered = Some(choice.worker);
                }
                done => return done,
            }
        }
        let subject = self.subjects.submit_as(pool, self.tenant.as_deref());
        let mut attempt = 0;
        loop {
            match self
                .call_with(subject.clone(), request, headers.clone(), true)
                .await
            {
                Err(ClientError::Wire(error))
                    if error.code == ErrorCode::NoSlotAvailable && attempt < retries =>
                {
                    attempt += 1;
                    let jitter = u64::from(ulid::Ulid::generate().random() as u16 % 100);
                    tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt) + jitter))
                        .await;
                }
                Err(ClientError::Wire(error)) if is_no_responders(&error) => {
                    return Err(ClientError::Wire(self.no_worker_of(pool).await));
                }
                Err(ClientError::Wire(error))
                    if error.code == ErrorCode::DuplicateRequestId && unanswered.is_some() =>
                {
                    let worker = unanswered.as_deref().unwrap_or_default();
                    let id = request.request_id.as_deref().unwrap_or_default();
                    return self
                        .started_by(worker, id)
                        .await
                        .ok_or(ClientError::Wire(error));
                }
                other => return other,
            }
        }
    }

    /// The acceptance of request `request_id` when `worker` (whose own subject did not answer
    /// a submit in time) started it after all, as its status tells; `None` when another
    /// worker runs or ran it (an id in use before this submit).
    async fn started_by(&self, worker: &str, request_id: &str) -> Option<Accepted> {
        let status = self.status(request_id).await.ok()?;
        (status.worker_id.as_deref() == Some(worker)).then(|| Accepted {
            request_id: status.request_id,
            worker_id: worker.to_string(),
            state: status.state,
        })
    }

    /// Where a request with `key` goes in `pool` by the fleet's rule, as the heartbeats this
    /// client follows tell (following starts at its first keyed request); `None` (the pool's
    /// worker places it) until they are read, when they cannot be, or when no worker has a
    /// free slot.
    pub fn place(&self, pool: &str, key: &str) -> Option<Choice> {
        if !self.placement.follow {
            return None;
        }
        let fleet = self
            .placement
            .fleet
            .get_or_init(|| Fleet::follow(self.nats.clone()));
        fleet.choose(pool, key, self.placement.load_factor)
    }

    /// The heartbeats this client follows, once a keyed request started following them.
    pub fn fleet(&self) -> Option<&Arc<Fleet>> {
        self.placement.fleet.get()
    }

    /// Follows the heartbeats now rather than at the first keyed request.
    pub fn follow_fleet(&self) -> Option<&Arc<Fleet>> {
        if !self.placement.follow {
            return None;
        }
        Some(
            self.placement
                .fleet
                .get_or_init(|| Fleet::follow(self.nats.clone())),
        )
    }

    /// The refusal of a submit no worker of `pool` answered: it names the pool, and the pools
    /// whose workers answer the service API now.
    async fn no_worker_of(&self, pool: &str) -> WireError {
        let others = served_now(&self.pools_served().await);
        WireError::new(
            ErrorCode::NoSlotAvailable,
            format!("no worker of pool {pool} is connected ({others})"),
        )
        .with_detail(serde_json::json!({ "no_responders": true, "pool": pool }))
    }

    /// The pools whose workers answer the service API (`$SRV.INFO.genfleet`, their `pool`
    /// metadata) within a moment; empty when none answers, or when this user may not ask.
    pub async fn pools_served(&self) -> std::collections::BTreeSet<String> {
        let mut pools = std::collections::BTreeSet::new();
        let inbox = self.nats.new_inbox();
        let Ok(mut replies) = self.nats.subscribe(inbox.clone()).await else {
            return pools;
        };
        if self
            .nats
            .publish_with_reply("$SRV.INFO.genfleet", inbox, "".into())
            .await
            .is_err()
        {
            return pools;
        }
        // Gathered until no answer comes for a moment: as long as the workers take to answer,
        // not a fixed window that a busy worker could miss.
        let mut wait = POOLS_FIRST_ANSWER;
        while let Ok(Some(message)) = tokio::time::timeout(wait, replies.next()).await {
            wait = POOLS_NEXT_ANSWER;
            if let Ok(info) = serde_json::from_slice::<serde_json::Value>(&message.payload)
                && let Some(pool) = info["metadata"]["pool"].as_str()
            {
                pools.insert(pool.to_string());
            }
        }
        pools
    }

    /// Puts a request on the durable queue of `pool`, in its band (`priority`) and under the
    /// client's tenant; it runs when a worker of the pool has a free slot, survives worker
    /// failures, and is kept once however often it is published within the stream's duplicate
    /// window. A request id is generated when absent.
    pub async fn enqueue(
        &self,
        pool: &str,
        request: &GenerationRequest,
    ) -> Result<Queued, ClientError> {
        // Sent as it is when it names itself (no copy of a large conversation).
        let request = match request.request_id {
            Some(_) => std::borrow::Cow::Borrowed(request),
            None => {
                let mut named = request.clone();
                named.request_id = Some(crate::protocol::ids::new_id());
                std::borrow::Cow::Owned(named)
            }
        };
        let request_id = request.request_id.clone().unwrap_or_default();
        // The duplicate window is the stream's, shared by every tenant: the message's id is
        // the request's id on the bus, which carries the tenant.
        let on_bus = self.on_bus(&request_id);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", on_bus.as_str());
        if self.encoding == Encoding::MsgPack {
            headers.insert(CONTENT_TYPE_HEADER, self.encoding.content_type());
        }
        trace_context(&mut headers);
        let body = self.encoding.encode(&request);
        let jetstream = self
            .jetstream
            .get_or_init(|| async_nats::jetstream::new(self.nats.clone()));
        let ack = jetstream
            .publish_with_headers(
                self.subjects
                    .queue_for(pool, request.band(), self.tenant.as_deref(), &request_id),
                headers,
                body.into(),
            )
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?
            .await
            .map_err(|e| {
                ClientError::Transport(format!("the queue did not take the request: {e}"))
            })?;
        if ack.duplicate {
            // The stream kept a message with this id within its duplicate window. It is this
            // request when the fleet knows it (queued, running or finished); otherwise another
            // publisher sent the same message id first (the window is the whole stream's,
            // every tenant's), and nothing of this caller's was queued.
            match self.status(&on_bus).await {
                Err(ClientError::Wire(error)) if error.code == ErrorCode::NotFound => {
                    return Err(ClientError::Wire(WireError::new(
                        ErrorCode::DuplicateRequestId,
                        format!(
                            "the queue took request {on_bus} for a duplicate of a message published with the same id within its duplicate window, but no such request is queued, running or finished: another publisher used this id; send it again under another request id"
                        ),
                    )));
                }
                _ => {}
            }
        }
        Ok(Queued {
            request_id: on_bus,
            duplicate: ack.duplicate,
        })
    }

    /// The request's events as they are published (subscribe before submitting, with a request
    /// id of your own, to miss none).
    pub async fn follow(
        &self,
        request_id: &str,
    ) -> Result<impl Stream<Item = Event> + use<>, ClientError> {
        check_id("request", request_id)?;
        let sub = self
            .nats
            .subscribe(self.subjects.events(&self.on_bus(request_id)))
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        Ok(sub.filter_map(|message| async move { Event::from_json(&message.payload).ok() }))
    }

    pub async fn status(&self, request_id: &str) -> Result<StatusReply, ClientError> {
        self.ask(Subjects::status, request_id, serde_json::json!({}))
            .await
    }

    /// The terminal result; `release: false` peeks and leaves it stored.
    pub async fn result(
        &self,
        request_id: &str,
        release: bool,
    ) -> Result<GenerationResult, ClientError> {
        self.ask(
            Subjects::result,
            request_id,
            serde_json::json!({ "release": release }),
        )
        .await
    }

    pub async fn cancel(&self, request_id: &str) -> Result<CancelReply, ClientError> {
        self.ask(Subjects::cancel, request_id, serde_json::json!({}))
            .await
    }

    /// Cancels, saying why: the reason goes into the cancelled result's detail
    /// (`cancelled by its caller: <reason>`).
    pub async fn cancel_because(
        &self,
        request_id: &str,
        reason: &str,
    ) -> Result<CancelReply, ClientError> {
        self.ask(
            Subjects::cancel,
            request_id,
            serde_json::json!({ "reason": reason }),
        )
        .await
    }

    /// Answers a decision on `decisions.<decision_id>`.
    pub async fn decide(
        &self,
        decision_id: &str,
        answer: &DecisionAnswer,
    ) -> Result<DecisionReply, ClientError> {
        check_id("decision", decision_id)?;
        self.call(self.subjects.decision(decision_id), answer).await
    }

    /// Submits and waits for the `finished` event (or, if an event was missed, the stored
    /// result), up to `wait`. The request gets an id first so no event is missed.
    pub async fn run(
        &self,
        pool: &str,
        mut request: GenerationRequest,
        wait: Duration,
    ) -> Result<GenerationResult, ClientError> {
        let request_id = self.on_bus(
            request
                .request_id
                .get_or_insert_with(crate::protocol::ids::new_id),
        );
        let mut events = Box::pin(self.follow(&request_id).await?);
        self.submit(pool, &request).await?;
        let finished = tokio::time::timeout(wait, async {
            while let Some(event) = events.next().await {
                if let EventBody::Finished { result } = event.body {
                    return Some(*result);
                }
            }
            None
        })
        .await;
        match finished {
            Ok(Some(result)) => {
                // Release the stored copy too; the event carried all of it.
                let _ = self.result(&request_id, true).await;
                Ok(result)
            }
            _ => self.result(&request_id, true).await,
        }
    }
}

/// The caller's current span as `traceparent`, when this process exports traces: the request's
/// spans on the worker join the caller's trace.
fn trace_context(headers: &mut async_nats::HeaderMap) {
    if let Some(traceparent) = crate::telemetry::current_traceparent() {
        headers.insert(
            crate::client::reply::TRACEPARENT_HEADER,
            traceparent.as_str(),
        );
    }
}

/// The pools whose workers answer now, as a line for people.
pub fn served_now(served: &std::collections::BTreeSet<String>) -> String {
    if served.is_empty() {
        "no worker answered the service API just now".to_string()
    } else {
        format!(
            "pools with workers now: {}",
            served
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}
