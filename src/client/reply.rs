//! Decoding requests and answering them in the encoding they came in.

use async_nats::{HeaderMap, Message};
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::protocol::codec::CONTENT_TYPE_HEADER;
use crate::protocol::text::{ELLIPSIS, clip_bytes};
use crate::protocol::{Encoding, ErrorCode, WireError};

/// The headers a tool call carries so that its tool service can correlate it.
pub const REQUEST_ID_HEADER: &str = "Genfleet-Request-Id";
pub const CALL_ID_HEADER: &str = "Genfleet-Call-Id";
pub const JOB_NAME_HEADER: &str = "Genfleet-Job-Name";
/// W3C trace context: a request, a tool call or a reply joins its sender's trace.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// The `traceparent` header of a message, when it is well formed
/// ([`crate::telemetry::valid_traceparent`]); anything else is ignored.
pub fn traceparent_of(message: &async_nats::Message) -> Option<String> {
    let value = message.headers.as_ref()?.get(TRACEPARENT_HEADER)?.as_str();
    crate::telemetry::valid_traceparent(value).then(|| value.to_string())
}

/// The encoding a message was sent in.
pub fn encoding_of(message: &Message) -> Encoding {
    let value = message
        .headers
        .as_ref()
        .and_then(|h| h.get(CONTENT_TYPE_HEADER))
        .map(|v| v.as_str());
    Encoding::from_content_type(value)
}

/// A header's value as text.
pub fn header(message: &Message, name: &str) -> Option<String> {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_string())
}

/// Decodes a request body, refusing one larger than `max_bytes`.
pub fn decode<T: DeserializeOwned>(message: &Message, max_bytes: usize) -> Result<T, WireError> {
    if message.payload.len() > max_bytes {
        return Err(WireError::new(
            ErrorCode::PayloadTooLarge,
            format!(
                "the request is {} bytes; at most {max_bytes} are accepted",
                message.payload.len()
            ),
        ));
    }
    encoding_of(message).decode(&message.payload)
}

/// Headers and body of a reply in `encoding`.
pub fn encode_reply<T: Serialize>(
    encoding: Encoding,
    reply: &Result<T, WireError>,
) -> (HeaderMap, Bytes) {
    let mut headers = HeaderMap::new();
    if encoding == Encoding::MsgPack {
        headers.insert(CONTENT_TYPE_HEADER, encoding.content_type());
    }
    let body = match reply {
        Ok(value) => encoding.encode(value),
        Err(error) => {
            // The NATS service API convention, so generic tooling sees the failure too.
            headers.insert(
                "Nats-Service-Error-Code",
                ErrorCode::http_status(error.code).to_string().as_str(),
            );
            headers.insert("Nats-Service-Error", header_text(&error.message).as_str());
            encoding.encode(&error.to_reply())
        }
    };
    (headers, body.into())
}

/// The longest `Nats-Service-Error` header value; the body carries the whole message.
const MAX_HEADER_TEXT: usize = 256;

/// `text` as a header value: one line (control characters become spaces, which a header
/// cannot hold) of at most [`MAX_HEADER_TEXT`] bytes.
fn header_text(text: &str) -> String {
    let out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if out.len() > MAX_HEADER_TEXT {
        // The mark counts against the limit.
        return clip_bytes(&out, MAX_HEADER_TEXT - ELLIPSIS.len_utf8());
    }
    out
}

/// Runs a handler's work. A panic in it is a bug, but the requester still gets an answer (an
/// INTERNAL error) instead of a timeout, and the worker goes on.
pub async fn guarded<T>(
    work: impl std::future::Future<Output = Result<T, WireError>>,
) -> Result<T, WireError> {
    use futures_util::FutureExt;
    match std::panic::AssertUnwindSafe(work).catch_unwind().await {
        Ok(reply) => reply,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(message = "a request handler panicked", panic = %what);
            Err(WireError::new(
                ErrorCode::Internal,
                "the worker failed on this message (a bug; its log has the cause)",
            ))
        }
    }
}

/// Answers `message` (when it has a reply subject); a failure to publish is only logged, the
/// requester's timeout covers it.
pub async fn respond<T: Serialize>(
    client: &async_nats::Client,
    message: &Message,
    reply: Result<T, WireError>,
) {
    let Some(reply_to) = message.reply.clone() else {
        return;
    };
    let (headers, body) = encode_reply(encoding_of(message), &reply);
    if let Err(error) = client.publish_with_headers(reply_to, headers, body).await {
        tracing::warn!(message = "could not send a reply", %error, subject = %message.subject);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_headers_hold_one_bounded_line_of_any_message() {
        let error = WireError::invalid(format!(
            "regex parse error:\n    (\n    ^\r\n{}",
            "é".repeat(400)
        ));
        let (headers, body) = encode_reply::<()>(Encoding::Json, &Err(error.clone()));
        let text = headers.get("Nats-Service-Error").unwrap().as_str();
        assert!(!text.contains(['\r', '\n']), "{text:?}");
        assert!(
            text.len() <= MAX_HEADER_TEXT && text.ends_with('…'),
            "{text:?}"
        );
        let reply: crate::protocol::ErrorReply = serde_json::from_slice(&body).unwrap();
        assert_eq!(reply.error.message, error.message);
    }

    #[tokio::test]
    async fn a_panicking_handler_still_answers() {
        let reply: Result<(), WireError> = guarded(async { panic!("boom") }).await;
        assert_eq!(reply.unwrap_err().code, ErrorCode::Internal);
        let reply: Result<u8, WireError> = guarded(async { Ok(1) }).await;
        assert_eq!(reply.unwrap(), 1);
    }
}
