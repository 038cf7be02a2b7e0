//! `genfleet mock-llm`: the scripted OpenAI-compatible server, as a process.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::llm::mock::{self, PrefixCacheSettings, Script};

#[derive(Debug, Args)]
pub struct MockLlmArgs {
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Rules file (.toml or .json); without one every request is answered with its last user
    /// message.
    #[arg(long, value_name = "FILE", conflicts_with = "replay")]
    pub script: Option<PathBuf>,
    /// Answer every chat request with this recorded response exactly as it was recorded: an
    /// SSE transcript (.sse) or a JSON body (e.g. tests/data/backends/vllm/tool_call.sse).
    #[arg(long, value_name = "FILE")]
    pub replay: Option<PathBuf>,
    /// Give the server a prefix cache of this many conversations (overrides the script's
    /// `prefix_cache.entries`; any prefix-cache flag turns the cache on).
    #[arg(long, value_name = "N")]
    pub prefix_cache_entries: Option<usize>,
    /// With the prefix cache: time to first token of a request that starts with a
    /// conversation served recently.
    #[arg(long, value_name = "MS")]
    pub prefix_hit_ms: Option<u64>,
    /// With the prefix cache: time to first token of any other request, per KiB of its
    /// messages' text.
    #[arg(long, value_name = "MS")]
    pub prefill_ms_per_kb: Option<u64>,
}

impl MockLlmArgs {
    /// The script's prefix cache with the flags laid over it; a flag alone turns it on.
    fn prefix_cache(&self, script: Option<PrefixCacheSettings>) -> Option<PrefixCacheSettings> {
        let flagged = self.prefix_cache_entries.is_some()
            || self.prefix_hit_ms.is_some()
            || self.prefill_ms_per_kb.is_some();
        if script.is_none() && !flagged {
            return None;
        }
        let base = script.unwrap_or_default();
        Some(PrefixCacheSettings {
            entries: self.prefix_cache_entries.unwrap_or(base.entries),
            prefix_hit_ms: self.prefix_hit_ms.unwrap_or(base.prefix_hit_ms),
            prefill_ms_per_kb: self.prefill_ms_per_kb.unwrap_or(base.prefill_ms_per_kb),
        })
    }
}

pub async fn run(args: MockLlmArgs) -> anyhow::Result<()> {
    // SIGTERM (a container's stop) or Ctrl-C.
    let shutdown = super::shutdown_signal();
    let mut script = match (&args.script, &args.replay) {
        (Some(path), _) => Script::from_file(path)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("cannot load the script {}", path.display()))?,
        (None, Some(path)) => Script::replay(path).map_err(anyhow::Error::msg)?,
        (None, None) => Script::echo(),
    };
    script.prefix_cache = args.prefix_cache(script.prefix_cache);
    script.validate().map_err(anyhow::Error::msg)?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    // The one line scripts and tests wait for.
    println!("mock-llm listening on http://{addr}/v1");
    tracing::info!(message = "mock-llm serving", %addr, rules = script.rules.len());
    mock::serve(listener, script, shutdown)
        .await
        .context("mock-llm server failed")
}
