//! The gateway's HTTP side.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/chat/completions` | a completion, whole or streamed (`stream: true`) |
//! | `/v1/responses...` | the Responses API ([`super::responses`]) |
//! | `GET /v1/models` | the model names served: each pool, and the names of `gateway.models` |
//! | `GET /healthz` | `ok` while the process serves |
//! | `GET /readyz` | 200 while connected to NATS and not stopping, else 503 |
//! | `GET /metrics` | Prometheus text |
//!
//! Failures are OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`
//! ([`super::error`]). A completion's answer is assembled in [`super::answer`], whole, or in
//! [`super::stream`], streamed.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use super::Shared;
use super::answer::{Answer, response_id};
use super::error::{ApiError, REQUEST_ID_HEADER};
use super::mapping::{Mapped, map_request};
use super::openai::{ChatRequest, parse_request};
use super::run::Run;
use crate::protocol::RequestLimits;
use crate::telemetry::{self, KeyValue};
use tracing::Instrument;

/// The gateway's routes, with `apis` (the Responses API's) beside its own.
pub fn router(shared: Arc<Shared>, apis: Router<Arc<Shared>>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .route("/scaling", get(scaling))
        .merge(apis)
        .fallback(|| async {
            ApiError::new(404, "invalid_request_error", "not_found", "no such route")
                .into_response()
        })
        .layer(DefaultBodyLimit::max(
            shared.settings.gateway.max_body_bytes,
        ))
        .with_state(shared)
}

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

/// This replica's load as JSON, for an autoscaler (KEDA's metrics-api scaler, with
/// `metricType: Value`: each replica tells its own share): the chat completions in progress.
async fn scaling(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(serde_json::json!({
        "open_responses": shared.metrics.open_responses().max(0),
    }))
    .into_response()
}

/// The caller's tenant ("" with no keys configured), from its API key: as an extractor, a
/// handler that takes it answers 401 before anything else when the key is missing or wrong.
pub(super) struct Tenant(pub String);

impl axum::extract::FromRequestParts<Arc<Shared>> for Tenant {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        shared: &Arc<Shared>,
    ) -> Result<Tenant, Response> {
        authorize(shared, &parts.headers)
            .map(Tenant)
            .map_err(|error| error.into_response())
    }
}

/// The caller's tenant ("" with no keys configured), or the 401 to send.
pub(super) fn authorize(shared: &Shared, headers: &HeaderMap) -> Result<String, Box<ApiError>> {
    let authorization = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    shared
        .keys
        .tenant_of(authorization)
        .map(Option::unwrap_or_default)
        .map_err(|refused| Box::new(ApiError::unauthorized(refused)))
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

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The span of one request (`name`, on `route`), from the request to the last byte of the
/// answer: a child of the caller's `traceparent`, and the parent of the fleet's spans of the
/// requests it submits.
pub(super) fn request_span(
    headers: &HeaderMap,
    name: &'static str,
    route: &'static str,
) -> tracing::Span {
    if !telemetry::exporting() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!("gateway_request", otel.name = name, otel.kind = "server");
    let traceparent = headers.get("traceparent").and_then(|v| v.to_str().ok());
    telemetry::set_parent(&span, traceparent);
    telemetry::annotate(
        &span,
        vec![
            KeyValue::new("http.request.method", "POST"),
            KeyValue::new("http.route", route),
        ],
    );
    span
}

/// The body, or the error to answer when it cannot be read (too large, cut short).
pub(super) fn read_body(
    shared: &Shared,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, Box<ApiError>> {
    body.map_err(|rejection| {
        let status = rejection.status().as_u16();
        let code = if status == 413 {
            "payload_too_large"
        } else {
            "invalid_request"
        };
        Box::new(ApiError::new(
            status,
            "invalid_request_error",
            code,
            format!(
                "the body cannot be read: {rejection} (at most gateway.max_body_bytes, {} bytes)",
                shared.settings.gateway.max_body_bytes
            ),
        ))
    })
}

/// The 503 of a request that came after the gateway began to stop.
pub(super) fn stopping() -> ApiError {
    ApiError::new(
        503,
        "server_error",
        "gateway_shutdown",
        "the gateway is stopping",
    )
}

/// The 404 of a model name that neither a pool nor `gateway.models` serves.
pub(super) fn model_not_found(model: &str) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        "model_not_found",
        format!(
            "The model `{}` does not exist: it is neither a pool of the fleet nor a name \
             of gateway.models (GET /v1/models lists them)",
            crate::protocol::text::one_line(model)
        ),
    )
    .with_param("model")
}

async fn chat_completions(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let span = request_span(
        &headers,
        "POST /v1/chat/completions",
        "/v1/chat/completions",
    );
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
    let body = match read_body(&shared, body) {
        Ok(body) => body,
        Err(error) => return error.into_response(),
    };
    if shared.stopping.is_cancelled() {
        return stopping().into_response();
    }
    let chat = match parse_request(&body) {
        Ok(chat) => chat,
        Err(field) => return ApiError::bad(field).into_response(),
    };
    let model = chat.model.clone();
    let mapped = match map_chat(&shared, &tenant, chat).await {
        Ok(mapped) => mapped,
        Err(error) => return error.into_response(),
    };
    let open = shared.metrics.open();
    let pool = mapped.pool.clone();
    let stream = mapped.stream;
    let include_usage = mapped.include_usage;
    let run = match start(&shared, mapped, &tenant).await {
        Ok(run) => run,
        Err(error) => {
            shared
                .metrics
                .answered(&tenant, &pool, error.code(), stream);
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

/// A chat request mapped onto a generation request of the caller's tenant, routed to its
/// pool.
pub(super) async fn map_chat(
    shared: &Shared,
    tenant: &str,
    chat: ChatRequest,
) -> Result<Mapped, Box<ApiError>> {
    let model = chat.model.clone();
    let Some(route) = shared.pools.route(&shared.client, &model).await else {
        shared
            .metrics
            .answered(tenant, "", "model_not_found", chat.stream == Some(true));
        return Err(Box::new(model_not_found(&model)));
    };
    let limits = RequestLimits {
        max_metadata_bytes: shared.settings.limits.max_metadata_bytes,
        ..RequestLimits::default()
    };
    let tenant = (!tenant.is_empty()).then_some(tenant);
    map_request(
        chat,
        route,
        tenant,
        shared.settings.gateway.max_request_ms,
        &limits,
    )
    .map_err(|field| Box::new(ApiError::bad(field)))
}

pub(super) async fn start(
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
            let mut api = ApiError::not_started(error, shared.settings.gateway.queue_wait_ms);
            api.request_id = request_id;
            Box::new(api)
        })
}
