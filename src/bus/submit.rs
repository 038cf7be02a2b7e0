//! `gen.submit.<pool>`, `gen.submit.<pool>.<tenant>` and a worker's own
//! `gen.worker.<worker_id>.submit[.<tenant>]`: interactive requests, started now in a free slot
//! or refused. The tenant is the subject's (the default tenant on a subject without one): NATS
//! permissions pin it to the caller's user, so no caller can submit as another.
//!
//! A worker is subscribed to its pool's submit subjects (in the pool's queue group) and to its
//! own for as long as it runs, full or not: leaving and joining a subject with every change of
//! capacity would lose a submit already on its way (async-nats 0.51 forgets a subscription's
//! sid as soon as its UNSUB is written and drops what arrives for it afterwards). A pool submit
//! that reaches a worker with no free slot (or whose slots turn out taken or reserved) is
//! forwarded, with the caller's reply subject, to the own subject of a peer whose last
//! heartbeat showed a free slot; that peer answers the caller. With no such peer the caller is
//! answered NO_SLOT_AVAILABLE, without the request being decoded.
//!
//! Its own subject is where a submitter sends a request whose affinity key this worker served
//! last (see [`super::affinity`]), and where peers forward. A submit there is started or
//! refused NO_SLOT_AVAILABLE at once, never forwarded again: a submitter then goes to the pool
//! straight away.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;

use super::admission::{self, Claim};
use super::affinity::preference_of;
use super::shared::{Shared, spawn_handler};
use super::store::LiveRecord;
use super::tenant_limit::Refusal;
use crate::actors::{Accepted, Capacity, Placement, Scheduling};
use crate::client::reply::{decode, guarded, header, respond};
use crate::protocol::{
    DEFAULT_TENANT, ErrorCode, GenerationRequest, RequestState, WireError,
    request::FORWARDED_BY_HEADER,
};

/// Which submit subjects a worker serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// `gen.submit.<pool>` and `gen.submit.<pool>.<tenant>`, in the pool's queue group: one
    /// worker of the pool answers.
    Pool,
    /// `gen.worker.<worker_id>.submit` and `gen.worker.<worker_id>.submit.<tenant>`: this
    /// worker's own.
    Own,
}

/// A route's submit subjects: the default tenant's and every tenant's.
pub(super) struct Submits {
    v1: async_nats::Subscriber,
    tenants: async_nats::Subscriber,
}

impl Submits {
    async fn next(&mut self) -> Option<async_nats::Message> {
        tokio::select! {
            Some(message) = self.v1.next() => Some(message),
            Some(message) = self.tenants.next() => Some(message),
            else => None,
        }
    }

    async fn drain(&mut self) {
        let _ = self.v1.drain().await;
        let _ = self.tenants.drain().await;
    }
}

impl Route {
    /// Subscribes to the route's subjects.
    pub(super) async fn subscribe(
        self,
        shared: &Shared,
    ) -> Result<Submits, async_nats::SubscribeError> {
        let pool = &shared.settings.worker.pool;
        let client = &shared.client;
        let subjects = &shared.subjects;
        match self {
            Route::Pool => {
                let group = subjects.submit_group(pool);
                let v1 = client
                    .queue_subscribe(subjects.submit(pool), group.clone())
                    .await?;
                let tenants = client
                    .queue_subscribe(subjects.tenant_submits(pool), group)
                    .await?;
                Ok(Submits { v1, tenants })
            }
            Route::Own => {
                let worker = &shared.worker_id;
                let v1 = client
                    .subscribe(subjects.worker_submit(worker, None))
                    .await?;
                let tenants = client
                    .subscribe(subjects.worker_tenant_submits(worker))
                    .await?;
                Ok(Submits { v1, tenants })
            }
        }
    }

    /// The tenant a submit on this route names (`None`: not a valid tenant token).
    fn tenant<'s>(self, shared: &Shared, subject: &'s str) -> Option<&'s str> {
        match self {
            Route::Pool => shared
                .subjects
                .submit_tenant(&shared.settings.worker.pool, subject),
            Route::Own => shared
                .subjects
                .worker_submit_tenant(&shared.worker_id, subject),
        }
    }
}

/// Serves the route's submit subjects for as long as the worker runs. When it stops (its
/// capacity's sender is gone) the subscription is drained, and what already reached the client
/// is answered.
pub(super) async fn serve_submits(
    shared: Arc<Shared>,
    mut capacity: watch::Receiver<Capacity>,
    mut first: Option<Submits>,
    route: Route,
) {
    loop {
        let subscribed = match first.take() {
            Some(sub) => Ok(sub),
            None => route.subscribe(&shared).await,
        };
        let mut sub = match subscribed {
            Ok(sub) => sub,
            Err(error) => {
                tracing::error!(message = "cannot subscribe to submits; retrying", %error, ?route);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            tokio::select! {
                message = sub.next() => match message {
                    Some(message) => spawn_handler(&shared, handle_submit(shared.clone(), message, route)).await,
                    None => break,
                },
                changed = capacity.changed() => {
                    if changed.is_err() {
                        sub.drain().await;
                        while let Some(message) = sub.next().await {
                            spawn_handler(&shared, handle_submit(shared.clone(), message, route)).await;
                        }
                        return;
                    }
                }
            }
        }
    }
}

async fn handle_submit(shared: Arc<Shared>, message: async_nats::Message, route: Route) {
    let forwarding = route == Route::Pool && !is_forwarded(&message);
    if forwarding && shared.capacity.borrow().free() == 0 {
        // Full (or draining): not even decoded here.
        let refused = match forward(&shared, &message).await {
            Ok(()) => return,
            Err(refused) => refused,
        };
        respond::<Accepted>(&shared.client, &message, Err(refused)).await;
        return;
    }
    let reply = guarded(submit(&shared, &message, route)).await;
    if forwarding
        && let Err(error) = &reply
        && error.code == ErrorCode::NoSlotAvailable
        && forward(&shared, &message).await.is_ok()
    {
        // The last free slot went to another request meanwhile, or the free ones are reserved
        // for higher bands: a peer may have one.
        return;
    }
    respond(&shared.client, &message, reply).await;
}

/// Whether a peer forwarded this submit here.
fn is_forwarded(message: &async_nats::Message) -> bool {
    header(message, FORWARDED_BY_HEADER).is_some()
}

/// Sends a pool submit this worker cannot start to a peer whose last heartbeat showed a free
/// slot, on that peer's own subject for the submit's tenant, with the caller's reply subject:
/// the peer answers the caller (an acceptance, or NO_SLOT_AVAILABLE if its slots went
/// meanwhile; "no responders" if it is gone). The refusal to send when no peer had one.
async fn forward(shared: &Shared, message: &async_nats::Message) -> Result<(), WireError> {
    let no_slot = || {
        let this = if shared.capacity.borrow().paused {
            "takes no work until its backend answers"
        } else {
            "is full"
        };
        WireError::new(
            ErrorCode::NoSlotAvailable,
            format!(
                "no free slot: worker {} {this} and no other worker of pool {} had a free slot at its last heartbeat",
                shared.worker_id, shared.settings.worker.pool
            ),
        )
    };
    let (Some(reply), Some(tenant)) = (
        message.reply.clone(),
        Route::Pool.tenant(shared, &message.subject),
    ) else {
        return Err(no_slot());
    };
    let Some(peer) = shared.peer_slots.take() else {
        return Err(no_slot());
    };
    let tenant = (tenant != DEFAULT_TENANT).then_some(tenant);
    let mut headers = message.headers.clone().unwrap_or_default();
    headers.insert(FORWARDED_BY_HEADER, shared.worker_id.as_str());
    let subject = shared.subjects.worker_submit(&peer, tenant);
    match shared
        .client
        .publish_with_reply_and_headers(subject, reply, headers, message.payload.clone())
        .await
    {
        Ok(()) => {
            shared.metrics.submits_forwarded.inc();
            tracing::debug!(message = "a submit forwarded to a peer with a free slot", peer = %peer);
            Ok(())
        }
        Err(error) => {
            tracing::warn!(message = "cannot forward a submit", %error);
            Err(no_slot())
        }
    }
}

/// Checks, claims the id fleet-wide (the request's one write before it runs), and starts it.
async fn submit(
    shared: &Shared,
    message: &async_nats::Message,
    route: Route,
) -> Result<Accepted, WireError> {
    let request: GenerationRequest = decode(message, shared.settings.limits.max_request_bytes)?;
    let tenant = route
        .tenant(shared, &message.subject)
        .filter(|t| *t != DEFAULT_TENANT)
        .map(str::to_string);
    // Checked with the id the caller gave; on the bus a tenant's id is `<tenant>.<id>`.
    let request = admission::check(shared, request)?.qualified(tenant.as_deref());
    let band = request.request().band();
    // A continuation offered by the worker that took its decision's answer carries its chain,
    // as on the queue, believed only as far as its decision's record vouches for it (see
    // `super::decisions`).
    let lineage = admission::vouched_chain(shared, message, request.request_id()).await?;
    let live = LiveRecord {
        request_id: request.request_id().to_string(),
        state: RequestState::Running,
        worker_id: shared.worker_id.clone(),
        attempt: 1,
        durable: false,
        priority: request.request().priority,
        tenant: tenant.clone(),
        handed_back: 0,
        queue_seq: None,
    };
    let tenant_name = crate::schedule::tenant_name(tenant.as_deref());
    let permit = shared
        .tenant_counts
        .take_one(tenant_name, Refusal::Read, shared.fencing.stale())
        .await?;
    let revision = shared.stores.claim(&live).await?;
    // A pool submit a peer forwarded here is one of the pool's still.
    let pooled = route == Route::Pool || is_forwarded(message);
    let placement = Placement {
        lineage,
        scheduling: Scheduling {
            band,
            tenant,
            ..Scheduling::default()
        },
        ..Placement::default()
    };
    let request_id = live.request_id.clone();
    let claim = Claim {
        live,
        revision,
        permit,
    };
    let preference = if pooled {
        preference_of(message.headers.as_ref())
    } else {
        crate::schedule::Preference::direct(&shared.worker_id)
    };
    let admitted = admission::admit(shared, request, placement, claim, None, preference).await;
    if admitted.is_err() {
        // Refused after all (the last slot went to another request meanwhile, or the worker
        // drains): the id is free again for the caller's next try.
        shared.stores.unclaim(&request_id, revision).await;
    }
    admitted
}
