//! `genfleet console`: the web console (see docs/console.md).

use anyhow::Context;
use clap::Args;

use crate::console::{Console, ConsoleOptions};
use crate::settings::Settings;

#[derive(Debug, Args)]
#[command(
    after_help = "Answering needs console.token (GENFLEET__CONSOLE__TOKEN), typed into the page \
by the person answering; without it the console is read-only. Stops on SIGTERM or Ctrl-C. See \
docs/console.md."
)]
pub struct ConsoleArgs {
    /// Address to listen on [default: console.listen, 127.0.0.1:8080]. Port 0 picks a free
    /// port. Anything but loopback exposes the page to the network: put it behind TLS.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Refuse every answer, even with console.token set.
    #[arg(long)]
    pub read_only: bool,
}

pub async fn run(settings: Settings, args: ConsoleArgs) -> anyhow::Result<()> {
    // Installed first, so a signal during the start is not lost.
    let stop = super::shutdown_signal();
    settings.console.validate()?;
    let listen = super::listen_addr(args.listen, &settings.console.listen, "127.0.0.1:8080")?;
    let started = Console::start(
        &settings,
        ConsoleOptions {
            listen,
            read_only: args.read_only,
        },
    );
    let Some(console) = super::unless_stopped(&stop, started).await else {
        return Ok(());
    };
    let console = console?;
    let addr = console.addr();
    let mode = if console.read_only() {
        "read-only: no console.token"
    } else {
        "answering with console.token"
    };
    println!("console listening on http://{addr} ({mode})");
    if !addr.ip().is_loopback() {
        tracing::warn!(
            message = "the console listens beyond loopback: serve it behind TLS, or the token crosses the network in clear text",
            %addr
        );
    }
    console
        .run(stop)
        .await
        .context("the console's server stopped")?;
    Ok(())
}
