//! OpenAI's Files API, for batches: a caller's JSONL input uploaded (`POST /v1/files`), and the
//! output and error files a batch produces, in a JetStream object store bucket every replica
//! shares (`gateway.files_bucket`).
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/files` | uploads a file (multipart: `purpose` `batch`, `file`) |
//! | `GET /v1/files` | the tenant's files |
//! | `GET /v1/files/{id}` | a file's object |
//! | `GET /v1/files/{id}/content` | its bytes |
//! | `DELETE /v1/files/{id}` | deletes it |
//!
//! Architecture invariants:
//! - A file belongs to its tenant: its object's name is `<tenant>.<id>` (`default.<id>` with no
//!   keys), built from the caller's own tenant on every route, so another tenant's id is a 404.
//! - An upload over `gateway.max_file_bytes` is refused as soon as that many bytes came,
//!   before anything is stored.
//! - Memory is bounded whatever callers send: an upload is held whole before it is stored, and
//!   at most [`UPLOADS_AT_ONCE`] are read at once (the others wait their turn).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, object_store, stream};
use axum::Router;
use axum::extract::{DefaultBodyLimit, Multipart, Path, Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use super::Shared;
use super::error::ApiError;
use super::http::{Tenant, authorize, now_secs};
use crate::client::BusError;
use crate::settings::Settings;

/// Longest file id read from a path: `file-` and a ULID are 31 characters.
const MAX_ID_LEN: usize = 64;

/// Uploads read at once: each is held whole (up to `gateway.max_file_bytes`) before it is
/// stored.
pub const UPLOADS_AT_ONCE: usize = 2;

/// What a multipart upload may carry besides the file: its fields' text, bounded.
const MAX_FIELD_BYTES: usize = 1024;

/// A file's object, as OpenAI writes it.
#[derive(Debug, Clone)]
pub struct FileObject {
    pub id: String,
    pub bytes: usize,
    pub created_at: u64,
    pub filename: String,
    pub purpose: String,
    pub expires_at: u64,
}

impl FileObject {
    pub fn json(&self) -> Value {
        json!({
            "id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
            "filename": self.filename, "purpose": self.purpose, "status": "processed",
            "status_details": null, "expires_at": self.expires_at,
        })
    }
}

/// The files bucket.
#[derive(Clone)]
pub struct Files {
    bucket: object_store::ObjectStore,
    ttl: Duration,
    uploads: Arc<tokio::sync::Semaphore>,
    /// Bytes of a file in one message of its object.
    chunk_size: usize,
}

/// A file's chunks are as large as the server's messages may be, up to this: a batch's output
/// is stored and read in a few round trips, not one per 128 KiB (the object store's default).
const MAX_CHUNK_BYTES: usize = 1024 * 1024;

/// The chunk size for a server whose messages hold at most `max_payload` bytes (a little is
/// left for the message's envelope).
fn chunk_size(max_payload: usize) -> usize {
    max_payload
        .saturating_sub(1024)
        .clamp(4096, MAX_CHUNK_BYTES)
}

#[derive(Debug, thiserror::Error)]
#[error("the files bucket: {0}")]
pub struct FilesError(pub String);

impl Files {
    /// Opens the bucket (`gateway.files_bucket`), creating it when absent (its stream as
    /// `create_object_store` makes it, through [`crate::client::streams::ensure_stream`]).
    pub async fn open(nats: &async_nats::Client, settings: &Settings) -> Result<Files, BusError> {
        let jetstream = jetstream::new(nats.clone());
        let bucket = &settings.gateway.files_bucket;
        let ttl = Duration::from_millis(settings.gateway.files_ttl_ms);
        let uploads = Arc::new(tokio::sync::Semaphore::new(UPLOADS_AT_ONCE));
        let chunk_size = chunk_size(nats.server_info().max_payload);
        if let Ok(store) = jetstream.get_object_store(bucket).await {
            return Ok(Files {
                bucket: store,
                ttl,
                uploads,
                chunk_size,
            });
        }
        let config = stream::Config {
            name: format!("OBJ_{bucket}"),
            description: Some(format!("genfleet files {bucket}")),
            subjects: vec![format!("$O.{bucket}.C.>"), format!("$O.{bucket}.M.>")],
            max_age: ttl,
            num_replicas: settings.jetstream.replicas,
            discard: stream::DiscardPolicy::New,
            allow_rollup: true,
            allow_direct: true,
            ..Default::default()
        };
        crate::client::streams::ensure_stream(&jetstream, config).await?;
        let store = jetstream
            .get_object_store(bucket)
            .await
            .map_err(|e| BusError::Setup(format!("cannot open bucket {bucket}: {e}")))?;
        Ok(Files {
            bucket: store,
            ttl,
            uploads,
            chunk_size,
        })
    }

    /// Stores a file of the tenant's.
    pub async fn put(
        &self,
        tenant: &str,
        purpose: &str,
        filename: &str,
        bytes: &[u8],
    ) -> Result<FileObject, FilesError> {
        let id = format!("file-{}", crate::protocol::ids::new_id());
        let created_at = now_secs();
        let metadata = HashMap::from([
            ("purpose".to_string(), purpose.to_string()),
            ("filename".to_string(), filename.to_string()),
            ("created_at".to_string(), created_at.to_string()),
        ]);
        let meta = object_store::ObjectMetadata {
            name: name(tenant, &id).expect("a fresh id is a file id"),
            metadata,
            chunk_size: Some(self.chunk_size),
            ..Default::default()
        };
        let mut reader = bytes;
        self.bucket
            .put(meta, &mut reader)
            .await
            .map_err(|e| FilesError(e.to_string()))?;
        Ok(FileObject {
            id,
            bytes: bytes.len(),
            created_at,
            filename: filename.to_string(),
            purpose: purpose.to_string(),
            expires_at: created_at + self.ttl.as_secs(),
        })
    }

    /// A file's object, `None` when the tenant has no file of that id.
    pub async fn info(&self, tenant: &str, id: &str) -> Result<Option<FileObject>, FilesError> {
        let Some(name) = name(tenant, id) else {
            return Ok(None);
        };
        match self.bucket.info(&name).await {
            Ok(info) if !info.deleted => Ok(Some(self.object_of(id, &info))),
            Ok(_) => Ok(None),
            Err(error) if error.kind() == object_store::InfoErrorKind::NotFound => Ok(None),
            Err(error) => Err(FilesError(error.to_string())),
        }
    }

    /// A file's bytes, `None` when the tenant has no file of that id.
    pub async fn read(&self, tenant: &str, id: &str) -> Result<Option<Vec<u8>>, FilesError> {
        let Some(name) = name(tenant, id) else {
            return Ok(None);
        };
        let mut object = match self.bucket.get(&name).await {
            Ok(object) => object,
            Err(error) if error.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(FilesError(error.to_string())),
        };
        let mut bytes = Vec::with_capacity(object.info().size);
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| FilesError(e.to_string()))?;
        Ok(Some(bytes))
    }

    /// Deletes a file of the tenant's; `Ok(false)` when there was none.
    pub async fn delete(&self, tenant: &str, id: &str) -> Result<bool, FilesError> {
        if self.info(tenant, id).await?.is_none() {
            return Ok(false);
        }
        let name = name(tenant, id).expect("an id that was read has a name");
        self.bucket
            .delete(&name)
            .await
            .map_err(|e| FilesError(e.to_string()))?;
        Ok(true)
    }

    /// The tenant's files, newest first.
    pub async fn list(&self, tenant: &str) -> Result<Vec<FileObject>, FilesError> {
        use futures_util::StreamExt;
        let prefix = format!("{}.", tenant_token(tenant));
        let mut list = self
            .bucket
            .list()
            .await
            .map_err(|e| FilesError(e.to_string()))?;
        let mut files = Vec::new();
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| FilesError(e.to_string()))?;
            if let Some(id) = info.name.strip_prefix(&prefix)
                && !info.deleted
            {
                files.push(self.object_of(id, &info));
            }
        }
        files.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));
        Ok(files)
    }

    fn object_of(&self, id: &str, info: &object_store::ObjectInfo) -> FileObject {
        let created_at = info
            .metadata
            .get("created_at")
            .and_then(|t| t.parse().ok())
            .unwrap_or_default();
        FileObject {
            id: id.to_string(),
            bytes: info.size,
            created_at,
            filename: info.metadata.get("filename").cloned().unwrap_or_default(),
            purpose: info.metadata.get("purpose").cloned().unwrap_or_default(),
            expires_at: created_at + self.ttl.as_secs(),
        }
    }
}

fn tenant_token(tenant: &str) -> &str {
    if tenant.is_empty() { "default" } else { tenant }
}

/// The object name of a tenant's file: `None` for an id no file has.
fn name(tenant: &str, id: &str) -> Option<String> {
    let valid = id.len() <= MAX_ID_LEN
        && id.strip_prefix("file-").is_some_and(|rest| {
            !rest.is_empty() && rest.chars().all(|c| c.is_ascii_alphanumeric())
        });
    valid.then(|| format!("{}.{id}", tenant_token(tenant)))
}

pub(super) fn routes(settings: &Settings) -> Router<Arc<Shared>> {
    // The upload's own limit: a little over the largest file, for the multipart framing.
    let limit = settings.gateway.max_file_bytes.saturating_add(64 * 1024);
    Router::new()
        .route(
            "/v1/files",
            get(list).post(upload).layer(DefaultBodyLimit::max(limit)),
        )
        .route("/v1/files/{id}", get(retrieve).delete(delete))
        .route("/v1/files/{id}/content", get(content))
}

pub(super) fn not_found(id: &str) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        "not_found",
        format!(
            "No such File object: {}",
            crate::protocol::text::one_line(id)
        ),
    )
    .with_param("id")
}

pub(super) fn unavailable(error: impl std::fmt::Display) -> ApiError {
    ApiError::unreachable("files", error)
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        413,
        "invalid_request_error",
        "payload_too_large",
        format!("the file is larger than gateway.max_file_bytes ({max} bytes): nothing was stored"),
    )
    .with_param("file")
}

async fn upload(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    multipart: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Response {
    match upload_in(&shared, &headers, multipart).await {
        Ok(object) => axum::Json(object.json()).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn upload_in(
    shared: &Shared,
    headers: &HeaderMap,
    multipart: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Result<FileObject, Box<ApiError>> {
    let tenant = authorize(shared, headers)?;
    let max = shared.settings.gateway.max_file_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > max.saturating_add(64 * 1024)) {
        return Err(Box::new(too_large(max)));
    }
    // Held until the file is stored: at most UPLOADS_AT_ONCE files in memory.
    let _turn = shared
        .files
        .uploads
        .clone()
        .acquire_owned()
        .await
        .expect("the uploads' semaphore is never closed");
    let mut multipart = multipart.map_err(|rejection| {
        Box::new(ApiError::invalid(
            "file",
            format!("the body must be multipart/form-data with purpose and file: {rejection}"),
        ))
    })?;
    let (mut purpose, mut file) = (None, None);
    loop {
        let field = match multipart.next_field().await {
            Ok(Some(field)) => field,
            Ok(None) => break,
            Err(error) if error.status().as_u16() == 413 => return Err(Box::new(too_large(max))),
            Err(error) => {
                return Err(Box::new(ApiError::invalid(
                    "file",
                    format!("the upload: {error}"),
                )));
            }
        };
        let name = field.name().unwrap_or_default().to_string();
        match name.as_str() {
            "purpose" => purpose = Some(read_field(field, MAX_FIELD_BYTES, "purpose").await?),
            "file" => {
                let filename = field.file_name().unwrap_or("upload.jsonl").to_string();
                let bytes = read_field(field, max, "file").await.map_err(|e| {
                    if e.code() == "payload_too_large" {
                        Box::new(too_large(max))
                    } else {
                        e
                    }
                })?;
                file = Some((filename, bytes));
            }
            other => {
                return Err(Box::new(ApiError::invalid(
                    other,
                    format!(
                        "{}: unknown field (purpose and file are)",
                        crate::protocol::text::one_line(other)
                    ),
                )));
            }
        }
    }
    let purpose = match purpose {
        None => return Err(Box::new(ApiError::invalid("purpose", "purpose: required"))),
        Some(purpose) => String::from_utf8_lossy(&purpose).into_owned(),
    };
    if purpose != "batch" {
        return Err(Box::new(ApiError::invalid(
            "purpose",
            format!(
                "purpose: {:?} is not served (batch is: the gateway keeps files for batches)",
                crate::protocol::text::one_line(&purpose)
            ),
        )));
    }
    let Some((filename, bytes)) = file else {
        return Err(Box::new(ApiError::invalid("file", "file: required")));
    };
    shared
        .files
        .put(&tenant, &purpose, &filename, &bytes)
        .await
        .map_err(|e| Box::new(unavailable(e)))
}

/// A field's bytes, refused once more than `max` came.
async fn read_field(
    mut field: axum::extract::multipart::Field<'_>,
    max: usize,
    param: &str,
) -> Result<Vec<u8>, Box<ApiError>> {
    let mut bytes = Vec::new();
    loop {
        match field.chunk().await {
            Ok(Some(chunk)) => {
                if bytes.len() + chunk.len() > max {
                    return Err(Box::new(
                        ApiError::new(
                            413,
                            "invalid_request_error",
                            "payload_too_large",
                            format!("{param}: larger than {max} bytes"),
                        )
                        .with_param(param),
                    ));
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(bytes),
            Err(error) if error.status().as_u16() == 413 => {
                return Err(Box::new(
                    ApiError::new(
                        413,
                        "invalid_request_error",
                        "payload_too_large",
                        format!("{param}: larger than {max} bytes"),
                    )
                    .with_param(param),
                ));
            }
            Err(error) => {
                return Err(Box::new(ApiError::invalid(
                    param,
                    format!("{param}: {error}"),
                )));
            }
        }
    }
}

async fn list(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let page = match super::page::Page::read(&query, &["purpose"]) {
        Ok(page) => page,
        Err(error) => return error.into_response(),
    };
    let files = match shared.files.list(&tenant).await {
        Ok(files) => files,
        Err(error) => return unavailable(error).into_response(),
    };
    let purpose = query.get("purpose");
    // Newest first already: the page reads the list oldest first.
    let data: Vec<Value> = files
        .iter()
        .rev()
        .filter(|f| purpose.is_none_or(|p| &f.purpose == p))
        .map(FileObject::json)
        .collect();
    axum::Json(page.of(data)).into_response()
}

async fn retrieve(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Response {
    match shared.files.info(&tenant, &id).await {
        Ok(Some(object)) => axum::Json(object.json()).into_response(),
        Ok(None) => not_found(&id).into_response(),
        Err(error) => unavailable(error).into_response(),
    }
}

async fn content(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Response {
    match shared.files.read(&tenant, &id).await {
        Ok(Some(bytes)) => {
            ([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response()
        }
        Ok(None) => not_found(&id).into_response(),
        Err(error) => unavailable(error).into_response(),
    }
}

async fn delete(
    State(shared): State<Arc<Shared>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Response {
    match shared.files.delete(&tenant, &id).await {
        Ok(true) => {
            axum::Json(json!({"id": id, "object": "file", "deleted": true})).into_response()
        }
        Ok(false) => not_found(&id).into_response(),
        Err(error) => unavailable(error).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_the_tenant_s_and_only_a_file_id_makes_one() {
        assert_eq!(name("t", "file-01AB").as_deref(), Some("t.file-01AB"));
        assert_eq!(name("", "file-01AB").as_deref(), Some("default.file-01AB"));
        for bad in [
            "", "file-", "file-*", "file-a.b", "t.file-1", "resp_1", "file-a/b",
        ] {
            assert_eq!(name("t", bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_chunk_fits_the_server_s_messages_and_is_at_most_a_mebibyte() {
        assert_eq!(chunk_size(1024 * 1024), 1024 * 1024 - 1024);
        assert_eq!(chunk_size(64 * 1024 * 1024), MAX_CHUNK_BYTES);
        assert_eq!(chunk_size(128 * 1024), 127 * 1024);
        assert_eq!(chunk_size(0), 4096);
    }
}
