//! The gateway's failures as OpenAI writes them: `{"error": {"message", "type", "param",
//! "code"}}` with the status, and the headers OpenAI's SDKs read (`retry-after`,
//! `x-should-retry`), and the refusals of a caller's key and of a request that cannot start.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::keys::Refused;
use super::openai::{BadField, ErrorBody, ErrorObject};
use super::run::StartError;
use crate::protocol::ErrorCode;

/// The header that names the request (the first of its chain) on every completion and on
/// every error answered once the request was sent.
pub const REQUEST_ID_HEADER: &str = "x-genfleet-request-id";

/// The header OpenAI's SDKs read to decide whether to send a failed request again.
const SHOULD_RETRY_HEADER: &str = "x-should-retry";

/// An error as OpenAI writes it.
#[derive(Debug)]
pub struct ApiError {
    status: u16,
    kind: &'static str,
    code: String,
    message: String,
    param: Option<String>,
    retry_after: Option<u64>,
    pub(super) request_id: Option<String>,
}

impl ApiError {
    pub(super) fn new(
        status: u16,
        kind: &'static str,
        code: &str,
        message: impl Into<String>,
    ) -> ApiError {
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

    /// The error names the request field at fault.
    pub(super) fn with_param(mut self, param: &str) -> ApiError {
        self.param = Some(param.into());
        self
    }

    /// The HTTP status.
    pub(super) fn status(&self) -> u16 {
        self.status
    }

    /// The JSON body as a value (a batch line's error body).
    pub(super) fn body_value(&self) -> serde_json::Value {
        serde_json::from_str(&self.body()).expect("errors serialize")
    }

    /// The wire code (`invalid_request`, `no_slot_available`, ...), as the metrics count it.
    pub(super) fn code(&self) -> &str {
        &self.code
    }

    pub(super) fn bad(field: BadField) -> ApiError {
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

    /// A 400 naming the field at fault.
    pub(super) fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", "invalid_request", message).with_param(param)
    }

    /// The 503 of a bucket (`what`: stored responses, files, batches) that cannot be reached.
    pub(super) fn unreachable(what: &str, error: impl std::fmt::Display) -> ApiError {
        ApiError::new(
            503,
            "api_connection_error",
            "bus_unavailable",
            format!("{what} cannot be reached: {error}"),
        )
    }

    /// The 401 of a caller without a key, or with a key the gateway does not know.
    pub(super) fn unauthorized(refused: Refused) -> ApiError {
        let message = match refused {
            Refused::Missing => {
                "You didn't provide an API key. Provide it as 'Authorization: Bearer <key>'."
            }
            Refused::Wrong => "Incorrect API key provided.",
        };
        ApiError::new(401, "invalid_request_error", "invalid_api_key", message)
    }

    /// Why a request could not be started; `queue_wait_ms` is `gateway.queue_wait_ms`.
    pub(super) fn not_started(error: StartError, queue_wait_ms: u64) -> ApiError {
        match error {
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
                        "no slot freed within gateway.queue_wait_ms ({queue_wait_ms} ms): the \
                         request was cancelled"
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
        }
    }

    /// The JSON body, also the `data` of a stream's last event when it fails.
    pub(super) fn body(&self) -> String {
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
