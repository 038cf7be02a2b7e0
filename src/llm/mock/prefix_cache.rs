//! The mock's prefix cache: what a model server's KV cache does to the time to first token,
//! without a GPU.
//!
//! A server that still holds the computed prefix of a conversation answers its continuation
//! almost at once; one that does not must read the whole conversation again first, in a time
//! that grows with its length. The mock remembers a hash of every conversation it served (the
//! messages as sent, in order), at most `entries` of them, forgetting the least recently used
//! first. A request whose messages start with one of those conversations (it may be the same
//! conversation again, or one that goes on from it) is a hit and waits `prefix_hit_ms` before
//! its first token; any other is a miss and waits `prefill_ms_per_kb` for each KiB of its
//! messages' text. So routing a conversation's turns back to the server that served the
//! earlier ones is measurable on a laptop.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::conversation::Conversation;
use crate::protocol::lru::BoundedLru;

/// The cache's settings, a script's `prefix_cache` table (or `genfleet mock-llm` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixCacheSettings {
    /// Conversations remembered (at least 1).
    pub entries: usize,
    /// Time to first token of a request that starts with a conversation served before.
    pub prefix_hit_ms: u64,
    /// Time to first token of any other request, per KiB of its messages' text.
    pub prefill_ms_per_kb: u64,
}

impl Default for PrefixCacheSettings {
    fn default() -> Self {
        PrefixCacheSettings {
            entries: 4096,
            prefix_hit_ms: 5,
            prefill_ms_per_kb: 50,
        }
    }
}

impl PrefixCacheSettings {
    pub(super) fn validate(&self) -> Result<(), String> {
        if self.entries == 0 {
            return Err("prefix_cache.entries must be at least 1".into());
        }
        Ok(())
    }
}

/// What the cache has done since it started or was last reset (`GET /mock/stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixCacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Conversations remembered now.
    pub entries: usize,
    pub capacity: usize,
}

impl PrefixCacheStats {
    /// Hits among the requests looked up, 0.0 to 1.0 (0 with none).
    pub fn hit_rate(&self) -> f64 {
        let looked = self.hits + self.misses;
        if looked == 0 {
            0.0
        } else {
            self.hits as f64 / looked as f64
        }
    }
}

pub(super) struct PrefixCache {
    settings: PrefixCacheSettings,
    served: Mutex<BoundedLru<u64, ()>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl PrefixCache {
    pub(super) fn new(settings: PrefixCacheSettings) -> PrefixCache {
        PrefixCache {
            settings,
            served: Mutex::new(BoundedLru::new(settings.entries)),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Looks the conversation up, remembers it as served, and tells how long its first token
    /// takes.
    pub(super) fn first_token_delay(&self, conv: &Conversation) -> Duration {
        let prefixes = prefix_hashes(conv);
        let Some(&whole) = prefixes.last() else {
            return Duration::ZERO;
        };
        let hit = {
            let mut served = self.lock();
            // The longest served prefix is the one a real cache would reuse; touching it keeps
            // a conversation that goes on from being forgotten.
            let hit = prefixes.iter().rev().any(|h| served.get(h).is_some());
            served.insert(whole, ());
            hit
        };
        if hit {
            self.hits.fetch_add(1, Ordering::Relaxed);
            Duration::from_millis(self.settings.prefix_hit_ms)
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            let bytes: usize = conv.messages.iter().map(|m| m.text.len()).sum();
            let micros = self.settings.prefill_ms_per_kb as u128 * bytes as u128 * 1000 / 1024;
            Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
        }
    }

    pub(super) fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: self.lock().len(),
            capacity: self.settings.entries,
        }
    }

    /// Forgets every conversation and zeroes the counters.
    pub(super) fn reset(&self) {
        *self.lock() = BoundedLru::new(self.settings.entries);
        self.hits.store(0, Ordering::Relaxed);
        self.misses.store(0, Ordering::Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BoundedLru<u64, ()>> {
        // A panic while holding the lock cannot leave the map half-changed in a way that
        // matters to a mock.
        self.served.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The hash of each leading run of messages: `[h(m1), h(m1, m2), ..., h(m1..mn)]`.
fn prefix_hashes(conv: &Conversation) -> Vec<u64> {
    let mut hasher = DefaultHasher::new();
    conv.messages
        .iter()
        .map(|m| {
            m.role.hash(&mut hasher);
            m.text.hash(&mut hasher);
            hasher.finish()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(turns: &[(&str, &str)]) -> Conversation {
        let messages: Vec<_> = turns
            .iter()
            .map(|(role, text)| serde_json::json!({"role": role, "content": text}))
            .collect();
        Conversation::from_request(&serde_json::json!({ "messages": messages })).unwrap()
    }

    #[test]
    fn a_conversation_that_goes_on_from_a_served_one_hits() {
        let cache = PrefixCache::new(PrefixCacheSettings {
            entries: 8,
            prefix_hit_ms: 3,
            prefill_ms_per_kb: 1024,
        });
        let first = conv(&[("system", "be brief"), ("user", "hello")]);
        // 13 bytes at 1 ms per byte.
        assert_eq!(cache.first_token_delay(&first), Duration::from_millis(13));
        let next = conv(&[
            ("system", "be brief"),
            ("user", "hello"),
            ("assistant", "hi"),
            ("user", "more"),
        ]);
        assert_eq!(cache.first_token_delay(&next), Duration::from_millis(3));
        // The same conversation again hits too; another that only shares the system does not.
        assert_eq!(cache.first_token_delay(&first), Duration::from_millis(3));
        let other = conv(&[("system", "be brief"), ("user", "bye")]);
        assert_eq!(cache.first_token_delay(&other), Duration::from_millis(11));
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses, stats.entries), (2, 2, 3));
        assert_eq!(stats.hit_rate(), 0.5);
        cache.reset();
        assert_eq!(
            cache.stats(),
            PrefixCacheStats {
                capacity: 8,
                ..Default::default()
            }
        );
    }

    #[test]
    fn the_cache_forgets_the_least_recently_used() {
        let cache = PrefixCache::new(PrefixCacheSettings {
            entries: 2,
            ..PrefixCacheSettings::default()
        });
        for text in ["a", "b", "c"] {
            cache.first_token_delay(&conv(&[("user", text)]));
        }
        let stats = cache.stats();
        assert_eq!((stats.entries, stats.misses), (2, 3));
        // "a" was forgotten, "c" is still there.
        cache.first_token_delay(&conv(&[("user", "a"), ("assistant", "x")]));
        cache.first_token_delay(&conv(&[("user", "c"), ("assistant", "x")]));
        assert_eq!(cache.stats().hits, 1);
        assert_eq!(cache.stats().entries, 2);
    }
}
