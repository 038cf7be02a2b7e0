//! Identifiers. Every id that names a subject token (request, pool, tool) is restricted to
//! `[A-Za-z0-9_-]` so it can never split or wildcard a NATS subject.

/// Longest request id.
pub const MAX_REQUEST_ID_LEN: usize = 128;
/// Longest pool or tool name.
pub const MAX_NAME_LEN: usize = 64;

/// True when `id` is 1..=`max_len` characters of `[A-Za-z0-9_-]`.
pub fn is_valid_token(id: &str, max_len: usize) -> bool {
    !id.is_empty()
        && id.len() <= max_len
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

pub fn is_valid_request_id(id: &str) -> bool {
    is_valid_token(id, MAX_REQUEST_ID_LEN)
}

pub fn is_valid_name(name: &str) -> bool {
    is_valid_token(name, MAX_NAME_LEN)
}

/// A fresh id: a ULID, so ids sort by creation time and carry 80 random bits (a request id is
/// a capability, see the security model).
pub fn new_id() -> String {
    ulid::Ulid::generate().to_string()
}

/// The current time as RFC 3339 with milliseconds, the format of every `ts` on the wire.
pub fn now_rfc3339() -> String {
    rfc3339(std::time::SystemTime::now())
}

/// A time as RFC 3339 with milliseconds.
pub fn rfc3339(time: std::time::SystemTime) -> String {
    humantime::format_rfc3339_millis(time).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens() {
        let cases = [
            ("abc", true),
            ("A-b_9", true),
            ("", false),
            ("a.b", false),
            ("a*", false),
            ("a>", false),
            ("a b", false),
            ("ü", false),
        ];
        for (id, ok) in cases {
            assert_eq!(is_valid_request_id(id), ok, "{id:?}");
        }
        assert!(is_valid_request_id(&"x".repeat(128)));
        assert!(!is_valid_request_id(&"x".repeat(129)));
        assert!(is_valid_name(&"x".repeat(64)));
        assert!(!is_valid_name(&"x".repeat(65)));
        assert!(is_valid_request_id(&new_id()));
    }
}
