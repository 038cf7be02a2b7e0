//! One generation request from prompt to result, as plain async Rust.
//!
//! Architecture invariant: the engine depends on neither NATS nor actix. It runs over three
//! traits ([`LlmBackend`], [`ToolRunner`], [`BiosProvider`]), so it is tested with scripted
//! backends and no broker, and the actor layer above it stays thin.

pub mod bios;
pub use crate::protocol::chain;
pub mod control;
pub mod events;
mod generation;
pub mod history;
pub mod loop_detect;
pub mod progress;
pub mod signals;
pub mod text_calls;
pub mod validation;

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::llm::LlmBackend;
use crate::protocol::{Content, GenerationRequest, GenerationResult, Message, Role, WireError};
use crate::settings::{Settings, SystemMessages, ToolMode};
use crate::tools::{ToolCatalog, ToolRunner};

pub use bios::{BiosContext, BiosProvider, DefaultBios};
pub use chain::ChainState;
pub use events::{Coalescing, EventEmitter, EventSink};
pub use history::{DecisionHistory, NoHistory};
pub use loop_detect::LoopDetectionConfig;
pub use progress::{CheckpointError, Checkpoints, Continuity, HANDED_OFF, Resume};
pub use signals::SignalLimits;

/// The engine's settings, taken from [`Settings`] once.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub tool_mode: ToolMode,
    pub system_messages: SystemMessages,
    pub default_tool_iterations: u32,
    /// 0: the backend decides.
    pub default_max_tokens: u32,
    pub stop_on_decision_request: bool,
    pub max_control_turns: u32,
    pub coalescing: Coalescing,
    pub correction_attempts: u32,
    pub default_tool_timeout: Duration,
    /// The backend's configured model, named in the traces when a request names none.
    pub model: String,
    pub max_output_bytes: usize,
    /// A tool's answer, as JSON text, handed to the model.
    pub max_tool_result_bytes: usize,
    pub signal_limits: SignalLimits,
    pub loop_detection: LoopDetectionConfig,
    /// How long a decision waits for an answer (its `expires_at`); `None`: no expiry.
    pub decision_ttl: Option<Duration>,
    /// A request at this chain position may not request another decision.
    pub max_chain: u32,
    pub escalation: EscalationConfig,
    /// How often a running request writes its progress, once it ran this long (none: never).
    pub checkpoint_every: Option<Duration>,
}

/// How validation escalates.
#[derive(Debug, Clone)]
pub struct EscalationConfig {
    /// Confidence below which a request escalates (a request may set its own).
    pub threshold: f64,
    /// The first request of a chain retries once on its own before it escalates.
    pub auto_retry_on_first_failure: bool,
    /// The default option of escalation decisions.
    pub default_option: Option<String>,
    /// The default option of checkpoint decisions.
    pub checkpoint_default_option: Option<String>,
}

impl EngineConfig {
    pub fn from_settings(settings: &Settings) -> Self {
        let g = &settings.generation;
        EngineConfig {
            tool_mode: settings.llm.tool_mode,
            system_messages: settings.llm.system_messages,
            default_tool_iterations: g.default_tool_iterations,
            default_max_tokens: g.default_max_tokens,
            stop_on_decision_request: g.stop_on_decision_request,
            max_control_turns: g.max_control_turns,
            coalescing: Coalescing {
                bytes: g.delta_coalesce_bytes,
                interval: Duration::from_millis(g.delta_coalesce_ms),
            },
            correction_attempts: settings.tools.correction_attempts,
            default_tool_timeout: Duration::from_millis(settings.tools.default_timeout_ms),
            model: settings.llm.model.clone(),
            max_output_bytes: settings.limits.max_output_bytes,
            max_tool_result_bytes: settings.limits.max_tool_result_bytes,
            signal_limits: SignalLimits {
                max_model_signals: settings.limits.max_model_signals,
                max_model_signal_bytes: settings.limits.max_model_signal_bytes,
                max_worker_signal_bytes: settings.limits.max_worker_signal_bytes,
            },
            loop_detection: settings.loop_detection.clone(),
            decision_ttl: Some(Duration::from_millis(settings.decisions.ttl_ms))
                .filter(|d| !d.is_zero()),
            max_chain: settings.decisions.max_chain,
            escalation: EscalationConfig {
                threshold: settings.escalation.threshold,
                auto_retry_on_first_failure: settings.escalation.auto_retry_on_first_failure,
                default_option: Some(settings.escalation.default_option.clone())
                    .filter(|o| !o.is_empty()),
                checkpoint_default_option: Some(
                    settings.escalation.checkpoint_default_option.clone(),
                )
                .filter(|o| !o.is_empty()),
            },
            checkpoint_every: Some(Duration::from_millis(g.checkpoint_ms)).filter(|d| !d.is_zero()),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig::from_settings(&Settings::defaults())
    }
}

/// Where a request stands in the fleet: filled in by whoever accepted it.
#[derive(Debug, Clone)]
pub struct RequestContext {
    pub request_id: String,
    pub root_request_id: String,
    pub parent_request_id: Option<String>,
    pub chain_position: u32,
    pub attempt: u32,
    pub worker_id: String,
    pub pool: String,
    /// When the fleet accepted the request; `deadline_ms` and `timings_ms` count from here.
    pub accepted_at: Instant,
    /// What the request carries from earlier in its decision chain.
    pub chain: ChainState,
    /// The caller's W3C trace context, passed on to the backend and to tool services.
    pub traceparent: Option<String>,
    /// Where its checkpoints go, and the checkpoint it goes on from.
    pub continuity: Continuity,
}

impl RequestContext {
    /// A first attempt of an original request, accepted now.
    pub fn new(
        request_id: impl Into<String>,
        worker_id: impl Into<String>,
        pool: impl Into<String>,
    ) -> Self {
        let request_id = request_id.into();
        RequestContext {
            root_request_id: request_id.clone(),
            request_id,
            parent_request_id: None,
            chain_position: 1,
            attempt: 1,
            worker_id: worker_id.into(),
            pool: pool.into(),
            accepted_at: Instant::now(),
            chain: ChainState::default(),
            traceparent: None,
            continuity: Continuity::default(),
        }
    }
}

/// What a generation hands back: the terminal result, and the event emitter so the owner can
/// publish `finished` (after storing the result) with the next sequence number.
pub struct Finished {
    pub result: GenerationResult,
    pub events: EventEmitter,
}

/// Runs generations. One per worker, shared by all its slots.
pub struct Engine {
    config: EngineConfig,
    backend: Arc<dyn LlmBackend>,
    runner: Arc<dyn ToolRunner>,
    bios: Arc<dyn BiosProvider>,
    history: Arc<dyn DecisionHistory>,
    catalog: RwLock<Arc<ToolCatalog>>,
    /// Set when the backend refused native tools: every later call goes in text mode.
    native_tools_refused: AtomicBool,
    /// How system messages are sent now ([`SystemShape`] as a number): the configured shape,
    /// or, with `auto`, what the backend's chat template has been found to accept.
    system_shape: AtomicU8,
}

/// How the BIOS and the caller's system prompt are laid out for the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SystemShape {
    /// Each its own system message.
    Separate = 0,
    /// The leading system messages joined into one.
    Merged = 1,
    /// No leading system message: their text opens the first user message.
    FirstUser = 2,
}

impl SystemShape {
    fn from_u8(n: u8) -> SystemShape {
        match n {
            0 => SystemShape::Separate,
            1 => SystemShape::Merged,
            _ => SystemShape::FirstUser,
        }
    }

    /// The shape to try once the backend refused this one, if any is left.
    fn next(self) -> Option<SystemShape> {
        match self {
            SystemShape::Separate => Some(SystemShape::Merged),
            SystemShape::Merged => Some(SystemShape::FirstUser),
            SystemShape::FirstUser => None,
        }
    }

    fn configured(setting: SystemMessages) -> SystemShape {
        match setting {
            SystemMessages::Auto | SystemMessages::Separate => SystemShape::Separate,
            SystemMessages::Merged => SystemShape::Merged,
            SystemMessages::FirstUser => SystemShape::FirstUser,
        }
    }

    /// `messages` laid out in this shape. Only the system messages at the start move (the
    /// BIOS, the caller's `system`, and any the caller's conversation opens with).
    pub fn apply(self, mut messages: Vec<Message>) -> Vec<Message> {
        if self == SystemShape::Separate {
            return messages;
        }
        let leading = messages
            .iter()
            .take_while(|m| m.role == Role::System)
            .count();
        if leading == 0 || (leading == 1 && self == SystemShape::Merged) {
            return messages;
        }
        let text = messages
            .drain(..leading)
            .map(|m| m.text().into_owned())
            .collect::<Vec<_>>()
            .join("\n\n");
        match self {
            SystemShape::Separate => unreachable!("returned above"),
            SystemShape::Merged => messages.insert(0, Message::system(text)),
            SystemShape::FirstUser => match messages.iter_mut().find(|m| m.role == Role::User) {
                Some(user) => {
                    user.content = Some(match user.content.take() {
                        Some(Content::Text(said)) => Content::Text(format!("{text}\n\n{said}")),
                        Some(Content::Parts(mut parts)) => {
                            parts.insert(0, serde_json::json!({"type": "text", "text": text}));
                            Content::Parts(parts)
                        }
                        None => Content::Text(text),
                    });
                }
                None => messages.insert(0, Message::user(text)),
            },
        }
        messages
    }
}

impl Engine {
    pub fn new(
        config: EngineConfig,
        backend: Arc<dyn LlmBackend>,
        runner: Arc<dyn ToolRunner>,
        bios: Arc<dyn BiosProvider>,
    ) -> Self {
        let shape = SystemShape::configured(config.system_messages) as u8;
        Engine {
            backend,
            runner,
            bios,
            history: Arc::new(NoHistory),
            catalog: RwLock::new(Arc::new(ToolCatalog::default())),
            native_tools_refused: AtomicBool::new(false),
            system_shape: AtomicU8::new(shape),
            config,
        }
    }

    /// Where escalations look for suggestions (none by default).
    pub fn with_history(mut self, history: Arc<dyn DecisionHistory>) -> Self {
        self.history = history;
        self
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Replaces the known tools. Running generations keep the catalog they started with.
    pub fn set_catalog(&self, catalog: ToolCatalog) {
        *self.catalog.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(catalog);
    }

    pub fn catalog(&self) -> Arc<ToolCatalog> {
        self.catalog
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The tool mode calls go in now (text once the backend refused native tools).
    pub fn effective_tool_mode(&self) -> ToolMode {
        if self.native_tools_refused.load(Ordering::Relaxed) {
            ToolMode::Text
        } else {
            self.config.tool_mode
        }
    }

    /// The first backend call `request` would make on this engine, as it would be sent: the
    /// BIOS, the system layout, the native tools and the options. An unknown tool is an error.
    pub fn first_call(
        &self,
        request: GenerationRequest,
        context: RequestContext,
    ) -> Result<crate::llm::ChatRequest, String> {
        let events = EventEmitter::new(context.request_id.clone(), None, self.config.coalescing);
        generation::Generation::new(self, request, context, events, CancellationToken::new())
            .first_call()
    }

    /// How system messages are laid out for the backend now.
    pub fn system_shape(&self) -> SystemShape {
        SystemShape::from_u8(self.system_shape.load(Ordering::Relaxed))
    }

    /// The backend's chat template refused `refused`: with `llm.system_messages = "auto"`, the
    /// next shape to try (kept for every later call, with one warning); `None` when the
    /// configuration fixes the shape or none is left.
    fn system_refused(&self, refused: SystemShape, backend_said: &str) -> Option<SystemShape> {
        if self.config.system_messages != SystemMessages::Auto {
            return None;
        }
        let next = refused.next()?;
        // Only the first generation to see the refusal moves the shape on, and warns.
        if self
            .system_shape
            .compare_exchange(
                refused as u8,
                next as u8,
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            tracing::warn!(
                message = "the backend's chat template refused the system messages; sending them another way from now on (llm.system_messages)",
                refused = ?refused,
                now = ?next,
                backend_said = %backend_said
            );
        }
        Some(self.system_shape().max(next))
    }

    /// Checks what only the worker can check: every requested tool is registered, and no
    /// caller tool takes a control tool's name.
    pub fn check_request(&self, request: &GenerationRequest) -> Result<(), WireError> {
        for (i, tool) in request.caller_tools.iter().enumerate() {
            let name = &tool.function.name;
            if control::is_control_tool(name) {
                return Err(WireError::invalid(format!(
                    "caller_tools[{i}].function.name: {name:?} is the name of a control tool"
                )));
            }
        }
        let catalog = self.catalog();
        let unknown: Vec<&str> = request
            .tools
            .iter()
            .map(String::as_str)
            .filter(|name| catalog.get(name).is_none() && !control::is_control_tool(name))
            .collect();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(
                WireError::invalid(format!("unknown tools: {}", unknown.join(", ")))
                    .with_detail(serde_json::json!({ "unknown_tools": unknown })),
            )
        }
    }

    /// Runs one request to its terminal result. It always returns a result: cancellation
    /// (through `cancel`), the deadline and every failure end as a result with the partial
    /// output, never as an error or a panic of this future.
    pub async fn run(
        &self,
        request: GenerationRequest,
        context: RequestContext,
        events: EventEmitter,
        cancel: CancellationToken,
    ) -> Finished {
        generation::Generation::new(self, request, context, events, cancel)
            .run()
            .await
    }

    /// Whether a turn of `request` cut short can be continued on this engine's backend
    /// (instead of taken again from its start): the backend continues a final assistant
    /// message, and the request asks for no structured output.
    pub fn continues_turns(&self, request: &GenerationRequest) -> bool {
        !request.structured_output()
            && self.backend.continuation() != crate::llm::Continuation::None
    }

    /// An emitter for a request's events, coalescing as configured.
    pub fn emitter(&self, request_id: &str, sink: EventSink) -> EventEmitter {
        EventEmitter::new(request_id.to_string(), sink, self.config.coalescing)
    }
}
