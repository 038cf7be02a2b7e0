use clap::Parser;

use genfleet::cli::Cli;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    genfleet::telemetry::init(cli.log_format, cli.default_log_level());
    match cli.run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // One line: the error and its causes.
            eprintln!("genfleet: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
