//! The backend API key never appears in logs, results, events, signals, status replies or
//! metrics, even when the backend echoes it back in an error (some proxies do).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fleet;
use common::nats::{NatsServer, free_port};
use common::wait;
use futures_util::{FutureExt, StreamExt};
use genfleet::client::Client;
use genfleet::protocol::{GenerationRequest, Reason};
use genfleet::settings::Settings;

const KEY: &str = "sk-genfleet-secret-7Q2XK9";
/// Generous: a busy machine is slow, never wrong.
const WITHIN: Duration = Duration::from_secs(20);

/// What the backend was sent: the method and path of each call, with its Authorization
/// header.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// A backend that refuses every call and echoes the Authorization header it got, in the error
/// body and in a header; it keeps every call's header in `seen`.
async fn echoing_backend(seen: Seen) -> String {
    use axum::extract::{Request, State};
    use axum::http::{HeaderMap, StatusCode};
    use axum::middleware::{self, Next};
    use axum::response::Response;
    use axum::routing::{get, post};
    async fn record(State(seen): State<Seen>, request: Request, next: Next) -> Response {
        let authorization = request
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let call = format!("{} {}", request.method(), request.uri().path());
        seen.lock().unwrap().push((call, authorization));
        next.run(request).await
    }
    async fn refuse(headers: HeaderMap) -> (StatusCode, HeaderMap, String) {
        let got = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let mut reply = HeaderMap::new();
        reply.insert("x-seen-authorization", got.parse().unwrap());
        let body = serde_json::json!({"error": {"message": format!("invalid key: {got}"), "type": "auth"}});
        (StatusCode::UNAUTHORIZED, reply, body.to_string())
    }
    async fn overloaded(headers: HeaderMap) -> (StatusCode, String) {
        let got = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("overloaded for {got}"),
        )
    }
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(refuse))
        .route("/v2/v1/chat/completions", post(overloaded))
        .route("/v1/models", get(refuse))
        .route("/v2/v1/models", get(overloaded))
        .layer(middleware::from_fn_with_state(seen, record));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn the_api_key_appears_nowhere_even_when_the_backend_echoes_it() {
    genfleet::llm::openai::install_crypto_provider();
    let nats = NatsServer::start().await;
    let seen = Seen::default();
    let backend = echoing_backend(seen.clone()).await;
    let logs = tempfile::tempdir().unwrap();
    let http = format!("127.0.0.1:{}", free_port());
    let mut collected = String::new();
    for (worker_id, prefix) in [("refused", "/v1"), ("overloaded", "/v2/v1")] {
        let base_url = format!("{backend}{prefix}");
        let env = vec![
            ("GENFLEET__LLM__BASE_URL", base_url),
            ("GENFLEET__LLM__API_KEY", KEY.to_string()),
            ("GENFLEET__LLM__RETRIES", "1".to_string()),
            ("GENFLEET__LLM__RETRY_BACKOFF_MS", "10".to_string()),
            ("GENFLEET__HTTP__LISTEN", http.clone()),
            ("GENFLEET__HTTP__BACKEND_PROBE_MS", "200".to_string()),
            ("RUST_LOG", "trace".to_string()),
        ];
        let mut worker = fleet::worker(worker_id, &nats.url(), &env, logs.path());
        let mut settings = Settings::defaults();
        settings.nats.url = nats.url();
        let client = Client::connect(&settings).await.unwrap();
        fleet::wait_all_slots_free(client.nats(), 1, Duration::from_secs(20)).await;
        let mut signals = client.nats().subscribe("signals.>").await.unwrap();
        let id = format!("secret-{worker_id}");
        let mut events = Box::pin(client.follow(&id).await.unwrap());
        let mut request = GenerationRequest::user("hello");
        request.request_id = Some(id.clone());
        client.submit("default", &request).await.unwrap();
        let finished = wait::collect_until("the finished event", WITHIN, &mut events, |event| {
            matches!(event.body, genfleet::protocol::EventBody::Finished { .. })
        })
        .await;
        for event in &finished {
            collected.push_str(&serde_json::to_string(event).unwrap());
            collected.push('\n');
        }
        let status = client.status(&id).await.unwrap();
        collected.push_str(&serde_json::to_string(&status).unwrap());
        let result = client.result(&id, true).await.unwrap();
        assert_eq!(result.reason, Reason::BackendError, "{result:?}");
        assert!(
            result.detail.as_deref().unwrap_or_default().contains("401")
                || result.detail.as_deref().unwrap_or_default().contains("503"),
            "the backend's own words stay: {result:?}"
        );
        collected.push_str(&serde_json::to_string(&result).unwrap());
        // The request's failure is announced: its signal carries the backend's words too.
        let failed =
            wait::next_matching("the request's FAILED signal", WITHIN, &mut signals, |m| {
                let payload = String::from_utf8_lossy(&m.payload).into_owned();
                (m.subject.as_str() == "signals.outcome.FAILED" && payload.contains(&id))
                    .then_some(payload)
            })
            .await;
        collected.push_str(&failed);
        // Every signal that came meanwhile.
        while let Some(Some(signal)) = signals.next().now_or_never() {
            collected.push_str(&String::from_utf8_lossy(&signal.payload));
        }
        // The backend saw the key: on the completions it refused and on the readiness probe's
        // calls (two of them, so the probe met the refusal again after logging it once).
        let sent = format!("Bearer {KEY}");
        let with_key = |call: &str| {
            let seen = seen.lock().unwrap();
            let count = seen
                .iter()
                .filter(|(c, key)| c == call && *key == sent)
                .count();
            (count, format!("{seen:?}"))
        };
        let completion = format!("POST {prefix}/chat/completions");
        let probe = format!("GET {prefix}/models");
        wait::until(
            &format!("{worker_id}'s backend to get the key on a completion and on two probes"),
            WITHIN,
            || async {
                match (with_key(&completion), with_key(&probe)) {
                    ((completions, _), (probes, _)) if completions >= 1 && probes >= 2 => Ok(()),
                    (_, (_, all)) => Err(all),
                }
            },
        )
        .await;
        for path in ["/metrics", "/readyz", "/healthz"] {
            let body = reqwest::get(format!("http://{http}{path}"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            collected.push_str(&body);
        }
        worker.kill();
        let log = std::fs::read_to_string(logs.path().join(format!("{worker_id}.log"))).unwrap();
        // Logs written to a file are plain text: no terminal colour codes.
        assert!(!log.contains('\u{1b}'), "colour codes in the log: {log}");
        // Written at trace level: lines of that level, from the HTTP client that sent the key
        // among them.
        let at_level = |level: &str| {
            log.lines()
                .filter(|line| line.split_whitespace().nth(1) == Some(level))
                .count()
        };
        assert!(
            at_level("TRACE") > 0 && at_level("DEBUG") > 0,
            "{worker_id}: no TRACE or DEBUG lines in the log:\n{log}"
        );
        assert!(
            log.lines()
                .any(|line| line.contains("reqwest") || line.contains("hyper")),
            "{worker_id}: nothing of the HTTP client in the log:\n{log}"
        );
        collected.push_str(&log);
    }
    // The test saw what it meant to look at: the failure (results, events and the signal carry
    // the backend's own words, which held the key), the metrics, and a log written at trace
    // level, where a header would show if anything logged it.
    assert!(collected.contains("backend_error"), "{collected}");
    assert!(
        collected.contains("invalid key: Bearer [redacted]"),
        "the 401's echo of the key, redacted: {collected}"
    );
    assert!(
        collected.contains("overloaded for Bearer [redacted]"),
        "the 503's echo of the key, redacted: {collected}"
    );
    assert!(collected.contains("genfleet_requests_total"), "{collected}");
    let fragment = &KEY[3..];
    assert!(
        !collected.contains(fragment),
        "the API key leaked: {}",
        collected
            .lines()
            .filter(|l| l.contains(fragment))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
}
