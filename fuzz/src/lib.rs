//! What the fuzz targets check, shared so each target stays a few lines. Every check feeds the
//! same function the worker runs on untrusted input and asserts what the contract promises of
//! it: no panic, a clear error for what is refused, and that what is accepted stays usable.

use genfleet::engine::control::{SignalOrigin, control_tool, to_signal};
use genfleet::engine::signals::{SignalBook, json_len};
use genfleet::protocol::{Encoding, ErrorCode, GenerationRequest, Signal};
use genfleet::settings::Settings;
use std::sync::OnceLock;

/// The shipped defaults (config/default.toml), read once.
fn settings() -> &'static Settings {
    static SETTINGS: OnceLock<Settings> = OnceLock::new();
    SETTINGS.get_or_init(Settings::defaults)
}

/// A request body as a worker decodes and checks it on submit and on the queue.
///
/// - A body that does not decode is an INVALID_REQUEST with a message.
/// - A request that passes validation re-encodes, in either encoding, to a body that decodes
///   and passes again: workers store requests and results as JSON and forward continuations,
///   so an accepted request must never become unreadable on the way.
pub fn check_request(encoding: Encoding, data: &[u8]) {
    let limits = genfleet::actors::request_limits(settings());
    let request: GenerationRequest = match encoding.decode(data) {
        Ok(request) => request,
        Err(error) => {
            assert_eq!(error.code, ErrorCode::InvalidRequest);
            assert!(!error.message.is_empty());
            return;
        }
    };
    match request.validate(&limits) {
        Ok(()) => {
            for again in [Encoding::Json, Encoding::MsgPack] {
                let bytes = again.encode(&request);
                let back: GenerationRequest = again.decode(&bytes).unwrap_or_else(|e| {
                    panic!(
                        "an accepted request does not decode from {again:?}: {}",
                        e.message
                    )
                });
                if let Err(e) = back.validate(&limits) {
                    panic!(
                        "an accepted request is refused after {again:?}: {}",
                        e.message
                    );
                }
            }
        }
        Err(error) => {
            assert_eq!(error.code, ErrorCode::InvalidRequest);
            assert!(!error.message.is_empty());
            // The refusal itself goes back in the request's encoding.
            let _ = encoding.encode(&error.to_reply());
        }
    }
}

/// A control-tool call the model made, as the worker handles it: the tool's schema, then the
/// signal it becomes, then the bounded book of the request's signals.
///
/// - A call that passes its schema becomes a signal or a reason to correct it, never a panic.
/// - The signals kept stay within the bounds, and each reads back from the JSON that is
///   published and stored.
pub fn check_control_calls(calls: &[(&str, serde_json::Value)]) {
    let origin = SignalOrigin {
        request_id: "r",
        root_request_id: "r",
        job_name: None,
        worker_id: "w",
        pool: "default",
    };
    let l = &settings().limits;
    let limits = genfleet::engine::SignalLimits {
        max_model_signals: l.max_model_signals,
        max_model_signal_bytes: l.max_model_signal_bytes,
        max_worker_signal_bytes: l.max_worker_signal_bytes,
    };
    let mut book = SignalBook::new(limits);
    for (i, (name, arguments)) in calls.iter().enumerate() {
        let Some(tool) = control_tool(name) else {
            let args = arguments.as_object().cloned().unwrap_or_default();
            assert!(to_signal(name, &args, &origin, true).is_err());
            continue;
        };
        if !tool.check_arguments(arguments).is_empty() {
            continue;
        }
        let args = arguments
            .as_object()
            .expect("a call that passes its schema has an object of arguments");
        let Ok(signal) = to_signal(name, args, &origin, i % 2 == 0) else {
            continue;
        };
        if let Some(kept) = book.add(signal) {
            let json = serde_json::to_vec(kept).expect("a signal encodes");
            let back: Signal = serde_json::from_slice(&json)
                .unwrap_or_else(|e| panic!("a kept signal does not read back: {e}"));
            assert_eq!(back.code, kept.code);
            // Inside a stored result the signal sits two levels deeper.
            let result = serde_json::json!({"signals": [kept]});
            let bytes = serde_json::to_vec(&result).expect("a result encodes");
            serde_json::from_slice::<serde_json::Value>(&bytes)
                .unwrap_or_else(|e| panic!("a result holding the signal does not read back: {e}"));
        }
    }
    let model: Vec<&Signal> = book.signals().iter().collect();
    assert!(model.len() <= limits.max_model_signals as usize);
    let bytes: usize = model
        .iter()
        .map(|s| {
            s.code.len()
                + s.summary.len()
                + json_len(&s.meta)
                + s.decision.as_ref().map_or(0, json_len)
        })
        .sum();
    assert!(
        bytes <= limits.max_model_signal_bytes,
        "{bytes} bytes of model signals kept"
    );
}

/// `text` cut at the byte offsets picked by `cuts` (each taken modulo the length; offsets that
/// fall inside a character are skipped), as a stream of deltas would bring it.
pub fn cut<'a>(text: &'a str, cuts: &[u16]) -> Vec<&'a str> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|&c| usize::from(c) % (text.len() + 1))
        .filter(|&c| text.is_char_boundary(c))
        .collect();
    at.sort_unstable();
    at.dedup();
    let mut pieces = Vec::with_capacity(at.len() + 1);
    let mut start = 0;
    for c in at {
        pieces.push(&text[start..c]);
        start = c;
    }
    pieces.push(&text[start..]);
    pieces
}
