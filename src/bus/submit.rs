//! `gen.submit.<pool>`, `gen.submit.<pool>.<tenant>` and a worker's own
//! `gen.worker.<worker_id>.submit[.<tenant>]`: interactive requests, started now in a free slot
//! or refused. The tenant is the subject's (the default tenant on a subject without one): NATS
//! permissions pin it to the caller's user, so no caller can submit as another.
//!
//! A worker is subscribed to its pool's submit subject only while it has a free slot, so a
//! submit that finds no responders means no worker of the pool has one. Leaving the queue
//! group drains the subscription, but async-nats 0.51 forgets the subscription's sid on its
//! next poll after writing the UNSUB (it does not wait for the drain's PONG) and drops what
//! arrives for an unknown sid: a submit the server routed here just before it saw the UNSUB
//! is lost, its caller waiting out its timeout (docs/protocol.md, Submit, says so).
//!
//! Its own subject is where a submitter sends a request whose affinity key this worker served
//! last (see [`super::affinity`]). The worker stays subscribed to it and answers
//! NO_SLOT_AVAILABLE at once when it has no free slot: a submitter then goes to the pool
//! straight away. Leaving and joining it with every change of capacity would double the
//! subscription churn, and async-nats drops a subscription's sid as soon as its UNSUB is
//! written, so a submit already on its way to a subscription being left is lost, its caller
//! waiting out its timeout.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;

use super::admission::{self, Claim};
use super::affinity::Preference;
use super::reply::{decode, guarded, respond};
use super::shared::{Shared, spawn_handler};
use super::store::LiveRecord;
use crate::actors::{Accepted, Capacity, Placement};
use crate::protocol::{DEFAULT_TENANT, GenerationRequest, RequestState, WireError};

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

/// Serves the route's submit subjects: the pool's while a slot is free, the worker's own
/// always.
pub(super) async fn serve_submits(
    shared: Arc<Shared>,
    mut capacity: watch::Receiver<Capacity>,
    mut first: Option<Submits>,
    route: Route,
) {
    if route == Route::Own {
        return serve_own(shared, first).await;
    }
    loop {
        if capacity.wait_for(|c| c.free() > 0).await.is_err() {
            return;
        }
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
                    if changed.is_err() || capacity.borrow().free() == 0 {
                        // Drain, not unsubscribe: what already reached the client is answered
                        // (a submit still on its way when the sid is forgotten is not; see the
                        // module's doc).
                        sub.drain().await;
                        while let Some(message) = sub.next().await {
                            spawn_handler(&shared, handle_submit(shared.clone(), message, route)).await;
                        }
                        break;
                    }
                }
            }
        }
    }
}

/// The worker's own submit subject, for as long as the worker runs.
async fn serve_own(shared: Arc<Shared>, mut first: Option<Submits>) {
    loop {
        let mut sub = match first.take() {
            Some(sub) => sub,
            None => match Route::Own.subscribe(&shared).await {
                Ok(sub) => sub,
                Err(error) => {
                    tracing::error!(message = "cannot subscribe to own submits; retrying", %error);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
        };
        while let Some(message) = sub.next().await {
            spawn_handler(&shared, handle_submit(shared.clone(), message, Route::Own)).await;
        }
    }
}

async fn handle_submit(shared: Arc<Shared>, message: async_nats::Message, route: Route) {
    let reply = guarded(submit(&shared, &message, route)).await;
    respond(&shared.client, &message, reply).await;
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
    let request = admission::check(shared, request)?;
    let band = request.request().band();
    let live = LiveRecord {
        request_id: request.request_id().to_string(),
        state: RequestState::Running,
        worker_id: shared.worker_id.clone(),
        attempt: 1,
        durable: false,
        priority: request.request().priority,
        tenant: tenant.clone(),
        handed_back: 0,
    };
    let revision = shared.stores.claim(&live).await?;
    let placement = match route {
        // A continuation offered by the worker that took its decision's answer carries its
        // chain, as on the queue (see `super::decisions`).
        Route::Own => admission::chain_placement(message),
        Route::Pool => Placement {
            traceparent: super::tools::traceparent_of(message),
            ..Placement::default()
        },
    };
    let placement = Placement {
        band,
        tenant,
        ..placement
    };
    let request_id = live.request_id.clone();
    let claim = Claim { live, revision };
    let preference = match route {
        Route::Own => Preference::direct(&shared.worker_id),
        Route::Pool => Preference::from_headers(message.headers.as_ref()),
    };
    let admitted = admission::admit(shared, request, placement, claim, None, preference).await;
    if admitted.is_err() {
        // Refused after all (the last slot went to another request meanwhile, or the worker
        // drains): the id is free again for the caller's next try.
        shared.stores.unclaim(&request_id, revision).await;
    }
    admitted
}
