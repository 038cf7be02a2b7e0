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

use serde::de::IgnoredAny;
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// One line of the input file.
#[derive(Debug, Clone)]
pub struct Line {
    /// Its line number in the file, from 1.
    pub number: usize,
    pub custom_id: Option<String>,
    /// The request's body as it was written (an object; read into its request when the line
    /// runs), or why the line is not a request.
    pub body: Result<Box<RawValue>, LineError>,
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

/// Reads every non-blank line of `input` as a request to `endpoint`. Only the line's own
/// fields are read here: its body is kept as written, for its run to read.
pub fn parse(input: &[u8], endpoint: &str) -> Vec<Line> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut lines = Vec::new();
    for (i, raw) in input.split(|b| *b == b'\n').enumerate() {
        let number = i + 1;
        if raw.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let fields: Fields = match serde_json::from_slice(raw) {
            Ok(fields) => fields,
            // Valid JSON, but not an object.
            Err(_) if serde_json::from_slice::<IgnoredAny>(raw).is_ok() => {
                lines.push(Line {
                    number,
                    custom_id: None,
                    body: Err(refuse(number, "invalid_request", "must be a JSON object")),
                });
                continue;
            }
            Err(error) => {
                lines.push(Line {
                    number,
                    custom_id: None,
                    body: Err(refuse(number, "invalid_json", format!("not JSON: {error}"))),
                });
                continue;
            }
        };
        let custom_id = fields.string("custom_id");
        let body = read_line(number, &fields, custom_id.as_deref(), endpoint).and_then(|body| {
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

/// A line's fields, each value as written (the last of a name written twice, as a JSON
/// object reader takes it).
struct Fields<'a>(Vec<(String, &'a RawValue)>);

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| *v)
    }

    /// The field's string, `None` when absent or not a string.
    fn string(&self, name: &str) -> Option<String> {
        serde_json::from_str(self.get(name)?.get()).ok()
    }
}

impl<'de> serde::Deserialize<'de> for Fields<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Fields<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Fields<'de>, A::Error> {
                let mut fields = Vec::with_capacity(4);
                while let Some((key, value)) = map.next_entry::<String, &'de RawValue>()? {
                    fields.push((key, value));
                }
                Ok(Fields(fields))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

fn read_line(
    number: usize,
    fields: &Fields,
    custom_id: Option<&str>,
    endpoint: &str,
) -> Result<Box<RawValue>, LineError> {
    if let Some((key, _)) = fields
        .0
        .iter()
        .find(|(k, _)| !matches!(k.as_str(), "custom_id" | "method" | "url" | "body"))
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
    match custom_id {
        Some(id) if !id.is_empty() && id.len() <= 512 => {}
        _ => {
            return Err(refuse(
                number,
                "invalid_request",
                "custom_id: required, a string of 1 to 512 characters",
            ));
        }
    }
    match fields.string("method").as_deref() {
        Some("POST") => {}
        _ => return Err(refuse(number, "invalid_request", "method: must be POST")),
    }
    match fields.string("url") {
        Some(url) if url == endpoint => {}
        _ => {
            return Err(refuse(
                number,
                "invalid_url",
                format!("url: must be the batch's endpoint, {endpoint}"),
            ));
        }
    }
    match fields.get("body") {
        Some(body) if body.get().starts_with('{') => Ok(body.to_owned()),
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

    #[test]
    fn a_body_is_kept_as_written_and_only_an_object_is_one() {
        let input = concat!(
            r#"{"custom_id": "a\u0062", "method": "POST", "url": "/v1/chat/completions", "body":   {"model": "m", "messages": [{"role": "user", "content": "x\ny"}]}}"#,
            "\n",
            "[1, 2]\n",
            r#"{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": "{}"}"#,
            "\n",
            r#"{"custom_id": 4, "method": "POST", "url": "/v1/chat/completions", "body": {}}"#,
            "\n",
            r#"{"custom_id": "e", "url": "/v1/x", "url": "/v1/chat/completions", "method": "POST", "body": {}}"#,
        );
        let lines = parse(input.as_bytes(), "/v1/chat/completions");
        assert_eq!(lines[0].custom_id.as_deref(), Some("ab"));
        let body = lines[0].body.as_ref().expect("an object");
        let read: Value = serde_json::from_str(body.get()).expect("the body is JSON");
        assert_eq!(read["messages"][0]["content"], "x\ny");
        let error = lines[1].body.as_ref().unwrap_err();
        assert_eq!(error.code, "invalid_request");
        assert!(error.message.contains("must be a JSON object"), "{error:?}");
        let error = lines[2].body.as_ref().unwrap_err();
        assert!(error.message.contains("body"), "{error:?}");
        let error = lines[3].body.as_ref().unwrap_err();
        assert!(error.message.contains("custom_id"), "{error:?}");
        assert_eq!(lines[3].custom_id, None);
        // A field written twice counts as its last value, as a JSON object reader takes it.
        assert!(lines[4].body.is_ok(), "{:?}", lines[4].body);
    }
}
