//! The shipped permissions file (config/nats/permissions.conf) on a real nats-server: a worker,
//! a tool service, a manager, a client, the gateway and the console, each as a user of its
//! role, do their whole job; the acts a role must not do are refused by the server (its
//! permissions-violation error, seen through the client's event callback, or its log), and a
//! tenant on other prefixes reaches nothing of this one.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fleet::{self, Fleet, request};
use common::nats::NatsServer;
use common::wait;
use futures_util::StreamExt;
use genfleet::client::Client;
use genfleet::manager::{Manager, ManagerOptions, MemorySink, Policy};
use genfleet::protocol::{Reason, RequestState};
use genfleet::settings::Settings;

const SCRIPT: &str = r#"
[[rules]]
when_last_user_contains = "Decision chosen"
reply = "continued"

[[rules]]
when_last_role = "tool"
reply = "calculated: {{last_message}}"

[[rules]]
when_last_user_contains = "decide"
reply = "Two ways."
tool_calls = [{ name = "request_decision", arguments = { question = "Which path?", options = [{ id = "fast", label = "Fast" }, { id = "safe", label = "Safe" }] } }]

[[rules]]
when_last_user_contains = "calc"
tool_calls = [{ name = "calculate", arguments = { operation = "mul", a = 6, b = 7 } }]

[[rules]]
when_last_user_contains = "slow"
reply = "a b c d e f g h i j k l m n o p"
delay_ms = 100

[[rules]]
when_last_user_contains = "linger"
reply = "late"
first_token_delay_ms = 600000

[[rules]]
reply = "done"
"#;

/// The server's configuration: the shipped file, one user per role, an admin for the test's
/// own checks, and a client of another tenant whose subjects start with `b.`.
fn server_config() -> String {
    // nats-server resolves an include against the directory of the configuration, which the
    // harness puts in a new directory under the temp dir.
    let up = "../".repeat(
        std::env::temp_dir()
            .canonicalize()
            .unwrap()
            .components()
            .count(),
    );
    let shipped = format!(
        "{up}{}/config/nats/permissions.conf",
        env!("CARGO_MANIFEST_DIR").trim_start_matches('/')
    );
    format!(
        r#"
include "{shipped}"

TENANT_B_CLIENT = {{
  publish = {{ allow = [ "b.gen.submit.*", "b.gen.queue.*.*", "b.gen.status.*", "b.gen.result.*", "b.gen.cancel.*" ] }}
  subscribe = {{ allow = [ "b.gen.events.*", "_INBOX.>" ] }}
}}

authorization {{
  users = [
    {{ user: worker, password: wpass, permissions: $GENFLEET_WORKER }}
    {{ user: client, password: cpass, permissions: $GENFLEET_CLIENT }}
    {{ user: manager, password: mpass, permissions: $GENFLEET_MANAGER }}
    {{ user: tools, password: tpass, permissions: $GENFLEET_TOOL_SERVICE }}
    {{ user: gateway, password: gpass, permissions: $GENFLEET_GATEWAY }}
    {{ user: console, password: copass, permissions: $GENFLEET_CONSOLE }}
    {{ user: tenant-b, password: bpass, permissions: $TENANT_B_CLIENT }}
    {{ user: acme, password: acpass, permissions: $GENFLEET_TENANT_ACME }}
    {{ user: alice, password: alpass, permissions: {{
        publish = {{ allow = $GENFLEET_CLIENT_PUBLISH }}
        subscribe = {{ allow = [ "gen.events.*", "_INBOX_alice.>" ] }}
    }} }}
    {{ user: admin, password: apass }}
  ]
}}
"#
    )
}

/// A fleet on the shipped permissions: its worker as user "worker", its client as `user`.
async fn fleet_as(user: &'static str, password: &'static str) -> Fleet {
    Fleet::builder()
        .nats_config(server_config())
        .script(SCRIPT)
        .default_settings()
        .slots(2)
        .settings(|s| as_user(s, "worker", "wpass"))
        .client_settings(move |s| as_user(s, user, password))
        .start()
        .await
}

fn settings_as(nats: &NatsServer, user: &str, password: &str) -> Settings {
    let mut s = Settings::defaults();
    s.nats.url = nats.url();
    as_user(&mut s, user, password);
    s
}

fn as_user(s: &mut Settings, user: &str, password: &str) {
    s.nats.user = user.into();
    s.nats.password = password.into();
    s.nats.request_timeout_ms = 3_000;
}

/// A raw connection as `user`, with the server errors it receives.
async fn connect_as(
    nats: &NatsServer,
    user: &str,
    password: &str,
) -> (async_nats::Client, Arc<Mutex<Vec<String>>>) {
    let errors = Arc::new(Mutex::new(Vec::new()));
    let seen = errors.clone();
    let client = async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
        .event_callback(move |event| {
            let seen = seen.clone();
            async move {
                if let async_nats::Event::ServerError(error) = event {
                    seen.lock().unwrap().push(error.to_string());
                }
            }
        })
        .connect(nats.url())
        .await
        .unwrap_or_else(|e| panic!("{user} connects: {e}"));
    (client, errors)
}

/// How long anything here may take: generous, a busy machine is slow, never wrong.
const WITHIN: Duration = Duration::from_secs(15);

/// Waits (bounded) for the server's permissions violation naming `subject`.
async fn refused(errors: &Arc<Mutex<Vec<String>>>, what: &str, subject: &str) {
    wait::until(
        &format!("the server to refuse {what} on {subject}"),
        WITHIN,
        || async {
            let errors = errors.lock().unwrap();
            if errors
                .iter()
                .any(|e| e.to_lowercase().contains("permissions violation") && e.contains(subject))
            {
                Ok(())
            } else {
                Err(format!("errors seen: {errors:?}"))
            }
        },
    )
    .await
}

#[tokio::test]
async fn each_role_does_its_job_and_nothing_else() {
    // The worker, as user "worker"; the client, as user "client".
    let f = fleet_as("client", "cpass").await;
    let (nats, client) = (&f.nats, &f.client);

    // The tool service, as user "tools": registers and serves the calculator.
    let tools_settings = settings_as(nats, "tools", "tpass");
    let tools_connection = genfleet::client::connect::connect(
        &tools_settings.nats,
        genfleet::client::connect::ConnectPurpose::Client,
    )
    .await
    .unwrap();
    let _calculator = fleet::calculator(tools_connection, &tools_settings).await;

    // The manager, as user "manager", answering by rule.
    let manager_settings = settings_as(nats, "manager", "mpass");
    let manager = Manager::start(
        &manager_settings,
        ManagerOptions::new(
            "perm",
            Policy::from_toml_str("[[rule]]\nanswer = \"fast\"\n").unwrap(),
        ),
        Arc::new(MemorySink::default()),
    )
    .await
    .expect("the manager starts with manager permissions");
    let (stop_manager, stopped) = tokio::sync::oneshot::channel::<()>();
    let manager_task = tokio::spawn(manager.run(async {
        let _ = stopped.await;
    }));

    // The client: its whole job.
    let mut calc = request("p-calc", "calc");
    calc.tools = vec!["calculate".into()];
    let calculated = fleet::run_when_tools_known(client, &calc, Duration::from_secs(15)).await;
    assert_eq!(calculated.reason, Reason::Stop, "{calculated:?}");
    assert!(calculated.output.contains("42"), "{calculated:?}");

    let first = client
        .run(
            "default",
            request("p-decide", "decide"),
            Duration::from_secs(15),
        )
        .await
        .unwrap();
    assert_eq!(first.reason, Reason::DecisionRequested);
    let continuation = wait::until("the manager to answer the decision", WITHIN, || async {
        client
            .status("p-decide")
            .await
            .ok()
            .and_then(|status| status.continuation_request_id)
    })
    .await;
    let next = fleet::terminal(client, &continuation, Duration::from_secs(15)).await;
    assert_eq!(next.output, "continued");

    client
        .enqueue("default", &request("p-durable", "hello"))
        .await
        .expect("the client enqueues");
    let durable = fleet::terminal(client, "p-durable", Duration::from_secs(15)).await;
    assert_eq!(durable.state, RequestState::Completed);
    fleet::take_exactly_once(client, "p-durable").await;

    let mut slow_events = Box::pin(client.follow("p-slow").await.expect("the client follows"));
    client
        .submit("default", &request("p-slow", "slow"))
        .await
        .unwrap();
    // Cancelled while it streams.
    wait::next_matching("the first delta of p-slow", WITHIN, &mut slow_events, |e| {
        matches!(e.body, genfleet::protocol::EventBody::Delta { .. }).then_some(())
    })
    .await;
    client.cancel("p-slow").await.expect("the client cancels");
    let cancelled = client.result("p-slow", true).await.unwrap();
    assert_eq!(cancelled.state, RequestState::Cancelled);

    // What a client must not do.
    let (raw, errors) = connect_as(nats, "client", "cpass").await;
    let pending_decision = "01JDECISIONBYACLIENT0000000";
    raw.publish(
        format!("decisions.{pending_decision}"),
        "{\"option_id\":\"fast\"}".into(),
    )
    .await
    .unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "a client answering a decision", "decisions.").await;
    raw.publish(
        "$JS.API.DIRECT.GET.KV_GENFLEET_RESULTS.$KV.GENFLEET_RESULTS.res.p-calc",
        "".into(),
    )
    .await
    .unwrap();
    raw.flush().await.unwrap();
    refused(
        &errors,
        "a client reading the results bucket",
        "$JS.API.DIRECT.GET",
    )
    .await;
    let _sub = raw.subscribe("$KV.GENFLEET_RESULTS.>").await.unwrap();
    raw.flush().await.unwrap();
    refused(
        &errors,
        "a client watching the results bucket",
        "$KV.GENFLEET_RESULTS",
    )
    .await;
    raw.publish("gen.worker.any.cancel", "p-calc".into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "a client posing as a worker", "gen.worker.").await;
    let _signals = raw.subscribe("signals.>").await.unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "a client reading the signals", "signals.").await;

    // What a manager must not do.
    let (raw, errors) = connect_as(nats, "manager", "mpass").await;
    raw.publish("gen.submit.default", "{\"messages\":[]}".into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "a manager submitting", "gen.submit.default").await;
    raw.publish("gen.result.p-calc", "{}".into()).await.unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "a manager reading a result", "gen.result.p-calc").await;
    raw.publish(
        "$JS.API.DIRECT.GET.KV_GENFLEET_RESULTS.$KV.GENFLEET_RESULTS.res.p-calc",
        "".into(),
    )
    .await
    .unwrap();
    raw.flush().await.unwrap();
    refused(
        &errors,
        "a manager reading the results bucket",
        "$JS.API.DIRECT.GET.KV_GENFLEET_RESULTS",
    )
    .await;

    // What a tool service must not do.
    let (raw, errors) = connect_as(nats, "tools", "tpass").await;
    let _events = raw.subscribe("gen.events.*").await.unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "a tool service following requests", "gen.events.").await;
    raw.publish("signals.issue.FAKE", "{}".into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    refused(
        &errors,
        "a tool service raising signals",
        "signals.issue.FAKE",
    )
    .await;
    raw.publish("_INBOX.someone.else", "forged".into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    refused(
        &errors,
        "a tool service writing to others' inboxes",
        "_INBOX.someone.else",
    )
    .await;

    // A client of another tenant (prefix b.) reaches nothing of this one.
    let (raw, errors) = connect_as(nats, "tenant-b", "bpass").await;
    raw.publish("gen.result.p-decide", "{}".into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    refused(
        &errors,
        "another tenant reading a result",
        "gen.result.p-decide",
    )
    .await;
    let _events = raw.subscribe("gen.events.*").await.unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "another tenant following requests", "gen.events.").await;

    // A client with its own reply prefix (as permissions.conf shows) does its whole job, and
    // neither it nor a client on the shared `_INBOX.>` can listen to the other's replies.
    let mut alice_settings = settings_as(nats, "alice", "alpass");
    alice_settings.nats.inbox_prefix = "_INBOX_alice".into();
    let alice = Client::connect(&alice_settings).await.unwrap();
    let mut listen =
        async_nats::ConnectOptions::with_user_and_password("alice".into(), "alpass".into())
            .custom_inbox_prefix("_INBOX_alice")
            .connect(nats.url())
            .await
            .unwrap()
            .subscribe("_INBOX_alice.>")
            .await
            .unwrap();
    let (client_raw, client_errors) = connect_as(nats, "client", "cpass").await;
    let _overheard = client_raw.subscribe("_INBOX_alice.>").await.unwrap();
    client_raw.flush().await.unwrap();
    refused(
        &client_errors,
        "a client listening to another's replies",
        "_INBOX_alice.>",
    )
    .await;
    let r = alice
        .run(
            "default",
            request("p-alice", "hello"),
            Duration::from_secs(15),
        )
        .await
        .expect("a client on its own reply prefix runs a request");
    assert_eq!(r.output, "done");
    alice
        .enqueue("default", &request("p-alice-durable", "hello"))
        .await
        .expect("the enqueue's acknowledgement comes back on the client's own prefix");
    let durable = fleet::terminal(&alice, "p-alice-durable", Duration::from_secs(15)).await;
    assert_eq!(durable.state, RequestState::Completed);
    // The replies went to alice's prefix (her own listener saw them).
    let heard = wait::within("replies on alice's prefix", WITHIN, listen.next())
        .await
        .unwrap();
    assert!(
        heard.subject.starts_with("_INBOX_alice."),
        "{}",
        heard.subject
    );
    let (alice_raw, alice_errors) = connect_as(nats, "alice", "alpass").await;
    let _shared = alice_raw.subscribe("_INBOX.>").await.unwrap();
    alice_raw.flush().await.unwrap();
    refused(
        &alice_errors,
        "a client listening on the shared inboxes",
        "_INBOX.>",
    )
    .await;

    stop_manager.send(()).expect("the manager still runs");
    wait::within("the manager to stop", WITHIN, manager_task)
        .await
        .expect("the manager's task does not panic")
        .expect("the manager stops cleanly");
}

#[tokio::test]
async fn the_gateway_reaches_what_it_uses_and_nothing_of_a_workers() {
    let f = fleet_as("gateway", "gpass").await;
    let (nats, gateway) = (&f.nats, &f.client);
    const WAIT: Duration = Duration::from_secs(15);

    // Submit, follow the events, read the result; enqueue (with the stream's acknowledgement);
    // status; cancel.
    let done = gateway
        .run("default", request("g-run", "hello"), WAIT)
        .await
        .expect("the gateway runs a request");
    assert_eq!(done.output, "done");
    gateway
        .enqueue("default", &request("g-durable", "hello"))
        .await
        .expect("the gateway enqueues");
    let durable = fleet::terminal(gateway, "g-durable", WAIT).await;
    assert_eq!(durable.state, RequestState::Completed);
    gateway
        .submit("default", &request("g-slow", "linger until cancelled"))
        .await
        .unwrap();
    gateway
        .status("g-slow")
        .await
        .expect("the gateway asks status");
    gateway.cancel("g-slow").await.expect("the gateway cancels");
    let cancelled = fleet::terminal(gateway, "g-slow", WAIT).await;
    assert_eq!(cancelled.state, RequestState::Cancelled);

    // The results bucket, read only; every request's events; the workers' service API.
    let (raw, errors) = connect_as(nats, "gateway", "gpass").await;
    let results = async_nats::jetstream::new(raw.clone())
        .get_key_value("GENFLEET_RESULTS")
        .await
        .expect("the gateway opens the results bucket");
    let stored = results
        .get("res.g-durable")
        .await
        .expect("the gateway reads a result from the bucket");
    assert!(stored.is_some(), "the unread result is in the bucket");
    let _events = raw.subscribe("gen.events.>").await.unwrap();
    // The stored responses: created, written, read and deleted by the gateway.
    let responses = genfleet::gateway::responses::store::Responses::open(&raw, &f.settings)
        .await
        .expect("the gateway opens the responses bucket");
    let stored = genfleet::gateway::responses::store::Stored {
        response: serde_json::json!({"id": "resp_01PERMISSIONS", "status": "completed"}),
        input_items: Vec::new(),
        conversation: Vec::new(),
        session: "s".into(),
        request_id: "g-run".into(),
        background: false,
    };
    responses
        .put("team-a", &stored)
        .await
        .expect("the gateway stores a response");
    let read = responses.get("team-a", "resp_01PERMISSIONS").await;
    assert!(
        matches!(read, Ok(Some(_))),
        "the gateway reads a stored response"
    );
    assert!(
        responses
            .delete("team-a", "resp_01PERMISSIONS")
            .await
            .expect("the gateway deletes a stored response")
    );
    // Files and batches: an object stored, read, listed and deleted; a batch created,
    // listed, updated, and a line's outcome kept and read.
    let files = genfleet::gateway::files::Files::open(&raw, &f.settings)
        .await
        .expect("the gateway opens the files bucket");
    let file = files
        .put("team-a", "batch", "in.jsonl", b"{}\n")
        .await
        .expect("the gateway stores a file");
    let bytes = files
        .read("team-a", &file.id)
        .await
        .expect("the gateway reads a file");
    assert_eq!(bytes.as_deref(), Some(&b"{}\n"[..]));
    let listed = files.list("team-a").await.expect("the gateway lists files");
    assert_eq!(listed.len(), 1);
    assert!(
        files
            .delete("team-a", &file.id)
            .await
            .expect("the gateway deletes a file")
    );
    let batches = genfleet::client::batches::Batches::open(&raw, &f.settings)
        .await
        .expect("the gateway opens the batches buckets");
    let record = genfleet::client::batches::Record {
        batch: serde_json::json!({"id": "batch_01PERMISSIONS", "status": "validating"}),
        tenant: "team-a".into(),
        owner: String::new(),
        lease_until_ms: 0,
        reserved: 0,
        chunks: 0,
    };
    assert!(
        batches
            .create(&record)
            .await
            .expect("the gateway creates a batch")
    );
    assert_eq!(
        batches
            .keys()
            .await
            .expect("the gateway lists batches")
            .len(),
        1
    );
    let read = batches
        .get("team-a", "batch_01PERMISSIONS")
        .await
        .expect("the gateway reads a batch")
        .expect("the batch is there");
    batches
        .update(&read.record, read.revision)
        .await
        .expect("the gateway updates a batch");
    let outcome = genfleet::client::batches::KeptLine {
        number: 1,
        ok: true,
        text: serde_json::json!({"custom_id": "a"}).to_string(),
    };
    batches
        .put_chunk("team-a", "batch_01PERMISSIONS", 1, &[outcome])
        .await
        .expect("the gateway keeps a chunk of outcomes");
    let outcomes = batches
        .outcomes("team-a", "batch_01PERMISSIONS", 1)
        .await
        .expect("the gateway reads the outcomes");
    assert_eq!(outcomes.len(), 1);
    for subject in ["$SRV.INFO.genfleet", "$SRV.STATS.genfleet"] {
        let reply = wait::within(
            &format!("{subject} answered"),
            WAIT,
            raw.request(subject, "".into()),
        )
        .await
        .unwrap_or_else(|e| panic!("{subject}: {e}"));
        let info: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(info["name"], "genfleet", "{subject}: {info}");
    }
    fleet::take_exactly_once(gateway, "g-durable").await;

    // What only a worker (or a manager) does.
    raw.publish("gen.worker.any.cancel", "g-run".into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "the gateway posing as a worker", "gen.worker.").await;
    // The server answers a connection's acts in order: with this refusal in, any refusal of
    // the gateway's own acts above would be in too.
    assert_eq!(
        errors.lock().unwrap().len(),
        1,
        "the gateway's own acts were refused: {:?}",
        errors.lock().unwrap()
    );
    let _serve = raw.subscribe("gen.submit.>").await.unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "the gateway serving submits", "gen.submit.>").await;
    raw.publish("$KV.GENFLEET_RESULTS.res.g-run", "{}".into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    refused(
        &errors,
        "the gateway writing a result",
        "$KV.GENFLEET_RESULTS.res.g-run",
    )
    .await;
    raw.publish("decisions.01JDECISIONBYTHEGATEWAY0000", "{}".into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "the gateway answering a decision", "decisions.").await;
    let _signals = raw.subscribe("signals.>").await.unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "the gateway reading the signals", "signals.").await;
    raw.publish("$JS.API.STREAM.DELETE.KV_GENFLEET_RESULTS", "".into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    refused(
        &errors,
        "the gateway deleting the results bucket",
        "$JS.API.STREAM.DELETE",
    )
    .await;
}

/// A tenant's user (permissions.conf's GENFLEET_TENANT_ACME) submits and enqueues under its
/// own tenant, and the server refuses it every other tenant's subjects, the v1 ones included.
/// The worker keeps a pool limit per tenant, so its counts in GENFLEET_TENANTS go through its
/// grants too.
#[tokio::test]
async fn a_tenant_submits_only_under_the_tenant_its_user_is_granted() {
    let f = Fleet::builder()
        .nats_config(server_config())
        .script(SCRIPT)
        .default_settings()
        .slots(2)
        .settings(|s| {
            as_user(s, "worker", "wpass");
            s.worker.tenants.pool_max_running = 4;
        })
        .client_settings(|s| {
            as_user(s, "acme", "acpass");
            s.nats.inbox_prefix = "_INBOX_acme".into();
        })
        .start()
        .await;
    let acme = f.client.clone().with_tenant("acme").unwrap();
    let done = acme
        .run(
            "default",
            request("t-run", "hello"),
            Duration::from_secs(15),
        )
        .await
        .unwrap();
    assert_eq!(done.state, RequestState::Completed, "{done:?}");
    assert_eq!(
        done.tenant.as_deref(),
        Some("acme"),
        "the result names its tenant"
    );
    assert_eq!(
        done.request_id, "acme.t-run",
        "a tenant's request is known on the bus by its qualified id"
    );
    let mut queued = request("t-queued", "hello");
    queued.priority = Some(genfleet::protocol::Priority::High);
    acme.enqueue("default", &queued).await.unwrap();
    let r = fleet::terminal(&acme, "t-queued", Duration::from_secs(15)).await;
    assert_eq!(r.state, RequestState::Completed, "{r:?}");

    let (raw, errors) = connect_as(&f.nats, "acme", "acpass").await;
    for subject in [
        "gen.submit.default.other",
        "gen.submit.default",
        "gen.queue.default.normal.other.x1",
        "gen.queue.default.high.default.x2",
        "gen.queue.default.x3",
        "gen.status.x4",
        "gen.result.other.x5",
        "gen.cancel.other.x6",
    ] {
        raw.publish(subject, "{}".into()).await.unwrap();
        raw.flush().await.unwrap();
        refused(&errors, "a tenant using another tenant's subject", subject).await;
    }
}

/// The console (permissions.conf's GENFLEET_CONSOLE) does its whole job with none of its acts
/// refused: it follows the signals, the decisions, the results and every request's events,
/// polls the workers, lists the batches, shows a tenant's request, answers a decision and
/// cancels a request. The server refuses it submitting, enqueueing, writing a record, reading
/// the files and serving as a worker.
#[tokio::test]
async fn the_console_watches_answers_and_cancels_and_nothing_else() {
    genfleet::llm::openai::install_crypto_provider();
    const TOKEN: &str = "console-permissions-token-0123456789";
    let f = fleet_as("client", "cpass").await;
    let (nats, client) = (&f.nats, &f.client);

    // What there is to see: a decision pending, a batch the gateway keeps, a request of tenant
    // acme whose result waits for its caller.
    let decided = client
        .run("default", request("k-decide", "decide"), WITHIN)
        .await
        .unwrap();
    assert_eq!(decided.reason, Reason::DecisionRequested, "{decided:?}");
    let decision = decided
        .signals
        .iter()
        .find_map(|s| s.decision.clone())
        .expect("a decision")
        .decision_id;
    let (gateway, _) = connect_as(nats, "gateway", "gpass").await;
    let batches = genfleet::client::batches::Batches::open(&gateway, &f.settings)
        .await
        .unwrap();
    let batch = genfleet::client::batches::Record {
        batch: serde_json::json!({"id": "batch_01CONSOLEPERMISSIONS", "status": "in_progress",
            "created_at": 1_700_000_000u64, "request_counts": {"total": 1, "completed": 0, "failed": 0}}),
        tenant: "team-a".into(),
        owner: String::new(),
        lease_until_ms: 0,
        reserved: 0,
        chunks: 0,
    };
    assert!(batches.create(&batch).await.unwrap());
    let mut acme_settings = settings_as(nats, "acme", "acpass");
    acme_settings.nats.inbox_prefix = "_INBOX_acme".into();
    let acme = Client::connect(&acme_settings)
        .await
        .unwrap()
        .with_tenant("acme")
        .unwrap();
    acme.submit("default", &request("k-hello", "hello"))
        .await
        .unwrap();
    let acme_id = acme.on_bus("k-hello");
    wait::until("acme's request to end", WITHIN, || async {
        acme.status(&acme_id)
            .await
            .ok()
            .filter(|s| s.state == RequestState::Completed)
    })
    .await;

    let mut settings = f.settings.clone();
    as_user(&mut settings, "console", "copass");
    settings.console.token = TOKEN.into();
    settings.console.fleet_refresh_ms = 300;
    let console = genfleet::console::Console::start(
        &settings,
        genfleet::console::ConsoleOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            read_only: false,
        },
    )
    .await
    .expect("the console starts with console permissions");
    let base = format!("http://{}", console.addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(console.run(async {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let get = |path: String| {
        let http = http.clone();
        let url = format!("{base}{path}");
        async move {
            let response = http.get(url).send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<serde_json::Value>().await.unwrap())
        }
    };

    // Every link up, the pending decision in the inbox, its signal in the feed, the worker
    // polled; the request of tenant acme known and shown, its result peeked.
    let snapshot = wait::until("the console to see the fleet", WITHIN, || async {
        let (_, s) = get("/api/snapshot".into()).await;
        let links = &s["links"];
        let linked = ["decisions", "signals", "events", "results"]
            .iter()
            .all(|link| links[link].is_null())
            && links["nats_connected"] == true;
        let pending = s["inbox"]["items"]
            .as_array()
            .is_some_and(|items| items.iter().any(|i| i["decision_id"] == decision.as_str()));
        let signalled = s["signals"].as_array().is_some_and(|s| !s.is_empty());
        let polled = s["fleet"]["workers"]
            .as_array()
            .is_some_and(|w| w.len() == 1);
        if linked && pending && signalled && polled {
            Ok(s)
        } else {
            Err(format!("the snapshot: {s:#}"))
        }
    })
    .await;
    assert_eq!(snapshot["fleet"]["slots"], 2, "{snapshot:#}");
    let (status, shown) = get(format!("/api/requests/{acme_id}")).await;
    assert_eq!(status, 200, "{shown}");
    assert_eq!(shown["status"]["state"], "COMPLETED", "{shown}");
    assert_eq!(shown["result"]["request_id"], acme_id.as_str(), "{shown}");
    // A v1 request, whose result its caller has read: its status.
    let (status, shown) = get("/api/requests/k-decide".into()).await;
    assert_eq!(status, 200, "{shown}");
    assert_eq!(shown["status"]["decision_outcome"], "pending", "{shown}");
    let (status, listed) = get("/api/batches".into()).await;
    assert_eq!(status, 200, "{listed}");
    assert!(
        listed.to_string().contains("batch_01CONSOLEPERMISSIONS"),
        "{listed}"
    );

    // An answer through the console starts the continuation.
    let response = http
        .post(format!("{base}/api/decisions/{decision}"))
        .header("x-genfleet-token", TOKEN)
        .json(&serde_json::json!({"user": "ann", "option_id": "fast"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status().as_u16(),
        200,
        "{}",
        response.text().await.unwrap()
    );
    let continuation = wait::until("the answer to be taken", WITHIN, || async {
        client
            .status("k-decide")
            .await
            .ok()
            .and_then(|status| status.continuation_request_id)
    })
    .await;
    let next = fleet::terminal(client, &continuation, WITHIN).await;
    assert_eq!(next.output, "continued");

    // A request cancelled through the console.
    client
        .submit("default", &request("k-linger", "linger until cancelled"))
        .await
        .unwrap();
    wait::until("k-linger to run", WITHIN, || async {
        client
            .status("k-linger")
            .await
            .ok()
            .filter(|s| s.state == RequestState::Running)
    })
    .await;
    let response = http
        .post(format!("{base}/api/requests/k-linger/cancel"))
        .header("x-genfleet-token", TOKEN)
        .json(&serde_json::json!({"user": "ann"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status().as_u16(),
        200,
        "{}",
        response.text().await.unwrap()
    );
    let cancelled = fleet::terminal(client, "k-linger", WITHIN).await;
    assert_eq!(cancelled.state, RequestState::Cancelled);
    let _ = stop.send(());
    wait::within("the console stops", WITHIN, task)
        .await
        .unwrap()
        .unwrap();
    // None of those acts was refused.
    let log = nats.log_text();
    assert!(
        !log.lines()
            .any(|l| l.contains("\"console\"") && l.to_lowercase().contains("violation")),
        "the console's own acts were refused:\n{log}"
    );

    // What the console must not do.
    let (raw, errors) = connect_as(nats, "console", "copass").await;
    for (what, subject) in [
        ("the console submitting", "gen.submit.default"),
        ("the console enqueueing", "gen.queue.default.k-queued"),
        (
            "the console writing a result",
            "$KV.GENFLEET_RESULTS.res.k-hello",
        ),
        ("the console posing as a worker", "gen.worker.any.cancel"),
        (
            "the console reading the files",
            "$JS.API.STREAM.INFO.OBJ_GENFLEET_FILES",
        ),
        ("the console changing a batch", "$KV.GENFLEET_BATCHES.x"),
        (
            "the console deleting the signals",
            "$JS.API.STREAM.DELETE.GENFLEET_SIGNALS",
        ),
    ] {
        raw.publish(subject, "{}".into()).await.unwrap();
        raw.flush().await.unwrap();
        refused(&errors, what, subject).await;
    }
    let _serve = raw.subscribe("gen.submit.>").await.unwrap();
    raw.flush().await.unwrap();
    refused(&errors, "the console serving submits", "gen.submit.>").await;
}
