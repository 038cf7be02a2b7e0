//! The requests list: the newest requests matching a filter, and what the filters can take.

use std::collections::BTreeSet;

use serde::Serialize;

use super::{RequestEntry, Requests};

/// What the list is asked for: each given field must match (state exactly, the others as a
/// case-insensitive part; `id` a part of the request id).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestFilter {
    pub state: Option<String>,
    pub pool: Option<String>,
    pub job: Option<String>,
    pub tenant: Option<String>,
    pub id: Option<String>,
    pub limit: Option<usize>,
}

impl RequestFilter {
    fn matches(&self, entry: &RequestEntry) -> bool {
        fn part(wanted: &Option<String>, value: Option<&str>) -> bool {
            match wanted.as_deref().map(str::trim).filter(|w| !w.is_empty()) {
                None => true,
                Some(wanted) => value.is_some_and(|v| {
                    v.to_ascii_lowercase()
                        .contains(&wanted.to_ascii_lowercase())
                }),
            }
        }
        let state = match self.state.as_deref().filter(|s| !s.is_empty()) {
            None => true,
            Some(s) => entry
                .state
                .is_some_and(|state| state.as_str().eq_ignore_ascii_case(s)),
        };
        state
            && part(&self.pool, entry.pool.as_deref())
            && part(&self.job, entry.job_name.as_deref())
            && part(&self.tenant, Some(&entry.tenant))
            && part(&self.id, Some(&entry.request_id))
    }
}

/// Rows a list answer holds at most.
pub const LIST_MAX: usize = 500;

/// A page of the list.
#[derive(Debug, Clone, Serialize)]
pub struct RequestPage {
    /// The newest matching requests, newest first.
    pub requests: Vec<RequestEntry>,
    /// How many match, and how many the console keeps.
    pub matched: usize,
    pub kept: usize,
    /// The most the console keeps (`console.max_requests`).
    pub max: usize,
    /// What the filters can take: every pool, job and tenant among the kept requests.
    pub pools: Vec<String>,
    pub jobs: Vec<String>,
    pub tenants: Vec<String>,
}

impl Requests {
    /// The newest requests matching `filter`, newest first.
    pub fn list(&self, filter: &RequestFilter) -> RequestPage {
        let limit = filter.limit.unwrap_or(200).clamp(1, LIST_MAX);
        let mut matched = 0;
        let mut requests = Vec::new();
        for id in self.order.values().rev() {
            let Some(entry) = self.entries.get(id) else {
                continue;
            };
            if entry.known() && filter.matches(entry) {
                matched += 1;
                if requests.len() < limit {
                    requests.push(entry.shown());
                }
            }
        }
        let distinct = |f: fn(&RequestEntry) -> Option<&String>| {
            let mut values: Vec<String> = self
                .entries
                .values()
                .filter(|e| e.known())
                .filter_map(f)
                .cloned()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            values.truncate(200);
            values
        };
        RequestPage {
            requests,
            matched,
            kept: self.entries.values().filter(|e| e.known()).count(),
            max: self.max,
            pools: distinct(|e| e.pool.as_ref()),
            jobs: distinct(|e| e.job_name.as_ref()),
            tenants: distinct(|e| Some(&e.tenant)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use serde_json::json;

    use super::super::fixtures::{event, kinds, result};
    use super::super::tenant_of;
    use super::*;
    use crate::protocol::RequestState;
    use crate::protocol::ids::rfc3339;

    #[test]
    fn the_tenant_is_the_token_of_the_id_never_the_metadata() {
        assert_eq!(tenant_of("acme.job-1"), "acme");
        assert_eq!(tenant_of("job-1"), "default");
        let mut requests = Requests::new(10);
        // Its metadata says "mallory": a caller's word, not the fleet's.
        requests.apply_result(&result("r1", "COMPLETED", "stop", None), None);
        requests.apply_result(&result("acme.r2", "COMPLETED", "stop", Some("acme")), None);
        requests.apply_live(
            "globex.r3",
            RequestState::Running,
            "w1",
            1,
            SystemTime::now(),
        );
        let tenant = |id: &str| requests.get(id).unwrap().entry.tenant;
        assert_eq!(
            (tenant("r1"), tenant("acme.r2"), tenant("globex.r3")),
            ("default".into(), "acme".into(), "globex".into())
        );
        let page = requests.list(&RequestFilter::default());
        assert_eq!(page.tenants, ["acme", "default", "globex"]);
    }

    #[test]
    fn a_request_whose_metadata_claims_a_tenant_is_listed_under_its_own() {
        let claims_victim = |id: &str, tenant: Option<&str>| {
            let mut claimed = result(id, "COMPLETED", "stop", tenant);
            claimed.metadata.insert("tenant".into(), json!("victim"));
            claimed
        };
        let mut requests = Requests::new(10);
        let now = SystemTime::now();
        // Its result, stored by the worker that ran it, names its tenant as its id does.
        requests.apply_result(&claims_victim("acme.r1", Some("acme")), Some(rfc3339(now)));
        // Its `finished` event, for a request the default tenant sent.
        requests.apply_event(&event(
            "r2",
            0,
            1,
            json!({"event": "finished", "result": claims_victim("r2", None)}),
        ));
        // Only its live record so far: its id on the bus says whose it is.
        requests.apply_live("globex.r3", RequestState::Running, "w1", 1, now);
        let listed: Vec<(String, String)> = requests
            .list(&RequestFilter::default())
            .requests
            .into_iter()
            .map(|r| (r.request_id, r.tenant))
            .collect();
        assert_eq!(
            listed,
            [
                ("globex.r3".to_string(), "globex".to_string()),
                ("r2".into(), "default".into()),
                ("acme.r1".into(), "acme".into()),
            ]
        );
        let victim = serde_json::from_value(json!({"tenant": "victim"})).unwrap();
        assert_eq!(requests.list(&victim).matched, 0);
        assert_eq!(
            requests.list(&RequestFilter::default()).tenants,
            ["acme", "default", "globex"]
        );
    }

    #[test]
    fn the_list_is_filtered_newest_first_and_bounded() {
        let mut requests = Requests::new(3);
        requests.learn_worker("w1", "default");
        requests.learn_worker("w2", "gpu");
        let now = SystemTime::now();
        requests.apply_live("a", RequestState::Running, "w1", 1, now);
        requests.apply_result(
            &result("acme.b", "COMPLETED", "stop", Some("acme")),
            Some(rfc3339(now)),
        );
        requests.apply_live("c", RequestState::Queued, "w2", 1, now);
        let ids = |requests: &Requests, filter: RequestFilter| -> Vec<String> {
            requests
                .list(&filter)
                .requests
                .into_iter()
                .map(|r| r.request_id)
                .collect()
        };
        assert_eq!(
            ids(&requests, RequestFilter::default()),
            ["c", "acme.b", "a"]
        );
        let by = |field: &str, value: &str| {
            serde_json::from_value::<RequestFilter>(json!({ field: value })).unwrap()
        };
        for (filter, wanted) in [
            (by("state", "running"), vec!["a"]),
            (by("state", "QUEUED"), vec!["c"]),
            (by("pool", "GP"), vec!["c"]),
            (by("job", "tria"), vec!["acme.b"]),
            (by("tenant", "acme"), vec!["acme.b"]),
            (by("tenant", "DEFAU"), vec!["c", "a"]),
            (by("id", "b"), vec!["acme.b"]),
            (by("tenant", "other"), vec![]),
        ] {
            assert_eq!(ids(&requests, filter.clone()), wanted, "{filter:?}");
        }
        let page = requests.list(&RequestFilter::default());
        assert_eq!((page.kept, page.max, page.matched), (3, 3, 3));
        assert_eq!(page.pools, ["default", "gpu"]);
        assert_eq!(page.tenants, ["acme", "default"]);
        // Full: the finished one goes first, though it is not the oldest.
        requests.apply_live("d", RequestState::Running, "w1", 1, now);
        assert_eq!(ids(&requests, RequestFilter::default()), ["d", "c", "a"]);
        assert_eq!(kinds(&requests, "c"), ["queued"]);
    }
}
