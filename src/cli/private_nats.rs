//! A nats-server of the command's own (JetStream, a free loopback port, a store in a temporary
//! directory), for `genfleet demo` and `genfleet bench --local`. The server is killed and the
//! directory removed on drop, so an error or Ctrl-C leaves nothing behind.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::process::{Child, Command};

/// How long the server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Starts tried, each on ports of its own, before giving up on a server that exits at once.
const START_TRIES: u32 = 5;

pub struct PrivateNats {
    pub url: String,
    /// The binary that runs.
    pub binary: PathBuf,
    /// `http://127.0.0.1:PORT` of the monitoring endpoints (`/varz`, `/jsz`), when asked for.
    pub monitor_url: Option<String>,
    child: Child,
}

/// Whether the server also serves its monitoring endpoints (on loopback, like its clients).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Monitoring {
    Off,
    On,
}

impl PrivateNats {
    /// Starts `nats-server` (or `given`) with its store under `dir`, and waits until it
    /// accepts connections.
    pub async fn start(given: Option<&Path>, dir: &Path) -> anyhow::Result<PrivateNats> {
        Self::start_with(given, dir, Monitoring::Off).await
    }

    /// [`PrivateNats::start`], with the monitoring port if asked: `-m` binds the address `-a`
    /// gives, so it listens on loopback only.
    pub async fn start_with(
        given: Option<&Path>,
        dir: &Path,
        monitoring: Monitoring,
    ) -> anyhow::Result<PrivateNats> {
        let binary = find_nats_server(given)?;
        let mut tries = 0;
        loop {
            tries += 1;
            // A free port is free when chosen; another process may bind it before the server
            // does, and the server then exits at once: it is started again on other ports.
            let port = free_port()?;
            let monitor_port = match monitoring {
                Monitoring::On => Some(free_port()?),
                Monitoring::Off => None,
            };
            let mut command = Command::new(&binary);
            command.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
            if let Some(monitor_port) = monitor_port {
                command.args(["-m", &monitor_port.to_string()]);
            }
            command
                .args(["-js", "-sd"])
                .arg(dir.join("jetstream"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true);
            // Its own process group: a Ctrl-C at the terminal reaches genfleet only, which
            // stops what it started with the server still there, and the server last.
            #[cfg(unix)]
            command.process_group(0);
            let child = command
                .spawn()
                .with_context(|| format!("cannot start {}", binary.display()))?;
            let mut nats = PrivateNats {
                url: format!("nats://127.0.0.1:{port}"),
                binary: binary.clone(),
                monitor_url: monitor_port.map(|p| format!("http://127.0.0.1:{p}")),
                child,
            };
            match wait_for_nats(&nats.url, &mut nats.child).await {
                Ok(()) => return Ok(nats),
                Err(Unstarted::Exited(status)) if tries < START_TRIES => {
                    tracing::debug!(message = "nats-server exited at start; starting it again on other ports", %status);
                }
                Err(Unstarted::Exited(status)) => anyhow::bail!(
                    "nats-server exited at start ({status}), {tries} times: is {} a working nats-server?",
                    nats.binary.display()
                ),
                Err(Unstarted::Silent(error)) => {
                    anyhow::bail!("nats-server did not come up at {}: {error}", nats.url)
                }
            }
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Stops the server now (dropping it does too, without waiting).
    pub async fn stop(&mut self) {
        let _ = self.child.kill().await;
    }
}

fn find_nats_server(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = given {
        return Ok(path.to_path_buf());
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/usr/local/sbin", "/usr/local/bin", "/usr/bin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
        .context(
            "nats-server was not found: run ./scripts/demo.sh (it installs it), install it with \
             `sudo apt-get install nats-server`, or pass --nats-server PATH",
        )
}

/// A port nothing listens on now (loopback).
pub fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Why a started server is not there.
enum Unstarted {
    /// It exited (its port taken, most likely).
    Exited(std::process::ExitStatus),
    /// It runs but accepted no connection within [`START_TIMEOUT`].
    Silent(async_nats::ConnectError),
}

async fn wait_for_nats(url: &str, child: &mut Child) -> Result<(), Unstarted> {
    let started = Instant::now();
    loop {
        match async_nats::connect(url).await {
            Ok(_) => return Ok(()),
            Err(error) => {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(Unstarted::Exited(status));
                }
                if started.elapsed() >= START_TIMEOUT {
                    return Err(Unstarted::Silent(error));
                }
                tracing::debug!(%error, "nats-server not up yet");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A directory removed on drop (the store, scripts, logs).
pub struct TempDir(PathBuf);

impl TempDir {
    /// `<temp>/<prefix>-<ulid>`.
    pub fn new(prefix: &str) -> anyhow::Result<TempDir> {
        let path =
            std::env::temp_dir().join(format!("{prefix}-{}", crate::protocol::ids::new_id()));
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(TempDir(path))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
