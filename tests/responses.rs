//! The gateway's Responses API as its callers meet it: a real gateway process (two where a
//! conversation crosses replicas) in front of a real nats-server, a worker and the mock backend
//! (tests/data/gateway.toml). The official openai Python SDK and the OpenAI Agents SDK drive
//! it (tests/python/responses_client.py); what needs the process or the raw HTTP side (a
//! gateway killed under a background response, ids an attacker makes up) is driven from here.

mod common;

use common::gateway::{Gateway, KEY, TENANT, WITHIN, fleet, python, root};
use common::nats::free_port;
use common::wait;
use serde_json::{Value, json};

/// A second key, of another tenant.
const OTHER_KEY: &str = "sk-gateway-other-9876543210";
const OTHER_TENANT: &str = "team-other";

/// Runs one part of tests/python/responses_client.py.
async fn sdk(gateway: &Gateway, part: &str, arg: Option<&str>) -> String {
    let python = python();
    let mut command = tokio::process::Command::new(&python);
    command
        .arg(root().join("tests/python/responses_client.py"))
        .args([&gateway.base_url(), KEY, part]);
    if let Some(arg) = arg {
        command.arg(arg);
    }
    let output = command
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{python} runs: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success() && stdout.contains(&format!("responses client: {part} passed")),
        "the SDK's {part} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn http() -> reqwest::Client {
    reqwest::Client::new()
}

async fn create(gateway: &Gateway, body: Value) -> (u16, Value) {
    let response = http()
        .post(format!("{}/responses", gateway.base_url()))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

async fn get(gateway: &Gateway, key: &str, path: &str) -> (u16, Value) {
    let response = http()
        .get(format!("{}/{path}", gateway.base_url()))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_creates_streams_stores_reads_and_deletes_responses() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    sdk(&gateway, "responses", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_tool_round_trips_through_responses_stored_stateless_and_streamed() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    sdk(&gateway, "tools", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_continues_through_two_gateway_processes() {
    let f = fleet(1).await;
    let one = Gateway::start(&f, free_port(), &[]).await;
    let two = Gateway::start(&f, free_port(), &[]).await;
    sdk(&one, "chain", Some(&two.base_url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_is_polled_to_its_end_or_cancelled() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    sdk(&gateway, "background", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_s_key_finds_no_response() {
    let f = fleet(1).await;
    let gateway = Gateway::start_with_keys(
        &f,
        free_port(),
        &[(KEY, TENANT), (OTHER_KEY, OTHER_TENANT)],
        &[],
    )
    .await;
    sdk(&gateway, "tenants", Some(OTHER_KEY)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_agents_sdk_runs_an_agent_with_a_function_tool() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    sdk(&gateway, "agents", None).await;
}

/// Ids a caller makes up reach no stored response: not a wildcard, not another tenant's key
/// written out, not a path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_ids_are_404_and_never_reach_another_tenant() {
    let f = fleet(1).await;
    let gateway = Gateway::start_with_keys(
        &f,
        free_port(),
        &[(KEY, TENANT), (OTHER_KEY, OTHER_TENANT)],
        &[],
    )
    .await;
    let (status, mine) = create(&gateway, json!({"model": "default", "input": "Hal"})).await;
    assert_eq!(status, 200, "{mine}");
    let id = mine["id"].as_str().unwrap();
    for made_up in [
        "resp_*".to_string(),
        "resp_>".to_string(),
        format!("{TENANT}.{id}"),
        format!("..%2F{id}"),
        format!("{id}%00"),
        format!("{id}.x"),
        "resp_".to_string(),
        "x".repeat(300),
    ] {
        for key in [KEY, OTHER_KEY] {
            let (status, body) = get(&gateway, key, &format!("responses/{made_up}")).await;
            assert_eq!(status, 404, "{made_up} with {key}: {body}");
        }
    }
    let (status, _) = get(&gateway, OTHER_KEY, &format!("responses/{id}")).await;
    assert_eq!(status, 404);
    let (status, body) = get(&gateway, KEY, &format!("responses/{id}")).await;
    assert_eq!(
        (status, body["output"].clone()),
        (200, mine["output"].clone())
    );
    // No key at all: 401 before anything is read.
    let response = http()
        .get(format!("{}/responses/{id}", gateway.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 401);
}

/// A background response whose gateway was killed is settled by another one's poll, from the
/// request that ran on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_outlives_the_gateway_that_took_it() {
    let f = fleet(1).await;
    let mut first = Gateway::start(&f, free_port(), &[]).await;
    let second = Gateway::start(&f, free_port(), &[]).await;
    let (status, queued) = create(
        &first,
        json!({"model": "default", "input": "gw-background", "background": true}),
    )
    .await;
    assert_eq!(status, 200, "{queued}");
    let id = queued["id"].as_str().unwrap().to_string();
    first.stop("KILL").await;
    let done = wait::until("the background response to end", WITHIN, || async {
        let (status, body) = get(&second, KEY, &format!("responses/{id}")).await;
        match body["status"].as_str() {
            Some("queued" | "in_progress") => Err(format!("{status} {body}")),
            _ => Ok(body),
        }
    })
    .await;
    assert_eq!(done["status"], "completed", "{done}");
    let text = done["output"][0]["content"][0]["text"].as_str().unwrap();
    assert_eq!(text.matches("step").count(), 40, "{done}");
    // Settled once: read again, the same.
    let (_, again) = get(&second, KEY, &format!("responses/{id}")).await;
    assert_eq!(again, done);
}
