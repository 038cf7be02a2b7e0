//! docs/protocol.md's Result, Events and Status tables, walked field by field on a real fleet, in
//! the manner of tests/bad_input.rs's walk of the request.
//!
//! The documented fields are read from the doc itself (the Result example, its optional fields
//! and its table of states and reasons; the Events table and the fields every event has; the
//! Status examples and the finished summary), and this file's tables must name each of them and
//! nothing else, so a field added to the doc or to the wire without the other fails here. Then
//! every field is checked on the wire (the raw JSON of `gen.result.*`, `gen.events.*` and
//! `gen.status.*`) for a completed, a failed, a cancelled and a continued request, the
//! continuation that one started, and a request whose decision ended its chain: present where
//! the doc says, absent where it says, of its type, and meaning what it says. Every mismatch is
//! collected and reported at once.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fleet::{self, Fleet};
use common::wait;
use futures_util::StreamExt;
use genfleet::protocol::{DecisionAnswer, GenerationRequest};
use serde_json::{Value, json};

/// Generous: a busy machine is slow, never wrong.
const WITHIN: Duration = Duration::from_secs(30);

/// The cancelled request's whole answer (a word every 200 ms): it is cancelled long before.
const SLOW_REPLY: &str = "a b c d e f g h i j k l m n o p q r s t";
/// The failed request's answer, of which the stream breaks after two words.
const BROKEN_REPLY: &str = "one two three four five six";
/// The resumed request's answer, and the part of it its checkpoint held.
const RESUMED_REPLY: &str = "Half of the answer, then the rest.";
const RESUMED_PREFIX: &str = "Half of the ";
/// The worker the resumed request's record names, which never beats.
const GONE_WORKER: &str = "tbl-gone";

const SCRIPT: &str = r#"
[[rules]]
when_last_user_contains = "Decision chosen"
reply = "Carrying on as decided."

[[rules]]
when_last_role = "tool"
reasoning = "The tool answered."
reply = "The sum is in."

[[rules]]
when_last_user_contains = "tbl-completed"
reasoning = "Adding first."
reply = "Let me add."
tool_calls = [
  { name = "calculate", arguments = { operation = "add", a = 2, b = 3 } },
  { name = "signal_issue", arguments = { code = "NEEDS_EXTERNAL_INFO", severity = "low", summary = "noted" } },
]

[[rules]]
when_last_user_contains = "tbl-resumed"
reply = "Half of the answer, then the rest."

[[rules]]
when_last_user_contains = "tbl-failed"
reply = "one two three four five six"
break_after = 2

[[rules]]
when_last_user_contains = "tbl-cancelled"
reply = "a b c d e f g h i j k l m n o p q r s t"
delay_ms = 200

[[rules]]
when_last_user_contains = "tbl-continued"
reply = "Two ways."
tool_calls = [{ name = "request_decision", arguments = { question = "Which way?", options = [{ id = "left", label = "Left" }, { id = "right", label = "Right" }] } }]
"#;

/// What a request of the walk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// COMPLETED `stop`, after a tool call, with reasoning, a signal, checks and a key.
    Completed,
    /// FAILED `backend_error`: the stream broke after two words (run as tenant `acme`).
    Failed,
    /// CANCELLED while it streamed.
    Cancelled,
    /// COMPLETED `decision_requested`, its decision answered with an option that continues.
    Continued,
    /// The continuation the answer started.
    Continuation,
    /// COMPLETED `decision_requested` at a checkpoint, answered `skip`: its chain ended.
    ChainEnded,
    /// COMPLETED `stop`, taken up from the checkpoint a gone worker left in its record, its
    /// cut turn continued.
    Resumed,
}

use Kind::*;

/// A request of the walk, and what the fleet said of it on the wire.
struct Subject {
    kind: Kind,
    /// Its id on the bus.
    id: String,
    /// Its first user message.
    prompt: String,
    job_name: Option<&'static str>,
    metadata: Value,
    root: String,
    parent: Option<String>,
    /// The decision it raised.
    decision_id: Option<String>,
    /// The continuation its decision started.
    continuation: Option<String>,
    result: Value,
    events: Vec<Value>,
    status: Value,
    /// Its status while it ran (the cancelled request's only).
    running: Option<Value>,
    /// The `seq` of its first event heard (a resumed request numbers on from its checkpoint).
    first_seq: u64,
}

impl Subject {
    fn state(&self) -> &'static str {
        match self.kind {
            Completed | Continued | Continuation | ChainEnded | Resumed => "COMPLETED",
            Failed => "FAILED",
            Cancelled => "CANCELLED",
        }
    }

    fn reason(&self) -> &'static str {
        match self.kind {
            Completed | Continuation | Resumed => "stop",
            Continued | ChainEnded => "decision_requested",
            Failed => "backend_error",
            Cancelled => "cancelled",
        }
    }

    /// Its delivery: the resumed request's run is its second.
    fn attempt(&self) -> u64 {
        if self.kind == Resumed { 2 } else { 1 }
    }

    fn output(&self) -> &str {
        self.result["output"].as_str().unwrap_or_default()
    }

    /// The joined `text` of its events named `name`.
    fn joined(&self, name: &str) -> String {
        self.events
            .iter()
            .filter(|e| e["event"] == name)
            .filter_map(|e| e["text"].as_str())
            .collect()
    }

    fn names(&self) -> Vec<&str> {
        self.events
            .iter()
            .filter_map(|e| e["event"].as_str())
            .collect()
    }
}

/// What the whole walk shares.
struct Walk {
    worker_id: String,
}

/// Checks one field's value (`None`: absent) of one subject.
type Rule = fn(&Walk, &Subject, Option<&Value>) -> Result<(), String>;
/// Checks one field of an event (`event`) of one subject.
type EventRule = fn(&Walk, &Subject, &Value, Option<&Value>) -> Result<(), String>;

// ---- what a field holds ----

fn present(v: Option<&Value>) -> Result<&Value, String> {
    v.ok_or_else(|| "absent".to_string())
}

fn absent(v: Option<&Value>) -> Result<(), String> {
    match v {
        None => Ok(()),
        Some(v) => Err(format!("present ({v}), where the doc leaves it out")),
    }
}

fn string(v: Option<&Value>) -> Result<&str, String> {
    let v = present(v)?;
    v.as_str().ok_or_else(|| format!("not a string: {v}"))
}

fn number(v: Option<&Value>) -> Result<f64, String> {
    let v = present(v)?;
    v.as_f64().ok_or_else(|| format!("not a number: {v}"))
}

fn count(v: Option<&Value>) -> Result<u64, String> {
    let v = present(v)?;
    v.as_u64().ok_or_else(|| format!("not a whole number: {v}"))
}

fn boolean(v: Option<&Value>) -> Result<bool, String> {
    let v = present(v)?;
    v.as_bool().ok_or_else(|| format!("not a boolean: {v}"))
}

fn object(v: Option<&Value>) -> Result<&serde_json::Map<String, Value>, String> {
    let v = present(v)?;
    v.as_object().ok_or_else(|| format!("not an object: {v}"))
}

fn array(v: Option<&Value>) -> Result<&Vec<Value>, String> {
    let v = present(v)?;
    v.as_array().ok_or_else(|| format!("not an array: {v}"))
}

fn equal<T: PartialEq + std::fmt::Debug>(got: T, want: T) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{got:?}, expected {want:?}"))
    }
}

fn holds(ok: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if ok { Ok(()) } else { Err(why()) }
}

/// An RFC 3339 time in UTC, as the fleet writes them (`2026-11-22T10:00:01.204Z`).
fn timestamp(v: Option<&Value>) -> Result<(), String> {
    let ts = string(v)?;
    let ok = ts.len() >= 20
        && ts.ends_with('Z')
        && ts.as_bytes()[10] == b'T'
        && ts[..4].chars().all(|c| c.is_ascii_digit());
    holds(ok, || format!("not an RFC 3339 UTC time: {ts:?}"))
}

/// The value at a dotted path; `a.b` looks into the first element where `a` is an array.
fn lookup<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(value, |v, key| {
        let v = if let Value::Array(items) = v {
            items.first()?
        } else {
            v
        };
        v.get(key)
    })
}

// ---- the Result table ----

fn result_rules() -> Vec<(&'static str, Rule)> {
    vec![
        ("request_id", |_, s, v| equal(string(v)?, s.id.as_str())),
        ("root_request_id", |_, s, v| {
            equal(string(v)?, s.root.as_str())
        }),
        ("parent_request_id", |_, s, v| {
            equal(present(v)?, &json!(s.parent))
        }),
        ("job_name", |_, s, v| match s.job_name {
            Some(name) => equal(string(v)?, name),
            None => absent(v),
        }),
        ("state", |_, s, v| equal(string(v)?, s.state())),
        ("reason", |_, s, v| equal(string(v)?, s.reason())),
        ("output", |_, s, v| {
            let output = string(v)?;
            match s.kind {
                Completed => equal(output, "Let me add.\n\nThe sum is in."),
                Failed => holds(
                    !output.is_empty()
                        && BROKEN_REPLY.starts_with(output)
                        && output.len() < BROKEN_REPLY.len(),
                    || format!("not the partial output: {output:?}"),
                ),
                Cancelled => holds(
                    !output.is_empty()
                        && SLOW_REPLY.starts_with(output)
                        && output.len() < SLOW_REPLY.len(),
                    || format!("not the partial output: {output:?}"),
                ),
                Continued => equal(output, "Two ways."),
                Continuation => equal(output, "Carrying on as decided."),
                // The checkpoint asks before the model is called.
                ChainEnded => equal(output, ""),
                Resumed => equal(output, RESUMED_REPLY),
            }
        }),
        ("messages", |_, s, v| {
            let messages = array(v)?;
            equal(
                messages.first(),
                Some(&json!({"role": "user", "content": s.prompt})),
            )?;
            let role = |r: &str| messages.iter().any(|m| m["role"] == r);
            match s.kind {
                Completed => holds(role("tool") && role("assistant"), || {
                    format!("no tool turn: {messages:?}")
                }),
                Continuation => {
                    let last_user = messages.iter().rev().find(|m| m["role"] == "user");
                    let text = last_user.and_then(|m| m["content"].as_str());
                    holds(
                        text.is_some_and(|t| t.starts_with("Decision chosen: Left (left)")),
                        || format!("no choice injected: {messages:?}"),
                    )
                }
                _ => Ok(()),
            }
        }),
        ("signals", |_, s, v| {
            let signals = array(v)?;
            let named: Vec<String> = signals
                .iter()
                .map(|s| {
                    format!(
                        "{}.{}",
                        s["type"].as_str().unwrap_or("?"),
                        s["code"].as_str().unwrap_or("?")
                    )
                })
                .collect();
            let decision = |s: &Value| s["decision"]["decision_id"].as_str().map(String::from);
            match s.kind {
                Completed => equal(named, vec!["issue.NEEDS_EXTERNAL_INFO".to_string()]),
                Continued => {
                    equal(
                        named,
                        vec!["decision_request.NEEDS_MANAGER_DECISION".to_string()],
                    )?;
                    equal(decision(&signals[0]), s.decision_id.clone())
                }
                ChainEnded => {
                    equal(named, vec!["decision_request.CHECKPOINT".to_string()])?;
                    equal(decision(&signals[0]), s.decision_id.clone())
                }
                Cancelled | Continuation | Resumed => equal(named, Vec::new()),
                // The fleet's own signals may be here: each names its type and code.
                Failed => holds(!named.iter().any(|n| n.contains('?')), || {
                    format!("{signals:?}")
                }),
            }
        }),
        ("signals_dropped", |_, _, v| equal(count(v)?, 0)),
        ("tool_iterations_used", |_, s, v| {
            equal(count(v)?, u64::from(s.kind == Completed))
        }),
        ("usage", |_, _, v| object(v).map(|_| ())),
        ("usage.prompt_tokens", |_, s, v| tokens(s, count(v)?)),
        ("usage.completion_tokens", |_, s, v| tokens(s, count(v)?)),
        ("worker_id", |w, _, v| {
            equal(string(v)?, w.worker_id.as_str())
        }),
        ("attempt", |_, s, v| equal(count(v)?, s.attempt())),
        ("chain_position", |_, s, v| {
            equal(count(v)?, if s.kind == Continuation { 2 } else { 1 })
        }),
        ("truncated", |_, _, v| equal(boolean(v)?, false)),
        ("metadata", |_, s, v| equal(present(v)?, &s.metadata)),
        ("timings_ms", |_, _, v| object(v).map(|_| ())),
        ("timings_ms.queued", |_, _, v| count(v).map(|_| ())),
        ("timings_ms.first_token", |_, s, v| match s.kind {
            // No token came: the checkpoint stopped it first.
            ChainEnded => absent(v),
            _ => count(v).map(|_| ()),
        }),
        ("timings_ms.total", |_, s, v| {
            let queued = count(lookup(&s.result, "timings_ms.queued"))?;
            holds(count(v)? >= queued, || "total is less than queued".into())
        }),
        ("validation", |_, s, v| match s.kind {
            // The only request with checks; they judge a final answer.
            Completed => object(v).map(|_| ()),
            _ => absent(v),
        }),
        ("validation.confidence", |_, s, v| {
            checked(s, v, |v| equal(number(v)?, 1.0))
        }),
        ("validation.pass_rate", |_, s, v| {
            checked(s, v, |v| equal(number(v)?, 100.0))
        }),
        ("validation.threshold", |_, s, v| {
            checked(s, v, |v| equal(number(v)?, 0.6))
        }),
        ("validation.passed", |_, s, v| {
            checked(s, v, |v| equal(boolean(v)?, true))
        }),
        ("validation.retried", |_, s, v| {
            checked(s, v, |v| equal(boolean(v)?, false))
        }),
        ("validation.checks", |_, s, v| {
            checked(s, v, |v| equal(array(v)?.len(), 1))
        }),
        ("validation.checks.kind", |_, s, v| {
            checked(s, v, |v| equal(string(v)?, "contains"))
        }),
        ("validation.checks.name", |_, s, v| {
            checked(s, v, |v| equal(string(v)?, "contains \"sum\""))
        }),
        ("validation.checks.weight", |_, s, v| {
            checked(s, v, |v| equal(number(v)?, 1.0))
        }),
        ("validation.checks.passed", |_, s, v| {
            checked(s, v, |v| equal(boolean(v)?, true))
        }),
        ("detail", |_, s, v| match s.kind {
            // A plain success has none.
            Completed | Continuation => absent(v),
            Failed => holds(!string(v)?.is_empty(), || "empty".into()),
            _ => v.map_or(Ok(()), |v| string(Some(v)).map(|_| ())),
        }),
        ("reasoning", |_, s, v| match s.kind {
            Completed => {
                let reasoning = string(v)?;
                holds(
                    reasoning.contains("Adding first.") && reasoning.contains("The tool answered."),
                    || format!("not the model's reasoning: {reasoning:?}"),
                )
            }
            _ => absent(v),
        }),
        // No request here called a tool of its caller's.
        ("tool_calls", |_, _, v| absent(v)),
        ("affinity", |w, s, v| match s.kind {
            Completed => {
                let affinity = object(v)?;
                equal(affinity.get("key"), Some(&json!("tbl-key")))?;
                // Placed on its key's worker, the one worker here.
                equal(affinity.get("preferred_worker"), Some(&json!(w.worker_id)))?;
                equal(affinity.get("held"), Some(&json!(true)))
            }
            // Keyed by its chain's root, and placed on the worker that ran the root.
            Continuation => {
                let affinity = object(v)?;
                equal(affinity.get("key"), Some(&json!(s.root)))?;
                equal(affinity.get("preferred_worker"), Some(&json!(w.worker_id)))?;
                equal(affinity.get("held"), Some(&json!(true)))
            }
            _ => absent(v),
        }),
        ("tenant", |_, s, v| match s.kind {
            Failed => equal(string(v)?, "acme"),
            _ => absent(v),
        }),
        ("resumed", |w, s, v| match s.kind {
            Resumed => {
                let moves = array(v)?;
                equal(moves.len(), 1)?;
                let moved = &moves[0];
                equal(&moved["from_worker"], &json!(GONE_WORKER))?;
                equal(&moved["to_worker"], &json!(w.worker_id))?;
                equal(&moved["reason"], &json!("worker_lost"))?;
                equal(&moved["at_token"], &json!(3))?;
                equal(&moved["at_output_bytes"], &json!(RESUMED_PREFIX.len()))?;
                absent(moved.get("turn_restarted"))?;
                timestamp(moved.get("at"))
            }
            _ => absent(v),
        }),
    ]
}

/// A count of tokens: some where the backend answered in full and said how many, none where
/// the model was not called; a stream cut short (broken or cancelled) may have none to tell.
fn tokens(s: &Subject, n: u64) -> Result<(), String> {
    match s.kind {
        ChainEnded => equal(n, 0),
        Failed | Cancelled => Ok(()),
        _ => holds(n > 0, || "none".into()),
    }
}

/// A field of the validation report: present (and as `check` says) only where there is one.
fn checked(
    s: &Subject,
    v: Option<&Value>,
    check: impl FnOnce(Option<&Value>) -> Result<(), String>,
) -> Result<(), String> {
    match s.kind {
        Completed => check(v),
        _ => absent(v),
    }
}

// ---- the Events table ----

fn event_rules() -> Vec<(&'static str, &'static str, EventRule)> {
    vec![
        // Every event.
        ("*", "event", |_, _, _, v| string(v).map(|_| ())),
        ("*", "request_id", |_, s, _, v| {
            equal(string(v)?, s.id.as_str())
        }),
        ("*", "seq", |_, s, e, v| {
            let at = s.events.iter().position(|x| std::ptr::eq(x, e)).unwrap();
            equal(count(v)?, s.first_seq + at as u64)
        }),
        ("*", "ts", |_, s, e, v| {
            timestamp(v)?;
            let at = s.events.iter().position(|x| std::ptr::eq(x, e)).unwrap();
            let before = at.checked_sub(1).map(|i| &s.events[i]["ts"]);
            holds(
                before.is_none_or(|b| b.as_str() <= v.and_then(Value::as_str)),
                || format!("earlier than the event before it ({before:?})"),
            )
        }),
        ("started", "worker_id", |w, _, _, v| {
            equal(string(v)?, w.worker_id.as_str())
        }),
        ("started", "attempt", |_, _, _, v| equal(count(v)?, 1)),
        ("started", "chain_position", |_, s, _, v| {
            equal(Some(count(v)?), s.result["chain_position"].as_u64())
        }),
        ("delta", "text", |_, s, _, v| {
            holds(!string(v)?.is_empty(), || "empty".into())?;
            // The joined deltas are the output (a resumed run's go on from its checkpoint's).
            let before = if s.kind == Resumed {
                RESUMED_PREFIX
            } else {
                ""
            };
            equal(
                format!("{before}{}", s.joined("delta")),
                s.output().to_string(),
            )
        }),
        ("resumed", "worker_id", |w, _, _, v| {
            equal(string(v)?, w.worker_id.as_str())
        }),
        ("resumed", "attempt", |_, _, _, v| equal(count(v)?, 2)),
        ("resumed", "from_worker", |_, _, _, v| {
            equal(string(v)?, GONE_WORKER)
        }),
        ("resumed", "reason", |_, _, _, v| {
            equal(string(v)?, "worker_lost")
        }),
        // Its cut turn was continued, not taken again.
        ("resumed", "turn_restarted", |_, _, _, v| absent(v)),
        ("reasoning", "text", |_, s, _, v| {
            string(v)?;
            equal(
                s.joined("reasoning").as_str(),
                s.result["reasoning"].as_str().unwrap_or_default(),
            )
        }),
        ("tool_call", "call_id", |_, _, _, v| {
            holds(!string(v)?.is_empty(), || "empty".into())
        }),
        ("tool_call", "name", |_, _, _, v| {
            equal(string(v)?, "calculate")
        }),
        ("tool_call", "arguments", |_, _, _, v| {
            equal(present(v)?, &json!({"operation": "add", "a": 2, "b": 3}))
        }),
        ("tool_result", "call_id", |_, s, _, v| {
            // It answers the call announced before it.
            let call = s.events.iter().find(|e| e["event"] == "tool_call");
            equal(v, call.map(|c| &c["call_id"]))
        }),
        ("tool_result", "name", |_, _, _, v| {
            equal(string(v)?, "calculate")
        }),
        ("tool_result", "ok", |_, _, _, v| equal(boolean(v)?, true)),
        ("tool_result", "result", |_, _, _, v| {
            let result = present(v)?;
            holds(result.to_string().contains('5'), || {
                format!("not 2 + 3: {result}")
            })
        }),
        ("signal", "signal", |_, s, _, v| {
            let signal = present(v)?;
            let stored = s.result["signals"].as_array().cloned().unwrap_or_default();
            holds(stored.contains(signal), || {
                format!("not one of the result's signals: {signal}")
            })
        }),
        ("finished", "result", |_, s, _, v| {
            // All of it: the result as stored.
            equal(present(v)?, &s.result)
        }),
        ("continued", "continuation_request_id", |_, s, _, v| {
            equal(Some(string(v)?), s.continuation.as_deref())
        }),
        ("chain_ended", "decision_id", |_, s, _, v| {
            equal(Some(string(v)?), s.decision_id.as_deref())
        }),
        ("chain_ended", "outcome", |_, _, _, v| {
            equal(string(v)?, "skipped")
        }),
        ("chain_ended", "option_id", |_, _, _, v| {
            equal(string(v)?, "skip")
        }),
        ("chain_ended", "decided_by", |_, _, _, v| {
            equal(string(v)?, "tbl-manager")
        }),
    ]
}

/// The events each request must emit, in this order (`delta`s and `reasoning`s repeat).
fn expected_events(kind: Kind) -> Vec<&'static str> {
    match kind {
        Completed => vec![
            "started",
            "reasoning",
            "delta",
            "signal",
            "tool_call",
            "tool_result",
            "reasoning",
            "delta",
            "finished",
        ],
        Failed | Cancelled | Continuation => vec!["started", "delta", "finished"],
        Continued => vec!["started", "delta", "signal", "finished", "continued"],
        ChainEnded => vec!["started", "signal", "finished", "chain_ended"],
        Resumed => vec!["resumed", "delta", "finished"],
    }
}

// ---- the Status table ----

/// Checks a field of a status reply (`running`: the one taken while the request ran).
type StatusRule = fn(&Walk, &Subject, bool, Option<&Value>) -> Result<(), String>;

fn status_rules() -> Vec<(&'static str, StatusRule)> {
    vec![
        ("request_id", |_, s, _, v| equal(string(v)?, s.id.as_str())),
        ("state", |_, s, running, v| {
            equal(string(v)?, if running { "RUNNING" } else { s.state() })
        }),
        ("worker_id", |w, _, _, v| {
            equal(string(v)?, w.worker_id.as_str())
        }),
        ("attempt", |_, s, _, v| equal(count(v)?, s.attempt())),
        // While it waits or runs only.
        ("priority", |_, _, running, v| match running {
            true => equal(string(v)?, "normal"),
            false => absent(v),
        }),
        ("tenant", |_, _, running, v| match running {
            true => equal(string(v)?, "default"),
            false => absent(v),
        }),
        ("decision_id", |_, s, running, v| match (s.kind, running) {
            (Continued | ChainEnded, false) => equal(Some(string(v)?), s.decision_id.as_deref()),
            _ => absent(v),
        }),
        ("decision_outcome", |_, s, running, v| {
            match (s.kind, running) {
                (Continued, false) => equal(string(v)?, "continued"),
                (ChainEnded, false) => equal(string(v)?, "skipped"),
                _ => absent(v),
            }
        }),
        ("continuation_request_id", |_, s, running, v| {
            match (s.kind, running) {
                (Continued, false) => equal(Some(string(v)?), s.continuation.as_deref()),
                _ => absent(v),
            }
        }),
        ("finished", |_, _, running, v| match running {
            true => absent(v),
            false => object(v).map(|_| ()),
        }),
    ]
}

/// The finished summary: the result's fields of the same name, and the openings.
fn summary_rules() -> Vec<(&'static str, Rule)> {
    fn same(s: &Subject, v: Option<&Value>, field: &str) -> Result<(), String> {
        equal(v, s.result.get(field))
    }
    vec![
        ("request_id", |_, s, v| same(s, v, "request_id")),
        ("root_request_id", |_, s, v| same(s, v, "root_request_id")),
        // Present when set.
        ("parent_request_id", |_, s, v| match &s.parent {
            Some(parent) => equal(string(v)?, parent.as_str()),
            None => absent(v),
        }),
        ("job_name", |_, s, v| same(s, v, "job_name")),
        ("chain_position", |_, s, v| same(s, v, "chain_position")),
        ("state", |_, s, v| same(s, v, "state")),
        ("reason", |_, s, v| same(s, v, "reason")),
        ("detail", |_, s, v| same(s, v, "detail")),
        ("worker_id", |_, s, v| same(s, v, "worker_id")),
        ("attempt", |_, s, v| same(s, v, "attempt")),
        ("usage", |_, s, v| same(s, v, "usage")),
        ("timings_ms", |_, s, v| same(s, v, "timings_ms")),
        ("tool_iterations_used", |_, s, v| {
            same(s, v, "tool_iterations_used")
        }),
        ("signals", |_, s, v| {
            let named: Vec<Value> = s.result["signals"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| {
                    json!(format!(
                        "{}.{}",
                        s["type"].as_str().unwrap_or_default(),
                        s["code"].as_str().unwrap_or_default()
                    ))
                })
                .collect();
            equal(array(v)?, &named)
        }),
        ("decision_id", |_, s, v| match s.kind {
            Continued | ChainEnded => equal(Some(string(v)?), s.decision_id.as_deref()),
            _ => absent(v),
        }),
        ("finished_at", |_, _, v| timestamp(v)),
        ("prompt_start", |_, s, v| {
            equal(string(v)?, s.prompt.as_str())
        }),
        ("output_start", |_, s, v| equal(string(v)?, s.output())),
        ("output_chars", |_, s, v| {
            equal(count(v)?, s.output().chars().count() as u64)
        }),
    ]
}

// ---- what the doc says ----

fn protocol_doc() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/protocol.md"))
        .expect("docs/protocol.md")
}

/// The text under `heading` (a whole line), up to the next heading of its level or above.
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let start = doc
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no {heading:?} in docs/protocol.md"))
        + heading.len()
        + 2;
    let level = heading.split(' ').next().unwrap();
    let rest = &doc[start..];
    let mut in_code = false;
    let mut at = 0;
    for line in rest.split_inclusive('\n') {
        if line.starts_with("```") {
            in_code = !in_code;
        }
        let hashes = line.split(' ').next().unwrap_or_default();
        if !in_code
            && hashes.chars().all(|c| c == '#')
            && !hashes.is_empty()
            && hashes.len() <= level.len()
        {
            return &rest[..at];
        }
        at += line.len();
    }
    rest
}

/// The contents of the code blocks fenced as `lang` in `text`.
fn code_blocks(text: &str, lang: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match &mut current {
            None if line == format!("```{lang}") => current = Some(String::new()),
            Some(_) if line == "```" => blocks.push(current.take().unwrap()),
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// JSON with the doc's elisions (`[...]`, `{...}`) read as empty.
fn relaxed_json(text: &str) -> Value {
    let text = text.replace("[...]", "[]").replace("{...}", "{}");
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("an example does not parse ({e}): {text}"))
}

/// `text` without what parentheses hold.
fn without_parens(text: &str) -> String {
    let mut depth = 0;
    text.chars()
        .filter(|&c| {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    return false;
                }
                _ => {}
            }
            depth == 0
        })
        .collect()
}

/// The words in backticks.
fn backticked(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect()
}

/// The cells of a Markdown table's rows (the heading row and rule left out), starting at the
/// line that is `heading`.
fn table(text: &str, heading: &str) -> Vec<Vec<String>> {
    text.lines()
        .skip_while(|line| *line != heading)
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            line.trim_matches('|')
                .split(" | ")
                .map(|cell| cell.trim().to_string())
                .collect()
        })
        .collect()
}

/// The keys of an example, and `key.sub` for an object (or the first object of an array) it
/// holds.
fn example_fields(example: &Value) -> BTreeSet<String> {
    let mut fields = BTreeSet::new();
    for (key, value) in example.as_object().expect("an example object") {
        fields.insert(key.clone());
        // The caller's own, free-form.
        if key == "metadata" {
            continue;
        }
        let inner = match value {
            Value::Array(items) => items.first(),
            other => Some(other),
        };
        if let Some(Value::Object(inner)) = inner {
            for (sub, value) in inner {
                fields.insert(format!("{key}.{sub}"));
                if let Some(Value::Object(deeper)) = value.as_array().and_then(|a| a.first()) {
                    for leaf in deeper.keys() {
                        fields.insert(format!("{key}.{sub}.{leaf}"));
                    }
                }
            }
        }
    }
    fields
}

/// What docs/protocol.md documents.
struct Documented {
    result: BTreeSet<String>,
    /// State, and the reasons of its row.
    reasons: BTreeMap<String, BTreeSet<String>>,
    /// Every event's fields.
    common: BTreeSet<String>,
    /// Each event's own fields.
    events: BTreeMap<String, BTreeSet<String>>,
    status: BTreeSet<String>,
    summary: BTreeSet<String>,
}

fn documented() -> Documented {
    let doc = protocol_doc();

    let result_section = section(&doc, "## Result");
    let example = code_blocks(result_section, "json");
    let mut result = example_fields(&relaxed_json(&example[0]));
    // The bullet that lists the optional fields, up to the next bullet.
    let optional: Vec<&str> = result_section
        .lines()
        .skip_while(|line| !line.contains("Optional fields are left out when empty"))
        .enumerate()
        .take_while(|(i, line)| *i == 0 || !line.starts_with("- "))
        .map(|(_, line)| line)
        .collect();
    assert!(!optional.is_empty(), "the Result's optional fields");
    result.extend(backticked(&without_parens(&optional.join(" "))));
    let reasons = table(result_section, "| state | reasons |")
        .into_iter()
        .map(|row| {
            (
                row[0].clone(),
                backticked(&without_parens(&row[1])).into_iter().collect(),
            )
        })
        .collect();

    let events_section = section(&doc, "## Events");
    let every = events_section
        .split("each is a JSON object with")
        .nth(1)
        .and_then(|rest| rest.split(":\n").next())
        .expect("the fields every event has");
    let common = backticked(&without_parens(every)).into_iter().collect();
    let events = table(events_section, "| event | fields |")
        .into_iter()
        .map(|row| {
            let name = backticked(&row[0]).remove(0);
            // The fields come before the first ": " (what follows says what they are).
            let fields = row[1].split(": ").next().unwrap();
            let fields = backticked(&without_parens(fields)).into_iter().collect();
            (name, fields)
        })
        .collect();

    let status_section = section(&doc, "### Status");
    let mut status = BTreeSet::new();
    for block in code_blocks(status_section, "sh") {
        let reply: String = block
            .lines()
            .filter_map(|line| line.strip_prefix('#'))
            .map(str::trim)
            .collect();
        if !reply.is_empty() {
            status.extend(relaxed_json(&reply).as_object().unwrap().keys().cloned());
        }
    }
    assert!(
        status_section.contains("shows `finished`"),
        "the Status section names `finished`"
    );
    status.insert("finished".to_string());
    let summary_example = code_blocks(status_section, "json");
    let mut summary: BTreeSet<String> = relaxed_json(&summary_example[0])
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let when_set = status_section
        .split("appear when set")
        .next()
        .and_then(|before| before.rsplit("\n\n").next())
        .expect("the summary's fields that appear when set");
    summary.extend(backticked(&without_parens(when_set)));

    Documented {
        result,
        reasons,
        common,
        events,
        status,
        summary,
    }
}

/// What differs between the doc's fields and this file's.
fn compare(
    what: &str,
    doc: &BTreeSet<String>,
    here: &BTreeSet<String>,
    failures: &mut Vec<String>,
) {
    let missing: Vec<_> = doc.difference(here).collect();
    let extra: Vec<_> = here.difference(doc).collect();
    if !missing.is_empty() || !extra.is_empty() {
        failures.push(format!(
            "{what}: documented but not walked here {missing:?}; walked here but not documented {extra:?}"
        ));
    }
}

// ---- the walk ----

/// The raw JSON reply of `subject`.
async fn raw(nats: &async_nats::Client, subject: String, body: &'static str) -> Value {
    let reply = nats
        .request(subject.clone(), body.into())
        .await
        .unwrap_or_else(|e| panic!("{subject}: {e}"));
    serde_json::from_slice(&reply.payload).unwrap_or_else(|e| panic!("{subject}: {e}"))
}

/// Every event published on the fleet, by request id, as the wire has them.
type Heard = Arc<Mutex<BTreeMap<String, Vec<Value>>>>;

async fn listen(nats: &async_nats::Client) -> Heard {
    let heard = Heard::default();
    let mut events = nats.subscribe("gen.events.>").await.unwrap();
    nats.flush().await.unwrap();
    let into = heard.clone();
    tokio::spawn(async move {
        while let Some(message) = events.next().await {
            let event: Value = serde_json::from_slice(&message.payload).unwrap();
            let id = event["request_id"].as_str().unwrap_or_default().to_string();
            into.lock().unwrap().entry(id).or_default().push(event);
        }
    });
    heard
}

/// The events of `id` once it emitted one named `last`.
async fn events_until(heard: &Heard, id: &str, last: &str) -> Vec<Value> {
    wait::until(&format!("{id}'s {last} event"), WITHIN, || async {
        let heard = heard.lock().unwrap();
        let events = heard.get(id).cloned().unwrap_or_default();
        if events.iter().any(|e| e["event"] == last) {
            Ok(events)
        } else {
            Err(format!(
                "{:?}",
                events
                    .iter()
                    .map(|e| e["event"].clone())
                    .collect::<Vec<_>>()
            ))
        }
    })
    .await
}

fn request(body: Value) -> GenerationRequest {
    serde_json::from_value(body).expect("a valid request")
}

fn answer(option: &str) -> DecisionAnswer {
    DecisionAnswer {
        option_id: option.into(),
        rationale: None,
        decided_by: Some("tbl-manager".into()),
        modified_prompt: None,
        guidance: None,
        confidence_boost: None,
    }
}

/// The decision a result asked for.
fn decision_of(result: &Value) -> String {
    result["signals"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|s| s["decision"]["decision_id"].as_str())
        .unwrap_or_else(|| panic!("no decision in {result}"))
        .to_string()
}

#[tokio::test]
async fn the_result_events_and_status_tables_hold_field_by_field() {
    let f = Fleet::builder()
        .script(SCRIPT)
        .calculator()
        .slots(2)
        .start()
        .await;
    let walk = Walk {
        worker_id: f.workers[0].worker_id.clone(),
    };
    let subjects = run_the_requests(&f).await;
    let failures = check(&walk, &subjects);
    assert!(
        failures.is_empty(),
        "{} fields do not hold as docs/protocol.md says:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Runs the requests of the walk, one after the other, and reads what the wire says of each.
async fn run_the_requests(f: &Fleet) -> Vec<Subject> {
    let client = &f.client;
    let nats = client.nats();
    let heard = listen(nats).await;
    let result_of = |id: String| raw(nats, format!("gen.result.{id}"), "{\"release\": false}");
    let status_of = |id: String| raw(nats, format!("gen.status.{id}"), "");
    let subject = |kind, id: &str, prompt: &str| Subject {
        kind,
        id: id.to_string(),
        prompt: prompt.to_string(),
        job_name: None,
        metadata: json!({}),
        root: id.to_string(),
        parent: None,
        decision_id: None,
        continuation: None,
        result: Value::Null,
        events: Vec::new(),
        status: Value::Null,
        running: None,
        first_seq: 0,
    };
    let mut subjects = Vec::new();

    // Completed: a tool call, reasoning, a signal, checks, a key, a job name and metadata.
    let mut done = subject(Completed, "tbl-completed", "tbl-completed: add 2 and 3");
    done.job_name = Some("tbl-job");
    done.metadata = json!({"table": "completed"});
    fleet::submit_when_tools_known(
        client,
        &request(json!({
            "request_id": "tbl-completed", "job_name": "tbl-job", "metadata": done.metadata,
            "affinity_key": "tbl-key", "tools": ["calculate"],
            "messages": [{"role": "user", "content": done.prompt}],
            "validation": [{"kind": "contains", "text": "sum"}],
        })),
    )
    .await;
    done.events = events_until(&heard, &done.id, "finished").await;
    subjects.push(done);

    // Failed, as tenant acme: the stream breaks after two words.
    let acme = client.clone().with_tenant("acme").unwrap();
    let mut failed = subject(Failed, "acme.tbl-failed", "tbl-failed");
    failed.root = failed.id.clone();
    acme.submit("default", &fleet::request("tbl-failed", "tbl-failed"))
        .await
        .unwrap();
    failed.events = events_until(&heard, &failed.id, "finished").await;
    subjects.push(failed);

    // Cancelled while it streams; its status read while it runs.
    let mut cancelled = subject(Cancelled, "tbl-cancelled", "tbl-cancelled");
    client
        .submit("default", &fleet::request("tbl-cancelled", "tbl-cancelled"))
        .await
        .unwrap();
    events_until(&heard, &cancelled.id, "delta").await;
    cancelled.running = Some(status_of(cancelled.id.clone()).await);
    let reply = client.cancel("tbl-cancelled").await.unwrap();
    assert_eq!(reply.state, genfleet::protocol::RequestState::Cancelled);
    cancelled.events = events_until(&heard, &cancelled.id, "finished").await;
    subjects.push(cancelled);

    // Continued: the model asks a decision, answered with an option that continues.
    let mut asker = subject(Continued, "tbl-continued", "tbl-continued");
    asker.job_name = Some("tbl-chain");
    client
        .submit(
            "default",
            &request(json!({
                "request_id": "tbl-continued", "job_name": "tbl-chain",
                "messages": [{"role": "user", "content": "tbl-continued"}],
            })),
        )
        .await
        .unwrap();
    events_until(&heard, &asker.id, "finished").await;
    let decision = decision_of(&result_of(asker.id.clone()).await);
    let reply = client.decide(&decision, &answer("left")).await.unwrap();
    let next = reply.continuation_request_id.expect("a continuation");
    asker.decision_id = Some(decision);
    asker.continuation = Some(next.clone());
    asker.events = events_until(&heard, &asker.id, "continued").await;
    let mut continuation = subject(Continuation, &next, "tbl-continued");
    continuation.job_name = Some("tbl-chain");
    continuation.root = asker.id.clone();
    continuation.parent = Some(asker.id.clone());
    continuation.events = events_until(&heard, &next, "finished").await;
    subjects.push(asker);
    subjects.push(continuation);

    // A checkpoint answered skip: the chain ends there.
    let mut ended = subject(ChainEnded, "tbl-ended", "tbl-ended: deploy");
    client
        .submit(
            "default",
            &request(json!({
                "request_id": "tbl-ended",
                "messages": [{"role": "user", "content": ended.prompt}],
                "checkpoints": [{"name": "gate", "prompt_contains": ["deploy"]}],
            })),
        )
        .await
        .unwrap();
    events_until(&heard, &ended.id, "finished").await;
    let decision = decision_of(&result_of(ended.id.clone()).await);
    client.decide(&decision, &answer("skip")).await.unwrap();
    ended.decision_id = Some(decision);
    ended.events = events_until(&heard, &ended.id, "chain_ended").await;
    subjects.push(ended);

    // Resumed: its record names a worker with no heartbeat and holds a checkpoint cut mid-turn
    // (as a worker killed while the answer streamed leaves it); the status asked of it finds
    // the worker gone, and a live worker goes on from the checkpoint.
    let mut resumed = subject(Resumed, "tbl-resumed", "tbl-resumed");
    resumed.first_seq = 2;
    let js = async_nats::jetstream::new(nats.clone());
    let results = js.get_key_value("GENFLEET_RESULTS").await.unwrap();
    let record = json!({"live": {
        "request_id": "tbl-resumed", "state": "RUNNING", "worker_id": GONE_WORKER,
        "attempt": 1, "durable": false,
        "progress": {
            "request": {"request_id": "tbl-resumed",
                        "messages": [{"role": "user", "content": "tbl-resumed"}]},
            "conversation": [], "partial": RESUMED_PREFIX, "partial_visible": RESUMED_PREFIX,
            "output": RESUMED_PREFIX, "usage": {"prompt_tokens": 5, "completion_tokens": 3},
            "tool_iterations_used": 0, "tool_iterations_left": 4, "next_seq": 2,
            "elapsed_ms": 40, "first_token_ms": 10, "root_request_id": "tbl-resumed",
            "chain_position": 1
        }
    }});
    results
        .put(
            "res.tbl-resumed",
            serde_json::to_vec(&record).unwrap().into(),
        )
        .await
        .unwrap();
    status_of(resumed.id.clone()).await;
    resumed.events = events_until(&heard, &resumed.id, "finished").await;
    subjects.push(resumed);

    for s in &mut subjects {
        s.result = result_of(s.id.clone()).await;
        s.status = status_of(s.id.clone()).await;
    }
    subjects
}

/// Every way the fleet's answers differ from what docs/protocol.md says.
fn check(walk: &Walk, subjects: &[Subject]) -> Vec<String> {
    // The doc's fields, and this file's.
    let doc = documented();
    let mut failures = Vec::new();
    let results = result_rules();
    let events = event_rules();
    let statuses = status_rules();
    let summaries = summary_rules();
    let names =
        |rules: Vec<&'static str>| rules.into_iter().map(String::from).collect::<BTreeSet<_>>();
    compare(
        "Result",
        &doc.result,
        &names(results.iter().map(|r| r.0).collect()),
        &mut failures,
    );
    compare(
        "Events (every event)",
        &doc.common,
        &names(events.iter().filter(|r| r.0 == "*").map(|r| r.1).collect()),
        &mut failures,
    );
    compare(
        "Events",
        &doc.events.keys().cloned().collect(),
        &names(events.iter().filter(|r| r.0 != "*").map(|r| r.0).collect()),
        &mut failures,
    );
    for (event, fields) in &doc.events {
        compare(
            &format!("the {event} event"),
            fields,
            &names(
                events
                    .iter()
                    .filter(|r| r.0 == event)
                    .map(|r| r.1)
                    .collect(),
            ),
            &mut failures,
        );
    }
    compare(
        "Status",
        &doc.status,
        &names(statuses.iter().map(|r| r.0).collect()),
        &mut failures,
    );
    compare(
        "the finished summary",
        &doc.summary,
        &names(summaries.iter().map(|r| r.0).collect()),
        &mut failures,
    );

    let mut seen_events = BTreeSet::new();
    for s in subjects {
        let who = format!("{:?} {}", s.kind, s.id);
        // The Result: every documented field, and no other.
        for (field, rule) in &results {
            if let Err(why) = rule(walk, s, lookup(&s.result, field)) {
                failures.push(format!("{who}: result.{field}: {why}"));
            }
        }
        match doc.reasons.get(s.state()) {
            Some(reasons) if reasons.contains(s.reason()) => {}
            _ => failures.push(format!(
                "{who}: {} {} is not a row of the doc's table of states and reasons",
                s.state(),
                s.reason()
            )),
        }
        for key in s.result.as_object().into_iter().flatten().map(|(k, _)| k) {
            if !doc.result.contains(key) {
                failures.push(format!("{who}: result.{key} is not documented"));
            }
        }
        // The Events: in the order the request went, each with its documented fields only.
        let names = s.names();
        let mut order = names.clone();
        order.dedup();
        let mut expected = expected_events(s.kind);
        expected.dedup();
        if order != expected {
            failures.push(format!("{who}: events {names:?}, expected {expected:?}"));
        }
        for event in &s.events {
            let name = event["event"].as_str().unwrap_or_default();
            seen_events.insert(name.to_string());
            for (of, field, rule) in &events {
                if (*of == "*" || *of == name)
                    && let Err(why) = rule(walk, s, event, event.get(*field))
                {
                    failures.push(format!("{who}: {name} event: {field}: {why}"));
                }
            }
            let allowed = doc.events.get(name);
            for key in event.as_object().into_iter().flatten().map(|(k, _)| k) {
                if !doc.common.contains(key) && !allowed.is_some_and(|a| a.contains(key)) {
                    failures.push(format!("{who}: {name} event: {key} is not documented"));
                }
            }
        }
        // The Status: ended, and (the cancelled request) while it ran.
        let replies = [(false, Some(&s.status)), (true, s.running.as_ref())];
        for (running, reply) in replies {
            let Some(reply) = reply else { continue };
            let when = if running { "while running" } else { "ended" };
            for (field, rule) in &statuses {
                if let Err(why) = rule(walk, s, running, reply.get(*field)) {
                    failures.push(format!("{who}: status ({when}).{field}: {why}"));
                }
            }
            for key in reply.as_object().into_iter().flatten().map(|(k, _)| k) {
                if !doc.status.contains(key) {
                    failures.push(format!("{who}: status ({when}).{key} is not documented"));
                }
            }
        }
        if let Some(summary) = s.status.get("finished") {
            for (field, rule) in &summaries {
                if let Err(why) = rule(walk, s, summary.get(*field)) {
                    failures.push(format!("{who}: status.finished.{field}: {why}"));
                }
            }
            for key in summary.as_object().into_iter().flatten().map(|(k, _)| k) {
                if !doc.summary.contains(key) {
                    failures.push(format!("{who}: status.finished.{key} is not documented"));
                }
            }
        }
    }
    // Every documented event came.
    let unseen: Vec<_> = doc
        .events
        .keys()
        .filter(|e| !seen_events.contains(*e))
        .collect();
    if !unseen.is_empty() {
        failures.push(format!("no request emitted the events {unseen:?}"));
    }
    failures
}
