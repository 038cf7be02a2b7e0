//! A request's timeline and how it stands: what its record in the results bucket, its wire
//! events, the signals and the decisions of its chain each add.

use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::Value;

use super::{RequestEntry, Requests, TimelineEntry};
use crate::protocol::decision::DecisionRecord;
use crate::protocol::ids::rfc3339;
use crate::protocol::text::clip_chars_counted;
use crate::protocol::{
    Event, EventBody, FinishedSummary, GenerationResult, RequestState, Role, Signal,
};

/// Characters of a tool call's arguments, a tool's result or a detail kept in a timeline.
const TEXT_CHARS: usize = 160;

fn parse_time(ts: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(ts.trim_end_matches('Z'))
        .ok()
        .or_else(|| humantime::parse_rfc3339(ts).ok())
}

fn clip(text: &str) -> String {
    clip_chars_counted(text, TEXT_CHARS)
}

fn json_text(value: &Value) -> String {
    match value {
        Value::String(s) => clip(s),
        other => clip(&other.to_string()),
    }
}

impl Requests {
    /// A wire event of any request.
    pub fn apply_event(&mut self, event: &Event) {
        // Most events are output in the middle of a turn: they change nothing shown.
        if matches!(
            event.body,
            EventBody::Delta { .. } | EventBody::Reasoning { .. }
        ) && self
            .entries
            .get(&event.request_id)
            .is_some_and(|e| e.in_turn)
        {
            return;
        }
        let pool = match &event.body {
            EventBody::Started { worker_id, .. } => self.pools.get(worker_id).cloned(),
            _ => None,
        };
        let entry = self.entry(&event.request_id);
        let ts = event.ts.as_str();
        // Output, tools and signals come from a running request.
        if entry.state.is_none()
            && matches!(
                event.body,
                EventBody::Delta { .. }
                    | EventBody::Reasoning { .. }
                    | EventBody::ToolCall { .. }
                    | EventBody::ToolResult { .. }
                    | EventBody::Signal { .. }
            )
        {
            entry.state = Some(RequestState::Running);
        }
        match &event.body {
            EventBody::Started {
                worker_id,
                attempt,
                chain_position,
            } => {
                if !entry.terminal() {
                    entry.state = Some(RequestState::Running);
                }
                entry.set_place(worker_id, pool);
                entry.attempt = *attempt;
                entry.chain_position = *chain_position;
                entry.started_at = Some(event.ts.clone());
                entry.in_turn = false;
                entry.seen_start = true;
                entry.push(
                    TimelineEntry::new(
                        ts,
                        "started",
                        format!("on {worker_id} (attempt {attempt})"),
                    )
                    .keyed(format!("started-{attempt}")),
                );
            }
            EventBody::Resumed {
                worker_id,
                attempt,
                from_worker,
                reason,
                turn_restarted,
            } => {
                if !entry.terminal() {
                    entry.state = Some(RequestState::Running);
                }
                entry.set_place(worker_id, pool);
                entry.attempt = *attempt;
                let how = if *turn_restarted {
                    ", its turn taken again"
                } else {
                    ""
                };
                entry.push(
                    TimelineEntry::new(
                        ts,
                        "resumed",
                        format!(
                            "on {worker_id} (attempt {attempt}), from {from_worker} ({}){how}",
                            serde_json::to_value(reason)
                                .ok()
                                .and_then(|v| v.as_str().map(str::to_string))
                                .unwrap_or_default()
                        ),
                    )
                    .keyed(format!("resumed-{attempt}")),
                );
            }
            EventBody::Delta { .. } | EventBody::Reasoning { .. } => {
                if !entry.in_turn {
                    entry.in_turn = true;
                    entry.turns += 1;
                    let turn = entry.turns;
                    entry.push(TimelineEntry::new(
                        ts,
                        "turn",
                        format!("turn {turn}: the model streams its answer"),
                    ));
                }
            }
            EventBody::ToolCall {
                call_id,
                name,
                arguments,
            } => {
                entry.in_turn = false;
                entry.tool_calls += 1;
                entry.push(
                    TimelineEntry::new(ts, "tool_call", format!("{name} {}", json_text(arguments)))
                        .keyed(format!("call-{call_id}")),
                );
            }
            EventBody::ToolResult {
                call_id,
                name,
                ok,
                result,
            } => {
                entry.in_turn = false;
                let what = if *ok { "from" } else { "error from" };
                entry.push(
                    TimelineEntry::new(
                        ts,
                        "tool_result",
                        format!("{what} {name} → {}", json_text(result)),
                    )
                    .keyed(format!("result-{call_id}")),
                );
            }
            EventBody::Signal { signal } => {
                entry.in_turn = false;
                signal_entries(entry, signal);
            }
            EventBody::Finished { result } => {
                let result = result.clone();
                let finished_at = Some(event.ts.clone());
                self.apply_result(&result, finished_at);
            }
            EventBody::Continued {
                continuation_request_id,
            } => {
                entry.continuation_request_id = Some(continuation_request_id.clone());
                let mut line =
                    TimelineEntry::new(ts, "continued", format!("as {continuation_request_id}"))
                        .keyed(format!("continued-{continuation_request_id}"));
                line.request_id = Some(continuation_request_id.clone());
                entry.push(line);
                let parent = event.request_id.clone();
                let next = self.entry(continuation_request_id);
                next.parent_request_id.get_or_insert(parent);
            }
            EventBody::ChainEnded {
                decision_id,
                outcome,
                option_id,
                decided_by,
            } => {
                let mut text = outcome.as_str().to_string();
                if let Some(option) = option_id {
                    text.push_str(&format!(" ({option})"));
                }
                if let Some(by) = decided_by {
                    text.push_str(&format!(" by {by}"));
                }
                let mut line = TimelineEntry::new(ts, "chain_ended", text)
                    .keyed(format!("ended-{decision_id}"));
                line.decision_id = Some(decision_id.clone());
                entry.push(line);
            }
        }
    }

    /// A request's record in the results bucket, written at `written` (the server's time).
    pub fn apply_live(
        &mut self,
        request_id: &str,
        state: RequestState,
        worker_id: &str,
        attempt: u32,
        written: SystemTime,
    ) {
        let pool = self.pools.get(worker_id).cloned();
        let entry = self.entry(request_id);
        if entry.terminal() {
            return;
        }
        entry.state = Some(state);
        entry.set_place(worker_id, pool);
        entry.attempt = attempt;
        let ts = rfc3339(written);
        if entry.accepted_at.is_none() {
            entry.accepted_at = Some(ts.clone());
        }
        if state == RequestState::Queued {
            entry.push(
                TimelineEntry::new(
                    &ts,
                    "queued",
                    format!("on {worker_id}, waiting for a free slot"),
                )
                .keyed(format!("queued-{attempt}")),
            );
        } else {
            entry.push(
                TimelineEntry::new(&ts, "queued", format!("accepted by {worker_id}"))
                    .keyed("accepted".into()),
            );
        }
    }

    /// A terminal result (from its record or its `finished` event).
    pub fn apply_result(&mut self, result: &GenerationResult, finished_at: Option<String>) {
        let pool = self.pools.get(&result.worker_id).cloned();
        let finished_at = {
            let known = self
                .entries
                .get(&result.request_id)
                .and_then(|e| e.finished_at.clone());
            known.or(finished_at)
        };
        let first = self
            .entries
            .get(&result.request_id)
            .is_none_or(|e| !e.terminal());
        let entry = self.entry(&result.request_id);
        entry.state = Some(result.state);
        entry.reason = Some(result.reason.as_str().to_string());
        entry.detail = result.detail.as_deref().map(clip);
        entry.set_place(&result.worker_id, pool);
        entry.attempt = result.attempt;
        entry.chain_position = result.chain_position;
        entry.parent_request_id = result.parent_request_id.clone();
        if result.job_name.is_some() {
            entry.job_name = result.job_name.clone();
        }
        // The tenant it ran as (its subject's token), as its id says too.
        if let Some(tenant) = &result.tenant {
            entry.tenant = tenant.clone();
        }
        entry.latency_ms = Some(result.timings_ms.total);
        entry.finished_at = finished_at.clone();
        let end = finished_at.as_deref().and_then(parse_time);
        if let Some(end) = end {
            let accepted = end - Duration::from_millis(result.timings_ms.total);
            let started = accepted + Duration::from_millis(result.timings_ms.queued);
            entry.accepted_at.get_or_insert_with(|| rfc3339(accepted));
            entry.started_at.get_or_insert_with(|| rfc3339(started));
        }
        // Seen only now (the console started later, or missed its events): the timeline
        // comes from the result.
        if !entry.has("started")
            && let Some(started) = entry.started_at.clone()
        {
            if let Some(accepted) = entry.accepted_at.clone() {
                entry.push(
                    TimelineEntry::new(&accepted, "queued", "accepted").keyed("accepted".into()),
                );
            }
            entry.push(
                TimelineEntry::new(
                    &started,
                    "started",
                    format!("on {} (attempt {})", result.worker_id, result.attempt),
                )
                .keyed(format!("started-{}", result.attempt)),
            );
            from_transcript(entry, result, &started);
            entry.whole = true;
        }
        for signal in &result.signals {
            signal_entries(entry, signal);
        }
        let ts = finished_at.unwrap_or_else(|| entry.started_at.clone().unwrap_or_default());
        let mut text = format!("{} {}", result.state.as_str(), result.reason.as_str());
        if let Some(detail) = &result.detail {
            text.push_str(&format!(": {}", clip(detail)));
        }
        text.push_str(&format!(" after {} ms", result.timings_ms.total));
        entry.push(TimelineEntry::new(&ts, "finished", text).keyed("finished".into()));
        if first && let Some(pool) = entry.pool.clone() {
            let failed = result.state != RequestState::Completed;
            let when = entry
                .finished_at
                .as_deref()
                .and_then(parse_time)
                .unwrap_or_else(SystemTime::now);
            self.count(&pool, when, result.timings_ms.total, failed);
        }
    }

    /// The tombstone left once the caller read the result.
    pub fn apply_released(
        &mut self,
        request_id: &str,
        state: RequestState,
        summary: Option<&FinishedSummary>,
        written: SystemTime,
    ) {
        let pool = summary.and_then(|s| self.pools.get(&s.worker_id).cloned());
        let known = self.entries.contains_key(request_id);
        let entry = self.entry(request_id);
        entry.state = Some(state);
        entry.released = true;
        if let Some(s) = summary {
            entry.reason = Some(s.reason.as_str().to_string());
            entry.detail = s.detail.as_deref().map(clip);
            entry.set_place(&s.worker_id, pool);
            entry.attempt = s.attempt;
            entry.chain_position = s.chain_position;
            entry.parent_request_id = s.parent_request_id.clone();
            if s.job_name.is_some() {
                entry.job_name = s.job_name.clone();
            }
            entry.latency_ms = Some(s.timings_ms.total);
            if entry.finished_at.is_none() {
                entry.finished_at = s.finished_at.clone();
            }
            if !known && let Some(done) = s.finished_at.as_deref() {
                let mut text = format!("{} {}", s.state.as_str(), s.reason.as_str());
                if let Some(detail) = &s.detail {
                    text.push_str(&format!(": {}", clip(detail)));
                }
                entry.push(TimelineEntry::new(done, "finished", text).keyed("finished".into()));
            }
        }
        entry.push(
            TimelineEntry::new(&rfc3339(written), "released", "its caller read the result")
                .keyed("released".into()),
        );
    }

    /// A signal from the signals stream.
    pub fn apply_signal(&mut self, signal: &Signal) {
        self.learn_worker(&signal.worker_id, &signal.pool);
        if signal.request_id.is_empty() {
            return;
        }
        let entry = self.entry(&signal.request_id);
        entry.pool.get_or_insert_with(|| signal.pool.clone());
        if entry.job_name.is_none() {
            entry.job_name = signal.job_name.clone();
        }
        signal_entries(entry, signal);
    }

    /// A decision record from the decisions bucket: the asking request's pool, job and tenant,
    /// the decision asked, and its answer.
    pub fn apply_decision(&mut self, record: &DecisionRecord) {
        let entry = self.entry(&record.request_id);
        entry.pool = Some(record.pool.clone());
        entry.chain_position = record.chain_position;
        if entry.job_name.is_none() {
            entry.job_name = record.request.job_name.clone();
        }
        if let Some(tenant) = &record.tenant {
            entry.tenant = tenant.clone();
        }
        entry.decision_id = Some(record.decision_id.clone());
        let mut asked = TimelineEntry::new(
            &record.signal.ts,
            "decision",
            format!(
                "asked ({}): {}",
                kind_name(&record.decision.kind),
                clip(&record.decision.question)
            ),
        )
        .keyed(format!("decision-{}", record.decision_id));
        asked.decision_id = Some(record.decision_id.clone());
        entry.push(asked);
        if let Some(answer) = &record.answer {
            let mut text = format!(
                "by {}: {} ({})",
                answer.choice.decided_by.as_deref().unwrap_or("someone"),
                answer.choice.option_id,
                answer.outcome.as_str()
            );
            if let Some(rationale) = &answer.choice.rationale {
                text.push_str(&format!(", because {}", clip(rationale)));
            }
            let mut line = TimelineEntry::new(&answer.decided_at, "answered", text)
                .keyed(format!("answered-{}", record.decision_id));
            line.decision_id = Some(record.decision_id.clone());
            line.request_id = answer.continuation_request_id.clone();
            entry.push(line);
            if let Some(next) = &answer.continuation_request_id {
                entry.continuation_request_id = Some(next.clone());
                let (pool, job, parent) = (
                    record.pool.clone(),
                    record.request.job_name.clone(),
                    record.request_id.clone(),
                );
                let next = self.entry(next);
                next.pool.get_or_insert(pool);
                if next.job_name.is_none() {
                    next.job_name = job;
                }
                next.parent_request_id.get_or_insert(parent);
                next.chain_position = next.chain_position.max(record.chain_position + 1);
            }
        } else if let Some(expired) = &record.expired_at {
            let mut line = TimelineEntry::new(expired, "answered", "expired unanswered")
                .keyed(format!("answered-{}", record.decision_id));
            line.decision_id = Some(record.decision_id.clone());
            entry.push(line);
        }
    }

    /// A cancel asked from the console at `asked_at`, and what the fleet answered.
    pub fn note_cancel(&mut self, request_id: &str, asked_at: &str, by: &str, outcome: &str) {
        if let Some(entry) = self.entries.get_mut(request_id) {
            self.dirty = true;
            entry.push(TimelineEntry::new(
                asked_at,
                "cancel",
                format!("asked by {by}: {outcome}"),
            ));
        }
    }
}

fn kind_name<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// A signal's timeline entries: the signal, and the decision it asks when it carries one.
fn signal_entries(entry: &mut RequestEntry, signal: &Signal) {
    let mut line = TimelineEntry::new(
        &signal.ts,
        "signal",
        format!(
            "{}.{} ({}): {}",
            signal.kind.as_str(),
            signal.code,
            kind_name(&signal.severity),
            clip(&signal.summary)
        ),
    )
    .keyed(format!("signal-{}", signal.signal_id));
    if let Some(decision) = &signal.decision {
        line.decision_id = Some(decision.decision_id.clone());
        entry.decision_id = Some(decision.decision_id.clone());
    }
    entry.push(line);
}

/// The turns and tool calls of a request the console saw only finished, from its transcript
/// (they carry no time of their own: they are placed at its start).
fn from_transcript(entry: &mut RequestEntry, result: &GenerationResult, started: &str) {
    let mut turns = 0;
    let mut calls = 0;
    for message in &result.messages {
        match message.role {
            Role::Assistant => {
                turns += 1;
                entry.push(TimelineEntry::new(
                    started,
                    "turn",
                    format!("turn {turns} (from the transcript)"),
                ));
                for call in &message.tool_calls {
                    calls += 1;
                    entry.push(
                        TimelineEntry::new(
                            started,
                            "tool_call",
                            format!("{} {}", call.function.name, clip(&call.function.arguments)),
                        )
                        .keyed(format!("call-{}", call.id)),
                    );
                }
            }
            Role::Tool => {
                let text = message.text();
                entry.push(
                    TimelineEntry::new(started, "tool_result", format!("→ {}", clip(&text))).keyed(
                        format!(
                            "result-{}",
                            message.tool_call_id.clone().unwrap_or_default()
                        ),
                    ),
                );
            }
            _ => {}
        }
    }
    entry.turns = entry.turns.max(turns);
    entry.tool_calls = entry.tool_calls.max(calls);
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::fixtures::{event, kinds, result};
    use super::super::{RequestFilter, SERIES_BUCKETS};
    use super::*;

    #[test]
    fn a_request_seen_from_its_middle_has_a_partial_timeline() {
        let mut requests = Requests::new(10);
        let now = SystemTime::now();
        // Seen from its start: whole.
        requests.apply_live("a", RequestState::Running, "w1", 1, now);
        requests.apply_event(&event(
            "a",
            0,
            1,
            json!({"event": "started", "worker_id": "w1", "attempt": 1, "chain_position": 1}),
        ));
        // Running when the console started: its record, then an event from its middle.
        requests.apply_live("b", RequestState::Running, "w1", 1, now);
        requests.apply_event(&event(
            "b",
            7,
            2,
            json!({"event": "delta", "text": "and so"}),
        ));
        // Waiting for a slot: it has missed nothing yet.
        requests.apply_live("c", RequestState::Queued, "w1", 1, now);
        // Read by its caller before the console started: only its tombstone.
        let summary: FinishedSummary = serde_json::from_value(json!({
            "request_id": "d", "root_request_id": "d", "state": "COMPLETED", "reason": "stop",
            "worker_id": "w1", "attempt": 1, "chain_position": 1, "tool_iterations_used": 1,
            "output_chars": 4, "output_start": "done", "prompt_start": "Compute.", "signals": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            "timings_ms": {"queued": 5, "total": 1500},
            "finished_at": "2026-01-01T00:00:09.000Z"
        }))
        .unwrap();
        requests.apply_released("d", RequestState::Completed, Some(&summary), now);
        // Finished before the console started, its result still stored: its transcript tells
        // every turn and tool call.
        requests.apply_result(&result("e", "COMPLETED", "stop", None), Some(rfc3339(now)));
        let partial = |requests: &Requests, id: &str| {
            let entry = requests.get(id).unwrap().entry;
            (entry.partial, entry.turns, entry.tool_calls)
        };
        assert_eq!(partial(&requests, "a"), (false, 0, 0));
        assert_eq!(partial(&requests, "b"), (true, 1, 0));
        assert_eq!(partial(&requests, "c"), (false, 0, 0));
        assert_eq!(partial(&requests, "d"), (true, 0, 0));
        assert_eq!(partial(&requests, "e"), (false, 2, 1));
        let listed: Vec<(String, bool)> = requests
            .list(&RequestFilter::default())
            .requests
            .into_iter()
            .map(|r| (r.request_id, r.partial))
            .collect();
        assert!(listed.contains(&("d".into(), true)), "{listed:?}");
        // The rest of b comes with its result: its transcript has it all.
        requests.apply_event(&event(
            "b",
            8,
            3,
            json!({"event": "finished", "result": serde_json::to_value(result("b", "COMPLETED", "stop", None)).unwrap()}),
        ));
        assert_eq!(partial(&requests, "b"), (false, 2, 1));
    }

    #[test]
    fn events_make_a_timeline_of_turns_tool_calls_signals_and_the_end() {
        let mut requests = Requests::new(10);
        requests.learn_worker("w1", "gpu");
        let id = "acme.r1";
        let finished = serde_json::to_value(result(id, "COMPLETED", "stop", Some("acme"))).unwrap();
        let signal = json!({"signal_id": "s1", "type": "issue", "code": "MAX_TOKENS_REACHED",
            "source": "worker", "severity": "low", "summary": "cut", "meta": {}, "request_id": id,
            "root_request_id": id, "worker_id": "w1", "pool": "gpu", "ts": "2026-01-01T00:00:07.000Z"});
        for (seq, body) in [
            json!({"event": "started", "worker_id": "w1", "attempt": 1, "chain_position": 1}),
            json!({"event": "delta", "text": "Let me"}),
            json!({"event": "delta", "text": " compute"}),
            json!({"event": "tool_call", "call_id": "c1", "name": "calculate", "arguments": {"a": 1}}),
            json!({"event": "tool_result", "call_id": "c1", "name": "calculate", "ok": true, "result": {"value": 2}}),
            json!({"event": "delta", "text": "done"}),
            json!({"event": "signal", "signal": signal.clone()}),
            json!({"event": "finished", "result": finished}),
        ]
        .into_iter()
        .enumerate()
        {
            requests.apply_event(&event(id, seq as u64, seq as u32 + 1, body));
        }
        // The same signal from the signals stream is not shown twice.
        requests.apply_signal(&serde_json::from_value(signal).unwrap());
        assert_eq!(
            kinds(&requests, id),
            [
                "started",
                "turn",
                "tool_call",
                "tool_result",
                "turn",
                "signal",
                "finished"
            ]
        );
        let detail = requests.get(id).unwrap();
        let entry = &detail.entry;
        assert_eq!(
            (
                entry.state,
                entry.pool.as_deref(),
                entry.tenant.as_str(),
                entry.job_name.as_deref()
            ),
            (
                Some(RequestState::Completed),
                Some("gpu"),
                "acme",
                Some("triage")
            )
        );
        assert_eq!(
            (entry.turns, entry.tool_calls, entry.latency_ms),
            (2, 1, Some(1500))
        );
        assert!(detail.timeline[2].text.contains("calculate"));
        assert!(
            detail.timeline[6]
                .text
                .contains("COMPLETED stop after 1500 ms")
        );
        // A finished request counts once in its pool's series, however it is seen again.
        requests.apply_result(&result(id, "COMPLETED", "stop", Some("acme")), None);
        let series = requests.series(SystemTime::now(), &["gpu".into()]);
        let gpu = series.pools.iter().find(|p| p.pool == "gpu").unwrap();
        assert_eq!(gpu.points.len(), SERIES_BUCKETS);
        let finished: u32 = gpu.points.iter().map(|p| p.finished).sum();
        assert_eq!(finished, 0, "finished in 2026-01-01, outside the window");
    }

    #[test]
    fn a_request_seen_only_finished_gets_its_timeline_from_the_result() {
        let mut requests = Requests::new(10);
        requests.learn_worker("w1", "default");
        let now = SystemTime::now();
        requests.apply_result(
            &result("r2", "FAILED", "backend_error", None),
            Some(rfc3339(now)),
        );
        assert_eq!(
            kinds(&requests, "r2"),
            [
                "queued",
                "started",
                "turn",
                "tool_call",
                "tool_result",
                "turn",
                "finished"
            ]
        );
        let entry = requests.get("r2").unwrap().entry;
        assert_eq!((entry.turns, entry.tool_calls), (2, 1));
        assert!(entry.accepted_at.unwrap() < entry.started_at.unwrap());
        let series = requests.series(now, &["default".into(), "idle".into()]);
        let names: Vec<&str> = series.pools.iter().map(|p| p.pool.as_str()).collect();
        assert_eq!(names, ["default", "idle"]);
        let last = series.pools[0].points.last().unwrap();
        assert_eq!(
            (last.finished, last.failed, last.mean_latency_ms),
            (1, 1, Some(1500))
        );
        // The caller reads it: the tombstone says so.
        requests.apply_released("r2", RequestState::Failed, None, now);
        assert!(requests.get("r2").unwrap().entry.released);
    }

    #[test]
    fn a_decision_and_its_answer_link_the_continuation() {
        let mut requests = Requests::new(10);
        let mut request = crate::protocol::GenerationRequest::user("Plan it.");
        request.job_name = Some("plans".into());
        // A caller's word: not the tenant.
        request.metadata.insert("tenant".into(), json!("mallory"));
        let record: DecisionRecord = serde_json::from_value(json!({
            "decision_id": "d1", "request_id": "acme.r1", "root_request_id": "acme.r1", "chain_position": 1,
            "pool": "default",
            "decision": {"decision_id": "d1", "question": "Which path?", "options": [{"id": "fast", "label": "Fast"}], "kind": "model"},
            "signal": {"signal_id": "s1", "type": "decision_request", "code": "NEEDS_MANAGER_DECISION",
                "source": "model", "severity": "med", "summary": "Which path?", "meta": {}, "request_id": "acme.r1",
                "root_request_id": "acme.r1", "worker_id": "w1", "pool": "default", "ts": "2026-01-01T00:00:01.000Z"},
            "request": request, "continued_seq": 3, "tenant": "acme",
            "answer": {"option_id": "fast", "decided_by": "human:ann", "outcome": "continued",
                "continuation_request_id": "acme.r2", "decided_at": "2026-01-01T00:00:09.000Z"}
        }))
        .unwrap();
        requests.apply_decision(&record);
        requests.apply_decision(&record);
        assert_eq!(kinds(&requests, "acme.r1"), ["decision", "answered"]);
        // Named only by a decision: kept for its timeline, listed once its record comes.
        assert_eq!(requests.list(&RequestFilter::default()).matched, 0);
        assert_eq!(requests.get("acme.r1").unwrap().entry.state, None);
        requests.apply_live("acme.r1", RequestState::Running, "w1", 1, SystemTime::now());
        let page = requests.list(&RequestFilter::default());
        assert_eq!((page.matched, page.kept), (1, 1));
        assert_eq!(page.requests[0].request_id, "acme.r1");
        let asking = requests.get("acme.r1").unwrap();
        assert_eq!(
            asking.entry.continuation_request_id.as_deref(),
            Some("acme.r2")
        );
        assert_eq!(asking.timeline[1].request_id.as_deref(), Some("acme.r2"));
        assert!(
            asking.timeline[1]
                .text
                .contains("human:ann: fast (continued)")
        );
        let next = requests.get("acme.r2").unwrap().entry;
        assert_eq!(
            (
                next.parent_request_id.as_deref(),
                next.pool.as_deref(),
                next.tenant.as_str(),
                next.chain_position
            ),
            (Some("acme.r1"), Some("default"), "acme", 2)
        );
    }
}
