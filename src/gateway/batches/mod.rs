//! OpenAI's Batch API on the fleet (see docs/gateway.md, "The Batch API").
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/batches` | a batch of `/v1/chat/completions` or `/v1/responses` lines |
//! | `GET /v1/batches` | the tenant's batches, newest first |
//! | `GET /v1/batches/{id}` | a batch: its status, `request_counts` and files |
//! | `POST /v1/batches/{id}/cancel` | stops it: lines running are cancelled, the rest not sent |
//!
//! A batch's record and its lines' outcomes live in buckets every replica shares
//! ([`crate::client::batches`]); one replica at a time drives it ([`driver`]), and another takes it over when
//! that one stops or dies. Each line runs as a durable request in band `low` under the
//! batch's tenant.

pub mod driver;
pub mod lines;

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::Shared;
use super::error::ApiError;
use super::http::{Tenant, authorize, now_secs, read_body, stopping};
use super::page::Page;
use crate::client::batches::Record;

/// The endpoints a batch's lines may call.
pub const ENDPOINTS: &[&str] = &["/v1/chat/completions", "/v1/responses"];

/// The one completion window served.
const WINDOW: &str = "24h";
const WINDOW_SECS: u64 = 24 * 3600;

pub(super) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/batches", post(create).get(list))
        .route("/v1/batches/{id}", get(retrieve))
        .route("/v1/batches/{id}/cancel", post(cancel))
}

/// The body of `POST /v1/batches`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBatch {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
    /// Read and ignored: the output files are kept as long as every file.
    #[serde(default, rename = "output_expires_after")]
    _output_expires_after: Option<Value>,
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        "not_found",
        format!(
            "No batch found with id '{}'.",
            crate::protocol::text::one_line(id)
        ),
    )
}

fn unavailable(error: impl std::fmt::Display) -> ApiError {
    ApiError::unreachable("batches", error)
}

async fn create(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match create_in(&shared, &headers, body).await {
        Ok(batch) => axum::Json(batch).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn create_in(
    shared: &Shared,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Value, Box<ApiError>> {
    let tenant = authorize(shared, headers)?;
    let body = read_body(shared, body)?;
    if shared.stopping.is_cancelled() {
        return Err(Box::new(stopping()));
    }
    let request: CreateBatch = super::openai::read_strictly(&body, "a batch")
        .map_err(|field| Box::new(ApiError::bad(field)))?;
    if !ENDPOINTS.contains(&request.endpoint.as_str()) {
        return Err(Box::new(ApiError::invalid(
            "endpoint",
            format!("endpoint: must be one of {}", ENDPOINTS.join(", ")),
        )));
    }
    if request.completion_window != WINDOW {
        return Err(Box::new(ApiError::invalid(
            "completion_window",
            format!("completion_window: must be {WINDOW}"),
        )));
    }
    let metadata = request.metadata.unwrap_or_default();
    if metadata.len() > 16
        || metadata
            .iter()
            .any(|(k, v)| k.len() > 64 || v.as_str().is_none_or(|v| v.len() > 512))
    {
        return Err(Box::new(ApiError::invalid(
            "metadata",
            "metadata: at most 16 pairs, keys of at most 64 characters, values strings of at \
             most 512",
        )));
    }
    match shared.files.info(&tenant, &request.input_file_id).await {
        Ok(Some(_)) => {}
        Ok(None) => {
            return Err(Box::new(
                super::files::not_found(&request.input_file_id).with_param("input_file_id"),
            ));
        }
        Err(error) => return Err(Box::new(super::files::unavailable(error))),
    }
    let id = format!("batch_{}", crate::protocol::ids::new_id());
    let created_at = now_secs();
    let batch = json!({
        "id": id, "object": "batch", "endpoint": request.endpoint, "errors": null,
        "input_file_id": request.input_file_id, "completion_window": WINDOW,
        "status": "validating", "output_file_id": null, "error_file_id": null,
        "created_at": created_at, "in_progress_at": null,
        "expires_at": created_at + WINDOW_SECS, "finalizing_at": null, "completed_at": null,
        "failed_at": null, "expired_at": null, "cancelling_at": null, "cancelled_at": null,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    });
    let record = Record {
        batch: batch.clone(),
        tenant,
        owner: String::new(),
        lease_until_ms: 0,
        reserved: 0,
        chunks: 0,
    };
    match shared.batches.create(&record).await {
        Ok(true) => {}
        Ok(false) => return Err(Box::new(unavailable("a fresh batch id was taken"))),
        Err(error) => return Err(Box::new(unavailable(error))),
    }
    // This replica's keeper takes it at once.
    shared.batch_wake.notify_one();
    Ok(batch)
}

async fn retrieve(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Response {
    match shared.batches.get(&tenant, &id).await {
        Ok(Some(read)) => axum::Json(read.record.batch).into_response(),
        Ok(None) => not_found(&id).into_response(),
        Err(error) => unavailable(error).into_response(),
    }
}

async fn cancel(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Response {
    for _ in 0..8 {
        let read = match shared.batches.get(&tenant, &id).await {
            Ok(Some(read)) => read,
            Ok(None) => return not_found(&id).into_response(),
            Err(error) => return unavailable(error).into_response(),
        };
        let mut record = read.record;
        if record.is_final() || record.status() == "cancelling" {
            return axum::Json(record.batch).into_response();
        }
        record.batch["status"] = "cancelling".into();
        record.batch["cancelling_at"] = now_secs().into();
        match shared.batches.update(&record, read.revision).await {
            Ok(Some(_)) => {
                shared.batch_wake.notify_one();
                return axum::Json(record.batch).into_response();
            }
            Ok(None) => continue,
            Err(error) => return unavailable(error).into_response(),
        }
    }
    unavailable("the batch kept changing").into_response()
}

async fn list(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let page = match Page::read(&query, &[]) {
        Ok(page) => page,
        Err(error) => return error.into_response(),
    };
    match shared.batches.list(&tenant).await {
        // Newest first: the page reads the list oldest first, newest first by default.
        Ok(records) => {
            let data: Vec<Value> = records.into_iter().rev().map(|r| r.batch).collect();
            axum::Json(page.of(data)).into_response()
        }
        Err(error) => unavailable(error).into_response(),
    }
}
