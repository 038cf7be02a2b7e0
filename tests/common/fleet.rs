//! A fleet for a test ([`Fleet::builder`]), the requests a test sends it, its
//! real processes for the fault and soak tests (`genfleet worker` and `genfleet mock-llm` as
//! child processes, so a test can SIGKILL them and read their memory), and the checks that a
//! fleet has come back to rest: every slot free, no message in flight, no record left but
//! results.

mod builder;
mod requests;

// Each test binary uses some of them.
#[allow(unused_imports)]
pub use builder::{Fleet, FleetBuilder, calculator};
#[allow(unused_imports)]
pub use requests::{
    RUNNING, RUNNING_OR_UNCLAIMED, RUNNING_UNCLAIMED_OR_UNANSWERED, request, run_when_tools_known,
    submit_until_accepted, submit_when_tools_known, take_exactly_once, terminal, wait_result,
};

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use crate::common::wait;

/// A child process killed (SIGKILL) and reaped on drop.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and waits for the process to end.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and waits for the process to end (a worker drains and takes its heartbeat
    /// away).
    pub fn terminate(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let _ = self.child.wait();
    }

    /// SIGTERM, without waiting: the process drains while the test goes on (an in-process
    /// backend it still calls keeps answering).
    pub fn ask_to_stop(&self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
    }

    /// Resident memory (VmRSS) in KiB, from /proc.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .unwrap_or_else(|e| panic!("{} is not running: {e}", self.name));
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .expect("VmRSS in /proc/<pid>/status")
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `genfleet worker` with the given `GENFLEET__...` settings; its log goes to `log_dir`.
pub fn worker(id: &str, nats_url: &str, env: &[(&str, String)], log_dir: &Path) -> Proc {
    worker_of(
        super::process::genfleet_command(),
        id,
        nats_url,
        env,
        log_dir,
    )
}

/// [`worker`], of the `genfleet` executable `command` runs (another release's, say).
pub fn worker_of(
    mut command: Command,
    id: &str,
    nats_url: &str,
    env: &[(&str, String)],
    log_dir: &Path,
) -> Proc {
    let log = std::fs::File::create(log_dir.join(format!("{id}.log"))).expect("worker log");
    let child = command
        .arg("worker")
        .env("GENFLEET__NATS__URL", nats_url)
        .env("GENFLEET__WORKER__ID", id)
        .env("RUST_LOG", "warn")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("genfleet worker starts");
    Proc {
        child,
        name: format!("worker {id}"),
    }
}

/// `genfleet mock-llm` on `listen` (port 0: a free one) with a script file; returns once it
/// listens, with its base URL.
pub fn mock_llm(listen: &str, script: &Path) -> (Proc, String) {
    // The port of a killed mock can take a moment to be free again: start it again until then.
    wait::until_blocking(
        &format!("mock-llm to listen on {listen}"),
        Duration::from_secs(10),
        || {
            let mut child = Command::new(env!("CARGO_BIN_EXE_genfleet"))
                .args(["mock-llm", "--listen", listen, "--script"])
                .arg(script)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("genfleet mock-llm starts");
            let stdout = child.stdout.take().expect("piped stdout");
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            match line.trim().strip_prefix("mock-llm listening on ") {
                Some(url) => Ok((
                    Proc {
                        child,
                        name: "mock-llm".into(),
                    },
                    url.to_string(),
                )),
                None => {
                    let _ = child.kill();
                    let _ = child.wait();
                    Err(format!("it printed {line:?}"))
                }
            }
        },
    )
}

/// The `$SRV.STATS` data of every worker that answers within `wait`, by worker id:
/// `{"slots", "busy", "free", "draining"}`.
pub async fn worker_stats(
    nats: &async_nats::Client,
    wait: Duration,
) -> BTreeMap<String, serde_json::Value> {
    let inbox = nats.new_inbox();
    let mut replies = nats.subscribe(inbox.clone()).await.expect("subscribe");
    nats.publish_with_reply("$SRV.STATS.genfleet", inbox, "".into())
        .await
        .expect("publish");
    let mut stats = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Some(reply)) = tokio::time::timeout_at(deadline, replies.next()).await {
        if reply.status.is_some() || reply.payload.is_empty() {
            // No responders (yet): no worker is there.
            continue;
        }
        let value: serde_json::Value = serde_json::from_slice(&reply.payload).expect("stats JSON");
        let id = value["name"].as_str().unwrap_or_default().to_string();
        let id = value["id"].as_str().map(str::to_string).unwrap_or(id);
        stats.insert(id, value["endpoints"][0]["data"].clone());
    }
    stats
}

/// A raw submit to `pool`, sent again for up to 20 s while no worker has a free slot ("no
/// responders": no worker is there yet; or `NO_SLOT_AVAILABLE`: a one-slot worker frees its
/// slot just after the result is stored), as the client library does.
pub async fn submit_raw(
    nats: &async_nats::Client,
    pool: &str,
    headers: async_nats::HeaderMap,
    body: impl Into<bytes::Bytes>,
) -> Result<async_nats::Message, async_nats::RequestError> {
    let body = body.into();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = nats
            .request_with_headers(format!("gen.submit.{pool}"), headers.clone(), body.clone())
            .await;
        let no_slot = match &reply {
            Err(e) => e.kind() == async_nats::RequestErrorKind::NoResponders,
            Ok(reply) => reply
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Service-Error-Code"))
                .is_some_and(|code| code.as_str() == "503"),
        };
        if !no_slot || Instant::now() >= deadline {
            return reply;
        }
        // Paces the retries, as the client library does; the caller judges the last reply.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded) until `expected` workers answer and each has all its slots free.
pub async fn wait_all_slots_free(
    nats: &async_nats::Client,
    expected: usize,
    within: Duration,
) -> BTreeMap<String, serde_json::Value> {
    wait::until(
        &format!("{expected} workers with every slot free"),
        within,
        || async {
            let stats = worker_stats(nats, Duration::from_millis(400)).await;
            let at_rest = stats.len() == expected
                && stats
                    .values()
                    .all(|s| s["busy"] == 0 && s["free"] == s["slots"]);
            if at_rest {
                Ok(stats)
            } else {
                Err(format!("{stats:?}"))
            }
        },
    )
    .await
}

/// How long the buckets may take to answer: a JetStream cluster electing a leader answers
/// errors for a moment.
const BUCKETS_ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// The keys of the results bucket, by kind (`req`, `res`, `idx`, `cont`, ...).
pub async fn result_keys(nats: &async_nats::Client) -> BTreeMap<String, Vec<String>> {
    wait::until(
        "the keys of the results bucket",
        BUCKETS_ANSWER_WITHIN,
        || try_result_keys(nats),
    )
    .await
}

/// One look at the keys of the results bucket, by kind; an error when the bucket does not
/// answer (a JetStream cluster still electing a leader).
async fn try_result_keys(
    nats: &async_nats::Client,
) -> Result<BTreeMap<String, Vec<String>>, String> {
    let kv = async_nats::jetstream::new(nats.clone())
        .get_key_value("GENFLEET_RESULTS")
        .await
        .map_err(|e| e.to_string())?;
    let mut keys = kv.keys().await.map_err(|e| e.to_string())?;
    let mut by_kind: BTreeMap<String, Vec<String>> = BTreeMap::new();
    while let Some(Ok(key)) = keys.next().await {
        let kind = key.split('.').next().unwrap_or_default().to_string();
        by_kind.entry(kind).or_default().push(key);
    }
    Ok(by_kind)
}

/// The record of a request (`res.<id>`) as JSON, if there is one.
pub async fn record(nats: &async_nats::Client, request_id: &str) -> Option<serde_json::Value> {
    wait::until(
        "the results bucket to be read",
        BUCKETS_ANSWER_WITHIN,
        || try_record(nats, request_id),
    )
    .await
}

/// One read of a request's record; an error when the bucket does not answer.
async fn try_record(
    nats: &async_nats::Client,
    request_id: &str,
) -> Result<Option<serde_json::Value>, String> {
    let kv = async_nats::jetstream::new(nats.clone())
        .get_key_value("GENFLEET_RESULTS")
        .await
        .map_err(|e| e.to_string())?;
    let value = kv
        .get(format!("res.{request_id}"))
        .await
        .map_err(|e| e.to_string())?;
    Ok(value.and_then(|v| serde_json::from_slice(&v).ok()))
}

/// The requests each worker's heartbeat lists as running, by worker id.
pub async fn heartbeats(nats: &async_nats::Client) -> BTreeMap<String, Vec<String>> {
    let js = async_nats::jetstream::new(nats.clone());
    wait::until("the heartbeats", BUCKETS_ANSWER_WITHIN, || async {
        let kv = js
            .get_key_value("GENFLEET_WORKERS")
            .await
            .map_err(|e| e.to_string())?;
        // Listing a bucket's keys while its entries expire (a lost worker's heartbeat) can wait
        // for ever: each look is bounded, and a look that ran out is looked again.
        let listed = tokio::time::timeout(Duration::from_secs(3), async {
            let mut keys = kv.keys().await.map_err(|e| e.to_string())?;
            let mut found = BTreeMap::new();
            while let Some(Ok(worker)) = keys.next().await {
                if let Ok(Some(value)) = kv.get(&worker).await
                    && let Ok(beat) = serde_json::from_slice::<serde_json::Value>(&value)
                {
                    let running = beat["running"]
                        .as_array()
                        .map(|ids| {
                            ids.iter()
                                .filter_map(|id| id.as_str().map(String::from))
                                .collect()
                        })
                        .unwrap_or_default();
                    found.insert(worker, running);
                }
            }
            Ok::<_, String>(found)
        })
        .await;
        listed.unwrap_or_else(|_| Err("listing the heartbeats took over 3 s".to_string()))
    })
    .await
}

/// Waits (bounded) until the results bucket holds only ended requests: results and tombstones
/// (and the marks of answered decisions), no record of a running request, nothing else.
pub async fn wait_only_results_left(nats: &async_nats::Client, within: Duration) {
    wait::until(
        "only results left in the results bucket",
        within,
        || async {
            // A bucket that does not answer yet (a cluster still electing) is looked at again
            // within this wait, not failed on its own shorter bound.
            let keys = try_result_keys(nats).await?;
            let mut stray: Vec<String> = keys
                .iter()
                .filter(|(kind, _)| !matches!(kind.as_str(), "res" | "cont"))
                .flat_map(|(_, keys)| keys.iter().cloned())
                .collect();
            for key in keys.get("res").into_iter().flatten() {
                let id = key.trim_start_matches("res.");
                if let Some(record) = try_record(nats, id).await?
                    && record.get("live").is_some()
                {
                    stray.push(format!("{key} (live: {record})"));
                }
            }
            if stray.is_empty() {
                Ok(())
            } else {
                Err(format!("{stray:?}"))
            }
        },
    )
    .await
}

/// Waits (bounded) until the pool's queue holds no message and none is being worked on.
pub async fn wait_queue_empty(nats: &async_nats::Client, pool: &str, within: Duration) {
    let js = async_nats::jetstream::new(nats.clone());
    wait::until(
        &format!("the queue of pool {pool} to be empty"),
        within,
        || async {
            let mut stream = js.get_stream("GENFLEET_QUEUE").await.expect("queue stream");
            let messages = stream.info().await.expect("stream info").state.messages;
            let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
                .get_consumer(&format!("genfleet-{pool}"))
                .await
                .expect("pool consumer");
            let info = consumer.info().await.expect("consumer info");
            if messages == 0 && info.num_ack_pending == 0 && info.num_pending == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{messages} messages, {} pending, {} unacknowledged",
                    info.num_pending, info.num_ack_pending
                ))
            }
        },
    )
    .await
}

/// Waits (bounded, `within` for each check) until the fleet is at rest: the pool's queue holds
/// nothing, `workers` workers answer with every slot free, and the results bucket holds only
/// ended requests.
pub async fn wait_at_rest(nats: &async_nats::Client, pool: &str, workers: usize, within: Duration) {
    wait_queue_empty(nats, pool, within).await;
    wait_all_slots_free(nats, workers, within).await;
    wait_only_results_left(nats, within).await;
}

/// Waits (bounded) until `count` workers answer the service API; else fails with the logs in
/// `logs` (worker processes write theirs there).
pub async fn wait_workers(nats: &async_nats::Client, count: usize, within: Duration, logs: &Path) {
    let logs_text = || {
        let mut all = String::from("their logs:\n");
        for entry in std::fs::read_dir(logs).unwrap().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            all.push_str(&format!("--- {}\n{text}\n", entry.path().display()));
        }
        all
    };
    wait::until_showing(
        &format!("{count} workers to come up"),
        within,
        || async {
            match worker_stats(nats, Duration::from_millis(200)).await.len() {
                up if up >= count => Ok(()),
                up => Err(format!("{up} answered")),
            }
        },
        logs_text,
    )
    .await;
}

/// Waits (bounded) until exactly the workers `ids` answer the service API, each placing keyed
/// requests among all the others (its `peers` count): from then on every worker ranks a key's
/// workers alike.
pub async fn wait_placement(nats: &async_nats::Client, ids: &[&str], within: Duration) {
    let mut want: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
    want.sort();
    wait::until(
        &format!("workers {want:?} to see each other"),
        within,
        || async {
            let stats: BTreeMap<String, serde_json::Value> =
                worker_stats(nats, Duration::from_millis(300))
                    .await
                    .into_values()
                    .map(|s| (s["worker_id"].as_str().unwrap_or_default().to_string(), s))
                    .collect();
            let up: Vec<String> = stats.keys().cloned().collect();
            if up != want {
                return Err(format!("{up:?} answered"));
            }
            match stats
                .iter()
                .find(|(_, s)| s["peers"].as_u64() != Some(ids.len() as u64 - 1))
            {
                Some((id, s)) => Err(format!("{id} sees {} peers", s["peers"])),
                None => Ok(()),
            }
        },
    )
    .await;
}

/// The slot counts of worker `worker_id` (`{"total", "busy", "draining", "waiting"}`), from its
/// own `capacity` endpoint; `None` while it does not answer.
pub async fn capacity(nats: &async_nats::Client, worker_id: &str) -> Option<serde_json::Value> {
    let reply = nats
        .request(format!("gen.worker.{worker_id}.capacity"), "".into())
        .await
        .ok()?;
    let stats: serde_json::Value = serde_json::from_slice(&reply.payload).ok()?;
    Some(stats["capacity"].clone())
}

/// Waits (bounded) until worker `worker_id` answers with every slot free and nothing waiting
/// for one.
pub async fn wait_worker_idle(nats: &async_nats::Client, worker_id: &str, within: Duration) {
    wait::until(
        &format!("worker {worker_id} with every slot free"),
        within,
        || async {
            let capacity = capacity(nats, worker_id).await;
            match &capacity {
                Some(c) if c["busy"] == 0 && c["waiting"] == 0 && c["draining"] == false => Ok(()),
                _ => Err(format!("{capacity:?}")),
            }
        },
    )
    .await
}
