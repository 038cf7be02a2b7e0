//! `genfleet mock-llm`: the scripted OpenAI-compatible server, as a process.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::llm::mock::{self, Script};

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
}

pub async fn run(args: MockLlmArgs) -> anyhow::Result<()> {
    // SIGTERM (a container's stop) or Ctrl-C.
    let shutdown = super::shutdown_signal();
    let script = match (&args.script, &args.replay) {
        (Some(path), _) => Script::from_file(path)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("cannot load the script {}", path.display()))?,
        (None, Some(path)) => Script::replay(path).map_err(anyhow::Error::msg)?,
        (None, None) => Script::echo(),
    };
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
