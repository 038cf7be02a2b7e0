//! A request's life on the record: submitted (started in a free slot, or waiting for one),
//! ended by its slot, its slot freed, released by its owner.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use actix::prelude::*;

use super::records::{Record, Running, Waiting};
use super::{Supervisor, announce_finished, lost_result};
use crate::actors::messages::{
    Canceller, Release, Released, SlotDone, SlotReleased, Submit, Ticket,
};
use crate::engine::EventEmitter;
use crate::protocol::ids::new_id;
use crate::protocol::{Accepted, ErrorCode, GenerationResult, RequestState, WireError};
use crate::schedule::tenant_name;

impl<T: Ticket> Handler<Submit<T>> for Supervisor<T> {
    type Result = Result<Accepted, WireError>;

    fn handle(&mut self, msg: Submit<T>, ctx: &mut Context<Self>) -> Self::Result {
        let Submit {
            request,
            mut placement,
        } = msg;
        if self.draining {
            return Err(Self::refuse(
                ErrorCode::NoSlotAvailable,
                "the worker is draining and accepts no new requests",
            ));
        }
        if self.paused && !placement.scheduling.wait_for_slot {
            return Err(Self::refuse(
                ErrorCode::NoSlotAvailable,
                "the worker takes no work until its backend answers",
            ));
        }
        let request = request.into_request();
        let request_id = request.request_id.clone().unwrap_or_else(new_id);
        if self.records.contains_key(&request_id) {
            return Err(Self::refuse(
                ErrorCode::DuplicateRequestId,
                format!("request {request_id} is already known to this worker"),
            ));
        }
        let worker_id = self.config.worker_id.clone();
        let accepted = |state| Accepted {
            request_id: request_id.clone(),
            worker_id: worker_id.clone(),
            state,
        };
        let free = self.config.slots.saturating_sub(self.busy);
        let policy = self.config.policy();
        let tenant = placement.scheduling.tenant.as_deref();
        let at_limit = policy.at_tenant_limit(&self.slots, tenant);
        if at_limit && !placement.scheduling.wait_for_slot {
            return Err(Self::refuse(
                ErrorCode::TenantLimit,
                format!(
                    "tenant {} already runs {} requests on this worker (worker.tenants.max_running)",
                    tenant_name(tenant),
                    self.config.tenant_max_running
                ),
            ));
        }
        if policy.band_fits(free, placement.scheduling.band) && !at_limit && self.waiting.is_empty()
        {
            let accepted = accepted(RequestState::Running);
            // Started at once: nobody waits to hear it.
            placement.on_start = None;
            self.start_in_slot(request, placement, ctx);
            self.publish_capacity();
            return Ok(accepted);
        }
        if free == 0
            && !at_limit
            && (self.preempt_for(placement.scheduling.band) || self.preempt_for_share(tenant))
        {
            // It starts at once: the preempted request gives its slot back as soon as it has
            // written its checkpoint (normally at its next piece of text), and until then this
            // worker runs one request more than its slots.
            let accepted = accepted(RequestState::Running);
            placement.on_start = None;
            self.start_in_slot(request, placement, ctx);
            self.publish_capacity();
            return Ok(accepted);
        }
        if placement.scheduling.wait_for_slot && self.waiting.len() < self.config.slots as usize {
            let accepted = accepted(RequestState::Queued);
            self.waiting.push_back(request_id.clone());
            self.records.insert(
                request_id,
                Record::Waiting(Box::new(Waiting { request, placement })),
            );
            self.publish_capacity();
            return Ok(accepted);
        }
        if free > 0 {
            return Err(Self::refuse(
                ErrorCode::NoSlotAvailable,
                format!(
                    "the {free} free slots are reserved for bands above {} (worker.reserved_slots)",
                    placement.scheduling.band
                ),
            ));
        }
        Err(Self::refuse(
            ErrorCode::NoSlotAvailable,
            format!("all {} slots are busy", self.config.slots),
        ))
    }
}

impl<T: Ticket> Supervisor<T> {
    /// With `worker.preempt`, asks the newest running request of a band below `band` (one not
    /// yet preempted `worker.max_preemptions` times, nor already handing off) to hand its slot
    /// over: it writes a checkpoint at its next chance and stops. Whether one was asked. A
    /// request already asked is not asked again: each preemption frees one slot, for the one
    /// request that asked it.
    fn preempt_for(&mut self, band: crate::protocol::Priority) -> bool {
        if !self.config.preempt || self.draining {
            return false;
        }
        let Some(victim) = self.preempt_newest(|running| running.band > band) else {
            return false;
        };
        tracing::info!(
            message = "preempting a request of a lower band",
            request_id = %victim,
            for_band = band.as_str()
        );
        true
    }

    /// With `worker.preempt_fair_share`, asks the newest running request of the tenant far
    /// over its fair share of this worker's slots ([`crate::schedule::over_share`]) to hand
    /// its slot over to a request of `tenant`, under its share, that finds none free: as
    /// [`Supervisor::preempt_for`], bounded by `worker.max_preemptions` the same way. A tenant's
    /// requests already asked to leave count as gone; the taker's waiting ones as its own.
    fn preempt_for_share(&mut self, tenant: Option<&str>) -> bool {
        if !self.config.preempt_fair_share || self.draining {
            return false;
        }
        let taker = tenant_name(tenant);
        let mut counts: HashMap<String, u32> = HashMap::new();
        for record in self.records.values() {
            let holder = match record {
                Record::Running(running) if running.cancelled_by.is_none() => {
                    tenant_name(running.tenant.as_deref())
                }
                Record::Waiting(waiting)
                    if tenant_name(waiting.placement.scheduling.tenant.as_deref()) == taker =>
                {
                    taker
                }
                _ => continue,
            };
            *counts.entry(holder.to_string()).or_default() += 1;
        }
        let Some(giver) = crate::schedule::over_share(self.config.slots, &counts, taker) else {
            return false;
        };
        let Some(victim) =
            self.preempt_newest(|running| tenant_name(running.tenant.as_deref()) == giver)
        else {
            return false;
        };
        tracing::info!(
            message = "preempting a request of a tenant over its fair share",
            request_id = %victim,
            tenant = %giver,
            for_tenant = %taker
        );
        true
    }

    /// Asks the newest running request that `chosen` picks, and that is neither leaving
    /// already nor preempted `worker.max_preemptions` times, to hand its slot over; its id.
    fn preempt_newest(&mut self, chosen: impl Fn(&Running<T>) -> bool) -> Option<String> {
        let max_preemptions = self.config.max_preemptions;
        let victim = self
            .records
            .values_mut()
            .filter_map(|record| match record {
                Record::Running(running)
                    if chosen(running)
                        && running.cancelled_by.is_none()
                        && running.context.continuity.preemptions < max_preemptions =>
                {
                    Some(running)
                }
                _ => None,
            })
            .max_by_key(|running| running.started_at)?;
        victim.context.continuity.hand_off.cancel();
        victim.cancelled_by = Some(Canceller::Preempted);
        Some(victim.context.request_id.clone())
    }
}

impl<T: Ticket> Handler<SlotDone> for Supervisor<T> {
    type Result = ();

    fn handle(&mut self, msg: SlotDone, _: &mut Context<Self>) {
        let Some(Record::Running(running)) = self.records.remove(&msg.request_id) else {
            // Already ended (e.g. released first): the first terminal result stands.
            tracing::warn!(message = "a second end for one request was ignored", request_id = %msg.request_id);
            return;
        };
        let running = *running;
        let result = match msg.outcome {
            Ok(finished) => finished.result,
            Err(detail) => lost_result(&running, &msg.context, detail),
        };
        self.end_running(msg.request_id, msg.sequence, running, result);
    }
}

impl<T: Ticket> Supervisor<T> {
    /// Ends a running request with its terminal result: announced after the request's last
    /// event (`sequence` goes on from it), and kept for its waiters.
    fn end_running(
        &mut self,
        request_id: String,
        sequence: Arc<AtomicU64>,
        running: Running<T>,
        result: GenerationResult,
    ) {
        let emitter = EventEmitter::continuing(
            request_id,
            self.sink.clone(),
            self.engine.config().coalescing,
            sequence,
        );
        announce_finished(emitter, result.clone());
        self.record_result(
            result,
            running.waiters,
            running.ticket,
            running.cancelled_by,
        );
    }
}

impl<T: Ticket> Handler<SlotReleased> for Supervisor<T> {
    type Result = ();

    fn handle(&mut self, msg: SlotReleased, ctx: &mut Context<Self>) {
        self.busy = self.busy.checked_sub(1).unwrap_or_else(|| {
            tracing::error!(message = "a slot was released twice", request_id = %msg.request_id);
            0
        });
        self.slots.free(&msg.request_id);
        // A slot that ends without a result (its actor stopped first) still ends its request.
        if let Some(Record::Running(_)) = self.records.get(&msg.request_id)
            && let Some(Record::Running(running)) = self.records.remove(&msg.request_id)
        {
            let running = *running;
            let detail = "the slot stopped before the generation ended".to_string();
            let result = lost_result(&running, &running.context, detail);
            let sequence = running.sequence.clone();
            self.end_running(msg.request_id.clone(), sequence, running, result);
        }
        self.start_waiting(ctx);
        self.publish_capacity();
    }
}

impl<T: Ticket> Handler<Release<T>> for Supervisor<T> {
    type Result = Option<Released<T>>;

    fn handle(&mut self, msg: Release<T>, _: &mut Context<Self>) -> Self::Result {
        if !matches!(self.records.get(&msg.request_id), Some(Record::Finished(_))) {
            return None;
        }
        let Some(Record::Finished(ended)) = self.records.remove(&msg.request_id) else {
            return None;
        };
        self.finished_order.retain(|id| id != &msg.request_id);
        Some(Released {
            ticket: ended.ticket,
            cancelled_by: ended.cancelled_by,
        })
    }
}
