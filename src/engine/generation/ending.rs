//! How a generation ends: why it stops, and the one terminal result that says so.
//!
//! Every way out of the tool loop is a [`Stop`], never an error or a panic, so that
//! `Engine::run` always has a result to return. [`Generation::finish`] is the only place a result
//! is built, so its fields mean the same whatever ended the generation.

use crate::engine::Finished;
use crate::protocol::{GenerationResult, Reason};

use super::Generation;

/// Why the generation stops, with the detail the result carries.
pub(super) struct Stop {
    pub(super) reason: Reason,
    pub(super) detail: Option<String>,
}

impl Stop {
    pub(super) fn new(reason: Reason, detail: impl Into<String>) -> Stop {
        Stop {
            reason,
            detail: Some(detail.into()),
        }
    }

    pub(super) fn plain(reason: Reason) -> Stop {
        Stop {
            reason,
            detail: None,
        }
    }
}

impl Generation<'_> {
    /// Flushes the coalesced deltas first, so the result never holds text the events have not
    /// shown; the emitter is handed back so `finished` follows with the next sequence number.
    pub(super) async fn finish(mut self, stop: Stop) -> Finished {
        self.events.flush().await;
        // What waited for a checkpoint goes out now: the result holds it (and `finished`, sent
        // by the Supervisor on the same numbering, follows it).
        self.events.release().await;
        let timings_ms = self.meter.timings(self.ctx.accepted_at);
        let signals_dropped = self.signals.dropped();
        let result = GenerationResult {
            request_id: self.ctx.request_id,
            root_request_id: self.ctx.root_request_id,
            parent_request_id: self.ctx.parent_request_id,
            job_name: self.request.job_name,
            state: stop.reason.state(),
            reason: stop.reason,
            detail: stop.detail,
            output: self.transcript.output,
            reasoning: self.transcript.reasoning,
            messages: self.transcript.conversation,
            signals: self.signals.into_signals(),
            signals_dropped,
            tool_iterations_used: self.iterations.used,
            usage: self.meter.usage,
            worker_id: self.ctx.worker_id,
            attempt: self.ctx.attempt,
            chain_position: self.ctx.chain_position,
            truncated: self.transcript.truncated,
            metadata: self.request.metadata,
            timings_ms,
            validation: self.judgement.report,
            tool_calls: self.transcript.caller_calls,
            // Where the request was placed is the bus's to tell, not the engine's.
            affinity: None,
            tenant: None,
            // So are its moves between workers (its record keeps them).
            resumed: Vec::new(),
        };
        Finished {
            result,
            events: self.events,
        }
    }
}
