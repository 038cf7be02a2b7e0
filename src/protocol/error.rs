//! Wire error replies: `{"error": {"code", "message", "detail"}}`.
//!
//! Codes are stable strings that clients branch on; the message is for humans and may change.

use serde::{Deserialize, Serialize};

/// Every error code a genfleet reply may carry. The set is part of the wire contract: adding a
/// code is a protocol change, so clients can match exhaustively.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    InvalidRequest,
    PayloadTooLarge,
    NoSlotAvailable,
    NotFound,
    NotReady,
    AlreadyFinished,
    DuplicateRequestId,
    InvalidOption,
    AlreadyDecided,
    Unauthorized,
    TenantLimit,
    Internal,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "INVALID_REQUEST",
            ErrorCode::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            ErrorCode::NoSlotAvailable => "NO_SLOT_AVAILABLE",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::NotReady => "NOT_READY",
            ErrorCode::AlreadyFinished => "ALREADY_FINISHED",
            ErrorCode::DuplicateRequestId => "DUPLICATE_REQUEST_ID",
            ErrorCode::InvalidOption => "INVALID_OPTION",
            ErrorCode::AlreadyDecided => "ALREADY_DECIDED",
            ErrorCode::Unauthorized => "UNAUTHORIZED",
            ErrorCode::TenantLimit => "TENANT_LIMIT",
            ErrorCode::Internal => "INTERNAL",
        }
    }
}

impl ErrorCode {
    /// The HTTP status that goes with the code: the service API's error header and the
    /// console's HTTP replies use it.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest | ErrorCode::InvalidOption => 400,
            ErrorCode::Unauthorized => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::AlreadyFinished
            | ErrorCode::AlreadyDecided
            | ErrorCode::DuplicateRequestId => 409,
            ErrorCode::NotReady => 425,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::NoSlotAvailable => 503,
            ErrorCode::TenantLimit => 429,
            ErrorCode::Internal => 500,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The body of an error reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub detail: serde_json::Value,
}

/// `{"error": {...}}`, the envelope of every failure reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorReply {
    pub error: ErrorBody,
}

/// A protocol-level failure that maps to exactly one wire code.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
    pub detail: serde_json::Value,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        WireError {
            code,
            message: message.into(),
            detail: serde_json::Value::Null,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    pub fn with_detail(mut self, detail: serde_json::Value) -> Self {
        self.detail = detail;
        self
    }

    pub fn to_reply(&self) -> ErrorReply {
        ErrorReply {
            error: ErrorBody {
                code: self.code,
                message: self.message.clone(),
                detail: self.detail.clone(),
            },
        }
    }
}

impl From<ErrorReply> for WireError {
    fn from(reply: ErrorReply) -> Self {
        WireError {
            code: reply.error.code,
            message: reply.error.message,
            detail: reply.error.detail,
        }
    }
}
