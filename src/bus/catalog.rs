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
use crate::tools::{Tool, ToolCatalog, ToolDefinition, parse_definition};

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
    let configured = configured_tools(settings)?;
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
        let parsed = serde_json::from_slice::<serde_json::Value>(value)
            .map_err(|e| e.to_string())
            .and_then(|v| {
                let (d, legacy) = parse_definition(v)?;
                if legacy {
                    tracing::warn!(message = "converted a legacy tool registration", tool = %key);
                }
                Ok(d)
            })
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

/// The definitions of the configuration: `tools.definitions` and the files of
/// `tools.definitions_dir`, each checked (an invalid one stops the worker with the reason).
pub fn configured_tools(settings: &Settings) -> Result<Vec<ToolDefinition>, BusError> {
    let mut values: Vec<(String, serde_json::Value)> = settings
        .tools
        .definitions
        .iter()
        .enumerate()
        .map(|(i, v)| (format!("tools.definitions[{i}]"), v.clone()))
        .collect();
    if !settings.tools.definitions_dir.is_empty() {
        let dir = std::path::Path::new(&settings.tools.definitions_dir);
        let entries = std::fs::read_dir(dir).map_err(|e| {
            BusError::Setup(format!("tools.definitions_dir {}: {e}", dir.display()))
        })?;
        let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            let text = || {
                std::fs::read_to_string(&path)
                    .map_err(|e| BusError::Setup(format!("{}: {e}", path.display())))
            };
            let value = match path.extension().and_then(|e| e.to_str()) {
                Some("json") => serde_json::from_str(&text()?)
                    .map_err(|e| BusError::Setup(format!("{}: {e}", path.display())))?,
                Some("toml") => config::Config::builder()
                    .add_source(config::File::from_str(&text()?, config::FileFormat::Toml))
                    .build()
                    .and_then(|c| c.try_deserialize::<serde_json::Value>())
                    .map_err(|e| BusError::Setup(format!("{}: {e}", path.display())))?,
                _ => continue,
            };
            values.push((path.display().to_string(), value));
        }
    }
    let mut definitions = Vec::new();
    for (origin, value) in values {
        let (definition, legacy) =
            parse_definition(value).map_err(|e| BusError::Setup(format!("{origin}: {e}")))?;
        if legacy {
            tracing::warn!(message = "converted a legacy tool definition", %origin, tool = %definition.name);
        }
        Tool::new(definition.clone()).map_err(|e| BusError::Setup(format!("{origin}: {e}")))?;
        definitions.push(definition);
    }
    Ok(definitions)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn definitions_come_from_the_config_and_a_directory_in_either_form() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("greet.toml"),
            "name = \"greet\"\nbrief = \"Greet a person by name\"\n[schema]\ntype = \"object\"\n[schema.properties.name]\ntype = \"string\"\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("old.json"),
            r#"{"name": "old", "description": "Store a value for later.", "required_fields": ["value"]}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a definition").unwrap();
        let mut settings = Settings::defaults();
        settings.tools.definitions = vec![
            serde_json::json!({"name": "add", "brief": "Add two numbers", "schema": {"type": "object"}}),
        ];
        settings.tools.definitions_dir = dir.path().display().to_string();
        let names: Vec<String> = configured_tools(&settings)
            .unwrap()
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["add", "greet", "old"]);

        std::fs::write(
            dir.path().join("bad.json"),
            r#"{"name": "bad", "brief": "The bad tool", "schema": {"type": "object"}}"#,
        )
        .unwrap();
        let err = configured_tools(&settings).unwrap_err().to_string();
        assert!(err.contains("bad.json") && err.contains("verb"), "{err}");
    }
}
