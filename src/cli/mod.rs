//! The `genfleet` command line. Each command lives in its own module; `main` only parses and
//! dispatches, and turns an error into one line and a non-zero exit status.

mod mock_llm;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::telemetry::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "genfleet",
    version,
    about = "A fleet of LLM generation workers on NATS"
)]
pub struct Cli {
    /// Configuration file layered over the built-in defaults (also GENFLEET_CONFIG).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log output: human or json (logs go to stderr; filter with RUST_LOG).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve a scripted OpenAI-compatible chat completions API (for tests, demos, benchmarks).
    MockLlm(mock_llm::MockLlmArgs),
}

impl Cli {
    pub async fn run(self) -> anyhow::Result<()> {
        match self.command {
            Command::MockLlm(args) => mock_llm::run(args).await,
        }
    }
}
