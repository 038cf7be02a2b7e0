//! Shared harness for the integration tests: the mock backend on a free loopback port, the real
//! OpenAI-compatible client, scripted tools, and helpers to run a request and collect its events.
#![allow(dead_code)]

pub mod fleet;
pub mod gateway;
pub mod nats;
pub mod process;
pub mod wait;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use genfleet::engine::{BiosProvider, DefaultBios, Engine, EngineConfig, RequestContext};
use genfleet::llm::mock::{MockServer, Script};
use genfleet::llm::{LlmBackend, OpenAiBackend};
use genfleet::protocol::{Event, EventBody, GenerationRequest, GenerationResult};
use genfleet::settings::Settings;
use genfleet::tools::{
    ToolCatalog, ToolDefinition, ToolInvocation, ToolReply, ToolRunError, ToolRunner,
};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How a scripted tool behaves.
#[derive(Clone)]
pub enum Behaviour {
    /// Adds `a` and `b`.
    Add,
    Reply(serde_json::Value),
    ErrorReply(serde_json::Value),
    RunnerError(String),
    /// Never answers (for timeouts and cancellation inside a tool call).
    Hang,
}

/// Tools that answer as scripted and remember every call.
#[derive(Default)]
pub struct ScriptedTools {
    behaviours: Mutex<HashMap<String, Behaviour>>,
    calls: Mutex<Vec<ToolInvocation>>,
}

impl ScriptedTools {
    pub fn set(&self, name: &str, behaviour: Behaviour) {
        self.behaviours
            .lock()
            .unwrap()
            .insert(name.into(), behaviour);
    }

    pub fn calls(&self) -> Vec<ToolInvocation> {
        self.calls.lock().unwrap().clone()
    }
}

impl ToolRunner for ScriptedTools {
    fn run(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolReply, ToolRunError>> {
        self.calls.lock().unwrap().push(call.clone());
        let behaviour = self.behaviours.lock().unwrap().get(&call.name).cloned();
        async move {
            match behaviour {
                Some(Behaviour::Add) => {
                    let a = call.arguments["a"].as_f64().unwrap_or(0.0);
                    let b = call.arguments["b"].as_f64().unwrap_or(0.0);
                    Ok(ToolReply::Ok(json!({ "sum": a + b })))
                }
                Some(Behaviour::Reply(v)) => Ok(ToolReply::Ok(v)),
                Some(Behaviour::ErrorReply(v)) => Ok(ToolReply::Error(v)),
                Some(Behaviour::RunnerError(e)) => Err(ToolRunError::Transport(e)),
                Some(Behaviour::Hang) => std::future::pending().await,
                None => Err(ToolRunError::NoResponders(call.name)),
            }
        }
        .boxed()
    }
}

/// The tools every engine test knows.
pub fn test_tools() -> Vec<ToolDefinition> {
    let def = |name: &str, brief: &str, schema: serde_json::Value| ToolDefinition {
        name: name.into(),
        schema,
        brief: brief.into(),
        examples: None,
        timeout_ms: None,
    };
    let number_pair = json!({
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
        "additionalProperties": false
    });
    let mut add = def("add", "Add two numbers", number_pair.clone());
    add.examples = Some(serde_json::from_value(json!({
        "description": "Adds a and b and returns their sum.",
        "instructions": {"when_to_use": "Any sum.", "common_pitfalls": ["a and b must be numbers, not strings"]},
        "examples": [{"scenario": "two plus three", "payload": {"a": 2, "b": 3}}]
    })).unwrap());
    let mut slow = def("slow", "Wait a long time", json!({"type": "object"}));
    slow.timeout_ms = Some(200);
    vec![
        add,
        def("mul", "Multiply two numbers", number_pair),
        def(
            "clock",
            "Read the current time",
            json!({"type": "object", "properties": {}}),
        ),
        slow,
        def("hang", "Never answer", json!({"type": "object"})),
        def(
            "shell",
            "Run a shell command",
            json!({"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}),
        ),
        def(
            "note",
            "Save a note",
            json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
        ),
        def("broken", "Fail in the runner", json!({"type": "object"})),
        def(
            "get_weather",
            "Get the weather in a city",
            json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        ),
        def(
            "refuse",
            "Answer with an error reply",
            json!({"type": "object"}),
        ),
    ]
}

pub struct Harness {
    pub server: MockServer,
    pub engine: Arc<Engine>,
    pub tools: Arc<ScriptedTools>,
}

impl Harness {
    pub async fn new(script: &str) -> Harness {
        Self::with(script, |_| {}).await
    }

    /// A harness whose settings `tune` adjusts (tool mode, limits ...).
    pub async fn with(script: &str, tune: impl FnOnce(&mut Settings)) -> Harness {
        Self::build(script, tune, Arc::new(DefaultBios)).await
    }

    pub async fn build(
        script: &str,
        tune: impl FnOnce(&mut Settings),
        bios: Arc<dyn BiosProvider>,
    ) -> Harness {
        let script = Script::from_toml_str(script).expect("test script parses");
        Self::with_script(script, tune, bios).await
    }

    pub async fn with_script(
        script: Script,
        tune: impl FnOnce(&mut Settings),
        bios: Arc<dyn BiosProvider>,
    ) -> Harness {
        let server = MockServer::start(script).await.expect("mock server starts");
        let mut settings = Settings::defaults();
        settings.llm.base_url = server.base_url();
        settings.llm.model = "mock".into();
        settings.llm.retry_backoff_ms = 10;
        settings.llm.idle_timeout_ms = 5_000;
        settings.generation.delta_coalesce_ms = 0;
        settings.generation.delta_coalesce_bytes = 1;
        tune(&mut settings);
        let backend: Arc<dyn LlmBackend> = Arc::new(OpenAiBackend::new(&settings.llm).unwrap());
        Self::from_parts(server, settings, backend, bios)
    }

    pub fn from_parts(
        server: MockServer,
        settings: Settings,
        backend: Arc<dyn LlmBackend>,
        bios: Arc<dyn BiosProvider>,
    ) -> Harness {
        let tools = Arc::new(ScriptedTools::default());
        tools.set("add", Behaviour::Add);
        tools.set("mul", Behaviour::Reply(json!({"product": 12})));
        tools.set(
            "clock",
            Behaviour::Reply(json!({"now": "2026-01-01T00:00:00Z"})),
        );
        tools.set("slow", Behaviour::Hang);
        tools.set("hang", Behaviour::Hang);
        tools.set("shell", Behaviour::Reply(json!({"exit": 0})));
        tools.set("note", Behaviour::Reply(json!({"saved": true})));
        tools.set("broken", Behaviour::RunnerError("connection reset".into()));
        tools.set(
            "get_weather",
            Behaviour::Reply(json!({"sky": "clear", "celsius": 21})),
        );
        tools.set(
            "refuse",
            Behaviour::ErrorReply(json!({"code": "DENIED", "message": "not today"})),
        );
        let engine = Engine::new(
            EngineConfig::from_settings(&settings),
            backend,
            tools.clone(),
            bios,
        );
        engine.set_catalog(ToolCatalog::new(test_tools()).unwrap());
        Harness {
            server,
            engine: Arc::new(engine),
            tools,
        }
    }

    /// Runs a request to its end and returns the result and every event it emitted.
    pub async fn run(&self, request: GenerationRequest) -> (GenerationResult, Vec<Event>) {
        self.run_with_cancel(request, CancellationToken::new())
            .await
    }

    pub async fn run_with_cancel(
        &self,
        request: GenerationRequest,
        cancel: CancellationToken,
    ) -> (GenerationResult, Vec<Event>) {
        self.run_at(request, cancel, 1).await
    }

    /// Runs a request at a given place in its decision chain.
    pub async fn run_at(
        &self,
        request: GenerationRequest,
        cancel: CancellationToken,
        chain_position: u32,
    ) -> (GenerationResult, Vec<Event>) {
        let id = request.request_id.clone().unwrap_or_else(|| "req-1".into());
        let mut context = RequestContext::new(id, "worker-1", "default");
        context.chain_position = chain_position;
        self.run_in(request, context, cancel).await
    }

    /// Runs a request in the given context (its chain state, place, attempt).
    pub async fn run_in(
        &self,
        request: GenerationRequest,
        context: RequestContext,
        cancel: CancellationToken,
    ) -> (GenerationResult, Vec<Event>) {
        self.run_watched(request, context, cancel, |_| {}).await
    }

    /// Runs a request and cancels it at the first event `at` picks (the first delta, say);
    /// fails if the request ends before any event was picked.
    pub async fn run_cancelled_at(
        &self,
        request: GenerationRequest,
        at: impl Fn(&Event) -> bool + Send + 'static,
    ) -> (GenerationResult, Vec<Event>) {
        let id = request.request_id.clone().unwrap_or_else(|| "req-1".into());
        let context = RequestContext::new(id, "worker-1", "default");
        let cancel = CancellationToken::new();
        let (trigger, fired) = (cancel.clone(), cancel.clone());
        let (result, events) = self
            .run_watched(request, context, cancel, move |event| {
                if at(event) {
                    trigger.cancel();
                }
            })
            .await;
        assert!(
            fired.is_cancelled(),
            "no event came to cancel the request at; it emitted {:?}",
            event_names(&events)
        );
        (result, events)
    }

    /// Runs a request, showing `watch` every event as it is emitted.
    async fn run_watched(
        &self,
        request: GenerationRequest,
        context: RequestContext,
        cancel: CancellationToken,
        mut watch: impl FnMut(&Event) + Send + 'static,
    ) -> (GenerationResult, Vec<Event>) {
        let (tx, mut rx) = mpsc::channel(1024);
        let id = context.request_id.clone();
        let collector = tokio::spawn(async move {
            let mut events = Vec::new();
            while let Some(event) = rx.recv().await {
                watch(&event);
                events.push(event);
            }
            events
        });
        let finished = tokio::time::timeout(
            Duration::from_secs(30),
            self.engine
                .run(request, context, self.engine.emitter(&id, Some(tx)), cancel),
        )
        .await
        .expect("a generation ends well within 30 s");
        drop(finished.events);
        let events = collector.await.unwrap();
        (finished.result, events)
    }

    /// The chat completion bodies the backend received, oldest first.
    pub fn backend_requests(&self) -> Vec<serde_json::Value> {
        self.server.requests()
    }
}

pub fn request(body: serde_json::Value) -> GenerationRequest {
    serde_json::from_value(body).expect("test request decodes")
}

/// The text of every delta event, joined.
pub fn streamed_text(events: &[Event]) -> String {
    events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::Delta { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

pub fn event_names(events: &[Event]) -> Vec<&'static str> {
    events.iter().map(|e| e.body.name()).collect()
}

/// The system message the BIOS provider wrote, as the backend received it in call `n`.
pub fn bios_of(body: &serde_json::Value) -> String {
    body["messages"][0]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}
