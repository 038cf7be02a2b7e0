//! The `genfleet` command line. Each command lives in its own module; `main` only parses and
//! dispatches, and turns an error into one line and a non-zero exit status.

mod bench;
mod console;
mod demo;
mod fleet;
mod gateway;
mod manager;
mod mock_llm;
mod private_nats;
mod requests;
pub mod tool_demo;
mod worker;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use tracing::Instrument;

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
    /// Run one worker (the main job) until SIGTERM or Ctrl-C, then drain.
    #[command(after_help = WORKER_HELP)]
    Worker(worker::WorkerArgs),
    /// Start a generation request on a worker of a pool.
    Submit(requests::SubmitArgs),
    /// Show the state of a request.
    Status(requests::IdArgs),
    /// Read (and release) the result of a request.
    Result(requests::ResultArgs),
    /// Cancel a running or queued request.
    Cancel(requests::IdArgs),
    /// Answer a decision request: `genfleet decide DECISION_ID OPTION_ID`.
    Decide(requests::DecideArgs),
    /// Serve two example tools (a calculator and a clock) until Ctrl-C.
    ToolDemo(tool_demo::ToolDemoArgs),
    /// List the workers of the fleet with their pools and slots.
    Fleet(fleet::FleetArgs),
    /// Follow the fleet's signals and answer decisions by rules, at a console or by a model.
    Manager(manager::ManagerArgs),
    /// Serve the web console: the fleet live, the signals, and the decisions to answer.
    Console(console::ConsoleArgs),
    /// Serve an OpenAI-compatible chat completions API in front of the fleet.
    Gateway(gateway::GatewayArgs),
    /// Serve a scripted OpenAI-compatible chat completions API (for tests, demos, benchmarks).
    MockLlm(mock_llm::MockLlmArgs),
    /// Load a fleet (or a private one, --local) and report latency, throughput, the streaming
    /// relay and memory against the floors of NATS and the backend.
    Bench(Box<bench::BenchArgs>),
    /// Run the whole flow on this machine, narrated: a private nats-server, the mock backend, a
    /// worker, a tool service, a manager, and a job through a tool call and a decision.
    Demo(demo::DemoArgs),
}

/// What `genfleet worker --help` adds: the settings a worker is usually started with.
const WORKER_HELP: &str = "\
Settings come from the built-in defaults, a file (--config or GENFLEET_CONFIG) and the
environment (GENFLEET__SECTION__KEY). A worker is usually started with:
  GENFLEET__NATS__URL       NATS servers                       [default: nats://127.0.0.1:4222]
  GENFLEET__WORKER__POOL    the pool it serves                 [default: default]
  GENFLEET__WORKER__SLOTS   requests it runs at once           [default: 4]
  GENFLEET__LLM__BASE_URL   the OpenAI-compatible backend      [default: http://127.0.0.1:8000/v1]
  GENFLEET__LLM__MODEL      the model the backend serves       [default: default]
  GENFLEET__LLM__API_KEY    the backend's key, if it needs one
Every setting, with its default and variable: docs/configuration.md (and config/default.toml).
Backends and their settings: docs/backends.md.";

impl Cli {
    /// The log level when RUST_LOG is unset: services narrate, one-shot commands stay quiet.
    pub fn default_log_level(&self) -> &'static str {
        match self.command {
            Command::Worker(_)
            | Command::MockLlm(_)
            | Command::ToolDemo(_)
            | Command::Console(_)
            | Command::Gateway(_) => "info",
            _ => "warn",
        }
    }

    /// What the services export as traces: the `[telemetry]` section, each process under a
    /// `service.name` of its own unless configured; `submit` too, whose span is the root of
    /// the request's trace. `None` for the other one-shot commands, and when the settings do not
    /// load (the command then says why).
    pub fn traces(&self) -> Option<crate::telemetry::Traces> {
        let service = match self.command {
            Command::Worker(_) => "genfleet-worker",
            Command::ToolDemo(_) => "genfleet-tool-demo",
            Command::Manager(_) => "genfleet-manager",
            Command::Console(_) => "genfleet-console",
            Command::Submit(_) => "genfleet-submit",
            Command::Gateway(_) => "genfleet-gateway",
            _ => return None,
        };
        let telemetry = crate::settings::Settings::load(self.config.as_deref())
            .ok()?
            .telemetry;
        Some(crate::telemetry::Traces {
            enabled: telemetry.enabled,
            endpoint: telemetry.endpoint,
            protocol: telemetry.protocol,
            service_name: Some(telemetry.service_name)
                .filter(|name| !name.is_empty())
                .unwrap_or_else(|| service.to_string()),
            max_queue_size: telemetry.max_queue_size,
        })
    }

    /// Runs the command. The worker and the gateway build their own runtimes, of
    /// `worker.threads` and `gateway.threads` (one thread by default; the worker's carries its
    /// actix system); every other command runs on a plain tokio runtime.
    pub fn run(self) -> anyhow::Result<()> {
        let config_file = self.config.clone();
        let settings = || crate::settings::Settings::load(self.config.as_deref());
        match self.command {
            Command::Worker(args) => worker::run(settings()?, args),
            Command::Gateway(args) => {
                let settings = settings()?;
                crate::bus::worker::runtime(settings.gateway.threads)?
                    .block_on(gateway::run(settings, args))
            }
            command => {
                let runtime = tokio::runtime::Runtime::new()?;
                runtime.block_on(async move {
                    match command {
                        Command::Submit(args) => {
                            // With traces exported, the request's trace starts here.
                            let span = tracing::info_span!("genfleet.submit");
                            requests::submit(settings()?, args).instrument(span).await
                        }
                        Command::Status(args) => requests::status(settings()?, args).await,
                        Command::Result(args) => requests::result(settings()?, args).await,
                        Command::Cancel(args) => requests::cancel(settings()?, args).await,
                        Command::Fleet(args) => fleet::run(settings()?, args).await,
                        Command::Manager(args) => manager::run(settings()?, args).await,
                        Command::Console(args) => console::run(settings()?, args).await,
                        Command::Decide(args) => requests::decide(settings()?, args).await,
                        Command::ToolDemo(args) => tool_demo::run(settings()?, args).await,
                        Command::MockLlm(args) => mock_llm::run(args).await,
                        Command::Demo(args) => demo::run(args).await,
                        Command::Bench(args) => bench::run(settings()?, config_file, *args).await,
                        Command::Worker(_) | Command::Gateway(_) => {
                            unreachable!("handled above")
                        }
                    }
                })
            }
        }
    }
}

/// How a long-running command is asked to stop: SIGTERM (Kubernetes) or SIGINT (Ctrl-C).
/// Cloned, it can be awaited at several points (the start-up, then the serving).
pub(crate) type Stop = Shared<BoxFuture<'static, ()>>;

/// Listens for SIGTERM and SIGINT. The handlers are installed when this is called (not when the
/// future is first polled), so a signal that comes while the command is still starting is not
/// lost to the default action. Must be called inside a tokio runtime.
pub(crate) fn shutdown_signal() -> Stop {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let interrupt = signal(SignalKind::interrupt());
        async move {
            match (term, interrupt) {
                (Ok(mut term), Ok(mut interrupt)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = interrupt.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
        .boxed()
        .shared()
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
        .boxed()
        .shared()
    }
}

/// Runs a command's start-up unless it is asked to stop first: `None` then, the start-up
/// dropped where it was (waiting for NATS, say), so a signal stops a command at any point.
pub(crate) async fn unless_stopped<T>(
    stop: &Stop,
    start: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        () = stop.clone() => {
            tracing::info!(message = "stopped while starting");
            None
        }
        value = start => Some(value),
    }
}

/// The address a server command listens on: its `--listen`, else the configured one.
/// `example` is shown when the address does not parse.
pub(crate) fn listen_addr(
    flag: Option<String>,
    configured: &str,
    example: &str,
) -> anyhow::Result<std::net::SocketAddr> {
    use anyhow::Context;
    let listen = flag.unwrap_or_else(|| configured.to_string());
    listen
        .parse()
        .with_context(|| format!("--listen {listen:?} is not an address like {example}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every command and every argument says what it is for in `--help`.
    #[test]
    fn every_command_and_argument_has_a_description() {
        fn walk(command: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in command.get_arguments() {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "version") {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in command.get_subcommands() {
                if sub.get_about().is_none() && sub.get_long_about().is_none() {
                    missing.push(format!("{path} {}", sub.get_name()));
                }
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "genfleet", &mut missing);
        assert!(missing.is_empty(), "without a description: {missing:#?}");
    }

    #[test]
    fn worker_help_names_the_usual_settings_and_where_the_rest_are() {
        let mut command = Cli::command();
        let help = command
            .find_subcommand_mut("worker")
            .unwrap()
            .render_long_help()
            .to_string();
        for needed in [
            "GENFLEET__WORKER__POOL",
            "GENFLEET__WORKER__SLOTS",
            "GENFLEET__LLM__BASE_URL",
            "GENFLEET__LLM__MODEL",
            "GENFLEET__NATS__URL",
            "docs/configuration.md",
        ] {
            assert!(help.contains(needed), "{needed} missing from\n{help}");
        }
    }
}
