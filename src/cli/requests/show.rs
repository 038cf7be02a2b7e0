//! What `status`, `result` and `decide` print for people (`--json` prints the wire's records).

use std::fmt::Write;

use crate::protocol::StatusReply;
use crate::protocol::decision::DecisionReply;
use crate::protocol::{DecisionOutcome, GenerationResult, Reason, RequestState, Timings, Usage};

/// `genfleet status`: the state, and for a finished request how it ended, from its summary.
pub fn status(status: &StatusReply) -> String {
    let mut out = String::new();
    let request_id = status.request_id.as_str();
    let state = status.state;
    let finished = status.finished.as_ref();
    match finished {
        Some(f) => {
            let _ = writeln!(out, "{request_id} {} {}", state.as_str(), f.reason.as_str());
        }
        None => {
            let _ = writeln!(out, "{request_id} {}", state.as_str());
        }
    }
    if let Some(detail) = finished.and_then(|f| f.detail.as_deref()) {
        let _ = writeln!(out, "  why:      {detail}");
    }
    if let Some(worker) = status.worker_id.as_deref().filter(|w| !w.is_empty()) {
        let attempt = status
            .attempt
            .filter(|a| *a > 1)
            .map(|a| format!(" (attempt {a})"))
            .unwrap_or_default();
        let _ = writeln!(out, "  worker:   {worker}{attempt}");
    }
    if let Some(band) = status.priority {
        let _ = writeln!(out, "  band:     {band}");
    }
    if let Some(tenant) = &status.tenant {
        let _ = writeln!(out, "  tenant:   {tenant}");
    }
    if let Some(f) = finished {
        chain(
            &mut out,
            f.job_name.as_deref(),
            f.chain_position,
            &f.root_request_id,
            f.parent_request_id.as_deref(),
            request_id,
        );
        if let Some(at) = &f.finished_at {
            let _ = writeln!(out, "  finished: {at}");
        }
        timings(&mut out, &f.timings_ms, state);
        tokens(
            &mut out,
            f.usage,
            f.tool_iterations_used,
            f.output_chars > 0,
        );
        if !f.signals.is_empty() {
            let _ = writeln!(out, "  signals:  {}", f.signals.join(", "));
        }
        if !f.prompt_start.is_empty() {
            let _ = writeln!(out, "  prompt:   {}", one_line(&f.prompt_start));
        }
        if f.output_chars > 0 {
            let _ = writeln!(
                out,
                "  output:   {} ({} characters)",
                one_line(&f.output_start),
                f.output_chars
            );
        }
    }
    let decision = status
        .decision_id
        .as_deref()
        .or(finished.and_then(|f| f.decision_id.as_deref()));
    if let Some(decision) = decision {
        let outcome = status
            .decision_outcome
            .map(|o| o.as_str())
            .unwrap_or("pending");
        let _ = writeln!(out, "  decision: {decision} ({outcome})");
    }
    if let Some(next) = &status.continuation_request_id {
        let _ = writeln!(out, "  continued as request {next}");
    }
    out
}

/// `genfleet result`: how it ended, the output whole, then the figures.
pub fn result(r: &GenerationResult) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} {} {}",
        r.request_id,
        r.state.as_str(),
        r.reason.as_str()
    );
    if let Some(detail) = &r.detail {
        let _ = writeln!(out, "  why:      {detail}");
    }
    let attempt = if r.attempt > 1 {
        format!(" (attempt {})", r.attempt)
    } else {
        String::new()
    };
    if !r.worker_id.is_empty() {
        let _ = writeln!(out, "  worker:   {}{attempt}", r.worker_id);
    }
    chain(
        &mut out,
        r.job_name.as_deref(),
        r.chain_position,
        &r.root_request_id,
        r.parent_request_id.as_deref(),
        &r.request_id,
    );
    timings(&mut out, &r.timings_ms, r.state);
    tokens(
        &mut out,
        r.usage,
        r.tool_iterations_used,
        !r.output.is_empty(),
    );
    if let Some(v) = &r.validation {
        let _ = writeln!(
            out,
            "  checks:   confidence {:.2} (needs {:.2}){}",
            v.confidence,
            v.threshold,
            if v.passed { "" } else { ", fell short" }
        );
    }
    for signal in &r.signals {
        let _ = writeln!(
            out,
            "  signal:   {}: {}",
            signal.subject_suffix(),
            signal.summary
        );
    }
    if r.reason == Reason::DecisionRequested
        && let Some(decision) = r.signals.iter().rev().find_map(|s| s.decision.as_ref())
    {
        let _ = writeln!(
            out,
            "  decision: {} ({}): genfleet decide {} <option>",
            decision.decision_id,
            decision
                .options
                .iter()
                .map(|o| o.id.as_str())
                .collect::<Vec<_>>()
                .join(" | "),
            decision.decision_id
        );
    }
    if !r.output.is_empty() {
        let _ = writeln!(out, "\n{}", r.output.trim_end());
    }
    out
}

/// `genfleet decide`: what the answer did.
pub fn decided(reply: &DecisionReply) -> String {
    match (reply.outcome, &reply.continuation_request_id) {
        (DecisionOutcome::Continued, Some(next)) => format!(
            "decision {} answered: the job continues as request {next}",
            reply.decision_id
        ),
        (outcome, _) => format!(
            "decision {} answered: the job ends ({})",
            reply.decision_id,
            outcome.as_str()
        ),
    }
}

fn chain(
    out: &mut String,
    job_name: Option<&str>,
    position: u32,
    root: &str,
    parent: Option<&str>,
    request_id: &str,
) {
    let mut parts = Vec::new();
    if let Some(job) = job_name {
        parts.push(format!("job {job}"));
    }
    if position > 1 || root != request_id {
        parts.push(format!("chain position {position}, first request {root}"));
    }
    if let Some(parent) = parent {
        parts.push(format!("continues {parent}"));
    }
    if !parts.is_empty() {
        let _ = writeln!(out, "  chain:    {}", parts.join("; "));
    }
}

fn timings(out: &mut String, t: &Timings, state: RequestState) {
    let mut parts = vec![format!("queued {}", millis(t.queued))];
    if let Some(first) = t.first_token {
        parts.push(format!("first token {}", millis(first)));
    }
    if state.is_terminal() {
        parts.push(format!("total {}", millis(t.total)));
    }
    let _ = writeln!(out, "  time:     {}", parts.join(", "));
}

/// The tokens the backend counted. A request that ended mid-stream (cancelled, timed out, its
/// backend failing) has output but no count: backends report usage at the end of a stream.
fn tokens(out: &mut String, usage: Usage, tool_iterations: u32, has_output: bool) {
    let tools = if tool_iterations > 0 {
        format!(", {tool_iterations} tool round(s)")
    } else {
        String::new()
    };
    if usage.prompt_tokens == 0 && usage.completion_tokens == 0 && has_output {
        let _ = writeln!(
            out,
            "  tokens:   not reported (it ended before the backend counted them){tools}"
        );
        return;
    }
    let _ = writeln!(
        out,
        "  tokens:   {} prompt, {} completion{tools}",
        usage.prompt_tokens, usage.completion_tokens
    );
}

/// A duration for people: `850 ms`, `2.3 s`, `4 min 12 s`.
fn millis(ms: u64) -> String {
    match ms {
        0..1000 => format!("{ms} ms"),
        1000..60_000 => format!("{:.1} s", ms as f64 / 1000.0),
        _ => format!("{} min {} s", ms / 60_000, (ms % 60_000) / 1000),
    }
}

/// Text on one line: line breaks shown as `⏎`.
fn one_line(text: &str) -> String {
    text.replace("\r\n", " ⏎ ").replace('\n', " ⏎ ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::FinishedSummary;

    fn failed() -> GenerationResult {
        let mut r = GenerationResult::empty(
            "r1",
            Reason::BackendError,
            "the backend answered HTTP 500: out of memory".into(),
            "w1",
        );
        r.attempt = 2;
        r.timings_ms = Timings {
            queued: 3,
            first_token: None,
            total: 2300,
        };
        r
    }

    #[test]
    fn a_failed_requests_status_says_why() {
        let result = failed();
        let status = StatusReply {
            request_id: "r1".into(),
            state: RequestState::Failed,
            worker_id: Some("w1".into()),
            attempt: Some(2),
            continuation_request_id: None,
            decision_id: None,
            decision_outcome: None,
            finished: Some(FinishedSummary::of(
                &result,
                Some("2026-11-24T10:00:00.000Z".into()),
            )),
            priority: None,
            tenant: None,
        };
        let text = super::status(&status);
        assert!(text.starts_with("r1 FAILED backend_error\n"), "{text}");
        for line in [
            "  why:      the backend answered HTTP 500: out of memory",
            "  worker:   w1 (attempt 2)",
            "  finished: 2026-11-24T10:00:00.000Z",
            "  time:     queued 3 ms, total 2.3 s",
        ] {
            assert!(text.contains(line), "{line:?} in\n{text}");
        }
    }

    #[test]
    fn a_running_requests_status_shows_its_band_tenant_and_worker() {
        let status = StatusReply {
            worker_id: Some("w2".into()),
            attempt: Some(1),
            priority: Some(crate::protocol::Priority::High),
            tenant: Some("acme".into()),
            ..StatusReply::new("r2", RequestState::Running)
        };
        let text = super::status(&status);
        for line in [
            "r2 RUNNING\n",
            "  worker:   w2\n",
            "  band:     high\n",
            "  tenant:   acme\n",
        ] {
            assert!(text.contains(line), "{line:?} in\n{text}");
        }
    }

    #[test]
    fn a_result_shows_its_output_whole_after_the_figures() {
        let mut r = failed();
        r.state = RequestState::Completed;
        r.reason = Reason::Stop;
        r.detail = None;
        r.output = "line one\nline two".into();
        let text = result(&r);
        assert!(text.starts_with("r1 COMPLETED stop\n"), "{text}");
        assert!(text.ends_with("\nline one\nline two\n"), "{text}");
        assert_eq!(millis(999), "999 ms");
        assert_eq!(millis(252_000), "4 min 12 s");
    }
}
