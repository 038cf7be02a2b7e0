//! The worker's tool catalog: definitions from the configuration, and registrations in KV
//! bucket `GENFLEET_TOOLS` (key = tool name), watched so a tool service can register, update or
//! withdraw a tool while workers run. A registration overrides a configured tool of the same
//! name; an invalid one is skipped with a warning.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures_util::StreamExt;

use super::BusError;
use super::store::ensure_bucket;
use crate::engine::Engine;
use crate::settings::Settings;
use crate::tools::{Tool, ToolCatalog, ToolDefinition};

/// Opens the bucket, installs the current catalog in `engine`, and keeps it current.
pub async fn follow_tools(
    js: &async_nats::jetstream::Context,
    settings: &Settings,
    engine: Arc<Engine>,
) -> Result<tokio::task::JoinHandle<()>, BusError> {
    let bucket = ensure_bucket(
        js,
        &settings.tools.bucket,
        1,
        Duration::ZERO,
        settings.jetstream.replicas,
    )
    .await?;
    let configured = settings.tools.definitions.clone();
    for definition in &configured {
        Tool::new(definition.clone())
            .map_err(|e| BusError::Setup(format!("tools.definitions: {e}")))?;
    }
    let mut registered = BTreeMap::new();
    let mut keys = bucket
        .keys()
        .await
        .map_err(|e| BusError::Setup(format!("cannot list the tools: {e}")))?;
    while let Some(Ok(key)) = keys.next().await {
        if let Ok(Some(value)) = bucket.get(&key).await {
            registered.insert(key, value.to_vec());
        }
    }
    engine.set_catalog(build(&configured, &registered));
    // Watch from the latest value of every key: what changed since the listing comes again,
    // and applying it twice is harmless.
    let mut watch = bucket
        .watch_with_history(">")
        .await
        .map_err(|e| BusError::Setup(format!("cannot watch the tools: {e}")))?;
    Ok(tokio::spawn(async move {
        while let Some(entry) = watch.next().await {
            let Ok(entry) = entry else { continue };
            match entry.operation {
                kv::Operation::Put => {
                    if registered
                        .get(&entry.key)
                        .is_some_and(|v| v[..] == entry.value[..])
                    {
                        continue;
                    }
                    registered.insert(entry.key.clone(), entry.value.to_vec());
                    tracing::info!(message = "tool registered", tool = %entry.key);
                }
                kv::Operation::Delete | kv::Operation::Purge => {
                    if registered.remove(&entry.key).is_none() {
                        continue;
                    }
                    tracing::info!(message = "tool withdrawn", tool = %entry.key);
                }
            }
            engine.set_catalog(build(&configured, &registered));
        }
    }))
}

fn build(configured: &[ToolDefinition], registered: &BTreeMap<String, Vec<u8>>) -> ToolCatalog {
    let mut tools: BTreeMap<String, Tool> = BTreeMap::new();
    for definition in configured {
        if let Ok(tool) = Tool::new(definition.clone()) {
            tools.insert(tool.name().to_string(), tool);
        }
    }
    for (key, value) in registered {
        let parsed = serde_json::from_slice::<ToolDefinition>(value)
            .map_err(|e| e.to_string())
            .and_then(|d| {
                if &d.name == key {
                    Tool::new(d).map_err(|e| e.to_string())
                } else {
                    Err(format!(
                        "the key {key:?} differs from the definition's name {:?}",
                        d.name
                    ))
                }
            });
        match parsed {
            Ok(tool) => {
                tools.insert(key.clone(), tool);
            }
            Err(reason) => {
                tracing::warn!(message = "skipped an invalid tool registration", tool = %key, %reason)
            }
        }
    }
    ToolCatalog::from_tools(tools.into_values())
}
