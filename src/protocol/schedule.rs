//! Who a request is for and how urgent it is: its priority band (a request field) and its
//! tenant (a subject token that the caller's NATS permissions pin to its user, never a body
//! field a caller could forge).

use serde::{Deserialize, Serialize};

use super::ids::is_valid_token;

/// A request's priority band. The durable queue serves the highest band with a waiting
/// request first; a worker's reserved slots keep room that only higher bands may take.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    /// Every band, the most urgent first (the order in which the queue serves them).
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    /// The band a subject token names.
    pub fn from_token(token: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.as_str() == token)
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The tenant of every request sent on the v1 subjects (`gen.submit.<pool>`,
/// `gen.queue.<pool>.<id>`), and of a single-tenant fleet.
pub const DEFAULT_TENANT: &str = "default";

/// Longest tenant name.
pub const MAX_TENANT_LEN: usize = 32;

/// A tenant name is 1-32 characters of `[A-Za-z0-9_-]`: one subject token, a part of a
/// consumer name and a metric label, so its length and charset bound what each costs.
pub fn is_valid_tenant(tenant: &str) -> bool {
    is_valid_token(tenant, MAX_TENANT_LEN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_read_and_order() {
        for band in Priority::ALL {
            assert_eq!(Priority::from_token(band.as_str()), Some(band));
        }
        assert_eq!(Priority::from_token("urgent"), None);
        assert!(Priority::High < Priority::Normal && Priority::Normal < Priority::Low);
        assert_eq!(Priority::default(), Priority::Normal);
        assert_eq!(
            serde_json::from_str::<Priority>("\"low\"").unwrap(),
            Priority::Low
        );
    }

    #[test]
    fn tenant_names_are_one_bounded_token() {
        for (name, ok) in [
            ("acme", true),
            ("team_a-1", true),
            ("", false),
            ("a.b", false),
            ("a*", false),
            ("a b", false),
            (&"x".repeat(33), false),
            (&"x".repeat(32), true),
        ] {
            assert_eq!(is_valid_tenant(name), ok, "{name:?}");
        }
    }
}
