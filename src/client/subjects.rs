//! Every subject genfleet uses, built from the configured prefixes in one place.

use crate::protocol::schedule::is_valid_tenant;
use crate::protocol::{DEFAULT_TENANT, Priority, SignalType};
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

    /// `gen.submit.<pool>`: interactive requests of the default tenant, one worker of the pool
    /// answers.
    pub fn submit(&self, pool: &str) -> String {
        format!("{}.submit.{pool}", self.gen_prefix)
    }

    /// `gen.submit.<pool>.<tenant>`: interactive requests of a tenant (the default tenant's
    /// when `tenant` is `None`, on the v1 subject).
    pub fn submit_as(&self, pool: &str, tenant: Option<&str>) -> String {
        match tenant {
            Some(tenant) => format!("{}.submit.{pool}.{tenant}", self.gen_prefix),
            None => self.submit(pool),
        }
    }

    /// Every tenant's submit subject of a pool (`gen.submit.<pool>.*`).
    pub fn tenant_submits(&self, pool: &str) -> String {
        format!("{}.submit.{pool}.*", self.gen_prefix)
    }

    /// The tenant a submit subject of `pool` names: the default tenant on the v1 subject,
    /// `None` for a subject that is not one of the pool's.
    pub fn submit_tenant<'s>(&self, pool: &str, subject: &'s str) -> Option<&'s str> {
        tenant_after(&self.submit(pool), subject)
    }

    /// The queue group of a pool's submit subscribers.
    pub fn submit_group(&self, pool: &str) -> String {
        format!("genfleet-submit-{pool}")
    }

    /// `gen.queue.<pool>.<request_id>`: the durable queue of the v1 subjects (band `normal`,
    /// the default tenant).
    pub fn queue(&self, pool: &str, request_id: &str) -> String {
        format!("{}.queue.{pool}.{request_id}", self.gen_prefix)
    }

    /// The subject a request of `band` and `tenant` is queued on: the v1 subject for `normal`
    /// requests of the default tenant (`tenant` `None`), `gen.queue.<pool>.<band>.<tenant>.<id>`
    /// otherwise.
    pub fn queue_for(
        &self,
        pool: &str,
        band: Priority,
        tenant: Option<&str>,
        request_id: &str,
    ) -> String {
        match (band, tenant) {
            (Priority::Normal, None) => self.queue(pool, request_id),
            (band, tenant) => format!(
                "{}.queue.{pool}.{band}.{}.{request_id}",
                self.gen_prefix,
                tenant.unwrap_or(DEFAULT_TENANT)
            ),
        }
    }

    /// Every queue subject one request (its id as the bus knows it) may wait on, to find it
    /// while it waits: for the default tenant the v1 one and its banded ones, for another
    /// tenant that tenant's banded ones only (a request id never reaches another tenant's).
    pub fn queued(&self, request_id: &str) -> Vec<String> {
        match crate::protocol::schedule::split_qualified(request_id) {
            Some((Some(tenant), id)) => {
                vec![format!("{}.queue.*.*.{tenant}.{id}", self.gen_prefix)]
            }
            Some((None, id)) => vec![
                format!("{}.queue.*.{id}", self.gen_prefix),
                format!("{}.queue.*.*.{DEFAULT_TENANT}.{id}", self.gen_prefix),
            ],
            None => Vec::new(),
        }
    }

    /// The queue subjects one request (its id as the bus knows it) may wait on in `pool`:
    /// the v1 one and the banded ones for the default tenant, the tenant's banded ones for
    /// another. Each names one subject, which the stream finds at once; [`Subjects::queued`]'s
    /// wildcards make it look through every subject it holds.
    pub fn queued_in(&self, pool: &str, request_id: &str) -> Vec<String> {
        let Some((tenant, id)) = crate::protocol::schedule::split_qualified(request_id) else {
            return Vec::new();
        };
        let mut subjects = Vec::with_capacity(4);
        if tenant.is_none() {
            subjects.push(self.queue(pool, id));
        }
        let tenant = tenant.unwrap_or(DEFAULT_TENANT);
        for band in Priority::ALL {
            subjects.push(self.queue_for(pool, band, Some(tenant), id));
        }
        subjects
    }

    /// The filter of a pool's v1 queue consumer: `gen.queue.<pool>.*`.
    pub fn pool_queue(&self, pool: &str) -> String {
        format!("{}.queue.{pool}.*", self.gen_prefix)
    }

    /// The filter of the queue consumer of one band and tenant of a pool.
    pub fn band_queue(&self, pool: &str, band: Priority, tenant: &str) -> String {
        format!("{}.queue.{pool}.{band}.{tenant}.*", self.gen_prefix)
    }

    /// Every banded queue subject of a pool (`gen.queue.<pool>.*.*.*`), to find the bands and
    /// tenants with waiting requests.
    pub fn banded_queues(&self, pool: &str) -> String {
        format!("{}.queue.{pool}.*.*.*", self.gen_prefix)
    }

    /// Where the queue stream republishes the headers of every message it stores
    /// (`gen.queued.>`), so that workers hear of new requests without pulling.
    pub fn queue_notices(&self) -> String {
        format!("{}.queued.>", self.gen_prefix)
    }

    /// A pool's notices (`gen.queued.<pool>.>`).
    pub fn pool_notices(&self, pool: &str) -> String {
        format!("{}.queued.{pool}.>", self.gen_prefix)
    }

    /// Reads a queue subject (or its notice): the pool, band, tenant and request id.
    pub fn parse_queued(&self, subject: &str) -> Option<QueueSubject> {
        let rest = subject
            .strip_prefix(&format!("{}.queue.", self.gen_prefix))
            .or_else(|| subject.strip_prefix(&format!("{}.queued.", self.gen_prefix)))?;
        let tokens: Vec<&str> = rest.split('.').collect();
        match tokens.as_slice() {
            [pool, request_id] => Some(QueueSubject {
                pool: pool.to_string(),
                band: Priority::Normal,
                tenant: DEFAULT_TENANT.to_string(),
                v1: true,
                request_id: request_id.to_string(),
            }),
            [pool, band, tenant, request_id] if is_valid_tenant(tenant) => Some(QueueSubject {
                pool: pool.to_string(),
                band: Priority::from_token(band)?,
                tenant: tenant.to_string(),
                v1: false,
                request_id: request_id.to_string(),
            }),
            _ => None,
        }
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

    /// `gen.status.*`, `gen.result.*`, `gen.cancel.*`: answered by any worker, for the default
    /// tenant's requests.
    pub fn any(&self, verb: &str) -> String {
        format!("{}.{verb}.*", self.gen_prefix)
    }

    /// `gen.status.*.*`, `gen.result.*.*`, `gen.cancel.*.*`: the same for every other tenant's
    /// requests, whose ids on the bus are `<tenant>.<id>`.
    pub fn any_tenant(&self, verb: &str) -> String {
        format!("{}.{verb}.*.*", self.gen_prefix)
    }

    /// The request id (as the bus knows it: `<id>`, or `<tenant>.<id>`) of a per-request
    /// subject of `verb` (`gen.<verb>.<id>`, `gen.<verb>.<tenant>.<id>`); empty when the
    /// subject is not one.
    pub fn request_of<'s>(&self, verb: &str, subject: &'s str) -> &'s str {
        subject
            .strip_prefix(self.gen_prefix.as_str())
            .and_then(|rest| rest.strip_prefix('.'))
            .and_then(|rest| rest.strip_prefix(verb))
            .and_then(|rest| rest.strip_prefix('.'))
            .unwrap_or_default()
    }

    /// The queue group in which any one worker answers status, result and cancel.
    pub fn any_group(&self) -> &'static str {
        "genfleet-any"
    }

    /// A worker's own subject for the cancels other workers forward to it.
    pub fn worker_cancel(&self, worker_id: &str) -> String {
        format!("{}.worker.{worker_id}.cancel", self.gen_prefix)
    }

    /// `gen.worker.<worker_id>.submit`, and `gen.worker.<worker_id>.submit.<tenant>` for a
    /// tenant: a worker's own submit subject, for requests whose affinity key it served last.
    /// The tenant is a subject token here too, so NATS permissions vouch for it.
    pub fn worker_submit(&self, worker_id: &str, tenant: Option<&str>) -> String {
        match tenant {
            Some(tenant) => format!("{}.worker.{worker_id}.submit.{tenant}", self.gen_prefix),
            None => format!("{}.worker.{worker_id}.submit", self.gen_prefix),
        }
    }

    /// Every tenant's own submit subject of a worker (`gen.worker.<worker_id>.submit.*`).
    pub fn worker_tenant_submits(&self, worker_id: &str) -> String {
        format!("{}.worker.{worker_id}.submit.*", self.gen_prefix)
    }

    /// The tenant a worker's own submit subject names: the default tenant on the subject
    /// without a tenant token, `None` for a subject that is not the worker's.
    pub fn worker_submit_tenant<'s>(&self, worker_id: &str, subject: &'s str) -> Option<&'s str> {
        tenant_after(&self.worker_submit(worker_id, None), subject)
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

/// What a queue subject says of the request queued on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSubject {
    pub pool: String,
    pub band: Priority,
    pub tenant: String,
    /// Queued on the v1 subject `gen.queue.<pool>.<id>`.
    pub v1: bool,
    pub request_id: String,
}

impl QueueSubject {
    /// The request's id on the bus: `<tenant>.<id>` for a tenant other than the default.
    pub fn qualified_id(&self) -> String {
        crate::protocol::schedule::qualified_id(Some(&self.tenant), &self.request_id)
    }
}

/// The tenant token after a submit subject's `base`: the default tenant when there is none,
/// `None` when `subject` is not `base` or its tenant token is not a valid tenant name.
fn tenant_after<'s>(base: &str, subject: &'s str) -> Option<&'s str> {
    let rest = subject.strip_prefix(base)?;
    if rest.is_empty() {
        return Some(DEFAULT_TENANT);
    }
    rest.strip_prefix('.').filter(|t| is_valid_tenant(t))
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
        assert_eq!(s.worker_submit("w1", None), "t.gen.worker.w1.submit");
        assert_eq!(
            s.worker_submit("w1", Some("acme")),
            "t.gen.worker.w1.submit.acme"
        );
        assert_eq!(
            s.worker_submit_tenant("w1", "t.gen.worker.w1.submit.acme"),
            Some("acme")
        );
        assert_eq!(
            s.worker_submit_tenant("w1", "t.gen.worker.w1.submit"),
            Some(crate::protocol::DEFAULT_TENANT)
        );
        assert_eq!(s.worker_submit_tenant("w1", "t.gen.worker.w2.submit"), None);
        assert_eq!(s.events("r"), "t.gen.events.r");
        assert_eq!(s.any("status"), "t.gen.status.*");
        assert_eq!(
            s.signal(SignalType::DecisionRequest, "CHECKPOINT"),
            "t.sig.decision_request.CHECKPOINT"
        );
        assert_eq!(s.all_signals(), "t.sig.>");
        assert_eq!(Subjects::request_id_of("t.gen.result.abc"), "abc");
        assert_eq!(s.request_of("result", "t.gen.result.abc"), "abc");
        assert_eq!(s.request_of("result", "t.gen.result.acme.abc"), "acme.abc");
        assert_eq!(s.request_of("status", "t.gen.result.abc"), "");
        assert_eq!(s.events("acme.r"), "t.gen.events.acme.r");
        assert_eq!(s.any_tenant("cancel"), "t.gen.cancel.*.*");
        assert_eq!(s.queued("acme.r"), vec!["t.gen.queue.*.*.acme.r"]);
        assert_eq!(
            s.queued("r"),
            vec!["t.gen.queue.*.r", "t.gen.queue.*.*.default.r"]
        );
        assert!(s.queued("a.b.c").is_empty());
        assert_eq!(s.submit_as("p", Some("acme")), "t.gen.submit.p.acme");
        assert_eq!(s.submit_tenant("p", "t.gen.submit.p"), Some("default"));
        assert_eq!(s.submit_tenant("p", "t.gen.submit.p.acme"), Some("acme"));
        assert_eq!(s.submit_tenant("p", "t.gen.submit.px"), None);
        assert_eq!(
            s.queue_for("p", Priority::Normal, None, "r"),
            "t.gen.queue.p.r"
        );
        assert_eq!(
            s.queue_for("p", Priority::High, None, "r"),
            "t.gen.queue.p.high.default.r"
        );
        assert_eq!(
            s.queue_for("p", Priority::Normal, Some("acme"), "r"),
            "t.gen.queue.p.normal.acme.r"
        );
    }

    #[test]
    fn queue_subjects_read_back() {
        let s = Subjects::new(&SubjectSettings {
            gen_prefix: "t.gen".into(),
            signals_prefix: "t.sig".into(),
            tools_prefix: "t.tools".into(),
            decisions_prefix: "t.dec".into(),
        });
        let q = s.parse_queued("t.gen.queue.p.low.acme.r1").unwrap();
        assert_eq!(
            (
                q.pool.as_str(),
                q.band,
                q.tenant.as_str(),
                q.v1,
                q.request_id.as_str()
            ),
            ("p", Priority::Low, "acme", false, "r1")
        );
        assert_eq!(q.qualified_id(), "acme.r1");
        assert_eq!(
            s.parse_queued("t.gen.queue.p.high.default.r1")
                .unwrap()
                .qualified_id(),
            "r1"
        );
        let q = s.parse_queued("t.gen.queued.p.r2").unwrap();
        assert_eq!(
            (q.band, q.tenant.as_str(), q.v1),
            (Priority::Normal, "default", true)
        );
        for bad in [
            "t.gen.queue.p.urgent.acme.r",
            "t.gen.queue.p",
            "t.gen.queue.p.a.b",
            "x.r",
        ] {
            assert_eq!(s.parse_queued(bad), None, "{bad}");
        }
    }
}
