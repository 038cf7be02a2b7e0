//! `genfleet bench --local`: a private fleet on this machine. A nats-server (JetStream, a free
//! port, its monitoring port, a temporary store), the mock backend as its own `genfleet mock-llm` process and each
//! worker as its own `genfleet worker` process, so that the CPU time and memory of each can be
//! read from `/proc` apart from the load generator's. Everything is killed and the store
//! removed when the fleet is dropped, also after an error or Ctrl-C.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::procstat::Watched;
use super::workload;
use crate::cli::private_nats::{Monitoring, PrivateNats, TempDir, free_port};

/// How long a process of the fleet may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(50);

/// How the private fleet is made.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    pub nats_server: Option<PathBuf>,
    /// The configuration file the bench itself was given, passed on to the workers.
    pub config: Option<PathBuf>,
    pub pool: String,
    pub workers: u32,
    pub slots: u32,
    pub token_delay_ms: u64,
}

pub struct LocalFleet {
    pub nats_url: String,
    /// nats-server's monitoring endpoints (`http://127.0.0.1:PORT`).
    pub monitor_url: String,
    /// The mock backend's OpenAI base URL (`http://127.0.0.1:PORT/v1`).
    pub backend_url: String,
    pub workers: Vec<LocalWorker>,
    options: LocalOptions,
    nats: PrivateNats,
    mock: Child,
    /// Declared last: the processes above are killed (on drop) before it is removed.
    dir: TempDir,
}

pub struct LocalWorker {
    pub worker_id: String,
    /// `http.listen` of the worker: /metrics, /readyz.
    pub http_addr: String,
    child: Child,
}

impl LocalWorker {
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

impl LocalFleet {
    pub async fn start(options: LocalOptions) -> anyhow::Result<LocalFleet> {
        let dir = TempDir::new("genfleet-bench")?;
        let nats =
            PrivateNats::start_with(options.nats_server.as_deref(), dir.path(), Monitoring::On)
                .await?;
        let nats_url = nats.url.clone();
        let monitor_url = nats
            .monitor_url
            .clone()
            .context("the private nats-server has its monitoring port")?;

        let script = dir.path().join("mock-llm.toml");
        std::fs::write(&script, workload::mock_script(options.token_delay_ms))
            .context("cannot write the mock backend's script")?;
        let mut mock = Command::new(current_exe()?)
            .args(["mock-llm", "--listen", "127.0.0.1:0", "--script"])
            .arg(&script)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start genfleet mock-llm")?;
        let backend_url = mock_url(&mut mock).await?;

        let mut fleet = LocalFleet {
            nats_url,
            monitor_url,
            backend_url,
            workers: Vec::new(),
            options,
            nats,
            mock,
            dir,
        };
        for n in 1..=fleet.options.workers {
            let pool = fleet.options.pool.clone();
            let worker = fleet
                .start_worker(&format!("bench-worker-{n}"), &pool, fleet.options.slots)
                .await?;
            fleet.workers.push(worker);
        }
        Ok(fleet)
    }

    /// Starts one more worker process on the mock backend and waits until it is ready
    /// (`/readyz`).
    pub async fn start_worker(
        &self,
        worker_id: &str,
        pool: &str,
        slots: u32,
    ) -> anyhow::Result<LocalWorker> {
        self.start_worker_at(worker_id, pool, slots, &self.backend_url)
            .await
    }

    /// The fleet's own directory (logs, the store), removed with it.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Starts one more worker process on the backend at `backend_url`.
    pub async fn start_worker_at(
        &self,
        worker_id: &str,
        pool: &str,
        slots: u32,
        backend_url: &str,
    ) -> anyhow::Result<LocalWorker> {
        let http_addr = format!("127.0.0.1:{}", free_port()?);
        let log_path = self.dir.path().join(format!("{worker_id}.log"));
        let log = std::fs::File::create(&log_path).context("cannot create a worker log")?;
        let mut command = Command::new(current_exe()?);
        if let Some(config) = &self.options.config {
            command.arg("--config").arg(config);
        }
        let child = command
            .arg("worker")
            .env("GENFLEET__NATS__URL", &self.nats_url)
            .env("GENFLEET__LLM__BASE_URL", backend_url)
            .env("GENFLEET__WORKER__SLOTS", slots.to_string())
            .env("GENFLEET__WORKER__ID", worker_id)
            .env("GENFLEET__WORKER__POOL", pool)
            .env("GENFLEET__HTTP__LISTEN", &http_addr)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("cannot start genfleet worker")?;
        let mut worker = LocalWorker {
            worker_id: worker_id.to_string(),
            http_addr,
            child,
        };
        wait_until_ready(&mut worker, &log_path).await?;
        Ok(worker)
    }

    /// The processes whose CPU and memory a run reports.
    pub fn watched(&self) -> Vec<Watched> {
        let mut watched: Vec<Watched> = self
            .workers
            .iter()
            .filter_map(|w| {
                Some(Watched {
                    role: format!("worker {}", w.worker_id),
                    pid: w.pid()?,
                })
            })
            .collect();
        for (role, pid) in [
            ("nats-server", self.nats.pid()),
            ("mock-llm", self.mock.id()),
        ] {
            if let Some(pid) = pid {
                watched.push(Watched {
                    role: role.to_string(),
                    pid,
                });
            }
        }
        watched
    }
}

/// The executable the workers and the mock are started from: this very one. On Linux
/// `/proc/self/exe` names the running file even after a rebuild replaced the one at its path,
/// so a long run never mixes versions.
fn current_exe() -> anyhow::Result<PathBuf> {
    let this = PathBuf::from("/proc/self/exe");
    if this.exists() {
        return Ok(this);
    }
    std::env::current_exe().context("cannot find the genfleet executable to start workers with")
}

/// The base URL the mock prints on its first line once it listens.
async fn mock_url(mock: &mut Child) -> anyhow::Result<String> {
    let stdout = mock.stdout.take().context("the mock's output is piped")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(START_TIMEOUT, lines.next_line())
        .await
        .context("genfleet mock-llm did not start in time")??
        .context("genfleet mock-llm exited at start")?;
    let url = line
        .strip_prefix("mock-llm listening on ")
        .with_context(|| format!("unexpected first line from genfleet mock-llm: {line}"))?
        .to_string();
    // Keep reading so the mock never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(url)
}

async fn wait_until_ready(worker: &mut LocalWorker, log: &Path) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let url = format!("http://{}/readyz", worker.http_addr);
    let started = Instant::now();
    loop {
        if let Some(status) = worker.child.try_wait()? {
            anyhow::bail!(
                "worker {} exited at start ({status}); its log:\n{}",
                worker.worker_id,
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        if let Ok(response) = http.get(&url).timeout(Duration::from_secs(1)).send().await
            && response.status().is_success()
        {
            return Ok(());
        }
        if started.elapsed() > START_TIMEOUT {
            anyhow::bail!(
                "worker {} was not ready within {START_TIMEOUT:?}; its log:\n{}",
                worker.worker_id,
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}
