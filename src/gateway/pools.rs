//! Which model names the gateway serves: the pools the workers announce on the service API
//! (`$SRV.INFO.genfleet`, their `pool` metadata), the pool of the configuration
//! (`worker.pool`), and the names of `gateway.models`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use super::mapping::Route;
use crate::client::Client;
use crate::settings::Settings;

/// Pools asked for less than this long ago are not asked again, even when `fresh`.
const JUST_ASKED: Duration = Duration::from_secs(1);

/// The pools seen lately, asked again when older than `gateway.pools_refresh_ms`.
pub struct Pools {
    models: std::collections::BTreeMap<String, crate::settings::GatewayModel>,
    configured: BTreeSet<String>,
    refresh: Duration,
    seen: Mutex<Option<(Instant, BTreeSet<String>)>>,
}

impl Pools {
    pub fn new(settings: &Settings) -> Pools {
        let mut configured: BTreeSet<String> = settings
            .gateway
            .models
            .values()
            .map(|m| m.pool.clone())
            .collect();
        configured.insert(settings.worker.pool.clone());
        Pools {
            models: settings.gateway.models.clone(),
            configured,
            refresh: Duration::from_millis(settings.gateway.pools_refresh_ms),
            seen: Mutex::new(None),
        }
    }

    /// Where `model` goes: a configured name first, then a pool's own name. `None`: unknown.
    pub async fn route(&self, client: &Client, model: &str) -> Option<Route> {
        if let Some(entry) = self.models.get(model) {
            return Some(Route {
                pool: entry.pool.clone(),
                model: (!entry.model.is_empty()).then(|| entry.model.clone()),
            });
        }
        let pool = Route {
            pool: model.to_string(),
            model: None,
        };
        if self.configured.contains(model) {
            return Some(pool);
        }
        if self.live(client, false).await.contains(model) {
            return Some(pool);
        }
        // A worker of a new pool may have started since the last look.
        self.live(client, true)
            .await
            .contains(model)
            .then_some(pool)
    }

    /// Every model name served: (name, pool).
    pub async fn list(&self, client: &Client) -> Vec<(String, String)> {
        let mut pools = self.configured.clone();
        pools.extend(self.live(client, false).await);
        let mut names: Vec<(String, String)> = pools.into_iter().map(|p| (p.clone(), p)).collect();
        names.extend(
            self.models
                .iter()
                .map(|(name, entry)| (name.clone(), entry.pool.clone())),
        );
        names.sort();
        names.dedup();
        names
    }

    /// The pools the workers announce; asked again when stale, or when `fresh` unless they
    /// were just asked.
    async fn live(&self, client: &Client, fresh: bool) -> BTreeSet<String> {
        let mut seen = self.seen.lock().await;
        let age_limit = if fresh { JUST_ASKED } else { self.refresh };
        if let Some((at, pools)) = &*seen
            && at.elapsed() < age_limit
        {
            return pools.clone();
        }
        let pools = ask(client).await;
        *seen = Some((Instant::now(), pools.clone()));
        pools
    }
}

async fn ask(client: &Client) -> BTreeSet<String> {
    client.pools_served().await
}
