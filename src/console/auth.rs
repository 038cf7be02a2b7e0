//! Who may do what at the console.
//!
//! - Reading (the page, the live streams) needs no token, but a console listening on loopback
//!   only answers requests whose `Host` is a loopback name, so a web page elsewhere cannot
//!   reach it through DNS rebinding.
//! - Answering needs the configured token, sent as `X-Genfleet-Token` (or `Authorization:
//!   Bearer`), compared in constant time. A console without a token is read-only.
//! - A POST must be JSON and, when the browser says where it comes from (`Origin`,
//!   `Sec-Fetch-Site`), come from the console's own page. The token travels in a header that a
//!   cross-site form cannot send and a cross-site script cannot send without a CORS preflight,
//!   which the console never grants; no cookie is ever used.

use axum::http::{HeaderMap, StatusCode, header};
use subtle::ConstantTimeEq;

use crate::protocol::{ErrorCode, WireError};

pub const TOKEN_HEADER: &str = "x-genfleet-token";

/// A refused request: the HTTP status and the wire error the body carries.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub status: StatusCode,
    pub error: WireError,
}

impl Refusal {
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            error: WireError::new(code, message),
        }
    }

    fn unauthorized(message: impl Into<String>) -> Refusal {
        Refusal::new(StatusCode::FORBIDDEN, ErrorCode::Unauthorized, message)
    }
}

/// The console's rules, fixed when it starts.
#[derive(Clone)]
pub struct Gate {
    /// `None`: read-only.
    token: Option<String>,
    /// Only loopback `Host` names are answered (the console listens on loopback).
    loopback_hosts_only: bool,
}

impl Gate {
    pub fn new(token: Option<String>, loopback_hosts_only: bool) -> Gate {
        Gate {
            token: token.filter(|t| !t.is_empty()),
            loopback_hosts_only,
        }
    }

    pub fn read_only(&self) -> bool {
        self.token.is_none()
    }

    /// Every request: the `Host` it names.
    pub fn check_host(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        if !self.loopback_hosts_only {
            return Ok(());
        }
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        if is_loopback_host(host) {
            Ok(())
        } else {
            Err(Refusal::new(
                StatusCode::MISDIRECTED_REQUEST,
                ErrorCode::Unauthorized,
                format!(
                    "this console listens on loopback and answers only for localhost, 127.0.0.1 or [::1], not Host {host:?}"
                ),
            ))
        }
    }

    /// A request that changes something (an answer) or checks the token: same origin, JSON,
    /// and the token.
    pub fn check_write(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        check_same_origin(headers)?;
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(Refusal::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                ErrorCode::InvalidRequest,
                "the body must be JSON (Content-Type: application/json)",
            ));
        }
        let Some(token) = &self.token else {
            return Err(Refusal::unauthorized(
                "this console is read-only: it was started without console.token (or with --read-only)",
            ));
        };
        let given = headers
            .get(TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .or_else(|| {
                headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
            });
        let Some(given) = given else {
            return Err(Refusal::unauthorized(
                "answering needs the console's token (header X-Genfleet-Token)",
            ));
        };
        if bool::from(given.trim().as_bytes().ct_eq(token.as_bytes())) {
            Ok(())
        } else {
            Err(Refusal::unauthorized(
                "the token is not the console's token",
            ))
        }
    }
}

/// A browser's cross-site request is refused: its `Origin` (when sent) must name the host the
/// request went to, and `Sec-Fetch-Site` (when sent) must say same-origin.
fn check_same_origin(headers: &HeaderMap) -> Result<(), Refusal> {
    let text = |name| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = text("sec-fetch-site")
        && !matches!(site, "same-origin" | "none")
    {
        return Err(Refusal::unauthorized(format!(
            "cross-site request refused (Sec-Fetch-Site: {site})"
        )));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or_default();
        let host = text(header::HOST.as_str()).unwrap_or_default();
        let origin_host = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .unwrap_or_default();
        if host.is_empty() || !origin_host.eq_ignore_ascii_case(host) {
            return Err(Refusal::unauthorized(format!(
                "cross-site request refused (Origin {origin:?} is not this console)"
            )));
        }
    }
    Ok(())
}

/// `localhost`, `127.x.y.z` or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((inside, port)) if port.is_empty() || port.starts_with(':') => inside,
            _ => return false,
        }
    } else {
        host.rsplit_once(':').map_or(host, |(name, _)| name)
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const TOKEN: &str = "0123456789abcdef-token";

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn hosts_of_a_loopback_console() {
        let gate = Gate::new(None, true);
        for (host, ok) in [
            ("127.0.0.1:8080", true),
            ("127.0.0.1", true),
            ("127.1.2.3:80", true),
            ("localhost:8080", true),
            ("LOCALHOST", true),
            ("[::1]:8080", true),
            ("[::1]", true),
            ("evil.example:8080", false),
            ("10.0.0.1:8080", false),
            ("[::2]:8080", false),
            ("[::1]x", false),
            ("", false),
        ] {
            let result = gate.check_host(&headers(&[("host", host)]));
            assert_eq!(result.is_ok(), ok, "{host}");
        }
        // A console told to listen elsewhere answers any name.
        assert!(
            Gate::new(None, false)
                .check_host(&headers(&[("host", "console.example")]))
                .is_ok()
        );
    }

    /// A case: its name, the request's headers, and the refusal expected (status, words of
    /// its message), if any.
    type Case<'a> = (
        &'a str,
        Vec<(&'static str, &'a str)>,
        Option<(u16, &'a str)>,
    );

    #[test]
    fn writes_need_json_the_same_origin_and_the_token() {
        let gate = Gate::new(Some(TOKEN.into()), true);
        let bearer = format!("Bearer {TOKEN}");
        let json = ("content-type", "application/json");
        let host = ("host", "127.0.0.1:8080");
        let token = ("x-genfleet-token", TOKEN);
        let cases: Vec<Case> = vec![
            ("header token", vec![json, host, token], None),
            (
                "bearer token, charset, same origin",
                vec![
                    ("content-type", "application/json; charset=utf-8"),
                    host,
                    ("authorization", &bearer),
                    ("origin", "http://127.0.0.1:8080"),
                    ("sec-fetch-site", "same-origin"),
                ],
                None,
            ),
            (
                "no token",
                vec![json, host],
                Some((403, "needs the console's token")),
            ),
            (
                "wrong token",
                vec![json, host, ("x-genfleet-token", "0123456789abcdef-tokem")],
                Some((403, "not the console's token")),
            ),
            (
                "a prefix of the token",
                vec![json, host, ("x-genfleet-token", "0123456789")],
                Some((403, "not the console's token")),
            ),
            (
                "a form post",
                vec![
                    ("content-type", "application/x-www-form-urlencoded"),
                    host,
                    token,
                ],
                Some((415, "must be JSON")),
            ),
            (
                "another origin",
                vec![json, host, token, ("origin", "http://evil.example")],
                Some((403, "cross-site")),
            ),
            (
                "origin null",
                vec![json, host, token, ("origin", "null")],
                Some((403, "cross-site")),
            ),
            (
                "cross-site fetch",
                vec![json, host, token, ("sec-fetch-site", "cross-site")],
                Some((403, "cross-site")),
            ),
            (
                "same-site is not same-origin",
                vec![json, host, token, ("sec-fetch-site", "same-site")],
                Some((403, "cross-site")),
            ),
        ];
        for (name, pairs, expected) in cases {
            match (gate.check_write(&headers(&pairs)), expected) {
                (Ok(()), None) => {}
                (Err(refusal), Some((status, needle))) => {
                    assert_eq!(refusal.status.as_u16(), status, "{name}");
                    assert!(
                        refusal.error.message.contains(needle),
                        "{name}: {refusal:?}"
                    );
                    if status == 403 {
                        assert_eq!(refusal.error.code, ErrorCode::Unauthorized, "{name}");
                    }
                }
                (got, expected) => panic!("{name}: {got:?}, expected {expected:?}"),
            }
        }
    }

    #[test]
    fn a_console_without_a_token_is_read_only() {
        let gate = Gate::new(Some(String::new()), true);
        assert!(gate.read_only());
        let refusal = gate
            .check_write(&headers(&[
                ("content-type", "application/json"),
                ("host", "localhost:8080"),
                ("x-genfleet-token", "anything-at-all-here"),
            ]))
            .unwrap_err();
        assert_eq!(refusal.error.code, ErrorCode::Unauthorized);
        assert!(refusal.error.message.contains("read-only"));
    }
}
