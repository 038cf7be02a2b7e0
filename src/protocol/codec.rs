//! JSON and MessagePack codecs. A message is MessagePack when it carries the header
//! `Content-Type: application/msgpack`; a reply uses the encoding of the request it answers.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::WireError;

pub const CONTENT_TYPE_HEADER: &str = "Content-Type";
pub const MSGPACK_CONTENT_TYPE: &str = "application/msgpack";
pub const JSON_CONTENT_TYPE: &str = "application/json";

/// Either decoder refuses arrays and maps nested this deep (the whole body counting as one
/// level): serde_json's limit, applied to MessagePack too so both encodings accept the same
/// requests.
pub const MAX_DECODE_DEPTH: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    #[default]
    Json,
    MsgPack,
}

impl Encoding {
    /// The encoding named by a `Content-Type` header value (absent or anything else: JSON).
    pub fn from_content_type(value: Option<&str>) -> Encoding {
        match value {
            Some(v)
                if v.split(';')
                    .next()
                    .is_some_and(|t| t.trim().eq_ignore_ascii_case(MSGPACK_CONTENT_TYPE)) =>
            {
                Encoding::MsgPack
            }
            _ => Encoding::Json,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Encoding::Json => JSON_CONTENT_TYPE,
            Encoding::MsgPack => MSGPACK_CONTENT_TYPE,
        }
    }

    /// Encodes `value`. MessagePack uses named fields (maps), so it decodes into the same
    /// strict types as JSON and stays readable by clients in any language.
    pub fn encode<T: Serialize + ?Sized>(self, value: &T) -> Vec<u8> {
        let encoded = match self {
            Encoding::Json => serde_json::to_vec(value).map_err(|e| e.to_string()),
            Encoding::MsgPack => rmp_serde::to_vec_named(value).map_err(|e| e.to_string()),
        };
        // Only maps with non-string keys fail to encode, and the wire types have none.
        encoded.expect("wire types always encode")
    }

    /// Decodes strictly; the error is an INVALID_REQUEST naming what is wrong and where
    /// (`messages[0].role: unknown variant ...`). Both encodings refuse nesting of
    /// [`MAX_DECODE_DEPTH`] levels and bytes after the value.
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> Result<T, WireError> {
        match self {
            Encoding::Json => {
                let invalid = |e: &dyn std::fmt::Display| {
                    WireError::invalid(format!("invalid JSON request: {e}"))
                };
                // serde_json's own recursion limit is MAX_DECODE_DEPTH. Read once without
                // keeping each value's path (what naming the field costs); a value that does
                // not read is read again with it, for the error.
                if let Ok(value) = serde_json::from_slice(bytes) {
                    return Ok(value);
                }
                let mut de = serde_json::Deserializer::from_slice(bytes);
                let value = serde_path_to_error::deserialize(&mut de).map_err(|e| invalid(&e))?;
                de.end().map_err(|e| invalid(&e))?;
                Ok(value)
            }
            Encoding::MsgPack => {
                let invalid = |e: &dyn std::fmt::Display| {
                    WireError::invalid(format!("invalid MessagePack request: {e}"))
                };
                let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(bytes));
                de.set_max_depth(MAX_DECODE_DEPTH);
                let value = serde_path_to_error::deserialize(&mut de)
                    .map_err(|e| invalid(&msgpack_error(&e)))?;
                let rest = bytes.len() as u64 - de.position();
                if rest > 0 {
                    return Err(invalid(&format!("{rest} bytes after the end of the value")));
                }
                Ok(value)
            }
        }
    }
}

/// rmp-serde words a value of the wrong type for a typed field as "wrong msgpack marker
/// FixStr(4)"; say it the way the JSON decoder does.
fn msgpack_error(error: &serde_path_to_error::Error<rmp_serde::decode::Error>) -> String {
    let rmp_serde::decode::Error::TypeMismatch(marker) = error.inner() else {
        return error.to_string();
    };
    use rmp::Marker as M;
    let kind = match marker {
        M::FixPos(_) | M::FixNeg(_) | M::U8 | M::U16 | M::U32 | M::U64 => "integer",
        M::I8 | M::I16 | M::I32 | M::I64 => "integer",
        M::F32 | M::F64 => "floating point",
        M::FixStr(_) | M::Str8 | M::Str16 | M::Str32 => "string",
        M::FixArray(_) | M::Array16 | M::Array32 => "sequence",
        M::FixMap(_) | M::Map16 | M::Map32 => "map",
        M::True | M::False => "boolean",
        M::Null => "nil",
        M::Bin8 | M::Bin16 | M::Bin32 => "binary",
        M::Reserved => "reserved marker 0xc1",
        _ => "extension",
    };
    let path = error.path().to_string();
    if path == "." {
        format!("invalid type: {kind}")
    } else {
        format!("{path}: invalid type: {kind}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::*;
    use serde_json::json;

    fn sample_request() -> GenerationRequest {
        serde_json::from_value(json!({
            "request_id": "r1", "job_name": "j", "system": "s",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\":1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"result\":2}"},
                {"role": "user", "content": [{"type": "text", "text": "more"}]}
            ],
            "tools": ["add"], "tool_iterations": 2, "max_tokens": 10, "temperature": 0.5,
            "options": {"top_p": 0.9, "stop": ["x"]}, "deadline_ms": 5, "metadata": {"k": [1, 2.5, null, true]},
            "validation": [{"kind": "max_chars", "max": 5}, {"kind": "json_schema", "schema": {"type": "object"}, "weight": 2.0}],
            "checkpoints": [{"name": "c", "prompt_contains": ["x"], "min_attempt": 2}]
        }))
        .unwrap()
    }

    fn sample_result() -> GenerationResult {
        GenerationResult {
            request_id: "r1".into(),
            root_request_id: "r1".into(),
            parent_request_id: None,
            job_name: Some("j".into()),
            state: RequestState::Completed,
            reason: Reason::DecisionRequested,
            detail: None,
            output: "out ü".into(),
            reasoning: "why".into(),
            messages: sample_request().messages,
            signals: vec![Signal {
                signal_id: "s1".into(),
                kind: SignalType::DecisionRequest,
                code: "NEEDS_MANAGER_DECISION".into(),
                source: SignalSource::Model,
                severity: Severity::Med,
                summary: "which".into(),
                meta: serde_json::Map::new(),
                request_id: "r1".into(),
                root_request_id: "r1".into(),
                job_name: None,
                worker_id: "w".into(),
                pool: "p".into(),
                ts: "2026-01-01T00:00:00.000Z".into(),
                decision: Some(DecisionBlock {
                    decision_id: "d1".into(),
                    question: "q".into(),
                    options: vec![DecisionOption {
                        id: "a".into(),
                        label: "A".into(),
                        pros: Some("p".into()),
                        cons: None,
                    }],
                    default_option: Some("a".into()),
                    context: None,
                    kind: DecisionKind::Model,
                    expires_at: None,
                }),
            }],
            signals_dropped: 1,
            tool_iterations_used: 2,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 4,
            },
            worker_id: "w".into(),
            attempt: 1,
            chain_position: 1,
            truncated: false,
            metadata: serde_json::Map::new(),
            timings_ms: Timings {
                queued: 1,
                first_token: Some(2),
                total: 3,
            },
            validation: None,
            tool_calls: Vec::new(),
            affinity: Some(crate::protocol::AffinityRecord {
                key: "chat-1".into(),
                preferred_worker: Some("w0".into()),
                held: false,
                fallback: Some("busy".into()),
            }),
            tenant: Some("acme".into()),
            resumed: Vec::new(),
        }
    }

    #[test]
    fn round_trips_in_both_encodings() {
        let request = sample_request();
        let result = sample_result();
        let event = Event {
            request_id: "r1".into(),
            seq: 9,
            ts: "t".into(),
            body: EventBody::Finished {
                result: Box::new(result.clone()),
            },
        };
        for enc in [Encoding::Json, Encoding::MsgPack] {
            let back: GenerationRequest = enc.decode(&enc.encode(&request)).unwrap();
            assert_eq!(back, request, "{enc:?}");
            let back: GenerationResult = enc.decode(&enc.encode(&result)).unwrap();
            assert_eq!(back, result, "{enc:?}");
            let back: Event = enc.decode(&enc.encode(&event)).unwrap();
            assert_eq!(back, event, "{enc:?}");
            let err = WireError::new(ErrorCode::NotReady, "running")
                .with_detail(json!({"state": "RUNNING"}));
            let back: ErrorReply = enc.decode(&enc.encode(&err.to_reply())).unwrap();
            assert_eq!(WireError::from(back), err);
        }
    }

    #[test]
    fn msgpack_is_strict_too() {
        let body = rmp_serde::to_vec_named(
            &json!({"messages": [{"role": "user", "content": "x"}], "bogus": 1}),
        )
        .unwrap();
        let err = Encoding::MsgPack
            .decode::<GenerationRequest>(&body)
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidRequest);
        assert!(err.message.contains("bogus"), "{}", err.message);
        let err = Encoding::MsgPack
            .decode::<GenerationRequest>(&[0xc1, 0x00])
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidRequest);
    }

    /// `{"messages": [...], "metadata": {"k": [[[...]]]}}` with the whole body `depth` deep.
    fn nested_request(depth: usize) -> serde_json::Value {
        let mut value = json!(1);
        for _ in 0..depth - 2 {
            value = json!([value]);
        }
        json!({"messages": [{"role": "user", "content": "x"}], "metadata": {"k": value}})
    }

    #[test]
    fn both_encodings_refuse_the_same_nesting() {
        let deepest = nested_request(MAX_DECODE_DEPTH - 1);
        let deeper = nested_request(MAX_DECODE_DEPTH);
        for enc in [Encoding::Json, Encoding::MsgPack] {
            let body = enc.encode(&deepest);
            let ok = enc.decode::<GenerationRequest>(&body);
            assert!(ok.is_ok(), "{enc:?}: {:?}", ok.err());
            let body = enc.encode(&deeper);
            let err = enc.decode::<GenerationRequest>(&body).unwrap_err();
            assert_eq!(err.code, ErrorCode::InvalidRequest);
            assert!(err.message.contains("metadata"), "{enc:?}: {}", err.message);
        }
    }

    #[test]
    fn errors_name_the_path_to_the_bad_value() {
        let body = json!({"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]});
        for enc in [Encoding::Json, Encoding::MsgPack] {
            let err = enc
                .decode::<GenerationRequest>(&enc.encode(&body))
                .unwrap_err();
            assert!(
                err.message.contains("messages[1].role"),
                "{enc:?}: {}",
                err.message
            );
            assert!(err.message.contains("robot"), "{enc:?}: {}", err.message);
        }
    }

    #[test]
    fn bytes_after_the_value_are_refused() {
        let body = json!({"messages": [{"role": "user", "content": "x"}]});
        for enc in [Encoding::Json, Encoding::MsgPack] {
            let mut bytes = enc.encode(&body);
            bytes.extend_from_slice(&enc.encode(&body));
            let err = enc.decode::<GenerationRequest>(&bytes).unwrap_err();
            assert_eq!(err.code, ErrorCode::InvalidRequest, "{enc:?}");
        }
        let mut bytes = Encoding::MsgPack.encode(&body);
        bytes.push(0xc0);
        let err = Encoding::MsgPack
            .decode::<GenerationRequest>(&bytes)
            .unwrap_err();
        assert!(err.message.contains("1 bytes after"), "{}", err.message);
    }

    #[test]
    fn content_type_selects_encoding() {
        assert_eq!(Encoding::from_content_type(None), Encoding::Json);
        assert_eq!(
            Encoding::from_content_type(Some("application/msgpack")),
            Encoding::MsgPack
        );
        assert_eq!(
            Encoding::from_content_type(Some("Application/MsgPack; x=1")),
            Encoding::MsgPack
        );
        assert_eq!(
            Encoding::from_content_type(Some("application/json")),
            Encoding::Json
        );
    }

    #[test]
    fn event_wire_shape() {
        let event = Event {
            request_id: "r".into(),
            seq: 0,
            ts: "t".into(),
            body: EventBody::Delta { text: "hi".into() },
        };
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            json!({"request_id": "r", "seq": 0, "ts": "t", "event": "delta", "text": "hi"})
        );
    }

    #[test]
    fn an_event_reads_back_whole_whichever_way_its_fields_are_laid_out() {
        let finished = Event {
            request_id: "acme.r1".into(),
            seq: 7,
            ts: "2026-11-28T18:00:00.000Z".into(),
            body: EventBody::Finished {
                result: Box::new(sample_result()),
            },
        };
        let payload = serde_json::to_vec(&finished).unwrap();
        assert_eq!(Event::type_of(&payload), Some(b"finished".as_slice()));
        assert_eq!(Event::from_json(&payload).unwrap(), finished);
        // The type last (another writer's layout): read all the same.
        let result = serde_json::to_string(&sample_result()).unwrap();
        let reordered = format!(
            r#"{{"request_id":"acme.r1","seq":7,"ts":"2026-11-28T18:00:00.000Z","result":{result},"event":"finished"}}"#
        );
        assert_eq!(Event::from_json(reordered.as_bytes()).unwrap(), finished);
        // A tool's result that looks like a finished event, ahead of the type: read as what it
        // is.
        let tool = r#"{"request_id":"r","seq":1,"ts":"t","call_id":"c","name":"n","ok":true,"result":{"event":"finished"},"event":"tool_result"}"#;
        assert_eq!(
            Event::type_of(tool.as_bytes()),
            Some(b"finished".as_slice())
        );
        assert_eq!(
            Event::from_json(tool.as_bytes()).unwrap().body,
            EventBody::ToolResult {
                call_id: "c".into(),
                name: "n".into(),
                ok: true,
                result: json!({"event": "finished"}),
            }
        );
        // A text that names another type is not taken for the event's own.
        let delta = Event {
            body: EventBody::Delta {
                text: r#"say "event":"finished" here"#.into(),
            },
            ..finished.clone()
        };
        let payload = serde_json::to_vec(&delta).unwrap();
        assert_eq!(Event::type_of(&payload), Some(b"delta".as_slice()));
        assert_eq!(Event::from_json(&payload).unwrap(), delta);
        // A finished event whose result does not read is an error, as any other.
        let mut broken = serde_json::to_value(&finished).unwrap();
        broken["result"]["state"] = json!("NOT_A_STATE");
        let broken = serde_json::to_vec(&broken).unwrap();
        assert!(Event::from_json(&broken).is_err());
        assert_eq!(Event::type_of(b"{}"), None);
        assert_eq!(Event::type_of(br#"{"event":"unterminated"#), None);
    }
}
