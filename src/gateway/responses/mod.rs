//! OpenAI's Responses API on the fleet (see docs/gateway.md, "The Responses API").
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/responses` | a response, whole, streamed (`stream: true`) or in the background |
//! | `GET /v1/responses/{id}` | a stored response (a background one's progress) |
//! | `DELETE /v1/responses/{id}` | forgets it (and cancels it if it still runs) |
//! | `POST /v1/responses/{id}/cancel` | cancels a background response |
//! | `GET /v1/responses/{id}/input_items` | its input items, a page at a time |
//!
//! A response runs as a chat completion does ([`super::run::Run`]): its input items become
//! chat messages after the stored conversation of its `previous_response_id`, and what the
//! run yields becomes output items. A stored response ([`store`]) lives in a bucket every
//! replica shares, under its tenant; a `previous_response_id` chain is one session for
//! placement, so its requests go first to the worker that served the chain last.

mod background;
pub mod store;
mod stream;
pub mod wire;

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tracing::Instrument;

use self::store::Stored;
use self::wire::{Echo, ItemIds, Outcome, Produced};
use super::Shared;
use super::error::{ApiError, REQUEST_ID_HEADER};
use super::http::{Tenant, authorize, map_chat, now_secs, read_body, request_span, stopping};
use super::mapping::{Ending, Mapped};
use super::page::Page;
use super::run::{End, Piece, Run};

pub(super) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/responses", post(create))
        .route("/v1/responses/{id}", get(retrieve).delete(delete))
        .route("/v1/responses/{id}/cancel", post(cancel))
        .route("/v1/responses/{id}/input_items", get(input_items))
}

/// One response on its way: what its object and its stored record need besides the run.
#[derive(Clone)]
pub(in crate::gateway) struct Job {
    shared: Arc<Shared>,
    tenant: String,
    id: String,
    created_at: u64,
    echo: Echo,
    store: bool,
    background: bool,
    pool: String,
    input_items: Vec<Value>,
    /// The conversation before its output: the previous response's, and its input.
    conversation: Vec<Value>,
    session: String,
}

impl Job {
    fn object(&self, outcome: &Outcome, output: Vec<Value>, used: Option<Value>) -> Value {
        wire::response_object(
            &self.id,
            self.created_at,
            &self.echo,
            outcome,
            output,
            used,
            self.background,
            self.store,
        )
    }

    /// The record to store of the response `object`, which produced `produced`.
    fn record(&self, object: Value, produced: Option<&Produced>, request_id: &str) -> Stored {
        let mut conversation = self.conversation.clone();
        if let Some(message) = produced.and_then(Produced::message) {
            conversation.push(message);
        }
        Stored {
            response: object,
            input_items: self.input_items.clone(),
            conversation,
            session: self.session.clone(),
            request_id: request_id.to_string(),
            background: self.background,
        }
    }

    /// The response's object once it ended, kept when it is to be stored.
    pub(in crate::gateway) async fn finish(
        &self,
        outcome: &Outcome,
        produced: &Produced,
        usage: crate::protocol::result::Usage,
        request_id: &str,
    ) -> Value {
        let output = produced.items(&mut ItemIds::new());
        let object = self.object(outcome, output, Some(wire::usage(usage)));
        self.keep(&object, Some(produced), request_id).await;
        object
    }

    /// Keeps the response when it is to be stored. A store that fails is logged: the caller
    /// has its answer, and a later `previous_response_id` of it is a 404.
    async fn keep(&self, object: &Value, produced: Option<&Produced>, request_id: &str) {
        if !self.store {
            return;
        }
        let record = self.record(object.clone(), produced, request_id);
        if let Err(error) = self.shared.responses.put(&self.tenant, &record).await {
            tracing::warn!(message = "a response was not stored", %error, response_id = %self.id);
        }
    }
}

/// The outcome of a run's end.
fn outcome_of(end: &End) -> Outcome {
    Outcome::of(&end.ending, end.message.clone())
}

fn outcome_label(end: &End) -> &'static str {
    match end.ending {
        Ending::Finish(finish) => finish,
        Ending::Error { code, .. } => code,
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        "not_found",
        format!(
            "Response with id '{}' not found.",
            crate::protocol::text::one_line(id)
        ),
    )
}

fn store_unavailable(error: impl std::fmt::Display) -> ApiError {
    ApiError::unreachable("stored responses", error)
}

/// A Responses request read into the generation request it runs as, and its job: its
/// `previous_response_id` read in the caller's tenant, its model routed.
pub(in crate::gateway) async fn prepare_job(
    shared: &Arc<Shared>,
    tenant: &str,
    request: wire::ResponsesRequest,
) -> Result<(Mapped, Job), Box<ApiError>> {
    let previous = match &request.previous_response_id {
        None => None,
        Some(id) => Some(previous_of(shared, tenant, id).await.map_err(Box::new)?),
    };
    let history = previous
        .as_ref()
        .map(|p| p.conversation.as_slice())
        .unwrap_or_default();
    let mut prepared = wire::prepare(request, history).map_err(|e| Box::new(ApiError::bad(e)))?;
    let id = format!("resp_{}", crate::protocol::ids::new_id());
    // A `previous_response_id` chain is one session: its requests go first to the worker
    // that served it last.
    let genfleet = prepared.chat.genfleet.get_or_insert_with(Default::default);
    let session = genfleet
        .session
        .clone()
        .or_else(|| previous.as_ref().map(|p| p.session.clone()))
        .or_else(|| prepared.chat.user.clone())
        .unwrap_or_else(|| id.clone());
    genfleet.session = Some(session.clone());
    if prepared.background {
        genfleet.durable = true;
    }
    let mapped = map_chat(shared, tenant, prepared.chat).await?;
    let mut conversation = history.to_vec();
    conversation.extend(prepared.input_messages);
    let job = Job {
        shared: shared.clone(),
        tenant: tenant.to_string(),
        id,
        created_at: now_secs(),
        echo: prepared.echo,
        store: prepared.store,
        background: prepared.background,
        pool: mapped.pool.clone(),
        input_items: prepared.input_items,
        conversation,
        session,
    };
    Ok((mapped, job))
}

async fn create(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let span = request_span(&headers, "POST /v1/responses", "/v1/responses");
    match create_in(shared, headers, body).instrument(span).await {
        Ok(response) | Err(response) => response,
    }
}

async fn create_in(
    shared: Arc<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Response> {
    let refuse = |error: ApiError| error.into_response();
    let tenant = authorize(&shared, &headers).map_err(|e| refuse(*e))?;
    let body = read_body(&shared, body).map_err(|e| refuse(*e))?;
    if shared.stopping.is_cancelled() {
        return Err(refuse(stopping()));
    }
    let request = wire::parse(&body).map_err(|e| refuse(ApiError::bad(e)))?;
    let stream = request.stream == Some(true);
    let (mapped, job) = prepare_job(&shared, &tenant, request)
        .await
        .map_err(|e| refuse(*e))?;
    if job.background {
        return background::start(job, mapped).await;
    }
    let open = shared.metrics.open();
    let run = match super::http::start(&shared, mapped, &tenant).await {
        Ok(run) => run,
        Err(error) => {
            shared
                .metrics
                .answered(&tenant, &job.pool, error.code(), stream);
            return Err(error.into_response());
        }
    };
    let request_id = run.caller_id().to_string();
    let mut response = if stream {
        stream::respond(job, run, open)
    } else {
        whole(job, run).await
    };
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    Ok(response)
}

/// The stored response a request continues, read in the caller's tenant.
async fn previous_of(shared: &Shared, tenant: &str, id: &str) -> Result<Stored, ApiError> {
    match shared.responses.get(tenant, id).await {
        Ok(Some(read)) if read.stored.is_final() => Ok(read.stored),
        Ok(Some(read)) => Err(ApiError::new(
            400,
            "invalid_request_error",
            "invalid_request",
            format!(
                "previous_response_id: response {id} is {} (wait until it ends)",
                read.stored.status()
            ),
        )
        .with_param("previous_response_id")),
        Ok(None) => Err(ApiError::new(
            404,
            "invalid_request_error",
            "previous_response_not_found",
            format!(
                "Previous response with id '{}' not found.",
                crate::protocol::text::one_line(id)
            ),
        )
        .with_param("previous_response_id")),
        Err(error) => Err(store_unavailable(error)),
    }
}

/// The whole response, once the chain ended. The run (and its cancel guard) lives in this
/// future: a caller that hangs up drops it.
async fn whole(job: Job, mut run: Run) -> Response {
    let mut produced = Produced::default();
    let end = loop {
        match run.next().await {
            Some(Piece::Text(text)) => produced.text.push_str(&text),
            Some(Piece::Reasoning(text)) => produced.reasoning.push_str(&text),
            Some(Piece::End(end)) => break end,
            None => unreachable!("a run ends with its End piece"),
        }
    };
    job.shared
        .metrics
        .answered(&job.tenant, &job.pool, outcome_label(&end), false);
    let outcome = outcome_of(&end);
    produced.tool_calls = end.tool_calls.clone();
    let object = job
        .finish(&outcome, &produced, end.usage, run.caller_id())
        .await;
    match end.ending {
        Ending::Error { status, kind, code } => {
            ApiError::new(status, kind, code, end.message).into_response()
        }
        Ending::Finish(_) => axum::Json(object).into_response(),
    }
}

async fn retrieve(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Response {
    match background::current(&shared, &tenant, &id).await {
        Ok(Some(stored)) => axum::Json(stored.response).into_response(),
        Ok(None) => not_found(&id).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn delete(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Response {
    // A response that still runs is cancelled first: nobody can read its answer any more.
    match background::cancel(&shared, &tenant, &id, "its response was deleted").await {
        Ok(None) => return not_found(&id).into_response(),
        Ok(Some(_)) => {}
        Err(error) => return error.into_response(),
    }
    match shared.responses.delete(&tenant, &id).await {
        Ok(true) => {
            axum::Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
        }
        Ok(false) => not_found(&id).into_response(),
        Err(error) => store_unavailable(error).into_response(),
    }
}

async fn cancel(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Response {
    match shared.responses.get(&tenant, &id).await {
        Ok(Some(read)) if !read.stored.background => {
            return ApiError::new(
                400,
                "invalid_request_error",
                "invalid_request",
                "Only responses created with background set to true can be cancelled.",
            )
            .into_response();
        }
        Ok(Some(_)) => {}
        Ok(None) => return not_found(&id).into_response(),
        Err(error) => return store_unavailable(error).into_response(),
    }
    match background::cancel(&shared, &tenant, &id, "cancelled by its caller").await {
        Ok(Some(stored)) => axum::Json(stored.response).into_response(),
        Ok(None) => not_found(&id).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn input_items(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let page = match Page::read(&query, &["include"]) {
        Ok(page) => page,
        Err(error) => return error.into_response(),
    };
    let stored = match shared.responses.get(&tenant, &id).await {
        Ok(Some(read)) => read.stored,
        Ok(None) => return not_found(&id).into_response(),
        Err(error) => return store_unavailable(error).into_response(),
    };
    axum::Json(page.of(stored.input_items)).into_response()
}
