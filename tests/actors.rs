//! The actor runtime: slots and the request lifecycle under any interleaving, with a scripted
//! in-process backend whose calls wait on gates the test opens.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::Addr;
use common::wait;
use futures_util::StreamExt;
use futures_util::stream;
use genfleet::actors::{
    Cancel, Canceller, Capacity, Drain, GetResult, Held, Placement, Release, Scheduling, Stats,
    Status, Submit, SupervisorConfig,
};
use genfleet::engine::{DefaultBios, Engine, EngineConfig};
use genfleet::llm::{
    ChatRequest, ChatStream, FinishReason, LlmBackend, LlmError, StreamEvent, ToolCallDelta,
};
use genfleet::protocol::{
    ErrorCode, Event, EventBody, GenerationRequest, Priority, Reason, RequestLimits, RequestState,
    Role,
};
use genfleet::settings::ReservedSlots;
use genfleet::tools::ToolCatalog;
use proptest::prelude::*;
use tokio::sync::{mpsc, watch};

/// The Supervisor under test keeps a text with each request as its ticket.
type Supervisor = genfleet::actors::Supervisor<String>;
type SupervisorHandle = genfleet::actors::SupervisorHandle<String>;

/// What the scripted backend does for one request (keyed by the request's user message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    /// Streams a few words and finishes.
    Complete,
    /// Streams a word, then waits for the gate before finishing.
    Partial,
    /// The stream breaks.
    BackendFails,
    /// Panics inside the generation.
    Panics,
    /// Calls a tool that succeeds, then answers.
    ToolOk,
    /// Calls a tool whose runner fails.
    ToolFails,
    /// Sends a call to an unknown tool (no correction allowed).
    ParseError,
    /// Repeats a line until the loop detector stops it.
    Loops,
}

const ALL: [Behaviour; 8] = [
    Behaviour::Complete,
    Behaviour::Partial,
    Behaviour::BackendFails,
    Behaviour::Panics,
    Behaviour::ToolOk,
    Behaviour::ToolFails,
    Behaviour::ParseError,
    Behaviour::Loops,
];

#[derive(Default)]
struct GatedBackend {
    scripts: Mutex<HashMap<String, (Behaviour, watch::Receiver<bool>)>>,
    gates: Mutex<HashMap<String, watch::Sender<bool>>>,
}

impl GatedBackend {
    fn script(&self, key: &str, behaviour: Behaviour) {
        let (tx, rx) = watch::channel(false);
        self.scripts
            .lock()
            .unwrap()
            .insert(key.into(), (behaviour, rx));
        self.gates.lock().unwrap().insert(key.into(), tx);
    }

    fn open(&self, key: &str) {
        if let Some(gate) = self.gates.lock().unwrap().get(key) {
            let _ = gate.send(true);
        }
    }

    fn open_all(&self) {
        for gate in self.gates.lock().unwrap().values() {
            let _ = gate.send(true);
        }
    }
}

fn text(s: &str) -> Result<StreamEvent, LlmError> {
    Ok(StreamEvent::Text(s.into()))
}

fn finish() -> Result<StreamEvent, LlmError> {
    Ok(StreamEvent::Finish(FinishReason::Stop))
}

fn call(name: &str) -> Result<StreamEvent, LlmError> {
    Ok(StreamEvent::ToolCall(ToolCallDelta {
        index: 0,
        id: Some(format!("c-{name}")),
        name: Some(name.into()),
        arguments: "{}".into(),
    }))
}

impl LlmBackend for GatedBackend {
    fn chat_stream(&self, request: ChatRequest) -> ChatStream {
        let key = request
            .messages
            .iter()
            .rev()
            .find(|m| m.role == Role::User)
            .map(|m| m.text().into_owned())
            .unwrap_or_default();
        let after_tool = request
            .messages
            .last()
            .is_some_and(|m| m.role == Role::Tool);
        let (behaviour, mut gate) = self
            .scripts
            .lock()
            .unwrap()
            .get(&key)
            .cloned()
            .expect("scripted");
        let opened = async move {
            let _ = gate.wait_for(|open| *open).await;
        };
        let items: Vec<Result<StreamEvent, LlmError>> = match (behaviour, after_tool) {
            (_, true) => vec![text("after the tool"), finish()],
            (Behaviour::Complete, _) => vec![text("all "), text("done"), finish()],
            (Behaviour::Partial, _) => vec![text("partial "), text("rest"), finish()],
            (Behaviour::BackendFails, _) => {
                vec![
                    text("cut "),
                    Err(LlmError::StreamBroken("the connection dropped".into())),
                ]
            }
            (Behaviour::Panics, _) => vec![],
            (Behaviour::ToolOk, _) => vec![
                call("ok_tool"),
                Ok(StreamEvent::Finish(FinishReason::ToolCalls)),
            ],
            (Behaviour::ToolFails, _) => vec![
                call("bad_tool"),
                Ok(StreamEvent::Finish(FinishReason::ToolCalls)),
            ],
            (Behaviour::ParseError, _) => vec![
                call("nope"),
                Ok(StreamEvent::Finish(FinishReason::ToolCalls)),
            ],
            (Behaviour::Loops, _) => (0..50)
                .map(|_| text("the same line, over and over again!\n"))
                .chain([finish()])
                .collect(),
        };
        if behaviour == Behaviour::Panics {
            return stream::once(async move {
                opened.await;
                panic!("scripted panic in the backend");
            })
            .boxed();
        }
        if behaviour == Behaviour::Partial && !after_tool {
            // The first word streams at once; the rest waits for the gate.
            let mut items = items.into_iter();
            let first = items.next().unwrap();
            let rest: Vec<_> = items.collect();
            return stream::iter([first])
                .chain(stream::once(opened).flat_map(move |_| stream::iter(rest.clone())))
                .boxed();
        }
        stream::once(opened)
            .flat_map(move |_| stream::iter(items.clone()))
            .boxed()
    }
}

struct Fixture {
    backend: Arc<GatedBackend>,
    handle: SupervisorHandle,
    events: mpsc::Receiver<Event>,
}

fn tools() -> ToolCatalog {
    let def = |name: &str| genfleet::tools::ToolDefinition {
        name: name.into(),
        schema: serde_json::json!({"type": "object"}),
        brief: "Do a scripted thing".into(),
        examples: None,
        timeout_ms: None,
    };
    ToolCatalog::new([def("ok_tool"), def("bad_tool")]).unwrap()
}

fn fixture(slots: u32) -> Fixture {
    fixture_with(config(slots))
}

fn fixture_with(config: SupervisorConfig) -> Fixture {
    let backend = Arc::new(GatedBackend::default());
    let runner = Arc::new(common::ScriptedTools::default());
    runner.set(
        "ok_tool",
        common::Behaviour::Reply(serde_json::json!({"ok": true})),
    );
    runner.set(
        "bad_tool",
        common::Behaviour::RunnerError("tool service gone".into()),
    );
    let engine_config = EngineConfig {
        correction_attempts: 0,
        ..EngineConfig::default()
    };
    let engine = Engine::new(
        engine_config,
        backend.clone(),
        runner,
        Arc::new(DefaultBios),
    );
    engine.set_catalog(tools());
    let (tx, events) = mpsc::channel(4096);
    let handle = Supervisor::start(config, Arc::new(engine), Some(tx));
    Fixture {
        backend,
        handle,
        events,
    }
}

fn config(slots: u32) -> SupervisorConfig {
    SupervisorConfig {
        worker_id: "w1".into(),
        pool: "default".into(),
        slots,
        max_retained_results: 10_000,
        cancel_wait: Duration::from_secs(5),
        limits: RequestLimits::default(),
        reserved: ReservedSlots::default(),
        tenant_max_running: 0,
        drain_handoff: genfleet::settings::DrainHandOff::Deadline,
        preempt: false,
        preempt_fair_share: false,
        max_preemptions: 2,
    }
}

fn request(id: &str) -> GenerationRequest {
    let mut request = GenerationRequest::user(id);
    request.request_id = Some(id.into());
    request.tools = vec!["ok_tool".into(), "bad_tool".into()];
    request
}

async fn submit(handle: &SupervisorHandle, id: &str) -> Result<(), ErrorCode> {
    submit_checked(handle, request(id)).await
}

/// Checks a request as the bus does, then submits it.
async fn submit_checked(
    handle: &SupervisorHandle,
    request: GenerationRequest,
) -> Result<(), ErrorCode> {
    let request = handle.checker.check(request).map_err(|e| e.code)?;
    handle
        .addr
        .send(Submit {
            request,
            placement: Placement::default(),
        })
        .await
        .unwrap()
        .map(|_| ())
        .map_err(|e| e.code)
}

/// Submits interactively in `band`, as `tenant`.
async fn submit_as(
    handle: &SupervisorHandle,
    id: &str,
    band: Priority,
    tenant: Option<&str>,
) -> Result<(), ErrorCode> {
    let request = handle.checker.check(request(id)).map_err(|e| e.code)?;
    handle
        .addr
        .send(Submit {
            request,
            placement: Placement {
                scheduling: Scheduling {
                    band,
                    tenant: tenant.map(str::to_string),
                    ..Scheduling::default()
                },
                ..Placement::default()
            },
        })
        .await
        .unwrap()
        .map(|_| ())
        .map_err(|e| e.code)
}

async fn result(
    addr: &Addr<Supervisor>,
    id: &str,
    release: bool,
) -> Result<genfleet::protocol::GenerationResult, ErrorCode> {
    addr.send(GetResult {
        request_id: id.into(),
        release,
    })
    .await
    .unwrap()
    .map_err(|e| e.code)
}

/// How long anything here may take: generous, a busy machine is slow, never wrong.
const WITHIN: Duration = Duration::from_secs(10);

/// Waits until no slot is busy (bounded).
async fn quiesce(handle: &SupervisorHandle) {
    let mut capacity = handle.capacity.clone();
    wait::within(
        "every slot released",
        WITHIN,
        capacity.wait_for(|c| c.busy == 0),
    )
    .await
    .unwrap();
}

/// Waits until `id` has a terminal result (bounded).
async fn finished(addr: &Addr<Supervisor>, id: &str) -> genfleet::protocol::GenerationResult {
    wait::until(&format!("{id} to finish"), WITHIN, || async {
        match result(addr, id, false).await {
            Err(other) if other != ErrorCode::NotReady => panic!("{id}: {other:?}"),
            answer => answer,
        }
    })
    .await
}

/// Waits until `id` streamed its first text, reading `events` (bounded).
async fn first_delta(events: &mut mpsc::Receiver<Event>, id: &str) {
    wait::within(&format!("the first delta of {id}"), WITHIN, async {
        while let Some(event) = events.recv().await {
            if event.request_id == id && matches!(event.body, EventBody::Delta { .. }) {
                return;
            }
        }
        panic!("the events of {id} ended before any delta");
    })
    .await
}

#[actix::test]
async fn submit_with_no_free_slot_is_refused_at_once() {
    let f = fixture(2);
    let addr = &f.handle.addr;
    f.backend.script("a", Behaviour::Partial);
    f.backend.script("b", Behaviour::Partial);
    f.backend.script("c", Behaviour::Complete);
    submit(&f.handle, "a").await.unwrap();
    submit(&f.handle, "b").await.unwrap();
    assert_eq!(
        submit(&f.handle, "c").await,
        Err(ErrorCode::NoSlotAvailable)
    );
    assert_eq!(f.handle.capacity.borrow().free(), 0);
    f.backend.open("a");
    finished(addr, "a").await;
    let mut capacity = f.handle.capacity.clone();
    capacity.wait_for(|c| c.free() == 1).await.unwrap();
    submit(&f.handle, "c").await.unwrap();
    f.backend.open_all();
    quiesce(&f.handle).await;
}

#[actix::test]
async fn reserved_slots_keep_room_that_only_higher_bands_take() {
    let f = fixture_with(SupervisorConfig {
        reserved: ReservedSlots { high: 1, normal: 1 },
        ..config(4)
    });
    for id in ["l1", "l2", "l3", "n1", "n2", "h1", "h2"] {
        f.backend.script(id, Behaviour::Partial);
    }
    // Four free: low may take two, leaving the normal and high reserves.
    assert_eq!(
        submit_as(&f.handle, "l1", Priority::Low, None).await,
        Ok(())
    );
    assert_eq!(
        submit_as(&f.handle, "l2", Priority::Low, None).await,
        Ok(())
    );
    assert_eq!(
        submit_as(&f.handle, "l3", Priority::Low, None).await,
        Err(ErrorCode::NoSlotAvailable)
    );
    // Normal takes the normal reserve, never the high one.
    assert_eq!(
        submit_as(&f.handle, "n1", Priority::Normal, None).await,
        Ok(())
    );
    assert_eq!(
        submit_as(&f.handle, "n2", Priority::Normal, None).await,
        Err(ErrorCode::NoSlotAvailable)
    );
    assert_eq!(
        submit_as(&f.handle, "h1", Priority::High, None).await,
        Ok(())
    );
    assert_eq!(
        submit_as(&f.handle, "h2", Priority::High, None).await,
        Err(ErrorCode::NoSlotAvailable)
    );
    f.backend.open_all();
    quiesce(&f.handle).await;
}

#[actix::test]
async fn a_tenant_at_its_limit_is_refused_with_tenant_limit() {
    let f = fixture_with(SupervisorConfig {
        tenant_max_running: 1,
        ..config(4)
    });
    for id in ["a1", "a2", "b1", "d1", "d2"] {
        f.backend.script(id, Behaviour::Partial);
    }
    assert_eq!(
        submit_as(&f.handle, "a1", Priority::Normal, Some("a")).await,
        Ok(())
    );
    assert_eq!(
        submit_as(&f.handle, "a2", Priority::Normal, Some("a")).await,
        Err(ErrorCode::TenantLimit)
    );
    assert_eq!(
        submit_as(&f.handle, "b1", Priority::Normal, Some("b")).await,
        Ok(())
    );
    // The default tenant has the same limit.
    assert_eq!(
        submit_as(&f.handle, "d1", Priority::Normal, None).await,
        Ok(())
    );
    assert_eq!(
        submit_as(&f.handle, "d2", Priority::Normal, None).await,
        Err(ErrorCode::TenantLimit)
    );
    // A slot freed by the tenant is its own again.
    f.backend.open("a1");
    finished(&f.handle.addr, "a1").await;
    let mut capacity = f.handle.capacity.clone();
    capacity.wait_for(|c| c.busy == 2).await.unwrap();
    f.backend.script("a2", Behaviour::Partial);
    assert_eq!(
        submit_as(&f.handle, "a2", Priority::Normal, Some("a")).await,
        Ok(())
    );
    f.backend.open_all();
    quiesce(&f.handle).await;
}

#[actix::test]
async fn capacity_is_announced_as_it_goes_to_zero_and_back() {
    let f = fixture(1);
    let mut capacity = f.handle.capacity.clone();
    assert_eq!(capacity.borrow_and_update().free(), 1);
    f.backend.script("a", Behaviour::Partial);
    submit(&f.handle, "a").await.unwrap();
    capacity.changed().await.unwrap();
    assert_eq!(
        *capacity.borrow_and_update(),
        Capacity {
            total: 1,
            busy: 1,
            draining: false,
            waiting: 0,
            paused: false,
        }
    );
    f.backend.open("a");
    capacity.changed().await.unwrap();
    assert_eq!(capacity.borrow_and_update().free(), 1);
}

#[actix::test]
async fn results_are_released_once_and_status_follows_the_request() {
    let f = fixture(2);
    let addr = &f.handle.addr;
    f.backend.script("a", Behaviour::Partial);
    submit(&f.handle, "a").await.unwrap();
    let status = addr
        .send(Status {
            request_id: "a".into(),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            status.state,
            status.worker_id.as_deref().unwrap_or_default()
        ),
        (RequestState::Running, "w1")
    );
    let err = addr
        .send(GetResult {
            request_id: "a".into(),
            release: true,
        })
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::NotReady);
    assert_eq!(err.detail["state"], "RUNNING");
    assert_eq!(
        submit(&f.handle, "a").await,
        Err(ErrorCode::DuplicateRequestId)
    );
    f.backend.open("a");
    let peeked = finished(addr, "a").await;
    assert_eq!(peeked.output, "partial rest");
    let status = addr
        .send(Status {
            request_id: "a".into(),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.state, RequestState::Completed);
    let read = result(addr, "a", true).await.unwrap();
    assert_eq!(read, peeked);
    assert_eq!(result(addr, "a", true).await, Err(ErrorCode::NotFound));
    let status = addr
        .send(Status {
            request_id: "a".into(),
        })
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(status.code, ErrorCode::NotFound);
    let stats = addr.send(Stats).await.unwrap();
    assert_eq!((stats.running, stats.retained_results), (0, 0));
}

#[actix::test]
async fn invalid_requests_are_refused_before_taking_a_slot() {
    let f = fixture(1);
    let mut bad = request("x");
    bad.tools = vec!["not_registered".into()];
    let err = f.handle.checker.check(bad).unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidRequest);
    let mut bad = request("y");
    bad.messages.clear();
    let err = f.handle.checker.check(bad).unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidRequest);
    assert_eq!(f.handle.capacity.borrow().free(), 1);
}

#[actix::test]
async fn a_request_without_an_id_gets_a_ulid() {
    let f = fixture(1);
    f.backend.script("hello", Behaviour::Complete);
    let mut req = GenerationRequest::user("hello");
    req.request_id = None;
    let accepted = f
        .handle
        .addr
        .send(Submit {
            request: f.handle.checker.check(req).unwrap(),
            placement: Placement::default(),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(accepted.request_id.len(), 26);
    assert_eq!(accepted.state, RequestState::Running);
    f.backend.open_all();
    let r = finished(&f.handle.addr, &accepted.request_id).await;
    assert_eq!(r.root_request_id, accepted.request_id);
}

#[actix::test]
async fn cancelling_a_running_request_stores_cancelled_with_partial_output_then_replies() {
    let mut f = fixture(1);
    let addr = &f.handle.addr;
    f.backend.script("a", Behaviour::Partial);
    submit(&f.handle, "a").await.unwrap();
    // Let the first word stream before cancelling.
    first_delta(&mut f.events, "a").await;
    let reply = addr
        .send(Cancel {
            request_id: "a".into(),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.state, RequestState::Cancelled);
    // The reply comes after the result is stored.
    let r = result(addr, "a", false).await.unwrap();
    assert_eq!(
        (r.state, r.reason, r.output.as_str()),
        (RequestState::Cancelled, Reason::Cancelled, "partial ")
    );
    quiesce(&f.handle).await;
    let err = addr
        .send(Cancel {
            request_id: "a".into(),
        })
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        (err.code, err.detail["state"].as_str()),
        (ErrorCode::AlreadyFinished, Some("CANCELLED"))
    );
    let err = addr
        .send(Cancel {
            request_id: "zzz".into(),
        })
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::NotFound);
}

#[actix::test]
async fn every_ending_releases_the_slot_with_one_terminal_result() {
    let cases = [
        (Behaviour::Complete, Reason::Stop),
        (Behaviour::ToolOk, Reason::Stop),
        (Behaviour::ToolFails, Reason::ToolExecutionError),
        (Behaviour::ParseError, Reason::ToolParseError),
        (Behaviour::BackendFails, Reason::BackendError),
        (Behaviour::Loops, Reason::LoopDetected),
        (Behaviour::Panics, Reason::WorkerLost),
    ];
    let f = fixture(1);
    let addr = &f.handle.addr;
    for (i, (behaviour, reason)) in cases.into_iter().enumerate() {
        let id = format!("r{i}");
        f.backend.script(&id, behaviour);
        submit(&f.handle, &id)
            .await
            .unwrap_or_else(|e| panic!("{behaviour:?}: {e:?}"));
        f.backend.open(&id);
        let r = finished(addr, &id).await;
        assert_eq!(r.reason, reason, "{behaviour:?}: {r:?}");
        quiesce(&f.handle).await;
        assert_eq!(f.handle.capacity.borrow().free(), 1, "{behaviour:?}");
        if behaviour == Behaviour::Panics {
            assert!(r.detail.unwrap().contains("panicked"));
        }
    }
}

#[actix::test]
async fn events_reach_the_subscriber_with_finished_last_and_seq_gapless() {
    let mut f = fixture(1);
    let addr = &f.handle.addr;
    f.backend.script("a", Behaviour::ToolOk);
    submit(&f.handle, "a").await.unwrap();
    f.backend.open("a");
    let mut received = stream::poll_fn(|cx| f.events.poll_recv(cx));
    let events = wait::collect_until("the finished event", WITHIN, &mut received, |event| {
        matches!(event.body, EventBody::Finished { .. })
    })
    .await;
    let names: Vec<&str> = events.iter().map(|e| e.body.name()).collect();
    assert_eq!(names.first(), Some(&"started"));
    assert_eq!(names.last(), Some(&"finished"), "{names:?}");
    assert!(names.contains(&"tool_call") && names.contains(&"tool_result"));
    assert_eq!(
        events.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (0..events.len() as u64).collect::<Vec<_>>()
    );
    // When `finished` is out, the result is readable.
    assert!(result(addr, "a", true).await.is_ok());
}

#[actix::test]
async fn drain_lets_running_requests_finish_then_cancels_the_rest() {
    // Four slots, three taken: the free one is what the drain must close.
    let f = fixture(4);
    let addr = &f.handle.addr;
    f.backend.script("quick", Behaviour::Partial);
    f.backend.script("stuck", Behaviour::Partial);
    f.backend.script("durable", Behaviour::Partial);
    f.backend.script("late", Behaviour::Complete);
    submit(&f.handle, "quick").await.unwrap();
    submit(&f.handle, "stuck").await.unwrap();
    addr.send(Submit {
        request: f.handle.checker.check(request("durable")).unwrap(),
        placement: Placement {
            scheduling: Scheduling {
                durable: true,
                ..Scheduling::default()
            },
            ..Placement::default()
        },
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(f.handle.capacity.borrow().free(), 1);
    let drain = addr.send(Drain {
        deadline: Duration::from_secs(1),
    });
    let opener = async {
        let mut capacity = f.handle.capacity.clone();
        wait::within(
            "the drain to begin",
            WITHIN,
            capacity.wait_for(|c| c.draining),
        )
        .await
        .unwrap();
        assert_eq!(
            f.handle.capacity.borrow().free(),
            0,
            "no free slot while draining"
        );
        assert_eq!(
            submit(&f.handle, "late").await,
            Err(ErrorCode::NoSlotAvailable)
        );
        f.backend.open("quick");
    };
    let (report, ()) = tokio::join!(drain, opener);
    let mut cancelled = report.unwrap().cancelled;
    cancelled.sort();
    assert_eq!(
        cancelled,
        vec![("durable".to_string(), true), ("stuck".to_string(), false)]
    );
    assert_eq!(
        result(addr, "quick", true).await.unwrap().reason,
        Reason::Stop
    );
    assert_eq!(
        result(addr, "stuck", true).await.unwrap().reason,
        Reason::Cancelled
    );
    assert_eq!(f.handle.capacity.borrow().busy, 0);
}

#[actix::test]
async fn cancellation_reaches_an_http_stream_read_through_the_actors() {
    let h = common::Harness::new(
        "[[rules]]\nreply = \"a b c d e f g h i j k l m n o p\"\ndelay_ms = 100\n",
    )
    .await;
    let (tx, mut events) = mpsc::channel(4096);
    let handle = Supervisor::start(config(1), h.engine.clone(), Some(tx));
    let mut req = GenerationRequest::user("go");
    req.request_id = Some("http".into());
    submit_request(&handle, req).await;
    // Cancelled once the stream is under way: the first word is out, the rest to come.
    first_delta(&mut events, "http").await;
    let r = cancel_and_read(&handle.addr, "http").await;
    assert!(
        !r.output.is_empty() && r.output.len() < "a b c d e f g h i j k l m n o p".len(),
        "{:?}",
        r.output
    );
    quiesce(&handle).await;
}

#[actix::test]
async fn cancellation_reaches_a_tool_call_through_the_actors() {
    let h = common::Harness::new(
        "[[rules]]\nreply = \"Calling.\"\ntool_calls = [{ name = \"hang\", arguments = {} }]\n",
    )
    .await;
    let handle = Supervisor::start(config(1), h.engine.clone(), None);
    let mut req = GenerationRequest::user("go");
    req.request_id = Some("tool".into());
    req.tools = vec!["hang".into()];
    submit_request(&handle, req).await;
    wait::until("the tool to have the call", WITHIN, || async {
        !h.tools.calls().is_empty()
    })
    .await;
    assert_eq!(h.tools.calls().len(), 1);
    let r = cancel_and_read(&handle.addr, "tool").await;
    assert_eq!(
        (r.reason, r.output.as_str()),
        (Reason::Cancelled, "Calling.")
    );
    quiesce(&handle).await;
}

async fn submit_request(handle: &SupervisorHandle, request: GenerationRequest) {
    submit_checked(handle, request).await.unwrap();
}

/// Cancels a running request, checks the reply came with CANCELLED, and reads the result.
async fn cancel_and_read(
    addr: &Addr<Supervisor>,
    id: &str,
) -> genfleet::protocol::GenerationResult {
    let reply = addr
        .send(Cancel {
            request_id: id.into(),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.state, RequestState::Cancelled);
    result(addr, id, true).await.unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Submit(Behaviour),
    Cancel(usize),
    Open(usize),
    GetResult(usize, bool),
    Status(usize),
    Yield(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..ALL.len()).prop_map(|i| Op::Submit(ALL[i])),
        1 => any::<usize>().prop_map(Op::Cancel),
        3 => any::<usize>().prop_map(Op::Open),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(i, r)| Op::GetResult(i, r)),
        1 => any::<usize>().prop_map(Op::Status),
        2 => (0u8..8).prop_map(Op::Yield),
    ]
}

/// Runs one interleaving and checks the invariants at its end.
fn run_interleaving(slots: u32, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let system = actix::System::new();
    system.block_on(async move {
        let f = fixture(slots);
        let addr = &f.handle.addr;
        let mut accepted: Vec<String> = Vec::new();
        let mut reads: HashMap<String, u32> = HashMap::new();
        let mut next = 0;
        let pick = |v: &Vec<String>, i: usize| (!v.is_empty()).then(|| v[i % v.len()].clone());
        for op in ops {
            match op {
                Op::Submit(behaviour) => {
                    let id = format!("q{next}");
                    next += 1;
                    f.backend.script(&id, behaviour);
                    match submit(&f.handle, &id).await {
                        Ok(()) => accepted.push(id),
                        Err(ErrorCode::NoSlotAvailable) => {}
                        Err(other) => prop_assert!(false, "unexpected refusal {other:?}"),
                    }
                }
                Op::Cancel(i) => {
                    if let Some(id) = pick(&accepted, i) {
                        match addr
                            .send(Cancel {
                                request_id: id.clone(),
                            })
                            .await
                            .unwrap()
                        {
                            Ok(reply) => prop_assert!(reply.state.is_terminal(), "{id}: {reply:?}"),
                            Err(e) => prop_assert!(
                                matches!(e.code, ErrorCode::AlreadyFinished | ErrorCode::NotFound),
                                "{id}: {e:?}"
                            ),
                        }
                    }
                }
                Op::Open(i) => {
                    if let Some(id) = pick(&accepted, i) {
                        f.backend.open(&id);
                    }
                }
                Op::GetResult(i, release) => {
                    if let Some(id) = pick(&accepted, i) {
                        match result(addr, &id, release).await {
                            Ok(r) => {
                                prop_assert!(r.state.is_terminal());
                                prop_assert_eq!(&r.request_id, &id);
                                if release {
                                    *reads.entry(id).or_default() += 1;
                                }
                            }
                            Err(code) => prop_assert!(
                                matches!(code, ErrorCode::NotReady | ErrorCode::NotFound),
                                "{code:?}"
                            ),
                        }
                    }
                }
                Op::Status(i) => {
                    if let Some(id) = pick(&accepted, i) {
                        let _ = addr.send(Status { request_id: id }).await.unwrap();
                    }
                }
                Op::Yield(n) => {
                    for _ in 0..n {
                        tokio::task::yield_now().await;
                    }
                }
            }
            let capacity = *f.handle.capacity.borrow();
            prop_assert!(capacity.busy <= slots);
        }
        f.backend.open_all();
        quiesce(&f.handle).await;
        // Every accepted request ends in exactly one terminal result, readable exactly once.
        for id in &accepted {
            if reads.get(id).copied().unwrap_or(0) == 0 {
                let r = finished(addr, id).await;
                prop_assert!(r.state.is_terminal());
                prop_assert!(result(addr, id, true).await.is_ok());
                *reads.entry(id.clone()).or_default() += 1;
            }
            prop_assert_eq!(reads[id], 1, "{} read more than once", id);
            prop_assert_eq!(result(addr, id, true).await, Err(ErrorCode::NotFound));
        }
        let stats = addr.send(Stats).await.unwrap();
        prop_assert_eq!(stats.capacity.busy, 0);
        prop_assert_eq!(stats.capacity.free(), slots);
        prop_assert_eq!(stats.running, 0, "no running record leaks");
        prop_assert_eq!(stats.retained_results, 0, "no finished record leaks");
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn slots_and_records_hold_under_random_interleavings(
        slots in 1u32..4,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        run_interleaving(slots, ops)?;
    }
}

/// Submits `id` to wait for a slot if none is free, with a ticket; returns the acceptance and
/// the notice of its start.
async fn submit_waiting(
    handle: &SupervisorHandle,
    id: &str,
) -> (
    Result<genfleet::protocol::Accepted, ErrorCode>,
    tokio::sync::oneshot::Receiver<()>,
) {
    let (on_start, started) = tokio::sync::oneshot::channel();
    let accepted = handle
        .addr
        .send(Submit {
            request: handle.checker.check(request(id)).unwrap(),
            placement: Placement {
                scheduling: Scheduling {
                    durable: true,
                    wait_for_slot: true,
                    ..Scheduling::default()
                },
                ticket: Some(format!("ticket of {id}")),
                on_start: Some(on_start),
                ..Placement::default()
            },
        })
        .await
        .unwrap()
        .map_err(|e| e.code);
    (accepted, started)
}

fn ticket_text(ticket: &Option<String>) -> String {
    ticket.clone().unwrap_or_default()
}

#[actix::test]
async fn a_request_waiting_for_a_slot_starts_when_one_frees_and_keeps_its_ticket_to_the_end() {
    let f = fixture(1);
    f.backend.script("busy", Behaviour::Partial);
    f.backend.script("next", Behaviour::Complete);
    submit(&f.handle, "busy").await.unwrap();
    let (accepted, mut started) = submit_waiting(&f.handle, "next").await;
    assert_eq!(accepted.unwrap().state, RequestState::Queued);
    // It holds the next free slot: nothing else may take it, and at most `slots` wait.
    let capacity = *f.handle.capacity.borrow();
    assert_eq!(
        (capacity.busy, capacity.waiting, capacity.free()),
        (1, 1, 0)
    );
    assert_eq!(
        submit(&f.handle, "other").await,
        Err(ErrorCode::NoSlotAvailable)
    );
    let (refused, _) = submit_waiting(&f.handle, "third").await;
    assert_eq!(refused.unwrap_err(), ErrorCode::NoSlotAvailable);
    let held = f.handle.addr.send(Held::new()).await.unwrap();
    let next = held.iter().find(|h| h.request_id == "next").unwrap();
    assert_eq!(next.state, RequestState::Queued);
    assert_eq!(ticket_text(&next.ticket), "ticket of next");
    assert!(started.try_recv().is_err(), "it has not started yet");
    f.backend.open("busy");
    wait::within("its start once the slot frees", WITHIN, started)
        .await
        .expect("the start is told");
    f.backend.open("next");
    let r = finished(&f.handle.addr, "next").await;
    assert_eq!(r.state, RequestState::Completed);
    let released = f
        .handle
        .addr
        .send(Release::new("next"))
        .await
        .unwrap()
        .expect("an ended request is released with its ticket");
    assert_eq!(ticket_text(&released.ticket), "ticket of next");
    assert_eq!(released.cancelled_by, None);
    // Released: nothing of it is left on record.
    assert_eq!(
        result(&f.handle.addr, "next", false).await,
        Err(ErrorCode::NotFound)
    );
    quiesce(&f.handle).await;
}

#[actix::test]
async fn a_waiting_request_cancelled_never_runs_and_a_drain_hands_back_the_others() {
    let f = fixture(1);
    f.backend.script("busy", Behaviour::Partial);
    submit(&f.handle, "busy").await.unwrap();
    let (accepted, started) = submit_waiting(&f.handle, "cancelled").await;
    assert_eq!(accepted.unwrap().state, RequestState::Queued);
    let reply = f
        .handle
        .addr
        .send(Cancel {
            request_id: "cancelled".into(),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.state, RequestState::Cancelled);
    assert!(started.await.is_err(), "a cancelled wait never starts");
    let r = result(&f.handle.addr, "cancelled", false).await.unwrap();
    assert_eq!(
        (r.reason, r.detail.as_deref()),
        (
            Reason::Cancelled,
            Some("cancelled while waiting for a slot")
        )
    );
    let released = f
        .handle
        .addr
        .send(Release::new("cancelled"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(released.cancelled_by, Some(Canceller::Caller));
    assert_eq!(ticket_text(&released.ticket), "ticket of cancelled");
    // The slot went to nobody: the waiting request left it.
    assert_eq!(f.handle.capacity.borrow().waiting, 0);

    let (accepted, started) = submit_waiting(&f.handle, "handed-back").await;
    assert_eq!(accepted.unwrap().state, RequestState::Queued);
    let drain = f.handle.addr.send(Drain {
        deadline: Duration::from_millis(200),
    });
    let report = drain.await.unwrap();
    assert!(
        report
            .cancelled
            .contains(&("handed-back".to_string(), true)),
        "{report:?}"
    );
    assert!(started.await.is_err(), "a drained wait never starts");
    let released = f
        .handle
        .addr
        .send(Release::new("handed-back"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(released.cancelled_by, Some(Canceller::Drain));
    quiesce(&f.handle).await;
}
