//! The Rust client of the wire contract, used by the CLI and the tests: submit, follow events,
//! status, result, cancel.

use std::time::Duration;

use futures_util::{Stream, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::connect::{self, ConnectPurpose};
use super::decisions::DecisionReply;
use super::reply::encode_reply;
use super::subjects::Subjects;
use crate::actors::{Accepted, CancelReply};
use crate::protocol::StatusReply;
use crate::protocol::codec::CONTENT_TYPE_HEADER;
use crate::protocol::{
    DecisionAnswer, Encoding, ErrorCode, ErrorReply, Event, EventBody, GenerationRequest,
    GenerationResult, WireError,
};
use crate::settings::Settings;

/// How often a submit refused with NO_SLOT_AVAILABLE is tried again (another worker of the pool
/// may be free by then).
const SUBMIT_RETRIES: u32 = 3;

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
}

/// Refuses an id that could never name a request (or decision) before anything is sent: the
/// reply would otherwise be silence on a subject no worker serves.
fn check_id(what: &str, id: &str) -> Result<(), ClientError> {
    if crate::protocol::ids::is_valid_request_id(id) {
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
        "only letters, digits, '_' and '-' are allowed".to_string()
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
        Ok(Client::new(nats, Subjects::new(&settings.subjects)))
    }

    pub fn new(nats: async_nats::Client, subjects: Subjects) -> Client {
        Client {
            nats,
            subjects,
            encoding: Encoding::Json,
            timeout: Duration::from_secs(15),
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
        let (mut headers, payload) = encode_reply::<&B>(self.encoding, &Ok(body));
        if self.encoding == Encoding::MsgPack {
            headers.insert(CONTENT_TYPE_HEADER, self.encoding.content_type());
        }
        let request = async_nats::Request::new()
            .headers(headers)
            .payload(payload)
            .timeout(Some(self.timeout));
        let is_submit = subject.starts_with(&self.subjects.submit(""));
        let reply = self.nats.send_request(subject.clone(), request).await.map_err(|error| match error.kind() {
            // Only submits are answered by workers with a free slot; any connected worker
            // answers the other subjects.
            async_nats::RequestErrorKind::NoResponders if is_submit => ClientError::Wire(WireError::new(
                ErrorCode::NoSlotAvailable,
                "no worker of the pool answers (none has a free slot, or none is connected)",
            )),
            async_nats::RequestErrorKind::NoResponders => ClientError::Transport(format!(
                "no worker answers on {subject}: is a genfleet worker connected?"
            )),
            async_nats::RequestErrorKind::TimedOut => ClientError::Timeout(self.timeout),
            _ => ClientError::Transport(error.to_string()),
        })?;
        let encoding = super::reply::encoding_of(&reply);
        if let Ok(error) = encoding.decode::<ErrorReply>(&reply.payload) {
            return Err(ClientError::Wire(error.into()));
        }
        encoding
            .decode::<R>(&reply.payload)
            .map_err(|e| ClientError::Transport(format!("unreadable reply: {}", e.message)))
    }

    /// Starts a request on a worker of `pool`, retrying a few times with jitter when every
    /// worker that answered was full.
    pub async fn submit(
        &self,
        pool: &str,
        request: &GenerationRequest,
    ) -> Result<Accepted, ClientError> {
        let subject = self.subjects.submit(pool);
        let mut attempt = 0;
        loop {
            match self.call(subject.clone(), request).await {
                Err(ClientError::Wire(error))
                    if error.code == ErrorCode::NoSlotAvailable && attempt < SUBMIT_RETRIES =>
                {
                    attempt += 1;
                    let jitter = u64::from(ulid::Ulid::generate().random() as u16 % 100);
                    tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt) + jitter))
                        .await;
                }
                other => return other,
            }
        }
    }

    /// Puts a request on the durable queue of `pool`; it runs when a worker of the pool has a
    /// free slot, survives worker failures, and is kept once however often it is published
    /// within the stream's duplicate window. A request id is generated when absent.
    pub async fn enqueue(
        &self,
        pool: &str,
        request: &GenerationRequest,
    ) -> Result<Queued, ClientError> {
        let mut request = request.clone();
        let request_id = request
            .request_id
            .get_or_insert_with(crate::protocol::ids::new_id)
            .clone();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", request_id.as_str());
        if self.encoding == Encoding::MsgPack {
            headers.insert(CONTENT_TYPE_HEADER, self.encoding.content_type());
        }
        let body = self.encoding.encode(&request);
        let jetstream = async_nats::jetstream::new(self.nats.clone());
        let ack = jetstream
            .publish_with_headers(self.subjects.queue(pool, &request_id), headers, body.into())
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?
            .await
            .map_err(|e| {
                ClientError::Transport(format!("the queue did not take the request: {e}"))
            })?;
        Ok(Queued {
            request_id,
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
            .subscribe(self.subjects.events(request_id))
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        Ok(sub.filter_map(|message| async move {
            serde_json::from_slice::<Event>(&message.payload).ok()
        }))
    }

    pub async fn status(&self, request_id: &str) -> Result<StatusReply, ClientError> {
        check_id("request", request_id)?;
        self.call(self.subjects.status(request_id), &serde_json::json!({}))
            .await
    }

    /// The terminal result; `release: false` peeks and leaves it stored.
    pub async fn result(
        &self,
        request_id: &str,
        release: bool,
    ) -> Result<GenerationResult, ClientError> {
        check_id("request", request_id)?;
        self.call(
            self.subjects.result(request_id),
            &serde_json::json!({ "release": release }),
        )
        .await
    }

    pub async fn cancel(&self, request_id: &str) -> Result<CancelReply, ClientError> {
        check_id("request", request_id)?;
        self.call(self.subjects.cancel(request_id), &serde_json::json!({}))
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
        let request_id = request
            .request_id
            .get_or_insert_with(crate::protocol::ids::new_id)
            .clone();
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
