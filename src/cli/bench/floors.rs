//! The floors a run compares genfleet with, measured in the same run with the load of the phase
//! they are the floor of (its concurrency, reply length and budget):
//! plain NATS request-reply against a trivial responder that echoes the payload (what one bus
//! round trip costs), JetStream writes as a lean request would make them (a KV create, then an
//! update of the same key), and the backend called directly over HTTP with the request a
//! worker sends it, and the same request not streamed, each read to the last byte (what the
//! model call costs without genfleet: the faster of the two is the floor latency is added to).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use serde::Serialize;

use super::budget::Budget;
use super::closed_loop;
use super::interactive::LoadSpec;
use super::latency::Summary;
use super::meter::Meter;
use super::monitor::BusOps;
use super::procstat::ProcessUsage;
use super::target::Target;
use super::workload;

#[derive(Debug, Clone, Serialize)]
pub struct FloorReport {
    pub concurrency: usize,
    pub payload_bytes: usize,
    pub requests: u64,
    pub errors: u64,
    pub duration_secs: f64,
    pub requests_per_sec: f64,
    pub latency_ms: Option<Summary>,
    /// Backend floor only: reply tokens per second (known reply length × calls / seconds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    /// Backend floor only: `as sent by the worker` (taken from the mock's request log) or
    /// `constructed` (the backend keeps no log).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    pub processes: Vec<ProcessUsage>,
    /// Bus operations per call, from nats-server's counters.
    pub bus: Option<BusOps>,
}

/// Request-reply against an echo responder on a subject of this run, with a payload the size
/// of a submit of the load's reply length. The responder runs in this process on its own connection.
pub async fn nats_request_reply(
    target: &Target,
    load: &LoadSpec,
    meter: &Meter,
) -> anyhow::Result<FloorReport> {
    let payload = submit_body(target, load.reply_tokens);
    let subject = format!("_genfleet_bench.{}.echo", target.run_id);
    let responder = crate::client::connect::connect(
        &target.settings.nats,
        crate::client::connect::ConnectPurpose::Client,
    )
    .await?;
    let mut requests_in = responder.subscribe(subject.clone()).await?;
    responder.flush().await?;
    let echo = tokio::spawn(async move {
        while let Some(message) = requests_in.next().await {
            if let Some(reply) = message.reply {
                let _ = responder.publish(reply, message.payload).await;
            }
        }
    });
    let call = |client: usize| {
        let nats = target.connection(client).clone();
        let subject = subject.clone();
        let payload = payload.clone();
        async move {
            let request = async_nats::Request::new()
                .payload(payload)
                .timeout(Some(target.timeout));
            nats.send_request(subject, request).await.is_ok()
        }
    };
    // Warm up: one call per client.
    futures_util::future::join_all((0..load.concurrency).map(call)).await;
    let report = drive("floor: nats", load, meter, call).await;
    echo.abort();
    Ok(FloorReport {
        payload_bytes: payload.len(),
        tokens_per_sec: None,
        body: None,
        ..report
    })
}

/// JetStream writes as a lean request would make them: a KV create (the claim), then an update
/// of the same key at the revision the create returned (the result). One call is the pair,
/// each write carrying a payload the size of a submit of the load's reply length. The bucket is made
/// like the results bucket (history 1, `jetstream.replicas`, through its stream as the worker
/// makes it) but with a short TTL, and deleted afterwards.
pub async fn jetstream_writes(
    target: &Target,
    load: &LoadSpec,
    meter: &Meter,
) -> anyhow::Result<FloorReport> {
    let payload = submit_body(target, load.reply_tokens);
    let name = format!("genfleet_bench_floor_{}", target.run_id);
    let admin = async_nats::jetstream::new(target.connection(0).clone());
    crate::client::streams::ensure_bucket(
        &admin,
        &name,
        1,
        FLOOR_BUCKET_TTL,
        target.settings.jetstream.replicas,
    )
    .await?;
    // Each client writes on its own connection, as separate workers would.
    let mut buckets = Vec::with_capacity(load.concurrency);
    for client in 0..load.concurrency {
        buckets.push(
            async_nats::jetstream::new(target.connection(client).clone())
                .get_key_value(&name)
                .await?,
        );
    }
    let keys = AtomicU64::new(0);
    let call = |client: usize| {
        let bucket = buckets[client].clone();
        let key = format!("pair.{}", keys.fetch_add(1, Ordering::Relaxed));
        let payload = payload.clone();
        async move {
            match bucket.create(&key, payload.clone()).await {
                Ok(revision) => bucket.update(&key, payload, revision).await.is_ok(),
                Err(_) => false,
            }
        }
    };
    futures_util::future::join_all((0..load.concurrency).map(call)).await;
    let report = drive("floor: jetstream", load, meter, call).await;
    if let Err(error) = admin.delete_stream(format!("KV_{name}")).await {
        tracing::warn!(message = "the JetStream floor's bucket was not deleted", bucket = %name, %error);
    }
    Ok(FloorReport {
        payload_bytes: payload.len(),
        ..report
    })
}

/// How long a write of the JetStream floor is kept: the bucket is deleted after the floor, and
/// one left behind by an interrupted run empties itself.
const FLOOR_BUCKET_TTL: Duration = Duration::from_secs(600);

/// The body of a submit of `reply_tokens`, as the load sends it.
fn submit_body(target: &Target, reply_tokens: usize) -> bytes::Bytes {
    serde_json::to_vec(&workload::request(
        target.request_id("floor", 0),
        reply_tokens,
    ))
    .expect("requests serialize")
    .into()
}

/// The backend called directly with the chat request a worker sends for a request of the
/// load's reply length (`streamed`), or the same request not streamed: timed to the last byte
/// of the response.
pub async fn backend_http(
    backend_url: &str,
    model: &str,
    load: &LoadSpec,
    meter: &Meter,
    streamed: bool,
) -> anyhow::Result<FloorReport> {
    let http = reqwest::Client::builder().build()?;
    let base = backend_url.trim_end_matches('/');
    let (body, how) = backend_body(&http, base, model, load.reply_tokens, streamed).await;
    let url = format!("{base}/chat/completions");
    let call = |_client: usize| {
        let request = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body.clone());
        async move {
            match request.send().await {
                Ok(response) if response.status().is_success() => response.bytes().await.is_ok(),
                _ => false,
            }
        }
    };
    futures_util::future::join_all((0..load.concurrency).map(call)).await;
    let report = drive("floor: backend", load, meter, call).await;
    let ok = report.requests - report.errors;
    Ok(FloorReport {
        payload_bytes: body.len(),
        tokens_per_sec: Some((ok * load.reply_tokens as u64) as f64 / report.duration_secs),
        body: Some(how.to_string()),
        ..report
    })
}

/// The body of a direct call to the backend (`base`, its URL up to `/v1`) for a reply of
/// `reply_tokens`, and how it was made: the request a worker sent the mock (from its request
/// log; a warm-up made one), else one put together here. Not `streamed`: the same request
/// without `stream` and `stream_options`.
pub async fn backend_body(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    reply_tokens: usize,
    streamed: bool,
) -> (bytes::Bytes, &'static str) {
    let (mut body, how) = match worker_request(http, base, reply_tokens).await {
        Some(body) => (body, "as sent by the worker"),
        None => (constructed_request(model, reply_tokens), "constructed"),
    };
    if !streamed && let Some(fields) = body.as_object_mut() {
        fields.insert("stream".into(), serde_json::Value::Bool(false));
        fields.remove("stream_options");
    }
    let how = match (streamed, how) {
        (true, how) => how,
        (false, "as sent by the worker") => "as sent by the worker, not streamed",
        (false, _) => "constructed, not streamed",
    };
    (
        serde_json::to_vec(&body).expect("JSON serializes").into(),
        how,
    )
}

/// The body a worker sent the mock for a request of `reply_tokens` (the warm-up made one),
/// from the mock's request log; `None` when the backend keeps no log or has none such.
async fn worker_request(
    http: &reqwest::Client,
    base: &str,
    reply_tokens: usize,
) -> Option<serde_json::Value> {
    let log_url = format!("{}/mock/requests", base.trim_end_matches("/v1"));
    let bodies: Vec<serde_json::Value> = http.get(log_url).send().await.ok()?.json().await.ok()?;
    let text = workload::words(reply_tokens);
    let body = bodies.into_iter().rev().find(|body| {
        body.pointer("/messages")
            .and_then(|m| m.as_array())
            .and_then(|m| m.last())
            .and_then(|m| m.get("content"))
            .and_then(|c| c.as_str())
            == Some(text.as_str())
    })?;
    Some(body)
}

fn constructed_request(model: &str, reply_tokens: usize) -> serde_json::Value {
    let request = workload::request(String::new(), reply_tokens);
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": request.messages[0].text()}],
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": request.max_tokens,
    })
}

/// The load's clients calling `call` in a loop until its budget is spent; a call that says
/// `false` failed.
async fn drive<F, Fut>(label: &str, load: &LoadSpec, meter: &Meter, call: F) -> FloorReport
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let budget = Budget::new(load.requests, load.duration);
    let looped = closed_loop::run(label, load.concurrency, budget, meter, |client| {
        call(client).map(|ok| if ok { Ok(()) } else { Err(()) })
    })
    .await;
    let ok = looped.samples.len() as u64;
    let errors = looped.errors.len() as u64;
    let cost = looped.spent.per_request(ok);
    FloorReport {
        concurrency: load.concurrency,
        payload_bytes: 0,
        requests: ok + errors,
        errors,
        duration_secs: looped.secs,
        requests_per_sec: ok as f64 / looped.secs,
        latency_ms: looped.samples.summary(),
        tokens_per_sec: None,
        body: None,
        processes: cost.processes,
        bus: cost.bus,
    }
}
