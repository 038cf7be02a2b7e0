//! The backend API key never appears in logs, results, events, signals, status replies or
//! metrics, even when the backend echoes it back in an error (some proxies do).

mod common;

use std::time::Duration;

use common::fleet;
use common::nats::{NatsServer, free_port};
use futures_util::StreamExt;
use genfleet::bus::client::Client;
use genfleet::protocol::{GenerationRequest, Reason};
use genfleet::settings::Settings;

const KEY: &str = "sk-genfleet-secret-7Q2XK9";

/// A backend that refuses every call and echoes the Authorization header it got, in the error
/// body and in a header.
async fn echoing_backend() -> String {
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::{get, post};
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
        .route("/v2/v1/models", get(overloaded));
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
    let backend = echoing_backend().await;
    let logs = tempfile::tempdir().unwrap();
    let http = format!("127.0.0.1:{}", free_port());
    let mut collected = String::new();
    for (worker_id, base_url) in [
        ("refused", format!("{backend}/v1")),
        ("overloaded", format!("{backend}/v2/v1")),
    ] {
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
        let finished = tokio::time::timeout(Duration::from_secs(20), async {
            let mut all = Vec::new();
            while let Some(event) = events.next().await {
                let last = matches!(event.body, genfleet::protocol::EventBody::Finished { .. });
                all.push(serde_json::to_string(&event).unwrap());
                if last {
                    break;
                }
            }
            all
        })
        .await
        .expect("the request finishes");
        collected.push_str(&finished.join("\n"));
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
        while let Ok(Some(signal)) =
            tokio::time::timeout(Duration::from_millis(300), signals.next()).await
        {
            collected.push_str(&String::from_utf8_lossy(&signal.payload));
        }
        // The readiness probe met the same backend several times meanwhile.
        tokio::time::sleep(Duration::from_millis(600)).await;
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
        collected.push_str(&log);
    }
    // The test saw what it meant to look at.
    assert!(collected.contains("backend_error"), "{collected}");
    assert!(collected.contains("genfleet_requests_total"), "{collected}");
    assert!(collected.to_lowercase().contains("trace") || collected.contains("DEBUG"));
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
