//! `gen.submit.<pool>`, `gen.submit.<pool>.<tenant>` and a worker's own
//! `gen.worker.<worker_id>.submit[.<tenant>]`: interactive requests, started now in a free slot
//! or refused. The tenant is the subject's (the default tenant on a subject without one): NATS
//! permissions pin it to the caller's user, so no caller can submit as another.
//!
//! A worker is subscribed to its pool's submit subjects (in the pool's queue group) and to its
//! own for as long as it runs, full or not: leaving and joining a subject with every change of
//! capacity would lose a submit already on its way (async-nats 0.51 forgets a subscription's
//! sid as soon as its UNSUB is written and drops what arrives for it afterwards).
//!
//! A keyed pool submit that nobody placed goes to its key's worker by the fleet's rule
//! ([`crate::schedule::choose`]); a pool submit that reaches a worker with no free slot (or
//! whose slots turn out taken or reserved) goes to the own subject of a peer whose last
//! heartbeat showed a free slot. Either is sent on as this worker's own request, and the
//! peer's answer relayed to the caller, so a peer gone since its last heartbeat is found out
//! here and the caller still gets an answer. A submit is sent on at most twice. With no peer
//! to take it the caller is answered NO_SLOT_AVAILABLE.
//!
//! Its own subject is where a submitter that placed a keyed request itself sends it, and where
//! peers send submits on. A submitter's submit there is started or refused NO_SLOT_AVAILABLE
//! at once, never sent on: a submitter then goes to the pool straight away.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;

use super::admission::{self, Claim};
use super::affinity::preference_of;
use super::shared::{Shared, spawn_handler, this_load};
use super::store::LiveRecord;
use super::tenant_limit::Refusal;
use crate::actors::{Accepted, Capacity, Placement, Scheduling};
use crate::client::reply::{decode, guarded, header, respond};
use crate::protocol::request::{
    AFFINITY_FALLBACK_HEADER, FORWARDED_BY_HEADER, PREFERRED_WORKER_HEADER,
};
use crate::protocol::{DEFAULT_TENANT, ErrorCode, GenerationRequest, RequestState, WireError};
use crate::schedule::{Choice, PassedOver, Preference};

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

/// How many times one submit may be forwarded between workers: once to its key's worker, once
/// more to a peer with a free slot.
const MAX_FORWARDS: usize = 2;

async fn handle_submit(shared: Arc<Shared>, message: async_nats::Message, route: Route) {
    let hops = forwarders(&message);
    // A pool submit, or one a peer forwarded here, is the pool's to place; a submit sent to
    // this worker's own subject by its submitter is started here or refused.
    let pooled = route == Route::Pool || hops > 0;
    let forwarding = pooled && hops < MAX_FORWARDS;
    // A keyed pool submit that no worker placed yet goes to its key's worker, unless its
    // submitter already tried that worker (it says which, and why it fell back).
    let to_place =
        route == Route::Pool && hops == 0 && header(&message, AFFINITY_FALLBACK_HEADER).is_none();
    let mut told = None;
    let mut decoded = None;
    if to_place {
        match decode::<GenerationRequest>(&message, shared.settings.limits.max_request_bytes) {
            Ok(request) => {
                if let Some(key) = request.affinity_key.clone() {
                    match place(&shared, &key) {
                        Placed::Here(preference) => told = Some(preference),
                        Placed::There(choice) => {
                            if forward_to(&shared, &message, &choice).await.is_ok() {
                                return;
                            }
                            // Gone since its last heartbeat: started here, or sent on for a
                            // free slot, as its key's worker had none.
                            told = Some(Preference {
                                worker: Some(choice.key_worker),
                                fallback: Some(PassedOver::Busy.as_str().to_string()),
                            });
                        }
                        Placed::Nowhere(key_worker) => {
                            told = key_worker.map(|worker| Preference {
                                worker: Some(worker),
                                fallback: Some(PassedOver::Busy.as_str().to_string()),
                            });
                        }
                    }
                }
                decoded = Some(request);
            }
            Err(error) => {
                respond::<Accepted>(&shared.client, &message, Err(error)).await;
                return;
            }
        }
    }
    let preempting = shared.settings.preempts_by_band() || shared.settings.preempts_by_share();
    if forwarding && shared.capacity.borrow().free() == 0 {
        // Full (or draining): not decoded here, but to read its key.
        let refused = match forward(&shared, &message, told.as_ref()).await {
            Ok(()) => return,
            Err(refused) => refused,
        };
        if !preempting || shared.capacity.borrow().draining {
            answer(&shared, &message, Err(refused)).await;
            return;
        }
        // No peer has a free slot: a request of a higher band may take one of a lower band's
        // here (worker.preempt), or one of a tenant under its fair share one of a tenant far
        // over it (worker.preempt_fair_share).
    }
    let reply = guarded(submit(&shared, &message, route, decoded, told.clone())).await;
    if forwarding
        && let Err(error) = &reply
        && error.code == ErrorCode::NoSlotAvailable
        && forward(&shared, &message, told.as_ref()).await.is_ok()
    {
        // The last free slot went to another request meanwhile, or the free ones are reserved
        // for higher bands: a peer may have one.
        return;
    }
    answer(&shared, &message, reply).await;
}

/// Answers a submit, counting a refusal for want of a slot. A refusal is counted once, by the
/// worker that answers it: a worker that forwarded the submit relays its peer's answer as it
/// came (see [`relay`]), uncounted.
async fn answer(
    shared: &Shared,
    message: &async_nats::Message,
    reply: Result<Accepted, WireError>,
) {
    if let Err(error) = &reply
        && error.code == ErrorCode::NoSlotAvailable
    {
        shared.metrics.submits_refused.inc();
    }
    respond(&shared.client, message, reply).await;
}

/// Where the fleet's rule puts a keyed request, as this worker sees the pool.
enum Placed {
    /// This worker is the one: the record's preference.
    Here(Preference),
    /// A peer is.
    There(Choice),
    /// No worker has a free slot: capacity decides. The key's worker, when there is one.
    Nowhere(Option<String>),
}

/// Ranks the pool's live workers for `key` (this one with its own exact load, the peers as
/// their last heartbeats tell) and says where the request goes.
fn place(shared: &Shared, key: &str) -> Placed {
    let this = this_load(shared);
    match shared
        .peer_slots
        .place(key, this, shared.settings.placement.load_factor)
    {
        Some(choice) if choice.worker == shared.worker_id => Placed::Here(Preference {
            worker: Some(choice.key_worker),
            fallback: choice.passed_over.map(|p| p.as_str().to_string()),
        }),
        Some(choice) => Placed::There(choice),
        None => Placed::Nowhere(shared.peer_slots.key_worker(key, this_load(shared))),
    }
}

/// How many workers forwarded this submit.
fn forwarders(message: &async_nats::Message) -> usize {
    message
        .headers
        .as_ref()
        .map_or(0, |h| h.get_all(FORWARDED_BY_HEADER).count())
}

/// The tenant's own submit subject of `peer`, for a pool submit, and the submit's headers with
/// this worker added as a forwarder. `None` when the submit names no tenant this worker's pool
/// serves.
fn forwarded(
    shared: &Shared,
    message: &async_nats::Message,
    peer: &str,
) -> Option<(String, async_nats::HeaderMap)> {
    let tenant = match forwarders(message) {
        0 => Route::Pool.tenant(shared, &message.subject),
        _ => Route::Own.tenant(shared, &message.subject),
    }?;
    let tenant = (tenant != DEFAULT_TENANT).then_some(tenant);
    let mut headers = message.headers.clone().unwrap_or_default();
    headers.append(FORWARDED_BY_HEADER, shared.worker_id.as_str());
    Some((shared.subjects.worker_submit(peer, tenant), headers))
}

/// Sends a keyed pool submit to the worker its key's rank chose, telling it the key's worker
/// and why it is not that one. That worker answers, or forwards it once more for a free slot
/// if its own went meanwhile; the answer is relayed to the caller. `Err` when that worker is
/// gone (nothing was sent on, the submit is this worker's to answer).
async fn forward_to(
    shared: &Shared,
    message: &async_nats::Message,
    choice: &Choice,
) -> Result<(), ()> {
    let (subject, mut headers) = forwarded(shared, message, &choice.worker).ok_or(())?;
    headers.insert(PREFERRED_WORKER_HEADER, choice.key_worker.as_str());
    if let Some(passed_over) = choice.passed_over {
        headers.insert(AFFINITY_FALLBACK_HEADER, passed_over.as_str());
    }
    relay(shared, message, &choice.worker, subject, headers).await?;
    shared.metrics.submits_placed.inc();
    Ok(())
}

/// How long a worker waits for the answer of the peer it forwarded a submit to.
const FORWARD_WAIT: Duration = Duration::from_secs(10);

/// Sends a submit on to `peer` as a request of this worker's and relays the peer's answer to
/// the caller: so a peer that is gone since its last heartbeat ("no responders", which the
/// caller would never hear of a message forwarded with its reply subject) costs the caller
/// nothing but this worker's own answer. `Err` when the peer is gone or the submit cannot be
/// sent; a peer that does not answer in time is answered for with an error (it may have
/// started the request: the caller's retry finds its id in use).
async fn relay(
    shared: &Shared,
    message: &async_nats::Message,
    peer: &str,
    subject: String,
    headers: async_nats::HeaderMap,
) -> Result<(), ()> {
    let Some(reply_to) = message.reply.clone() else {
        return Err(());
    };
    let request = async_nats::Request::new()
        .headers(headers)
        .payload(message.payload.clone())
        .timeout(Some(FORWARD_WAIT));
    match shared.client.send_request(subject, request).await {
        Ok(answer) => {
            let headers = answer.headers.unwrap_or_default();
            let _ = shared
                .client
                .publish_with_headers(reply_to, headers, answer.payload)
                .await;
            Ok(())
        }
        Err(error) if error.kind() == async_nats::RequestErrorKind::NoResponders => {
            tracing::debug!(message = "the worker a submit was sent on to is gone", peer = %peer);
            shared.peer_slots.forget(peer);
            Err(())
        }
        Err(error) => {
            tracing::warn!(message = "a worker a submit was sent on to did not answer", peer = %peer, %error);
            let unanswered = WireError::new(
                ErrorCode::Internal,
                format!(
                    "worker {peer}, to which worker {} sent the submit on, did not answer: ask the request's status before sending it again",
                    shared.worker_id
                ),
            );
            respond::<Accepted>(&shared.client, message, Err(unanswered)).await;
            Ok(())
        }
    }
}

/// Sends a pool submit this worker cannot start to a peer whose last heartbeat showed a free
/// slot, on that peer's own subject for the submit's tenant, and relays its answer (an
/// acceptance, or NO_SLOT_AVAILABLE if its slots went meanwhile). The refusal to send when no
/// peer had one, or the one chosen is gone.
async fn forward(
    shared: &Shared,
    message: &async_nats::Message,
    told: Option<&Preference>,
) -> Result<(), WireError> {
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
    let Some(peer) = shared.peer_slots.take() else {
        return Err(no_slot());
    };
    let Some((subject, mut headers)) = forwarded(shared, message, &peer) else {
        return Err(no_slot());
    };
    if let Some(worker) = told.and_then(|t| t.worker.as_deref()) {
        // Placed here, but no slot after all.
        headers.insert(PREFERRED_WORKER_HEADER, worker);
        headers.insert(AFFINITY_FALLBACK_HEADER, PassedOver::Busy.as_str());
    } else if header(message, PREFERRED_WORKER_HEADER).is_some() {
        // Its key's worker (the one that sent it here) had no slot after all.
        headers.insert(AFFINITY_FALLBACK_HEADER, PassedOver::Busy.as_str());
    }
    relay(shared, message, &peer, subject, headers)
        .await
        .map_err(|()| no_slot())?;
    shared.metrics.submits_forwarded.inc();
    tracing::debug!(message = "a submit forwarded to a peer with a free slot", peer = %peer);
    Ok(())
}

/// Checks, claims the id fleet-wide (the request's one write before it runs), and starts it.
async fn submit(
    shared: &Shared,
    message: &async_nats::Message,
    route: Route,
    decoded: Option<GenerationRequest>,
    told: Option<Preference>,
) -> Result<Accepted, WireError> {
    let request: GenerationRequest = match decoded {
        Some(request) => request,
        None => decode(message, shared.settings.limits.max_request_bytes)?,
    };
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
        progress: None,
        resumed: Vec::new(),
        ack: None,
    };
    let tenant_name = crate::schedule::tenant_name(tenant.as_deref());
    let permit = shared
        .tenant_counts
        .take_one(tenant_name, Refusal::Read, shared.fencing.stale())
        .await?;
    let revision = shared.stores.claim(&live).await?;
    // A pool submit a peer forwarded here is one of the pool's still.
    let pooled = route == Route::Pool || forwarders(message) > 0;
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
    // Placed here by this worker's ranking; else as the submitter (or the worker that
    // forwarded it) told; a submitter that sent it straight here without saying which worker
    // it preferred chose this one.
    let preference = match told {
        Some(preference) => preference,
        None if pooled || header(message, PREFERRED_WORKER_HEADER).is_some() => {
            preference_of(message.headers.as_ref())
        }
        None => Preference::direct(&shared.worker_id),
    };
    let admitted = admission::admit(shared, request, placement, claim, None, preference).await;
    if admitted.is_err() {
        // Refused after all (the last slot went to another request meanwhile, or the worker
        // drains): the id is free again for the caller's next try.
        shared.stores.unclaim(&request_id, revision).await;
    }
    admitted
}
