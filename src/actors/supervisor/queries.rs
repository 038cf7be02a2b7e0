//! What the Supervisor tells without changing anything (but a result read with `release`):
//! a request's status, its result, the requests held with their tickets, the slots per tenant,
//! the counts.

use actix::prelude::*;

use super::Supervisor;
use super::records::Record;
use crate::actors::messages::{
    GetResult, Held, HeldRequest, Stats, Status, TenantSlots, Ticket, TicketOf,
};
use crate::protocol::{
    DEFAULT_TENANT, ErrorCode, GenerationResult, Priority, RequestState, StatsReply, StatusReply,
    WireError,
};

impl<T: Ticket> Handler<Status> for Supervisor<T> {
    type Result = Result<StatusReply, WireError>;

    fn handle(&mut self, msg: Status, _: &mut Context<Self>) -> Self::Result {
        let state = match self.records.get(&msg.request_id) {
            None => {
                return Err(WireError::new(
                    ErrorCode::NotFound,
                    format!("request {} is not known to this worker", msg.request_id),
                ));
            }
            Some(Record::Waiting(waiting)) => (
                RequestState::Queued,
                Some((
                    waiting.placement.scheduling.band,
                    waiting.placement.scheduling.tenant.clone(),
                )),
            ),
            Some(Record::Running(running)) => (
                RequestState::Running,
                Some((running.band, running.tenant.clone())),
            ),
            Some(Record::Finished(ended)) => (ended.result.state, None),
        };
        let (state, placed) = state;
        let (priority, tenant) = match placed {
            Some((band, tenant)) => (
                Some(band),
                Some(tenant.unwrap_or_else(|| DEFAULT_TENANT.to_string())),
            ),
            None => (None, None),
        };
        Ok(StatusReply {
            worker_id: Some(self.config.worker_id.clone()),
            priority,
            tenant,
            ..StatusReply::new(&msg.request_id, state)
        })
    }
}

impl<T: Ticket> Handler<GetResult> for Supervisor<T> {
    type Result = Result<GenerationResult, WireError>;

    fn handle(&mut self, msg: GetResult, _: &mut Context<Self>) -> Self::Result {
        match self.records.get(&msg.request_id) {
            None => Err(WireError::new(
                ErrorCode::NotFound,
                format!("no result for request {}", msg.request_id),
            )),
            Some(Record::Running(_)) | Some(Record::Waiting(_)) => {
                let state = match self.records.get(&msg.request_id) {
                    Some(Record::Waiting(_)) => RequestState::Queued,
                    _ => RequestState::Running,
                };
                Err(WireError::new(
                    ErrorCode::NotReady,
                    format!("request {} is {}", msg.request_id, state.as_str()),
                )
                .with_detail(serde_json::json!({"state": state})))
            }
            Some(Record::Finished(ended)) if !msg.release => Ok(ended.result.clone()),
            Some(Record::Finished(_)) => {
                let Some(Record::Finished(ended)) = self.records.remove(&msg.request_id) else {
                    unreachable!("matched as finished above");
                };
                self.finished_order.retain(|id| id != &msg.request_id);
                Ok(ended.result)
            }
        }
    }
}

impl<T: Ticket> Handler<Held<T>> for Supervisor<T> {
    type Result = MessageResult<Held<T>>;

    fn handle(&mut self, _: Held<T>, _: &mut Context<Self>) -> Self::Result {
        let held = self
            .records
            .iter()
            .map(|(request_id, record)| HeldRequest {
                request_id: request_id.clone(),
                state: match record {
                    Record::Waiting(_) => RequestState::Queued,
                    Record::Running(_) => RequestState::Running,
                    Record::Finished(ended) => ended.result.state,
                },
                ticket: record.ticket().clone(),
            })
            .collect();
        MessageResult(held)
    }
}

impl<T: Ticket> Handler<TicketOf<T>> for Supervisor<T> {
    type Result = Option<T>;

    fn handle(&mut self, msg: TicketOf<T>, _: &mut Context<Self>) -> Self::Result {
        self.records.get(&msg.request_id)?.ticket().clone()
    }
}

impl<T: Ticket> Handler<TenantSlots> for Supervisor<T> {
    type Result = Vec<(String, Priority, u32)>;

    fn handle(&mut self, _: TenantSlots, _: &mut Context<Self>) -> Self::Result {
        self.slots.by_tenant_and_band()
    }
}

impl<T: Ticket> Handler<Stats> for Supervisor<T> {
    type Result = MessageResult<Stats>;

    fn handle(&mut self, _: Stats, _: &mut Context<Self>) -> Self::Result {
        let running = self
            .records
            .values()
            .filter(|r| matches!(r, Record::Running(_)))
            .count();
        MessageResult(StatsReply {
            capacity: *self.capacity.borrow(),
            running,
            retained_results: self.records.len() - running - self.waiting.len(),
        })
    }
}
