//! A real `nats-server` per test: JetStream on, its own store directory, a free port on
//! 127.0.0.1, killed and cleaned up on drop. Tests run in parallel, each with its own server.
//!
//! Readiness is the server's own INFO line carrying the unique `server_name` this harness gave
//! it, so a test never talks to another process that happens to hold the port.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// How long a server may take to start answering.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a restart keeps trying to bind the port the killed server held.
const REBIND_TIMEOUT: Duration = Duration::from_secs(5);
/// The pause between two looks of the bounded start loops below, each of which fails loudly
/// with the server's log (they hold the process, so they keep their own loop rather than
/// `wait::until`'s).
const POLL: Duration = Duration::from_millis(20);

pub struct NatsServer {
    /// Declared first so the process dies before its directory is removed.
    child: Option<Child>,
    port: u16,
    name: String,
    config: PathBuf,
    dir: tempfile::TempDir,
}

/// Why a launch did not produce a ready server.
enum LaunchError {
    /// The process exited; the port may have been taken between `free_port` and the bind.
    Exited(String),
}

impl NatsServer {
    /// A plain server (no authentication, no TLS) with JetStream.
    pub async fn start() -> NatsServer {
        Self::start_with_config("").await
    }

    /// A server whose generated configuration (name, port, JetStream store) is followed by
    /// `conf`: authorization, TLS, accounts, a monitoring port ...
    pub async fn start_with_config(conf: &str) -> NatsServer {
        let mut last = String::new();
        // A port handed out by `free_port` can be taken again before the server binds it.
        for _ in 0..3 {
            let mut server = Self::configure(free_port(), conf);
            match server.launch(READY_TIMEOUT).await {
                Ok(()) => return server,
                Err(LaunchError::Exited(log)) if log.contains("address already in use") => {
                    last = log;
                }
                Err(LaunchError::Exited(log)) => {
                    panic!("nats-server exited at start; its log:\n{log}")
                }
            }
        }
        panic!("nats-server found no free port in 3 tries; its last log:\n{last}");
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding the configuration, the log and the JetStream store; tests may put
    /// their certificates or keys here too.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// SIGKILL, and waits for the process to end. The store directory stays.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().await.expect("nats-server can be killed");
        }
    }

    /// Starts the server again on the same port with the same store, so JetStream data
    /// survives. Kills the running one first if there is one.
    pub async fn restart(&mut self) {
        self.kill().await;
        let started = Instant::now();
        loop {
            match self.launch(READY_TIMEOUT).await {
                Ok(()) => return,
                Err(LaunchError::Exited(log)) => {
                    if started.elapsed() > REBIND_TIMEOUT {
                        panic!(
                            "nats-server did not restart on port {} within {REBIND_TIMEOUT:?}; its log:\n{log}",
                            self.port
                        );
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        }
    }

    /// A plain connection for test set-up and checks (no credentials, no TLS).
    pub async fn client(&self) -> async_nats::Client {
        let url = self.url();
        tokio::time::timeout(READY_TIMEOUT, async_nats::connect(url.as_str()))
            .await
            .unwrap_or_else(|_| panic!("connecting to {url} timed out"))
            .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
    }

    fn configure(port: u16, conf: &str) -> NatsServer {
        let dir = tempfile::Builder::new()
            .prefix("genfleet-nats-")
            .tempdir()
            .expect("a temp dir for nats-server");
        // Unique per server: readiness checks that the INFO line names it.
        let name = format!(
            "genfleet-test-{port}-{}",
            dir.path()
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .trim_start_matches("genfleet-nats-")
        );
        let store = dir.path().join("jetstream");
        let config = dir.path().join("nats-server.conf");
        let text = format!(
            "server_name: \"{name}\"\n\
             listen: \"127.0.0.1:{port}\"\n\
             jetstream {{\n  store_dir: \"{}\"\n  max_memory_store: 268435456\n  max_file_store: 1073741824\n}}\n\
             {conf}\n",
            store.display()
        );
        std::fs::write(&config, text).expect("nats-server config written");
        NatsServer {
            child: None,
            port,
            name,
            config,
            dir,
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    /// What the server wrote to its log so far.
    pub fn log_text(&self) -> String {
        self.log()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Spawns the process and waits until it answers with its own INFO line.
    async fn launch(&mut self, timeout: Duration) -> Result<(), LaunchError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("nats-server log opened");
        let child = Command::new(binary())
            .arg("-c")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle cloned"))
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("nats-server spawns");
        self.child = Some(child);
        let started = Instant::now();
        loop {
            let child = self.child.as_mut().expect("just spawned");
            if child.try_wait().expect("nats-server status").is_some() {
                self.child = None;
                return Err(LaunchError::Exited(self.log()));
            }
            if self.answers().await {
                return Ok(());
            }
            if started.elapsed() > timeout {
                self.kill().await;
                panic!(
                    "nats-server on port {} not ready within {timeout:?}; its log:\n{}",
                    self.port,
                    self.log()
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Whether the port answers with an INFO line naming this server.
    async fn answers(&self) -> bool {
        let info = async {
            let stream = TcpStream::connect(("127.0.0.1", self.port)).await.ok()?;
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line).await.ok()?;
            Some(line)
        };
        match tokio::time::timeout(Duration::from_secs(1), info).await {
            Ok(Some(line)) => {
                line.starts_with("INFO ")
                    && line.contains(&format!("\"server_name\":\"{}\"", self.name))
            }
            _ => false,
        }
    }
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

/// `NATS_SERVER`, else `nats-server` on PATH (or in /usr/sbin, where Debian puts it and where a
/// non-root PATH may not look).
fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("NATS_SERVER") {
        return PathBuf::from(path);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!("nats-server not found (NATS_SERVER or PATH): install nats-server: ./scripts/test.sh does it")
        })
}
