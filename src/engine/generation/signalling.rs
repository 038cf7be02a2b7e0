//! The signals a generation raises, and the bounds they go through.
//!
//! The model's signals count against the per-request limits and may be dropped (a model must
//! not flood its managers), while the worker's own are always kept with their meta bounded.
//! Either kind is emitted as an event as soon as it is recorded, so whoever follows the request
//! sees it before the result.

use serde_json::json;

use crate::engine::control::SignalOrigin;
use crate::engine::loop_detect::LoopVerdict;
use crate::protocol::{EventBody, Reason, Severity, Signal, SignalSource, SignalType};

use super::Generation;
use super::ending::Stop;

impl Generation<'_> {
    pub(super) fn origin(&self) -> SignalOrigin<'_> {
        SignalOrigin {
            request_id: &self.ctx.request_id,
            root_request_id: &self.ctx.root_request_id,
            job_name: self.request.job_name.as_deref(),
            worker_id: &self.ctx.worker_id,
            pool: &self.ctx.pool,
        }
    }

    pub(super) async fn model_signal(&mut self, signal: Signal) -> bool {
        let kept = self.signals.add(signal).cloned();
        let Some(signal) = kept else {
            tracing::debug!(message = "model signal dropped by the per-request bound", request_id = %self.ctx.request_id);
            return false;
        };
        self.events
            .emit(EventBody::Signal {
                signal: Box::new(signal),
            })
            .await;
        true
    }

    pub(super) async fn worker_signal(
        &mut self,
        code: &str,
        severity: Severity,
        summary: String,
        meta: serde_json::Value,
    ) {
        let meta = match meta {
            serde_json::Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        let signal = self.origin().signal(
            SignalType::Issue,
            code,
            SignalSource::Worker,
            severity,
            summary,
            meta,
        );
        self.push_worker_signal(signal).await;
    }

    /// Records a signal the worker raises (always kept, meta bounded) and emits it.
    pub(super) async fn push_worker_signal(&mut self, signal: Signal) {
        if let Some(signal) = self.signals.add(signal).cloned() {
            self.events
                .emit(EventBody::Signal {
                    signal: Box::new(signal),
                })
                .await;
        }
    }

    /// Ends the generation in a loop. The signal carries the kind of loop, which the result's
    /// reason and detail do not.
    pub(super) async fn loop_detected(&mut self, verdict: LoopVerdict) -> Stop {
        let detail = verdict.detail.clone();
        self.worker_signal(
            "LOOP_DETECTED",
            Severity::High,
            format!("the model was stopped in a loop: {detail}"),
            json!({"kind": format!("{:?}", verdict.kind), "detail": detail}),
        )
        .await;
        Stop::new(Reason::LoopDetected, detail)
    }
}
