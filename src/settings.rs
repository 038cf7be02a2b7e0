//! Typed settings: the built-in defaults (config/default.toml, compiled in), then the file named
//! by `--config` or `GENFLEET_CONFIG`, then `GENFLEET__SECTION__KEY` environment variables.
//!
//! Unknown keys are errors in every layer, so a misspelt override fails loudly instead of being
//! ignored.

pub mod loop_detection;
mod words;

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::protocol::ids::is_valid_name;
use crate::protocol::text::one_line;

pub use loop_detection::LoopDetectionConfig;

/// The defaults shipped with genfleet; the same file users copy to start their own.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// Environment variable naming a config file (same as `--config`).
pub const CONFIG_ENV: &str = "GENFLEET_CONFIG";
/// The most threads a process's runtime may be given (`worker.threads`, `gateway.threads`).
pub const MAX_RUNTIME_THREADS: usize = 256;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub nats: NatsSettings,
    pub subjects: SubjectSettings,
    pub jetstream: JetStreamSettings,
    pub decisions: DecisionSettings,
    pub escalation: EscalationSettings,
    pub worker: WorkerSettings,
    pub placement: PlacementSettings,
    pub llm: LlmSettings,
    pub generation: GenerationSettings,
    pub tools: ToolSettings,
    pub limits: LimitSettings,
    pub loop_detection: LoopDetectionConfig,
    pub http: HttpSettings,
    pub manager: ManagerSettings,
    pub console: ConsoleSettings,
    pub gateway: GatewaySettings,
    pub telemetry: TelemetrySettings,
}

/// Traces exported over OTLP/HTTP (see docs/operations.md#traces). The standard `OTEL_*`
/// variables are read over this section when a process starts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetrySettings {
    pub enabled: bool,
    pub endpoint: String,
    pub protocol: String,
    pub service_name: String,
    pub max_queue_size: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSettings {
    pub listen: String,
    pub backend_probe_ms: u64,
}

/// What a draining worker does with the requests still running (`worker.drain_handoff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainHandOff {
    /// The default: they run on until `worker.drain_timeout_ms`, then each writes a checkpoint
    /// and a live peer goes on from it.
    Deadline,
    /// Each writes a checkpoint at once and a live peer goes on from it.
    AtOnce,
    /// They run on until the deadline, then end CANCELLED (a durable one goes back to the
    /// queue and starts over).
    Off,
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSettings {
    pub url: String,
    pub name: String,
    pub token: String,
    pub user: String,
    pub password: String,
    pub nkey_seed_file: String,
    pub credentials_file: String,
    pub tls_ca_file: String,
    pub tls_cert_file: String,
    pub tls_key_file: String,
    pub tls_required: bool,
    pub connect_timeout_ms: u64,
    pub request_timeout_ms: u64,
    /// Prefix of this connection's reply subjects (`<prefix>.<random>`); a per-user prefix lets
    /// the server's permissions keep one user's replies from another.
    pub inbox_prefix: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubjectSettings {
    pub gen_prefix: String,
    pub signals_prefix: String,
    pub tools_prefix: String,
    pub decisions_prefix: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionSettings {
    pub bucket: String,
    pub ttl_ms: u64,
    pub max_chain: u32,
    pub answer_default_on_expiry: bool,
    pub sweep_ms: u64,
    pub history_bucket: String,
    pub history_ttl_ms: u64,
    pub history_max_entries: i64,
    pub history_scan_max: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EscalationSettings {
    pub threshold: f64,
    pub auto_retry_on_first_failure: bool,
    pub default_option: String,
    pub checkpoint_default_option: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JetStreamSettings {
    pub queue_stream: String,
    pub signals_stream: String,
    pub results_bucket: String,
    pub replicas: usize,
    pub results_ttl_ms: u64,
    pub signals_max_age_ms: u64,
    pub running_refresh_ms: u64,
    pub queue_duplicate_window_ms: u64,
    pub queue_ack_wait_ms: u64,
    pub queue_max_deliver: i64,
    pub finished_bucket: String,
    pub finished_ttl_ms: u64,
    pub finished_max_entries: i64,
}

/// Written by hand so secrets never reach a log line through `{:?}`.
impl std::fmt::Debug for NatsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secret = |s: &str| if s.is_empty() { "" } else { "<redacted>" };
        f.debug_struct("NatsSettings")
            .field("url", &self.url)
            .field("name", &self.name)
            .field("token", &secret(&self.token))
            .field("user", &self.user)
            .field("password", &secret(&self.password))
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("credentials_file", &self.credentials_file)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("tls_required", &self.tls_required)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .field("inbox_prefix", &self.inbox_prefix)
            .finish()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSettings {
    pub id: String,
    pub pool: String,
    pub slots: u32,
    pub drain_timeout_ms: u64,
    /// What a drain does with the requests still running: hand them off to live peers (at its
    /// deadline, or at once) or cancel them at its deadline.
    pub drain_handoff: DrainHandOff,
    /// A request of a higher band that finds no free slot takes the slot of the newest running
    /// request of a lower band, which writes a checkpoint, waits and goes on later.
    pub preempt: bool,
    /// A request of a tenant under its fair share of a worker's slots that finds none free
    /// takes the slot of the newest running request of a tenant far over its share.
    #[serde(default)]
    pub preempt_fair_share: bool,
    /// How many times one request may be preempted (then it runs to its end).
    pub max_preemptions: u32,
    pub cancel_wait_ms: u64,
    pub max_retained_results: usize,
    pub heartbeat_ms: u64,
    pub lost_after_ms: u64,
    /// Threads the worker's runtime runs on: 1 (the default) runs the actors, the bus and the
    /// backend's HTTP client on one thread, with no hand-off between threads on a request's
    /// path; more spreads the bus and the HTTP connections over that many; 0, one per core.
    pub threads: usize,
    #[serde(default)]
    pub reserved_slots: ReservedSlots,
    #[serde(default)]
    pub tenants: TenantSettings,
}

/// Slots kept free for higher priority bands (`worker.reserved_slots`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReservedSlots {
    /// Slots only `high` requests may take.
    pub high: u32,
    /// Slots only `high` and `normal` requests may take.
    pub normal: u32,
}

impl ReservedSlots {
    /// The free slots a request of `band` must leave to the bands above it.
    pub fn above(&self, band: crate::protocol::Priority) -> u32 {
        match band {
            crate::protocol::Priority::High => 0,
            crate::protocol::Priority::Normal => self.high,
            crate::protocol::Priority::Low => self.high + self.normal,
        }
    }
}

/// Where requests with an affinity key go (`placement`; docs/protocol.md#affinity).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementSettings {
    /// The bounded-load factor: a worker whose busy slots reach this times its share of the
    /// pool's busy slots (counting the new request) is passed over; 0 bounds nothing.
    pub load_factor: f64,
    /// Clients and gateways follow the workers' heartbeats and send a keyed request straight
    /// to its key's worker.
    pub follow_heartbeats: bool,
}

/// Limits per tenant (`worker.tenants`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantSettings {
    /// Running requests of one tenant on this worker at most; 0 is no limit.
    pub max_running: u32,
    /// Running requests of one tenant across the worker's pool at most; 0 is no limit. Kept
    /// exact by a compare-and-set count in bucket `GENFLEET_TENANTS` (`bus::tenant_limit`).
    pub pool_max_running: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolMode {
    Native,
    Text,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SystemMessages {
    /// `separate` until the backend's chat template refuses it, then `merged`, then
    /// `first_user`, learnt once per worker with a warning.
    Auto,
    /// The BIOS and the caller's system prompt as two system messages.
    Separate,
    /// One system message, the BIOS first (templates that take exactly one).
    Merged,
    /// No system message: the BIOS and the caller's system prompt open the first user message
    /// (templates that refuse the system role).
    FirstUser,
}

/// What a streamed answer that ends with `[DONE]` but without a finish reason counts as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DoneWithoutFinish {
    /// A broken stream: FAILED `backend_error` with the partial output.
    Fail,
    /// The default. `[DONE]` is the stream's own clean end (the official SDKs end there
    /// without an error): after content it ends the answer with finish reason `stop`
    /// (`tool_calls` after native calls). Servers leave the finish reason out when a stop
    /// string or the end-of-turn token ends the text (llama-cpp-python's server, some MLX
    /// servers). A stream cut without `[DONE]`, or a `[DONE]` with nothing before it, still
    /// fails.
    Stop,
}

/// How a backend is asked to continue a partial assistant message (`llm.continuation`): a
/// generation interrupted mid-stream is resumed on another worker from the output so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContinuationSetting {
    /// The default: the worker asks the server what it is when it first answers (llama.cpp's
    /// `/props`, Ollama's `/api/version`, vLLM's `/version`, SGLang's `/get_model_info`) and
    /// picks the matching form; a server it does not recognise cannot continue.
    Auto,
    /// `continue_final_message: true, add_generation_prompt: false` (vLLM, SGLang).
    ContinueFinalMessage,
    /// The assistant message last in `messages`, nothing added (llama.cpp's llama-server,
    /// Ollama).
    Prefill,
    /// The backend cannot continue: an interrupted turn is generated again from its start.
    None,
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmSettings {
    pub base_url: String,
    pub api_key: String,
    pub model: String,
    pub tool_mode: ToolMode,
    pub system_messages: SystemMessages,
    pub connect_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub retries: u32,
    pub retry_backoff_ms: u64,
    pub done_without_finish_reason: DoneWithoutFinish,
    pub continuation: ContinuationSetting,
}

/// Written by hand so the API key can never reach a log line through `{:?}`.
impl std::fmt::Debug for LlmSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlmSettings")
            .field("base_url", &self.base_url)
            .field(
                "api_key",
                &if self.api_key.is_empty() {
                    ""
                } else {
                    "<redacted>"
                },
            )
            .field("model", &self.model)
            .field("tool_mode", &self.tool_mode)
            .field("system_messages", &self.system_messages)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("idle_timeout_ms", &self.idle_timeout_ms)
            .field("retries", &self.retries)
            .field("retry_backoff_ms", &self.retry_backoff_ms)
            .field(
                "done_without_finish_reason",
                &self.done_without_finish_reason,
            )
            .field("continuation", &self.continuation)
            .finish()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationSettings {
    pub default_tool_iterations: u32,
    pub max_tool_iterations: u32,
    pub default_max_tokens: u32,
    pub stop_on_decision_request: bool,
    pub max_control_turns: u32,
    pub delta_coalesce_bytes: usize,
    pub delta_coalesce_ms: u64,
    /// A running request's progress is written to its record this often (and at every tool
    /// boundary), once it has run this long; 0: never (no resume on another worker).
    pub checkpoint_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSettings {
    pub correction_attempts: u32,
    pub default_timeout_ms: u64,
    pub bucket: String,
    /// Definitions in either form (three tiers, or the legacy form converted on load).
    #[serde(default)]
    pub definitions: Vec<serde_json::Value>,
    /// A directory of definition files (`*.json`, `*.toml`, one definition each); empty: none.
    #[serde(default)]
    pub definitions_dir: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSettings {
    pub max_request_bytes: usize,
    pub max_metadata_bytes: usize,
    pub max_output_bytes: usize,
    pub max_tool_result_bytes: usize,
    pub max_model_signals: u32,
    pub max_model_signal_bytes: usize,
    pub max_worker_signal_bytes: usize,
}

/// `genfleet manager`, the reference manager agent (see docs/manager.md).
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManagerSettings {
    pub name: String,
    pub rules_file: String,
    pub llm_base_url: String,
    pub llm_model: String,
    pub llm_api_key: String,
    pub llm_timeout_ms: u64,
    pub max_in_flight: usize,
    pub ack_wait_ms: u64,
}

impl ManagerSettings {
    /// Checked by the manager itself, so that a worker never refuses to start over them.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let fail = |msg: String| Err(SettingsError(msg));
        if !is_valid_name(&self.name) {
            return fail(format!(
                "manager.name {:?} must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'",
                self.name
            ));
        }
        if !self.llm_base_url.is_empty() {
            match reqwest::Url::parse(&self.llm_base_url) {
                Ok(url) if matches!(url.scheme(), "http" | "https") => {}
                _ => {
                    return fail(format!(
                        "manager.llm_base_url {:?} is not an http(s) URL",
                        self.llm_base_url
                    ));
                }
            }
        }
        if self.max_in_flight == 0 || self.max_in_flight > 10_000 {
            return fail("manager.max_in_flight must be between 1 and 10000".into());
        }
        if self.ack_wait_ms < 1000 {
            return fail("manager.ack_wait_ms must be at least 1000".into());
        }
        if self.llm_timeout_ms == 0 {
            return fail("manager.llm_timeout_ms must be at least 1".into());
        }
        Ok(())
    }

    /// The settings of the manager's model: `llm.*` with the manager's non-empty overrides.
    pub fn llm(&self, base: &LlmSettings) -> LlmSettings {
        let pick = |own: &str, fallback: &str| {
            if own.is_empty() {
                fallback.to_string()
            } else {
                own.to_string()
            }
        };
        let mut llm = base.clone();
        llm.base_url = pick(&self.llm_base_url, &base.base_url);
        llm.model = pick(&self.llm_model, &base.model);
        llm.api_key = pick(&self.llm_api_key, &base.api_key);
        llm
    }
}

/// Written by hand so the API key can never reach a log line through `{:?}`.
impl std::fmt::Debug for ManagerSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagerSettings")
            .field("name", &self.name)
            .field("rules_file", &self.rules_file)
            .field("llm_base_url", &self.llm_base_url)
            .field("llm_model", &self.llm_model)
            .field(
                "llm_api_key",
                &if self.llm_api_key.is_empty() {
                    ""
                } else {
                    "<redacted>"
                },
            )
            .field("llm_timeout_ms", &self.llm_timeout_ms)
            .field("max_in_flight", &self.max_in_flight)
            .field("ack_wait_ms", &self.ack_wait_ms)
            .finish()
    }
}

/// `genfleet console`, the web console (see docs/console.md).
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleSettings {
    pub listen: String,
    pub token: String,
    pub max_inbox: usize,
    pub max_signals: usize,
    pub max_requests: usize,
    pub max_clients: usize,
    pub fleet_refresh_ms: u64,
}

impl ConsoleSettings {
    /// Checked by the console itself, so that a worker never refuses to start over them.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let fail = |msg: String| Err(SettingsError(msg));
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return fail(format!(
                "console.listen {:?} is not an address like 127.0.0.1:8080",
                self.listen
            ));
        }
        if !self.token.is_empty() && self.token.chars().count() < 16 {
            return fail(
                "console.token must be at least 16 characters (empty: a read-only console)".into(),
            );
        }
        if self
            .token
            .chars()
            .any(|c| c.is_control() || c.is_whitespace())
        {
            return fail("console.token must not contain spaces or control characters".into());
        }
        for (key, value, max) in [
            ("console.max_inbox", self.max_inbox, 100_000),
            ("console.max_signals", self.max_signals, 100_000),
            ("console.max_requests", self.max_requests, 100_000),
            ("console.max_clients", self.max_clients, 10_000),
        ] {
            if value == 0 || value > max {
                return fail(format!("{key} must be between 1 and {max}"));
            }
        }
        if self.fleet_refresh_ms < 100 {
            return fail("console.fleet_refresh_ms must be at least 100".into());
        }
        Ok(())
    }
}

/// Written by hand so the token can never reach a log line through `{:?}`.
impl std::fmt::Debug for ConsoleSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleSettings")
            .field("listen", &self.listen)
            .field(
                "token",
                &if self.token.is_empty() {
                    ""
                } else {
                    "<redacted>"
                },
            )
            .field("max_inbox", &self.max_inbox)
            .field("max_signals", &self.max_signals)
            .field("max_requests", &self.max_requests)
            .field("max_clients", &self.max_clients)
            .field("fleet_refresh_ms", &self.fleet_refresh_ms)
            .finish()
    }
}

/// `genfleet gateway`, the OpenAI-compatible front door (see docs/gateway.md).
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewaySettings {
    pub listen: String,
    /// Serve a listen address beyond loopback with no API key configured.
    pub allow_unauthenticated: bool,
    /// Keys by their SHA-256 (hex), each with the tenant it stands for.
    pub api_keys: Vec<GatewayKey>,
    /// A file of more keys: one `<sha256-hex> <tenant>` a line, `#` comments.
    pub api_keys_file: String,
    /// Model names callers use, each to a pool and the backend model name.
    pub models: std::collections::BTreeMap<String, GatewayModel>,
    pub queue_wait_ms: u64,
    pub decision_wait_ms: u64,
    pub max_request_ms: u64,
    pub drain_ms: u64,
    pub max_body_bytes: usize,
    pub pools_refresh_ms: u64,
    /// The bucket of stored responses (`POST /v1/responses` with `store`), shared by every
    /// gateway replica.
    pub responses_bucket: String,
    /// How long a stored response is kept after its last change.
    pub responses_ttl_ms: u64,
    /// The object store bucket of uploaded and produced files (`/v1/files`).
    pub files_bucket: String,
    /// Largest file `POST /v1/files` takes.
    pub max_file_bytes: usize,
    /// How long a file is kept.
    pub files_ttl_ms: u64,
    /// The bucket of batches (`/v1/batches`); their lines' outcomes are in `<bucket>_LINES`.
    pub batches_bucket: String,
    /// How long a batch's record and its lines' outcomes are kept.
    pub batches_ttl_ms: u64,
    /// Lines of one batch in flight at once (on the queue or running).
    pub batch_window: usize,
    /// Threads the gateway runs on: 1 serves every connection and its requests on one thread;
    /// more spreads them; 0, one per core.
    pub threads: usize,
}

/// One API key of the gateway, by its hash: the key itself is never configured.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayKey {
    pub sha256: String,
    pub tenant: String,
}

/// Where a model name of the gateway goes.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayModel {
    pub pool: String,
    /// The backend's model name (`model` of the generation request); empty: the worker's own.
    #[serde(default)]
    pub model: String,
}

impl GatewayKey {
    /// Checks the hash's shape and the tenant's name; `at` names where the key was read.
    pub fn validate(&self, at: &str) -> Result<(), SettingsError> {
        if self.sha256.len() != 64 || !self.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(SettingsError(format!(
                "{at}: sha256 must be 64 hexadecimal characters (the SHA-256 of the key, e.g. \
                 printf %s \"$KEY\" | sha256sum)"
            )));
        }
        if !crate::protocol::schedule::is_valid_tenant(&self.tenant) {
            return Err(SettingsError(format!(
                "{at}: tenant {:?} must be 1-{} characters of A-Z, a-z, 0-9, '_' or '-' (it is \
                 the tenant token of the subjects the gateway submits on)",
                one_line(&self.tenant),
                crate::protocol::schedule::MAX_TENANT_LEN
            )));
        }
        Ok(())
    }
}

impl GatewaySettings {
    /// Checked by the gateway itself, so that a worker never refuses to start over them.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let fail = |msg: String| Err(SettingsError(msg));
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return fail(format!(
                "gateway.listen {:?} is not an address like 127.0.0.1:8081",
                self.listen
            ));
        }
        for (i, key) in self.api_keys.iter().enumerate() {
            key.validate(&format!("gateway.api_keys[{i}]"))?;
        }
        for (key, bucket) in [
            ("gateway.responses_bucket", &self.responses_bucket),
            ("gateway.files_bucket", &self.files_bucket),
            ("gateway.batches_bucket", &self.batches_bucket),
        ] {
            if !is_valid_name(bucket) {
                return fail(format!(
                    "{key} {bucket:?} is not a bucket name (A-Z, a-z, 0-9, '_' or '-')"
                ));
            }
        }
        for (name, model) in &self.models {
            if name.is_empty() || name.chars().any(char::is_control) {
                return fail(format!("gateway.models: {name:?} is not a model name"));
            }
            if !is_valid_name(&model.pool) {
                return fail(format!(
                    "gateway.models.{name}.pool {:?} is not a pool name",
                    model.pool
                ));
            }
        }
        for (key, value) in [
            ("gateway.pools_refresh_ms", self.pools_refresh_ms),
            ("gateway.max_body_bytes", self.max_body_bytes as u64),
            ("gateway.responses_ttl_ms", self.responses_ttl_ms),
            ("gateway.max_file_bytes", self.max_file_bytes as u64),
            ("gateway.files_ttl_ms", self.files_ttl_ms),
            ("gateway.batches_ttl_ms", self.batches_ttl_ms),
            ("gateway.batch_window", self.batch_window as u64),
        ] {
            if value == 0 {
                return fail(format!("{key} must be at least 1"));
            }
        }
        Ok(())
    }
}

/// Written by hand so that no key hash reaches a log line through `{:?}`.
impl std::fmt::Debug for GatewaySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewaySettings")
            .field("listen", &self.listen)
            .field("allow_unauthenticated", &self.allow_unauthenticated)
            .field("api_keys", &format!("<{} keys>", self.api_keys.len()))
            .field("api_keys_file", &self.api_keys_file)
            .field("models", &self.models)
            .field("queue_wait_ms", &self.queue_wait_ms)
            .field("decision_wait_ms", &self.decision_wait_ms)
            .field("max_request_ms", &self.max_request_ms)
            .field("drain_ms", &self.drain_ms)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("pools_refresh_ms", &self.pools_refresh_ms)
            .field("responses_bucket", &self.responses_bucket)
            .field("responses_ttl_ms", &self.responses_ttl_ms)
            .field("files_bucket", &self.files_bucket)
            .field("max_file_bytes", &self.max_file_bytes)
            .field("files_ttl_ms", &self.files_ttl_ms)
            .field("batches_bucket", &self.batches_bucket)
            .field("batches_ttl_ms", &self.batches_ttl_ms)
            .field("batch_window", &self.batch_window)
            .field("threads", &self.threads)
            .finish()
    }
}

/// The enumerated settings and their values (read from the enums themselves).
const ENUMERATIONS: &words::Enumerations = &[
    ("llm.tool_mode", words::values_of::<ToolMode>),
    ("llm.system_messages", words::values_of::<SystemMessages>),
    (
        "llm.done_without_finish_reason",
        words::values_of::<DoneWithoutFinish>,
    ),
    ("llm.continuation", words::values_of::<ContinuationSetting>),
    ("worker.drain_handoff", words::values_of::<DrainHandOff>),
];

/// What the checks of [`Settings::validate`] want of the whole number `key` beyond not being
/// negative, found by trying 0 there: `"a whole number of at least 1"`, or `None` when 0 is
/// fine.
fn minimum_of(merged: &serde_json::Value, key: &str) -> Option<String> {
    let (section, name) = key.split_once('.')?;
    let mut probe = merged.clone();
    *probe.get_mut(section)?.get_mut(name)? = serde_json::Value::from(0);
    let settings: Settings = serde_json::from_value(probe).ok()?;
    let rule = settings.validate().err()?.0;
    let rule = rule.strip_prefix(&format!("{key} must be "))?;
    Some(format!(
        "a whole number {}",
        rule.replace("at least", "of at least")
    ))
}

/// A configuration problem, rendered as one line that names the key.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct SettingsError(pub String);

impl Settings {
    /// Whether a worker preempts by band (`worker.preempt`): only where requests write
    /// checkpoints to go on from.
    pub fn preempts_by_band(&self) -> bool {
        self.worker.preempt && self.generation.checkpoint_ms > 0
    }

    /// Whether a worker preempts by fair share (`worker.preempt_fair_share`), likewise.
    pub fn preempts_by_share(&self) -> bool {
        self.worker.preempt_fair_share && self.generation.checkpoint_ms > 0
    }

    /// Loads the layers. `file` wins over `GENFLEET_CONFIG`.
    pub fn load(file: Option<&Path>) -> Result<Settings, SettingsError> {
        let env_file = std::env::var_os(CONFIG_ENV).map(std::path::PathBuf::from);
        let file = file.map(Path::to_path_buf).or(env_file);
        let env = config::Environment::with_prefix("GENFLEET")
            .separator("__")
            .try_parsing(true);
        Self::load_from(file.as_deref(), Some(env))
    }

    /// The built-in defaults alone (tests, tools that need no configuration).
    pub fn defaults() -> Settings {
        Self::load_from(None, None).expect("the built-in defaults are valid")
    }

    fn load_from(
        file: Option<&Path>,
        env: Option<config::Environment>,
    ) -> Result<Settings, SettingsError> {
        let mut builder = config::Config::builder().add_source(config::File::from_str(
            DEFAULT_TOML,
            config::FileFormat::Toml,
        ));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(SettingsError(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            builder = builder.add_source(config::File::from(path).required(true));
        }
        if let Some(env) = env {
            builder = builder.add_source(env);
        }
        let config = builder
            .build()
            .map_err(|e| SettingsError(one_line(&e.to_string())))?;
        // Each key against the kind of its default first, then the structs; both say what is
        // wrong in the user's words (words.rs).
        let merged: serde_json::Value = config
            .clone()
            .try_deserialize()
            .map_err(|e| SettingsError(one_line(&e.to_string())))?;
        let defaults: toml::Table =
            toml::from_str(DEFAULT_TOML).expect("the built-in defaults are TOML");
        words::check_kinds(&defaults, ENUMERATIONS, &merged).map_err(SettingsError)?;
        let settings: Settings = config.try_deserialize().map_err(|e| {
            SettingsError(words::said(&e, ENUMERATIONS, &|key| {
                minimum_of(&merged, key)
            }))
        })?;
        settings.validate()?;
        Ok(settings)
    }

    /// Checks that serde cannot express.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let fail = |msg: String| Err(SettingsError(msg));
        if self.worker.slots == 0 {
            return fail("worker.slots must be at least 1".into());
        }
        let reserved = self.worker.reserved_slots;
        if reserved.high.saturating_add(reserved.normal) >= self.worker.slots {
            return fail(format!(
                "worker.reserved_slots (high {} + normal {}) must leave at least one of the {} worker.slots to every band",
                reserved.high, reserved.normal, self.worker.slots
            ));
        }
        if !is_valid_name(&self.worker.pool) {
            return fail(format!(
                "worker.pool {:?} must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'",
                self.worker.pool
            ));
        }
        if !self.worker.id.is_empty() && !is_valid_name(&self.worker.id) {
            return fail(format!(
                "worker.id {:?} must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'",
                self.worker.id
            ));
        }
        let factor = self.placement.load_factor;
        if !(factor.is_finite() && (factor == 0.0 || factor >= 1.0)) {
            return fail(format!(
                "placement.load_factor is {factor}, but must be 0 (no bound) or at least 1"
            ));
        }
        match reqwest::Url::parse(&self.llm.base_url) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => {}
            _ => {
                return fail(format!(
                    "llm.base_url {:?} is not an http(s) URL",
                    self.llm.base_url
                ));
            }
        }
        if self.llm.model.is_empty() {
            return fail("llm.model must not be empty".into());
        }
        if self.generation.default_tool_iterations > self.generation.max_tool_iterations {
            return fail(
                "generation.default_tool_iterations is larger than generation.max_tool_iterations"
                    .into(),
            );
        }
        for (key, prefix) in [
            ("subjects.gen_prefix", &self.subjects.gen_prefix),
            ("subjects.signals_prefix", &self.subjects.signals_prefix),
            ("subjects.tools_prefix", &self.subjects.tools_prefix),
            ("subjects.decisions_prefix", &self.subjects.decisions_prefix),
            ("nats.inbox_prefix", &self.nats.inbox_prefix),
        ] {
            let tokens_ok = prefix
                .split('.')
                .all(|t| !t.is_empty() && !t.contains(['*', '>', ' ', '\t']));
            if !tokens_ok {
                return fail(format!("{key} {prefix:?} is not a valid subject prefix"));
            }
        }
        if self.jetstream.running_refresh_ms == 0
            || self.jetstream.running_refresh_ms * 2 > self.jetstream.results_ttl_ms
        {
            return fail(
                "jetstream.running_refresh_ms must be at least 1 and at most half of jetstream.results_ttl_ms"
                    .into(),
            );
        }
        if self.jetstream.queue_ack_wait_ms < 300 || self.jetstream.queue_max_deliver < 1 {
            return fail(
                "jetstream.queue_ack_wait_ms must be at least 300 and jetstream.queue_max_deliver at least 1"
                    .into(),
            );
        }
        if self.jetstream.finished_max_entries < 1 || self.jetstream.finished_ttl_ms == 0 {
            return fail(
                "jetstream.finished_max_entries and jetstream.finished_ttl_ms must be at least 1"
                    .into(),
            );
        }
        if self.worker.heartbeat_ms == 0 || self.worker.lost_after_ms < self.worker.heartbeat_ms * 2
        {
            return fail(
                "worker.lost_after_ms must be at least twice worker.heartbeat_ms (and that at least 1)"
                    .into(),
            );
        }
        for (key, threads) in [
            ("worker.threads", self.worker.threads),
            ("gateway.threads", self.gateway.threads),
        ] {
            if threads > MAX_RUNTIME_THREADS {
                return fail(format!(
                    "{key} must be at most {MAX_RUNTIME_THREADS} (0: one per core)"
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.escalation.threshold) {
            return fail("escalation.threshold must be between 0 and 1".into());
        }
        for (key, value, allowed) in [
            (
                "escalation.default_option",
                &self.escalation.default_option,
                &["", "retry", "skip", "abort"][..],
            ),
            (
                "escalation.checkpoint_default_option",
                &self.escalation.checkpoint_default_option,
                &["", "proceed", "skip", "abort"][..],
            ),
        ] {
            if !allowed.contains(&value.as_str()) {
                return fail(format!(
                    "{key} {value:?} must be one of {:?} (empty: no default)",
                    &allowed[1..]
                ));
            }
        }
        if self.decisions.sweep_ms == 0 || self.decisions.history_max_entries < 1 {
            return fail(
                "decisions.sweep_ms and decisions.history_max_entries must be at least 1".into(),
            );
        }
        if !self.http.listen.is_empty() && self.http.listen.parse::<std::net::SocketAddr>().is_err()
        {
            return fail(format!(
                "http.listen {:?} is not an address like 0.0.0.0:9090 (empty: no HTTP server)",
                self.http.listen
            ));
        }
        if !matches!(
            self.telemetry.protocol.as_str(),
            "http/protobuf" | "http/json"
        ) {
            return fail(format!(
                "telemetry.protocol {:?} must be http/protobuf or http/json",
                self.telemetry.protocol
            ));
        }
        if self.telemetry.max_queue_size == 0 {
            return fail("telemetry.max_queue_size must be at least 1".into());
        }
        if self.limits.max_tool_result_bytes < 256 {
            return fail("limits.max_tool_result_bytes must be at least 256".into());
        }
        if self.limits.max_output_bytes == 0 {
            return fail("limits.max_output_bytes must be at least 1".into());
        }
        if let Err(e) = self.loop_detection.validate() {
            return fail(format!("loop_detection: {e}"));
        }
        Ok(())
    }

    /// The worker id: configured, else `<hostname>-<ulid>`.
    pub fn worker_id(&self) -> String {
        if !self.worker.id.is_empty() {
            return self.worker.id.clone();
        }
        let host = std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| {
                h.trim()
                    .chars()
                    .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                    .take(30)
                    .collect::<String>()
            })
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "worker".into());
        format!("{host}-{}", crate::protocol::ids::new_id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words of Rust's, never of a user's.
    const RUST_WORDS: &[&str] = &[
        "enum ",
        "variant",
        "invalid type",
        "struct ",
        "i64",
        "u32",
        "u64",
        "usize",
        "f64",
        "integer `",
        "Option",
        "sequence",
        "map",
    ];

    fn load_env(vars: &[(String, String)]) -> Result<Settings, SettingsError> {
        let env = config::Environment::with_prefix("GENFLEET")
            .separator("__")
            .try_parsing(true)
            .source(Some(vars.iter().cloned().collect()));
        Settings::load_from(None, Some(env))
    }

    /// Refused, naming `key` and `allowed`, in the user's words.
    fn refused_in_words(
        given: &str,
        result: Result<Settings, SettingsError>,
        key: &str,
        allowed: &str,
    ) {
        let message = match result {
            Ok(_) => panic!("{given} was accepted"),
            Err(error) => error.to_string(),
        };
        assert!(
            message.contains(key),
            "{given}: {message:?} does not name {key}"
        );
        assert!(
            message.contains(allowed),
            "{given}: {message:?} does not say {allowed:?}"
        );
        for word in RUST_WORDS {
            assert!(
                !message.contains(word),
                "{given}: {message:?} says {word:?}"
            );
        }
    }

    /// Every setting of config/default.toml, given a wrong value in a file and in the
    /// environment, is refused with a message that names it and what it must be.
    /// Tables of the defaults whose keys are names the user chooses.
    const USER_KEYED_TABLES: &[&str] = &["gateway.models"];

    #[test]
    fn every_setting_given_a_wrong_value_is_refused_in_its_own_words() {
        let defaults: toml::Table = toml::from_str(DEFAULT_TOML).unwrap();
        // A table within a section (`[worker.reserved_slots]`) is walked as a section.
        let mut sections: Vec<(String, toml::Value)> = Vec::new();
        for (name, table) in &defaults {
            let mut flat = toml::Table::new();
            for (key, value) in table.as_table().unwrap() {
                match value {
                    // Tables keyed by the user's own names (the gateway's model names) have no
                    // fixed keys to walk.
                    toml::Value::Table(_)
                        if USER_KEYED_TABLES.contains(&format!("{name}.{key}").as_str()) => {}
                    toml::Value::Table(_) => {
                        sections.push((format!("{name}.{key}"), value.clone()))
                    }
                    _ => {
                        flat.insert(key.clone(), value.clone());
                    }
                }
            }
            sections.push((name.clone(), toml::Value::Table(flat)));
        }
        let mut walked = 0;
        for (section, table) in &sections {
            let named = if section.contains('.') {
                format!("`{section}`")
            } else {
                format!("`[{section}]`")
            };
            refused_in_words(
                &format!("{section} = 3"),
                load_toml(&format!("{section} = 3\n")),
                &named,
                "must be a table",
            );
            refused_in_words(
                &format!("[{section}] no_such_key"),
                load_toml(&format!("[{section}]\nno_such_key = 1\n")),
                &format!("`{section}.no_such_key`"),
                "is not a setting",
            );
            for (key, default) in table.as_table().unwrap() {
                walked += 1;
                let name = format!("{section}.{key}");
                let quoted = format!("`{name}`");
                let env_key = format!(
                    "GENFLEET__{}__{}",
                    section.to_uppercase().replace('.', "__"),
                    key.to_uppercase()
                );
                let enumerated = ENUMERATIONS.iter().find(|(k, _)| *k == name);
                let (wrong_in_file, wrong_in_env, allowed): (&[&str], &str, String) =
                    match (default, enumerated) {
                        (toml::Value::Integer(_), _) => (
                            &["\"many\"", "2.5", "true", "[1]"],
                            "many",
                            "a whole number".into(),
                        ),
                        (toml::Value::Float(_), _) => (
                            &["\"high\"", "true", "{ a = 1 }"],
                            "high",
                            "a number".into(),
                        ),
                        (toml::Value::Boolean(_), _) => {
                            (&["\"maybe\"", "3"], "maybe", "true or false".into())
                        }
                        (toml::Value::String(_), Some((_, values))) => {
                            (&["\"bogus\"", "3"], "bogus", words::either(&values()))
                        }
                        (toml::Value::String(_), None) => {
                            (&["{ a = 1 }", "[1]"], "", "text".into())
                        }
                        (toml::Value::Array(_), _) => (&["3", "\"x\""], "", "a list".into()),
                        (toml::Value::Table(_), _) => (&["3", "\"x\""], "", "a table".into()),
                        (other, _) => panic!("{name}: a default of an unexpected kind: {other}"),
                    };
                for wrong in wrong_in_file {
                    let given = format!("[{section}] {key} = {wrong}");
                    let result = load_toml(&format!("[{section}]\n{key} = {wrong}\n"));
                    refused_in_words(&given, result, &quoted, &allowed);
                }
                if !wrong_in_env.is_empty() {
                    let given = format!("{env_key}={wrong_in_env}");
                    let result = load_env(&[(env_key.clone(), wrong_in_env.to_string())]);
                    refused_in_words(&given, result, &quoted, &allowed);
                }
                // A negative whole number is refused in words, or allowed.
                if matches!(default, toml::Value::Integer(_))
                    && let Err(error) = load_toml(&format!("[{section}]\n{key} = -1\n"))
                {
                    refused_in_words(&format!("{name} = -1"), Err(error), &name, "");
                }
            }
        }
        assert!(walked > 80, "only {walked} settings walked");
        // The examples people meet first, word for word.
        let said = |r: Result<Settings, SettingsError>| r.err().unwrap().to_string();
        assert_eq!(
            said(load_env(&[(
                "GENFLEET__LLM__TOOL_MODE".into(),
                "bogus".into()
            )])),
            "invalid configuration: `llm.tool_mode` must be `native` or `text`, not \"bogus\""
        );
        assert!(said(load_toml("worker = 3\n")).contains("`[worker]` must be a table of settings"));
        assert_eq!(
            said(load_toml("[worker]\nslots = -3\n")),
            "invalid configuration: `worker.slots` must be a whole number of at least 1, not -3"
        );
    }

    fn load_toml(extra: &str) -> Result<Settings, SettingsError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, extra).unwrap();
        Settings::load_from(Some(&path), None)
    }

    #[test]
    fn defaults_load() {
        let s = Settings::defaults();
        assert_eq!(s.worker.pool, "default");
        assert_eq!(s.llm.tool_mode, ToolMode::Native);
        assert!(s.loop_detection.enabled);
    }

    #[test]
    fn a_file_overrides_only_what_it_names() {
        let s = load_toml("[worker]\nslots = 9\n[llm]\ntool_mode = \"text\"\n").unwrap();
        assert_eq!(s.worker.slots, 9);
        assert_eq!(s.worker.pool, "default");
        assert_eq!(s.llm.tool_mode, ToolMode::Text);
    }

    #[test]
    fn errors_name_the_key() {
        for (toml, needle) in [
            ("[worker]\nslots = \"many\"\n", "slots"),
            ("[worker]\nslots = 0\n", "worker.slots"),
            ("[llm]\nbase_urll = \"x\"\n", "base_urll"),
            ("[llm]\nbase_url = \"ftp://x\"\n", "llm.base_url"),
            ("[llm]\ntool_mode = \"telepathy\"\n", "telepathy"),
            ("[worker]\npool = \"a.b\"\n", "worker.pool"),
            ("[worker]\nthreads = 1000\n", "worker.threads"),
            ("[gateway]\nthreads = 1000\n", "gateway.threads"),
            (
                "[worker]\nslots = 2\n[worker.reserved_slots]\nhigh = 1\nnormal = 1\n",
                "worker.reserved_slots",
            ),
        ] {
            let err = load_toml(toml).unwrap_err().to_string();
            assert!(err.contains(needle), "{toml}: {err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
        let err = Settings::load_from(Some(Path::new("/nonexistent.toml")), None).unwrap_err();
        assert!(err.to_string().contains("/nonexistent.toml"));
    }

    #[test]
    fn environment_overrides() {
        let env = config::Environment::with_prefix("GENFLEET")
            .separator("__")
            .try_parsing(true)
            .source(Some(
                [
                    ("GENFLEET__WORKER__SLOTS".to_string(), "7".to_string()),
                    (
                        "GENFLEET__LLM__BASE_URL".to_string(),
                        "http://h:1/v1".to_string(),
                    ),
                    ("GENFLEET_CONFIG".to_string(), "ignored".to_string()),
                ]
                .into_iter()
                .collect(),
            ));
        let s = Settings::load_from(None, Some(env)).unwrap();
        assert_eq!(s.worker.slots, 7);
        assert_eq!(s.llm.base_url, "http://h:1/v1");
    }

    #[test]
    fn api_key_is_not_debug_printed() {
        let mut s = Settings::defaults();
        s.llm.api_key = "sk-secret".into();
        s.manager.llm_api_key = "sk-manager".into();
        s.console.token = "console-token-0123456789".into();
        let printed = format!("{s:?}");
        assert!(!printed.contains("sk-secret") && !printed.contains("sk-manager"));
        assert!(!printed.contains("console-token"));
    }

    #[test]
    fn console_settings_are_checked() {
        Settings::defaults().console.validate().unwrap();
        for (toml, needle) in [
            ("[console]\nlisten = \"localhost\"\n", "console.listen"),
            ("[console]\ntoken = \"short\"\n", "at least 16"),
            ("[console]\ntoken = \"with space 0123456789\"\n", "spaces"),
            ("[console]\nmax_inbox = 0\n", "console.max_inbox"),
            ("[console]\nmax_clients = 0\n", "console.max_clients"),
            (
                "[console]\nfleet_refresh_ms = 5\n",
                "console.fleet_refresh_ms",
            ),
        ] {
            let err = load_toml(toml).unwrap().console.validate().unwrap_err();
            assert!(err.to_string().contains(needle), "{toml}: {err}");
        }
    }

    #[test]
    fn manager_settings_are_checked_and_fall_back_to_llm() {
        let s = Settings::defaults();
        s.manager.validate().unwrap();
        let llm = s.manager.llm(&s.llm);
        assert_eq!(
            (llm.base_url, llm.model),
            (s.llm.base_url.clone(), s.llm.model.clone())
        );
        let s = load_toml("[manager]\nllm_model = \"big\"\nllm_api_key = \"k\"\n").unwrap();
        let llm = s.manager.llm(&s.llm);
        assert_eq!((llm.model.as_str(), llm.api_key.as_str()), ("big", "k"));
        for (toml, needle) in [
            ("[manager]\nname = \"a.b\"\n", "manager.name"),
            (
                "[manager]\nllm_base_url = \"ftp://x\"\n",
                "manager.llm_base_url",
            ),
            ("[manager]\nmax_in_flight = 0\n", "manager.max_in_flight"),
            ("[manager]\nack_wait_ms = 10\n", "manager.ack_wait_ms"),
        ] {
            let err = load_toml(toml)
                .unwrap()
                .manager
                .validate()
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{toml}: {err}");
        }
        assert!(
            load_toml("[manager]\nnmae = \"x\"\n")
                .unwrap_err()
                .to_string()
                .contains("nmae")
        );
    }

    #[test]
    fn continuation_is_auto_unless_set_and_a_wrong_value_names_the_key() {
        assert_eq!(
            Settings::defaults().llm.continuation,
            ContinuationSetting::Auto
        );
        for (given, wanted) in [
            ("auto", ContinuationSetting::Auto),
            (
                "continue_final_message",
                ContinuationSetting::ContinueFinalMessage,
            ),
            ("prefill", ContinuationSetting::Prefill),
            ("none", ContinuationSetting::None),
        ] {
            let s = load_toml(&format!("[llm]\ncontinuation = \"{given}\"\n")).unwrap();
            assert_eq!(s.llm.continuation, wanted, "{given}");
        }
        assert_eq!(
            load_toml("[llm]\ncontinuation = \"resume\"\n")
                .unwrap_err()
                .to_string(),
            "invalid configuration: `llm.continuation` must be `auto`, \
             `continue_final_message`, `prefill` or `none`, not \"resume\""
        );
    }
}
