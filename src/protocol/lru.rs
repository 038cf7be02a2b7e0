//! A small map that keeps at most a given number of entries, forgetting the least recently
//! used first. The mock server's prefix cache must stay bounded whatever its callers send, and
//! needs no more than this.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// At most `capacity` entries; reading or writing an entry makes it the most recent.
#[derive(Debug, Clone)]
pub struct BoundedLru<K, V> {
    capacity: usize,
    /// Each key's value and the tick of its last use.
    entries: HashMap<K, (V, u64)>,
    /// Ticks of last use, oldest first: the next to forget is the first.
    order: BTreeMap<u64, K>,
    tick: u64,
}

impl<K: Hash + Eq + Clone, V> BoundedLru<K, V> {
    /// A map of at most `capacity` entries (0 keeps nothing).
    pub fn new(capacity: usize) -> Self {
        BoundedLru {
            capacity,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value of `key`, now the most recently used.
    pub fn get(&mut self, key: &K) -> Option<&V> {
        self.tick += 1;
        let tick = self.tick;
        let (value, used) = self.entries.get_mut(key)?;
        self.order.remove(used);
        *used = tick;
        self.order.insert(tick, key.clone());
        Some(value)
    }

    /// Whether `key` is held, without making it more recent.
    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Sets `key` to `value` as the most recent entry, forgetting the least recent one when
    /// the map is full.
    pub fn insert(&mut self, key: K, value: V) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        let tick = self.tick;
        if let Some((_, used)) = self.entries.insert(key.clone(), (value, tick)) {
            self.order.remove(&used);
        } else if self.entries.len() > self.capacity
            && let Some((_, oldest)) = self.order.pop_first()
        {
            self.entries.remove(&oldest);
        }
        self.order.insert(tick, key);
    }

    pub fn remove(&mut self, key: &K) -> Option<V> {
        let (value, used) = self.entries.remove(key)?;
        self.order.remove(&used);
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forgets_the_least_recently_used_first() {
        let mut lru = BoundedLru::new(2);
        lru.insert("a", 1);
        lru.insert("b", 2);
        assert_eq!(lru.get(&"a"), Some(&1)); // "b" is now the oldest
        lru.insert("c", 3);
        assert!(!lru.contains(&"b"));
        assert!(lru.contains(&"a") && lru.contains(&"c"));
        assert_eq!(lru.len(), 2);
        lru.insert("a", 10); // replaces, keeps the size
        assert_eq!(lru.len(), 2);
        assert_eq!(lru.get(&"a"), Some(&10));
        lru.insert("d", 4); // "c" is the oldest now
        assert!(!lru.contains(&"c"));
        assert_eq!(lru.remove(&"a"), Some(10));
        assert_eq!(lru.len(), 1);
    }

    #[test]
    fn stays_bounded_and_zero_keeps_nothing() {
        let mut lru = BoundedLru::new(3);
        for i in 0..1000 {
            lru.insert(i, i);
        }
        assert_eq!(lru.len(), 3);
        assert!(lru.contains(&999) && lru.contains(&997) && !lru.contains(&996));
        assert_eq!(lru.order.len(), 3);
        let mut none = BoundedLru::new(0);
        none.insert(1, 1);
        assert!(none.is_empty());
    }
}
