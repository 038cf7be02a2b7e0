//! `genfleet bench --local`: a private fleet on this machine. A nats-server (JetStream, a free
//! port, its monitoring port, a temporary store) or a JetStream cluster of several on loopback
//! (the fleet run's, with the fleet's streams and buckets replicated on every node), the mock
//! backend as its own `genfleet mock-llm` process and each worker as its own `genfleet worker`
//! process, so that the CPU time and memory of each can be read from `/proc` apart from the
//! load generator's; gateways and a manager as processes too, when a phase asks for them. The
//! workers can be replaced by those of another build (`--baseline`). Everything is killed and
//! the store removed when the fleet is dropped, also after an error or Ctrl-C.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::TryStreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::procstat::Watched;
use super::workload;
use crate::cli::private_nats::{Monitoring, PrivateNats, TempDir, free_port};

/// How long a process of the fleet may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a worker asked to stop may take to drain and exit before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
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
    /// Settings every worker of the fleet gets on top of the configuration, as
    /// `GENFLEET__...` variables (the churn phase's heartbeats, preemption).
    pub worker_env: Vec<(String, String)>,
    /// nats-server nodes: 1, a plain server; more, a JetStream cluster whose streams and
    /// buckets every process of the fleet makes with as many replicas.
    pub nats_nodes: usize,
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

    /// Asks the worker to stop (SIGTERM: it drains and leaves the bus) and returns once its
    /// process has exited; it is killed if it takes longer than [`STOP_TIMEOUT`].
    pub async fn stop(mut self) -> Stopped {
        if let Some(pid) = self.child.id() {
            let asked = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .await
                .is_ok_and(|status| status.success());
            if asked && let Ok(exited) = tokio::time::timeout(STOP_TIMEOUT, self.child.wait()).await
            {
                return match exited {
                    Ok(status) if status.success() => Stopped::Drained,
                    Ok(status) => Stopped::Exited(status.to_string()),
                    Err(error) => Stopped::Exited(error.to_string()),
                };
            }
        }
        // Kills and waits for the process to end.
        let _ = self.child.kill().await;
        Stopped::Killed
    }

    /// Kills the worker at once (SIGKILL: no drain, no goodbye on the bus, as a crash or a
    /// lost node) and returns once its process is gone.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

/// How a worker asked to stop went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// It drained and exited with status 0.
    Drained,
    /// It exited otherwise (the status, or why it could not be read).
    Exited(String),
    /// It was still running after [`STOP_TIMEOUT`] and was killed.
    Killed,
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stopped::Drained => write!(f, "drained and exited"),
            Stopped::Exited(status) => write!(f, "exited ({status})"),
            Stopped::Killed => write!(
                f,
                "was killed after {}s of draining",
                STOP_TIMEOUT.as_secs()
            ),
        }
    }
}

/// A genfleet build whose `worker` command the fleet runs.
#[derive(Debug, Clone)]
pub struct Build {
    /// `this build` or `baseline`, as the report names it.
    pub name: &'static str,
    pub exe: PathBuf,
    /// Its workers are `<prefix><n>`.
    pub worker_prefix: &'static str,
}

impl Build {
    /// The running build: the bench's own executable.
    pub fn this() -> anyhow::Result<Build> {
        Ok(Build {
            name: "this build",
            exe: current_exe()?,
            worker_prefix: "bench-worker-",
        })
    }

    /// Another build, to compare this one with.
    pub fn baseline(exe: PathBuf) -> Build {
        Build {
            name: "baseline",
            exe,
            worker_prefix: "bench-baseline-worker-",
        }
    }
}

impl LocalFleet {
    pub async fn start(options: LocalOptions) -> anyhow::Result<LocalFleet> {
        let dir = TempDir::new("genfleet-bench")?;
        let nats = PrivateNats::start_cluster(
            options.nats_server.as_deref(),
            dir.path(),
            options.nats_nodes.max(1),
            Monitoring::On,
        )
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
        fleet.start_workers(&Build::this()?).await?;
        Ok(fleet)
    }

    /// Replaces the workers by fresh ones of `build`. Every worker is stopped and waited for
    /// first, then every stream of the private server is deleted (the buckets are streams
    /// too): the new workers make them again as they start, so a run of one build starts from
    /// the state a run of the other started from, and neither sees the other's records,
    /// queue consumer or results.
    pub async fn replace_workers(&mut self, build: &Build) -> anyhow::Result<()> {
        for worker in std::mem::take(&mut self.workers) {
            worker.stop().await;
        }
        self.empty_jetstream().await?;
        self.start_workers(build).await
    }

    /// Starts `--workers` workers of `build` on the fleet's pool.
    async fn start_workers(&mut self, build: &Build) -> anyhow::Result<()> {
        for n in 1..=self.options.workers {
            let worker = self
                .spawn_worker(&WorkerProcess {
                    exe: &build.exe,
                    worker_id: &format!("{}{n}", build.worker_prefix),
                    pool: &self.options.pool,
                    slots: self.options.slots,
                    backend_url: &self.backend_url,
                })
                .await
                .with_context(|| format!("{} ({})", build.name, build.exe.display()))?;
            self.workers.push(worker);
        }
        Ok(())
    }

    async fn empty_jetstream(&self) -> anyhow::Result<()> {
        let client = async_nats::connect(self.nats_url.as_str()).await?;
        let jetstream = async_nats::jetstream::new(client);
        let names: Vec<String> = jetstream.stream_names().try_collect().await?;
        for name in names {
            jetstream
                .delete_stream(&name)
                .await
                .with_context(|| format!("cannot delete stream {name} between runs"))?;
        }
        Ok(())
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

    /// Starts one more worker process of this build on the backend at `backend_url`.
    pub async fn start_worker_at(
        &self,
        worker_id: &str,
        pool: &str,
        slots: u32,
        backend_url: &str,
    ) -> anyhow::Result<LocalWorker> {
        self.spawn_worker(&WorkerProcess {
            exe: &current_exe()?,
            worker_id,
            pool,
            slots,
            backend_url,
        })
        .await
    }

    /// `exe worker`, with the arguments and environment every worker of the bench gets, and
    /// waits until it is ready (`/readyz`).
    async fn spawn_worker(&self, process: &WorkerProcess<'_>) -> anyhow::Result<LocalWorker> {
        // A free port can be taken by another process between choosing it and the worker
        // binding it: a worker that exits at start for that is started again on another.
        let mut tries = 0;
        loop {
            tries += 1;
            match self.spawn_worker_once(process).await {
                Err(error)
                    if tries < PORT_TRIES
                        && error.to_string().contains("(http.listen)")
                        && error.to_string().contains("in use") =>
                {
                    continue;
                }
                done => return done,
            }
        }
    }

    async fn spawn_worker_once(&self, process: &WorkerProcess<'_>) -> anyhow::Result<LocalWorker> {
        let WorkerProcess {
            exe,
            worker_id,
            pool,
            slots,
            backend_url,
        } = *process;
        let http_addr = format!("127.0.0.1:{}", free_port()?);
        let log_path = self.dir.path().join(format!("{worker_id}.log"));
        let log = std::fs::File::create(&log_path).context("cannot create a worker log")?;
        let mut command = Command::new(exe);
        if let Some(config) = &self.options.config {
            command.arg("--config").arg(config);
        }
        command.envs(self.options.worker_env.iter().map(|(k, v)| (k, v)));
        command.envs(self.fleet_env());
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
            .with_context(|| format!("cannot start {} worker", exe.display()))?;
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
        let nodes = self.nats.node_pids();
        for (n, pid) in &nodes {
            watched.push(Watched {
                role: if nodes.len() == 1 && self.options.nats_nodes <= 1 {
                    "nats-server".to_string()
                } else {
                    format!("nats-server {n}")
                },
                pid: *pid,
            });
        }
        if let Some(pid) = self.mock.id() {
            watched.push(Watched {
                role: "mock-llm".to_string(),
                pid,
            });
        }
        watched
    }

    /// What every genfleet process of the fleet gets whatever its role: on a cluster, the
    /// replicas of the streams and buckets it makes when they are absent.
    fn fleet_env(&self) -> Vec<(String, String)> {
        let nodes = self.options.nats_nodes.max(1);
        if nodes == 1 {
            return Vec::new();
        }
        vec![(
            "GENFLEET__JETSTREAM__REPLICAS".to_string(),
            nodes.to_string(),
        )]
    }

    /// Each NATS node's client URL, by index.
    pub fn nats_node_urls(&self) -> Vec<String> {
        self.nats.node_urls()
    }

    /// The NATS node whose server name is `name`.
    pub fn nats_node_named(&self, name: &str) -> Option<usize> {
        self.nats.node_named(name)
    }

    /// Kills NATS node `n` (SIGKILL); its ports and store stay.
    pub async fn kill_nats_node(&mut self, n: usize) -> anyhow::Result<()> {
        self.nats.kill_node(n).await
    }

    /// Starts NATS node `n` again on its ports and store, and waits until it accepts
    /// connections.
    pub async fn restart_nats_node(&mut self, n: usize) -> anyhow::Result<()> {
        self.nats.restart_node(n).await
    }
}

/// A worker process to start: which build, under which id, on which pool and backend.
struct WorkerProcess<'a> {
    exe: &'a Path,
    worker_id: &'a str,
    pool: &'a str,
    slots: u32,
    backend_url: &'a str,
}

/// A `genfleet gateway` process of the fleet, killed when dropped.
pub struct LocalGateway {
    /// Its OpenAI base URL (`http://127.0.0.1:PORT/v1`).
    pub base_url: String,
    /// Its name, and the log it writes (`<name>.log`).
    pub name: String,
    /// The address it listens on: a gateway started again takes the same.
    pub listen: SocketAddr,
    child: Child,
}

impl LocalGateway {
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Kills the gateway at once (SIGKILL: its callers' connections break, nothing is
    /// cancelled on the bus) and returns once its process is gone.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

/// How a gateway of the fleet is started.
#[derive(Debug, Clone)]
pub struct GatewayOptions<'a> {
    /// Its `worker.pool`: the pool a model name that is no other pool's goes to.
    pub pool: &'a str,
    /// Its log is `<name>.log`: replicas side by side each keep a log of their own.
    pub name: &'a str,
    /// Where it listens; `None`, a free port.
    pub listen: Option<SocketAddr>,
    /// Settings on top of the configuration, as `GENFLEET__...` variables (API keys).
    pub env: Vec<(String, String)>,
}

impl LocalFleet {
    /// Starts `genfleet gateway` on a free port, on the fleet's NATS with `pool` as its
    /// `worker.pool`, and returns once it listens (it prints its address then).
    pub async fn start_gateway(&self, pool: &str) -> anyhow::Result<LocalGateway> {
        self.start_gateway_named(pool, "gateway").await
    }

    /// [`LocalFleet::start_gateway`], its log in `<name>.log`: replicas side by side each
    /// keep a log of their own.
    pub async fn start_gateway_named(
        &self,
        pool: &str,
        name: &str,
    ) -> anyhow::Result<LocalGateway> {
        self.start_gateway_with(&GatewayOptions {
            pool,
            name,
            listen: None,
            env: Vec::new(),
        })
        .await
    }

    /// A gateway as `options` say. One given the address of a gateway just killed binds it
    /// again (tried again for a moment while the port is not free yet).
    pub async fn start_gateway_with(
        &self,
        options: &GatewayOptions<'_>,
    ) -> anyhow::Result<LocalGateway> {
        let started = Instant::now();
        loop {
            match self.spawn_gateway(options).await {
                Err(error)
                    if options.listen.is_some()
                        && error.to_string().contains("in use")
                        && started.elapsed() < START_TIMEOUT =>
                {
                    tokio::time::sleep(POLL).await;
                }
                done => return done,
            }
        }
    }

    async fn spawn_gateway(&self, options: &GatewayOptions<'_>) -> anyhow::Result<LocalGateway> {
        let name = options.name;
        let log_path = self.dir.path().join(format!("{name}.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .context("cannot open the gateway's log")?;
        let listen = options
            .listen
            .map_or_else(|| "127.0.0.1:0".to_string(), |addr| addr.to_string());
        let mut command = Command::new(current_exe()?);
        if let Some(config) = &self.options.config {
            command.arg("--config").arg(config);
        }
        command.envs(self.fleet_env());
        command.envs(options.env.iter().map(|(k, v)| (k, v)));
        let mut child = command
            .args(["gateway", "--listen", &listen])
            .env("GENFLEET__NATS__URL", &self.nats_url)
            .env("GENFLEET__WORKER__POOL", options.pool)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("cannot start genfleet gateway")?;
        let stdout = child
            .stdout
            .take()
            .context("the gateway's output is piped")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(START_TIMEOUT, lines.next_line()).await;
        let log_text = || std::fs::read_to_string(&log_path).unwrap_or_default();
        let line = match first {
            Ok(Ok(Some(line))) => line,
            Ok(_) => anyhow::bail!("genfleet gateway exited at start; its log:\n{}", log_text()),
            Err(_) => anyhow::bail!(
                "genfleet gateway did not listen within {START_TIMEOUT:?}; its log:\n{}",
                log_text()
            ),
        };
        let base_url = line
            .strip_prefix("gateway listening on ")
            .and_then(|rest| rest.split_whitespace().next())
            .with_context(|| format!("unexpected first line from genfleet gateway: {line}"))?
            .to_string();
        let listen = base_url
            .trim_start_matches("http://")
            .trim_end_matches("/v1")
            .parse::<SocketAddr>()
            .with_context(|| format!("the gateway's address in {base_url}"))?;
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(LocalGateway {
            base_url,
            name: name.to_string(),
            listen,
            child,
        })
    }

    /// Starts `genfleet manager --name <name> --rules <rules> --deliver new` on the fleet's
    /// NATS, its log (standard output and error) in `<name>.log`. It is up once its durable
    /// consumer exists; the caller waits for that where it matters.
    pub fn start_manager(&self, name: &str, rules: &Path) -> anyhow::Result<LocalManager> {
        let log_path = self.dir.path().join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).context("cannot create the manager's log")?;
        let mut command = Command::new(current_exe()?);
        if let Some(config) = &self.options.config {
            command.arg("--config").arg(config);
        }
        command.envs(self.fleet_env());
        let child = command
            .args(["manager", "--name", name, "--deliver", "new", "--rules"])
            .arg(rules)
            .env("GENFLEET__NATS__URL", &self.nats_url)
            .stdin(Stdio::null())
            .stdout(log.try_clone().context("the manager's log")?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("cannot start genfleet manager")?;
        Ok(LocalManager { child })
    }
}

/// A `genfleet manager` process of the fleet, killed when dropped.
pub struct LocalManager {
    child: Child,
}

impl LocalManager {
    /// Whether it still runs (it exits at once on a bad rules file or no NATS).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
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

/// How many times a worker whose chosen HTTP port was taken before it bound it is started
/// again on another.
const PORT_TRIES: u32 = 5;

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
