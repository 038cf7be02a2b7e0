//! The two mappings of the gateway: an OpenAI chat request onto a generation request and its
//! pool, and how a generation ended onto OpenAI's `finish_reason` or an error. The tables are
//! in docs/gateway.md; keep the two in step.

use serde_json::Value;

use super::openai::{BadField, ChatRequest, Stop};
use crate::protocol::request::RESERVED_OPTION_KEYS;
use crate::protocol::{DecisionOutcome, GenerationRequest, Reason, RequestLimits};

/// What a chat request asks of the fleet.
#[derive(Debug)]
pub struct Mapped {
    pub pool: String,
    pub request: GenerationRequest,
    pub stream: bool,
    pub include_usage: bool,
    pub durable: bool,
    pub queue: bool,
    pub follow_decisions: bool,
}

/// Where a model name goes: a pool, and the backend's model name if the configuration names
/// one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub pool: String,
    pub model: Option<String>,
}

/// Maps a chat request (its model already routed) onto a generation request. `tenant` is the
/// caller's, from its API key; it goes into the metadata over anything the caller wrote there.
pub fn map_request(
    chat: ChatRequest,
    route: Route,
    tenant: Option<&str>,
    max_request_ms: u64,
    limits: &RequestLimits,
) -> Result<Mapped, BadField> {
    if let Some(n) = chat.n
        && n != 1
    {
        return Err(BadField::new(
            "n",
            "n must be 1: the gateway generates one choice per request",
        ));
    }
    let passed: Vec<(String, Value)> = chat
        .passed_options()
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.clone()))
        .collect();
    let genfleet = chat.genfleet.unwrap_or_default();
    let mut messages = Vec::with_capacity(chat.messages.len());
    for (i, message) in chat.messages.iter().enumerate() {
        messages.push(super::openai::parse_message(i, message)?);
    }
    let mut request = GenerationRequest {
        request_id: genfleet.request_id,
        job_name: genfleet.job_name,
        system: genfleet.system,
        messages,
        tools: genfleet.tools,
        caller_tools: chat.tools.unwrap_or_default(),
        tool_iterations: genfleet.tool_iterations,
        max_tokens: chat.max_completion_tokens.or(chat.max_tokens),
        temperature: chat.temperature,
        model: route.model,
        deadline_ms: genfleet.deadline_ms,
        metadata: genfleet.metadata,
        validation: genfleet.validation,
        escalation_threshold: genfleet.escalation_threshold,
        checkpoints: genfleet.checkpoints,
        priority: genfleet.priority,
        affinity_key: genfleet.session.or_else(|| chat.user.clone()),
        ..Default::default()
    };
    for (name, value) in passed {
        debug_assert!(!RESERVED_OPTION_KEYS.contains(&name.as_str()));
        request.options.insert(name, value);
    }
    if let Some(stop) = chat.stop {
        let stop = match stop {
            Stop::One(one) => Value::from(one),
            Stop::Many(many) => Value::from(many),
        };
        request.options.insert("stop".into(), stop);
    }
    if let Some(user) = chat.user {
        request.options.insert("user".into(), user.clone().into());
        request.metadata.entry("user").or_insert(user.into());
    }
    for (key, value) in chat.metadata.unwrap_or_default() {
        request.metadata.entry(key).or_insert(value);
    }
    if let Some(tenant) = tenant {
        request.metadata.insert("tenant".into(), tenant.into());
    }
    if max_request_ms > 0 {
        request.deadline_ms = Some(
            request
                .deadline_ms
                .map_or(max_request_ms, |d| d.min(max_request_ms)),
        );
    }
    request.validate(limits).map_err(|error| BadField {
        param: guess_param(&error.message),
        message: error.message,
    })?;
    Ok(Mapped {
        pool: route.pool,
        request,
        stream: chat.stream.unwrap_or(false),
        include_usage: chat.stream_options.is_some_and(|o| o.include_usage),
        durable: genfleet.durable,
        queue: genfleet.queue,
        follow_decisions: genfleet.follow_decisions,
    })
}

/// The request's own check names the field first (`messages[1]...`, `metadata ...`): its first
/// word, as OpenAI's `param`.
fn guess_param(message: &str) -> Option<String> {
    let word = message.split([' ', ':']).next().filter(|w| !w.is_empty())?;
    word.chars()
        .all(|c| c.is_ascii_alphanumeric() || "_.[]".contains(c))
        .then(|| word.to_string())
}

/// How a completion ends, for OpenAI's `finish_reason` (a completion) or an error (a failure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// `finish_reason` of a completion.
    Finish(&'static str),
    /// An error: HTTP status, OpenAI `type`, `code`.
    Error {
        status: u16,
        kind: &'static str,
        code: &'static str,
    },
}

/// The finish reason of a generation's own ending (see the table in docs/gateway.md).
pub fn ending_of(reason: Reason) -> Ending {
    let error = |status, kind, code| Ending::Error { status, kind, code };
    match reason {
        Reason::Stop => Ending::Finish("stop"),
        Reason::Length => Ending::Finish("length"),
        Reason::ToolCalls => Ending::Finish("tool_calls"),
        // Only when the caller asked not to follow decisions (`genfleet.follow_decisions`).
        Reason::DecisionRequested => Ending::Finish("decision_requested"),
        Reason::Cancelled => error(409, "request_cancelled", "cancelled"),
        Reason::Timeout => error(504, "timeout_error", "timeout"),
        Reason::BackendError => error(502, "server_error", "backend_error"),
        Reason::WorkerLost => error(502, "server_error", "worker_lost"),
        // The model's own output could not be used (it looped, or called a tool wrongly and
        // its correction failed too): the same request would fail the same way.
        Reason::LoopDetected => error(422, "model_error", "loop_detected"),
        Reason::ToolParseError => error(422, "model_error", "tool_parse_error"),
        // A tool service behind the fleet failed (or the decision chain's limit was reached).
        Reason::ToolExecutionError => error(502, "server_error", "tool_execution_error"),
        Reason::InvalidRequest => error(400, "invalid_request_error", "invalid_request"),
    }
}

/// Whether an error with this `code` is worth the same request again, as the
/// `x-should-retry` header tells OpenAI's SDKs (which otherwise retry 408, 409, 429 and every
/// 5xx twice): a worker lost, no free slot, a timeout, the backend or the bus failing may pass;
/// the model's own failures, a failed tool, a cancelled request, a refused or duplicate one
/// would fail the same way (or run a tool again).
pub fn should_retry(code: &str) -> bool {
    matches!(
        code,
        "worker_lost"
            | "backend_error"
            | "timeout"
            | "no_slot_available"
            | "queue_timeout"
            | "gateway_shutdown"
            | "bus_unavailable"
            | "bus_closed"
            | "internal"
    )
}

/// The finish reason when a decision ended the chain instead of continuing it.
pub fn ending_of_chain(outcome: DecisionOutcome) -> &'static str {
    match outcome {
        DecisionOutcome::Skipped => "decision_skipped",
        DecisionOutcome::Aborted => "decision_aborted",
        DecisionOutcome::Expired => "decision_expired",
        // Continued or pending never end a chain; a record that says so is read as expired.
        _ => "decision_expired",
    }
}

/// The finish reason when `gateway.decision_wait_ms` ran out before the decision's answer.
pub const DECISION_TIMEOUT: &str = "decision_timeout";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::openai::parse_request;
    use serde_json::json;

    fn map(body: Value) -> Result<Mapped, BadField> {
        let chat = parse_request(body.to_string().as_bytes()).unwrap();
        let route = Route {
            pool: "default".into(),
            model: Some("backend-m".into()),
        };
        map_request(
            chat,
            route,
            Some("team-a"),
            60_000,
            &RequestLimits::default(),
        )
    }

    #[test]
    fn an_openai_request_maps_onto_a_generation_request() {
        let mapped = map(json!({
            "model": "gpt", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
            "max_tokens": 10, "max_completion_tokens": 20, "temperature": 0.2, "top_p": 0.9,
            "stop": ["END"], "user": "u1", "stream": true, "stream_options": {"include_usage": true},
            "tool_choice": "auto", "metadata": {"k": "v"},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "genfleet": {"durable": true, "queue": false, "job_name": "j", "deadline_ms": 999_999,
                         "metadata": {"tenant": "forged", "a": 1}, "tools": ["calculate"]}
        }))
        .unwrap();
        let r = &mapped.request;
        assert_eq!(mapped.pool, "default");
        assert!(mapped.stream && mapped.include_usage && mapped.durable && !mapped.queue);
        assert_eq!(r.model.as_deref(), Some("backend-m"));
        assert_eq!(r.max_tokens, Some(20));
        assert_eq!(r.temperature, Some(0.2));
        assert_eq!(r.options["top_p"], json!(0.9));
        assert_eq!(r.options["stop"], json!(["END"]));
        assert_eq!(r.options["tool_choice"], json!("auto"));
        assert_eq!(r.options["user"], json!("u1"));
        assert_eq!(r.metadata["tenant"], json!("team-a"));
        assert_eq!(r.metadata["a"], json!(1));
        assert_eq!(r.metadata["k"], json!("v"));
        assert_eq!(r.deadline_ms, Some(60_000));
        assert_eq!(r.tools, ["calculate"]);
        assert_eq!(r.caller_tools[0].function.name, "f");
        assert_eq!(r.job_name.as_deref(), Some("j"));
        assert_eq!(r.messages.len(), 2);
    }

    #[test]
    fn what_the_fleet_refuses_names_the_field() {
        let error = map(json!({"model": "gpt", "messages": [], "n": 2})).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("n"));
        let error = map(json!({"model": "gpt", "messages": []})).unwrap_err();
        assert!(error.message.contains("messages"), "{error:?}");
        let error =
            map(json!({"model": "gpt", "messages": [{"role": "user", "content": "x", "bad": 1}]}))
                .unwrap_err();
        assert_eq!(error.param.as_deref(), Some("messages[0].bad"), "{error:?}");
    }

    #[test]
    fn every_reason_has_an_ending_and_only_three_are_openai_s_own() {
        use Reason::*;
        for reason in [
            Stop,
            Length,
            DecisionRequested,
            ToolCalls,
            Cancelled,
            ToolExecutionError,
            ToolParseError,
            LoopDetected,
            BackendError,
            WorkerLost,
            Timeout,
            InvalidRequest,
        ] {
            match ending_of(reason) {
                Ending::Finish(finish) => assert!(
                    reason.state() == crate::protocol::RequestState::Completed,
                    "{reason:?} → {finish}"
                ),
                Ending::Error { status, code, .. } => {
                    assert!(status >= 400, "{reason:?}");
                    let retried = matches!(reason, BackendError | WorkerLost | Timeout);
                    assert_eq!(should_retry(code), retried, "{reason:?}");
                }
            }
        }
    }
}
