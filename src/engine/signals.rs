//! The bounded record of a request's signals.
//!
//! A model may raise only a few small signals per request (it must not flood managers);
//! signals the worker raises itself are always kept, with their `meta` trimmed to a bound.

use crate::protocol::text::floor_char_boundary;
use crate::protocol::{Signal, SignalSource};

#[derive(Debug, Clone, Copy)]
pub struct SignalLimits {
    pub max_model_signals: u32,
    pub max_model_signal_bytes: usize,
    pub max_worker_signal_bytes: usize,
}

#[derive(Debug)]
pub struct SignalBook {
    limits: SignalLimits,
    signals: Vec<Signal>,
    model_count: u32,
    model_bytes: usize,
    dropped: u32,
}

impl SignalBook {
    pub fn new(limits: SignalLimits) -> Self {
        SignalBook {
            limits,
            signals: Vec::new(),
            model_count: 0,
            model_bytes: 0,
            dropped: 0,
        }
    }

    /// Keeps a signal if the bounds allow; returns whether it was kept. What counts against the
    /// byte bound is what the model wrote (code, summary, meta, decision), not the ids and
    /// timestamps the worker adds.
    pub fn add(&mut self, mut signal: Signal) -> Option<&Signal> {
        match signal.source {
            SignalSource::Worker => {
                trim_map(&mut signal.meta, self.limits.max_worker_signal_bytes);
            }
            SignalSource::Model => {
                let size = model_bytes(&signal);
                if self.model_count >= self.limits.max_model_signals
                    || self.model_bytes + size > self.limits.max_model_signal_bytes
                {
                    self.dropped += 1;
                    return None;
                }
                self.model_count += 1;
                self.model_bytes += size;
            }
        }
        self.signals.push(signal);
        self.signals.last()
    }

    pub fn dropped(&self) -> u32 {
        self.dropped
    }

    /// The book of a resumed generation: the signals its earlier run raised (sent already),
    /// counted against the same bounds.
    pub fn restore(&mut self, signals: Vec<Signal>, dropped: u32) {
        for signal in signals {
            self.add(signal);
        }
        self.dropped += dropped;
    }

    pub fn signals(&self) -> &[Signal] {
        &self.signals
    }

    pub fn into_signals(self) -> Vec<Signal> {
        self.signals
    }
}

fn model_bytes(signal: &Signal) -> usize {
    signal.code.len()
        + signal.summary.len()
        + json_len(&signal.meta)
        + signal.decision.as_ref().map_or(0, json_len)
}

/// Serialized JSON length, without keeping the bytes.
pub fn json_len<T: serde::Serialize + ?Sized>(value: &T) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
}

/// Shrinks `map` until its JSON is at most `max_bytes`, trimming the longest strings first
/// (the long texts carry the least information per byte: prompts, outputs, histories), then
/// dropping the largest entries if strings alone cannot make it fit.
pub fn trim_map(map: &mut serde_json::Map<String, serde_json::Value>, max_bytes: usize) {
    const MARK: &str = "…";
    loop {
        let size = json_len(map);
        if size <= max_bytes {
            return;
        }
        let excess = size - max_bytes;
        let Some(longest) = longest_string(map) else {
            break;
        };
        let len = longest.len();
        if len <= 16 {
            break;
        }
        let keep = len
            .saturating_sub(excess + MARK.len())
            .max(len / 2)
            .min(len - 8);
        longest.truncate(floor_char_boundary(longest, keep));
        longest.push_str(MARK);
    }
    while json_len(map) > max_bytes {
        let Some(largest) = map
            .iter()
            .max_by_key(|(_, v)| json_len(*v))
            .map(|(k, _)| k.clone())
        else {
            return;
        };
        map.remove(&largest);
    }
}

fn longest_string(map: &mut serde_json::Map<String, serde_json::Value>) -> Option<&mut String> {
    fn visit<'a>(value: &'a mut serde_json::Value, best: &mut Option<&'a mut String>) {
        match value {
            serde_json::Value::String(s) if best.as_ref().is_none_or(|b| s.len() > b.len()) => {
                *best = Some(s);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(|v| visit(v, best)),
            serde_json::Value::Object(map) => map.values_mut().for_each(|v| visit(v, best)),
            _ => {}
        }
    }
    let mut best = None;
    for value in map.values_mut() {
        visit(value, &mut best);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Severity, SignalType};
    use serde_json::json;

    fn signal(source: SignalSource, summary: &str, meta: serde_json::Value) -> Signal {
        Signal {
            signal_id: "s".into(),
            kind: SignalType::Issue,
            code: "POLICY_RISK".into(),
            source,
            severity: Severity::Low,
            summary: summary.into(),
            meta: meta.as_object().cloned().unwrap_or_default(),
            request_id: "r".into(),
            root_request_id: "r".into(),
            job_name: None,
            worker_id: "w".into(),
            pool: "p".into(),
            ts: "t".into(),
            decision: None,
        }
    }

    fn limits() -> SignalLimits {
        SignalLimits {
            max_model_signals: 3,
            max_model_signal_bytes: 4096,
            max_worker_signal_bytes: 1024,
        }
    }

    #[test]
    fn model_signals_are_bounded_by_count_and_bytes() {
        let mut book = SignalBook::new(limits());
        for _ in 0..5 {
            book.add(signal(SignalSource::Model, "x", json!({})));
        }
        assert_eq!(book.signals().len(), 3);
        assert_eq!(book.dropped(), 2);
        // Worker signals are kept past the model's bound.
        assert!(
            book.add(signal(SignalSource::Worker, "w", json!({})))
                .is_some()
        );
        assert_eq!(book.signals().len(), 4);

        let mut book = SignalBook::new(limits());
        assert!(
            book.add(signal(SignalSource::Model, &"a".repeat(3000), json!({})))
                .is_some()
        );
        assert!(
            book.add(signal(SignalSource::Model, &"a".repeat(1500), json!({})))
                .is_none()
        );
        assert!(
            book.add(signal(SignalSource::Model, "small", json!({})))
                .is_some()
        );
        assert_eq!(book.dropped(), 1);
    }

    #[test]
    fn worker_meta_is_trimmed_longest_first() {
        let mut book = SignalBook::new(limits());
        let kept = book
            .add(signal(
                SignalSource::Worker,
                "s",
                json!({"prompt": "p".repeat(5000), "output": "o".repeat(600), "n": 3, "short": "keep me"}),
            ))
            .unwrap();
        let size = serde_json::to_vec(&kept.meta).unwrap().len();
        assert!(size <= 1024, "{size}");
        assert_eq!(kept.meta["short"], "keep me");
        assert_eq!(kept.meta["n"], 3);
        assert!(kept.meta["prompt"].as_str().unwrap().ends_with('…'));
    }

    #[test]
    fn trimming_terminates_on_unshrinkable_meta() {
        let mut map = json!({"a": vec![1; 400], "b": "x"})
            .as_object()
            .cloned()
            .unwrap();
        trim_map(&mut map, 100);
        assert!(serde_json::to_vec(&map).unwrap().len() <= 100);
    }
}
