//! The fleet run's churn, in turn with quiet spells between: a rolling restart of every
//! worker, a NATS node killed and started again on its ports and store, a gateway killed and
//! started again on its address. Each is timed as the bench saw it, from its first act to
//! the fleet being whole again; the latency of a request is labelled by whether one was in
//! progress when the request was sent.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::super::local::{GatewayOptions, LocalFleet, LocalGateway};
use crate::settings::JetStreamSettings;

/// When each disruption begins, as shares of the run's length (a later one waits for the one
/// before to end and a quiet spell to pass), and how long what is killed stays down.
#[derive(Debug, Clone, Serialize)]
pub struct Schedule {
    pub rolling_restart_at_s: f64,
    pub node_kill_at_s: f64,
    pub node_down_s: f64,
    pub gateway_kill_at_s: f64,
    pub gateway_down_s: f64,
    /// The least quiet time after each disruption, the last one included.
    pub quiet_s: f64,
    /// When the load ends unless a disruption ran late.
    pub load_s: f64,
}

impl Schedule {
    /// The disruptions of a run of `secs` seconds, spread over it.
    pub fn over(secs: f64) -> Schedule {
        Schedule {
            rolling_restart_at_s: 0.15 * secs,
            node_kill_at_s: 0.42 * secs,
            node_down_s: (0.07 * secs).max(5.0),
            gateway_kill_at_s: 0.70 * secs,
            gateway_down_s: 2.0,
            quiet_s: (0.10 * secs).max(5.0),
            load_s: secs,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DisruptionKind {
    RollingRestart,
    NatsNodeKilled,
    GatewayKilled,
}

/// One disruption as it happened.
#[derive(Debug, Clone, Serialize)]
pub struct Disruption {
    pub kind: DisruptionKind,
    /// For people and the chart.
    pub label: String,
    /// Seconds since the load began: its first act, and the fleet whole again.
    pub started_s: f64,
    pub ended_s: f64,
    /// What happened, step by step.
    pub steps: Vec<String>,
}

impl Disruption {
    /// Whether it was in progress at `t` (seconds since the load began).
    pub fn covers(&self, t: f64) -> bool {
        self.started_s <= t && t <= self.ended_s
    }
}

/// The `/metrics` addresses of the workers running, which the signals sampler reads; the
/// churn keeps it current.
pub type WorkerAddrs = Arc<Mutex<Vec<String>>>;

/// What the churn works on.
pub struct Churn<'a> {
    pub fleet: &'a mut LocalFleet,
    pub gateways: &'a mut Vec<LocalGateway>,
    /// The settings a gateway is started with (its API keys).
    pub gateway_env: Vec<(String, String)>,
    pub pool: String,
    pub slots: u32,
    pub addrs: WorkerAddrs,
    /// When the load began.
    pub started: Instant,
    /// Never killed: the bench reads every request's events through it.
    pub spared_node: usize,
    /// Names the streams whose leader is the node to kill.
    pub jetstream: JetStreamSettings,
}

impl Churn<'_> {
    fn now_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    async fn until(&self, at_s: f64) {
        let at = self.started + Duration::from_secs_f64(at_s.max(0.0));
        tokio::time::sleep_until(at.into()).await;
    }

    /// Every disruption of `schedule`, in turn; returns once the last quiet spell began
    /// (the load's end is the caller's).
    pub async fn run(&mut self, schedule: &Schedule) -> anyhow::Result<Vec<Disruption>> {
        let mut done = Vec::new();
        self.until(schedule.rolling_restart_at_s).await;
        done.push(self.rolling_restart().await?);
        let next = schedule
            .node_kill_at_s
            .max(done[0].ended_s + schedule.quiet_s);
        self.until(next).await;
        done.push(self.kill_a_nats_node(schedule.node_down_s).await?);
        let next = schedule
            .gateway_kill_at_s
            .max(done[1].ended_s + schedule.quiet_s);
        self.until(next).await;
        done.push(self.kill_a_gateway(schedule.gateway_down_s).await?);
        Ok(done)
    }

    /// SIGTERM to each worker in turn (it drains and hands its requests off); once it has
    /// exited, a replacement with a new id starts and is ready before the next goes.
    async fn rolling_restart(&mut self) -> anyhow::Result<Disruption> {
        let started_s = self.now_s();
        eprintln!("fleet: rolling restart of every worker at {started_s:.1} s");
        let mut steps = Vec::new();
        let count = self.fleet.workers.len();
        for n in 1..=count {
            let worker = self.fleet.workers.remove(0);
            let old = worker.worker_id.clone();
            lock(&self.addrs).retain(|a| *a != worker.http_addr);
            let stopping = Instant::now();
            let how = worker.stop().await;
            let stopped = stopping.elapsed();
            let new_id = format!("bench-worker-r{n}");
            let starting = Instant::now();
            let replacement = self
                .fleet
                .start_worker(&new_id, &self.pool, self.slots)
                .await?;
            lock(&self.addrs).push(replacement.http_addr.clone());
            self.fleet.workers.push(replacement);
            let step = format!(
                "{old} {how} in {:.1} s; {new_id} ready {:.1} s later",
                stopped.as_secs_f64(),
                starting.elapsed().as_secs_f64()
            );
            eprintln!("fleet:   {step}");
            steps.push(step);
        }
        Ok(Disruption {
            kind: DisruptionKind::RollingRestart,
            label: "rolling restart".into(),
            started_s,
            ended_s: self.now_s(),
            steps,
        })
    }

    /// SIGKILL to a NATS node (the one leading the results bucket's stream when it is not the
    /// spared one), down for `down_s`, then started again on its ports and store.
    async fn kill_a_nats_node(&mut self, down_s: f64) -> anyhow::Result<Disruption> {
        let (node, why) = self.victim_node().await;
        let started_s = self.now_s();
        eprintln!("fleet: NATS node {node} ({why}) killed at {started_s:.1} s");
        self.fleet.kill_nats_node(node).await?;
        tokio::time::sleep(Duration::from_secs_f64(down_s)).await;
        let restarting = Instant::now();
        self.fleet.restart_nats_node(node).await?;
        let accepting = restarting.elapsed();
        let spared = &self.fleet.nats_node_urls()[self.spared_node];
        let whole = match streams_whole(spared, WHOLE_WITHIN).await {
            Some(streams) => format!(
                "all {streams} streams led and every replica current {:.1} s after its start",
                restarting.elapsed().as_secs_f64()
            ),
            None => format!("not every stream's replicas current within {WHOLE_WITHIN:?}"),
        };
        let step = format!(
            "node {node} ({why}) SIGKILL, down {down_s:.1} s, accepting connections again {:.1} s \
             after its start, {whole}",
            accepting.as_secs_f64()
        );
        eprintln!("fleet:   {step}");
        Ok(Disruption {
            kind: DisruptionKind::NatsNodeKilled,
            label: format!("NATS node {node} killed"),
            started_s,
            ended_s: self.now_s(),
            steps: vec![step],
        })
    }

    /// The node to kill: the leader of the results bucket's stream (every request's record),
    /// else of the queue's, when it is not the spared node; else the last node.
    async fn victim_node(&self) -> (usize, String) {
        let urls = self.fleet.nats_node_urls();
        let leaders = stream_leaders(&urls[self.spared_node], &self.jetstream).await;
        let nodes = urls.len();
        for (stream, leader) in leaders {
            if let Some(node) = leader.and_then(|name| self.fleet.nats_node_named(&name))
                && node != self.spared_node
            {
                return (node, format!("leader of {stream}"));
            }
        }
        let node = if self.spared_node == nodes - 1 {
            0
        } else {
            nodes - 1
        };
        (node, "a follower".to_string())
    }

    /// SIGKILL to the last gateway, down for `down_s`, then started again on its address.
    async fn kill_a_gateway(&mut self, down_s: f64) -> anyhow::Result<Disruption> {
        let gateway = self
            .gateways
            .pop()
            .ok_or_else(|| anyhow::anyhow!("the fleet has a gateway"))?;
        let (name, listen) = (gateway.name.clone(), gateway.listen);
        let started_s = self.now_s();
        eprintln!("fleet: {name} killed at {started_s:.1} s");
        gateway.kill().await;
        tokio::time::sleep(Duration::from_secs_f64(down_s)).await;
        let restarting = Instant::now();
        let again = self
            .fleet
            .start_gateway_with(&GatewayOptions {
                pool: &self.pool,
                name: &name,
                listen: Some(listen),
                env: self.gateway_env.clone(),
            })
            .await?;
        self.gateways.push(again);
        let step = format!(
            "{name} SIGKILL, down {down_s:.1} s, listening on {listen} again {:.1} s after its start",
            restarting.elapsed().as_secs_f64()
        );
        eprintln!("fleet:   {step}");
        Ok(Disruption {
            kind: DisruptionKind::GatewayKilled,
            label: format!("{name} killed"),
            started_s,
            ended_s: self.now_s(),
            steps: vec![step],
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How long a restarted node's streams may take to catch up before the run goes on.
const WHOLE_WITHIN: Duration = Duration::from_secs(60);

/// Waits, within `bound`, until every stream of the cluster (the buckets are streams too) has
/// a leader and every replica current, as the node at `url` tells; returns how many streams
/// there are, or `None` if they were not all whole in time.
async fn streams_whole(url: &str, bound: Duration) -> Option<usize> {
    let started = Instant::now();
    let client = tokio::time::timeout(bound, async_nats::connect(url))
        .await
        .ok()?
        .ok()?;
    let jetstream = async_nats::jetstream::new(client);
    while started.elapsed() < bound {
        if let Some(streams) = whole_now(&jetstream).await {
            return Some(streams);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

/// How many streams there are, when each has a leader and every replica is current.
async fn whole_now(jetstream: &async_nats::jetstream::Context) -> Option<usize> {
    use futures_util::TryStreamExt;
    let names: Vec<String> = tokio::time::timeout(
        Duration::from_secs(5),
        jetstream.stream_names().try_collect(),
    )
    .await
    .ok()?
    .ok()?;
    for name in &names {
        let stream = tokio::time::timeout(Duration::from_secs(5), jetstream.get_stream(name))
            .await
            .ok()?
            .ok()?;
        let cluster = stream.cached_info().cluster.as_ref()?;
        let current =
            cluster.leader.is_some() && cluster.replicas.iter().all(|p| p.current && !p.offline);
        if !current {
            return None;
        }
    }
    Some(names.len())
}

/// The leaders of the results bucket's stream and the queue's, by server name (`None`
/// where it cannot be read), asked through the node at `url`.
async fn stream_leaders(url: &str, settings: &JetStreamSettings) -> Vec<(String, Option<String>)> {
    let streams = [
        format!("KV_{}", settings.results_bucket),
        settings.queue_stream.clone(),
    ];
    let Ok(Ok(client)) =
        tokio::time::timeout(Duration::from_secs(5), async_nats::connect(url)).await
    else {
        return streams.into_iter().map(|s| (s, None)).collect();
    };
    let jetstream = async_nats::jetstream::new(client);
    let mut leaders = Vec::new();
    for stream in streams {
        let leader = tokio::time::timeout(Duration::from_secs(5), jetstream.get_stream(&stream))
            .await
            .ok()
            .and_then(Result::ok)
            .and_then(|s| s.cached_info().cluster.as_ref()?.leader.clone());
        leaders.push((stream, leader));
    }
    leaders
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_spreads_the_disruptions_over_the_run() {
        let s = Schedule::over(165.0);
        assert!(s.rolling_restart_at_s > 0.0);
        assert!(s.rolling_restart_at_s < s.node_kill_at_s);
        assert!(s.node_kill_at_s + s.node_down_s < s.gateway_kill_at_s);
        assert!(s.gateway_kill_at_s + s.gateway_down_s + s.quiet_s < s.load_s);
        // A short run keeps its outages long enough to be outages.
        assert!(Schedule::over(30.0).node_down_s >= 5.0);
    }
}
