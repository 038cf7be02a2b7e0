//! One subscription for the events of many requests of one tenant, handed to each request's
//! follower by the id in the event's subject.
//!
//! A batch driver follows thousands of requests one after another. A subscription made and
//! removed for each costs the server two protocol operations per request, and each change to
//! its subscriptions empties every publisher's cache of where a subject goes, so the workers'
//! events cost more too. A fan-out subscribes once, to every request of its tenant
//! (`gen.events.<tenant>.*`, or `gen.events.*` for the default tenant), and drops unread the
//! events of requests nobody here follows: a replica that drives a batch receives its tenant's
//! other events while it does.
//!
//! Architecture invariants:
//! - A follower is registered before its request is sent (registering is local, the
//!   subscription already stands), so it misses nothing the server delivers.
//! - Memory is bounded whatever the publishers do: each follower holds at most
//!   [`EVENTS_HELD`] events; past that they are dropped, and the follower, seeing the sequence
//!   skip, reads the part's stored result ([`crate::client::follow`]).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;

use super::{Client, ClientError};
use crate::protocol::Event;

/// Events held for one follower that has not read them yet.
pub const EVENTS_HELD: usize = 256;

/// Each followed request's route, by its id on the bus; none once the subscription ended (or
/// the fan-out was dropped): every follower's stream then ends, and a new one ends at once.
type Routes = Arc<Mutex<Option<HashMap<String, Route>>>>;

/// Where one follower's events go: the number of the follower that holds it, whether it takes
/// only what ends a part, and the channel of its events' payloads.
struct Route {
    number: u64,
    ends_only: bool,
    tx: mpsc::Sender<bytes::Bytes>,
}

/// The tenant's events, subscribed once; [`EventFanout::follow`] takes one request's.
pub struct EventFanout {
    routes: Routes,
    /// The next follower's number.
    next: std::sync::atomic::AtomicU64,
    task: tokio::task::JoinHandle<()>,
}

impl Client {
    /// Every event of this client's tenant on one subscription, for following many of its
    /// requests (see the module's documentation for what that costs).
    pub async fn event_fanout(&self) -> Result<EventFanout, ClientError> {
        let subjects = self.subjects().clone();
        let mut sub = self
            .nats()
            .subscribe(subjects.events(&self.on_bus("*")))
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        // The server has the subscription before any follower's request can be sent.
        self.nats()
            .flush()
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        let routes: Routes = Arc::new(Mutex::new(Some(HashMap::new())));
        let task = tokio::spawn({
            let routes = routes.clone();
            async move {
                while let Some(message) = sub.next().await {
                    let request_id = subjects.request_of("events", &message.subject);
                    let routes = routes.lock().unwrap_or_else(|e| e.into_inner());
                    let Some(route) = routes.as_ref().and_then(|r| r.get(request_id)) else {
                        continue;
                    };
                    if route.ends_only
                        && matches!(
                            Event::type_of(&message.payload),
                            Some(b"delta" | b"reasoning")
                        )
                    {
                        continue;
                    }
                    // A follower that fell this far behind reads its stored result.
                    let _ = route.tx.try_send(message.payload);
                }
                // The subscription ended: every follower's stream ends with it.
                close(&routes);
            }
        });
        Ok(EventFanout {
            routes,
            next: Default::default(),
            task,
        })
    }
}

impl EventFanout {
    /// The events of `request_id` (as the bus knows it: `<tenant>.<id>` for a tenant's), from
    /// now on, until the stream is dropped. Take it before sending the request.
    pub fn follow(&self, request_id: &str) -> FannedEvents {
        self.route(request_id, false)
    }

    /// [`EventFanout::follow`] without the text as it streams (`delta` and `reasoning` events
    /// are dropped unread): for a follower that wants only each part's end. Its
    /// [`Follow`](super::Follow) sees the numbering skip and takes the part's text from its
    /// result, whole.
    pub fn follow_ends(&self, request_id: &str) -> FannedEvents {
        self.route(request_id, true)
    }

    fn route(&self, request_id: &str, ends_only: bool) -> FannedEvents {
        let (tx, rx) = mpsc::channel(EVENTS_HELD);
        let number = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Once closed, nothing comes any more: the stream ends at once (its sender dropped), as
        // a closed subscription's.
        if let Some(routes) = self
            .routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            routes.insert(
                request_id.to_string(),
                Route {
                    number,
                    ends_only,
                    tx,
                },
            );
        }
        FannedEvents {
            rx,
            routes: self.routes.clone(),
            request_id: request_id.to_string(),
            number,
        }
    }

    /// Requests followed now.
    pub fn followed(&self) -> usize {
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(0, HashMap::len)
    }
}

impl Drop for EventFanout {
    fn drop(&mut self) {
        self.task.abort();
        close(&self.routes);
    }
}

/// Ends every follower's stream (their senders dropped), and any taken after.
fn close(routes: &Routes) {
    routes.lock().unwrap_or_else(|e| e.into_inner()).take();
}

/// One request's events from an [`EventFanout`]; it stops following when dropped.
pub struct FannedEvents {
    rx: mpsc::Receiver<bytes::Bytes>,
    routes: Routes,
    request_id: String,
    number: u64,
}

impl Stream for FannedEvents {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        loop {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(payload)) => {
                    if let Ok(event) = Event::from_json(&payload) {
                        return Poll::Ready(Some(event));
                    }
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Drop for FannedEvents {
    fn drop(&mut self) {
        let mut routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        let Some(routes) = routes.as_mut() else {
            return;
        };
        // Only this follower's own route: a later follower of the same id keeps its own.
        if routes
            .get(&self.request_id)
            .is_some_and(|route| route.number == self.number)
        {
            routes.remove(&self.request_id);
        }
    }
}
