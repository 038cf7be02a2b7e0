//! `genfleet gateway`: the OpenAI-compatible front door (see docs/gateway.md).

use anyhow::Context;
use clap::Args;

use crate::gateway::Gateway;
use crate::settings::Settings;

#[derive(Debug, Args)]
#[command(
    after_help = "Callers use any OpenAI client with base URL http://ADDR/v1. API keys are \
configured by their SHA-256 (gateway.api_keys, gateway.api_keys_file); with none the gateway \
listens on loopback only unless gateway.allow_unauthenticated is set. Stops on SIGTERM or \
Ctrl-C, letting open responses finish for gateway.drain_ms. See docs/gateway.md."
)]
pub struct GatewayArgs {
    /// Address to listen on [default: gateway.listen, 127.0.0.1:8081]. Port 0 picks a free
    /// port.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
}

pub async fn run(settings: Settings, args: GatewayArgs) -> anyhow::Result<()> {
    // Installed first, so a signal during the start is not lost.
    let stop = super::shutdown_signal();
    settings.gateway.validate()?;
    let listen = super::listen_addr(args.listen, &settings.gateway.listen, "127.0.0.1:8081")?;
    let started = Gateway::start(&settings, listen);
    let Some(gateway) = super::unless_stopped(&stop, started).await else {
        return Ok(());
    };
    let gateway = gateway?;
    let addr = gateway.addr();
    let keys = match gateway.keys() {
        0 => "no API keys: every caller is let in".to_string(),
        1 => "1 API key".to_string(),
        n => format!("{n} API keys"),
    };
    println!("gateway listening on http://{addr}/v1 ({keys})");
    if gateway.keys() == 0 {
        tracing::warn!(
            message = "no API key is configured: anyone who reaches the gateway may run requests",
            %addr
        );
    }
    gateway
        .run(stop)
        .await
        .context("the gateway's server stopped")?;
    Ok(())
}
