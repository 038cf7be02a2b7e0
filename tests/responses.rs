//! The gateway's Responses and Batch APIs as their callers meet them: a real gateway process (two where a
//! conversation crosses replicas) in front of a real nats-server, a worker and the mock backend
//! (tests/data/gateway.toml). The official openai Python SDK and the OpenAI Agents SDK drive
//! it (tests/python/responses_client.py); what needs the process or the raw HTTP side (a
//! gateway killed under a background response, ids an attacker makes up) is driven from here.

mod common;

use common::fleet::Fleet;
use common::gateway::{
    Gateway, KEY, TENANT, WITHIN, answer_next_decision, fleet, python, python_part, root,
};
use common::nats::free_port;
use common::wait;
use genfleet::llm::mock::Script;
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;

/// A second key, of another tenant.
const OTHER_KEY: &str = "sk-gateway-other-9876543210";
const OTHER_TENANT: &str = "team-other";

/// Runs one part of tests/python/responses_client.py.
async fn sdk(gateway: &Gateway, part: &str, arg: Option<&str>) -> String {
    let args: Vec<&str> = arg.into_iter().collect();
    python_part(
        gateway,
        "responses_client.py",
        "responses client",
        part,
        &args,
    )
    .await
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_and_batches_run_malformed_lines_cancels_limits_and_tenants() {
    let f = fleet(1).await;
    let gateway = Gateway::start_with_keys(
        &f,
        free_port(),
        &[(KEY, TENANT), (OTHER_KEY, OTHER_TENANT)],
        &[("GENFLEET__GATEWAY__MAX_FILE_BYTES", "200000")],
    )
    .await;
    sdk(&gateway, "batch", Some(OTHER_KEY)).await;
}

/// What makes a worker's loss show at once (as tests/faults.rs does).
const FAST_FAULTS: [(&str, &str); 4] = [
    ("GENFLEET__JETSTREAM__QUEUE_ACK_WAIT_MS", "1500"),
    ("GENFLEET__WORKER__HEARTBEAT_MS", "300"),
    ("GENFLEET__WORKER__LOST_AFTER_MS", "1500"),
    ("GENFLEET__WORKER__DRAIN_TIMEOUT_MS", "500"),
];

/// Two worker processes of four slots on the slow script of tests/data/batch.toml.
async fn two_workers() -> Fleet {
    let script = Script::from_file(root().join("tests/data/batch.toml")).unwrap();
    FAST_FAULTS
        .into_iter()
        .fold(
            Fleet::builder()
                .default_settings()
                .mock_script(script)
                .worker_processes(["doomed", "steady"])
                .slots(4),
            |builder, (key, value)| builder.worker_env(key, value),
        )
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_line_batch_answers_every_line_once_though_a_worker_is_killed() {
    let mut f = two_workers().await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let mut child = tokio::process::Command::new(python())
        .arg(root().join("tests/python/responses_client.py"))
        .args([&gateway.base_url(), KEY, "batch-big", "1000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut printed = String::new();
    let mut killed = false;
    while let Some(line) = lines.next_line().await.unwrap() {
        printed.push_str(&line);
        printed.push('\n');
        let progress = line
            .strip_prefix("PROGRESS=")
            .and_then(|n| n.parse::<u64>().ok());
        // Halfway or so: the batch has lines running on both workers.
        if !killed && progress.is_some_and(|n| n >= 200) {
            f.processes[0].kill();
            killed = true;
        }
    }
    let output = child.wait_with_output().await.unwrap();
    assert!(
        output.status.success() && printed.contains("COMPLETED=1000"),
        "the batch failed ({}):\n{}\n{}",
        output.status,
        printed
            .lines()
            .filter(|l| !l.starts_with("PROGRESS="))
            .collect::<Vec<_>>()
            .join("\n"),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        killed,
        "the batch ended before a worker could be killed:\n{printed}"
    );
    // Once the batch ended, its lines' stored results are released (their outcomes are in the
    // batch's files): none is left to age out of the results bucket.
    let batch_id = printed
        .lines()
        .find_map(|line| line.strip_prefix("BATCH_ID="))
        .expect("the client printed the batch's id")
        .to_string();
    let client = f.client.clone().with_tenant(TENANT).unwrap();
    for n in 1..=1000 {
        let id = format!("{batch_id}-{n}");
        wait::until(&format!("{id}'s result to be released"), WITHIN, || async {
            match client.result(&id, false).await {
                Err(error) if error.code() == Some(genfleet::protocol::ErrorCode::NotFound) => {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    }
}

/// A batch's JSONL file uploaded as `POST /v1/files` would take it from any client.
async fn upload(gateway: &Gateway, lines: &[Value]) -> String {
    let mut jsonl = String::new();
    for line in lines {
        jsonl.push_str(&line.to_string());
        jsonl.push('\n');
    }
    let boundary = "genfleet-test-boundary";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\
         Content-Type: application/jsonl\r\n\r\n{jsonl}\r\n--{boundary}--\r\n"
    );
    let response = http()
        .post(format!("{}/files", gateway.base_url()))
        .bearer_auth(KEY)
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(body)
        .send()
        .await
        .unwrap();
    let file: Value = response.json().await.unwrap();
    file["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{file}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_goes_on_when_its_gateway_is_killed_and_every_replica_reports_the_same() {
    let f = two_workers().await;
    let mut first = Gateway::start(&f, free_port(), &[]).await;
    let second = Gateway::start(&f, free_port(), &[]).await;
    let lines: Vec<Value> = (0..300)
        .map(|i| {
            json!({"custom_id": format!("g-{i}"), "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "default", "messages": [{"role": "user", "content": format!("line-{i}")}]}})
        })
        .collect();
    let file_id = upload(&first, &lines).await;
    let response = http()
        .post(format!("{}/batches", first.base_url()))
        .bearer_auth(KEY)
        .json(
            &json!({"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                      "completion_window": "24h"}),
        )
        .send()
        .await
        .unwrap();
    let batch: Value = response.json().await.unwrap();
    let id = batch["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{batch}"))
        .to_string();
    // Once some lines ended, the gateway driving it is killed.
    wait::until("some lines to end", WITHIN, || async {
        let (_, batch) = get(&first, KEY, &format!("batches/{id}")).await;
        let completed = batch["request_counts"]["completed"].as_u64().unwrap_or(0);
        if completed >= 20 {
            Ok(())
        } else {
            Err(batch.to_string())
        }
    })
    .await;
    first.stop("KILL").await;
    let url = format!("batches/{id}");
    let done = wait::until(
        "the batch to end through the other gateway",
        WITHIN * 3,
        || async {
            let (_, batch) = get(&second, KEY, &url).await;
            match batch["status"].as_str() {
                Some("completed" | "failed" | "expired" | "cancelled") => Ok(batch),
                _ => Err(batch.to_string()),
            }
        },
    )
    .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": 300, "completed": 300, "failed": 0})
    );
    // A gateway started again reports what the other does.
    let restarted = Gateway::start(&f, free_port(), &[]).await;
    let (_, again) = get(&restarted, KEY, &format!("batches/{id}")).await;
    assert_eq!(again, done);
    let output_id = done["output_file_id"].as_str().unwrap();
    let text = http()
        .get(format!(
            "{}/files/{output_id}/content",
            restarted.base_url()
        ))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut ids: Vec<String> = text
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap()["custom_id"].to_string())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 300, "every line once: {}", text.lines().count());
    assert_eq!(text.lines().count(), 300);
}

/// A decision the model asks is answered and the chain goes on, as on chat completions: one
/// response, whole or in the background, its parts set apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_chain_is_one_response_whole_or_in_the_background() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let mut asks = f
        .client
        .nats()
        .subscribe("signals.decision_request.>")
        .await
        .unwrap();
    f.client.nats().flush().await.unwrap();
    let body = json!({"model": "default", "input": "gw-ask where the report goes"});
    let whole = tokio::spawn({
        let url = format!("{}/responses", gateway.base_url());
        let body = body.clone();
        async move {
            let response = http()
                .post(url)
                .bearer_auth(KEY)
                .json(&body)
                .send()
                .await
                .unwrap();
            response.json::<Value>().await.unwrap()
        }
    });
    answer_next_decision(&f.client, &mut asks).await;
    let whole = wait::within("the response", WITHIN, whole).await.unwrap();
    assert_eq!(whole["status"], "completed", "{whole}");
    let text = |r: &Value| {
        r["output"]
            .as_array()
            .unwrap()
            .iter()
            .find(|item| item["type"] == "message")
            .map(|item| item["content"][0]["text"].clone())
    };
    assert_eq!(
        text(&whole),
        Some(json!("Two places fit.\n\nFiled as chosen.")),
        "{whole}"
    );

    let mut background = body;
    background["background"] = json!(true);
    let (status, queued) = create(&gateway, background).await;
    assert_eq!(status, 200, "{queued}");
    answer_next_decision(&f.client, &mut asks).await;
    let id = queued["id"].as_str().unwrap().to_string();
    let done = wait::until("the background response to end", WITHIN, || async {
        let (_, body) = get(&gateway, KEY, &format!("responses/{id}")).await;
        match body["status"].as_str() {
            Some("queued" | "in_progress") => Err(body.to_string()),
            _ => Ok(body),
        }
    })
    .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        text(&done),
        Some(json!("Two places fit.\n\nFiled as chosen.")),
        "{done}"
    );
}

/// A response that fails is an error whole (and kept as `failed`), and ends a stream with
/// `response.failed` carrying the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_generation_is_an_error_whole_a_failed_response_kept_and_a_failed_event() {
    let f = fleet(1).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    let body = json!({"model": "default", "input": "gw-badtool now"});
    let (status, error) = create(&gateway, body.clone()).await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(error["error"]["code"], "tool_parse_error", "{error}");

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let response = http()
        .post(format!("{}/responses", gateway.base_url()))
        .bearer_auth(KEY)
        .json(&streamed)
        .send()
        .await
        .unwrap();
    let text = response.text().await.unwrap();
    let events: Vec<Value> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    let last = events
        .last()
        .unwrap_or_else(|| panic!("no event in {text}"));
    assert_eq!(last["type"], "response.failed", "{text}");
    assert_eq!(last["response"]["status"], "failed", "{text}");
    assert_eq!(
        last["response"]["error"]["code"], "tool_parse_error",
        "{text}"
    );
    assert_eq!(events[0]["type"], "response.created", "{text}");
    // Kept as it ended.
    let id = last["response"]["id"].as_str().unwrap();
    let (status, kept) = get(&gateway, KEY, &format!("responses/{id}")).await;
    assert_eq!(
        (status, kept["status"].clone()),
        (200, json!("failed")),
        "{kept}"
    );
}

/// A `previous_response_id` chain is one session: each of its turns goes to the worker that
/// served the one before, whichever of two workers that is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_response_id_chain_stays_on_the_worker_that_served_it() {
    let script = Script::from_file(root().join("tests/data/gateway.toml")).unwrap();
    let mut f = Fleet::builder()
        .mock_script(script)
        .workers(2)
        .slots(4)
        .start()
        .await;
    f.client = f.client.clone().with_tenant(TENANT).unwrap();
    // The workers rank a key alike only once each sees the other.
    let ids: Vec<String> = f.workers.iter().map(|w| w.worker_id.clone()).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    common::fleet::wait_placement(f.client.nats(), &ids, WITHIN).await;
    let gateway = Gateway::start(&f, free_port(), &[]).await;
    for chain in 0..3 {
        let mut previous: Option<String> = None;
        let mut workers = Vec::new();
        for turn in 0..4 {
            let mut body = json!({"model": "default", "input": format!("gw-chain {chain} {turn}")});
            if let Some(previous) = &previous {
                body["previous_response_id"] = json!(previous);
            }
            let response = http()
                .post(format!("{}/responses", gateway.base_url()))
                .bearer_auth(KEY)
                .json(&body)
                .send()
                .await
                .unwrap();
            let request_id = response.headers()[genfleet::gateway::REQUEST_ID_HEADER]
                .to_str()
                .unwrap()
                .to_string();
            let answer: Value = response.json().await.unwrap();
            assert_eq!(answer["status"], "completed", "{answer}");
            previous = Some(answer["id"].as_str().unwrap().to_string());
            let status = f.client.status(&request_id).await.unwrap();
            let finished = status.finished.expect("a finished summary");
            workers.push(finished.worker_id);
        }
        assert!(
            workers.iter().all(|w| *w == workers[0]),
            "chain {chain} moved between workers: {workers:?}"
        );
    }
}
