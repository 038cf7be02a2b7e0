//! One chat completion on the fleet: the request started (at once, or through the durable
//! queue), its events followed through the decisions of its chain, and what the caller sees
//! as one completion handed out piece by piece.
//!
//! Architecture invariant: a caller that goes away cancels its request, on every path. The
//! [`CancelGuard`] is armed before the request is sent and follows it to its continuations;
//! it lives in the handler's future (a whole completion) or in the SSE stream (a streamed one),
//! so when hyper drops either because the connection closed, `gen.cancel.<id>` goes out. It is
//! disarmed only once the request (or its chain) reached its end and the caller was told.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::Shared;
use super::mapping::{DECISION_TIMEOUT, Ending, Mapped, ending_of, ending_of_chain};
use crate::client::{Client, ClientError, Follow, Lost, Step};
use crate::protocol::{ErrorCode, GenerationResult, Reason, RequestState, ToolCall};

/// What the caller is given next.
#[derive(Debug)]
pub enum Piece {
    Text(String),
    Reasoning(String),
    End(End),
}

/// How the completion ended.
#[derive(Debug)]
pub struct End {
    /// A finish reason, or an error (status, type, code) with its message.
    pub ending: Ending,
    pub message: String,
    pub tool_calls: Vec<ToolCall>,
    pub usage: crate::protocol::result::Usage,
}

/// Why a request could not be started.
#[derive(Debug)]
pub enum StartError {
    /// No slot free and the caller asked not to queue.
    NoSlot,
    /// `gateway.queue_wait_ms` ran out; the request was cancelled.
    QueueTimeout,
    /// The fleet refused the request.
    Refused(crate::protocol::WireError),
    /// NATS could not be reached or did not answer.
    Bus(String),
    /// The gateway stopped and its drain ran out while the request waited; it was cancelled.
    Shutdown,
}

impl From<ClientError> for StartError {
    fn from(error: ClientError) -> StartError {
        match error {
            ClientError::Wire(wire) if wire.code == ErrorCode::NoSlotAvailable => {
                StartError::NoSlot
            }
            ClientError::Wire(wire) => StartError::Refused(wire),
            other => StartError::Bus(other.to_string()),
        }
    }
}

/// The refusal of a request id the caller chose that already names a request of its tenant.
fn id_in_use(request_id: &str) -> crate::protocol::WireError {
    let id =
        crate::protocol::schedule::split_qualified(request_id).map_or(request_id, |(_, id)| id);
    crate::protocol::WireError::new(
        ErrorCode::DuplicateRequestId,
        format!("request id {id} is already in use"),
    )
    .with_detail(serde_json::json!({ "param": "genfleet.request_id" }))
}

/// Between the output of a request that raised a decision and its continuation's, in one
/// completion: a blank line.
pub const CHAIN_SEPARATOR: &str = "\n\n";

/// Why the gateway cancels a request whose caller hung up (the cancelled result's detail).
const CLIENT_GONE: &str = "the caller went away (its HTTP connection to the gateway closed)";

/// Sends `gen.cancel.<id>` for the request it follows when dropped armed.
pub struct CancelGuard {
    client: Client,
    current: Arc<Mutex<Option<String>>>,
    shared: Arc<Shared>,
    tenant: String,
}

impl CancelGuard {
    fn new(shared: &Arc<Shared>, tenant: &str) -> CancelGuard {
        CancelGuard {
            client: shared.client.clone(),
            current: Arc::new(Mutex::new(None)),
            shared: shared.clone(),
            tenant: tenant.to_string(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn arm(&self, request_id: &str) {
        *self.lock() = Some(request_id.to_string());
    }

    fn disarm(&self) {
        *self.lock() = None;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        let Some(request_id) = self.lock().take() else {
            return;
        };
        self.shared.metrics.client_gone(&self.tenant);
        tracing::info!(
            message = "the caller went away: cancelling its request",
            request_id
        );
        let client = self.client.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            // A cancel that overtook the request's own submit finds nothing yet: try again.
            for _ in 0..5 {
                match client.cancel_because(&request_id, CLIENT_GONE).await {
                    Err(error) if error.code() == Some(ErrorCode::NotFound) => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(error) => {
                        tracing::warn!(message = "cancel failed", %error, request_id);
                        return;
                    }
                    Ok(_) => return,
                }
            }
        });
    }
}

/// The caller's client on the bus and the request's id there: submitted under the key's
/// tenant, a subject token the gateway's NATS user is granted (the tenant's metadata entry is
/// for people and metrics only), with its id within that tenant (`<tenant>.<id>`), so an id
/// the caller chose never reaches another tenant's request. An id the caller chose must name
/// no request of the tenant yet: following or cancelling one would be reading or ending
/// another caller's.
pub async fn prepare(
    shared: &Shared,
    mapped: &mut Mapped,
    tenant: &str,
    chosen: bool,
) -> Result<(Client, String), StartError> {
    let client = if tenant.is_empty() {
        shared.client.clone()
    } else {
        shared.client.clone().with_tenant(tenant)?
    };
    let request_id = client.on_bus(
        mapped
            .request
            .request_id
            .get_or_insert_with(crate::protocol::ids::new_id),
    );
    if chosen {
        match client.status(&request_id).await {
            Err(ClientError::Wire(error)) if error.code == ErrorCode::NotFound => {}
            Ok(_) => return Err(StartError::Refused(id_in_use(&request_id))),
            Err(error) => return Err(error.into()),
        }
    }
    Ok((client, request_id))
}

/// Puts the request on the durable queue. A queue message kept as a duplicate of one
/// published before (within the stream's window) is not this caller's request.
pub async fn enqueue(client: &Client, mapped: &Mapped) -> Result<bool, ClientError> {
    match client.enqueue(&mapped.pool, &mapped.request).await {
        Ok(queued) if queued.duplicate => Err(ClientError::Wire(id_in_use(&queued.request_id))),
        Ok(_) => Ok(false),
        Err(error) => Err(error),
    }
}

/// A request on its way: follow it with [`Run::next`].
pub struct Run {
    shared: Arc<Shared>,
    guard: CancelGuard,
    follow: Follow,
    /// Steps that came while waiting for the request to start.
    backlog: VecDeque<Step>,
    /// The first request of the chain (the completion's id).
    pub root: String,
    /// Text was sent to the caller already in this completion.
    sent_text: bool,
    /// A continuation started since: its first text is set apart from the part before it.
    separate: bool,
    usage: crate::protocol::result::Usage,
    follow_decisions: bool,
    /// Set while a decision of the chain waits for its answer.
    decision_deadline: Option<Instant>,
    pending: VecDeque<Piece>,
    done: bool,
}

impl Run {
    /// Sends the request: to a free slot at once, else (unless the caller said
    /// `queue: false`) through the durable queue, and waits until it started, up to
    /// `gateway.queue_wait_ms`.
    pub async fn start(
        shared: &Arc<Shared>,
        mut mapped: Mapped,
        tenant: &str,
        chosen: bool,
    ) -> Result<Run, StartError> {
        let (client, request_id) = prepare(shared, &mut mapped, tenant, chosen).await?;
        let follow = client
            .follow_chain(&request_id, mapped.follow_decisions)
            .await?;
        let guard = CancelGuard::new(shared, tenant);
        guard.arm(&request_id);
        let mut run = Run {
            shared: shared.clone(),
            guard,
            follow,
            backlog: VecDeque::new(),
            root: request_id,
            sent_text: false,
            separate: false,
            usage: Default::default(),
            follow_decisions: mapped.follow_decisions,
            decision_deadline: None,
            pending: VecDeque::new(),
            done: false,
        };
        let enqueue = || enqueue(&client, &mapped);
        let started = if mapped.durable {
            enqueue().await
        } else {
            match client.submit_once(&mapped.pool, &mapped.request).await {
                Ok(accepted) => Ok(accepted.state == RequestState::Running),
                Err(ClientError::Wire(error))
                    if error.code == ErrorCode::NoSlotAvailable && mapped.queue =>
                {
                    enqueue().await
                }
                Err(error) => Err(error),
            }
        };
        let started = match started {
            Ok(started) => started,
            Err(error) => {
                run.guard.disarm();
                return Err(error.into());
            }
        };
        if !started {
            run.wait_started().await?;
        }
        Ok(run)
    }

    /// The request's id as its caller knows it: the bus's id without the tenant token (a
    /// caller of the gateway only ever sees its own tenant's requests).
    pub fn caller_id(&self) -> &str {
        crate::protocol::schedule::split_qualified(&self.root).map_or(&self.root, |(_, id)| id)
    }

    /// Waits until the request started (or ended), keeping the steps that came.
    async fn wait_started(&mut self) -> Result<(), StartError> {
        let wait = self.shared.settings.gateway.queue_wait_ms;
        let deadline = (wait > 0).then(|| Instant::now() + Duration::from_millis(wait));
        let abort = self.shared.abort.clone();
        loop {
            tokio::select! {
                _ = abort.cancelled() => {
                    self.guard.disarm();
                    let _ = self.shared.client.cancel(self.follow.current()).await;
                    return Err(StartError::Shutdown);
                }
                step = self.follow.next() => {
                    let Some(step) = step else {
                        return Err(StartError::Bus("the bus connection closed".into()));
                    };
                    if let Step::Lost(Lost::BusClosed) = step {
                        return Err(StartError::Bus("the bus connection closed".into()));
                    }
                    let queued = matches!(step, Step::ToolCall { .. } | Step::ToolResult { .. });
                    self.backlog.push_back(step);
                    if !queued {
                        return Ok(());
                    }
                }
                _ = sleep_until(deadline) => {
                    self.guard.disarm();
                    // Had it started meanwhile, the cancel ends it too: the caller is told
                    // it timed out either way.
                    let _ = self.shared.client.cancel(self.follow.current()).await;
                    return Err(StartError::QueueTimeout);
                }
            }
        }
    }

    /// The next piece for the caller; `None` after the end.
    pub async fn next(&mut self) -> Option<Piece> {
        loop {
            if let Some(piece) = self.pending.pop_front() {
                return Some(piece);
            }
            if self.done {
                return None;
            }
            let step = match self.backlog.pop_front() {
                Some(step) => step,
                None => {
                    let abort = self.shared.abort.clone();
                    tokio::select! {
                        biased;
                        _ = abort.cancelled() => {
                            self.end_on_shutdown().await;
                            continue;
                        }
                        step = self.follow.next() => match step {
                            Some(step) => step,
                            // The follow ends with its last part's result or the chain's end:
                            // a follow that stops without either lost the bus.
                            None => Step::Lost(Lost::BusClosed),
                        },
                        _ = sleep_until(self.decision_deadline) => {
                            self.end_decision_wait().await;
                            continue;
                        }
                    }
                }
            };
            self.on_step(step);
        }
    }

    fn on_step(&mut self, step: Step) {
        match step {
            Step::Text(text) => self.push_text(text),
            Step::Reasoning(text) => self.pending.push_back(Piece::Reasoning(text)),
            Step::Ended(result) => self.on_result(*result),
            Step::Continued { request_id } => {
                tracing::debug!(message = "following the continuation", request_id = %request_id, root = %self.root);
                self.guard.arm(&request_id);
                self.separate = self.sent_text;
                self.decision_deadline = None;
            }
            Step::ChainEnded { outcome } => {
                self.finish(ending_of_chain(outcome), "the decision ended the chain")
            }
            Step::Lost(Lost::BusClosed) => self.fail(
                503,
                "api_connection_error",
                "bus_closed",
                "the gateway lost the bus connection".into(),
            ),
            Step::Lost(Lost::Result(message)) => {
                self.fail(502, "server_error", "result_unavailable", message)
            }
            Step::Lost(Lost::Continuation(message)) => {
                self.fail(503, "api_connection_error", "bus_unavailable", message)
            }
            Step::Started { .. } | Step::ToolCall { .. } | Step::ToolResult { .. } => {}
        }
    }

    fn on_result(&mut self, result: GenerationResult) {
        self.usage.add(result.usage);
        let client = self.shared.client.clone();
        let id = result.request_id.clone();
        let has_decision = result.signals.iter().any(|s| s.decision.is_some());
        let waits =
            result.reason == Reason::DecisionRequested && self.follow_decisions && has_decision;
        if waits {
            let wait = Duration::from_millis(self.shared.settings.gateway.decision_wait_ms);
            self.decision_deadline = Some(Instant::now() + wait);
            return;
        }
        // The caller gets all of it: the stored copy is released.
        tokio::spawn(async move {
            let _ = client.result(&id, true).await;
        });
        let message = result
            .detail
            .clone()
            .unwrap_or_else(|| format!("the request ended {}", result.reason.as_str()));
        self.guard.disarm();
        self.done = true;
        self.pending.push_back(Piece::End(End {
            ending: ending_of(result.reason),
            message,
            tool_calls: result.tool_calls,
            usage: self.usage,
        }));
    }

    /// Text for the caller. The parts of a decision chain are one completion, each part set
    /// apart from the one before by [`CHAIN_SEPARATOR`].
    fn push_text(&mut self, text: String) {
        if text.is_empty() {
            return;
        }
        if std::mem::take(&mut self.separate) {
            self.pending
                .push_back(Piece::Text(CHAIN_SEPARATOR.to_string()));
        }
        self.sent_text = true;
        self.pending.push_back(Piece::Text(text));
    }

    async fn end_decision_wait(&mut self) {
        // Cancelling a request that waits on its decision expires the decision.
        let _ = self.shared.client.cancel(self.follow.current()).await;
        self.finish(
            DECISION_TIMEOUT,
            "no answer to the decision within gateway.decision_wait_ms",
        );
    }

    async fn end_on_shutdown(&mut self) {
        let _ = self.shared.client.cancel(self.follow.current()).await;
        self.fail(
            503,
            "server_error",
            "gateway_shutdown",
            "the gateway is shutting down: the request was cancelled".into(),
        );
    }

    fn finish(&mut self, finish: &'static str, message: &str) {
        self.guard.disarm();
        self.done = true;
        self.pending.push_back(Piece::End(End {
            ending: Ending::Finish(finish),
            message: message.into(),
            tool_calls: Vec::new(),
            usage: self.usage,
        }));
    }

    fn fail(&mut self, status: u16, kind: &'static str, code: &'static str, message: String) {
        self.guard.disarm();
        self.done = true;
        self.pending.push_back(Piece::End(End {
            ending: Ending::Error { status, kind, code },
            message,
            tool_calls: Vec::new(),
            usage: self.usage,
        }));
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
