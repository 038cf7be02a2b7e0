//! The gateway's HTTP side.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/chat/completions` | a completion, whole or streamed (`stream: true`) |
//! | `GET /v1/models` | the model names served: each pool, and the names of `gateway.models` |
//! | `GET /healthz` | `ok` while the process serves |
//! | `GET /readyz` | 200 while connected to NATS and not stopping, else 503 |
//! | `GET /metrics` | Prometheus text |
//!
//! Failures are OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::stream;
use serde_json::json;

use super::Shared;
use super::keys::Refused;
use super::mapping::{Ending, Mapped, map_request};
use super::openai::{
    AssistantMessage, BadField, Chunk, ChunkChoice, Completion, CompletionChoice, Delta, ErrorBody,
    ErrorObject, ToolCallDelta, Usage, parse_request,
};
use super::run::{Piece, Run, StartError};
use crate::protocol::{ErrorCode, RequestLimits};
use crate::telemetry::{self, KeyValue};
use tracing::Instrument;

/// Comment lines on a quiet stream (a decision waiting for its answer), so that proxies and
/// clients keep it open.
const KEEP_ALIVE: Duration = Duration::from_secs(10);
/// The header that names the request (the first of its chain) on every completion.
const REQUEST_ID_HEADER: &str = "x-genfleet-request-id";

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::new(404, "invalid_request_error", "not_found", "no such route")
                .into_response()
        })
        .layer(DefaultBodyLimit::max(
            shared.settings.gateway.max_body_bytes,
        ))
        .with_state(shared)
}

/// An error as OpenAI writes it.
#[derive(Debug)]
pub struct ApiError {
    status: u16,
    kind: &'static str,
    code: String,
    message: String,
    param: Option<String>,
    retry_after: Option<u64>,
    request_id: Option<String>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            code: code.into(),
            message: message.into(),
            param: None,
            retry_after: None,
            request_id: None,
        }
    }

    fn bad(field: BadField) -> ApiError {
        ApiError {
            param: field.param,
            ..ApiError::new(
                400,
                "invalid_request_error",
                "invalid_request",
                field.message,
            )
        }
    }

    fn body(&self) -> String {
        serde_json::to_string(&ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: &self.code,
            },
        })
        .expect("errors serialize")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body(),
        )
            .into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Some(id) = &self.request_id
            && let Ok(value) = HeaderValue::from_str(id)
        {
            response.headers_mut().insert(REQUEST_ID_HEADER, value);
        }
        // OpenAI's SDKs retry 408, 409, 429 and 5xx unless told: only what another try may
        // mend is retried.
        let retry = if super::mapping::should_retry(&self.code) {
            "true"
        } else {
            "false"
        };
        response
            .headers_mut()
            .insert(SHOULD_RETRY_HEADER, HeaderValue::from_static(retry));
        response
    }
}

/// The header OpenAI's SDKs read to decide whether to send a failed request again.
const SHOULD_RETRY_HEADER: &str = "x-should-retry";

async fn ready(State(shared): State<Arc<Shared>>) -> Response {
    let connected =
        shared.client.nats().connection_state() == async_nats::connection::State::Connected;
    if connected && !shared.stopping.is_cancelled() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        shared.metrics.render(),
    )
        .into_response()
}

/// The caller's tenant ("" with no keys configured), or the 401 to send.
fn authorize(shared: &Shared, headers: &HeaderMap) -> Result<String, Box<ApiError>> {
    let authorization = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match shared.keys.tenant_of(authorization) {
        Ok(tenant) => Ok(tenant.unwrap_or_default()),
        Err(refused) => {
            let message = match refused {
                Refused::Missing => {
                    "You didn't provide an API key. Provide it as 'Authorization: Bearer <key>'."
                }
                Refused::Wrong => "Incorrect API key provided.",
            };
            Err(Box::new(ApiError::new(
                401,
                "invalid_request_error",
                "invalid_api_key",
                message,
            )))
        }
    }
}

async fn models(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(error) = authorize(&shared, &headers) {
        return error.into_response();
    }
    let data: Vec<_> = shared
        .pools
        .list(&shared.client)
        .await
        .into_iter()
        .map(|(name, pool)| {
            json!({"id": name, "object": "model", "created": 0, "owned_by": "genfleet",
                   "genfleet": {"pool": pool}})
        })
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The span of one completion, from the request to the last byte of the answer: a child of
/// the caller's `traceparent`, and the parent of the fleet's spans of the requests it submits.
fn completion_span(headers: &HeaderMap) -> tracing::Span {
    if !telemetry::exporting() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "chat_completion",
        otel.name = "POST /v1/chat/completions",
        otel.kind = "server"
    );
    let traceparent = headers.get("traceparent").and_then(|v| v.to_str().ok());
    telemetry::set_parent(&span, traceparent);
    telemetry::annotate(
        &span,
        vec![
            KeyValue::new("http.request.method", "POST"),
            KeyValue::new("http.route", "/v1/chat/completions"),
        ],
    );
    span
}

async fn chat_completions(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let span = completion_span(&headers);
    chat_completion(shared, headers, body, span.clone())
        .instrument(span)
        .await
}

async fn chat_completion(
    shared: Arc<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    span: tracing::Span,
) -> Response {
    let tenant = match authorize(&shared, &headers) {
        Ok(tenant) => tenant,
        Err(error) => return error.into_response(),
    };
    let body = match body {
        Ok(body) => body,
        Err(rejection) => {
            let status = rejection.status().as_u16();
            let code = if status == 413 {
                "payload_too_large"
            } else {
                "invalid_request"
            };
            return ApiError::new(
                status,
                "invalid_request_error",
                code,
                format!(
                    "the body cannot be read: {rejection} (at most gateway.max_body_bytes, {} bytes)",
                    shared.settings.gateway.max_body_bytes
                ),
            )
            .into_response();
        }
    };
    if shared.stopping.is_cancelled() {
        return ApiError::new(
            503,
            "server_error",
            "gateway_shutdown",
            "the gateway is stopping",
        )
        .into_response();
    }
    let chat = match parse_request(&body) {
        Ok(chat) => chat,
        Err(field) => return ApiError::bad(field).into_response(),
    };
    let model = chat.model.clone();
    let Some(route) = shared.pools.route(&shared.client, &model).await else {
        shared
            .metrics
            .answered(&tenant, "", "model_not_found", chat.stream == Some(true));
        return ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                404,
                "invalid_request_error",
                "model_not_found",
                format!(
                    "The model `{}` does not exist: it is neither a pool of the fleet nor a name \
                     of gateway.models (GET /v1/models lists them)",
                    crate::protocol::text::one_line(&model)
                ),
            )
        }
        .into_response();
    };
    let limits = RequestLimits {
        max_metadata_bytes: shared.settings.limits.max_metadata_bytes,
        ..RequestLimits::default()
    };
    let tenant_opt = (!tenant.is_empty()).then_some(tenant.as_str());
    let mapped = match map_request(
        chat,
        route,
        tenant_opt,
        shared.settings.gateway.max_request_ms,
        &limits,
    ) {
        Ok(mapped) => mapped,
        Err(field) => return ApiError::bad(field).into_response(),
    };
    let open = shared.metrics.open();
    let pool = mapped.pool.clone();
    let stream = mapped.stream;
    let include_usage = mapped.include_usage;
    let run = match start(&shared, mapped, &tenant).await {
        Ok(run) => run,
        Err(error) => {
            shared.metrics.answered(&tenant, &pool, &error.code, stream);
            return error.into_response();
        }
    };
    let mut attributes = vec![
        KeyValue::new("genfleet.request_id", run.root.clone()),
        KeyValue::new("genfleet.pool", pool.clone()),
        KeyValue::new("gen_ai.request.model", model.clone()),
    ];
    if !tenant.is_empty() {
        attributes.push(KeyValue::new("genfleet.tenant", tenant.clone()));
    }
    telemetry::annotate(&span, attributes);
    let answer = Answer {
        shared: shared.clone(),
        _span: span,
        id: format!("chatcmpl-{}", run.caller_id()),
        request_id: run.caller_id().to_string(),
        created: now_secs(),
        model,
        tenant,
        pool,
        include_usage,
        _open: open,
    };
    let mut response = if stream {
        answer.stream(run)
    } else {
        answer.whole(run).await
    };
    if let Ok(value) = HeaderValue::from_str(&response_id(&response)) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

/// The request id put in the response's extensions by [`Answer`].
fn response_id(response: &Response) -> String {
    response
        .extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_default()
}

#[derive(Clone)]
struct RequestId(String);

async fn start(
    shared: &Arc<Shared>,
    mut mapped: Mapped,
    tenant: &str,
) -> Result<Run, Box<ApiError>> {
    // Named here, so that an error after the request was sent names it too.
    let chosen = mapped.request.request_id.is_some();
    let request_id = Some(
        mapped
            .request
            .request_id
            .get_or_insert_with(crate::protocol::ids::new_id)
            .clone(),
    );
    Run::start(shared, mapped, tenant, chosen)
        .await
        .map_err(|error| {
            let mut api = match error {
                StartError::NoSlot => ApiError {
                    retry_after: Some(1),
                    ..ApiError::new(
                        429,
                        "rate_limit_error",
                        "no_slot_available",
                        "no worker of the pool has a free slot (genfleet.queue is false: the \
                     request was not queued)",
                    )
                },
                StartError::QueueTimeout => ApiError {
                    retry_after: Some(1),
                    ..ApiError::new(
                        503,
                        "server_error",
                        "queue_timeout",
                        format!(
                            "no slot freed within gateway.queue_wait_ms ({} ms): the request was \
                         cancelled",
                            shared.settings.gateway.queue_wait_ms
                        ),
                    )
                },
                StartError::Refused(wire) => {
                    let status = match wire.code {
                        ErrorCode::NoSlotAvailable => 429,
                        code => code.http_status(),
                    };
                    let kind = match status {
                        400..=499 => "invalid_request_error",
                        _ => "server_error",
                    };
                    let code = wire.code.as_str().to_ascii_lowercase();
                    ApiError::new(status, kind, &code, wire.message)
                }
                StartError::Shutdown => ApiError::new(
                    503,
                    "server_error",
                    "gateway_shutdown",
                    "the gateway is shutting down: the request was cancelled",
                ),
                StartError::Bus(message) => ApiError::new(
                    503,
                    "api_connection_error",
                    "bus_unavailable",
                    format!("the fleet cannot be reached: {message}"),
                ),
            };
            api.request_id = request_id;
            Box::new(api)
        })
}

/// What a completion's answer needs besides its run.
struct Answer {
    shared: Arc<Shared>,
    id: String,
    request_id: String,
    created: u64,
    model: String,
    tenant: String,
    pool: String,
    include_usage: bool,
    _open: super::metrics::OpenGuard,
    /// The completion's span, open until the answer (a stream's last event included) is sent.
    _span: tracing::Span,
}

impl Answer {
    /// The whole completion, once the chain ended. The run (and its cancel guard) lives in
    /// this future: a caller that hangs up drops it.
    async fn whole(self, mut run: Run) -> Response {
        let (mut content, mut reasoning) = (String::new(), String::new());
        let end = loop {
            match run.next().await {
                Some(Piece::Text(text)) => content.push_str(&text),
                Some(Piece::Reasoning(text)) => reasoning.push_str(&text),
                Some(Piece::End(end)) => break end,
                None => unreachable!("a run ends with its End piece"),
            }
        };
        let mut response = match end.ending {
            Ending::Finish(finish) => {
                self.shared
                    .metrics
                    .answered(&self.tenant, &self.pool, finish, false);
                let completion = Completion {
                    id: self.id.clone(),
                    object: "chat.completion",
                    created: self.created,
                    model: self.model.clone(),
                    choices: [CompletionChoice {
                        index: 0,
                        message: AssistantMessage {
                            role: "assistant",
                            content: (!content.is_empty() || end.tool_calls.is_empty())
                                .then_some(content),
                            reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
                            tool_calls: end.tool_calls,
                        },
                        logprobs: None,
                        finish_reason: finish.to_string(),
                    }],
                    usage: Usage::from(end.usage),
                };
                axum::Json(completion).into_response()
            }
            Ending::Error { status, kind, code } => {
                self.shared
                    .metrics
                    .answered(&self.tenant, &self.pool, code, false);
                ApiError::new(status, kind, code, end.message).into_response()
            }
        };
        response
            .extensions_mut()
            .insert(RequestId(self.request_id.clone()));
        response
    }

    /// Server-sent `chat.completion.chunk`s, then `data: [DONE]`; a failure after the start is
    /// an `error` object in place of the last chunk (OpenAI's SDKs raise it). The run lives in
    /// the stream: a caller that hangs up drops it.
    fn stream(self, run: Run) -> Response {
        let request_id = self.request_id.clone();
        let state = StreamState {
            answer: self,
            run,
            started: false,
            finished: false,
        };
        let events = stream::unfold(state, |mut state| async move {
            let frames = state.step().await?;
            Some((
                stream::iter(frames.into_iter().map(Ok::<_, Infallible>)),
                state,
            ))
        });
        let events = futures_util::StreamExt::flatten(events);
        let mut response = Sse::new(events)
            .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
            .into_response();
        response.extensions_mut().insert(RequestId(request_id));
        response
    }
}

struct StreamState {
    answer: Answer,
    run: Run,
    started: bool,
    finished: bool,
}

impl StreamState {
    fn chunk(&self, delta: Delta<'_>, finish: Option<&str>) -> SseEvent {
        let chunk = Chunk {
            id: &self.answer.id,
            object: "chat.completion.chunk",
            created: self.answer.created,
            model: &self.answer.model,
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason: finish,
            }],
            usage: self.answer.include_usage.then_some(None),
        };
        SseEvent::default().data(serde_json::to_string(&chunk).expect("chunks serialize"))
    }

    /// The next frames, `None` once the stream is over.
    async fn step(&mut self) -> Option<Vec<SseEvent>> {
        if self.finished {
            return None;
        }
        let mut frames = Vec::new();
        if !self.started {
            self.started = true;
            frames.push(self.chunk(
                Delta {
                    role: Some("assistant"),
                    content: Some(""),
                    ..Default::default()
                },
                None,
            ));
        }
        let piece = self.run.next().await;
        match piece {
            Some(Piece::Text(text)) => frames.push(self.chunk(
                Delta {
                    content: Some(&text),
                    ..Default::default()
                },
                None,
            )),
            Some(Piece::Reasoning(text)) => frames.push(self.chunk(
                Delta {
                    reasoning_content: Some(&text),
                    ..Default::default()
                },
                None,
            )),
            Some(Piece::End(end)) => {
                self.finished = true;
                let metrics = &self.answer.shared.metrics;
                match end.ending {
                    Ending::Finish(finish) => {
                        metrics.answered(&self.answer.tenant, &self.answer.pool, finish, true);
                        if !end.tool_calls.is_empty() {
                            let calls = end
                                .tool_calls
                                .iter()
                                .enumerate()
                                .map(|(index, call)| ToolCallDelta {
                                    index,
                                    id: &call.id,
                                    kind: &call.kind,
                                    function: &call.function,
                                })
                                .collect();
                            frames.push(self.chunk(
                                Delta {
                                    tool_calls: Some(calls),
                                    ..Default::default()
                                },
                                None,
                            ));
                        }
                        frames.push(self.chunk(Delta::default(), Some(finish)));
                        if self.answer.include_usage {
                            let chunk = Chunk {
                                id: &self.answer.id,
                                object: "chat.completion.chunk",
                                created: self.answer.created,
                                model: &self.answer.model,
                                choices: Vec::new(),
                                usage: Some(Some(Usage::from(end.usage))),
                            };
                            frames
                                .push(SseEvent::default().data(
                                    serde_json::to_string(&chunk).expect("chunks serialize"),
                                ));
                        }
                        frames.push(SseEvent::default().data("[DONE]"));
                    }
                    Ending::Error { status, kind, code } => {
                        metrics.answered(&self.answer.tenant, &self.answer.pool, code, true);
                        let error = ApiError::new(status, kind, code, end.message);
                        frames.push(SseEvent::default().data(error.body()));
                    }
                }
            }
            None => self.finished = true,
        }
        Some(frames)
    }
}
