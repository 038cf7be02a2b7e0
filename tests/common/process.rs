//! A `genfleet` command run as a user runs it: its output read line by line, waited on for what
//! it says, signalled, and killed if the test gives up on it.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::wait;

/// How long a command may take to say it is ready (a cold start on a busy machine).
pub const STARTS_WITHIN: Duration = Duration::from_secs(60);
/// How long it may take to exit once signalled before the test calls it stuck. A command that
/// ignores the signal never exits; one that honours it takes well under a second here.
pub const EXITS_WITHIN: Duration = Duration::from_secs(30);

/// A command under test, killed if the test gives up on it.
pub struct Running {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    pub fn start<K: AsRef<std::ffi::OsStr>>(
        name: &str,
        args: &[&str],
        env: &[(K, String)],
    ) -> Running {
        Running::start_in(name, env!("CARGO_MANIFEST_DIR"), args, env)
    }

    /// Starts it in `dir`.
    pub fn start_in<K: AsRef<std::ffi::OsStr>>(
        name: &str,
        dir: &str,
        args: &[&str],
        env: &[(K, String)],
    ) -> Running {
        let mut child = genfleet_command()
            .current_dir(dir)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name} starts: {e}"));
        let (tx, lines) = mpsc::channel();
        let stdout: Box<dyn Read + Send> = Box::new(child.stdout.take().unwrap());
        let stderr: Box<dyn Read + Send> = Box::new(child.stderr.take().unwrap());
        for output in [stdout, stderr] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(output).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            });
        }
        Running {
            name: name.into(),
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for a line of its output containing `marker`.
    pub fn wait_for(&mut self, marker: &str) {
        let deadline = Instant::now() + STARTS_WITHIN;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let found = line.contains(marker);
                    self.seen.push(line);
                    if found {
                        return;
                    }
                }
                Err(_) => {
                    let _ = self.child.kill();
                    panic!(
                        "{}: never printed {marker:?}; its output:\n{}",
                        self.name,
                        self.seen.join("\n")
                    );
                }
            }
        }
    }

    /// Every line it printed so far.
    pub fn output(&mut self) -> String {
        self.seen.extend(self.lines.try_iter());
        self.seen.join("\n")
    }

    /// Sends `signal` (TERM or INT) and waits for the command to exit.
    pub fn signal_and_wait(mut self, signal: &str) -> ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill -{signal} {pid}");
        let exited = wait::poll_blocking(
            &format!("{} to exit on SIG{signal}", self.name),
            EXITS_WITHIN,
            || self.child.try_wait().expect("waits for the command"),
        );
        exited.unwrap_or_else(|failure| {
            let _ = self.child.kill();
            let _ = self.child.wait();
            self.seen.extend(self.lines.try_iter());
            panic!(
                "{failure}: it ignored SIG{signal}; its output:\n{}",
                self.seen.join("\n")
            );
        })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The genfleet executable, with the OpenTelemetry variables of the shell that runs the tests
/// removed: a process exports traces only where a test asks for it.
pub fn genfleet_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_genfleet"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("OTEL_") {
            command.env_remove(key);
        }
    }
    command
}
