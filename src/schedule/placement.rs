//! Placement by affinity key, the same for every party: rendezvous (highest-random-weight)
//! hashing of the key against the ids of the pool's live workers, with bounded loads.
//!
//! Every worker, gateway replica and client that reads the workers' heartbeats ranks a key's
//! workers alike, so a conversation lands on the same worker whichever of them sends it, and a
//! client that reads nothing (a one-shot command, a plain NATS caller) is placed by the worker
//! that receives its submit. A worker that joins or leaves moves only the keys it ranks first
//! for. docs/protocol.md (Affinity) states the rule for implementers in other languages, and
//! `tests/data/placement.json` holds vectors that every implementation is tested against.
//!
//! The rule:
//! - a worker's score for a key is the first 8 bytes, read as a big-endian unsigned integer,
//!   of the SHA-256 of the key's UTF-8 bytes, one zero byte, and the worker id's UTF-8 bytes
//!   ([`score`]);
//! - the workers are ranked by score, highest first; equal scores by worker id, bytewise
//!   ascending ([`rank`]);
//! - the key's worker is the first in rank of the live workers of the pool that take work (not
//!   draining, not paused); the request goes to the first in rank with a free slot whose load
//!   stays bounded ([`choose`]).

use std::collections::HashMap;

/// The bounded-load factor used when none is set (`placement.load_factor`): a worker already
/// busier than twice the pool's average share is passed over for the next in rank.
pub const DEFAULT_LOAD_FACTOR: f64 = 2.0;

/// A worker's score for `key`: the first 8 bytes of SHA-256(key ‖ 0x00 ‖ worker_id), big-endian.
pub fn score(key: &str, worker_id: &str) -> u64 {
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    digest.update(key.as_bytes());
    digest.update(&[0]);
    digest.update(worker_id.as_bytes());
    let digest = digest.finish();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_ref()[..8]);
    u64::from_be_bytes(first)
}

/// `workers` in the key's order: highest score first, equal scores by id (bytewise ascending).
pub fn rank<'a>(key: &str, workers: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut scored: Vec<(u64, &str)> = workers.into_iter().map(|w| (score(key, w), w)).collect();
    scored.sort_unstable_by(|a, b| {
        b.0.cmp(&a.0)
            .then_with(|| a.1.as_bytes().cmp(b.1.as_bytes()))
    });
    scored.dedup_by(|a, b| a.1 == b.1);
    scored.into_iter().map(|(_, w)| w).collect()
}

/// A live worker of the pool that takes work, as its last heartbeat (or, for the worker
/// itself, its own count) tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLoad {
    pub worker_id: String,
    pub slots: u32,
    pub busy: u32,
}

impl WorkerLoad {
    fn free(&self) -> u32 {
        self.slots.saturating_sub(self.busy)
    }
}

/// Why a request did not go to its key's worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassedOver {
    /// The key's worker had no free slot.
    Busy,
    /// The key's worker was busier than the load factor allows.
    Load,
}

impl PassedOver {
    /// As the `Genfleet-Affinity-Fallback` header and the result's `affinity.fallback` say it.
    pub fn as_str(self) -> &'static str {
        match self {
            PassedOver::Busy => "busy",
            PassedOver::Load => "load",
        }
    }
}

/// Where a keyed request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The worker that takes it.
    pub worker: String,
    /// The first in the key's rank: where it goes when that worker can take it.
    pub key_worker: String,
    /// Why `worker` is not `key_worker` (`None` when they are the same).
    pub passed_over: Option<PassedOver>,
}

/// Whether `worker` is passed over for the bounded load: at least half its slots are busy, and
/// its busy slots, weighed against its share of the pool's slots, reach `load_factor` times the
/// pool's busy slots counting this request. In the order docs/protocol.md gives, in IEEE 754
/// doubles: `2 × busy ≥ slots` and `busy × S ≥ load_factor × (B + 1) × slots`, where B and S
/// are the busy and all slots of the workers ranked. A factor of 0 (or below 1, or not finite)
/// bounds nothing. The half-busy floor keeps a quiet pool's conversations on their workers: a
/// key's worker that a heartbeat shows running one request (maybe the turn before, finished
/// since) is not passed over for it.
fn over_load(worker: &WorkerLoad, busy_total: u64, slots_total: u64, load_factor: f64) -> bool {
    if !(load_factor.is_finite() && load_factor >= 1.0) {
        return false;
    }
    if 2 * u64::from(worker.busy) < u64::from(worker.slots) {
        return false;
    }
    let left = f64::from(worker.busy) * slots_total as f64;
    let right = load_factor * (busy_total + 1) as f64 * f64::from(worker.slots);
    left >= right
}

/// Where a request with `key` goes among `workers` (the pool's live workers that take work):
/// the first in rank with a free slot and a bounded load; when every worker with a free slot is
/// over the bound, the first in rank with a free slot (the bound moves work, it never refuses
/// it). `None` when no worker has a free slot, or there is none.
pub fn choose(key: &str, workers: &[WorkerLoad], load_factor: f64) -> Option<Choice> {
    let by_id: HashMap<&str, &WorkerLoad> =
        workers.iter().map(|w| (w.worker_id.as_str(), w)).collect();
    let ranked = rank(key, by_id.keys().copied());
    let key_worker = (*ranked.first()?).to_string();
    let busy_total: u64 = by_id.values().map(|w| u64::from(w.busy)).sum();
    let slots_total: u64 = by_id.values().map(|w| u64::from(w.slots)).sum();
    let with_free = || ranked.iter().map(|id| by_id[id]).filter(|w| w.free() > 0);
    let chosen = with_free()
        .find(|w| !over_load(w, busy_total, slots_total, load_factor))
        .or_else(|| with_free().next())?;
    let passed_over = if chosen.worker_id == key_worker {
        None
    } else if by_id[key_worker.as_str()].free() == 0 {
        Some(PassedOver::Busy)
    } else {
        Some(PassedOver::Load)
    };
    Some(Choice {
        worker: chosen.worker_id.clone(),
        key_worker,
        passed_over,
    })
}

/// The pool's live workers as heartbeats tell them, kept by a worker (its peers) or a client
/// (all of them): what [`choose`] ranks. A submit sent to a worker counts one more busy slot
/// there until its next heartbeat says otherwise.
#[derive(Debug, Clone, Default)]
pub struct PoolView {
    workers: HashMap<String, WorkerLoad>,
}

impl PoolView {
    /// A heartbeat: the worker as it is now, or `None` when it takes no work (another pool,
    /// draining, paused).
    pub fn note(&mut self, worker_id: &str, load: Option<(u32, u32)>) {
        match load {
            Some((slots, busy)) => {
                self.workers.insert(
                    worker_id.to_string(),
                    WorkerLoad {
                        worker_id: worker_id.to_string(),
                        slots,
                        busy,
                    },
                );
            }
            None => {
                self.workers.remove(worker_id);
            }
        }
    }

    /// The worker stopped or is lost.
    pub fn forget(&mut self, worker_id: &str) {
        self.workers.remove(worker_id);
    }

    /// Workers followed.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The workers followed, their slots and their busy slots, summed.
    pub fn totals(&self) -> (u32, u64, u64) {
        self.workers
            .values()
            .fold((0, 0, 0), |(n, slots, busy), w| {
                (n + 1, slots + u64::from(w.slots), busy + u64::from(w.busy))
            })
    }

    /// Whether any worker had a free slot.
    pub fn any_free(&self) -> bool {
        self.workers.values().any(|w| w.free() > 0)
    }

    /// The worker with the most free slots (ties: the lowest id), counted one busier from now.
    pub fn take_most_free(&mut self) -> Option<String> {
        let worker = self
            .workers
            .values()
            .filter(|w| w.free() > 0)
            .max_by(|a, b| a.free().cmp(&b.free()).then(b.worker_id.cmp(&a.worker_id)))?
            .worker_id
            .clone();
        self.sent(&worker);
        Some(worker)
    }

    /// The first in `key`'s rank of the workers followed and `this`, free slots or not.
    pub fn key_worker(&self, key: &str, this: Option<&str>) -> Option<String> {
        let ids = self.workers.keys().map(String::as_str).chain(this);
        rank(key, ids).first().map(|w| w.to_string())
    }

    /// A submit went to `worker_id`: one more busy slot there until its next heartbeat.
    pub fn sent(&mut self, worker_id: &str) {
        if let Some(worker) = self.workers.get_mut(worker_id) {
            worker.busy = worker.busy.saturating_add(1).min(worker.slots);
        }
    }

    /// Where a request with `key` goes, among the workers followed and `this` (the worker
    /// asking, with its own exact load, in place of what its heartbeat said), `skip`ped ones
    /// left out (a worker that just refused it).
    pub fn choose(
        &self,
        key: &str,
        this: Option<WorkerLoad>,
        skip: Option<&str>,
        load_factor: f64,
    ) -> Option<Choice> {
        let this_id = this.as_ref().map(|w| w.worker_id.clone());
        let workers: Vec<WorkerLoad> = self
            .workers
            .values()
            .filter(|w| Some(&w.worker_id) != this_id.as_ref())
            .cloned()
            .chain(this)
            .map(|mut w| {
                if Some(w.worker_id.as_str()) == skip {
                    // Still ranked (it stays the key's worker), but with no slot to offer.
                    w.busy = w.slots;
                }
                w
            })
            .collect();
        choose(key, &workers, load_factor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(loads: &[(&str, u32, u32)]) -> Vec<WorkerLoad> {
        loads
            .iter()
            .map(|(id, slots, busy)| WorkerLoad {
                worker_id: id.to_string(),
                slots: *slots,
                busy: *busy,
            })
            .collect()
    }

    fn workers(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("worker-{i:02}")).collect()
    }

    fn top(key: &str, ids: &[String]) -> String {
        rank(key, ids.iter().map(String::as_str))[0].to_string()
    }

    #[test]
    fn every_ranking_of_the_same_workers_is_the_same_whatever_their_order() {
        let ids = workers(7);
        let mut reversed = ids.clone();
        reversed.reverse();
        for key in ["a", "session-42", "acme.01JD0QB2", "ключ"] {
            assert_eq!(
                rank(key, ids.iter().map(String::as_str)),
                rank(key, reversed.iter().map(String::as_str))
            );
        }
    }

    #[test]
    fn a_worker_leaving_moves_only_the_keys_it_ranked_first_for_and_one_joining_takes_about_a_share()
     {
        let four = workers(4);
        let keys: Vec<String> = (0..4000).map(|i| format!("chat-{i}")).collect();
        let before: Vec<String> = keys.iter().map(|k| top(k, &four)).collect();
        // worker-02 leaves: only its keys move.
        let three: Vec<String> = four.iter().filter(|w| *w != "worker-02").cloned().collect();
        for (key, was) in keys.iter().zip(&before) {
            let now = top(key, &three);
            if was != "worker-02" {
                assert_eq!(&now, was, "{key} moved although its worker stayed");
            }
        }
        // worker-04 joins: the keys that move all move to it, about a fifth of them.
        let five = workers(5);
        let moved = keys
            .iter()
            .zip(&before)
            .filter(|(key, was)| {
                let now = top(key, &five);
                if &now != *was {
                    assert_eq!(now, "worker-04", "{key} moved between old workers");
                    true
                } else {
                    false
                }
            })
            .count();
        let share = moved as f64 / keys.len() as f64;
        assert!((0.15..0.25).contains(&share), "moved {share}");
    }

    #[test]
    fn the_first_in_rank_with_a_free_slot_takes_it() {
        let key = "chat-7";
        let ids = workers(3);
        let ranked = rank(key, ids.iter().map(String::as_str));
        let (first, second) = (ranked[0], ranked[1]);
        let loads =
            |busy_first: u32| pool(&[(first, 2, busy_first), (second, 2, 0), (ranked[2], 2, 0)]);
        let idle = choose(key, &loads(0), 0.0).unwrap();
        assert_eq!((idle.worker.as_str(), idle.passed_over), (first, None));
        let full = choose(key, &loads(2), 0.0).unwrap();
        assert_eq!(
            (
                full.worker.as_str(),
                full.key_worker.as_str(),
                full.passed_over
            ),
            (second, first, Some(PassedOver::Busy))
        );
        let none = pool(&[(first, 1, 1), (second, 1, 1)]);
        assert_eq!(choose(key, &none, 2.0), None);
        assert_eq!(choose(key, &[], 2.0), None);
    }

    #[test]
    fn a_hot_key_spills_to_the_next_in_rank_not_to_a_random_worker() {
        let key = "hot";
        let ids = workers(4);
        let ranked = rank(key, ids.iter().map(String::as_str));
        let mut loads = pool(&ranked.iter().map(|w| (*w, 4, 0)).collect::<Vec<_>>());
        // The hot key's requests arrive one after another and stay running.
        let mut placed = Vec::new();
        for _ in 0..8 {
            let choice = choose(key, &loads, 2.0).unwrap();
            assert_eq!(choice.key_worker, ranked[0]);
            placed.push(choice.worker.clone());
            loads
                .iter_mut()
                .find(|w| w.worker_id == choice.worker)
                .unwrap()
                .busy += 1;
        }
        // The key's worker takes requests until half its slots are busy; from then on it takes
        // one whenever it is not twice as busy as the pool's average share, and the next in
        // rank takes the rest. The workers further down the rank get none.
        let expected: Vec<&str> = [0, 0, 1, 1, 0, 1, 0, 1]
            .iter()
            .map(|n| ranked[*n])
            .collect();
        assert_eq!(placed, expected);
        // Without a bound, the hot key fills its worker before moving on.
        let mut loads = pool(&ranked.iter().map(|w| (*w, 4, 0)).collect::<Vec<_>>());
        for n in 0..4 {
            let choice = choose(key, &loads, 0.0).unwrap();
            assert_eq!(choice.worker, ranked[0], "request {n}");
            loads
                .iter_mut()
                .find(|w| w.worker_id == choice.worker)
                .unwrap()
                .busy += 1;
        }
    }

    #[test]
    fn over_the_bound_everywhere_the_first_free_in_rank_still_takes_it() {
        let key = "k";
        let ids = workers(2);
        let ranked = rank(key, ids.iter().map(String::as_str));
        // Both busy alike, factor 1: both at the bound.
        let loads = pool(&[(ranked[0], 4, 3), (ranked[1], 4, 3)]);
        let choice = choose(key, &loads, 1.0).unwrap();
        assert_eq!(
            (choice.worker.as_str(), choice.passed_over),
            (ranked[0], None)
        );
    }

    #[test]
    fn a_view_counts_what_it_sent_and_ranks_the_asking_worker_with_its_own_load() {
        let mut view = PoolView::default();
        view.note("w1", Some((2, 0)));
        view.note("w2", Some((2, 2)));
        view.note("w3", None);
        assert_eq!(view.len(), 2);
        assert_eq!(view.take_most_free().as_deref(), Some("w1"));
        assert_eq!(view.take_most_free().as_deref(), Some("w1"));
        assert_eq!(view.take_most_free(), None);
        assert!(!view.any_free());
        // The asking worker's own count replaces its heartbeat's.
        let this = WorkerLoad {
            worker_id: "w2".into(),
            slots: 2,
            busy: 0,
        };
        let choice = view.choose("any", Some(this), None, 0.0).unwrap();
        assert_eq!(choice.worker, "w2");
        // A worker skipped stays ranked but takes nothing.
        view.note("w1", Some((2, 0)));
        let skipped = view.choose("any", None, Some("w1"), 0.0);
        assert_eq!(skipped, None);
        view.forget("w1");
        assert!(view.is_empty() || view.len() == 1);
    }

    #[test]
    fn the_vectors_every_implementation_shares_hold() {
        let vectors: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/data/placement.json")).unwrap();
        let text = |v: &serde_json::Value| v.as_str().unwrap().to_string();
        for case in vectors["scores"].as_array().unwrap() {
            let got = score(
                case["key"].as_str().unwrap(),
                case["worker_id"].as_str().unwrap(),
            );
            assert_eq!(got.to_string(), text(&case["score"]), "{case}");
            assert_eq!(format!("{got:016x}"), text(&case["score_hex"]), "{case}");
        }
        for case in vectors["rankings"].as_array().unwrap() {
            let workers: Vec<String> = case["workers"]
                .as_array()
                .unwrap()
                .iter()
                .map(text)
                .collect();
            let ranked: Vec<String> = case["ranked"]
                .as_array()
                .unwrap()
                .iter()
                .map(text)
                .collect();
            assert_eq!(
                rank(
                    case["key"].as_str().unwrap(),
                    workers.iter().map(String::as_str)
                ),
                ranked,
                "{case}"
            );
        }
        let cases = vectors["choices"].as_array().unwrap();
        assert!(cases.len() >= 10);
        for case in cases {
            let workers: Vec<WorkerLoad> = case["workers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| WorkerLoad {
                    worker_id: text(&w["worker_id"]),
                    slots: w["slots"].as_u64().unwrap() as u32,
                    busy: w["busy"].as_u64().unwrap() as u32,
                })
                .collect();
            let got = choose(
                case["key"].as_str().unwrap(),
                &workers,
                case["load_factor"].as_f64().unwrap(),
            );
            let expected = (!case["choice"].is_null()).then(|| Choice {
                worker: text(&case["choice"]["worker"]),
                key_worker: text(&case["choice"]["key_worker"]),
                passed_over: match case["choice"]["fallback"].as_str() {
                    None => None,
                    Some("busy") => Some(PassedOver::Busy),
                    Some("load") => Some(PassedOver::Load),
                    Some(other) => panic!("fallback {other}"),
                },
            });
            assert_eq!(got, expected, "{case}");
        }
    }
}
