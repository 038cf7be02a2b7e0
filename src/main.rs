use clap::Parser;

use genfleet::cli::Cli;

/// mimalloc: a worker allocates and frees small buffers for every event, chunk and message it
/// handles; glibc's malloc took about a tenth of its CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let traces = cli.traces();
    let telemetry =
        match genfleet::telemetry::init(cli.log_format, cli.default_log_level(), traces.as_ref()) {
            Ok(telemetry) => telemetry,
            Err(error) => {
                eprintln!("genfleet: {error}");
                return std::process::ExitCode::FAILURE;
            }
        };
    let code = match cli.run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // One line: the error and its causes.
            eprintln!("genfleet: {error:#}");
            std::process::ExitCode::FAILURE
        }
    };
    // After the command's own shutdown (a worker's drain): the last spans are sent.
    telemetry.shutdown();
    code
}
