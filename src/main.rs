use clap::Parser;

use genfleet::cli::Cli;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    genfleet::telemetry::init(cli.log_format);
    match cli.run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // One line: the error and its causes.
            eprintln!("genfleet: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
