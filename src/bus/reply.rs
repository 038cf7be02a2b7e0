//! Decoding requests and answering them in the encoding they came in.

use async_nats::{HeaderMap, Message};
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::protocol::codec::CONTENT_TYPE_HEADER;
use crate::protocol::{Encoding, ErrorCode, WireError};

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
            headers.insert("Nats-Service-Error", error.message.as_str());
            encoding.encode(&error.to_reply())
        }
    };
    (headers, body.into())
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
