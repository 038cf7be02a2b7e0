//! The worker's HTTP server: /metrics parses and moves with load, /healthz, and /readyz going
//! unready while draining, without NATS, or without a backend.

mod common;

use std::time::Duration;

use common::fleet::{self, Fleet};
use common::nats::NatsServer;
use common::wait;
use genfleet::bus::worker::WorkerHandle;
use genfleet::llm::mock::{MockServer, Script};
use genfleet::protocol::{ErrorCode, GenerationRequest, Priority};
use genfleet::settings::Settings;

/// A fleet whose worker serves HTTP at `base`.
struct Served {
    fleet: Fleet,
    base: String,
}

async fn served(script: &str) -> Served {
    let fleet = Fleet::builder()
        .script(script)
        .default_settings()
        .client_timeout(Duration::from_secs(10))
        .slots(2)
        .settings(|s| {
            s.worker.drain_timeout_ms = 5000;
            s.http.listen = "127.0.0.1:0".into();
            s.http.backend_probe_ms = 100;
        })
        .start()
        .await;
    let base = format!(
        "http://{}",
        fleet.workers[0].http_addr.expect("the HTTP server listens")
    );
    Served { fleet, base }
}

async fn get(base: &str, path: &str) -> (u16, String) {
    genfleet::llm::openai::install_crypto_provider();
    let response = reqwest::get(format!("{base}{path}")).await.unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// How long anything here may take: generous, a busy machine is slow, never wrong.
const WITHIN: Duration = Duration::from_secs(10);

/// Polls `path` until its status is `want`, returning the body.
async fn until_status(base: &str, path: &str, want: u16) -> String {
    wait::until(&format!("{path} to answer {want}"), WITHIN, || async {
        match get(base, path).await {
            (status, body) if status == want => Ok(body),
            (status, body) => Err(format!("{status}: {body}")),
        }
    })
    .await
}

/// The samples of a metric as (labels, value).
fn samples(text: &str, name: &str) -> Vec<(Vec<(String, String)>, f64)> {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("Prometheus text parses");
    scrape
        .samples
        .into_iter()
        .filter(|s| s.metric == name)
        .map(|s| {
            let mut labels: Vec<(String, String)> = s
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            labels.sort();
            let value = match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                prometheus_parse::Value::Histogram(_) | prometheus_parse::Value::Summary(_) => {
                    f64::NAN
                }
            };
            (labels, value)
        })
        .collect()
}

fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut want: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    want.sort();
    samples(text, name)
        .into_iter()
        .find(|(l, _)| *l == want)
        .map(|(_, v)| v)
        .unwrap_or(0.0)
}

#[tokio::test]
async fn metrics_parse_and_move_with_load() {
    let s = served(
        "[[rules]]\nwhen_last_user_contains = \"slow\"\nreply = \"a b c d e f\"\ndelay_ms = 150\n\
         [[rules]]\nreply = \"done\"\n",
    )
    .await;
    assert_eq!(get(&s.base, "/healthz").await.0, 200);
    until_status(&s.base, "/readyz", 200).await;
    let before = get(&s.base, "/metrics").await.1;
    assert_eq!(value(&before, "genfleet_slots_total", &[]), 2.0);
    assert_eq!(value(&before, "genfleet_slots_busy", &[]), 0.0);
    assert_eq!(value(&before, "genfleet_backend_up", &[]), 1.0);

    let slow = GenerationRequest {
        request_id: Some("slow-1".into()),
        ..GenerationRequest::user("slow")
    };
    s.fleet.client.submit("default", &slow).await.unwrap();
    wait::until(
        "a running request to show as a busy slot",
        WITHIN,
        || async {
            match value(
                &get(&s.base, "/metrics").await.1,
                "genfleet_slots_busy",
                &[],
            ) {
                1.0 => Ok(()),
                busy => Err(busy),
            }
        },
    )
    .await;
    for i in 0..3 {
        s.fleet
            .client
            .run(
                "default",
                GenerationRequest::user(format!("quick {i}")),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    // A bad request through the durable queue ends FAILED invalid_request.
    let js = async_nats::jetstream::new(s.fleet.client.nats().clone());
    js.publish("gen.queue.default.bad-1", "not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let text = wait::until(
        "the metrics to count four completed and one failed request",
        WITHIN,
        || async {
            let text = get(&s.base, "/metrics").await.1;
            let completed = value(
                &text,
                "genfleet_requests_total",
                &[("state", "COMPLETED"), ("reason", "stop")],
            );
            let failed = value(
                &text,
                "genfleet_requests_total",
                &[("state", "FAILED"), ("reason", "invalid_request")],
            );
            if completed == 4.0 && failed == 1.0 {
                Ok(text)
            } else {
                Err(text)
            }
        },
    )
    .await;
    assert_eq!(
        value(
            &text,
            "genfleet_requests_total",
            &[("state", "COMPLETED"), ("reason", "stop")]
        ),
        4.0,
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "genfleet_requests_total",
            &[("state", "FAILED"), ("reason", "invalid_request")]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(value(&text, "genfleet_request_seconds_count", &[]), 5.0);
    assert_eq!(
        value(&text, "genfleet_first_token_seconds_count", &[]),
        4.0,
        "the refused request had no first token"
    );
    assert!(value(&text, "genfleet_request_seconds_sum", &[]) > 0.1);
    assert_eq!(value(&text, "genfleet_slots_busy", &[]), 0.0);
    for family in [
        "genfleet_queue_pending",
        "genfleet_decisions_pending",
        "genfleet_draining",
    ] {
        assert!(
            text.contains(&format!("# TYPE {family} gauge")),
            "{family} missing"
        );
    }
}

#[tokio::test]
async fn metrics_count_signals_tool_calls_and_backend_errors() {
    let s = served(
        "[[rules]]\nwhen_last_user_contains = \"fail\"\nstatus = 400\n\
         [[rules]]\nwhen_last_role = \"tool\"\nreply = \"tool done\"\n\
         [[rules]]\nwhen_last_user_contains = \"tool\"\ntool_calls = [{ name = \"calculate\", arguments = { operation = \"mul\", a = 6, b = 7 } }]\n\
         [[rules]]\nreply = \"Loop forever. Loop forever. Loop forever. Loop forever. Loop forever. Loop forever. Loop forever. Loop forever. Loop forever. Loop forever.\"\nrepeat = 40\n",
    )
    .await;
    until_status(&s.base, "/readyz", 200).await;
    let failed = s
        .fleet
        .client
        .run(
            "default",
            GenerationRequest::user("fail"),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(failed.reason.as_str(), "backend_error");
    let service = fleet::calculator(s.fleet.client.nats().clone(), &s.fleet.settings).await;
    let mut tooled = GenerationRequest::user("tool");
    tooled.tools = vec!["calculate".into()];
    // The worker learns of the tool from the bucket it watches.
    let ran = fleet::run_when_tools_known(&s.fleet.client, &tooled, Duration::from_secs(10)).await;
    assert_eq!(ran.output, "tool done");
    service.withdraw().await.unwrap();
    let looped = s
        .fleet
        .client
        .run(
            "default",
            GenerationRequest::user("go"),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(looped.reason.as_str(), "loop_detected");
    let text = get(&s.base, "/metrics").await.1;
    assert_eq!(
        value(&text, "genfleet_backend_errors_total", &[("kind", "http")]),
        1.0,
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "genfleet_signals_total",
            &[("type", "issue"), ("code", "LOOP_DETECTED")]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "genfleet_tool_call_seconds_count",
            &[("tool", "calculate"), ("outcome", "ok")]
        ),
        1.0,
        "{text}"
    );
}

#[tokio::test]
async fn readyz_goes_unready_without_nats_or_backend_and_while_draining() {
    let mut s = served("[[rules]]\nreply = \"a b c d e f g h\"\ndelay_ms = 200\n").await;
    until_status(&s.base, "/readyz", 200).await;

    // NATS gone: unready; back: ready again.
    s.fleet.nats.kill().await;
    let body = until_status(&s.base, "/readyz", 503).await;
    assert!(body.contains("NATS"), "{body}");
    assert_eq!(get(&s.base, "/healthz").await.0, 200, "alive all the same");
    s.fleet.nats.restart().await;
    until_status(&s.base, "/readyz", 200).await;

    // The backend gone: unready.
    let mock = s.fleet.mock.take().unwrap();
    let mock_addr = mock.addr();
    drop(mock);
    let body = until_status(&s.base, "/readyz", 503).await;
    assert!(body.contains("backend"), "{body}");
    let mock = MockServer::start_at(
        mock_addr,
        Script::from_toml_str("[[rules]]\nreply = \"a b c d e f g h\"\ndelay_ms = 200\n").unwrap(),
    )
    .await
    .unwrap();
    s.fleet.mock = Some(mock);
    until_status(&s.base, "/readyz", 200).await;

    // Draining: unready while the running request finishes.
    fleet::submit_until_accepted(
        &s.fleet.client,
        "default",
        &GenerationRequest::user("long"),
        Duration::from_secs(10),
    )
    .await;
    let worker = s.fleet.workers.remove(0);
    let stopping = tokio::task::spawn_blocking(move || worker.stop());
    let body = until_status(&s.base, "/readyz", 503).await;
    assert!(body.contains("draining"), "{body}");
    stopping.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_callers_traceparent_reaches_the_tool_services() {
    let f = Fleet::builder()
        .script(
            "[[rules]]\nwhen_last_role = \"tool\"\nreply = \"done\"\n\
             [[rules]]\ntool_calls = [{ name = \"calculate\", arguments = { operation = \"add\", a = 1, b = 2 } }]\n",
        )
        .default_settings()
        .settings(|s| {
            s.tools.definitions =
                vec![serde_json::to_value(genfleet::cli::tool_demo::calculate_definition()).unwrap()];
        })
        .start()
        .await;
    let client = &f.client;
    let nats_client = client.nats().clone();
    let mut tool = nats_client.subscribe("tools.calculate").await.unwrap();
    nats_client.flush().await.unwrap();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("traceparent", traceparent);
    let body = serde_json::to_vec(&serde_json::json!({
        "request_id": "traced", "messages": [{"role": "user", "content": "add"}], "tools": ["calculate"]
    }))
    .unwrap();
    common::fleet::submit_raw(&nats_client, "default", headers, body)
        .await
        .unwrap();
    let call = wait::within(
        "the tool call",
        WITHIN,
        futures_util::StreamExt::next(&mut tool),
    )
    .await
    .unwrap();
    let got = call
        .headers
        .as_ref()
        .and_then(|h| h.get("traceparent"))
        .map(|v| v.to_string());
    assert_eq!(got.as_deref(), Some(traceparent));
    nats_client
        .publish(call.reply.unwrap(), "{\"result\": 3}".into())
        .await
        .unwrap();
    let result = fleet::terminal(client, "traced", Duration::from_secs(10)).await;
    assert_eq!(result.output, "done");
}

#[tokio::test]
async fn healthz_answers_while_the_worker_waits_for_nats() {
    let mut nats = NatsServer::start().await;
    nats.kill().await;
    let mock = MockServer::start(Script::echo()).await.unwrap();
    let mut s = Settings::defaults();
    s.nats.url = nats.url();
    s.llm.base_url = mock.base_url();
    let port = common::nats::free_port();
    s.http.listen = format!("127.0.0.1:{port}");
    let base = format!("http://127.0.0.1:{port}");
    let starting = tokio::task::spawn_blocking(move || WorkerHandle::spawn(s));
    genfleet::llm::openai::install_crypto_provider();
    let alive = wait::poll("/healthz to answer", WITHIN, || async {
        reqwest::get(format!("{base}/healthz"))
            .await
            .map(|response| response.status().as_u16())
    })
    .await;
    let ready = get(&base, "/readyz").await;
    // NATS comes back before any assertion, so a failure cannot leave the worker waiting.
    nats.restart().await;
    let alive = alive.unwrap_or_else(|failure| panic!("{failure}"));
    assert_eq!(alive, 200, "/healthz answers before NATS is there");
    assert_eq!(ready.0, 503);
    assert!(ready.1.contains("starting"), "{}", ready.1);
    let _worker = starting.await.unwrap().unwrap();
    until_status(&base, "/readyz", 200).await;
}

/// The pool's scaling signals (`/scaling`, the `genfleet_pool_*` gauges), read from one
/// worker, count the whole pool: every worker's slots and busy slots, and the durable queue of
/// every band and tenant, also the queues heard of while every slot is busy.
#[tokio::test]
async fn the_pool_signals_count_every_worker_band_and_tenant() {
    let fleet = Fleet::builder()
        .script(
            "[[rules]]\nwhen_last_user_contains = \"block\"\n\
             reply = \"a b c d e f g h i j k l m n o\"\ndelay_ms = 2000\n\n\
             [[rules]]\nreply = \"done\"\n",
        )
        .default_settings()
        .client_timeout(Duration::from_secs(10))
        .slots(2)
        .workers(2)
        .settings(|s| {
            s.http.listen = "127.0.0.1:0".into();
            s.http.backend_probe_ms = 100;
        })
        .start()
        .await;
    let base = format!(
        "http://{}",
        fleet.workers[0].http_addr.expect("the HTTP server listens")
    );
    let scaling = |want: serde_json::Value| {
        let base = base.clone();
        async move {
            let (status, body) = get(&base, "/scaling").await;
            if status != 200 {
                return Err(format!("{status}: {body}"));
            }
            let got: serde_json::Value = serde_json::from_str(&body).expect("JSON");
            let mismatched = want
                .as_object()
                .unwrap()
                .iter()
                .any(|(field, value)| got[field] != *value);
            if mismatched { Err(body) } else { Ok(got) }
        }
    };
    // Both workers, as the heartbeats tell, and nothing to do.
    wait::until("the pool measured at rest", WITHIN, || {
        scaling(serde_json::json!({
            "pool": "default", "workers": 2, "slots": 4, "slots_busy": 0,
            "queue_waiting": 0, "queue_running": 0, "backlog": 0, "wanted_slots": 0,
        }))
    })
    .await;

    // Every slot of both workers busy with interactive requests.
    let blockers: Vec<String> = (0..4).map(|i| format!("blocker-{i}")).collect();
    for id in &blockers {
        let request = GenerationRequest {
            request_id: Some(id.clone()),
            ..GenerationRequest::user("block")
        };
        fleet::submit_until_accepted(&fleet.client, "default", &request, WITHIN).await;
    }
    // Queued behind them: three bands of the default tenant, and two tenants of their own.
    let queued = [
        (None, Priority::Low, "q-low"),
        (None, Priority::Normal, "q-normal"),
        (None, Priority::High, "q-high"),
        (Some("acme"), Priority::Normal, "q-acme"),
        (Some("zeta"), Priority::Low, "q-zeta"),
    ];
    for (tenant, band, id) in queued {
        let client = match tenant {
            Some(tenant) => fleet.client.clone().with_tenant(tenant).unwrap(),
            None => fleet.client.clone(),
        };
        let request = GenerationRequest {
            request_id: Some(id.into()),
            priority: Some(band),
            ..GenerationRequest::user("queued")
        };
        client.enqueue("default", &request).await.unwrap();
    }
    let signals = serde_json::json!({
        "workers": 2, "slots": 4, "slots_busy": 4,
        "queue_waiting": 5, "queue_running": 0, "backlog": 5, "wanted_slots": 9,
    });
    let got = wait::until("the pool measured busy", WITHIN, || {
        scaling(signals.clone())
    })
    .await;
    assert!(got["age_ms"].as_u64().is_some(), "{got}");
    // The same numbers on the other worker, and as gauges.
    let other = format!(
        "http://{}",
        fleet.workers[1].http_addr.expect("the HTTP server listens")
    );
    wait::until("the other worker to measure the same", WITHIN, || async {
        let text = get(&other, "/metrics").await.1;
        let seen = [
            value(&text, "genfleet_pool_workers", &[]),
            value(&text, "genfleet_pool_slots", &[]),
            value(&text, "genfleet_pool_slots_busy", &[]),
            value(&text, "genfleet_pool_backlog", &[]),
        ];
        if seen == [2.0, 4.0, 4.0, 5.0] {
            Ok(())
        } else {
            Err(format!("{seen:?}"))
        }
    })
    .await;

    // A submit no worker has a slot for is refused, and counted once, by the worker that
    // answered.
    let refusals = || async {
        let mut counted = 0.0;
        for worker in [&base, &other] {
            let text = get(worker, "/metrics").await.1;
            counted += value(&text, "genfleet_submits_refused_total", &[]);
        }
        counted
    };
    let before = refusals().await;
    let refused = fleet
        .client
        .submit_once("default", &GenerationRequest::user("block"))
        .await
        .expect_err("every slot is busy");
    assert_eq!(
        refused.code(),
        Some(ErrorCode::NoSlotAvailable),
        "{refused}"
    );
    assert_eq!(refusals().await - before, 1.0);

    for id in &blockers {
        fleet.client.cancel(id).await.unwrap();
    }
    // The queued requests run and end: nothing left.
    for (tenant, _, id) in queued {
        let client = match tenant {
            Some(tenant) => fleet.client.clone().with_tenant(tenant).unwrap(),
            None => fleet.client.clone(),
        };
        let result = fleet::terminal(&client, id, Duration::from_secs(30)).await;
        assert_eq!(result.output, "done");
    }
    wait::until("the pool measured at rest again", WITHIN, || {
        scaling(serde_json::json!({
            "workers": 2, "slots_busy": 0, "backlog": 0, "wanted_slots": 0,
        }))
    })
    .await;
}
