//! `genfleet manager`: the reference manager agent (see docs/manager.md).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, ValueEnum};

use crate::manager::{
    ConsoleHandle, Deliver, LlmPicker, Manager, ManagerOptions, Policy, StdoutSink,
};
use crate::settings::Settings;

#[derive(Debug, Args)]
#[command(
    after_help = "Decisions are answered by the rules first (first match wins); those no \
rule answers go to the console (--interactive) or the model (--llm), else they are left for \
another manager. Stops on SIGTERM or Ctrl-C. See docs/manager.md."
)]
pub struct ManagerArgs {
    /// Name of this manager [default: manager.name, "default"]. Managers with the same name
    /// share the signals between them; managers with different names each see every signal.
    /// Its durable consumer is genfleet-manager-<NAME>.
    #[arg(long)]
    pub name: Option<String>,
    /// Where a new consumer starts: all (every signal still in the stream) or new (only signals
    /// from now on). An existing consumer of the same name resumes where it stopped.
    #[arg(long, value_enum, default_value_t = DeliverArg::All)]
    pub deliver: DeliverArg,
    /// Policy rules: a TOML file of [[rule]] tables [default: manager.rules_file, none].
    #[arg(long, value_name = "FILE")]
    pub rules: Option<PathBuf>,
    /// Ask a person at this terminal about each decision no rule answers, one at a time; the
    /// answer is recorded as decided by human:$USER.
    #[arg(long, conflicts_with_all = ["llm", "json"])]
    pub interactive: bool,
    /// Ask a higher-level model (manager.llm_*, falling back to llm.*) about each decision no
    /// rule answers; recorded as decided by llm:<model>.
    #[arg(long)]
    pub llm: bool,
    /// Print signals and actions as JSON lines instead of the readable log.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeliverArg {
    All,
    New,
}

pub async fn run(settings: Settings, args: ManagerArgs) -> anyhow::Result<()> {
    // Installed first, so a signal during the start is not lost.
    let stop = super::shutdown_signal();
    settings.manager.validate()?;
    let name = args.name.unwrap_or_else(|| settings.manager.name.clone());
    let rules = args.rules.or_else(|| {
        Some(PathBuf::from(&settings.manager.rules_file)).filter(|p| !p.as_os_str().is_empty())
    });
    let policy = match rules {
        Some(path) => Policy::load(&path)?,
        None => Policy::empty(),
    };
    let console = if args.interactive {
        let user = std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "unknown".into());
        let handle = ConsoleHandle::stdio().context("cannot start the console")?;
        Some((handle, format!("human:{user}")))
    } else {
        None
    };
    let llm = if args.llm {
        Some(LlmPicker::from_settings(&settings).context("cannot set up the manager's model")?)
    } else {
        None
    };
    let options = ManagerOptions {
        name,
        deliver: match args.deliver {
            DeliverArg::All => Deliver::All,
            DeliverArg::New => Deliver::New,
        },
        json: args.json,
        policy,
        console,
        llm,
    };
    let started = Manager::start(&settings, options, Arc::new(StdoutSink));
    let Some(manager) = super::unless_stopped(&stop, started).await else {
        return Ok(());
    };
    manager?.run(stop).await?;
    Ok(())
}
