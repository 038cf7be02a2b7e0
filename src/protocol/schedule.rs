//! Who a request is for and how urgent it is: its priority band (a request field) and its
//! tenant (a subject token that the caller's NATS permissions pin to its user, never a body
//! field a caller could forge).

use std::collections::BTreeMap;

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

/// A request's id on the bus: the bare id for the default tenant (the v1 subjects), and
/// `<tenant>.<id>` for any other tenant. Its per-request subjects (`gen.events.<tenant>.<id>`,
/// `gen.status.…`, `gen.result.…`, `gen.cancel.…`) and its record (`res.<tenant>.<id>`) carry
/// the tenant token, so the same id in two tenants is two requests and NATS permissions can
/// pin a tenant to its own.
pub fn qualified_id(tenant: Option<&str>, id: &str) -> String {
    match tenant {
        Some(tenant) if tenant != DEFAULT_TENANT => format!("{tenant}.{id}"),
        _ => id.to_string(),
    }
}

/// The tenant (`None` for the default tenant) and the bare id of a request id on the bus;
/// `None` when it is neither a bare id nor `<tenant>.<id>`.
pub fn split_qualified(id: &str) -> Option<(Option<&str>, &str)> {
    match id.split_once('.') {
        None => super::ids::is_valid_request_id(id).then_some((None, id)),
        Some((tenant, bare)) => (is_valid_tenant(tenant)
            && tenant != DEFAULT_TENANT
            && super::ids::is_valid_request_id(bare))
        .then_some((Some(tenant), bare)),
    }
}

/// True for a request id as the bus knows it: a bare id, or `<tenant>.<id>`.
pub fn is_valid_qualified_id(id: &str) -> bool {
    split_qualified(id).is_some()
}

/// A tenant's running requests across a pool, worker by worker: the value of key
/// `<pool>.<tenant>` in KV bucket `GENFLEET_TENANTS`, kept when `worker.tenants.pool_max_running`
/// is set. Only workers write it, each its own count, by compare-and-set (docs/protocol.md,
/// Priority bands and tenants).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantRunning {
    /// Each worker's running requests of the tenant, by worker id; a worker running none is
    /// left out.
    #[serde(default)]
    pub running: BTreeMap<String, u32>,
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
    }

    #[test]
    fn qualified_ids_carry_their_tenant() {
        assert_eq!(qualified_id(None, "a1"), "a1");
        assert_eq!(qualified_id(Some(DEFAULT_TENANT), "a1"), "a1");
        assert_eq!(qualified_id(Some("acme"), "a1"), "acme.a1");
        assert_eq!(split_qualified("acme.a1"), Some((Some("acme"), "a1")));
        assert_eq!(split_qualified("a1"), Some((None, "a1")));
        for bad in [
            "",
            "default.a1",
            "a.b.c",
            "acme.",
            ".a1",
            "ac*me.a1",
            "acme.a>",
        ] {
            assert_eq!(split_qualified(bad), None, "{bad:?}");
        }
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
