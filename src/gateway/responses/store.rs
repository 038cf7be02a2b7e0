//! Stored responses: what `POST /v1/responses` keeps (with `store`, the default) in a
//! JetStream key-value bucket shared by every gateway replica, so that a
//! `previous_response_id`, a `GET` or a background response's poll works through any of them.
//!
//! Architecture invariant: a response belongs to its tenant. Its key is
//! `<tenant>.<response id>` (`default.<id>` with no keys configured, a name no tenant may take),
//! and every read, write and delete builds the key from the caller's own tenant: another
//! tenant's id names a key that does not exist, so it is a 404 exactly as an unknown one.

use std::time::Duration;

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::client::BusError;
use crate::settings::Settings;

/// Longest response id read from a path: `resp_` and a ULID are 31 characters.
const MAX_ID_LEN: usize = 64;

/// One stored response.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stored {
    /// The response object as `GET /v1/responses/{id}` serves it.
    pub response: Value,
    /// This response's own input items, each with its id (`GET .../input_items`).
    pub input_items: Vec<Value>,
    /// The conversation a `previous_response_id` continues: every chat message of the chain
    /// before this response, its input and its output (never its instructions: OpenAI does
    /// not carry those over).
    pub conversation: Vec<Value>,
    /// The chain's placement key: its requests go first to the worker that served it last.
    pub session: String,
    /// The request on the bus now answering it (a decision chain's last part), for a
    /// background response's poll and cancel.
    pub request_id: String,
    /// Whether it runs in the background (`background: true`).
    #[serde(default)]
    pub background: bool,
}

impl Stored {
    pub fn status(&self) -> &str {
        self.response["status"].as_str().unwrap_or("")
    }

    /// Whether the response reached its end (no longer queued or in progress).
    pub fn is_final(&self) -> bool {
        !matches!(self.status(), "queued" | "in_progress")
    }
}

/// A stored response as read, with its revision for a write that must not overwrite a newer
/// one.
pub struct Read {
    pub stored: Stored,
    pub revision: u64,
}

/// The bucket of stored responses.
#[derive(Clone)]
pub struct Responses {
    bucket: kv::Store,
}

/// Why the store could not be used.
#[derive(Debug, thiserror::Error)]
#[error("the response store: {0}")]
pub struct StoreError(pub String);

impl Responses {
    /// Opens the bucket (`gateway.responses_bucket`), creating it when absent.
    pub async fn open(nats: &async_nats::Client, settings: &Settings) -> Result<Self, BusError> {
        let jetstream = async_nats::jetstream::new(nats.clone());
        let bucket = crate::client::streams::ensure_bucket(
            &jetstream,
            &settings.gateway.responses_bucket,
            1,
            Duration::from_millis(settings.gateway.responses_ttl_ms),
            settings.jetstream.replicas,
        )
        .await?;
        Ok(Responses { bucket })
    }

    /// The stored response of this id in the tenant's keys; `None` when there is none (an id
    /// that is not a response id's shape included).
    pub async fn get(&self, tenant: &str, id: &str) -> Result<Option<Read>, StoreError> {
        let Some(key) = key(tenant, id) else {
            return Ok(None);
        };
        let entry = self
            .bucket
            .entry(key)
            .await
            .map_err(|e| StoreError(e.to_string()))?;
        let Some(entry) = entry else { return Ok(None) };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let stored = serde_json::from_slice(&entry.value)
            .map_err(|e| StoreError(format!("a stored response cannot be read: {e}")))?;
        Ok(Some(Read {
            stored,
            revision: entry.revision,
        }))
    }

    /// Writes a response (new, or over whatever is there).
    pub async fn put(&self, tenant: &str, stored: &Stored) -> Result<u64, StoreError> {
        let key = own_key(tenant, stored)?;
        let body = serde_json::to_vec(stored).expect("stored responses serialize");
        self.bucket
            .put(key, body.into())
            .await
            .map_err(|e| StoreError(e.to_string()))
    }

    /// Writes a response over the revision read; `Ok(false)` when it changed since.
    pub async fn update(
        &self,
        tenant: &str,
        stored: &Stored,
        revision: u64,
    ) -> Result<bool, StoreError> {
        let key = own_key(tenant, stored)?;
        let body = serde_json::to_vec(stored).expect("stored responses serialize");
        match self.bucket.update(key, body.into(), revision).await {
            Ok(_) => Ok(true),
            Err(error) if error.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(false),
            Err(error) => Err(StoreError(error.to_string())),
        }
    }

    /// Deletes the tenant's response of this id; `Ok(false)` when there was none.
    pub async fn delete(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        if self.get(tenant, id).await?.is_none() {
            return Ok(false);
        }
        let key = key(tenant, id).expect("an id that was read has a key");
        self.bucket
            .purge(key)
            .await
            .map_err(|e| StoreError(e.to_string()))?;
        Ok(true)
    }
}

fn own_key(tenant: &str, stored: &Stored) -> Result<String, StoreError> {
    let id = stored.response["id"].as_str().unwrap_or_default();
    key(tenant, id).ok_or_else(|| StoreError(format!("{id:?} is not a response id")))
}

/// The key of a tenant's response: `None` for an id that no response has (so that a caller's
/// id never reaches the bucket as a wildcard, a second token or an empty one).
fn key(tenant: &str, id: &str) -> Option<String> {
    let valid = id.len() <= MAX_ID_LEN
        && id.strip_prefix("resp_").is_some_and(|rest| {
            !rest.is_empty() && rest.chars().all(|c| c.is_ascii_alphanumeric())
        });
    let tenant = if tenant.is_empty() { "default" } else { tenant };
    valid.then(|| format!("{tenant}.{id}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_the_tenant_s_and_only_a_response_id_makes_one() {
        assert_eq!(
            key("team-a", "resp_01ABC").as_deref(),
            Some("team-a.resp_01ABC")
        );
        assert_eq!(key("", "resp_01ABC").as_deref(), Some("default.resp_01ABC"));
        for bad in [
            "",
            "resp_",
            "resp_*",
            "resp_>",
            "resp_a.b",
            "team-b.resp_1",
            "resp_a b",
            "msg_01ABC",
            &format!("resp_{}", "a".repeat(MAX_ID_LEN)),
        ] {
            assert_eq!(key("team-a", bad), None, "{bad:?}");
        }
    }
}
