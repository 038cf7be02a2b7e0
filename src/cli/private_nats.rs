//! nats-servers of the command's own: one (JetStream, a free loopback port, a store in a
//! temporary directory) for `genfleet demo` and `genfleet bench --local`, or a JetStream
//! cluster of several on loopback for the bench's fleet run, each node on ports and a store of
//! its own, which can be killed and started again on the same ports and store. Every server is
//! killed on drop (the directory is the caller's), so an error or Ctrl-C leaves nothing behind.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::process::{Child, Command};

/// How long a server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Starts tried, each on ports of its own, before giving up on a server that exits at once.
const START_TRIES: u32 = 5;
/// The pause between two looks while a server comes up.
const POLL: Duration = Duration::from_millis(50);
/// The cluster's name, as its nodes' routes carry it.
const CLUSTER_NAME: &str = "genfleet-private";

/// One nats-server, or the nodes of a cluster.
pub struct PrivateNats {
    /// Every node's client URL, comma-separated: the form `nats.url` takes, so a client given
    /// it reconnects to another node when its own dies.
    pub url: String,
    /// The binary that runs.
    pub binary: PathBuf,
    /// `http://127.0.0.1:PORT` of the first node's monitoring endpoints (`/varz`, `/jsz`), when
    /// asked for.
    pub monitor_url: Option<String>,
    nodes: Vec<Node>,
}

/// One server process and how to start it again as it was.
struct Node {
    /// `nats://127.0.0.1:PORT`.
    url: String,
    /// Its command line: the same ports and store at every start.
    args: Vec<OsString>,
    /// `None` while it is killed.
    child: Option<Child>,
}

/// Whether the server also serves its monitoring endpoints (on loopback, like its clients).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Monitoring {
    Off,
    On,
}

/// The ports of one node.
struct Ports {
    client: u16,
    monitor: Option<u16>,
    /// The cluster's route port (clusters only).
    route: Option<u16>,
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
        Self::start_cluster(given, dir, 1, monitoring).await
    }

    /// `nodes` servers with JetStream, each with its store under `dir/node-<n>`; more than one
    /// are routed to each other as one cluster (each names every route, its own included, as
    /// nats-server allows). Returns once every node accepts connections and, for a cluster,
    /// its JetStream has a meta leader. One node is a plain server, exactly as
    /// [`PrivateNats::start_with`] has always started it (its store in `dir/jetstream`).
    pub async fn start_cluster(
        given: Option<&Path>,
        dir: &Path,
        nodes: usize,
        monitoring: Monitoring,
    ) -> anyhow::Result<PrivateNats> {
        anyhow::ensure!(nodes >= 1, "a private NATS has at least one node");
        let binary = find_nats_server(given)?;
        let mut tries = 0;
        loop {
            tries += 1;
            // A free port is free when chosen; another process may bind it before the server
            // does, and the server then exits at once: every node is started again on other
            // ports (a cluster's routes name them all).
            let ports = (0..nodes)
                .map(|_| {
                    Ok(Ports {
                        client: free_port()?,
                        monitor: match monitoring {
                            Monitoring::On => Some(free_port()?),
                            Monitoring::Off => None,
                        },
                        route: (nodes > 1).then(free_port).transpose()?,
                    })
                })
                .collect::<anyhow::Result<Vec<Ports>>>()?;
            let mut started = Vec::with_capacity(nodes);
            for (n, node_ports) in ports.iter().enumerate() {
                let mut node = Node {
                    url: format!("nats://127.0.0.1:{}", node_ports.client),
                    args: node_args(dir, n, &ports),
                    child: None,
                };
                node.spawn(&binary)?;
                started.push(node);
            }
            let mut nats = PrivateNats {
                url: started
                    .iter()
                    .map(|n| n.url.as_str())
                    .collect::<Vec<_>>()
                    .join(","),
                binary: binary.clone(),
                monitor_url: ports[0].monitor.map(|p| format!("http://127.0.0.1:{p}")),
                nodes: started,
            };
            let mut exited = None;
            for node in &mut nats.nodes {
                match wait_for_nats(&node.url, node.child.as_mut()).await {
                    Ok(()) => {}
                    Err(Unstarted::Exited(status)) => {
                        exited = Some(status);
                        break;
                    }
                    Err(Unstarted::Silent(error)) => {
                        anyhow::bail!("nats-server did not come up at {}: {error}", node.url)
                    }
                }
            }
            match exited {
                None => {
                    if nodes > 1 {
                        nats.wait_for_jetstream().await?;
                    }
                    return Ok(nats);
                }
                Some(status) if tries < START_TRIES => {
                    tracing::debug!(message = "nats-server exited at start; starting again on other ports", %status);
                    nats.stop().await;
                    // A store is tied to the cluster it was made in: the next try starts empty.
                    for n in 0..nodes {
                        let _ = std::fs::remove_dir_all(store_dir(dir, n, nodes));
                    }
                }
                Some(status) => anyhow::bail!(
                    "nats-server exited at start ({status}), {tries} times: is {} a working nats-server?",
                    nats.binary.display()
                ),
            }
        }
    }

    /// The pid of every node running, by its index.
    pub fn node_pids(&self) -> Vec<(usize, u32)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(n, node)| Some((n, node.pid()?)))
            .collect()
    }

    /// The node whose server name (as JetStream names a stream's leader) is `name`.
    pub fn node_named(&self, name: &str) -> Option<usize> {
        (0..self.nodes.len()).find(|n| server_name(*n) == name)
    }

    /// Each node's client URL, by index.
    pub fn node_urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url.clone()).collect()
    }

    /// Kills node `n` at once (SIGKILL: no goodbye to its routes or clients, as a crash or a
    /// lost machine) and returns once its process is gone. Its ports and store stay for
    /// [`PrivateNats::restart_node`].
    pub async fn kill_node(&mut self, n: usize) -> anyhow::Result<()> {
        let node = self.nodes.get_mut(n).context("no such node")?;
        if let Some(mut child) = node.child.take() {
            let _ = child.kill().await;
        }
        Ok(())
    }

    /// Starts node `n` again on its ports and store, and returns once it accepts connections.
    /// The port of a node just killed can take a moment to bind again: the start is tried
    /// again within [`START_TIMEOUT`].
    pub async fn restart_node(&mut self, n: usize) -> anyhow::Result<()> {
        let binary = self.binary.clone();
        let node = self.nodes.get_mut(n).context("no such node")?;
        anyhow::ensure!(node.child.is_none(), "node {n} runs");
        let started = Instant::now();
        loop {
            node.spawn(&binary)?;
            match wait_for_nats(&node.url, node.child.as_mut()).await {
                Ok(()) => return Ok(()),
                Err(Unstarted::Exited(status)) if started.elapsed() < START_TIMEOUT => {
                    tracing::debug!(message = "nats-server exited at its restart; trying again", %status);
                    node.child = None;
                    tokio::time::sleep(POLL).await;
                }
                Err(Unstarted::Exited(status)) => {
                    node.child = None;
                    anyhow::bail!(
                        "nats-server {} did not start again within {START_TIMEOUT:?} ({status})",
                        node.url
                    )
                }
                Err(Unstarted::Silent(error)) => {
                    anyhow::bail!("nats-server did not come back at {}: {error}", node.url)
                }
            }
        }
    }

    /// Waits (within [`START_TIMEOUT`]) until the cluster's JetStream answers through the
    /// first node: its meta leader is elected.
    pub async fn wait_for_jetstream(&self) -> anyhow::Result<()> {
        let url = &self.nodes[0].url;
        let client = async_nats::connect(url.as_str()).await?;
        let jetstream = async_nats::jetstream::new(client);
        let started = Instant::now();
        loop {
            // "stream not found" is JetStream's own answer: its meta leader is elected.
            let answer = match jetstream.get_stream("GENFLEET_PRIVATE_ABSENT").await {
                Err(error) if error.to_string().contains("not found") => return Ok(()),
                Err(error) => error.to_string(),
                Ok(_) => "a stream of that name exists".to_string(),
            };
            if started.elapsed() >= START_TIMEOUT {
                anyhow::bail!(
                    "the private cluster's JetStream did not answer within {START_TIMEOUT:?}: {answer}"
                );
            }
            tokio::time::sleep(POLL * 4).await;
        }
    }

    /// Stops every node now (dropping it does too, without waiting).
    pub async fn stop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill().await;
            }
        }
    }
}

/// The command line of node `n` of nodes with `ports`.
fn node_args(dir: &Path, n: usize, ports: &[Ports]) -> Vec<OsString> {
    let own = &ports[n];
    let mut args: Vec<OsString> = ["-a", "127.0.0.1", "-p", &own.client.to_string()]
        .map(OsString::from)
        .to_vec();
    if let Some(monitor) = own.monitor {
        args.extend(["-m".into(), monitor.to_string().into()]);
    }
    let store = store_dir(dir, n, ports.len());
    args.extend(["-js".into(), "-sd".into(), store.into_os_string()]);
    if let Some(route) = own.route {
        let routes = ports
            .iter()
            .filter_map(|p| p.route)
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        args.extend(
            [
                "--server_name".to_string(),
                server_name(n),
                "--cluster_name".into(),
                CLUSTER_NAME.into(),
                "--cluster".into(),
                format!("nats://127.0.0.1:{route}"),
                "--routes".into(),
                routes,
            ]
            .map(OsString::from),
        );
    }
    args
}

/// The server name of a cluster's node `n`.
fn server_name(n: usize) -> String {
    format!("{CLUSTER_NAME}-{n}")
}

/// Where node `n` of `nodes` keeps its JetStream store.
fn store_dir(dir: &Path, n: usize, nodes: usize) -> PathBuf {
    if nodes == 1 {
        dir.join("jetstream")
    } else {
        dir.join(format!("node-{n}"))
    }
}

impl Node {
    fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    fn spawn(&mut self, binary: &Path) -> anyhow::Result<()> {
        let mut command = Command::new(binary);
        command
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        // Its own process group: a Ctrl-C at the terminal reaches genfleet only, which
        // stops what it started with the server still there, and the server last.
        #[cfg(unix)]
        command.process_group(0);
        self.child = Some(
            command
                .spawn()
                .with_context(|| format!("cannot start {}", binary.display()))?,
        );
        Ok(())
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

async fn wait_for_nats(url: &str, mut child: Option<&mut Child>) -> Result<(), Unstarted> {
    let started = Instant::now();
    loop {
        match async_nats::connect(url).await {
            Ok(_) => return Ok(()),
            Err(error) => {
                if let Some(child) = child.as_deref_mut()
                    && let Ok(Some(status)) = child.try_wait()
                {
                    return Err(Unstarted::Exited(status));
                }
                if started.elapsed() >= START_TIMEOUT {
                    return Err(Unstarted::Silent(error));
                }
                tracing::debug!(%error, "nats-server not up yet");
                tokio::time::sleep(POLL).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound on each wait of the test (a cluster electing its leaders takes seconds).
    const WAIT: Duration = Duration::from_secs(30);

    async fn eventually<T, F: Future<Output = Option<T>>>(
        what: &str,
        mut f: impl FnMut() -> F,
    ) -> T {
        let started = Instant::now();
        loop {
            if let Some(value) = f().await {
                return value;
            }
            assert!(started.elapsed() < WAIT, "{what} within {WAIT:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    #[tokio::test]
    async fn a_cluster_keeps_a_replicated_stream_through_a_node_killed_and_started_again() {
        let dir = TempDir::new("genfleet-private-nats-test").unwrap();
        let mut nats = PrivateNats::start_cluster(None, dir.path(), 3, Monitoring::On)
            .await
            .expect("a 3-node cluster starts (nats-server on PATH)");
        let urls = nats.node_urls();
        assert_eq!(urls.len(), 3);
        assert_eq!(nats.url, urls.join(","));
        assert_eq!(nats.node_pids().len(), 3);
        assert_eq!(nats.node_named("genfleet-private-1"), Some(1));
        assert_eq!(nats.node_named("somebody-else"), None);

        // Through node 0, which stays up.
        let js = async_nats::jetstream::new(async_nats::connect(urls[0].as_str()).await.unwrap());
        let config = async_nats::jetstream::stream::Config {
            name: "T".into(),
            subjects: vec!["t.>".into()],
            num_replicas: 3,
            ..Default::default()
        };
        eventually("the stream is made with 3 replicas", || {
            let (js, config) = (js.clone(), config.clone());
            async move { js.create_stream(config).await.ok() }
        })
        .await;
        let publish = |n: u32| {
            let js = js.clone();
            async move {
                let ack = js.publish(format!("t.{n}"), "x".into()).await.ok()?;
                ack.await.ok()
            }
        };
        eventually("the first message is stored", || publish(1)).await;

        nats.kill_node(1).await.unwrap();
        assert_eq!(nats.node_pids().len(), 2);
        eventually("a message is stored with a node down", || publish(2)).await;

        nats.restart_node(1).await.unwrap();
        assert_eq!(nats.node_pids().len(), 3);
        // The node that came back serves the stream, both messages in it, from its store.
        let back = async_nats::jetstream::new(async_nats::connect(urls[1].as_str()).await.unwrap());
        eventually(
            "the stream has both messages through the node that came back",
            || {
                let back = back.clone();
                async move {
                    let mut stream = back.get_stream("T").await.ok()?;
                    let info = stream.info().await.ok()?;
                    let current = info
                        .cluster
                        .as_ref()?
                        .replicas
                        .iter()
                        .all(|peer| peer.current && !peer.offline);
                    (info.state.messages == 2 && current).then_some(())
                }
            },
        )
        .await;
        nats.stop().await;
    }
}
