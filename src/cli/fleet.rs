//! `genfleet fleet`: every worker that answers the service API, with its pool and slots.

use std::time::Duration;

use clap::Args;
use futures_util::StreamExt;

use crate::client::Client;
use crate::settings::Settings;

#[derive(Debug, Args)]
pub struct FleetArgs {
    /// Print one JSON object per worker.
    #[arg(long)]
    pub json: bool,
    /// How long to collect answers.
    #[arg(long, default_value_t = 500)]
    pub wait_ms: u64,
}

pub async fn run(settings: Settings, args: FleetArgs) -> anyhow::Result<()> {
    let client = Client::connect(&settings).await?;
    let nats = client.nats();
    let inbox = nats.new_inbox();
    let mut replies = nats.subscribe(inbox.clone()).await?;
    nats.publish_with_reply("$SRV.STATS.genfleet", inbox.clone(), "".into())
        .await?;
    let mut workers = Vec::new();
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_millis(args.wait_ms), replies.next()).await
    {
        if let Ok(stats) = serde_json::from_slice::<serde_json::Value>(&message.payload) {
            workers.push(stats);
        }
    }
    let info_inbox = nats.new_inbox();
    let mut infos = nats.subscribe(info_inbox.clone()).await?;
    nats.publish_with_reply("$SRV.INFO.genfleet", info_inbox, "".into())
        .await?;
    let mut metadata = std::collections::HashMap::new();
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_millis(args.wait_ms), infos.next()).await
    {
        if let Ok(info) = serde_json::from_slice::<serde_json::Value>(&message.payload)
            && let Some(id) = info["id"].as_str()
        {
            metadata.insert(id.to_string(), info["metadata"].clone());
        }
    }
    workers.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    if !args.json {
        println!(
            "{:<40} {:<16} {:>5} {:>5} {:>5}  VERSION",
            "WORKER", "POOL", "SLOTS", "BUSY", "FREE"
        );
    }
    let (mut slots, mut busy) = (0, 0);
    for stats in &workers {
        let id = stats["id"].as_str().unwrap_or_default();
        let meta = metadata.get(id).cloned().unwrap_or_default();
        let data = &stats["endpoints"][0]["data"];
        slots += data["slots"].as_u64().unwrap_or(0);
        busy += data["busy"].as_u64().unwrap_or(0);
        if args.json {
            let row = serde_json::json!({
                "worker_id": meta["worker_id"], "service_id": id, "pool": meta["pool"],
                "slots": data["slots"], "busy": data["busy"], "free": data["free"],
                "draining": data["draining"], "version": stats["version"],
            });
            println!("{row}");
        } else {
            println!(
                "{:<40} {:<16} {:>5} {:>5} {:>5}  {}{}",
                meta["worker_id"].as_str().unwrap_or(id),
                meta["pool"].as_str().unwrap_or("?"),
                count(&data["slots"]),
                count(&data["busy"]),
                count(&data["free"]),
                stats["version"].as_str().unwrap_or("?"),
                if data["draining"] == true {
                    " (draining)"
                } else {
                    ""
                }
            );
        }
    }
    if !args.json {
        let n = workers.len();
        let plural = if n == 1 { "" } else { "s" };
        println!("{n} worker{plural}, {busy}/{slots} slots busy");
    }
    Ok(())
}

/// A number of the stats as a string, so the table's widths apply (`?` when missing).
fn count(value: &serde_json::Value) -> String {
    value
        .as_u64()
        .map_or_else(|| "?".to_string(), |n| n.to_string())
}
