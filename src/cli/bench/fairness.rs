//! Fair share and the cost of scheduling (`--mode fairness`).
//!
//! Fair share: a light tenant puts a request on the durable queue every few milliseconds,
//! first on an idle fleet, then right after a flooding tenant has put a burst there. The light
//! tenant's queue wait (from its publish to its `started` event, measured here to the
//! microsecond) is compared: the target is a p50 at most twice the idle one.
//!
//! Overhead: interactive requests at the phase's concurrency, on the v1 subject (default
//! tenant, no priority) and as a tenant with a priority band, in turns; the target is a
//! throughput at most 5% lower with them.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;

use super::target::Target;
use super::workload;
use crate::client::Client;
use crate::protocol::{EventBody, GenerationRequest, Priority, RequestState};

/// The tenants the phase uses.
const LIGHT: &str = "bench-light";
const FLOOD: &str = "bench-flood";
const TAGGED: &str = "bench-tenant";

/// Publishes of the flood waiting for their acknowledgement at once.
const PUBLISHES_IN_FLIGHT: usize = 256;

#[derive(Debug, Clone, Serialize)]
pub struct FairnessReport {
    pub light_requests: u64,
    /// Between two of the light tenant's requests.
    pub light_every_ms: u64,
    pub flood_requests: u64,
    /// The light tenant's p50 queue wait on an idle fleet.
    pub idle_wait_p50_ms: f64,
    /// ... beside the flood.
    pub flooded_wait_p50_ms: f64,
    /// flooded / idle; the target is at most 2.
    pub wait_ratio: f64,
    /// The flooding tenant's p50 queue wait, for scale.
    pub flood_wait_p50_ms: Option<f64>,
    /// Interactive requests per second on the v1 subject, and as a tenant with a band.
    pub v1_per_sec: f64,
    pub tenant_band_per_sec: f64,
    /// How much lower the second is, in percent; the target is at most 5.
    pub overhead_pct: f64,
}

pub struct FairnessSpec {
    pub light: u64,
    /// Between two of the light tenant's requests.
    pub light_every: Duration,
    pub flood: u64,
    pub reply_tokens: usize,
    pub concurrency: usize,
    /// Each turn of the overhead measurement.
    pub turn: Duration,
    pub turns: u32,
}

pub async fn run(target: &Target, spec: &FairnessSpec) -> anyhow::Result<FairnessReport> {
    let client = Client::new(target.connection(0).clone(), target.subjects.clone());
    let light = client.clone().with_tenant(LIGHT)?;
    let flood = client.clone().with_tenant(FLOOD)?;
    let wait = target.timeout;

    eprintln!("fairness: the light tenant on an idle fleet");
    let idle = light_waits(target, &light, "idle", spec, wait).await?;

    eprintln!(
        "fairness: {} requests of a flooding tenant, then the light one",
        spec.flood
    );
    let flood_ids: Vec<String> = (0..spec.flood)
        .map(|n| target.request_id("flood", n))
        .collect();
    // The flooding tenant's events: its requests are `<tenant>.<id>` on the bus.
    let mut follower = target
        .connection(1)
        .subscribe(target.subjects.events(&format!("{FLOOD}.*")))
        .await?;
    let flood_prefix = flood.on_bus(&target.request_id("flood", 0));
    let flood_prefix = flood_prefix.trim_end_matches('0').to_string();
    let flood_count = spec.flood as usize;
    let flood_waits = tokio::spawn(async move {
        let mut waits = Vec::new();
        while waits.len() < flood_count {
            let Some(message) = follower.next().await else {
                break;
            };
            let Ok(event) = serde_json::from_slice::<crate::protocol::Event>(&message.payload)
            else {
                continue;
            };
            if let EventBody::Finished { result } = event.body
                && event.request_id.starts_with(&flood_prefix)
            {
                waits.push(result.timings_ms.queued as f64);
            }
        }
        waits
    });
    let published: Vec<bool> = futures_util::stream::iter(flood_ids.iter().cloned())
        .map(|id| {
            let flood = flood.clone();
            let pool = target.pool.clone();
            let reply_tokens = spec.reply_tokens;
            async move {
                flood
                    .enqueue(&pool, &workload::request(id, reply_tokens))
                    .await
                    .is_ok()
            }
        })
        .buffered(PUBLISHES_IN_FLIGHT)
        .collect()
        .await;
    anyhow::ensure!(
        published.iter().all(|ok| *ok),
        "the queue did not take the whole flood"
    );
    let flooded = light_waits(target, &light, "flooded", spec, wait).await?;
    let flood_waits = tokio::time::timeout(wait.max(Duration::from_secs(120)), flood_waits)
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    target
        .release(flood_ids.iter().map(|id| flood.on_bus(id)).collect())
        .await;

    eprintln!("fairness: interactive throughput, v1 subjects against a tenant with a band");
    let (mut v1, mut banded) = (0.0, 0.0);
    for turn in 0..spec.turns {
        v1 += throughput(target, None, spec, turn).await;
        banded += throughput(target, Some(Priority::High), spec, turn).await;
    }
    let (v1, banded) = (v1 / spec.turns as f64, banded / spec.turns as f64);
    let idle_p50 = p50(idle).unwrap_or(0.0);
    let flooded_p50 = p50(flooded).unwrap_or(0.0);
    Ok(FairnessReport {
        light_requests: spec.light,
        light_every_ms: spec.light_every.as_millis() as u64,
        flood_requests: spec.flood,
        idle_wait_p50_ms: idle_p50,
        flooded_wait_p50_ms: flooded_p50,
        wait_ratio: if idle_p50 > 0.0 {
            flooded_p50 / idle_p50
        } else {
            f64::NAN
        },
        flood_wait_p50_ms: p50(flood_waits),
        v1_per_sec: v1,
        tenant_band_per_sec: banded,
        overhead_pct: if v1 > 0.0 {
            (v1 - banded) / v1 * 100.0
        } else {
            f64::NAN
        },
    })
}

/// The light tenant's requests, one every `spec.light_every`, each followed to its end: their
/// queue waits in ms.
async fn light_waits(
    target: &Target,
    light: &Client,
    phase: &str,
    spec: &FairnessSpec,
    wait: Duration,
) -> anyhow::Result<Vec<f64>> {
    let mut runs = tokio::task::JoinSet::new();
    let mut ids = Vec::new();
    for n in 0..spec.light {
        let id = target.request_id(&format!("light-{phase}"), n);
        ids.push(light.on_bus(&id));
        let light = light.clone();
        let pool = target.pool.clone();
        let request = workload::request(id.clone(), spec.reply_tokens);
        let mut events = Box::pin(light.follow(&id).await?);
        runs.spawn(async move {
            let published = Instant::now();
            light.enqueue(&pool, &request).await.ok()?;
            let mut started = None;
            let finished = tokio::time::timeout(wait, async {
                while let Some(event) = events.next().await {
                    match event.body {
                        EventBody::Started { .. } if started.is_none() => {
                            started = Some(published.elapsed());
                        }
                        EventBody::Finished { result } => return Some(*result),
                        _ => {}
                    }
                }
                None
            })
            .await
            .ok()
            .flatten()?;
            let started = started?;
            (finished.state == RequestState::Completed).then_some(started.as_secs_f64() * 1000.0)
        });
        tokio::time::sleep(spec.light_every).await;
    }
    let mut waits = Vec::new();
    while let Some(done) = runs.join_next().await {
        if let Ok(Some(queued)) = done {
            waits.push(queued);
        }
    }
    target.release(ids).await;
    anyhow::ensure!(
        waits.len() as u64 == spec.light,
        "only {} of the light tenant's {} requests completed",
        waits.len(),
        spec.light
    );
    Ok(waits)
}

/// Interactive requests completed per second over one turn, at the spec's concurrency: on
/// the v1 subject, or (`band` given) as a tenant in that band.
async fn throughput(
    target: &Target,
    band: Option<Priority>,
    spec: &FairnessSpec,
    turn: u32,
) -> f64 {
    let started = Instant::now();
    let label = if band.is_some() { "banded" } else { "v1" };
    let loops = (0..spec.concurrency).map(|c| {
        let v1 = Client::new(target.connection(c).clone(), target.subjects.clone());
        let client = match band {
            Some(_) => v1
                .with_tenant(TAGGED)
                .expect("the bench's tenant name is valid"),
            None => v1,
        };
        let pool = target.pool.clone();
        let reply_tokens = spec.reply_tokens;
        let prefix = format!("{label}-{turn}-{c}");
        let until = started + spec.turn;
        async move {
            let mut done = 0u64;
            let mut n = 0u64;
            while Instant::now() < until {
                let id = target.request_id(&prefix, n);
                n += 1;
                let mut request: GenerationRequest = workload::request(id, reply_tokens);
                request.priority = band;
                // `run` reads (and so releases) the result.
                if let Ok(result) = client.run(&pool, request, target.timeout).await
                    && result.state == RequestState::Completed
                {
                    done += 1;
                }
            }
            done
        }
    });
    let done: u64 = futures_util::future::join_all(loops)
        .await
        .into_iter()
        .sum();
    done as f64 / started.elapsed().as_secs_f64()
}

/// The report as lines for people.
pub fn table(r: &FairnessReport) -> String {
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1} ms"));
    [
        format!(
            "fair share: light tenant ({} requests, one every {} ms) beside a flood of {}",
            r.light_requests, r.light_every_ms, r.flood_requests
        ),
        format!(
            "  light p50 queue wait, idle fleet:    {:.2} ms",
            r.idle_wait_p50_ms
        ),
        format!(
            "  light p50 queue wait, beside flood:  {:.2} ms",
            r.flooded_wait_p50_ms
        ),
        format!(
            "  ratio:                               {:.2} (target at most 2)",
            r.wait_ratio
        ),
        format!(
            "  flooding tenant's p50 queue wait:    {}",
            ms(r.flood_wait_p50_ms)
        ),
        "interactive throughput".to_string(),
        format!(
            "  v1 subjects:                         {:.1} req/s",
            r.v1_per_sec
        ),
        format!(
            "  a tenant, band high:                 {:.1} req/s",
            r.tenant_band_per_sec
        ),
        format!(
            "  overhead:                            {:.1}% (target at most 5%)",
            r.overhead_pct
        ),
    ]
    .join("\n")
}

fn p50(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    Some(values[values.len() / 2])
}
