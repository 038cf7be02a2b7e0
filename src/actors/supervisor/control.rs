//! Stopping requests: a caller's cancel, the fleet's fence, the pause while the backend does
//! not answer, and the drain.

use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use super::Supervisor;
use super::records::Record;

use crate::actors::messages::{Cancel, Canceller, Drain, DrainReport, Fence, Pause, Ticket};
use crate::protocol::{CancelReply, ErrorCode, RequestState, WireError};
use crate::settings::DrainHandOff;

impl<T: Ticket> Supervisor<T> {
    fn cancel(
        &mut self,
        request_id: String,
        by: Canceller,
    ) -> ResponseFuture<Result<CancelReply, WireError>> {
        let immediate =
            |r: Result<CancelReply, WireError>| -> ResponseFuture<Result<CancelReply, WireError>> {
                Box::pin(async move { r })
            };
        if self.end_waiting(&request_id, by, "cancelled while waiting for a slot") {
            self.publish_capacity();
            return immediate(Ok(CancelReply {
                request_id,
                state: RequestState::Cancelled,
                decision_id: None,
            }));
        }
        match self.records.get_mut(&request_id) {
            None | Some(Record::Waiting(_)) => immediate(Err(WireError::new(
                ErrorCode::NotFound,
                format!("request {request_id} is not known to this worker"),
            ))),
            Some(Record::Finished(ended)) => immediate(Err(WireError::new(
                ErrorCode::AlreadyFinished,
                format!("request {request_id} already ended"),
            )
            .with_detail(serde_json::json!({"state": ended.result.state})))),
            Some(Record::Running(running)) => {
                running.cancel.cancel();
                running.cancelled_by.get_or_insert(by);
                let (tx, rx) = oneshot::channel();
                running.waiters.push(tx);
                let wait = self.config.cancel_wait;
                Box::pin(async move {
                    let state = match tokio::time::timeout(wait, rx).await {
                        Ok(Ok(state)) => state,
                        _ => RequestState::Running,
                    };
                    Ok(CancelReply {
                        request_id,
                        state,
                        decision_id: None,
                    })
                })
            }
        }
    }
}

impl<T: Ticket> Handler<Cancel> for Supervisor<T> {
    type Result = ResponseFuture<Result<CancelReply, WireError>>;

    fn handle(&mut self, msg: Cancel, _: &mut Context<Self>) -> Self::Result {
        self.cancel(msg.request_id, Canceller::Caller)
    }
}

impl<T: Ticket> Handler<Pause> for Supervisor<T> {
    type Result = ();

    fn handle(&mut self, Pause(paused): Pause, ctx: &mut Context<Self>) {
        self.paused = paused;
        if paused {
            // What waits here for a slot would wait for the backend: it goes back to the
            // queue for a worker whose backend answers, as in a drain.
            for request_id in self.waiting.clone() {
                self.end_waiting(
                    &request_id,
                    Canceller::Drain,
                    "the worker's backend stopped answering before the request started",
                );
            }
        } else {
            self.start_waiting(ctx);
        }
        self.publish_capacity();
    }
}

impl<T: Ticket> Handler<Fence> for Supervisor<T> {
    type Result = MessageResult<Fence>;

    fn handle(&mut self, Fence(ids): Fence, _: &mut Context<Self>) -> Self::Result {
        let mut fenced = Vec::new();
        for request_id in ids {
            if self.end_waiting(
                &request_id,
                Canceller::Fenced,
                "the fleet declared this worker lost before the request started",
            ) {
                fenced.push(request_id);
            } else if let Some(Record::Running(running)) = self.records.get_mut(&request_id) {
                running.cancel.cancel();
                running.cancelled_by.get_or_insert(Canceller::Fenced);
                fenced.push(request_id);
            }
        }
        MessageResult(fenced)
    }
}

impl<T: Ticket> Handler<Drain> for Supervisor<T> {
    type Result = ResponseActFuture<Self, DrainReport>;

    fn handle(&mut self, msg: Drain, _: &mut Context<Self>) -> Self::Result {
        self.draining = true;
        // What waits for a slot will not get one here: it ends now, handed back by the drain.
        let mut handed_back = Vec::new();
        for request_id in self.waiting.clone() {
            // One that goes on from a checkpoint (taken up here, not started yet) is handed
            // off again from that same checkpoint, where the drain hands off at all.
            let resumed = matches!(
                self.records.get(&request_id),
                Some(Record::Waiting(waiting)) if waiting.placement.continuity.from.is_some()
            );
            let (by, detail) = if resumed && self.config.drain_handoff != DrainHandOff::Off {
                (Canceller::HandOff, crate::engine::HANDED_OFF)
            } else {
                (Canceller::Drain, "the worker drained before it started")
            };
            if self.end_waiting(&request_id, by, detail) && by == Canceller::Drain {
                handed_back.push((request_id, true));
            }
        }
        self.publish_capacity();
        let hand_off = self.config.drain_handoff;
        let deadline = match hand_off {
            // Handed off right away: nothing waits for the deadline.
            DrainHandOff::AtOnce => Duration::ZERO,
            DrainHandOff::Deadline | DrainHandOff::Off => msg.deadline,
        };
        let mut capacity = self.capacity.subscribe();
        let cancel_wait = self.config.cancel_wait;
        let idle = async move {
            tokio::time::timeout(deadline, capacity.wait_for(|c| c.busy == 0))
                .await
                .is_ok()
        };
        Box::pin(
            idle.into_actor(self)
                .then(move |all_done, act, _| {
                    // What still runs hands off: each writes a checkpoint at its next chance
                    // and stops, for a live peer to go on from it.
                    let handing_off = !all_done && hand_off != DrainHandOff::Off;
                    if handing_off {
                        let mut asked = 0;
                        for record in act.records.values_mut() {
                            if let Record::Running(running) = record {
                                running.context.continuity.hand_off.cancel();
                                running.cancelled_by.get_or_insert(Canceller::HandOff);
                                asked += 1;
                            }
                        }
                        tracing::info!(
                            message = "draining: handing off the requests still running",
                            count = asked
                        );
                    }
                    let mut capacity = act.capacity.subscribe();
                    async move {
                        if handing_off {
                            let _ = tokio::time::timeout(
                                cancel_wait,
                                capacity.wait_for(|c| c.busy == 0),
                            )
                            .await;
                        }
                        all_done
                    }
                    .into_actor(act)
                })
                .then(move |all_done, act, _| {
                    let mut report = DrainReport {
                        cancelled: handed_back,
                    };
                    if !all_done {
                        // Whatever could not hand off (no checkpoint could be written, or it
                        // was in a long tool call) is cancelled.
                        for (id, record) in &mut act.records {
                            if let Record::Running(running) = record {
                                running.cancel.cancel();
                                if matches!(running.cancelled_by, None | Some(Canceller::HandOff)) {
                                    running.cancelled_by = Some(Canceller::Drain);
                                }
                                report.cancelled.push((id.clone(), running.durable));
                            }
                        }
                        if !report.cancelled.is_empty() {
                            tracing::info!(
                                message = "drain deadline passed; cancelled the remaining requests",
                                count = report.cancelled.len()
                            );
                        }
                    }
                    let mut capacity = act.capacity.subscribe();
                    async move {
                        let _ =
                            tokio::time::timeout(cancel_wait, capacity.wait_for(|c| c.busy == 0))
                                .await;
                        report
                    }
                    .into_actor(act)
                }),
        )
    }
}
