//! A batch's input file read into its lines, and each line's outcome written as OpenAI's
//! output and error files write it:
//!
//! - answered: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"},
//!   "error": null}` in the output file;
//! - refused or failed by the fleet: the same with the error's status and body
//!   (`{"error": {...}}`), in the error file;
//! - a line that is not a request (bad JSON, a missing `custom_id`, another endpoint's `url`):
//!   `{"id", "custom_id", "response": null, "error": {"code", "message", "line"}}` in the error
//!   file, with its line number. The rest of the batch runs.

use std::collections::HashMap;

use serde_json::{Value, json};

/// One line of the input file.
#[derive(Debug, Clone)]
pub struct Line {
    /// Its line number in the file, from 1.
    pub number: usize,
    pub custom_id: Option<String>,
    /// The request's body, or why the line is not a request.
    pub body: Result<Value, LineError>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LineError {
    pub code: &'static str,
    pub message: String,
}

fn refuse(number: usize, code: &'static str, message: impl std::fmt::Display) -> LineError {
    LineError {
        code,
        message: format!("line {number}: {message}"),
    }
}

/// Reads every non-blank line of `input` as a request to `endpoint`.
pub fn parse(input: &[u8], endpoint: &str) -> Vec<Line> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut lines = Vec::new();
    for (i, raw) in input.split(|b| *b == b'\n').enumerate() {
        let number = i + 1;
        if raw.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let value: Value = match serde_json::from_slice(raw) {
            Ok(value) => value,
            Err(error) => {
                lines.push(Line {
                    number,
                    custom_id: None,
                    body: Err(refuse(number, "invalid_json", format!("not JSON: {error}"))),
                });
                continue;
            }
        };
        let custom_id = value
            .get("custom_id")
            .and_then(Value::as_str)
            .map(str::to_string);
        let body = read_line(number, &value, endpoint).and_then(|body| {
            let id = custom_id.clone().unwrap_or_default();
            match seen.insert(id.clone(), number) {
                Some(first) => Err(refuse(
                    number,
                    "duplicate_custom_id",
                    format!(
                        "custom_id {:?} is the custom_id of line {first} too",
                        crate::protocol::text::one_line(&id)
                    ),
                )),
                None => Ok(body),
            }
        });
        lines.push(Line {
            number,
            custom_id,
            body,
        });
    }
    lines
}

fn read_line(number: usize, value: &Value, endpoint: &str) -> Result<Value, LineError> {
    let Value::Object(map) = value else {
        return Err(refuse(number, "invalid_request", "must be a JSON object"));
    };
    if let Some(key) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "custom_id" | "method" | "url" | "body"))
    {
        return Err(refuse(
            number,
            "invalid_request",
            format!(
                "{}: unknown field (custom_id, method, url and body are)",
                crate::protocol::text::one_line(key)
            ),
        ));
    }
    match map.get("custom_id") {
        Some(Value::String(id)) if !id.is_empty() && id.len() <= 512 => {}
        _ => {
            return Err(refuse(
                number,
                "invalid_request",
                "custom_id: required, a string of 1 to 512 characters",
            ));
        }
    }
    match map.get("method").and_then(Value::as_str) {
        Some("POST") => {}
        _ => return Err(refuse(number, "invalid_request", "method: must be POST")),
    }
    match map.get("url").and_then(Value::as_str) {
        Some(url) if url == endpoint => {}
        _ => {
            return Err(refuse(
                number,
                "invalid_url",
                format!("url: must be the batch's endpoint, {endpoint}"),
            ));
        }
    }
    match map.get("body") {
        Some(body @ Value::Object(_)) => Ok(body.clone()),
        _ => Err(refuse(
            number,
            "invalid_request",
            "body: required, an object",
        )),
    }
}

/// The `id` of a line's outcome.
pub fn outcome_id(batch_id: &str, number: usize) -> String {
    let batch = batch_id.strip_prefix("batch_").unwrap_or(batch_id);
    format!("batch_req_{batch}-{number}")
}

/// The error-file line of a line that is not a request.
pub fn not_a_request(batch_id: &str, line: &Line, error: &LineError) -> Value {
    json!({
        "id": outcome_id(batch_id, line.number),
        "custom_id": line.custom_id,
        "response": null,
        "error": {"code": error.code, "message": error.message, "line": line.number},
    })
}

/// The line of an answered request (`status` 200: of the output file; else of the error
/// file, `body` then being the error's), as JSON text: written straight from `body`, with no
/// value tree built for it on the way.
pub fn answered<B: serde::Serialize>(
    batch_id: &str,
    line: &Line,
    status: u16,
    request_id: Option<&str>,
    body: &B,
) -> String {
    #[derive(serde::Serialize)]
    struct Answered<'a, B> {
        id: String,
        custom_id: &'a Option<String>,
        response: Response<'a, B>,
        error: Option<()>,
    }
    #[derive(serde::Serialize)]
    struct Response<'a, B> {
        status_code: u16,
        request_id: Option<&'a str>,
        body: &'a B,
    }
    serde_json::to_string(&Answered {
        id: outcome_id(batch_id, line.number),
        custom_id: &line.custom_id,
        response: Response {
            status_code: status,
            request_id,
            body,
        },
        error: None,
    })
    .expect("answers serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_is_a_request_or_says_why_not_with_its_number() {
        let input = concat!(
            r#"{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}"#,
            "\n\n",
            "{not json\n",
            r#"{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}"#,
            "\n",
            r#"{"custom_id": "c", "method": "POST", "url": "/v1/responses", "body": {}}"#,
            "\n",
            r#"{"custom_id": "d", "method": "GET", "url": "/v1/chat/completions", "body": {}}"#,
            "\n",
            r#"{"method": "POST", "url": "/v1/chat/completions", "body": {}}"#,
            "\n",
            r#"{"custom_id": "f", "method": "POST", "url": "/v1/chat/completions", "body": {}, "extra": 1}"#,
            "\n",
            r#"{"custom_id": "g", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}"#,
        );
        let lines = parse(input.as_bytes(), "/v1/chat/completions");
        let numbers: Vec<_> = lines.iter().map(|l| l.number).collect();
        assert_eq!(numbers, [1, 3, 4, 5, 6, 7, 8, 9]);
        let codes: Vec<_> = lines
            .iter()
            .map(|l| l.body.as_ref().err().map(|e| e.code))
            .collect();
        assert_eq!(
            codes,
            [
                None,
                Some("invalid_json"),
                Some("duplicate_custom_id"),
                Some("invalid_url"),
                Some("invalid_request"),
                Some("invalid_request"),
                Some("invalid_request"),
                None
            ]
        );
        let error = lines[1].body.as_ref().unwrap_err();
        assert!(error.message.starts_with("line 3:"), "{error:?}");
        let out = not_a_request("batch_01X", &lines[1], error);
        assert_eq!(out["error"]["line"], 3);
        assert_eq!(out["id"], "batch_req_01X-3");
        assert!(
            lines[5]
                .body
                .as_ref()
                .unwrap_err()
                .message
                .contains("custom_id")
        );
        assert!(
            lines[6]
                .body
                .as_ref()
                .unwrap_err()
                .message
                .contains("extra")
        );
    }
}
