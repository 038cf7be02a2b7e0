//! Background responses (`background: true`): the request goes on the durable queue, the
//! caller gets the response at once as `queued`, and polls it (`GET /v1/responses/{id}`) or
//! cancels it (`POST /v1/responses/{id}/cancel`) through any replica.
//!
//! The replica that accepted it follows the request and writes each change to the stored
//! response. A replica that stops (or dies) leaves its requests running: the next poll of such
//! a response asks the fleet where its request stands and settles it from the stored result.
//! Every write is made over the revision read, so the follower, a poll and a cancel never
//! overwrite one another's end: the first end written stays.

use axum::response::{IntoResponse, Response};

use super::store::Stored;
use super::wire::{Outcome, Produced};
use super::{Job, store_unavailable};
use crate::client::{Client, ClientError, Follow, Step};
use crate::gateway::Shared;
use crate::gateway::collect::{Collected, Collector};
use crate::gateway::error::ApiError;
use crate::gateway::mapping::{Mapped, ending_of};
use crate::gateway::run::{enqueue, prepare};
use crate::protocol::result::Usage;
use crate::protocol::{ErrorCode, GenerationResult, Reason, RequestState};

/// How many times a write that lost a race reads again before giving up.
const WRITE_TRIES: usize = 8;

/// Most decision-chain links a poll follows at once.
const MAX_LINKS: usize = 32;

/// Stores the response as `queued`, enqueues its request and answers at once; a task of this
/// replica follows the request to its end.
pub(super) async fn start(job: Job, mut mapped: Mapped) -> Result<Response, Response> {
    let shared = job.shared.clone();
    let chosen = mapped.request.request_id.is_some();
    let not_started = |error| {
        shared
            .metrics
            .answered(&job.tenant, &job.pool, "not_started", false);
        ApiError::not_started(error, shared.settings.gateway.queue_wait_ms).into_response()
    };
    let (client, request_id) = prepare(&shared, &mut mapped, &job.tenant, chosen)
        .await
        .map_err(not_started)?;
    let follow = client
        .follow_chain(&request_id, mapped.follow_decisions)
        .await
        .map_err(|e| not_started(e.into()))?;
    let object = job.object(&Outcome::Open("queued"), Vec::new(), None);
    let record = job.record(object.clone(), None, &request_id);
    shared
        .responses
        .put(&job.tenant, &record)
        .await
        .map_err(|e| store_unavailable(e).into_response())?;
    if let Err(error) = enqueue(&client, &mapped).await {
        let outcome = Outcome::Failed {
            code: "not_started".into(),
            message: error.to_string(),
        };
        settle(&job, &outcome, &Produced::default(), Usage::default()).await;
        return Err(not_started(error.into()));
    }
    shared
        .metrics
        .answered(&job.tenant, &job.pool, "background", false);
    tokio::spawn(follow_to_end(job, follow, client, mapped.follow_decisions));
    Ok(axum::Json(object).into_response())
}

/// Follows a background request through its chain, writing its progress and its end.
async fn follow_to_end(job: Job, mut follow: Follow, client: Client, through_decisions: bool) {
    let mut collector = Collector::new(through_decisions);
    while let Some(step) = follow.next().await {
        match &step {
            Step::Started { .. } => {
                modify(&job.shared, &job.tenant, &job.id, |stored| {
                    (stored.status() == "queued").then(|| {
                        stored.response["status"] = "in_progress".into();
                    })
                })
                .await;
            }
            Step::Continued { request_id } => {
                modify(&job.shared, &job.tenant, &job.id, |stored| {
                    (!stored.is_final()).then(|| stored.request_id = request_id.clone())
                })
                .await;
            }
            _ => {}
        }
        match collector.take(step) {
            Collected::Going => {}
            // The bus went away: a later poll settles the response from the fleet.
            Collected::Abandoned => return,
            Collected::Ended {
                ending,
                message,
                release,
            } => {
                let outcome = Outcome::of(&ending, message);
                settle(&job, &outcome, &collector.produced, collector.usage).await;
                if let Some(request_id) = release {
                    let _ = client.result(&request_id, true).await;
                }
                return;
            }
        }
    }
}

fn outcome_of_result(result: &GenerationResult) -> Outcome {
    let message = result
        .detail
        .clone()
        .unwrap_or_else(|| format!("the request ended {}", result.reason.as_str()));
    Outcome::of(&ending_of(result.reason), message)
}

/// Writes the response's end, unless an end was written first (a cancel, another replica).
async fn settle(job: &Job, outcome: &Outcome, produced: &Produced, usage: Usage) {
    let output = produced.items(&mut super::wire::ItemIds::new());
    let object = job.object(outcome, output, Some(super::wire::usage(usage)));
    let mut conversation = None;
    modify(&job.shared, &job.tenant, &job.id, |stored| {
        if stored.is_final() {
            return None;
        }
        let record = conversation
            .get_or_insert_with(|| job.record(object.clone(), Some(produced), &stored.request_id));
        stored.response = record.response.clone();
        stored.conversation = record.conversation.clone();
        Some(())
    })
    .await;
}

/// Reads the response, applies `change` (which returns `None` to leave it) and writes it over
/// the revision read, again while another write comes between. The response as it stands.
async fn modify(
    shared: &Shared,
    tenant: &str,
    id: &str,
    mut change: impl FnMut(&mut Stored) -> Option<()>,
) -> Option<Stored> {
    for _ in 0..WRITE_TRIES {
        let read = match shared.responses.get(tenant, id).await {
            Ok(Some(read)) => read,
            Ok(None) => return None,
            Err(error) => {
                tracing::warn!(message = "a background response cannot be read", %error, response_id = %id);
                return None;
            }
        };
        let mut stored = read.stored;
        if change(&mut stored).is_none() {
            return Some(stored);
        }
        match shared
            .responses
            .update(tenant, &stored, read.revision)
            .await
        {
            Ok(true) => return Some(stored),
            Ok(false) => continue,
            Err(error) => {
                tracing::warn!(message = "a background response was not updated", %error, response_id = %id);
                return Some(stored);
            }
        }
    }
    None
}

/// The tenant's response of this id as it stands: a background one that has not ended is
/// first settled from the fleet (its request ended while no replica followed it).
pub(super) async fn current(
    shared: &Shared,
    tenant: &str,
    id: &str,
) -> Result<Option<Stored>, ApiError> {
    let read = match shared.responses.get(tenant, id).await {
        Ok(Some(read)) => read,
        Ok(None) => return Ok(None),
        Err(error) => return Err(store_unavailable(error)),
    };
    if read.stored.is_final() || !read.stored.background {
        return Ok(Some(read.stored));
    }
    Ok(Some(
        settle_from_fleet(shared, tenant, id, read.stored).await,
    ))
}

/// Asks the fleet where a background response's request stands, and writes what it learnt.
async fn settle_from_fleet(shared: &Shared, tenant: &str, id: &str, stored: Stored) -> Stored {
    let client = &shared.client;
    let mut request_id = stored.request_id.clone();
    for _ in 0..MAX_LINKS {
        let status = match client.status(&request_id).await {
            Ok(status) => status,
            Err(_) => return stored,
        };
        if let Some(next) = status.continuation_request_id {
            request_id = next;
            continue;
        }
        if !status.state.is_terminal() {
            let running = status.state == RequestState::Running;
            let moved = request_id != stored.request_id;
            if !running && !moved {
                return stored;
            }
            let request_id = request_id.clone();
            return modify(shared, tenant, id, |stored| {
                if stored.is_final() {
                    return None;
                }
                stored.request_id = request_id.clone();
                if running {
                    stored.response["status"] = "in_progress".into();
                }
                Some(())
            })
            .await
            .unwrap_or(stored);
        }
        let result = match client.result(&request_id, false).await {
            Ok(result) => result,
            // Released: whoever released it wrote the end first.
            Err(ClientError::Wire(error)) if error.code == ErrorCode::NotFound => {
                return match shared.responses.get(tenant, id).await {
                    Ok(Some(read)) => read.stored,
                    _ => stored,
                };
            }
            Err(_) => return stored,
        };
        if result.reason == Reason::DecisionRequested {
            // Its decision waits for an answer: still in progress.
            return stored;
        }
        let produced = Produced {
            reasoning: result.reasoning.clone(),
            text: result.output.clone(),
            tool_calls: result.tool_calls.clone(),
        };
        let outcome = outcome_of_result(&result);
        let output = produced.items(&mut super::wire::ItemIds::new());
        let settled = modify(shared, tenant, id, |stored| {
            if stored.is_final() {
                return None;
            }
            super::wire::settle(
                &mut stored.response,
                &outcome,
                output.clone(),
                Some(super::wire::usage(result.usage)),
            );
            if let Some(message) = produced.message() {
                stored.conversation.push(message);
            }
            stored.request_id = request_id.clone();
            Some(())
        })
        .await
        .unwrap_or(stored);
        let _ = client.result(&request_id, true).await;
        return settled;
    }
    stored
}

/// Cancels the tenant's response of this id if it still runs; the response as it stands
/// (`None`: there is none).
pub(super) async fn cancel(
    shared: &Shared,
    tenant: &str,
    id: &str,
    why: &str,
) -> Result<Option<Stored>, ApiError> {
    let Some(stored) = current(shared, tenant, id).await? else {
        return Ok(None);
    };
    if stored.is_final() {
        return Ok(Some(stored));
    }
    match shared.client.cancel_because(&stored.request_id, why).await {
        Ok(_) => {}
        // It ended meanwhile, or is not known yet: the write below decides.
        Err(error) if error.code().is_some() => {}
        Err(error) => {
            return Err(ApiError::new(
                503,
                "api_connection_error",
                "bus_unavailable",
                format!("the fleet cannot be reached: {error}"),
            ));
        }
    }
    let cancelled = modify(shared, tenant, id, |stored| {
        if stored.is_final() {
            return None;
        }
        stored.response["status"] = "cancelled".into();
        Some(())
    })
    .await;
    Ok(cancelled.or(Some(stored)))
}
