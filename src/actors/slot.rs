//! The slot actor: runs one request's generation and reports its end to the Supervisor.
//!
//! The slot is released structurally: the actor owns a [`SlotGuard`] whose `Drop` tells the
//! Supervisor the slot is free. Whatever ends the actor (completion, cancellation, a panic in
//! the generation, the actor being stopped or its arbiter going away), the guard is dropped
//! exactly once, so no path can forget to release.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use tracing::Instrument;

use actix::prelude::*;
use tokio_util::sync::CancellationToken;

use super::messages::{SlotDone, SlotReleased};
use crate::engine::{Engine, EventEmitter, EventSink, RequestContext};
use crate::protocol::GenerationRequest;
use crate::telemetry::{self, KeyValue};

/// Frees the slot when dropped; owned by the slot actor and nothing else.
pub(super) struct SlotGuard {
    pub(super) request_id: String,
    /// The Supervisor, told of the free slot.
    pub(super) released: Recipient<SlotReleased>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        // do_send ignores the mailbox bound; at most one release per slot is ever in flight,
        // so what it can queue is bounded by `worker.slots`.
        self.released.do_send(SlotReleased {
            request_id: std::mem::take(&mut self.request_id),
        });
    }
}

pub(super) struct SlotActor {
    /// The Supervisor, told of the generation's end.
    pub(super) done: Recipient<SlotDone>,
    pub(super) engine: Arc<Engine>,
    pub(super) job: Option<(GenerationRequest, RequestContext)>,
    pub(super) sink: EventSink,
    pub(super) cancel: CancellationToken,
    /// Kept for its `Drop`, which frees the slot.
    #[expect(dead_code, reason = "held for its Drop alone")]
    pub(super) guard: SlotGuard,
    pub(super) sequence: Arc<AtomicU64>,
    pub(super) task: Option<tokio::task::AbortHandle>,
}

impl Actor for SlotActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let Some((request, context)) = self.job.take() else {
            ctx.stop();
            return;
        };
        let engine = self.engine.clone();
        let request_id = context.request_id.clone();
        let emitter = EventEmitter::continuing(
            request_id.clone(),
            self.sink.clone(),
            engine.config().coalescing,
            self.sequence.clone(),
        );
        let cancel = self.cancel.clone();
        let started = context.clone();
        // The generation runs as its own task: on a multi-threaded runtime it uses every core,
        // and a panic inside it is caught by the JoinHandle instead of unwinding the actor.
        let span = tracing::info_span!(
            "slot",
            request_id = %context.request_id,
            worker_id = %context.worker_id,
            pool = %context.pool,
            chain_position = context.chain_position,
            attempt = context.attempt,
            traceparent = context.traceparent.as_deref().unwrap_or(""),
        );
        trace_slot(&span, &context);
        let handle = tokio::spawn(
            async move { engine.run(request, context, emitter, cancel).await }.instrument(span),
        );
        self.task = Some(handle.abort_handle());
        ctx.spawn(handle.into_actor(self).map(move |joined, act, ctx| {
            let outcome = match joined {
                Ok(finished) => Ok(finished),
                Err(error) => {
                    let what = if error.is_panic() {
                        panic_text(error.into_panic())
                    } else {
                        "the generation task was aborted".to_string()
                    };
                    tracing::error!(message = "generation lost", request_id = %started.request_id, error = %what);
                    Err(what)
                }
            };
            act.done.do_send(SlotDone {
                request_id: started.request_id.clone(),
                context: started.clone(),
                outcome,
                sequence: act.sequence.clone(),
            });
            ctx.stop();
        }));
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        // Stopped before the generation ended (e.g. the system shuts down): end it too.
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// In an exported trace, the slot's span sits under the request's span on this worker, after
/// the wait for a slot (from when the fleet accepted the request until now).
fn trace_slot(span: &tracing::Span, context: &RequestContext) {
    if !telemetry::exporting() {
        return;
    }
    let identity = || {
        vec![
            KeyValue::new("genfleet.request_id", context.request_id.clone()),
            KeyValue::new("genfleet.pool", context.pool.clone()),
            KeyValue::new("genfleet.worker_id", context.worker_id.clone()),
        ]
    };
    let now = std::time::SystemTime::now();
    let accepted = telemetry::wall_clock_ago(context.accepted_at.elapsed());
    telemetry::record_interval(
        "genfleet.queue_wait",
        context.traceparent.as_deref(),
        accepted,
        now,
        identity(),
    );
    telemetry::set_parent(span, context.traceparent.as_deref());
    telemetry::annotate(span, identity());
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("the generation panicked: {text}")
}
