//! `genfleet console` on a real nats-server with a worker on the mock backend: the HTTP API
//! (token, cross-site and read-only refusals, the live streams, a followed request), then the
//! whole page in headless Chromium driven by tests/console/browser.mjs.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::fleet::{self, Fleet};
use common::wait;
use eventsource_stream::Eventsource;
use futures_util::{Stream, StreamExt};
use genfleet::client::Client;
use genfleet::console::{Console, ConsoleOptions};
use genfleet::protocol::decision::DecisionRecord;
use genfleet::protocol::{EventBody, GenerationRequest, GenerationResult, Reason};
use genfleet::settings::Settings;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

/// How long any awaited condition may take before the test fails.
const WAIT: Duration = Duration::from_secs(20);
const TOKEN: &str = "console-test-token-0123456789";

/// The model computes with the calculator, then asks where the report goes; a continuation
/// files it. "Sum the numbers" never passes its check (an escalation); "slowly" streams for a
/// few seconds; "until cancelled" streams for a minute, longer than any wait of the tests, so
/// it is still running when a test cancels it; "Fail loudly" meets a backend that answers
/// HTTP 500; "Say hello" answers at once; "Multiply and report" computes with the calculator
/// and reports, with no decision.
const SCRIPT: &str = r#"
token_delay_ms = 2

[[rules]]
when_last_user_contains = "Decision chosen"
reply = "Report filed as decided. {{last_user}}"
chunk = "word"

[[rules]]
when_any_message_contains = "Sum the numbers"
reply = "The sum is forty-two."

[[rules]]
when_last_user_contains = "slowly"
reply = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty twenty-one twenty-two twenty-three twenty-four twenty-five twenty-six twenty-seven twenty-eight twenty-nine thirty"
chunk = "word"
delay_ms = 120

[[rules]]
when_last_user_contains = "until cancelled"
reply = "tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick tick"
chunk = "word"
delay_ms = 1000

[[rules]]
when_last_user_contains = "Fail loudly"
status = 500
error_message = "the model ran out of memory"

[[rules]]
when_last_user_contains = "Say hello"
reply = "Hello from the fleet."
chunk = "word"

[[rules]]
when_any_message_contains = "Multiply and report"
when_last_role = "tool"
reply = "Reported: the product is 7,006,652."
chunk = "word"

[[rules]]
when_last_role = "tool"
reply = "The product is 7,006,652."
tool_calls = [{ name = "request_decision", arguments = { question = "Where should the report go?", options = [{ id = "email", label = "Email it to the team", pros = "everyone sees it today", cons = "one more mail" }, { id = "archive", label = "Archive it", pros = "no noise", cons = "nobody reads it" }], default_option = "email", context = "The product is 7,006,652; the report is ready." } }]

[[rules]]
reply = "I will compute that with the calculator."
tool_calls = [{ name = "calculate", arguments = { operation = "mul", a = 1234, b = 5678 } }]
"#;

async fn fleet() -> Fleet {
    genfleet::llm::openai::install_crypto_provider();
    Fleet::builder()
        .script(SCRIPT)
        .slots(2)
        .settings(|s| s.console.fleet_refresh_ms = 300)
        .calculator()
        .start()
        .await
}

impl Fleet {
    /// A client of `tenant`: its requests are `<tenant>.<id>` on the bus.
    fn tenant(&self, tenant: &str) -> Client {
        self.client.clone().with_tenant(tenant).unwrap()
    }

    /// Runs `request` as `client`'s tenant to its end; its caller reads (so releases) the
    /// result when `read`, else the result is left stored, so the console can show it whole.
    /// Returns the request's id on the bus and its result.
    async fn finish(
        &self,
        client: &Client,
        mut request: GenerationRequest,
        read: bool,
    ) -> (String, GenerationResult) {
        let bare = genfleet::protocol::ids::new_id();
        let id = client.on_bus(&bare);
        request.request_id = Some(bare);
        let mut events = Box::pin(client.follow(&id).await.unwrap());
        fleet::submit_when_tools_known(client, &request).await;
        let result = wait::within("the request finishes", WAIT, async {
            while let Some(event) = events.next().await {
                if let EventBody::Finished { result } = event.body {
                    return *result;
                }
            }
            panic!("the events of {id} ended");
        })
        .await;
        if read {
            client.result(&id, true).await.unwrap();
        }
        (id, result)
    }

    /// Runs `request` until it asks for a decision; returns its id and the decision's. The
    /// result is left stored (a caller reading it would release it), so the console can show
    /// it.
    async fn raise(&self, request: GenerationRequest) -> (String, String) {
        let (id, result) = self.finish(&self.client, request, false).await;
        assert_eq!(result.reason, Reason::DecisionRequested, "{result:?}");
        let decision = result
            .signals
            .iter()
            .find_map(|s| s.decision.clone())
            .expect("a decision");
        (id, decision.decision_id)
    }

    async fn raise_decision(&self) -> (String, String) {
        let mut request = GenerationRequest::user("What is 1234 × 5678? Use the calculator.");
        request.job_name = Some("console-report".into());
        request.tools = vec!["calculate".into()];
        self.raise(request).await
    }

    async fn raise_escalation(&self) -> (String, String) {
        let request: GenerationRequest = serde_json::from_value(json!({
            "job_name": "sums",
            "messages": [{"role": "user", "content": "Sum the numbers 40 and 2."}],
            "validation": [{"kind": "contains", "text": "TOTAL"}],
        }))
        .unwrap();
        self.raise(request).await
    }

    /// Starts a request that streams for a few seconds, with the id given or a new one.
    async fn start_slow(&self, id: Option<&str>) -> String {
        let mut request = GenerationRequest::user("Count slowly to thirty.");
        let id = id.map_or_else(genfleet::protocol::ids::new_id, str::to_string);
        request.request_id = Some(id.clone());
        request.job_name = Some("slow-count".into());
        self.client.submit("default", &request).await.unwrap();
        id
    }

    /// Starts a request of tenant `globex` that runs for a minute unless cancelled, and
    /// waits until it streams; returns its id on the bus (`globex.<id>`). Its metadata names
    /// another tenant, which the console must not believe.
    async fn start_long(&self) -> String {
        let globex = self.tenant("globex");
        let mut request = GenerationRequest::user("Tick until cancelled.");
        let bare = genfleet::protocol::ids::new_id();
        let id = globex.on_bus(&bare);
        request.request_id = Some(bare);
        request.job_name = Some("ticker".into());
        request.metadata.insert("tenant".into(), json!("mallory"));
        let mut events = Box::pin(globex.follow(&id).await.unwrap());
        globex.submit("default", &request).await.unwrap();
        wait::within("the long request streams", WAIT, async {
            while let Some(event) = events.next().await {
                if matches!(event.body, EventBody::Delta { .. }) {
                    return;
                }
            }
            panic!("the events of {id} ended");
        })
        .await;
        id
    }

    /// Runs a request the backend refuses (for tenant `acme`), and reads (so releases) its
    /// FAILED result, as its caller would; returns its id on the bus (`acme.<id>`).
    async fn run_failing(&self) -> String {
        let mut request = GenerationRequest::user("Fail loudly, please.");
        request.job_name = Some("doomed".into());
        let result = self
            .tenant("acme")
            .run("default", request, WAIT)
            .await
            .unwrap();
        assert_eq!(result.state, genfleet::protocol::RequestState::Failed);
        assert!(result.request_id.starts_with("acme."), "{result:?}");
        result.request_id
    }

    /// Runs a request of tenant `acme` that answers at once, its result read (released) by
    /// its caller or left stored; returns its id on the bus (`acme.<id>`).
    async fn say_hello(&self, read: bool) -> String {
        let mut request = GenerationRequest::user("Say hello.");
        request.job_name = Some("greeting".into());
        self.finish(&self.tenant("acme"), request, read).await.0
    }

    /// Runs a request that calls the calculator and reports, and reads (releases) its
    /// result; returns its id.
    async fn multiply_and_read(&self) -> String {
        let mut request = GenerationRequest::user("Multiply and report 1234 × 5678.");
        request.job_name = Some("multiply".into());
        request.tools = vec!["calculate".into()];
        let (id, result) = self.finish(&self.client, request, true).await;
        assert_eq!(
            (result.reason, result.tool_iterations_used),
            (Reason::Stop, 1),
            "{result:?}"
        );
        id
    }

    async fn record(&self, decision_id: &str) -> DecisionRecord {
        let js = async_nats::jetstream::new(self.client.nats().clone());
        let bucket = js.get_key_value("GENFLEET_DECISIONS").await.unwrap();
        let entry = bucket.get(decision_id).await.unwrap().unwrap();
        serde_json::from_slice(&entry).unwrap()
    }
}

/// A console running in this process.
struct Running {
    base: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn console(settings: &Settings, token: &str, read_only: bool) -> Running {
    let mut settings = settings.clone();
    settings.console.token = token.into();
    let console = Console::start(
        &settings,
        ConsoleOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            read_only,
        },
    )
    .await
    .unwrap();
    let base = format!("http://{}", console.addr());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(console.run(async {
        let _ = stopped.await;
    }));
    Running {
        base,
        stop: Some(stop),
        task,
    }
}

impl Running {
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        wait::within("the console stops, open streams and all", WAIT, self.task)
            .await
            .unwrap()
            .unwrap();
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Answers through the console as its page does.
    async fn answer(&self, decision_id: &str, body: Value) -> (u16, Value) {
        let response = http()
            .post(self.url(&format!("/api/decisions/{decision_id}")))
            .header("content-type", "application/json")
            .header("x-genfleet-token", TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    async fn snapshot(&self) -> Value {
        http()
            .get(self.url("/api/snapshot"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Waits until the snapshot holds.
    async fn until(&self, what: &str, holds: impl Fn(&Value) -> bool) -> Value {
        wait::until(what, WAIT, || async {
            let snapshot = self.snapshot().await;
            if holds(&snapshot) {
                Ok(snapshot)
            } else {
                Err(format!("the snapshot: {snapshot:#}"))
            }
        })
        .await
    }
}

fn http() -> reqwest::Client {
    genfleet::llm::openai::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

fn item<'a>(snapshot: &'a Value, decision_id: &str) -> Option<&'a Value> {
    snapshot["inbox"]["items"]
        .as_array()?
        .iter()
        .find(|i| i["decision_id"] == decision_id)
}

/// Server-sent events as (event name, JSON data).
async fn events(response: reqwest::Response) -> impl Stream<Item = (String, Value)> {
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    response
        .bytes_stream()
        .eventsource()
        .filter_map(|event| async move {
            let event = event.ok()?;
            Some((event.event, serde_json::from_str(&event.data).ok()?))
        })
}

/// The next event that `wanted` accepts.
async fn next_event(
    stream: &mut (impl Stream<Item = (String, Value)> + Unpin),
    what: &str,
    wanted: impl Fn(&str, &Value) -> bool,
) -> Value {
    tokio::time::timeout(WAIT, async {
        while let Some((name, data)) = stream.next().await {
            if wanted(&name, &data) {
                return data;
            }
        }
        panic!("the stream ended before {what}");
    })
    .await
    .unwrap_or_else(|_| panic!("no event: {what}"))
}

/// Which events a wait accepts.
type Accept<'a> = &'a dyn Fn(&str, &Value) -> bool;

/// The next events that `wanted` accept, one each, in whatever order they come: events from
/// different sources (the decisions bucket, the signals stream) have no order between them.
async fn next_events<const N: usize>(
    stream: &mut (impl Stream<Item = (String, Value)> + Unpin),
    wanted: [(&str, Accept<'_>); N],
) -> [Value; N] {
    let mut found: [Option<Value>; N] = std::array::from_fn(|_| None);
    let missing = |found: &[Option<Value>; N]| {
        wanted
            .iter()
            .zip(found)
            .filter(|(_, f)| f.is_none())
            .map(|((what, _), _)| *what)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let all = tokio::time::timeout(WAIT, async {
        while let Some((name, data)) = stream.next().await {
            for (i, (_, accept)) in wanted.iter().enumerate() {
                if found[i].is_none() && accept(&name, &data) {
                    found[i] = Some(data);
                    break;
                }
            }
            if found.iter().all(Option::is_some) {
                return true;
            }
        }
        false
    })
    .await;
    match all {
        Ok(true) => found.map(|f| f.expect("all found")),
        Ok(false) => panic!("the stream ended before {}", missing(&found)),
        Err(_) => panic!("no event: {}", missing(&found)),
    }
}

#[tokio::test]
async fn answers_need_the_token_json_and_the_same_origin() {
    let f = fleet().await;
    let c = console(&f.settings, TOKEN, false).await;
    let (_, decision) = f.raise_decision().await;
    let url = c.url(&format!("/api/decisions/{decision}"));
    let body = json!({"user": "ann", "option_id": "archive", "rationale": "quiet week"});
    // Each refusal: status, code, words of its message.
    let refusals: Vec<(&str, reqwest::RequestBuilder, u16, &str, &str)> = vec![
        (
            "no token",
            http().post(&url).json(&body),
            403,
            "UNAUTHORIZED",
            "needs the console's token",
        ),
        (
            "a wrong token",
            http()
                .post(&url)
                .header("x-genfleet-token", "console-test-token-WRONG")
                .json(&body),
            403,
            "UNAUTHORIZED",
            "not the console's token",
        ),
        (
            "another site's page",
            http()
                .post(&url)
                .header("x-genfleet-token", TOKEN)
                .header("origin", "https://evil.example")
                .json(&body),
            403,
            "UNAUTHORIZED",
            "cross-site",
        ),
        (
            "a cross-site fetch",
            http()
                .post(&url)
                .header("x-genfleet-token", TOKEN)
                .header("sec-fetch-site", "cross-site")
                .json(&body),
            403,
            "UNAUTHORIZED",
            "cross-site",
        ),
        (
            "a form post",
            http()
                .post(&url)
                .header("x-genfleet-token", TOKEN)
                .header("content-type", "application/x-www-form-urlencoded")
                .body("user=ann&option_id=archive"),
            415,
            "INVALID_REQUEST",
            "must be JSON",
        ),
        (
            "a rebound host name",
            http()
                .post(&url)
                .header("x-genfleet-token", TOKEN)
                .header("host", "evil.example")
                .json(&body),
            421,
            "UNAUTHORIZED",
            "loopback",
        ),
        (
            "no name",
            http()
                .post(&url)
                .header("x-genfleet-token", TOKEN)
                .json(&json!({"user": "", "option_id": "archive"})),
            400,
            "INVALID_REQUEST",
            "user",
        ),
        (
            "an unknown field",
            http()
                .post(&url)
                .header("x-genfleet-token", TOKEN)
                .json(&json!({"user": "ann", "option_id": "archive", "decided_by": "ceo"})),
            400,
            "INVALID_REQUEST",
            "decided_by",
        ),
    ];
    for (name, request, status, code, needle) in refusals {
        let response = request.send().await.unwrap();
        assert_eq!(response.status().as_u16(), status, "{name}");
        let reply: Value = response.json().await.unwrap();
        assert_eq!(reply["error"]["code"], code, "{name}: {reply}");
        assert!(
            reply["error"]["message"].as_str().unwrap().contains(needle),
            "{name}: {reply}"
        );
    }
    assert!(
        f.record(&decision).await.answer.is_none(),
        "nothing got through"
    );

    // The fleet's own refusals come back as they are.
    let (status, reply) = c
        .answer(&decision, json!({"user": "ann", "option_id": "fax"}))
        .await;
    assert_eq!(
        (status, reply["error"]["code"].as_str()),
        (400, Some("INVALID_OPTION"))
    );
    let (status, reply) = c
        .answer(
            &decision,
            json!({"user": "ann", "option_id": "archive", "guidance": "be brief"}),
        )
        .await;
    assert_eq!(
        (status, reply["error"]["code"].as_str()),
        (400, Some("INVALID_REQUEST")),
        "{reply}"
    );

    // The token checks out at sign-in, then the answer is recorded with who gave it.
    let signed = http()
        .post(c.url("/api/session"))
        .header("x-genfleet-token", TOKEN)
        .header("origin", c.base.as_str())
        .header("sec-fetch-site", "same-origin")
        .json(&json!({"user": "ann"}))
        .send()
        .await
        .unwrap();
    assert_eq!(signed.status(), 200);
    assert_eq!(
        signed.json::<Value>().await.unwrap()["decided_by"],
        "human:ann"
    );
    let (status, reply) = c.answer(&decision, body.clone()).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        (reply["outcome"].as_str(), reply["decided_by"].as_str()),
        (Some("continued"), Some("human:ann"))
    );
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let answer = f.record(&decision).await.answer.unwrap();
    assert_eq!(
        (
            answer.choice.option_id.as_str(),
            answer.choice.decided_by.as_deref(),
            answer.choice.rationale.as_deref(),
            answer.continuation_request_id.as_deref()
        ),
        (
            "archive",
            Some("human:ann"),
            Some("quiet week"),
            Some(continuation.as_str())
        )
    );

    // Someone else, later: the same option says who was first; another is ALREADY_DECIDED.
    let (status, reply) = c
        .answer(&decision, json!({"user": "bo", "option_id": "archive"}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(reply["answered_first_by"], "human:ann");
    assert_eq!(reply["continuation_request_id"], continuation.as_str());
    let (status, reply) = c
        .answer(&decision, json!({"user": "bo", "option_id": "email"}))
        .await;
    assert_eq!(status, 409);
    assert_eq!(reply["error"]["code"], "ALREADY_DECIDED");
    assert_eq!(reply["error"]["detail"]["decided_by"], "human:ann");
    assert_eq!(reply["error"]["detail"]["option_id"], "archive");

    // The inbox shows it decided, by whom.
    let snapshot = c
        .until("the inbox shows the answer", |s| {
            item(s, &decision).is_some_and(|i| i["state"] == "answered")
        })
        .await;
    let shown = item(&snapshot, &decision).unwrap();
    assert_eq!(shown["answer"]["decided_by"], "human:ann");
    assert_eq!(shown["answer"]["option_id"], "archive");
    c.stop().await;
}

#[tokio::test]
async fn a_read_only_console_shows_everything_and_answers_nothing() {
    let f = fleet().await;
    let without_token = console(&f.settings, "", false).await;
    let told_so = console(&f.settings, TOKEN, true).await;
    let (request_id, decision) = f.raise_decision().await;
    for c in [&without_token, &told_so] {
        let snapshot = c
            .until("the decision shows", |s| item(s, &decision).is_some())
            .await;
        assert_eq!(snapshot["console"]["read_only"], true);
        let shown = item(&snapshot, &decision).unwrap();
        assert_eq!(
            (shown["state"].as_str(), shown["request_id"].as_str()),
            (Some("pending"), Some(request_id.as_str()))
        );
        let (status, reply) = c
            .answer(&decision, json!({"user": "ann", "option_id": "email"}))
            .await;
        assert_eq!(status, 403, "{reply}");
        assert_eq!(reply["error"]["code"], "UNAUTHORIZED");
        assert!(
            reply["error"]["message"]
                .as_str()
                .unwrap()
                .contains("read-only"),
            "{reply}"
        );
    }
    assert!(f.record(&decision).await.is_pending());
    without_token.stop().await;
    told_so.stop().await;
}

#[tokio::test]
async fn the_live_stream_sends_a_snapshot_then_every_change() {
    let f = fleet().await;
    let c = console(&f.settings, TOKEN, false).await;
    let response = http().get(c.url("/api/stream")).send().await.unwrap();
    let mut stream = Box::pin(events(response).await);
    let snapshot = next_event(&mut stream, "the snapshot", |name, _| name == "snapshot").await;
    assert_eq!(snapshot["console"]["read_only"], false);
    assert_eq!(snapshot["inbox"]["items"], json!([]));

    // A decision: its record reaches the inbox, its signal the feed.
    let (request_id, decision) = f.raise_decision().await;
    let is_pending =
        |name: &str, data: &Value| name == "inbox" && data["decision_id"] == decision.as_str();
    let is_signal =
        |name: &str, data: &Value| name == "signal" && data["request_id"] == request_id.as_str();
    let [pending, signal] = next_events(
        &mut stream,
        [
            ("the pending decision", &is_pending),
            ("the decision's signal", &is_signal),
        ],
    )
    .await;
    assert_eq!(pending["state"], "pending");
    assert_eq!(pending["question"], "Where should the report go?");
    assert_eq!(pending["options"][0]["pros"], "everyone sees it today");
    assert_eq!(pending["default_option"], "email");
    assert_eq!(pending["job_name"], "console-report");
    assert_eq!(
        pending["prompt"],
        "What is 1234 × 5678? Use the calculator."
    );
    assert_eq!(
        (signal["type"].as_str(), signal["code"].as_str()),
        (Some("decision_request"), Some("NEEDS_MANAGER_DECISION"))
    );
    assert!(signal["seq"].as_u64().unwrap() >= 1);

    // The answer: the item says who decided, and the outcome signal follows.
    let (status, _) = c
        .answer(&decision, json!({"user": "ann", "option_id": "email"}))
        .await;
    assert_eq!(status, 200);
    let is_answered = |name: &str, data: &Value| {
        name == "inbox" && data["decision_id"] == decision.as_str() && data["state"] == "answered"
    };
    let is_outcome = |name: &str, data: &Value| name == "signal" && data["type"] == "outcome";
    let [answered, outcome] = next_events(
        &mut stream,
        [
            ("the answered decision", &is_answered),
            ("the outcome signal", &is_outcome),
        ],
    )
    .await;
    assert_eq!(answered["answer"]["decided_by"], "human:ann");
    assert_eq!(outcome["code"], "DECIDED");
    assert_eq!(outcome["meta"]["decided_by"], "human:ann");

    // An escalation carries its checks, confidence and threshold.
    let (_, escalation) = f.raise_escalation().await;
    let shown = next_event(&mut stream, "the escalation", |name, data| {
        name == "inbox" && data["decision_id"] == escalation.as_str()
    })
    .await;
    assert_eq!(
        (shown["kind"].as_str(), shown["code"].as_str()),
        (Some("escalation"), Some("LOW_CONFIDENCE"))
    );
    assert_eq!(shown["meta"]["confidence"], 0.0);
    assert_eq!(shown["meta"]["threshold"], 0.6);
    assert_eq!(shown["meta"]["checks"][0]["passed"], false);

    // The fleet: busy while a slow request runs, which is listed as running, then free.
    let slow = f.start_slow(None).await;
    let busy = next_event(
        &mut stream,
        "a busy slot, the slow request running",
        |name, data| {
            name == "fleet"
                && data["busy"] == 1
                && data["running"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|r| r["request_id"] == slow.as_str()))
        },
    )
    .await;
    assert_eq!(
        (busy["slots"].as_u64(), busy["free"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(busy["workers"][0]["busy"], 1);
    let idle = next_event(&mut stream, "the slot free again", |name, data| {
        name == "fleet" && data["busy"] == 0 && data["running_total"] == 0
    })
    .await;
    assert!(
        idle["finished"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["request_id"] == slow.as_str() && r["reason"] == "stop"),
        "{idle}"
    );
    // Stopping the console ends the open stream.
    c.stop().await;
    wait::within("the stream ends with the console", WAIT, async {
        while stream.next().await.is_some() {}
    })
    .await;
}

#[tokio::test]
async fn a_checkpoint_shows_its_trigger_and_takes_a_modified_prompt() {
    let f = fleet().await;
    let c = console(&f.settings, TOKEN, false).await;
    let request: GenerationRequest = serde_json::from_value(json!({
        "job_name": "deploys",
        "messages": [{"role": "user", "content": "Deploy the report to production, slowly."}],
        "checkpoints": [{"name": "production", "prompt_contains": ["production"],
                         "message": "Production deploys need a person."}],
    }))
    .unwrap();
    let (_, decision) = f.raise(request).await;
    let snapshot = c
        .until("the checkpoint shows", |s| item(s, &decision).is_some())
        .await;
    let shown = item(&snapshot, &decision).unwrap();
    assert_eq!(
        (shown["kind"].as_str(), shown["code"].as_str()),
        (Some("checkpoint"), Some("CHECKPOINT"))
    );
    assert_eq!(shown["question"], "Production deploys need a person.");
    assert_eq!(shown["meta"]["checkpoint"], "production");
    assert_eq!(shown["meta"]["matched"], json!(["production"]));
    let ids: Vec<&str> = shown["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["proceed", "skip", "abort", "modify_prompt"]);
    // modify_prompt without the prompt is the fleet's refusal, passed on; with it, answered.
    let (status, reply) = c
        .answer(
            &decision,
            json!({"user": "ann", "option_id": "modify_prompt"}),
        )
        .await;
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("modified_prompt")
    );
    let (status, reply) = c
        .answer(
            &decision,
            json!({"user": "ann", "option_id": "modify_prompt",
                   "modified_prompt": "Deploy the report to staging, slowly.", "guidance": "staging only"}),
        )
        .await;
    assert_eq!(status, 200, "{reply}");
    let answer = f.record(&decision).await.answer.unwrap();
    assert_eq!(
        (
            answer.choice.modified_prompt.as_deref(),
            answer.choice.guidance.as_deref(),
            answer.choice.decided_by.as_deref()
        ),
        (
            Some("Deploy the report to staging, slowly."),
            Some("staging only"),
            Some("human:ann")
        )
    );
    c.stop().await;
}

#[tokio::test]
async fn a_request_is_followed_live_and_its_result_only_peeked() {
    let f = fleet().await;
    let c = console(&f.settings, TOKEN, false).await;
    // Followed before it exists: the fleet does not know it yet, then its events come.
    let id = genfleet::protocol::ids::new_id();
    let response = http()
        .get(c.url(&format!("/api/requests/{id}/stream")))
        .send()
        .await
        .unwrap();
    let mut stream = Box::pin(events(response).await);
    let unknown = next_event(&mut stream, "the status", |name, _| {
        name.starts_with("status")
    })
    .await;
    assert_eq!(unknown["error"]["code"], "NOT_FOUND");
    let mut request = GenerationRequest::user("Count slowly to thirty.");
    request.request_id = Some(id.clone());
    f.client.submit("default", &request).await.unwrap();
    let started = next_event(&mut stream, "started", |name, data| {
        name == "event" && data["event"] == "started"
    })
    .await;
    assert_eq!(started["request_id"], id.as_str());
    let delta = next_event(&mut stream, "a delta", |name, data| {
        name == "event" && data["event"] == "delta"
    })
    .await;
    assert!(!delta["text"].as_str().unwrap().is_empty());
    let finished = next_event(&mut stream, "finished", |name, data| {
        name == "event" && data["event"] == "finished"
    })
    .await;
    assert_eq!(finished["result"]["reason"], "stop");

    // Followed after the end: status, then the stored result.
    let (request_id, _) = f.raise_decision().await;
    let response = http()
        .get(c.url(&format!("/api/requests/{request_id}/stream")))
        .send()
        .await
        .unwrap();
    let mut stream = Box::pin(events(response).await);
    let status = next_event(&mut stream, "the status", |name, _| name == "status").await;
    assert_eq!(status["state"], "COMPLETED");
    assert_eq!(status["decision_outcome"], "pending");
    let result = next_event(&mut stream, "the result", |name, _| name == "result").await;
    assert_eq!(result["reason"], "decision_requested");
    assert!(
        result["messages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["role"] == "tool"),
        "the tool call is in the transcript"
    );
    let once: Value = http()
        .get(c.url(&format!("/api/requests/{request_id}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(once["status"]["state"], "COMPLETED");
    assert_eq!(once["result"]["request_id"], request_id.as_str());
    // Peeked, not released: the caller still gets it.
    let theirs = f.client.result(&request_id, true).await.unwrap();
    assert_eq!(theirs.reason, Reason::DecisionRequested);
    let bad = http()
        .get(c.url("/api/requests/not.an.id/stream"))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    c.stop().await;
}

impl Running {
    async fn get(&self, path: &str) -> (u16, Value) {
        let response = http().get(self.url(path)).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    /// Waits until the list answer to `query` holds.
    async fn until_listed(&self, query: &str, what: &str, holds: impl Fn(&Value) -> bool) -> Value {
        wait::until(what, WAIT, || async {
            let (status, page) = self.get(&format!("/api/requests?{query}")).await;
            assert_eq!(status, 200, "{page}");
            if holds(&page) {
                Ok(page)
            } else {
                Err(format!("the list: {page:#}"))
            }
        })
        .await
    }

    /// Waits until the request's timeline holds.
    async fn until_timeline(&self, id: &str, what: &str, holds: impl Fn(&Value) -> bool) -> Value {
        wait::until(what, WAIT, || async {
            let (status, detail) = self.get(&format!("/api/requests/{id}/timeline")).await;
            if status == 200 && holds(&detail) {
                Ok(detail)
            } else {
                Err(format!("the timeline ({status}): {detail:#}"))
            }
        })
        .await
    }

    async fn cancel(&self, id: &str, token: Option<&str>) -> (u16, Value) {
        let mut request = http()
            .post(self.url(&format!("/api/requests/{id}/cancel")))
            .json(&json!({"user": "ann"}));
        if let Some(token) = token {
            request = request.header("x-genfleet-token", token);
        }
        let response = request.send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }
}

fn listed(page: &Value) -> Vec<&str> {
    page["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["request_id"].as_str().unwrap())
        .collect()
}

fn kinds(detail: &Value) -> Vec<&str> {
    detail["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect()
}

#[tokio::test]
async fn the_requests_list_is_filtered_each_request_has_a_timeline_and_one_is_cancelled() {
    let f = fleet().await;
    let c = console(&f.settings, TOKEN, false).await;
    // A request that calls the calculator and asks a decision; one for a tenant that fails.
    let (asking, decision) = f.raise_decision().await;
    let failed = f.run_failing().await;
    let page = c
        .until_listed("", "both requests are listed", |p| {
            let ids = listed(p);
            ids.contains(&asking.as_str()) && ids.contains(&failed.as_str())
        })
        .await;
    assert_eq!(page["max"], 2000);
    assert!(
        page["pools"]
            .as_array()
            .unwrap()
            .contains(&json!("default"))
    );
    for (query, wanted, not) in [
        ("state=FAILED", &failed, &asking),
        ("state=completed", &asking, &failed),
        ("tenant=acm", &failed, &asking),
        ("job=console-rep", &asking, &failed),
        ("pool=default", &asking, &"none".to_string()),
        (
            &format!("id={}", &failed[failed.len() - 6..]),
            &failed,
            &asking,
        ),
    ] {
        let page = c
            .until_listed(query, query, |p| listed(p).contains(&wanted.as_str()))
            .await;
        assert!(!listed(&page).contains(&not.as_str()), "{query}: {page:#}");
    }
    let (status, refused) = c.get("/api/requests?colour=red").await;
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("colour")
    );

    // The asking request's timeline: started, its turns, the tool call, the decision.
    let detail = c
        .until_timeline(&asking, "the decision is in the timeline", |d| {
            kinds(d).contains(&"decision") && kinds(d).contains(&"finished")
        })
        .await;
    let shown = kinds(&detail);
    for kind in [
        "started",
        "turn",
        "tool_call",
        "tool_result",
        "decision",
        "finished",
    ] {
        assert!(shown.contains(&kind), "{kind} missing: {detail:#}");
    }
    assert_eq!(detail["pool"], "default");
    assert_eq!(detail["decision_id"], decision.as_str());
    assert!(detail["tool_calls"].as_u64().unwrap() >= 1);
    // Answered: the answer and the continuation are in it, linked.
    let (status, reply) = c
        .answer(&decision, json!({"user": "ann", "option_id": "email"}))
        .await;
    assert_eq!(status, 200, "{reply}");
    let continuation = reply["continuation_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let detail = c
        .until_timeline(&asking, "the answer is in the timeline", |d| {
            d["timeline"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["kind"] == "answered" && e["request_id"] == continuation.as_str())
        })
        .await;
    assert_eq!(detail["continuation_request_id"], continuation.as_str());
    let next = c
        .until_timeline(&continuation, "the continuation finishes", |d| {
            d["state"] == "COMPLETED"
        })
        .await;
    assert_eq!(next["parent_request_id"], asking.as_str());
    assert_eq!(next["chain_position"], 2);

    // A running request is cancelled through the console, with the token only.
    let slow = f.start_long().await;
    c.until_listed("state=RUNNING", "the long request runs", |p| {
        listed(p).contains(&slow.as_str())
    })
    .await;
    c.until_timeline(&slow, "the model's turn begins", |d| {
        kinds(d).contains(&"turn")
    })
    .await;
    let (status, reply) = c.cancel(&slow, None).await;
    assert_eq!(
        (status, reply["error"]["code"].as_str()),
        (403, Some("UNAUTHORIZED"))
    );
    let (status, reply) = c.cancel(&slow, Some(TOKEN)).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        (reply["state"].as_str(), reply["cancelled_by"].as_str()),
        (Some("CANCELLED"), Some("human:ann"))
    );
    let (status, reply) = c.cancel(&slow, Some(TOKEN)).await;
    assert_eq!(
        (status, reply["error"]["code"].as_str()),
        (409, Some("ALREADY_FINISHED"))
    );
    let detail = c
        .until_timeline(&slow, "the cancel is in the timeline", |d| {
            d["state"] == "CANCELLED" && kinds(d).contains(&"finished")
        })
        .await;
    let shown = kinds(&detail);
    for kind in ["started", "turn", "cancel", "finished"] {
        assert!(shown.contains(&kind), "{kind} missing: {detail:#}");
    }
    // Its tenant is its id's (its metadata names another); seen from its start, it is whole.
    assert_eq!(
        (&detail["tenant"], &detail["partial"]),
        (&json!("globex"), &json!(false)),
        "{detail:#}"
    );
    let (status, unseen) = c.get("/api/requests/never-seen-here/timeline").await;
    assert_eq!(
        (status, unseen["error"]["code"].as_str()),
        (404, Some("NOT_FOUND"))
    );

    // The pool's series counts what finished.
    let snapshot = c
        .until("the series count the finished requests", |s| {
            s["fleet"]["series"]["pools"]
                .as_array()
                .is_some_and(|pools| {
                    pools.iter().any(|p| {
                        p["pool"] == "default"
                            && p["points"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(|x| x["finished"].as_u64().unwrap())
                                .sum::<u64>()
                                >= 4
                    })
                })
        })
        .await;
    assert_eq!(snapshot["fleet"]["series"]["bucket_ms"], 10_000);
    c.stop().await;
}

/// A batch's record as a gateway writes it.
fn batch_record(
    tenant: &str,
    id: &str,
    created_at: u64,
    status: &str,
    counts: [u64; 3],
    owner: &str,
) -> genfleet::client::batches::Record {
    genfleet::client::batches::Record {
        batch: json!({
            "id": id, "object": "batch", "endpoint": "/v1/chat/completions",
            "status": status, "created_at": created_at, "in_progress_at": created_at + 1,
            "output_file_id": (status == "completed").then(|| format!("file-out-{id}")),
            "error_file_id": null,
            "request_counts": {"total": counts[0], "completed": counts[1], "failed": counts[2]},
            "metadata": {"team": "search"},
        }),
        tenant: tenant.into(),
        owner: owner.into(),
        lease_until_ms: 0,
        reserved: 0,
        chunks: 0,
    }
}

#[tokio::test]
async fn the_batches_of_every_tenant_are_listed_newest_first() {
    let nats = common::nats::NatsServer::start().await;
    let mut settings = Settings::defaults();
    settings.nats.url = nats.url();
    let c = console(&settings, TOKEN, false).await;
    // No gateway yet: an empty list that says why, and the console made no bucket.
    let (status, page) = c.get("/api/batches").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["batches"], json!([]), "{page}");
    assert!(
        page["note"].as_str().unwrap().contains("GENFLEET_BATCHES"),
        "{page}"
    );
    let jetstream = async_nats::jetstream::new(nats.client().await);
    assert!(jetstream.get_key_value("GENFLEET_BATCHES").await.is_err());

    // A gateway's batches: one of the default tenant running, a newer one of acme done.
    let batches = genfleet::client::batches::Batches::open(&nats.client().await, &settings)
        .await
        .unwrap();
    let running = batch_record(
        "",
        "batch_01OLDER",
        1_700_000_000,
        "in_progress",
        [3, 1, 1],
        "gw-7",
    );
    let done = batch_record(
        "acme",
        "batch_01NEWER",
        1_700_000_100,
        "completed",
        [2, 2, 0],
        "",
    );
    assert!(batches.create(&running).await.unwrap());
    assert!(batches.create(&done).await.unwrap());
    let page = wait::until("both batches are listed", WAIT, || async {
        let (status, page) = c.get("/api/batches").await;
        assert_eq!(status, 200, "{page}");
        if page["batches"].as_array().unwrap().len() == 2 {
            Ok(page)
        } else {
            Err(format!("the list: {page:#}"))
        }
    })
    .await;
    assert_eq!(page["total"], 2);
    assert_eq!(page["max"], 2000);
    assert!(page.get("note").is_none(), "{page}");
    assert_eq!(
        page["batches"],
        json!([
            {
                "id": "batch_01NEWER", "tenant": "acme", "status": "completed",
                "endpoint": "/v1/chat/completions", "created_at": 1_700_000_100u64,
                "request_counts": {"total": 2, "completed": 2, "failed": 0},
                "output_file_id": "file-out-batch_01NEWER", "error_file_id": null,
                "driven_by": null,
            },
            {
                "id": "batch_01OLDER", "tenant": "default", "status": "in_progress",
                "endpoint": "/v1/chat/completions", "created_at": 1_700_000_000u64,
                "request_counts": {"total": 3, "completed": 1, "failed": 1},
                "output_file_id": null, "error_file_id": null,
                "driven_by": "gw-7",
            },
        ])
    );
    // Behind the same gate as every /api route: another host name is refused.
    let rebound = http()
        .get(c.url("/api/batches"))
        .header("host", "attacker.example:8080")
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), 421);
    assert_eq!(
        rebound.json::<Value>().await.unwrap()["error"]["code"],
        "UNAUTHORIZED"
    );
    c.stop().await;

    // At most console.max_requests of them: the newest.
    let mut small = settings.clone();
    small.console.max_requests = 1;
    let c = console(&small, "", true).await;
    let (status, page) = c.get("/api/batches").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["total"], 2, "{page}");
    assert_eq!(page["max"], 1, "{page}");
    let ids: Vec<&str> = page["batches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["batch_01NEWER"]);
    c.stop().await;
}

#[tokio::test]
async fn the_page_is_embedded_with_a_strict_policy_and_streams_are_capped() {
    let f = fleet().await;
    let mut settings = f.settings.clone();
    settings.console.max_clients = 1;
    let c = console(&settings, TOKEN, false).await;
    let page = http().get(c.url("/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let headers = page.headers().clone();
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let policy = headers["content-security-policy"].to_str().unwrap();
    for rule in [
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(policy.contains(rule), "{policy}");
    }
    assert_eq!(headers["x-content-type-options"], "nosniff");
    let html = page.text().await.unwrap();
    assert!(html.contains("genfleet console") && html.contains("/app.js"));
    // Nothing is loaded from elsewhere.
    for asset in ["/", "/app.js", "/app.css"] {
        let text = http()
            .get(c.url(asset))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for outside in ["http://", "https://", "//cdn"] {
            assert!(
                !text
                    .replace("http://www.w3.org/2000/svg", "")
                    .contains(outside),
                "{asset} refers to {outside}"
            );
        }
    }
    let script = http().get(c.url("/app.js")).send().await.unwrap();
    assert!(
        script.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/javascript")
    );
    assert!(script.text().await.unwrap().contains("EventSource"));
    // A page of another name is not served by a loopback console.
    let rebound = http()
        .get(c.url("/api/snapshot"))
        .header("host", "attacker.example:8080")
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), 421);
    // One live stream at a time here: the second is refused until the first ends.
    let first = http().get(c.url("/api/stream")).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let second = http().get(c.url("/api/stream")).send().await.unwrap();
    assert_eq!(second.status(), 503);
    assert_eq!(
        second.json::<Value>().await.unwrap()["error"]["code"],
        "INTERNAL"
    );
    drop(first);
    wait::until("the closed stream's place to be freed", WAIT, || async {
        http()
            .get(c.url("/api/stream"))
            .send()
            .await
            .unwrap()
            .status()
            == 200
    })
    .await;
    c.stop().await;
}

#[tokio::test]
async fn the_command_refuses_a_bad_address_in_one_line() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["console", "--listen", "localhost"])
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--listen"), "{stderr}");
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["console"])
        .env("GENFLEET__CONSOLE__TOKEN", "short")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("console.token"));
}

/// `genfleet console` as a user starts it; stopped (killed) on drop.
struct ConsoleProcess {
    url: String,
    _child: tokio::process::Child,
}

async fn console_process(settings: &Settings, token: &str) -> ConsoleProcess {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_genfleet"))
        .args(["console", "--listen", "127.0.0.1:0"])
        .env("GENFLEET__NATS__URL", &settings.nats.url)
        .env("GENFLEET__CONSOLE__TOKEN", token)
        .env("GENFLEET__CONSOLE__FLEET_REFRESH_MS", "300")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = wait::within("the console says where it listens", WAIT, lines.next_line())
        .await
        .unwrap()
        .unwrap();
    let url = first
        .strip_prefix("console listening on ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line: {first}"))
        .to_string();
    ConsoleProcess { url, _child: child }
}

/// Where the browser test finds Chromium and playwright-core (scripts/test.sh installs both
/// and sets these), or `None` when this run opted out with GENFLEET_TEST_SKIP_BROWSER=1.
fn browser_setup() -> Option<(String, String)> {
    let chromium = std::env::var("GENFLEET_TEST_CHROMIUM").ok();
    let modules = std::env::var("GENFLEET_TEST_NODE_MODULES").ok();
    match (chromium, modules) {
        (Some(chromium), Some(modules)) => Some((chromium, modules)),
        _ if std::env::var("GENFLEET_TEST_SKIP_BROWSER").as_deref() == Ok("1") => {
            eprintln!("GENFLEET_TEST_SKIP_BROWSER=1: the console's browser test is skipped");
            None
        }
        _ => panic!(
            "the console's browser test needs Chromium and playwright-core: run ./scripts/test.sh \
             (it installs both and sets GENFLEET_TEST_CHROMIUM and GENFLEET_TEST_NODE_MODULES), or \
             set them yourself (e.g. GENFLEET_TEST_CHROMIUM=/usr/bin/chromium \
             GENFLEET_TEST_NODE_MODULES=tests/console/node_modules after npm ci in tests/console); \
             GENFLEET_TEST_SKIP_BROWSER=1 skips this test"
        ),
    }
}

#[tokio::test]
async fn the_console_in_a_browser() {
    let Some((chromium, modules)) = browser_setup() else {
        return;
    };
    let f = fleet().await;
    let answering = console_process(&f.settings, TOKEN).await;
    let read_only = console_process(&f.settings, "").await;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let shots = std::env::var("GENFLEET_SCREENSHOT_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| root.join("docs/console"));
    std::fs::create_dir_all(&shots).unwrap();
    let node = std::env::var("GENFLEET_TEST_NODE").unwrap_or_else(|_| "node".into());
    let mut script = tokio::process::Command::new(&node)
        .arg(root.join("tests/console/browser.mjs"))
        .env("GENFLEET_CONSOLE_URL", &answering.url)
        .env("GENFLEET_READONLY_CONSOLE_URL", &read_only.url)
        .env("GENFLEET_CONSOLE_TOKEN", TOKEN)
        .env("GENFLEET_TEST_CHROMIUM", &chromium)
        .env(
            "GENFLEET_TEST_NODE_MODULES",
            std::path::absolute(&modules).unwrap(),
        )
        .env("GENFLEET_SCREENSHOT_DIR", &shots)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {node} (Node.js, for the browser test): {e}"));
    let mut to_script = script.stdin.take().unwrap();
    let mut from_script = BufReader::new(script.stdout.take().unwrap()).lines();
    // Its error output, gathered meanwhile, tells what the page did not show.
    let mut stderr = script.stderr.take().unwrap();
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut text).await;
        text
    });
    let mut transcript = Vec::new();
    // Consoles a step started; stopped with the test.
    let mut started = Vec::new();
    let run = async {
        let mut done = false;
        while let Ok(Some(line)) = from_script.next_line().await {
            transcript.push(line.clone());
            if line == "DONE" {
                done = true;
            } else if let Some(text) = line.strip_prefix("LOG ") {
                eprintln!("browser: {text}");
            } else if let Some(step) = line.strip_prefix("STEP ") {
                let step: Value = serde_json::from_str(step).unwrap();
                let reply = browser_step(&f, &step, &mut started).await;
                if to_script
                    .write_all(format!("{reply}\n").as_bytes())
                    .await
                    .is_err()
                {
                    break;
                }
            }
        }
        done
    };
    // A bound for a hung browser only: on a busy machine the whole script takes minutes.
    let done = tokio::time::timeout(Duration::from_secs(600), run).await;
    if done.is_err() {
        let _ = script.start_kill();
    }
    let status = script.wait().await.unwrap();
    let errors = errors.await.unwrap();
    assert!(
        status.success() && done == Ok(true),
        "the browser test failed ({status}{}):\n{errors}\nits steps:\n{}",
        if done.is_err() {
            ", stopped after 10 minutes"
        } else {
            ""
        },
        transcript.join("\n")
    );
    for shot in [
        "inbox",
        "request",
        "requests",
        "requests-narrow",
        "request-cancelled",
        "fleet",
        "signals",
        "inbox-narrow",
        "fleet-narrow",
        "batches",
    ] {
        let path = shots.join(format!("{shot}.png"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(bytes.starts_with(b"\x89PNG"), "{} is a PNG", path.display());
    }
}

/// A console started after the requests it is asked about began: one finished, called a
/// tool and was read by its caller; one still runs. Returns the console once it has read
/// both back.
async fn late_console(f: &Fleet, started: &mut Vec<ConsoleProcess>) -> Value {
    let read_id = f.multiply_and_read().await;
    let running_id = f.start_long().await;
    let late = console_process(&f.settings, TOKEN).await;
    for id in [&read_id, &running_id] {
        let url = format!("{}/api/requests/{id}/timeline", late.url);
        wait::until("the late console reads the request back", WAIT, || async {
            http().get(&url).send().await.unwrap().status() == 200
        })
        .await;
    }
    let url = late.url.clone();
    started.push(late);
    json!({"url": url, "read_id": read_id, "running_id": running_id})
}

/// A batch of tenant `acme` as a gateway writes it: a new one running (1 completed, 1 failed
/// of 3), or the one named, completed (2 completed, 1 failed of 3).
async fn batch_step(f: &Fleet, id: Option<&str>) -> Value {
    let batches = genfleet::client::batches::Batches::open(f.client.nats(), &f.settings)
        .await
        .unwrap();
    let Some(id) = id else {
        let id = format!("batch_{}", genfleet::protocol::ids::new_id());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let record = batch_record("acme", &id, now, "in_progress", [3, 1, 1], "gw-browser");
        assert!(batches.create(&record).await.unwrap());
        return json!({"id": id});
    };
    let read = batches.get("acme", id).await.unwrap().expect("the batch");
    let mut record = read.record;
    record.batch["status"] = json!("completed");
    record.batch["request_counts"] = json!({"total": 3, "completed": 2, "failed": 1});
    record.owner.clear();
    assert!(
        batches
            .update(&record, read.revision)
            .await
            .unwrap()
            .is_some()
    );
    json!({"id": id})
}

/// What the browser script asks of the fleet.
async fn browser_step(f: &Fleet, step: &Value, started: &mut Vec<ConsoleProcess>) -> Value {
    let decision_id = step["decision_id"].as_str().unwrap_or_default();
    match step["step"].as_str().unwrap_or_default() {
        "decision" => {
            let (request_id, decision_id) = f.raise_decision().await;
            json!({"request_id": request_id, "decision_id": decision_id})
        }
        "escalation" => {
            let (request_id, decision_id) = f.raise_escalation().await;
            json!({"request_id": request_id, "decision_id": decision_id})
        }
        "slow" => json!({"request_id": f.start_slow(step["request_id"].as_str()).await}),
        "long" => json!({"request_id": f.start_long().await}),
        "failed" => json!({"request_id": f.run_failing().await}),
        "hello" => json!({"request_id": f.say_hello(step["read"] == true).await}),
        "late_console" => late_console(f, started).await,
        "cancel" => match f
            .client
            .cancel(step["request_id"].as_str().unwrap_or_default())
            .await
        {
            Ok(reply) => json!({"state": reply.state.as_str()}),
            Err(e) => json!({"error": e.to_string()}),
        },
        "answer" => match f.record(decision_id).await.answer {
            Some(answer) => json!(answer),
            None => json!({"error": format!("decision {decision_id} has no answer")}),
        },
        "pending" => json!({"pending": f.record(decision_id).await.is_pending()}),
        "batch" => batch_step(f, step["id"].as_str()).await,
        other => json!({"error": format!("unknown step {other}")}),
    }
}
