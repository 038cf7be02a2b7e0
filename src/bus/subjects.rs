//! Every subject genfleet uses, built from the configured prefixes in one place.

use crate::protocol::SignalType;
use crate::settings::SubjectSettings;

#[derive(Debug, Clone)]
pub struct Subjects {
    gen_prefix: String,
    signals_prefix: String,
    tools_prefix: String,
    decisions_prefix: String,
}

impl Subjects {
    pub fn new(settings: &SubjectSettings) -> Self {
        Subjects {
            gen_prefix: settings.gen_prefix.clone(),
            signals_prefix: settings.signals_prefix.clone(),
            tools_prefix: settings.tools_prefix.clone(),
            decisions_prefix: settings.decisions_prefix.clone(),
        }
    }

    /// `gen.submit.<pool>`: interactive requests, one worker of the pool answers.
    pub fn submit(&self, pool: &str) -> String {
        format!("{}.submit.{pool}", self.gen_prefix)
    }

    /// The queue group of a pool's submit subscribers.
    pub fn submit_group(&self, pool: &str) -> String {
        format!("genfleet-submit-{pool}")
    }

    /// `gen.queue.<pool>.<request_id>`: the durable queue.
    pub fn queue(&self, pool: &str, request_id: &str) -> String {
        format!("{}.queue.{pool}.{request_id}", self.gen_prefix)
    }

    /// Every pool's queue subject of one request (to find it while it waits).
    pub fn queued(&self, request_id: &str) -> String {
        format!("{}.queue.*.{request_id}", self.gen_prefix)
    }

    /// A pool's whole queue, the filter of its consumer.
    pub fn pool_queue(&self, pool: &str) -> String {
        format!("{}.queue.{pool}.>", self.gen_prefix)
    }

    pub fn events(&self, request_id: &str) -> String {
        format!("{}.events.{request_id}", self.gen_prefix)
    }

    pub fn status(&self, request_id: &str) -> String {
        format!("{}.status.{request_id}", self.gen_prefix)
    }

    pub fn result(&self, request_id: &str) -> String {
        format!("{}.result.{request_id}", self.gen_prefix)
    }

    pub fn cancel(&self, request_id: &str) -> String {
        format!("{}.cancel.{request_id}", self.gen_prefix)
    }

    /// Every pool's queue: what the queue stream captures.
    pub fn all_queues(&self) -> String {
        format!("{}.queue.>", self.gen_prefix)
    }

    /// `gen.status.*`, `gen.result.*`, `gen.cancel.*`: answered by any worker.
    pub fn any(&self, verb: &str) -> String {
        format!("{}.{verb}.*", self.gen_prefix)
    }

    /// The queue group in which any one worker answers status, result and cancel.
    pub fn any_group(&self) -> &'static str {
        "genfleet-any"
    }

    /// A worker's own subject for the cancels other workers forward to it.
    pub fn worker_cancel(&self, worker_id: &str) -> String {
        format!("{}.worker.{worker_id}.cancel", self.gen_prefix)
    }

    /// A worker's `capacity` endpoint of the service API.
    pub fn worker_capacity(&self, worker_id: &str) -> String {
        format!("{}.worker.{worker_id}.capacity", self.gen_prefix)
    }

    /// The queue group of a worker's `capacity` endpoint (its own: every worker answers).
    pub fn capacity_group(&self, worker_id: &str) -> String {
        format!("genfleet-capacity-{worker_id}")
    }

    /// The queue group in which one worker takes each manager's answer.
    pub fn decisions_group(&self) -> &'static str {
        "genfleet-decisions"
    }

    /// The advisory a pool's queue consumer sends when a message's deliveries run out.
    pub fn max_deliveries_advisory(&self, stream: &str, consumer: &str) -> String {
        format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}")
    }

    /// The queue group in which one worker gives up each request out of deliveries.
    pub fn exhausted_group(&self) -> &'static str {
        "genfleet-exhausted"
    }

    pub fn signal(&self, kind: SignalType, code: &str) -> String {
        format!("{}.{}.{code}", self.signals_prefix, kind.as_str())
    }

    /// `tools.<name>`: one tool service answers.
    pub fn tool(&self, name: &str) -> String {
        format!("{}.{name}", self.tools_prefix)
    }

    /// `decisions.<decision_id>`: a manager's answer.
    pub fn decision(&self, decision_id: &str) -> String {
        format!("{}.{decision_id}", self.decisions_prefix)
    }

    /// Everything the signals stream captures.
    pub fn all_signals(&self) -> String {
        format!("{}.>", self.signals_prefix)
    }

    /// The last token of a request-scoped subject: the request id.
    pub fn request_id_of(subject: &str) -> &str {
        subject.rsplit('.').next().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_follow_the_prefixes() {
        let s = Subjects::new(&SubjectSettings {
            gen_prefix: "t.gen".into(),
            signals_prefix: "t.sig".into(),
            tools_prefix: "t.tools".into(),
            decisions_prefix: "t.dec".into(),
        });
        assert_eq!(s.submit("p"), "t.gen.submit.p");
        assert_eq!(s.events("r"), "t.gen.events.r");
        assert_eq!(s.any("status"), "t.gen.status.*");
        assert_eq!(
            s.signal(SignalType::DecisionRequest, "CHECKPOINT"),
            "t.sig.decision_request.CHECKPOINT"
        );
        assert_eq!(s.all_signals(), "t.sig.>");
        assert_eq!(Subjects::request_id_of("t.gen.result.abc"), "abc");
    }
}
