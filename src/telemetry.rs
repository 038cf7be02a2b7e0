//! Logging, set up once per process: human-readable or JSON lines, filtered by `RUST_LOG`
//! (default `info` for services, `warn` for one-shot commands).

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

/// Installs the global subscriber at `default_level` unless `RUST_LOG` says otherwise. Logs go
/// to stderr so stdout stays for command output; colours only when stderr is a terminal and
/// `NO_COLOR` is unset, so files and log collectors get plain text.
pub fn init(format: LogFormat, default_level: &str) {
    use std::io::IsTerminal;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
