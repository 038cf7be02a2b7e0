//! The fleet's live workers as their heartbeats tell them: the heartbeat record every worker
//! writes, and [`Fleet`], which follows bucket `GENFLEET_WORKERS` so that a client (the Rust
//! client, every gateway replica) places a keyed request on its key's worker itself, by the
//! rule of [`crate::schedule::choose`], and skips the hop a worker would otherwise make.
//!
//! Following is best effort: until the bucket's entries have been read, or when this process's
//! NATS user may not read them (a tenant's user may not: heartbeats name every tenant's running
//! requests), keyed requests go to the pool, and the worker that receives one places it by the
//! same rule.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use crate::client::streams::WORKERS_BUCKET;
use crate::schedule::{Choice, PoolView};

/// A worker's heartbeat record, key = its id in bucket `GENFLEET_WORKERS`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub worker_id: String,
    pub pool: String,
    pub slots: u32,
    pub busy: u32,
    pub draining: bool,
    /// It takes no work: its backend does not answer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    pub ts: String,
    /// The interactive requests running on the worker when it beat.
    #[serde(default)]
    pub running: Vec<String>,
    /// The durable requests the worker held (running, or waiting for a slot) when it beat: a
    /// redelivery of one it no longer holds (its message given back while the store could not
    /// record that) takes it over without waiting for the worker to be lost. Absent in the
    /// heartbeats of workers older than the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub durable: Option<Vec<String>>,
}

impl Heartbeat {
    /// Its slots and busy slots when it takes work of `pool` (`None`: another pool, draining,
    /// or paused).
    pub fn load_in(&self, pool: &str) -> Option<(u32, u32)> {
        (self.pool == pool && !self.draining && !self.paused).then_some((self.slots, self.busy))
    }
}

/// Workers followed at most (a fleet larger than this is followed in part).
const MAX_WORKERS: usize = 10_000;
/// The age past which an entry is taken for gone when the bucket's own limit cannot be read.
const DEFAULT_MAX_AGE: Duration = Duration::from_secs(10);

/// Where following the heartbeats stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Following {
    /// The bucket's entries are being read.
    Loading,
    /// Every entry there was has been read; new ones follow.
    Ready,
    /// The bucket cannot be read (no permission, no bucket): keyed requests go to the pool.
    Unavailable(String),
}

/// A worker as its last heartbeat told.
struct Seen {
    pool: String,
    load: Option<(u32, u32)>,
    at: Instant,
}

struct State {
    following: Following,
    workers: HashMap<String, Seen>,
    max_age: Duration,
}

/// The live workers of every pool, followed from their heartbeats.
pub struct Fleet {
    state: Mutex<State>,
}

impl Fleet {
    /// Starts following bucket `GENFLEET_WORKERS` in the background; the task ends when the
    /// returned handle's last clone is dropped.
    pub fn follow(nats: async_nats::Client) -> Arc<Fleet> {
        let fleet = Arc::new(Fleet {
            state: Mutex::new(State {
                following: Following::Loading,
                workers: HashMap::new(),
                max_age: DEFAULT_MAX_AGE,
            }),
        });
        tokio::spawn(follow(nats, Arc::downgrade(&fleet)));
        fleet
    }

    pub fn following(&self) -> Following {
        self.lock().following.clone()
    }

    /// Where a request with `key` goes in `pool`, by the fleet's rule; `None` while the
    /// heartbeats are not read yet or cannot be, or when no worker has a free slot.
    pub fn choose(&self, pool: &str, key: &str, load_factor: f64) -> Option<Choice> {
        let state = self.lock();
        if state.following != Following::Ready {
            return None;
        }
        let mut view = PoolView::default();
        for (id, seen) in &state.workers {
            if seen.pool == pool && seen.at.elapsed() < state.max_age {
                view.note(id, seen.load);
            }
        }
        view.choose(key, None, None, load_factor)
    }

    /// The live workers of `pool` that take work, as last seen: (id, slots, busy).
    pub fn workers_of(&self, pool: &str) -> Vec<(String, u32, u32)> {
        let state = self.lock();
        let mut workers: Vec<_> = state
            .workers
            .iter()
            .filter(|(_, seen)| seen.pool == pool && seen.at.elapsed() < state.max_age)
            .filter_map(|(id, seen)| seen.load.map(|(slots, busy)| (id.clone(), slots, busy)))
            .collect();
        workers.sort();
        workers
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every change is made whole under the lock; a panic cannot leave it torn.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn note(&self, entry: kv::Entry) {
        let mut state = self.lock();
        if entry.operation != kv::Operation::Put {
            state.workers.remove(&entry.key);
            return;
        }
        let Ok(heartbeat) = serde_json::from_slice::<Heartbeat>(&entry.value) else {
            return;
        };
        if heartbeat.worker_id != entry.key || !is_subject_token(&entry.key) {
            return;
        }
        if !state.workers.contains_key(&entry.key) && state.workers.len() >= MAX_WORKERS {
            return;
        }
        let load = heartbeat.load_in(&heartbeat.pool);
        state.workers.insert(
            entry.key,
            Seen {
                pool: heartbeat.pool,
                load,
                at: Instant::now(),
            },
        );
    }

    fn set(&self, following: Following) {
        self.lock().following = following;
    }
}

/// A worker id that can stand as one token of a subject.
fn is_subject_token(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 256
        && !id
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>'))
}

async fn follow(nats: async_nats::Client, fleet: Weak<Fleet>) {
    let js = async_nats::jetstream::new(nats);
    let store = match js.get_key_value(WORKERS_BUCKET).await {
        Ok(store) => store,
        Err(error) => return unavailable(&fleet, error.to_string()),
    };
    let (pending, max_age) = match store.status().await {
        Ok(status) => (status.values(), status.max_age()),
        Err(error) => return unavailable(&fleet, error.to_string()),
    };
    if let Some(fleet) = fleet.upgrade() {
        let mut state = fleet.lock();
        if !max_age.is_zero() {
            state.max_age = max_age;
        }
        if pending == 0 {
            state.following = Following::Ready;
        }
    }
    // Ready once the last of the bucket's entries arrives (delta 0): a partial view would
    // rank a key's workers otherwise than the others do.
    let mut watch = match store.watch_with_history(">").await {
        Ok(watch) => watch,
        Err(error) => return unavailable(&fleet, error.to_string()),
    };
    loop {
        let mut look = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                entry = watch.next() => {
                    let Some(fleet) = fleet.upgrade() else { return };
                    match entry {
                        Some(Ok(entry)) => {
                            let last_of_history = entry.delta == 0;
                            fleet.note(entry);
                            if last_of_history {
                                fleet.set(Following::Ready);
                            }
                        }
                        _ => break,
                    }
                }
                _ = look.tick() => {
                    let Some(fleet) = fleet.upgrade() else { return };
                    let mut state = fleet.lock();
                    let max_age = state.max_age;
                    state.workers.retain(|_, seen| seen.at.elapsed() < max_age);
                }
            }
        }
        // The watch ended (the connection was lost): followed again; what is known meanwhile
        // is ranked only while younger than the bucket's max age.
        let mut pause = Duration::from_millis(100);
        watch = loop {
            if fleet.strong_count() == 0 {
                return;
            }
            match store.watch_with_history(">").await {
                Ok(watch) => break watch,
                Err(error) => {
                    tracing::debug!(message = "cannot follow the heartbeats again yet", %error);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
        };
    }
}

fn unavailable(fleet: &Weak<Fleet>, why: String) {
    if let Some(fleet) = fleet.upgrade() {
        tracing::debug!(message = "cannot follow the workers' heartbeats; keyed requests go to the pool, whose workers place them", why = %why);
        fleet.set(Following::Unavailable(why));
    }
}
