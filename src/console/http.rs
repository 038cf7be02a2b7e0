//! The console's HTTP side: the page, its JSON API and its live streams.
//!
//! | route | what |
//! |---|---|
//! | `GET /` (and `/app.js`, `/app.css`, `/favicon.svg`) | the page, embedded in the binary |
//! | `GET /api/snapshot` | everything the console knows, as JSON |
//! | `GET /api/stream` | server-sent events: `snapshot`, then `inbox`, `inbox_removed`, `signal`, `fleet`, `links` |
//! | `GET /api/requests?state=&pool=&job=&tenant=&id=&limit=` | the requests list, newest first, filtered |
//! | `GET /api/requests/{id}` | `{"status", "result"}`: the request's status and its result, peeked |
//! | `GET /api/requests/{id}/timeline` | the request as the list knows it, with its timeline |
//! | `POST /api/requests/{id}/cancel` | cancels it (`gen.cancel.<id>`): `{"user"}` → the fleet's reply |
//! | `GET /api/batches` | `{"batches", "total", "max"}`: the gateway's batches of every tenant with their progress, newest first |
//! | `GET /api/requests/{id}/stream` | server-sent events: `status` (or `status_error`), `result` (or `result_error`) when it is terminal, then every `event` of `gen.events.<id>` |
//! | `POST /api/session` | checks the token and a name: `{"user"}` → `{"decided_by"}` |
//! | `POST /api/decisions/{decision_id}` | answers: `{"user", "option_id", "rationale"?, "modified_prompt"?, "guidance"?, "confidence_boost"?}` → the fleet's reply |
//! | `GET /healthz` | `ok` |
//!
//! Failures are the wire's error shape, `{"error": {"code", "message", "detail"}}`, with the
//! HTTP status of the code (UNAUTHORIZED is 403).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::{Stream, StreamExt, stream};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;

use super::auth::Refusal;
use super::requests::RequestFilter;
use super::{Push, Shared, assets};
use crate::client::ClientError;
use crate::protocol::schedule::is_valid_qualified_id;
use crate::protocol::{DecisionAnswer, ErrorCode, WireError};

/// Largest body the console reads (an answer with a modified prompt).
const MAX_BODY: usize = 256 * 1024;
/// Comment lines on idle streams, so proxies and browsers keep them open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// The page's rules for the browser: nothing but its own scripts and styles, nowhere to
/// connect but the console, never inside a frame.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route(
            "/",
            get(|| async { page(assets::INDEX_HTML, "text/html; charset=utf-8") }),
        )
        .route(
            "/app.js",
            get(|| async { page(assets::APP_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/app.css",
            get(|| async { page(assets::APP_CSS, "text/css; charset=utf-8") }),
        )
        .route(
            "/favicon.svg",
            get(|| async { page(assets::FAVICON_SVG, "image/svg+xml") }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/api/snapshot", get(snapshot))
        .route("/api/stream", get(live))
        .route("/api/requests", get(requests))
        .route("/api/requests/{id}", get(request))
        .route("/api/requests/{id}/stream", get(request_stream))
        .route("/api/requests/{id}/timeline", get(timeline))
        .route("/api/requests/{id}/cancel", post(cancel))
        .route("/api/batches", get(batches))
        .route("/api/session", post(session))
        .route("/api/decisions/{decision_id}", post(decide))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn_with_state(shared.clone(), guard))
        .with_state(shared)
}

/// Every request: the Host check, and the headers that keep the page to itself.
async fn guard(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    if let Err(refusal) = shared.gate.check_host(request.headers()) {
        return refused(refusal);
    }
    let api = request.uri().path().starts_with("/api/");
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    headers.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
    if api {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

fn page(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

fn error(status: StatusCode, error: &WireError) -> Response {
    (status, axum::Json(error.to_reply())).into_response()
}

fn refused(refusal: Refusal) -> Response {
    error(refusal.status, &refusal.error)
}

fn wire_status(code: ErrorCode) -> StatusCode {
    StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// A client failure as the wire error it amounts to, with its HTTP status.
fn client_error(failure: ClientError) -> (StatusCode, WireError) {
    match failure {
        ClientError::Wire(error) => (wire_status(error.code), error),
        ClientError::Transport(message) => (
            StatusCode::SERVICE_UNAVAILABLE,
            WireError::new(ErrorCode::Internal, message),
        ),
        ClientError::Timeout(after) => (
            StatusCode::GATEWAY_TIMEOUT,
            WireError::new(
                ErrorCode::Internal,
                format!("the fleet did not answer within {after:?}"),
            ),
        ),
    }
}

fn too_many_streams(max: usize) -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        &WireError::new(
            ErrorCode::Internal,
            format!("the console already serves {max} live streams (console.max_clients)"),
        ),
    )
}

fn sse_event(push: &Push) -> SseEvent {
    SseEvent::default().event(push.event).data(&push.data)
}

fn sse(events: impl Stream<Item = SseEvent> + Send + 'static) -> Response {
    let mut response = Sse::new(events.map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response();
    // Proxies that buffer would hold the stream back.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

async fn snapshot(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(shared.snapshot()).into_response()
}

/// The page's live stream: a snapshot, then every change. A page too slow to keep up gets a
/// fresh snapshot rather than a backlog.
async fn live(State(shared): State<Arc<Shared>>) -> Response {
    let Ok(permit) = shared.clients.clone().try_acquire_owned() else {
        return too_many_streams(shared.settings.console.max_clients);
    };
    let (first, receiver) = shared.subscribe();
    let start = (shared, receiver, Some(first), permit);
    let events = stream::unfold(start, |(shared, mut receiver, first, permit)| async move {
        if let Some(first) = first {
            return Some((sse_event(&first), (shared, receiver, None, permit)));
        }
        let next = tokio::select! {
            _ = shared.shutdown.cancelled() => return None,
            next = receiver.recv() => next,
        };
        match next {
            Ok(push) => Some((sse_event(&push), (shared, receiver, None, permit))),
            Err(RecvError::Lagged(_)) => {
                let (snapshot, fresh) = shared.subscribe();
                Some((sse_event(&snapshot), (shared, fresh, None, permit)))
            }
            Err(RecvError::Closed) => None,
        }
    });
    sse(events)
}

fn bad_request(message: String) -> Refusal {
    Refusal::new(StatusCode::BAD_REQUEST, ErrorCode::InvalidRequest, message)
}

fn check_id(id: &str) -> Result<(), Refusal> {
    if is_valid_qualified_id(id) {
        Ok(())
    } else {
        Err(bad_request(format!(
            "{id:?} is not an id (1-128 characters of A-Z, a-z, 0-9, '_' or '-', or <tenant>.<id> for a tenant's request)"
        )))
    }
}

/// The request's status and, when it is terminal, its result (peeked: the caller still gets
/// it). Each is `{"error": ...}` when the fleet refused it.
async fn status_and_result(shared: &Shared, id: &str) -> Vec<(&'static str, Value)> {
    let mut found = Vec::new();
    match shared.client.status(id).await {
        Ok(status) => {
            let terminal = status.state.is_terminal();
            found.push(("status", json!(status)));
            if terminal {
                match shared.client.result(id, false).await {
                    Ok(result) => found.push(("result", json!(result))),
                    Err(failure) => {
                        found.push(("result_error", json!(client_error(failure).1.to_reply())))
                    }
                }
            }
        }
        Err(failure) => found.push(("status_error", json!(client_error(failure).1.to_reply()))),
    }
    found
}

async fn request(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    if let Err(refusal) = check_id(&id) {
        return refused(refusal);
    }
    let mut body = serde_json::Map::new();
    for (name, value) in status_and_result(&shared, &id).await {
        body.insert(name.to_string(), value);
    }
    axum::Json(Value::Object(body)).into_response()
}

/// One request, live: what it is now, then every event it publishes. Subscribed before the
/// status is asked, so nothing falls between the two.
async fn request_stream(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    if let Err(refusal) = check_id(&id) {
        return refused(refusal);
    }
    let Ok(permit) = shared.clients.clone().try_acquire_owned() else {
        return too_many_streams(shared.settings.console.max_clients);
    };
    let nats = shared.client.nats();
    let subject = shared.client.subjects().events(&id);
    let subscribed = async {
        let sub = nats
            .subscribe(subject.clone())
            .await
            .map_err(|e| e.to_string())?;
        nats.flush().await.map_err(|e| e.to_string())?;
        Ok::<_, String>(sub)
    };
    let sub = match subscribed.await {
        Ok(sub) => sub,
        Err(problem) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                &WireError::new(
                    ErrorCode::Internal,
                    format!("cannot follow {subject}: {problem}"),
                ),
            );
        }
    };
    let first: Vec<SseEvent> = status_and_result(&shared, &id)
        .await
        .into_iter()
        .map(|(name, value)| SseEvent::default().event(name).data(value.to_string()))
        .collect();
    let events = sub.filter_map(|message| async move {
        // Events are JSON; anything else on the subject is not passed on.
        let text = std::str::from_utf8(&message.payload).ok()?;
        serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
        Some(SseEvent::default().event("event").data(text))
    });
    let stop = shared.shutdown.clone();
    let events = stream::iter(first)
        .chain(events)
        .take_until(async move { stop.cancelled().await })
        .map(move |event| {
            // The stream holds its place among the live streams until it ends.
            let _held = &permit;
            event
        });
    sse(events)
}

/// The requests list, filtered.
async fn requests(
    State(shared): State<Arc<Shared>>,
    filter: Result<Query<RequestFilter>, QueryRejection>,
) -> Response {
    match filter {
        Ok(Query(filter)) => {
            axum::Json(shared.read(|state| state.requests.list(&filter))).into_response()
        }
        Err(rejection) => refused(bad_request(format!(
            "{} (filters: state, pool, job, tenant, id, limit)",
            rejection.body_text()
        ))),
    }
}

/// One request as the list knows it, with its timeline.
async fn timeline(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    if let Err(refusal) = check_id(&id) {
        return refused(refusal);
    }
    match shared.read(|state| state.requests.get(&id)) {
        Some(detail) => axum::Json(detail).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            &WireError::new(
                ErrorCode::NotFound,
                format!(
                    "the console has not seen request {id} (it keeps the newest {} requests, console.max_requests)",
                    shared.settings.console.max_requests
                ),
            ),
        ),
    }
}

/// The gateway's batches of every tenant, newest first (at most `console.max_requests`).
async fn batches(State(shared): State<Arc<Shared>>) -> Response {
    match shared
        .batches
        .read(shared.client.nats(), &shared.settings)
        .await
    {
        Ok(list) => axum::Json(list.as_ref()).into_response(),
        Err(problem) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            &WireError::new(ErrorCode::Internal, problem),
        ),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    user: String,
}

/// Cancels a request on `gen.cancel.<id>`, as `genfleet cancel` does; the fleet's reply (or
/// refusal: `ALREADY_FINISHED`, `NOT_FOUND`) comes back as it is.
async fn cancel(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(refusal) = shared.gate.check_write(&headers) {
        tracing::warn!(message = "a console cancel was refused", request_id = %id, reason = %refusal.error.message);
        return refused(refusal);
    }
    let (_, by) = match read_write(&id, &body, |body: &CancelBody| &body.user) {
        Ok(read) => read,
        Err(refusal) => return refused(refusal),
    };
    let asked_at = crate::protocol::ids::now_rfc3339();
    match shared.client.cancel(&id).await {
        Ok(reply) => {
            tracing::info!(message = "cancelled a request", request_id = %id, cancelled_by = %by, state = reply.state.as_str());
            shared.apply(|state| {
                state.requests.note_cancel(
                    &id,
                    &asked_at,
                    &by,
                    &format!("the fleet answered {}", reply.state.as_str()),
                );
                Vec::new()
            });
            let mut body = json!(reply);
            body["cancelled_by"] = json!(by);
            (StatusCode::OK, axum::Json(body)).into_response()
        }
        Err(failure) => {
            let (status, wire) = client_error(failure);
            shared.apply(|state| {
                state.requests.note_cancel(
                    &id,
                    &asked_at,
                    &by,
                    &format!("refused, {}", wire.code.as_str()),
                );
                Vec::new()
            });
            error(status, &wire)
        }
    }
}

/// The person answering: a name for `decided_by`.
fn decided_by(user: &str) -> Result<String, Refusal> {
    let valid = !user.is_empty()
        && user.len() <= 64
        && user
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'@'));
    if valid {
        Ok(format!("human:{user}"))
    } else {
        Err(bad_request(format!(
            "user {user:?} must be 1-64 characters of A-Z, a-z, 0-9, '_', '-', '.' or '@'"
        )))
    }
}

/// A write's id and body, checked: the body, and who acts (`human:<user>`, the user named in
/// it).
fn read_write<B: serde::de::DeserializeOwned>(
    id: &str,
    body: &Bytes,
    user: fn(&B) -> &str,
) -> Result<(B, String), Refusal> {
    check_id(id)?;
    let body: B = parse(body)?;
    let by = decided_by(user(&body))?;
    Ok((body, by))
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, Refusal> {
    serde_json::from_slice(body).map_err(|e| bad_request(format!("unreadable body: {e}")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionBody {
    user: String,
}

/// Lets the page check a token (and a name) before it keeps them.
async fn session(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refusal) = shared.gate.check_write(&headers) {
        tracing::warn!(message = "a console sign-in was refused", reason = %refusal.error.message);
        return refused(refusal);
    }
    let body: SessionBody = match parse(&body) {
        Ok(body) => body,
        Err(refusal) => return refused(refusal),
    };
    match decided_by(&body.user) {
        Ok(by) => axum::Json(json!({ "decided_by": by })).into_response(),
        Err(refusal) => refused(refusal),
    }
}

/// An answer as the page sends it: the wire's answer with the person's name instead of
/// `decided_by`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AnswerBody {
    user: String,
    option_id: String,
    #[serde(default)]
    rationale: Option<String>,
    #[serde(default)]
    modified_prompt: Option<String>,
    #[serde(default)]
    guidance: Option<String>,
    #[serde(default)]
    confidence_boost: Option<f64>,
}

/// Empty or blank text is no text.
fn given(text: Option<String>) -> Option<String> {
    text.filter(|t| !t.trim().is_empty())
}

async fn decide(
    State(shared): State<Arc<Shared>>,
    Path(decision_id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(refusal) = shared.gate.check_write(&headers) {
        tracing::warn!(message = "a console answer was refused", decision_id = %decision_id, reason = %refusal.error.message);
        return refused(refusal);
    }
    let (body, by) = match read_write(&decision_id, &body, |body: &AnswerBody| &body.user) {
        Ok(read) => read,
        Err(refusal) => return refused(refusal),
    };
    let answer = DecisionAnswer {
        option_id: body.option_id,
        rationale: given(body.rationale),
        decided_by: Some(by.clone()),
        modified_prompt: given(body.modified_prompt),
        guidance: given(body.guidance),
        confidence_boost: body.confidence_boost,
    };
    match shared.client.decide(&decision_id, &answer).await {
        Ok(reply) => {
            // The same option answered first by someone else also succeeds: the record says
            // whose answer it was.
            let first = match shared.decisions().await {
                Ok(bucket) => bucket
                    .get(&decision_id)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|v| {
                        serde_json::from_slice::<crate::protocol::decision::DecisionRecord>(&v).ok()
                    })
                    .and_then(|r| r.answer)
                    .and_then(|a| a.choice.decided_by),
                Err(_) => None,
            };
            tracing::info!(
                message = "answered a decision",
                decision_id = %decision_id,
                option_id = %answer.option_id,
                decided_by = %by,
                outcome = reply.outcome.as_str(),
            );
            let mut body = json!(reply);
            body["decided_by"] = json!(by);
            if let Some(first) = first.filter(|f| *f != by) {
                body["answered_first_by"] = json!(first);
            }
            (StatusCode::OK, axum::Json(body)).into_response()
        }
        Err(failure) => {
            let (status, wire) = client_error(failure);
            error(status, &wire)
        }
    }
}
